"""A client for SandboxFusion-compatible servers (``retool sandbox serve`` or SandboxFusion itself).

:class:`SandboxClient` has the call shape of :class:`retool.sandbox.Sandbox` —
``await client.run(code, timeout_s=..., memory_mb=..., stdin=..., files=...,
fetch_files=...)`` returns a :class:`retool.types.ExecutionResult` — so a rollout can run
its code on a remote sandbox without knowing it. Against a retool server every field
comes back exactly (it sends a ``retool`` extension object); against an official
SandboxFusion server the fields SandboxFusion lacks are derived from its answer (status,
return code) or left unknown (peak memory, isolation).

Failure policy: what the code did is data (an ``ExecutionResult``, SandboxFusion's
``SandboxError`` included, as ``sandbox_error``); what the caller did wrong raises
:class:`SandboxRequestError` (a 4xx answer, e.g. an unsupported language); a server that
cannot be reached or answers 5xx is retried with exponential backoff, then raises
:class:`ServerUnavailableError`. Runs are stateless, so retrying one is safe.

Stateful sessions (a retool server's extension): :meth:`SandboxClient.session` gives a
:class:`RemoteSession` with the shape of :class:`retool.sandbox.executor.Session` — it
opens a server session at its first run (``POST /sessions``), sends every run with its
``session_id`` and closes it with ``aclose()``. Session runs are *not* retried: a run
that may have executed once must not execute twice in a state that persists.

Non-goals: ``/run_jupyter`` and the dataset endpoints; connection pooling across event
loops (use one client per event loop; ``run_sync`` opens a short-lived connection).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import aiohttp

from retool.sandbox.executor import SandboxUnavailableError
from retool.types import ExecStatus, ExecutionResult

log = logging.getLogger(__name__)


class SandboxRequestError(ValueError):
    """The server refused the request (HTTP 4xx); retrying the same request cannot help."""

    def __init__(self, http_status: int, detail: Any):
        super().__init__(f"sandbox server refused the request (HTTP {http_status}): {detail}")
        self.http_status = http_status
        self.detail = detail


class ServerUnavailableError(SandboxUnavailableError, ConnectionError):
    """The server could not be reached, or kept failing (HTTP 5xx), after all retries.

    A :class:`retool.sandbox.SandboxUnavailableError`, like a local sandbox that cannot
    start, so callers can handle both with one ``except``.
    """


class SandboxClient:
    """Runs Python snippets on a SandboxFusion-compatible HTTP server.

    ``endpoint`` is the server's base URL; a URL ending in ``/run_code`` (verl's
    ``sandbox_fusion_url``) is accepted too. ``http_timeout_s`` bounds one HTTP
    exchange, queueing on the server included. ``retries`` extra attempts are made on
    connection errors, HTTP timeouts and 5xx answers, sleeping ``backoff_s * 2**attempt`` between them.
    ``auto_print`` asks a retool server to show a final bare expression's value, as the
    local sandbox does (official SandboxFusion servers ignore it and run a plain script).
    """

    def __init__(
        self,
        endpoint: str = "http://127.0.0.1:8080",
        *,
        http_timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        auto_print: bool = True,
    ):
        self.endpoint = endpoint.rstrip("/").removesuffix("/run_code")
        self.http_timeout_s = http_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.auto_print = auto_print
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ running code

    async def run(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        stdin: str | None = None,
        files: dict[str, bytes] | None = None,
        fetch_files: tuple[str, ...] | list[str] = (),
    ) -> ExecutionResult:
        """Run one snippet; ``None`` limits mean the server's defaults."""
        payload = build_request(
            code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin, files=files,
            fetch_files=fetch_files, auto_print=self.auto_print,
        )
        answer = await self._post(self._current_session(), "/run_code", payload)
        return from_response(answer, timeout_s=timeout_s)

    def run_sync(self, code: str, **kwargs: Any) -> ExecutionResult:
        """Blocking :meth:`run` for code outside an event loop (one short-lived connection)."""

        async def once() -> ExecutionResult:
            async with _new_session(self.http_timeout_s) as session:
                payload = build_request(code, auto_print=self.auto_print, **kwargs)
                answer = await self._post(session, "/run_code", payload)
                return from_response(answer, timeout_s=kwargs.get("timeout_s"))

        return asyncio.run(once())

    def session(self) -> RemoteSession:
        """A stateful interpreter session on the server (opened at its first run)."""
        return RemoteSession(self)

    # ------------------------------------------------------------ server state

    async def ping(self) -> bool:
        """True when the server answers ``GET /v1/ping``; never raises for a dead server."""
        try:
            async with self._current_session().get(self.endpoint + "/v1/ping") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def wait_ready(self, timeout_s: float = 30.0, poll_s: float = 0.1) -> None:
        """Wait until the server answers pings; raise :class:`ServerUnavailableError` after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.ping():
            if loop.time() > deadline:
                raise ServerUnavailableError(f"no sandbox server answered at {self.endpoint} within {timeout_s:g} s")
            await asyncio.sleep(poll_s)

    async def metrics(self) -> dict[str, float]:
        """The server's ``/metrics`` (retool servers only)."""
        async with self._current_session().get(self.endpoint + "/metrics") as resp:
            if resp.status != 200:
                raise SandboxRequestError(resp.status, await resp.text())
            return await resp.json()

    # ------------------------------------------------------------ lifetime

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ HTTP

    def _current_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = _new_session(self.http_timeout_s)
        return self._session

    async def _post(self, session: aiohttp.ClientSession, path: str, payload: dict[str, Any],
                    retries: int | None = None) -> dict[str, Any]:
        url = self.endpoint + path
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                async with session.post(url, json=payload) as resp:
                    if resp.status == 200:
                        return await resp.json()
                    problem = f"HTTP {resp.status}: {await resp.text()}"
                    if resp.status < 500:
                        raise SandboxRequestError(resp.status, _detail(problem, await _json_or_none(resp)))
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                problem = f"{type(e).__name__}: {e}"
            if attempt < retries:
                log.warning("sandbox request to %s failed (%s); retrying", url, problem)
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise ServerUnavailableError(f"sandbox server at {url} failed {retries + 1} times; last: {problem}")


