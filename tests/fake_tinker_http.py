"""Tinker's HTTP API on 127.0.0.1, for tests that run the whole ``tinker`` SDK.

:mod:`tests.fake_tinker` replaces the SDK's ``ServiceClient``, so the SDK's own machinery
— its HTTP client, request ordering by sequence id, futures polled with
``retrieve_future``, and its retries — never runs there. This server speaks the
endpoints a ``retool train --engine tinker`` run uses, over real sockets, so the
unmodified SDK does all of that; the computations are :class:`FakeService`'s (the same
documented losses, Adam and sampler).

Faults are injected **below** the SDK, per endpoint (:meth:`TinkerHTTPFake.fail`): an
HTTP status (401, 408, 429, 500), ``"drop"`` (the connection closes without an answer:
the SDK sees a connection error), ``"delay:SECONDS"`` (a slow answer) or
``"applied-500"`` (the request is carried out, then answered 500, as when a response is
lost: the SDK re-sends it with the same sequence id, and this server carries out each
sequence id of a model once — what the SDK's sequence ids are for; how the real service
treats a re-sent id is not documented).

Endpoints: client config, session (create, heartbeat, finish: kept in
:attr:`TinkerHTTPFake.finished`), telemetry (kept in
:attr:`TinkerHTTPFake.telemetry`), create_model, get_info, forward_backward, optim_step,
save_weights, save_weights_for_sampler, create_sampling_session, samplers/{id}, asample,
retrieve_future. Not served (a test needing them uses :mod:`tests.fake_tinker`):
load_weights (resume), weights download (export), REST listings, custom losses.
"""

from __future__ import annotations

import collections
import json
import threading
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.fake_tinker import FakeService
from tests.http_fake import FakeHTTPHandler


