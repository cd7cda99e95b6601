"""PyTRIO's HTTP API on 127.0.0.1, for tests that run the whole ``pytrio`` SDK.

:mod:`tests.fake_tinker` replaces the SDK's ``ServiceClient``, so PyTRIO's transport —
its Control client, its Actor event coordinator (ordered events, idempotent event ids,
polling), its sampling stream and its retries — never runs there. This server speaks the
endpoints a ``retool train --engine pytrio`` run uses, over real sockets, so the
unmodified SDK does all of that; the computations are :class:`FakeService`'s (PyTRIO's
inferred semantics: a call's loss summed over targets that are not ``-100`` and divided
by their count).

PyTRIO 0.2.9 talks to two services (both served here, on one port):

- **Control** (``/api/...``, JSON, the API key as ``X-API-Key`` and a bearer token): key
  verification, SDK bootstrap, a service session, training and sampling runs — each run
  answered with an Actor address and a short-lived Actor JWT;
- **Actor** (``/actor/v1/...``, the JWT): training as *events* — a MessagePack envelope
  ``POST /v1/events`` (an ``event_id`` the SDK draws once and re-sends unchanged, plus
  ``index``/``step`` sequence metadata), answered ``accepted`` and polled with
  ``GET /v1/events/{id}`` until ``succeeded`` or ``failed``; sampling as one JSON
  ``POST /v1/sampling-runs/{id}/sample``; a heartbeat.

The SDK documents the event id as the idempotency key: an Actor that already holds the
event answers ``409 event_exists`` and the SDK polls the original instead. This server
does exactly that, so an event is carried out once however often it is sent.

Faults are injected **below** the SDK, per endpoint (:meth:`PytrioHTTPFake.fail`): an
HTTP status (401, 429, 500, ...), ``"drop"`` (the connection closes without an answer),
``"delay:SECONDS"`` (a slow answer) or ``"applied-500"`` (carried out, then answered 500,
as when the answer is lost); or an outage (:meth:`PytrioHTTPFake.fail_for`: every
request answers a status for some seconds). Endpoints are named ``api-key/verify``, ``bootstrap``,
``service-sessions``, ``training-runs``, ``sampling-runs``, ``telemetry``, ``heartbeat``,
``events/get``, ``sample``, and an event submit by its type (``trainer.init_run``,
``trainer.forward_backward``, ``trainer.optimize_step``, ``trainer.save_state``,
``trainer.save_weights``).

Not served (a test needing them uses :mod:`tests.fake_tinker`): resume from a checkpoint
(``load_state``, ``by-checkpoint-uri``), checkpoint listings and downloads (export),
``forward``, custom losses, batches the SDK splits into several events, TLS, JWT expiry
and renewal.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from tests.fake_tinker import FakeService
from tests.http_fake import FakeHTTPHandler

_CONTROL_ROUTES = [  # (method, path pattern under /api/, endpoint name)
    ("GET", r"openapi/v1/api-key/verify", "api-key/verify"),
    ("GET", r"sdk/bootstrap", "bootstrap"),
    ("POST", r"telemetry/event", "telemetry"),
    ("POST", r"openapi/v1/service-sessions", "service-sessions"),
    ("POST", r"openapi/v1/service-sessions/[^/]+/(renew|close)", "service-sessions/\\1"),
    ("POST", r"openapi/v1/service-sessions/[^/]+/training-runs", "training-runs"),
    ("POST", r"openapi/v1/service-sessions/[^/]+/sampling-runs", "sampling-runs"),
    ("POST", r"openapi/v1/(training|sampling)-runs/[^/]+/renew", "\\1-runs/renew"),
]
_ACTOR_ROUTES = [  # under /actor/
    ("POST", r"v1/events", "events"),
    ("GET", r"v1/events/[^/]+", "events/get"),
    ("POST", r"v1/client/heartbeat", "heartbeat"),
    ("POST", r"v1/sampling-runs/[^/]+/sample", "sample"),
]


class PytrioHTTPFake:
    """A PyTRIO-compatible HTTP server backed by a :class:`FakeService`; a context manager."""

    def __init__(self, root: str | Path, api_key: str) -> None:
        self.service = FakeService(root, "pytrio")
        self.api_key = api_key
        self.faults: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.hits: collections.Counter = collections.Counter()
        """Requests received per endpoint (re-sent ones included)."""
        self.executed: collections.Counter = collections.Counter()
        """Requests carried out per endpoint (an event id only once)."""
        self._lock = threading.Lock()
        self._events: dict[str, dict[str, Any]] = {}
        self._runs: dict[str, dict[str, Any]] = {}
        self._samplers: dict[str, Any] = {}
        self._outages: dict[str, float] = {}
        self._jwt = f"actor-jwt-{uuid.uuid4().hex}"
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # a client that gave up on a slow answer
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> PytrioHTTPFake:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True, name="fake-pytrio-http").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(self, endpoint: str, fault: int | str, times: int = 1) -> None:
        """The next ``times`` requests to ``endpoint`` (e.g. ``"sample"``) meet ``fault``."""
        self.faults[endpoint].extend([fault] * times)

    def fail_for(self, endpoint: str, status: int, seconds: float) -> None:
        """Every request to ``endpoint`` answers ``status`` for ``seconds`` from the next one."""
        self.faults[endpoint].append(f"for:{seconds}:{status}")

    def _arrived(self, endpoint: str) -> Any:
        """Count a request to ``endpoint``; the fault it meets, if any."""
        with self._lock:
            self.hits[endpoint] += 1
            queue = self.faults[endpoint]
            fault = queue[0] if queue else None
            if not (isinstance(fault, str) and fault.startswith("for:")):
                return queue.popleft() if queue else None
            _, seconds, status = fault.split(":")
            if fault not in self._outages:
                self._outages[fault] = time.monotonic() + float(seconds)
            if time.monotonic() < self._outages[fault]:
                return int(status)
            queue.popleft()
            return queue.popleft() if queue else None

    def route(self, method: str, path: str) -> tuple[str, str]:
        """``(plane, endpoint)`` for a request path; ``plane`` is ``api`` or ``actor``."""
        plane, _, rest = path.split("?", 1)[0].lstrip("/").partition("/")
        for want, pattern, name in _CONTROL_ROUTES if plane == "api" else _ACTOR_ROUTES:
            match = re.fullmatch(pattern, rest)
            if want == method and match:
                return plane, match.expand(name)
        raise _HTTPError(404, "not_found", f"fake PyTRIO server: no endpoint {method} {path}")

    # ------------------------------------------------------------ Control

    def control(self, endpoint: str, body: dict[str, Any]) -> Any:
        now = datetime.now(timezone.utc).isoformat()
        if endpoint == "api-key/verify":
            return {"api_key_tid": "key-1", "api_key_name": None, "user_cuid": "user-1", "username": "fake",
                    "display_name": None, "workspace_cuid": "ws-1", "workspace_name": "fake",
                    "workspace_type": "personal", "expires_at": None}
        if endpoint == "bootstrap":
            return {"compatibility": {"status": "compatible", "sdk_version": "0"}, "notices": []}
        if endpoint in ("telemetry", "service-sessions/close"):
            return {}
        if endpoint in ("service-sessions", "service-sessions/renew"):
            return {"service_session_cuid": "session-1", "workspace_cuid": "ws-1", "status": "ACTIVE",
                    "created_at": now, "updated_at": now}
        if endpoint in ("training-runs", "sampling-runs"):
            return self._create_run(endpoint, body, now)
        raise _HTTPError(404, "not_found", f"fake PyTRIO server: {endpoint} is not served")

    def _create_run(self, endpoint: str, body: dict[str, Any], now: str) -> dict[str, Any]:
        kind = endpoint.removesuffix("-runs")
        base_model, source = body.get("base_model") or "", body.get("source_checkpoint_uri") or ""
        if not source and not Path(base_model).is_dir():
            raise _HTTPError(404, "model_not_found", f"unknown base model {base_model}")
        cuid = f"{kind}-{uuid.uuid4().hex[:8]}"
        if kind == "training":
            self._runs[cuid] = {"base_model": base_model, "lock": threading.Lock()}
        else:
            with self._lock:
                self._samplers[cuid] = self.service.sampler(source or None, base_model or None)
        limits = {"max_batch_size": None, "max_tokens_per_request": None, "max_seq_len": None}
        return {f"{kind}_run_cuid": cuid, "service_session_cuid": "session-1", "workspace_cuid": "ws-1",
                "status": "READY", "run_index": 1, "model_spec_cuid": "spec-1", "model_alias": base_model,
                "model_id": base_model, ("trainer" if kind == "training" else "sampler"): limits,
                "actor": {"actor_cuid": "actor-1", "endpoint": f"{self.url}/actor", "connect_mode": "direct",
                          "tls_enabled": False},
                "actor_jwt": {"token": self._jwt, "expires_at": (datetime.now(timezone.utc)
                                                                 + timedelta(hours=1)).isoformat()},
                "created_at": now}

    # ------------------------------------------------------------ Actor: events

    def submit(self, envelope: dict[str, Any], fault: Any) -> dict[str, Any]:
        """Carry out an event once per event id; a re-sent id is answered 409 event_exists."""
        event_id, kind = envelope["event_id"], envelope["type"]
        run = self._runs[envelope["metadata"]["run_id"]]
        with run["lock"]:
            if event_id in self._events:
                raise _HTTPError(409, "event_exists", f"event {event_id} exists")
            try:
                result = {"status": "succeeded", "result": self._execute(run, kind, envelope["payload"]),
                          "usage": {"input_tokens": 0, "output_tokens": 0}}
            except Exception as err:  # the fake service's refusal: the event fails, as on the Actor
                result = {"status": "failed", "error": {"code": type(err).__name__, "message": str(err)},
                          "usage": {"input_tokens": 0, "output_tokens": 0}}
            with self._lock:
                self.executed[kind] += 1
            self._events[event_id] = {"version": 1, "event_id": event_id, "type": kind, **result}
        if fault == "applied-500":
            raise _HTTPError(500, "internal", "fake HTTP 500 after the event was carried out")
        return {"version": 1, "event_id": event_id, "type": kind, "status": "accepted"}

    def get_event(self, event_id: str) -> dict[str, Any]:
        if event_id not in self._events:
            raise _HTTPError(404, "event_not_found", f"no event {event_id}")
        return self._events[event_id]

    def _execute(self, run: dict[str, Any], kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        import pytrio

        if kind == "trainer.init_run":
            if payload.get("checkpoint_uri"):
                raise NotImplementedError("fake PyTRIO server: resume is not served")
            lora = payload["lora_config"]
            run["trainer"] = self.service.lora_trainer(payload["base_model"], lora["rank"], lora.get("seed"),
                                                       lora["train_unembed"])
            return {}
        trainer = run["trainer"]
        if kind == "trainer.forward_backward":
            return self._forward_backward(trainer, payload)
        if kind == "trainer.optimize_step":
            params = pytrio.types.AdamParams(**payload["adam_params"])
            return trainer.optim_step(params).model_dump(mode="json")
        if kind in ("trainer.save_state", "trainer.save_weights"):
            saved = trainer.save("weights" if kind == "trainer.save_state" else "sampler_weights", payload["name"])
            return {"checkpoint": {"uri": saved.path, "model_id": saved.model, "size_bytes": saved.size}}
        raise NotImplementedError(f"fake PyTRIO server: {kind} is not served")

    def _forward_backward(self, trainer: Any, payload: dict[str, Any]) -> dict[str, Any]:
        import pytrio

        totals = payload["gradient_accumulation"]
        if totals["total_samples"] != len(payload["data"]) or payload.get("auto_shift"):
            raise NotImplementedError("fake PyTRIO server: split batches and auto_shift are not served")
        data = []
        for datum in payload["data"]:
            tokens = [t for chunk in datum["model_input"]["chunks"] for t in chunk["tokens"]]
            inputs = {"target_tokens": np.asarray(datum["target_ids"], dtype=np.int64)}
            for name in ("weights", "logprobs", "advantages"):
                if datum.get(name) is not None:
                    inputs[name] = np.asarray(datum[name], dtype=np.float32)
            data.append(pytrio.types.Datum(model_input=pytrio.types.ModelInput.from_ints(tokens),
                                           loss_fn_inputs={k: pytrio.types.TensorData.from_numpy(v)
                                                           for k, v in inputs.items()}))
        output = trainer.forward_backward(data, payload["loss"]["type"], payload["loss"].get("config"))
        if int(output.metrics["token_count"]) != totals["total_active_tokens"]:
            raise ValueError(f"fake PyTRIO server: {output.metrics['token_count']} active targets, "
                             f"the SDK counted {totals['total_active_tokens']}")
        outputs = [{name: _wire_tensor(tensor.to_numpy()) for name, tensor in o.items()}
                   for o in output.loss_fn_outputs]
        metrics = {"loss_sum": float(output.metrics["loss_sum"]), "loss_mean": float(output.metrics["loss_mean"]),
                   "token_count": int(output.metrics["token_count"])}
        return {"loss_fn_outputs": outputs, "metrics": metrics}

    # ------------------------------------------------------------ Actor: sampling

    def sample(self, sampling_run: str, body: dict[str, Any]) -> dict[str, Any]:
        import pytrio

        params = dict(body["sampling_params"])
        if "stop_token_ids" in params:
            params["stop"] = params.pop("stop_token_ids")
        prompt = pytrio.types.ModelInput.from_ints(
            [t for chunk in body["prompt"]["chunks"] for t in chunk["tokens"]])
        response = self._samplers[sampling_run].submit(
            prompt, int(body.get("num_samples", 1)), pytrio.types.SamplingParams(**params)).result()
        with self._lock:
            self.executed["sample"] += 1
        return {"request_id": body["request_id"], "sampling_run": sampling_run,
                "sequences": [{"tokens": list(s.tokens), "logprobs": list(s.logprobs), "stop_reason": s.stop_reason}
                              for s in response.sequences],
                "usage": {"input_tokens": response.input_tokens, "output_tokens": response.output_tokens}}


def _wire_tensor(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array, dtype="<f4")
    return {"dtype": "<f4", "shape": list(array.shape), "encoding": "raw_le", "data": array.tobytes()}


class _HTTPError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _handler(fake: PytrioHTTPFake) -> type:
    class Handler(FakeHTTPHandler):
        def serve(self, method: str, raw: bytes) -> None:
            import msgpack

            msgpack_body = "msgpack" in self.headers.get("content-type", "")
            try:
                plane, endpoint = fake.route(method, self.path)
                body = msgpack.unpackb(raw, raw=False) if msgpack_body else json.loads(raw or b"{}")
                if endpoint == "events":
                    endpoint = body["type"]
            except _HTTPError as err:
                return self._error(err)
            fault = fake._arrived(endpoint)
            if isinstance(fault, str) and fault.startswith("delay:"):
                time.sleep(float(fault.split(":", 1)[1]))
            if fault == "drop":
                return self.drop_connection()
            if isinstance(fault, int):
                return self._error(_HTTPError(fault, "fake_fault", f"fake HTTP {fault}"))
            try:
                self._check_credentials(plane)
                if plane == "api":
                    return self._send(200, fake.control(endpoint, body))
                if endpoint == "heartbeat":
                    return self._send(200, {"heartbeat_ms": 30000})
                if endpoint == "sample":
                    return self._send(200, fake.sample(self.path.split("/")[-2], body))
                if endpoint == "events/get":
                    return self._send(200, fake.get_event(self.path.split("?")[0].rsplit("/", 1)[1]), msgpack_out=True)
                return self._send(200, fake.submit(body, fault), msgpack_out=True)
            except _HTTPError as err:
                return self._error(err)

        def _check_credentials(self, plane: str) -> None:
            if plane == "api" and self.path.startswith("/api/telemetry"):
                return
            want = fake.api_key if plane == "api" else fake._jwt
            if self.headers.get("authorization") != f"Bearer {want}":
                raise _HTTPError(401, "unauthorized", "invalid credentials")

        def _error(self, err: _HTTPError) -> None:
            self._send(err.status, {"code": err.code, "message": err.message})

        def _send(self, status: int, payload: Any, msgpack_out: bool = False) -> None:
            import msgpack

            data = msgpack.packb(payload, use_bin_type=True) if msgpack_out else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/msgpack" if msgpack_out else "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
