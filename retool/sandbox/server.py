"""A SandboxFusion-compatible HTTP front end for the retool sandbox.

Speaks the ``POST /run_code`` dialect of SandboxFusion (https://github.com/bytedance/SandboxFusion)
so that verl, the official ``sandbox-fusion`` PyPI client and other trainers can use
the local warm-fork :class:`~retool.sandbox.Sandbox` as their code runner.

Endpoints:

- ``POST /run_code``: run one Python snippet. Request fields ``code``, ``language``
  (must be ``"python"``), ``run_timeout``, ``memory_limit_MB``, ``stdin``, ``files``
  (path -> base64 content, written into the call's fresh working directory),
  ``fetch_files`` (paths read back after the run and returned base64 in ``files``);
  ``compile_timeout`` and ``args`` are accepted and ignored (Python has no compile
  step). The code runs as ``python main.py`` runs that file (see :mod:`retool.sandbox`):
  a final bare expression is not displayed unless the request sets ``auto_print`` (a
  retool extension, sent by our client). The response is SandboxFusion's
  ``RunCodeResponse`` plus a ``retool`` object with the fields SandboxFusion has no
  place for (our status, signal, peak memory, memory baseline, observation, ...);
  clients built for SandboxFusion ignore it.
- ``POST /sessions`` (retool extension): open a stateful interpreter session; answers
  ``{"session_id": ID, "idle_timeout_s": T}``. A ``/run_code`` request with
  ``"session_id": ID`` then runs in that session's interpreter, which keeps its
  variables across the session's runs (without ``session_id`` every run is a fresh
  process). Per-run limits are unchanged; a run that times out, runs out of memory or
  output ends the interpreter, and the next run says the state was lost. Session runs
  take no ``stdin``, ``files`` or ``fetch_files`` (422). ``DELETE /sessions/ID`` closes
  it; a session unused for ``session_idle_s`` is closed by the server; at most
  ``max_sessions`` are open (one more answers 429); an unknown or closed ID answers 404.
- ``GET /v1/ping``: ``"pong"`` (as SandboxFusion).
- ``GET /metrics``: the sandbox's counters and latencies since the server started, plus
  the server's own counts of rejected requests and of abandoned ones (``server/abandoned``:
  the client disconnected before its answer; the run was cancelled).

Statuses follow the official server: a process that ran and exited (even with a
traceback, ``MemoryError`` or a kill for exceeding a limit) is ``Finished`` with its
return code (negative signal number when killed) and overall ``Failed`` when that code
is non-zero; a timeout is ``TimeLimitExceeded`` with no return code; a failure of the
sandbox itself is ``run_result.status = Error`` and overall ``SandboxError`` (the
official client raises on it). Bad requests get a 4xx JSON ``{"detail": ...}``:
400 for a body that is not JSON, 413 for one over the size limit, 422 for fields that
fail validation, for languages other than Python (as the official server answers a
language it does not know) and for limits over this server's ceilings.

Non-goals: languages other than Python, ``/run_jupyter``, the online-judge dataset
endpoints, authentication. Anyone who can reach the port can run code as the server's
user, inside the sandbox's isolation (see ``retool.sandbox`` for its threat model), so
the server binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import ipaddress
import json
import logging
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retool.sandbox import Sandbox, SandboxConfig
from retool.sandbox.executor import check_timeout, sandbox_error
from retool.types import ExecStatus, ExecutionResult

log = logging.getLogger(__name__)

SUPPORTED_LANGUAGES: tuple[str, ...] = ("python",)
"""The SandboxFusion ``language`` values this server runs."""

DEFAULT_WORKERS = 64
"""Runs executed at once by default: verl's default concurrency (64 requests in flight),
so that under its default load no request waits in the queue. Sizing rule (see
docs/sandbox-server.md): a client that sends C requests at once, each with run timeout
T, and gives up after W seconds needs ``workers >= C / floor(W / T)``; verl waits
``W = compile_timeout + run_timeout + 10`` s."""


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``retool sandbox serve`` needs; the defaults run."""

    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default: the server has no authentication."""
    port: int = 8080
    """TCP port; 0 picks a free one (the bound URL is printed and returned)."""
    sandbox: SandboxConfig | None = None
    """Executor settings (pool size, default timeout and memory limit, ...); ``None``
    means ``SandboxConfig(workers=DEFAULT_WORKERS)``."""
    max_timeout_s: float = 300.0
    """Largest ``run_timeout`` a request may ask for; more is rejected with 422. At most
    the sandbox's own bound, ``retool.sandbox.executor.MAX_TIMEOUT_S``."""
    max_memory_mb: int = 16384
    """Largest ``memory_limit_MB`` a request may ask for; more is rejected with 422."""
    max_request_mb: float = 64.0
    """Largest request body (code + base64 files); more is rejected with 413."""
    shutdown_timeout_s: float = 30.0
    """On SIGINT/SIGTERM, how long in-flight runs may take to finish before closing."""
    max_sessions: int = 64
    """Stateful sessions open at once (``POST /sessions``); one more is refused with 429.
    Each holds an interpreter process (tens of MB) until it is closed or expires."""
    session_idle_s: float = 300.0
    """A session with no run for this long is closed (its state is gone; runs get 404)."""

    def __post_init__(self) -> None:
        check_timeout(self.max_timeout_s, "max_timeout_s")
        if not self.max_memory_mb > 0 or not self.max_request_mb > 0:
            raise ValueError("max_memory_mb and max_request_mb must be > 0")
        if not self.max_sessions >= 1 or not self.session_idle_s > 0:
            raise ValueError("max_sessions must be >= 1 and session_idle_s > 0")

    def sandbox_config(self) -> SandboxConfig:
        """The executor settings, with this server's default pool size and session bound."""
        return dataclasses.replace(self.sandbox or SandboxConfig(workers=DEFAULT_WORKERS),
                                   max_sessions=self.max_sessions)