class TinkerHTTPFake:
    """A Tinker-compatible HTTP server backed by a :class:`FakeService`; a context manager."""

    def __init__(self, root: str | Path) -> None:
        self.service = FakeService(root, "tinker")
        self.faults: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.hits: collections.Counter = collections.Counter()
        """Requests received per endpoint (re-sent ones included)."""
        self.executed: collections.Counter = collections.Counter()
        """Requests carried out per endpoint (a re-sent sequence id only once)."""
        self.telemetry: list[dict[str, Any]] = []
        self.finished: list[tuple[str, str]] = []
        """Sessions the SDK finished (``ServiceClient.close``): (session id, status)."""
        self._lock = threading.Lock()
        self._results: dict[str, Any] = {}
        self._done_seq: dict[tuple[str, int], str] = {}
        self._trainers: dict[str, Any] = {}
        self._samplers: dict[str, tuple[Any, str, str | None]] = {}
        self._model_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self.closing = threading.Event()
        """Set when the server shuts down: a delayed answer still pending is dropped."""
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> TinkerHTTPFake:
        threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-tinker-http").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def fail(self, endpoint: str, fault: int | str, times: int = 1) -> None:
        """The next ``times`` requests to ``endpoint`` (e.g. ``"asample"``) meet ``fault``."""
        self.faults[endpoint].extend([fault] * times)

    # ------------------------------------------------------------ endpoints

    def answer(self, endpoint: str, body: dict[str, Any]) -> Any:
        """The JSON answer to one request (raises :class:`_HTTPError` for an error status)."""
        from tinker import types

        if endpoint == "client/config":  # plain httpx, whole forward_backward calls, no session poller
            return types.ClientConfigResponse(use_pyqwest_transport=False, parallel_fwdbwd_chunks=False,
                                              sample_use_retrieve_futures=False).model_dump(mode="json")
        if endpoint == "client/dynamic_config":
            return types.ClientDynamicConfigResponse().model_dump(mode="json")
        if endpoint == "create_session":
            return {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:8]}"}
        if endpoint == "session_heartbeat":
            return {"type": "session_heartbeat"}
        if endpoint.startswith("sessions/") and endpoint.endswith("/finish"):
            self.finished.append((endpoint.split("/")[1], (body.get("reason") or {}).get("type", "")))
            return None
        if endpoint == "telemetry":
            for event in body.get("events", []):
                self.telemetry.append(event.get("event_data") or {})
            return {"status": "accepted"}
        if endpoint == "retrieve_future":
            with self._lock:
                result = self._results.get(body["request_id"])
            if result is None:
                raise _HTTPError(404, f"no future {body['request_id']}")
            return result
        if endpoint.startswith("samplers/"):
            sampler, base_model, model_path = self._samplers[endpoint.split("/", 1)[1]]
            return {"sampler_id": endpoint.split("/", 1)[1], "base_model": base_model, "model_path": model_path}
        if endpoint == "create_sampling_session":
            return self._create_sampling_session(body)
        if endpoint == "get_info":
            trainer = self._trainers[body["model_id"]]
            return types.GetInfoResponse(model_id=body["model_id"], is_lora=True,
                                         model_data=types.ModelData(model_name=trainer.model)).model_dump(mode="json")
        if endpoint == "forward_backward":  # sent as protobuf
            body = _forward_backward_from_proto(body["_raw"])
        handlers = {"create_model": self._create_model, "forward_backward": self._forward_backward,
                    "optim_step": self._optim_step, "save_weights": self._save_weights,
                    "save_weights_for_sampler": self._save_weights_for_sampler, "asample": self._sample}
        if endpoint not in handlers:
            raise _HTTPError(404, f"fake Tinker server: no endpoint {endpoint}")
        return self._future(endpoint, body, handlers[endpoint])

    def _future(self, endpoint: str, body: dict[str, Any], compute: Any) -> dict[str, Any]:
        """Carry out a request (a model's sequence id once) and answer with its future."""
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        key = (str(model_id), int(seq_id)) if model_id is not None and seq_id is not None else None
        with self._model_locks[str(model_id)]:
            if key is not None and key in self._done_seq:
                return {"request_id": self._done_seq[key], "model_id": model_id}
            request_id = f"{endpoint}-{uuid.uuid4().hex[:12]}"
            result = compute(body)
            self.executed[endpoint] += 1
            with self._lock:
                self._results[request_id] = result
                if key is not None:
                    self._done_seq[key] = request_id
        created = result.get("model_id") if isinstance(result, dict) else None
        future = {"request_id": request_id, "model_id": created or model_id}
        if endpoint == "asample":
            future["sample_sequence_ids"] = [uuid.uuid4().hex for _ in range(int(body.get("num_samples", 1)))]
        return future

    def _create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        from tinker import types

        request = types.CreateModelRequest.model_validate(body)
        if not Path(request.base_model).is_dir():
            raise _HTTPError(400, f"unknown base model {request.base_model}")
        lora = request.lora_config
        trainer = self.service.lora_trainer(request.base_model, lora.rank, lora.seed, lora.train_unembed)
        model_id = f"model-{uuid.uuid4().hex[:8]}"
        self._trainers[model_id] = trainer
        return {"model_id": model_id, "type": "create_model"}

    def _forward_backward(self, body: dict[str, Any]) -> dict[str, Any]:
        data, loss_fn, config = body["request"]
        return _forward_backward_proto(self._trainers[body["model_id"]].forward_backward(data, loss_fn, config))

    def _optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        from tinker import types

        request = types.OptimStepRequest.model_validate(body)
        return self._trainers[request.model_id].optim_step(request.optim_params).model_dump(mode="json")

    def _save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._trainers[body["model_id"]].save("weights", body["path"]).model_dump(mode="json")

    def _save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        trainer = self._trainers[body["model_id"]]
        if not body.get("path"):  # ephemeral (save_weights_and_get_sampling_client): a session, no checkpoint
            if body.get("sampling_session_seq_id") is None:
                raise _HTTPError(400, "fake Tinker server: save_weights_for_sampler needs a name or a "
                                      "sampling_session_seq_id")
            session_id = f"sampler-{uuid.uuid4().hex[:8]}"
            self._samplers[session_id] = (trainer.ephemeral_sampler(), trainer.model, None)
            return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}
        saved = trainer.save("sampler_weights", body["path"])
        return {"path": saved.path, "type": "save_weights_for_sampler"}

    def _create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        from retool.engines.base import EngineCheckpoint

        sampler = self.service.sampler(body.get("model_path"), body.get("base_model"))
        session_id = f"sampler-{uuid.uuid4().hex[:8]}"
        base_model = body.get("base_model") or EngineCheckpoint.read(self.service.folder(body["model_path"])).model
        self._samplers[session_id] = (sampler, base_model, body.get("model_path"))
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    def _sample(self, body: dict[str, Any]) -> dict[str, Any]:
        from tinker import types

        request = types.SampleRequest.model_validate(body)
        sampler = self._samplers[request.sampling_session_id][0]
        return _sample_proto(sampler.submit(request.prompt, request.num_samples, request.sampling_params).result())


