"""Counting the retries the services' SDKs make by themselves, for ``engine/retries``.

**Tinker** retries a failed request on its own, in three layers, and reports none of
them through its public API:

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

**PyTRIO** (0.2.9) retries in its own transport (``httpx``), in three places, and neither
logs nor reports a retry (its telemetry records only each request's final outcome):

- ``pytrio.transport.retry.request_with_retries`` (a fixed number of attempts,
  ``retry_max_attempts``: the Actor heartbeat) and ``request_with_retry_timeout`` (every
  Control request, every Actor event submit and event poll: re-sent until
  ``control_``/``training_retry_timeout_seconds`` have passed since the first failure)
  re-send after a connection error, a timeout or a 408/429/500/502/503/504 answer; each
  retry is preceded by one call of the module's ``_sleep`` / ``_sleep_before_retry_deadline``
  (the latter returns whether time is left for the retry);
- the sampling stream (``BaseActorHTTPClient._stream_with_actor_jwt``) has its own loop
  (``sampling_retry_timeout_seconds``) that waits with ``asyncio.sleep`` before each
  re-send — the only ``asyncio.sleep`` in ``pytrio.transport.actor.http_base``.

:func:`watch_pytrio` counts those waits: it wraps the two module functions and gives
``http_base`` an ``asyncio`` whose ``sleep`` counts (everything else is the real module).
Each ``ServiceClient`` runs its transport on its own event loop, so a retry is counted
for the client whose loop makes it (an earlier client still closing its session counts
nowhere). Retrying stays the SDK's; the wrappers only count, then call the original.
Not counted: the wait for Actor capacity (a 429 ``actor_capacity_exceeded`` when a run is created,
logged by the SDK at info level), and the re-send after a 401 that renews the Actor JWT.
A heartbeat's retries are counted too (they are retries of this run's service).

Safety of retries: a PyTRIO training call is an *event* whose id the SDK draws once and
re-sends unchanged, with ``index``/``step`` sequence metadata; the SDK documents the id
as the idempotency key (an Actor that already holds it answers ``409 event_exists`` and
the SDK polls the original). So an ``optim_step`` whose answer was lost is re-sent by the
SDK but applied once — if the service honours its protocol; retool cannot check that.
An event submit the SDK finally gives up on leaves its training client "broken" (every
later call fails); retool never retries a training call, so the run stops there and
resumes from its last checkpoint.

This is the one module that reads the SDKs' internals — a log message, telemetry event
fields, ``ServiceClient.holder`` (tinker :data:`TESTED_TINKER`); three private module
attributes, ``ServiceClient._runtime.event_loop`` and, to end a run's session
(:func:`close_pytrio`: 0.2.9 has no public close), ``ServiceClient._runtime.shutdown``
(pytrio :data:`TESTED_PYTRIO`). If they change, the watchers count what they still find
and never fail the run, and a session left open ends when the process exits; with
``TINKER_TELEMETRY=0`` only Tinker's HTTP retries are counted.
``tests/test_engine_tinker_http.py`` and ``tests/test_engine_pytrio_http.py`` check the
counts against the real SDKs over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

TESTED_TINKER = "0.38"
TESTED_PYTRIO = "0.2.9"
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


class _CountingAsyncio:
    """``asyncio`` for ``pytrio.transport.actor.http_base``, whose one ``sleep`` is the
    wait before a sampling stream re-send: it counts, then sleeps."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float, result: Any = None) -> Any:
        _add_pytrio()
        return await asyncio.sleep(delay, result)


_pytrio_loops: weakref.WeakKeyDictionary[Any, RetryCounter] = weakref.WeakKeyDictionary()
"""Each watched ``ServiceClient``'s event loop (its own thread) -> its run's counter."""
_pytrio_starting: weakref.WeakSet[RetryCounter] = weakref.WeakSet()
"""Counters of ``ServiceClient``s being constructed (their loop is not known yet)."""
_pytrio_watched = False


def _add_pytrio() -> None:
    """Count one retry for the client whose event loop is running it."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    counter = _pytrio_loops.get(loop)
    for target in [counter] if counter is not None else list(_pytrio_starting):
        target.add()


def _watch_pytrio_once() -> bool:
    """Wrap PyTRIO's retry waits (once per process); whether all three were found."""
    global _pytrio_watched
    if _pytrio_watched:
        return True
    # optional SDK: only a pytrio run has it
    from pytrio.transport import retry
    from pytrio.transport.actor import http_base

    found = 0
    if callable(getattr(retry, "_sleep", None)):
        sleep = retry._sleep

        async def counted_sleep(delay: float, jitter: float) -> None:
            _add_pytrio()
            await sleep(delay, jitter)

        retry._sleep = counted_sleep
        found += 1
    if callable(getattr(retry, "_sleep_before_retry_deadline", None)):
        before_deadline = retry._sleep_before_retry_deadline

        async def counted_before_deadline(delay: float, jitter: float, deadline: float) -> bool:
            retrying = await before_deadline(delay, jitter, deadline)
            if retrying:
                _add_pytrio()
            return retrying

        retry._sleep_before_retry_deadline = counted_before_deadline
        found += 1
    if getattr(http_base, "asyncio", None) is asyncio:
        http_base.asyncio = _CountingAsyncio()
        found += 1
    _pytrio_watched = True
    return found == 3


def watch_pytrio(counter: RetryCounter, create_service: Callable[[], Any]) -> Any:
    """``create_service()`` (a ``pytrio.ServiceClient``), with every retry its SDK makes
    for that client counted into ``counter``: while it is constructed (key check,
    session), retries on any loop not yet bound to a client; after, those on its own
    event loop — so a client of an earlier run, still closing, never counts here."""
    with _filter_lock:
        _watch_pytrio_once()
        _pytrio_starting.add(counter)
    try:
        service = create_service()
    finally:
        with _filter_lock:
            _pytrio_starting.discard(counter)
    runner = getattr(getattr(service, "_runtime", None), "event_loop", None)
    loop = getattr(runner, "loop", None)  # another SDK version: only construction was counted
    if loop is not None:
        _pytrio_loops[loop] = counter
    return service


def unwatch_tinker(counter: RetryCounter) -> None:
    """Stop counting HTTP retries into ``counter`` (its run has ended)."""
    _http_filter().counters.discard(counter)


PYTRIO_CLOSE_STATUS = {"success": "ENDED", "errored": "CANCELLED", "interrupted": "CANCELLED"}
"""Our run outcome as PyTRIO's service-session close status (``ENDED`` / ``CANCELLED``)."""


def close_pytrio(service_client: Any, status: str = "success") -> bool:
    """End a PyTRIO ``ServiceClient``'s service session now, with the run's outcome.

    PyTRIO 0.2.9 has no public ``close``: its ``ServiceRuntime`` (``_runtime``) closes
    the session (``POST .../service-sessions/<id>/close``), stops the heartbeats and
    releases the transport in ``shutdown(status)``; without this, that happens only
    when the client is garbage-collected or the process exits (a ``weakref.finalize``),
    always as ``ENDED``. Returns whether it was closed here: ``False`` on an SDK
    without that method (the session then ends as before, at exit)."""
    shutdown = getattr(getattr(service_client, "_runtime", None), "shutdown", None)
    if shutdown is None:
        return False
    shutdown(status=PYTRIO_CLOSE_STATUS.get(status, "CANCELLED"))
    return True
