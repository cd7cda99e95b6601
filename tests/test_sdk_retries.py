"""What :mod:`retool.engines.sdk_retries` counts from the Tinker HTTP client's log: the
retries of the run's own requests, not of the SDK's background traffic, and only while
the run is watched."""

from __future__ import annotations

import logging

from retool.engines.sdk_retries import (
    BACKGROUND_PATHS,
    HTTP_LOGGER,
    HTTP_RETRY_MESSAGE,
    RetryCounter,
    unwatch_tinker,
    watch_tinker,
)


def _retry_logged(path: str) -> None:
    logging.getLogger(HTTP_LOGGER).debug(HTTP_RETRY_MESSAGE, path, 0.5)


def test_only_the_runs_own_requests_are_counted_while_it_is_watched():
    counter = RetryCounter()
    assert watch_tinker(object(), counter) is False  # no SDK telemetry here: HTTP retries only
    try:
        _retry_logged("/api/v1/asample")
        _retry_logged("/api/v1/forward_backward")
        for path in BACKGROUND_PATHS:  # a leftover client's telemetry to a service that is gone, say
            _retry_logged(path)
        logging.getLogger(HTTP_LOGGER).debug("Sending HTTP Request: %s %s", "POST", "/api/v1/asample")
        assert counter.take() == 2
    finally:
        unwatch_tinker(counter)
    _retry_logged("/api/v1/asample")  # after its run ended
    assert counter.take() == 0


def test_counting_does_not_show_what_the_logger_hid(caplog):
    counter = RetryCounter()
    watch_tinker(object(), counter)
    try:
        with caplog.at_level(logging.WARNING):
            _retry_logged("/api/v1/optim_step")
        assert counter.take() == 1
        assert not [r for r in caplog.records if r.name == HTTP_LOGGER]
    finally:
        unwatch_tinker(counter)


def test_a_pytrio_session_is_closed_with_the_runs_outcome_where_the_sdk_can():
    from types import SimpleNamespace

    from retool.engines.sdk_retries import close_pytrio

    statuses = []
    client = SimpleNamespace(_runtime=SimpleNamespace(shutdown=lambda status: statuses.append(status)))
    assert close_pytrio(client, "success") and close_pytrio(client, "errored") and close_pytrio(client, "interrupted")
    assert statuses == ["ENDED", "CANCELLED", "CANCELLED"]
    assert close_pytrio(SimpleNamespace(), "success") is False  # another SDK: left to end at exit
    import inspect

    from pytrio.runtime.service import ServiceRuntime  # the real SDK's private runtime, as close_pytrio reads it

    assert "status" in inspect.signature(ServiceRuntime.shutdown).parameters