class RemoteSession:
    """A session of a retool sandbox server, shaped like :class:`retool.sandbox.executor.Session`."""

    def __init__(self, client: SandboxClient):
        self.client = client
        self.id: str | None = None
        self._closed = False

    async def run(self, code: str, *, timeout_s: float | None = None, memory_mb: int | None = None,
                  auto_print: bool | None = None) -> ExecutionResult:
        """Run ``code`` in the session's interpreter (opening the session first if needed)."""
        if self._closed:
            raise RuntimeError("this session is closed")
        http = self.client._current_session()
        if self.id is None:
            self.id = (await self.client._post(http, "/sessions", {}))["session_id"]
        payload = build_request(code, timeout_s=timeout_s, memory_mb=memory_mb,
                                auto_print=self.client.auto_print if auto_print is None else auto_print)
        payload["session_id"] = self.id
        for key in ("stdin", "files", "fetch_files"):
            payload.pop(key)
        answer = await self.client._post(http, "/run_code", payload, retries=0)
        return from_response(answer, timeout_s=timeout_s)

    async def aclose(self) -> None:
        """Close the server session (idempotent; a server that is gone is not an error)."""
        session_id, self.id, self._closed = self.id, None, True
        if session_id is None:
            return
        try:
            async with self.client._current_session().delete(f"{self.client.endpoint}/sessions/{session_id}"):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("could not close sandbox session %s: %s (it expires when idle)", session_id, e)

    async def __aenter__(self) -> RemoteSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _new_session(http_timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=http_timeout_s))


async def _json_or_none(resp: aiohttp.ClientResponse) -> Any:
    try:
        return await resp.json(content_type=None)
    except ValueError:
        return None


def _detail(fallback: str, body: Any) -> Any:
    return body["detail"] if isinstance(body, dict) and "detail" in body else fallback


# ---------------------------------------------------------------- wire mapping


def build_request(
    code: str,
    *,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    stdin: str | None = None,
    files: dict[str, bytes] | None = None,
    fetch_files: tuple[str, ...] | list[str] = (),
    auto_print: bool = True,
) -> dict[str, Any]:
    """The SandboxFusion ``/run_code`` body for one run (``None`` limits are omitted)."""
    payload: dict[str, Any] = {
        "code": code,
        "language": "python",
        "auto_print": auto_print,
        "stdin": stdin,
        "files": {path: base64.b64encode(data).decode("ascii") for path, data in (files or {}).items()},
        "fetch_files": list(fetch_files),
    }
    if timeout_s is not None:
        payload["run_timeout"] = timeout_s
    if memory_mb is not None:
        payload["memory_limit_MB"] = memory_mb
    return payload


def from_response(answer: dict[str, Any], *, timeout_s: float | None = None) -> ExecutionResult:
    """Turn a ``RunCodeResponse`` dict back into an :class:`ExecutionResult`.

    ``timeout_s`` (the limit that was asked for) only words the timeout observation
    when the server is an official SandboxFusion one.
    """
    run = answer.get("run_result") or {}
    files = {path: base64.b64decode(content) for path, content in (answer.get("files") or {}).items()}
    common = dict(
        stdout=run.get("stdout") or "",
        stderr=run.get("stderr") or "",
        wall_s=float(run.get("execution_time") or 0.0),
        cpu_s=float(run.get("cpu_time") or 0.0),
        files=files,
    )
    ours = answer.get("retool")
    if isinstance(ours, dict):
        return ExecutionResult(
            status=ExecStatus(ours["status"]),
            exit_code=ours.get("exit_code"),
            signal=ours.get("signal"),
            peak_rss_bytes=ours.get("peak_rss_bytes"),
            truncated=bool(ours.get("truncated")),
            observation=ours.get("observation") or "",
            isolation=tuple(ours.get("isolation") or ()),
            memory_baseline_bytes=ours.get("memory_baseline_bytes"),
            state_lost=ours.get("state_lost"),
            **common,
        )
    return _from_sandbox_fusion(answer, run, common, timeout_s)


def _from_sandbox_fusion(
    answer: dict[str, Any], run: dict[str, Any], common: dict[str, Any], timeout_s: float | None
) -> ExecutionResult:
    """Derive an ExecutionResult from an answer without the ``retool`` extension."""
    return_code = run.get("return_code")
    if answer.get("status") == "SandboxError" or run.get("status") == "Error" or not run:
        message = answer.get("message") or common["stderr"] or "sandbox error"
        return ExecutionResult(status=ExecStatus.SANDBOX_ERROR, observation=message, **{**common, "stderr": message})
    if run.get("status") == "TimeLimitExceeded":
        limit = f"{timeout_s:g} s" if timeout_s is not None else "the time limit"
        return ExecutionResult(
            status=ExecStatus.TIMEOUT, observation=f"Execution timed out after {limit}", **common
        )
    status = ExecStatus.OK if return_code == 0 else ExecStatus.ERROR
    signal = -return_code if isinstance(return_code, int) and return_code < 0 else None
    observation = common["stdout"] if status is ExecStatus.OK else (common["stdout"] + common["stderr"])
    return ExecutionResult(
        status=status,
        exit_code=return_code if signal is None else None,
        signal=signal,
        observation=observation,
        **common,
    )
