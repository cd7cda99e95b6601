"""Counting the retries the Tinker SDK makes by itself, for ``engine/retries``.

The SDK retries a failed request on its own, in three layers, and reports none of them
through its public API:

- its HTTP client (``tinker._base_client``) re-sends a request that met a connection
  error, a timeout or a 408/409/429/5xx answer, up to 10 times with backoff, and logs
  each at debug level ("Retrying request to ...");
- its request layer (``InternalClientHolder.execute_with_retries``, up to 5 minutes),
  its futures (``retrieve_future`` polling) and its sampling retry handler (configured
  by ``RetryConfig``) report every failure as a telemetry event whose data says whether
  it will be retried (``is_retryable`` / ``should_retry``).

:func:`watch_tinker` counts both: a filter on that logger (it lowers the logger's level
to debug so the records exist, counts the retry records, and lets through only what the
logger showed before) and a wrapper around the session's ``Telemetry.log``. Retrying
stays entirely the SDK's; this only counts.

**What is counted.** The retries of the run's own requests to the service: training,
sampling, futures, checkpoints, session and model creation. Not the SDK's background
traffic — its telemetry uploads, session heartbeats and dynamic-config refreshes
(:data:`BACKGROUND_PATHS`) — which runs on a timer whatever the run does. The HTTP
client's log record names only the request's path, not the client that sent it, so an
HTTP retry is counted into every counter being watched in this process (in a CLI run:
one); :func:`unwatch_tinker` stops a counter when its run ends, and the run closes its
``ServiceClient`` (``retool.engines.tinker.close_service``), which stops that client's
background loops. Before both, a run's counter also took the background retries of
clients left over from earlier runs in the same process (telemetry sent to a service
that was gone), and a fault-free run could report retries. The price: the SDK now builds its debug
records (one holds a dump of each request's options), which are dropped unread — small
next to a network round trip. Not counted: a 429 on a sample request, which the SDK
treats as the service's backpressure and waits out without a log line or an event.

Each retry is counted once; a request the SDK finally gives up on may count one more
(its last failure is reported as retryable before the time limit ends the loop).

This is the one module that reads the SDK's internals — a log message, telemetry event
fields, ``ServiceClient.holder`` — as they are in tinker :data:`TESTED_TINKER`. If they
change, :func:`watch_tinker` counts what it still finds and never fails the run; with
``TINKER_TELEMETRY=0`` only the HTTP retries are counted.
``tests/test_engine_tinker_http.py`` checks the counts against the real SDK over HTTP.
Not covered: PyTRIO, whose SDK neither logs nor reports its retries.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

TESTED_TINKER = "0.38"
HTTP_LOGGER = "tinker._base_client"
HTTP_RETRY_MESSAGE = "Retrying request to %s in %f seconds"
BACKGROUND_PATHS = ("/api/v1/telemetry", "/api/v1/session_heartbeat", "/api/v1/client/dynamic_config")
"""The SDK's own periodic requests: their retries are not the run's."""


def _is_background(url: object) -> bool:
    path = str(url).split("?", 1)[0].rstrip("/")
    return any(path.endswith(background) for background in BACKGROUND_PATHS)


class RetryCounter:
    """A thread-safe count of SDK retries since the last :meth:`take`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._count += n

    def take(self) -> int:
        with self._lock:
            count, self._count = self._count, 0
        return count


class _HTTPRetryFilter(logging.Filter):
    """Counts the HTTP client's retry records of the run's requests (not of
    :data:`BACKGROUND_PATHS`) into every watched counter; passes on only records the
    logger would have shown at its own level."""

    def __init__(self, shown_from: int) -> None:
        super().__init__()
        self.shown_from = shown_from
        self.counters: weakref.WeakSet[RetryCounter] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == HTTP_RETRY_MESSAGE and not (record.args and _is_background(record.args[0])):
            for counter in list(self.counters):
                counter.add()
        return record.levelno >= self.shown_from


_filter_lock = threading.Lock()


def _http_filter() -> _HTTPRetryFilter:
    logger = logging.getLogger(HTTP_LOGGER)
    with _filter_lock:
        for existing in logger.filters:
            if isinstance(existing, _HTTPRetryFilter):
                return existing
        added = _HTTPRetryFilter(logger.getEffectiveLevel())
        logger.addFilter(added)
        logger.setLevel(logging.DEBUG)
        return added


def watch_tinker(service_client: Any, counter: RetryCounter) -> bool:
    """Count into ``counter`` the retries of every request made through ``service_client``
    (its HTTP retries: of any client in this process, background requests excepted),
    until :func:`unwatch_tinker`. Returns whether the SDK's telemetry was there to be
    watched."""
    _http_filter().counters.add(counter)
    try:
        telemetry = service_client.holder.get_telemetry()
    except AttributeError:  # another SDK version: the HTTP retries are still counted
        return False
    if telemetry is None:
        return False
    original = telemetry.log

    def log(event_name: str, event_data: dict[str, object] | None = None, severity: str = "INFO") -> bool:
        if event_data and (event_data.get("should_retry") is True or event_data.get("is_retryable") is True):
            counter.add()
        return original(event_name, event_data, severity)

    telemetry.log = log
    return True


def unwatch_tinker(counter: RetryCounter) -> None:
    """Stop counting HTTP retries into ``counter`` (its run has ended)."""
    _http_filter().counters.discard(counter)