def _forward_backward_from_proto(raw: bytes) -> dict[str, Any]:
    """A ``/forward_backward`` body (the SDK's protobuf) as the request's fields."""
    import numpy as np
    from tinker import types
    from tinker.proto import tinker_public_pb2 as public_pb
    from tinker.proto.response_conv import _tensor_data_from_proto

    msg = public_pb.ForwardBackwardRequest()
    msg.ParseFromString(raw)
    data = [types.Datum(model_input=types.ModelInput.from_ints(
                            [int(t) for c in d.model_input for t in np.frombuffer(c.encoded_text.tokens, np.int32)]),
                        loss_fn_inputs={k: _tensor_data_from_proto(v) for k, v in d.loss_fn_inputs.items()})
            for d in msg.data]
    return {"model_id": msg.model_id, "seq_id": msg.seq_id,
            "request": (data, msg.loss_fn, dict(msg.loss_fn_config) or None)}


def _forward_backward_proto(output: Any) -> bytes:
    """A ``ForwardBackwardOutput`` as the protobuf the SDK asks for (one batched record)."""
    import numpy as np
    from tinker.proto import tinker_public_pb2 as public_pb

    msg = public_pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    msg.metrics.update({k: float(v) for k, v in output.metrics.items()})
    record = msg.loss_fn_outputs.add(num_datums=len(output.loss_fn_outputs))
    arrays = [np.asarray(o["logprobs"].tolist(), dtype=np.float32) for o in output.loss_fn_outputs]
    field = record.fields["logprobs"]
    field.dtype = public_pb.DTYPE_FLOAT32
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    return msg.SerializeToString()


def _sample_proto(response: Any) -> bytes:
    """A ``SampleResponse`` as the protobuf the SDK asks for."""
    import numpy as np
    from tinker.proto import tinker_public_pb2 as public_pb

    msg = public_pb.SampleResponse()
    for seq in response.sequences:
        msg.sequences.add(
            stop_reason=public_pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else public_pb.STOP_REASON_STOP,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes())
    return msg.SerializeToString()


class _HTTPError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def _handler(fake: TinkerHTTPFake) -> type:
    class Handler(FakeHTTPHandler):
        def serve(self, method: str, raw: bytes) -> None:
            if method == "GET" or "json" in self.headers.get("content-type", ""):
                body = json.loads(raw) if raw else {}
            else:
                body = {"_raw": raw}
            endpoint = self.path.split("?", 1)[0].removeprefix("/api/v1/")
            fake.hits[endpoint] += 1
            fault = fake.faults[endpoint].popleft() if fake.faults[endpoint] else None
            if isinstance(fault, str) and fault.startswith("delay:"):
                fake.closing.wait(float(fault.split(":", 1)[1]))
            if fault == "drop" or fake.closing.is_set():  # a closed server answers nothing more
                return self.drop_connection()
            if isinstance(fault, int):
                return self._send(fault, {"detail": f"fake HTTP {fault}"})
            try:
                answer = fake.answer(endpoint, body)
            except _HTTPError as err:
                return self._send(err.status, {"detail": err.detail})
            except Exception as err:  # the fake service's own refusals (e.g. an unknown checkpoint: 404)
                return self._send(getattr(err, "status_code", 500), {"detail": f"{type(err).__name__}: {err}"})
            if fault == "applied-500":
                return self._send(500, {"detail": "fake HTTP 500 after the request was carried out"})
            self._send(200, answer)

        def _send(self, status: int, payload: Any) -> None:
            proto = isinstance(payload, bytes)
            data = payload if proto else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/x-protobuf" if proto else "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
