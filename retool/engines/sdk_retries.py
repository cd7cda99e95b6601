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
stays entirely the SDK's; this only counts. The price: the SDK now builds its debug
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
    """Counts the HTTP client's retry records into every live counter; passes on only
    records the logger would have shown at its own level."""

    def __init__(self, shown_from: int) -> None:
        super().__init__()
        self.shown_from = shown_from
        self.counters: weakref.WeakSet[RetryCounter] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == HTTP_RETRY_MESSAGE:
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
    (its HTTP retries: of any client in this process). Returns whether the SDK's
    telemetry was there to be watched."""
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