# ---------------------------------------------------------------- wire models


class RunCodeRequest(BaseModel):
    """The body of ``POST /run_code`` (SandboxFusion's request, unknown keys ignored)."""

    model_config = ConfigDict(extra="ignore")

    code: str = Field(..., description="the Python source to run")
    language: str = Field(..., description='must be "python"')
    run_timeout: float | None = Field(
        None, gt=0, description="wall-clock limit in seconds; omitted -> the server default"
    )
    memory_limit_MB: int = Field(
        -1, description="memory the program may allocate in MiB, on top of the preloaded "
        "baseline; <= 0 -> the server default"
    )
    stdin: str | None = Field(None, description="text fed to the program's stdin")
    compile_timeout: float = Field(10, description="accepted for compatibility; unused")
    files: dict[str, str | None] = Field(
        default_factory=dict,
        description="relative path -> base64 content, written before the run; null skips",
    )
    fetch_files: list[str] = Field(
        default_factory=list, description="relative paths returned base64 after the run"
    )
    args: list[str] = Field(default_factory=list, description="pytest-only; unused")
    auto_print: bool = Field(
        False,
        description="retool extension: show the value of a final bare expression, as the "
        "model's sandbox does; off by default, so output is what `python file.py` prints",
    )
    session_id: str | None = Field(
        None, description="retool extension: run in this open session's interpreter (POST /sessions)"
    )


@dataclass(frozen=True)
class RunArgs:
    """One validated request, as keyword arguments of :meth:`Sandbox.run`."""

    code: str
    timeout_s: float | None = None
    memory_mb: int | None = None
    stdin: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: tuple[str, ...] = ()
    auto_print: bool = False
    session_id: str | None = None


class RequestError(Exception):
    """A request the server refuses; carries the HTTP status and a FastAPI-style detail."""

    def __init__(self, http_status: int, detail: Any, reason: str):
        super().__init__(str(detail))
        self.http_status = http_status
        self.detail = detail
        self.reason = reason
        """Short tag counted in ``/metrics`` (``bad_json``, ``invalid``, ...)."""


def _field_error(loc: tuple[Any, ...], msg: str, kind: str) -> RequestError:
    detail = [{"loc": ["body", *loc], "msg": msg, "type": kind}]
    return RequestError(422, detail, kind)


# ---------------------------------------------------------------- request -> run


def parse_request(body: bytes) -> RunCodeRequest:
    """Decode and validate a raw ``/run_code`` body, or raise :class:`RequestError`."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}", "bad_json") from None
    if not isinstance(payload, dict):
        raise RequestError(
            422, f"request body must be a JSON object, got {type(payload).__name__}", "invalid"
        )
    try:
        return RunCodeRequest.model_validate(payload)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_context=False, include_input=False)
        detail = [{**err, "loc": ["body", *err["loc"]]} for err in errors]
        raise RequestError(422, detail, "invalid") from None


def to_run_args(request: RunCodeRequest, config: ServerConfig) -> RunArgs:
    """Check a validated request against this server's abilities and ceilings."""
    if request.language not in SUPPORTED_LANGUAGES:
        raise _field_error(
            ("language",),
            f"unsupported language {request.language!r}: this server runs only "
            f"{', '.join(map(repr, SUPPORTED_LANGUAGES))}",
            "unsupported_language",
        )
    if request.run_timeout is not None and request.run_timeout > config.max_timeout_s:
        raise _field_error(
            ("run_timeout",),
            f"run_timeout {request.run_timeout:g} s exceeds this server's ceiling of "
            f"{config.max_timeout_s:g} s",
            "limit_exceeded",
        )
    if request.memory_limit_MB > config.max_memory_mb:
        raise _field_error(
            ("memory_limit_MB",),
            f"memory_limit_MB {request.memory_limit_MB} exceeds this server's ceiling of "
            f"{config.max_memory_mb} MB",
            "limit_exceeded",
        )
    if request.session_id is not None and (request.stdin is not None or request.files or request.fetch_files):
        raise _field_error(("session_id",), "a session run takes no stdin, files or fetch_files "
                           "(its interpreter is already running)", "invalid")
    return RunArgs(
        code=request.code,
        timeout_s=request.run_timeout,
        memory_mb=request.memory_limit_MB if request.memory_limit_MB > 0 else None,
        stdin=request.stdin,
        files=decode_files(request.files),
        fetch_files=tuple(_checked_path(p, ("fetch_files", i)) for i, p in enumerate(request.fetch_files)),
        auto_print=request.auto_print,
        session_id=request.session_id,
    )


def decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
    """Base64-decode request files; ``None`` contents are skipped (as SandboxFusion does)."""
    decoded: dict[str, bytes] = {}
    for path, content in files.items():
        if content is None:
            continue
        key = _checked_path(path, ("files", path))
        try:
            decoded[key] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _field_error(("files", path), f"content is not valid base64: {e}", "bad_base64") from None
    return decoded


def _checked_path(path: str, loc: tuple[Any, ...]) -> str:
    """``path`` unchanged if it is relative to the run's working directory and cannot escape it.

    Kept as given (not normalised): SandboxFusion answers fetched files under the
    names the request used.
    """
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or ".." in parts or "\\" in path or "\x00" in path:
        raise _field_error(
            loc,
            f"path {path!r} must be relative to the run's working directory, "
            "without '..', backslashes or NUL",
            "bad_path",
        )
    return path


# ---------------------------------------------------------------- result -> response


def to_response(result: ExecutionResult, fetch_files: tuple[str, ...] = ()) -> dict[str, Any]:
    """Render an :class:`ExecutionResult` as a SandboxFusion ``RunCodeResponse`` dict."""
    overall, message = _overall_status(result)
    files = {p: base64.b64encode(result.files[p]).decode("ascii") for p in fetch_files if p in result.files}
    return {
        "status": overall,
        "message": message,
        "compile_result": None,
        "run_result": _run_result(result),
        "executor_pod_name": None,
        "files": files,
        "retool": _extension(result),
    }


def _run_result(result: ExecutionResult) -> dict[str, Any]:
    if result.status is ExecStatus.TIMEOUT:
        status, return_code = "TimeLimitExceeded", None
    elif result.status is ExecStatus.SANDBOX_ERROR:
        status, return_code = "Error", None
    else:
        status, return_code = "Finished", return_code_of(result)
    return {
        "status": status,
        "execution_time": result.wall_s,
        "cpu_time": result.cpu_s,
        "return_code": return_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }


def return_code_of(result: ExecutionResult) -> int:
    """The process's return code as SandboxFusion reports it (``-N`` when killed by signal N).

    A run that ended with neither an exit code nor a signal (the executor could not
    tell) reports 0 when it succeeded and 1 otherwise, so clients never see a
    ``Finished`` run without a return code.
    """
    if result.exit_code is not None:
        return result.exit_code
    if result.signal is not None:
        return -result.signal
    return 0 if result.ok else 1


_MESSAGES = {
    ExecStatus.OK: "",
    ExecStatus.ERROR: "",
    ExecStatus.TIMEOUT: "time limit exceeded",
    ExecStatus.MEMORY: "memory limit exceeded",
    ExecStatus.OUTPUT_LIMIT: "output limit exceeded; output truncated",
}


def _overall_status(result: ExecutionResult) -> tuple[str, str]:
    if result.status is ExecStatus.SANDBOX_ERROR:
        return "SandboxError", result.stderr or result.observation or "sandbox error"
    message = _MESSAGES[result.status]
    if result.truncated and not message:
        message = "output truncated"
    failed = result.status is not ExecStatus.OK or return_code_of(result) != 0
    return ("Failed" if failed else "Success"), message


def _extension(result: ExecutionResult) -> dict[str, Any]:
    """The ExecutionResult fields SandboxFusion's schema has no place for."""
    return {
        "status": result.status.value,
        "exit_code": result.exit_code,
        "signal": result.signal,
        "peak_rss_bytes": result.peak_rss_bytes,
        "truncated": result.truncated,
        "observation": result.observation,
        "isolation": list(result.isolation),
        "memory_baseline_bytes": result.memory_baseline_bytes,
        "state_lost": result.state_lost,
    }


# ---------------------------------------------------------------- the aiohttp app

_SANDBOX = web.AppKey("sandbox", object)
_CONFIG = web.AppKey("config", ServerConfig)
_REJECTED = web.AppKey("rejected", collections.Counter)
_ABANDONED = web.AppKey("abandoned", list)
_SESSIONS = web.AppKey("sessions", object)


@dataclass
class _OpenSession:
    session: Any  # retool.sandbox.executor.Session
    last_used: float
    running: int = 0


class SessionTable:
    """The open sessions of a server: bounded, closed when idle too long."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.open: dict[str, _OpenSession] = {}
        self.expired = 0

    def create(self, sandbox: Sandbox) -> str:
        if len(self.open) >= self.config.max_sessions:
            raise RequestError(429, f"too many open sessions (this server's limit is {self.config.max_sessions}); "
                               "close one with DELETE /sessions/ID or wait for an idle one to expire "
                               f"({self.config.session_idle_s:g} s)", "too_many_sessions")
        session_id = secrets.token_hex(12)
        self.open[session_id] = _OpenSession(sandbox.session(), time.monotonic())
        return session_id

    def get(self, session_id: str) -> _OpenSession:
        entry = self.open.get(session_id)
        if entry is None:
            raise RequestError(404, f"no open session {session_id[:40]!r}: never opened, closed, or closed after "
                               f"{self.config.session_idle_s:g} s without a run", "unknown_session")
        entry.last_used = time.monotonic()
        return entry

    async def close(self, session_id: str) -> bool:
        entry = self.open.pop(session_id, None)
        if entry is not None:
            await entry.session.aclose()
        return entry is not None

    async def expire(self) -> None:
        """Close the sessions idle for longer than ``session_idle_s`` (none while it runs)."""
        limit = time.monotonic() - self.config.session_idle_s
        for session_id in [k for k, e in self.open.items() if not e.running and e.last_used < limit]:
            self.expired += 1
            await self.close(session_id)

    async def close_all(self) -> None:
        for session_id in list(self.open):
            await self.close(session_id)


def create_app(config: ServerConfig = ServerConfig()) -> web.Application:
    """The aiohttp application; it owns a Sandbox, started on startup, closed on cleanup."""
    app = web.Application(client_max_size=int(config.max_request_mb * 2**20))
    app[_CONFIG] = config
    app[_REJECTED] = collections.Counter()
    app[_ABANDONED] = [0]
    app.cleanup_ctx.append(_sandbox_lifetime)
    app.router.add_post("/run_code", _handle_run_code)
    app.router.add_post("/sessions", _handle_open_session)
    app.router.add_delete("/sessions/{session_id}", _handle_close_session)
    app.router.add_get("/v1/ping", _handle_ping)
    app.router.add_get("/metrics", _handle_metrics)
    return app


async def _sandbox_lifetime(app: web.Application):
    """Start the sandbox before accepting connections (a broken one fails here, loudly)."""
    async with Sandbox(app[_CONFIG].sandbox_config()) as sandbox:
        isolation = await asyncio.to_thread(sandbox.start)
        log.info("sandbox ready: %d workers, isolation %s", sandbox.config.workers, ", ".join(isolation))
        app[_SANDBOX] = sandbox
        sessions = app[_SESSIONS] = SessionTable(app[_CONFIG])
        janitor = asyncio.create_task(_expire_sessions(sessions))
        try:
            yield
        finally:
            janitor.cancel()
            await sessions.close_all()
    log.info("sandbox closed")


async def _expire_sessions(sessions: SessionTable) -> None:
    period = min(sessions.config.session_idle_s / 4, 5.0)
    while True:
        await asyncio.sleep(period)
        await sessions.expire()


async def _handle_open_session(request: web.Request) -> web.Response:
    app = request.app
    try:
        session_id = app[_SESSIONS].create(app[_SANDBOX])
    except RequestError as e:
        return _reject(app, e)
    return web.json_response({"session_id": session_id, "idle_timeout_s": app[_CONFIG].session_idle_s})


async def _handle_close_session(request: web.Request) -> web.Response:
    app = request.app
    if not await app[_SESSIONS].close(request.match_info["session_id"]):
        return _reject(app, RequestError(404, "no open session with that id", "unknown_session"))
    return web.json_response({"closed": True})


async def _handle_run_code(request: web.Request) -> web.Response:
    app = request.app
    try:
        body = await request.read()
        args = to_run_args(parse_request(body), app[_CONFIG])
    except web.HTTPRequestEntityTooLarge as e:
        return _reject(app, RequestError(413, f"request body too large: {e.text}", "too_large"))
    except RequestError as e:
        return _reject(app, e)
    runner = app[_SANDBOX]
    entry = None
    if args.session_id is not None:
        try:
            entry = app[_SESSIONS].get(args.session_id)
        except RequestError as e:
            return _reject(app, e)
        runner = entry.session
        entry.running += 1
    try:
        result = await _run(runner, args)
    except asyncio.CancelledError:  # the client went away (gave up waiting): its run is cancelled too
        app[_ABANDONED][0] += 1
        raise
    except (ValueError, TypeError) as e:  # arguments the sandbox refuses
        return _reject(app, RequestError(422, f"the sandbox refused the request: {e}", "invalid"))
    finally:
        if entry is not None:
            entry.running -= 1
            entry.last_used = time.monotonic()
    return web.json_response(to_response(result, args.fetch_files))


async def _run(runner: Any, args: RunArgs) -> ExecutionResult:
    """Run one request (on the sandbox, or in a session); a failure of the sandbox
    machinery becomes a SandboxError answer.

    ``ValueError``/``TypeError`` (the sandbox's verdict on bad arguments) propagate.
    """
    extra = {} if args.session_id is not None else dict(
        stdin=args.stdin, files=args.files or None, fetch_files=args.fetch_files)
    try:
        return await runner.run(args.code, timeout_s=args.timeout_s, memory_mb=args.memory_mb,
                                auto_print=args.auto_print, **extra)
    except (ValueError, TypeError):
        raise
    except Exception as e:  # the HTTP boundary: report, never drop the connection
        log.exception("sandbox failed to run a request")
        return sandbox_error(f"{type(e).__name__}: {e}")


def _reject(app: web.Application, error: RequestError) -> web.Response:
    app[_REJECTED][error.reason] += 1
    return web.json_response({"detail": error.detail}, status=error.http_status)


async def _handle_ping(request: web.Request) -> web.Response:
    return web.json_response("pong")


async def _handle_metrics(request: web.Request) -> web.Response:
    app = request.app
    metrics: dict[str, float] = dict(app[_SANDBOX].metrics(reset=False))
    for reason, count in sorted(app[_REJECTED].items()):
        metrics[f"server/rejected_{reason}"] = float(count)
    metrics["server/rejected"] = float(sum(app[_REJECTED].values()))
    metrics["server/abandoned"] = float(app[_ABANDONED][0])
    metrics["server/sessions_open"] = float(len(app[_SESSIONS].open))
    metrics["server/sessions_expired"] = float(app[_SESSIONS].expired)
    return web.json_response(metrics)


# ---------------------------------------------------------------- running it


async def start(config: ServerConfig) -> tuple[web.AppRunner, str]:
    """Start serving on ``config.host:config.port``; returns the runner and the bound URL."""
    if not _is_loopback(config.host):
        log.warning(
            "binding %s: anyone who can reach this port can run code (no authentication)",
            config.host,
        )
    # handler_cancellation: a request whose client disconnects (e.g. gave up after its
    # deadline) is cancelled, which takes its run out of the queue or ends it, so a
    # backlog of abandoned requests does not hold the workers from the live ones.
    runner = web.AppRunner(
        create_app(config), shutdown_timeout=config.shutdown_timeout_s, access_log=None,
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    return runner, f"http://{_url_host(host)}:{port}"


async def serve(config: ServerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (default: until SIGINT/SIGTERM), then shut down.

    Shutdown stops accepting connections, lets in-flight runs finish (up to
    ``config.shutdown_timeout_s``) and closes the sandbox.
    """
    runner, url = await start(config)
    print(f"retool sandbox server listening on {url} (POST {url}/run_code)", flush=True)
    stop = stop or _stop_on_signals()
    try:
        await stop.wait()
    finally:
        print("retool sandbox server shutting down", flush=True)
        await runner.cleanup()


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


class BackgroundServer:
    """A server running on its own event loop in a daemon thread (tests, notebooks,
    a trainer that embeds its own sandbox server).

    Use as a context manager; ``url`` is the bound address::

        with BackgroundServer(ServerConfig(port=0)) as server:
            SandboxClient(server.url).run_sync("print(1)")
    """

    def __init__(self, config: ServerConfig = ServerConfig(port=0)):
        self.config = config
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> BackgroundServer:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(start(self.config), self._loop)
        try:
            self._runner, self.url = future.result()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

