"""A stand-in for a Tinker-compatible training service (Tinker, PyTRIO), for tests.

No offline server of either service installs here, so this module replaces each SDK's
``ServiceClient`` with one whose clients answer with the **real SDK types**
(``tinker.types.*`` / ``pytrio.types.*``) and the SDKs' own future classes, computed with
the local engine's model (LoRA init, AdamW, checkpoint files) on a tiny model, using the
services' semantics rather than retool's:

- it sees only what the SDK would send: the ``Datum`` fields, the loss name and its
  config, ``AdamParams`` — never retool's records;
- losses as the services define them, computed here (not with ``retool.algo``): Tinker's
  documented token *sum* (``ppo``: ``-min(r A, clip(r, lo, hi) A)``,
  ``importance_sampling``: ``-r A``, ``cross_entropy``: ``-w logp``), no weight input
  for the RL losses; PyTRIO's (inferred, see ``retool.engines.tinker``) the same terms
  summed over targets that are not ``-100`` and divided by their count in the call;
- Adam is ``torch.optim.AdamW`` with the parameters sent (Tinker: "identical to
  torch.optim.AdamW"), ``grad_clip_norm`` 0 = off;
- requests of one training client run in submission order on one worker thread, so a
  ``forward_backward`` and an ``optim_step`` can both be in flight;
- sampled sequences include the stop token; ``stop=None`` means the model's EOS tokens;
- checkpoints live on disk under the service's root (so a new process can resume, as
  with a real service), named ``tinker://fake/<kind>/<name>``.

Faults: :meth:`FakeService.fail` makes the next call of a method fail with the SDK's
own exception (429, 500, timeout, 401); the SDK's transport retries are not part of this
fake, so the failure is what the SDK would raise once its own retries are spent. For
Tinker, :mod:`tests.fake_tinker_http` serves the same computations over HTTP to the
unmodified SDK, so its retries run (faults injected below it).

Use :func:`install` (monkeypatches ``tinker.ServiceClient`` / ``pytrio.ServiceClient``),
or run ``python -m tests.fake_tinker ROOT FLAVOUR MODEL_ALPHA -- retool args...`` for a
subprocess (kill/resume tests).
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

FAKE_LORA_ALPHA = 32.0
"""The fake service's LoRA alpha (the services choose their own; none takes one)."""
DENOMINATORS = ("call_tokens", "samples", "advantage_tokens", "datum_tokens", "sum")
"""What a service may divide a call's summed loss by: the call's active targets, its
datums, its targets with a nonzero advantage, each datum's own active targets, nothing."""


class FakeService:
    """The server side: checkpoints on disk, recorded gradients, injected faults."""

    def __init__(self, root: str | Path, flavour: str, lora_alpha: float = FAKE_LORA_ALPHA,
                 duplicate_seeded: bool = False, denominator: str | None = None) -> None:
        self.root, self.flavour, self.lora_alpha = Path(root), flavour, lora_alpha
        self.denominator = denominator or ("sum" if flavour == "tinker" else "call_tokens")
        """What the summed loss of a call is divided by (:data:`DENOMINATORS`): Tinker's
        documented ``sum``; PyTRIO's inferred ``call_tokens``; the others to test the probe."""
        assert self.denominator in DENOMINATORS, self.denominator
        self.duplicate_seeded = duplicate_seeded
        """Reproduce the reported Tinker behaviour: a seeded request for ``n > 1`` samples
        answers ``n`` token-identical sequences (one sample, repeated)."""
        self.sample_requests: list[tuple[int, int | None]] = []
        """Every sample request as sent: (``num_samples``, ``seed``)."""
        self.billing: list[Any] = []
        """Tinker only: what its billing would record, as the SDK's billing event types
        (``tinker.types.*BillingEvent``), one per request: prefill cached and not,
        sampled and trained tokens, checkpoints (the ephemeral snapshots are not)."""
        self.closed: list[str] = []
        self.deleted: list[str] = []
        """Every checkpoint deleted through the REST client."""
        """The status of every service session closed (PyTRIO: ``ENDED``/``CANCELLED``)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.faults: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.calls: collections.Counter = collections.Counter()
        self.training_clients: list[FakeTrainer] = []
        self.requests: list[tuple[str, Any]] = []
        """Every training request as sent: (``forward_backward``, (data, loss_fn, config)) or
        (``optim_step``, params)."""

    # ------------------------------------------------------------ faults

    def fail(self, method: str, status: int | str, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` fail with HTTP ``status`` (or ``timeout``)."""
        self.faults[method].extend([status] * times)

    def check(self, method: str) -> None:
        self.calls[method] += 1
        if self.faults[method]:
            raise self.error(self.faults[method].popleft())

    def error(self, status: int | str) -> Exception:
        if self.flavour == "tinker":
            import httpx
            import tinker

            request = httpx.Request("POST", "https://fake.invalid/api")
            if status == "timeout":
                return tinker.APITimeoutError(request)
            cls = {401: tinker.AuthenticationError, 404: tinker.NotFoundError, 429: tinker.RateLimitError,
                   500: tinker.InternalServerError}[status]
            return cls(f"fake HTTP {status}", response=httpx.Response(status, request=request), body=None)
        from pytrio.errors.auth import AuthError
        from pytrio.errors.control import ControlAPIError

        if status == 401:
            return AuthError("fake: invalid API key", code="auth.login_failed")
        if status == "timeout":
            return TimeoutError("fake: request timed out")
        return ControlAPIError(f"fake HTTP {status}", status_code=int(status), retryable=status in (429, 500))

    def bill(self, event: str, **fields: Any) -> None:
        if self.flavour == "tinker":
            import tinker

            self.billing.append(getattr(tinker.types, event)(**fields))

    # ------------------------------------------------------------ paths

    def path(self, kind: str, name: str) -> str:
        return f"tinker://fake/{kind}/{name}"

    def folder(self, path: str) -> Path:
        prefix = "tinker://fake/"
        if not path.startswith(prefix):
            raise self.error(404)
        folder = self.root / path[len(prefix):]
        if not (folder / "engine.json").is_file():
            raise self.error(404)
        return folder

    def future(self, value: Any = None, error: BaseException | None = None) -> Any:
        done: Future = Future()
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)
        return self.wrap(done)

    def wrap(self, future: Future) -> Any:
        """A concurrent future as the SDK's own future class."""
        if self.flavour == "tinker":
            from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

            return AwaitableConcurrentFuture(future)
        from pytrio.types import APIFuture

        return APIFuture(future)

    # ------------------------------------------------------------ clients

    def lora_trainer(self, base_model: str, rank: int, seed: int | None, train_unembed: bool) -> FakeTrainer:
        from retool.engines import LocalSettings
        from retool.engines.local import LocalEngineConfig, LocalTrainingClient

        self.check("create_lora_training_client")
        if not Path(base_model).is_dir():
            raise self.error(404)
        local = LocalTrainingClient(LocalEngineConfig(model=base_model, lora_rank=rank, lora_alpha=self.lora_alpha,
                                                      seed=seed or 0, sampler=LocalSettings(kv_cache_mb=0)))
        return self._register(FakeTrainer(self, local, base_model))

    def trainer_from_state(self, path: str, with_optimizer: bool) -> FakeTrainer:
        from retool.engines import LocalSettings
        from retool.engines.base import EngineCheckpoint
        from retool.engines.local import LocalEngineConfig, LocalTrainingClient

        self.check("create_training_client_from_state")
        folder = self.folder(path)
        saved = EngineCheckpoint.read(folder)
        local = LocalTrainingClient(LocalEngineConfig(
            model=saved.model, lora_rank=saved.lora["rank"], lora_alpha=saved.lora["alpha"],
            init_from=None if with_optimizer else str(folder), sampler=LocalSettings(kv_cache_mb=0)))
        if with_optimizer:
            local.load_state(folder)
        return self._register(FakeTrainer(self, local, saved.model))

    def _register(self, trainer: FakeTrainer) -> FakeTrainer:
        self.training_clients.append(trainer)
        return trainer

    def sampler(self, model_path: str | None, base_model: str | None, count: bool = True) -> FakeSampler:
        from retool.engines import SamplerRequest
        from retool.engines.base import EngineCheckpoint
        from retool.engines.local import sampler

        if count:
            self.check("create_sampling_client")
        if model_path:
            folder = self.folder(model_path)
            saved = EngineCheckpoint.read(folder)
            request = SamplerRequest(model=saved.model, checkpoint=saved, checkpoint_dir=str(folder))
        else:
            if not Path(str(base_model)).is_dir():
                raise self.error(404)
            request = SamplerRequest(model=str(base_model))
        return FakeSampler(self, sampler(request).sampler)


class FakeTrainer:
    """One training run on the fake service (one worker thread = ordered requests)."""

    def __init__(self, service: FakeService, local: Any, model: str) -> None:
        self.service, self.local, self.model = service, local, model
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="fake-service")
        self.grads: list[list[Any]] = []
        """The accumulated gradient at every optim_step (before clipping)."""
        self.grad_norms: list[float] = []

    def submit(self, method: str, fn: Any, *args: Any) -> Any:
        try:
            self.service.check(method)
        except Exception as err:
            return self.service.future(error=err)
        return self.service.wrap(self.worker.submit(fn, *args))

    # ------------------------------------------------------------ the service's computations

    def forward_backward(self, data: list, loss_fn: str, config: dict | None) -> Any:
        from retool.engines.local.model import model_mode

        self.service.requests.append(("forward_backward", (data, loss_fn, config)))
        self.service.bill("TrainingBillingEvent", token_count=sum(d.model_input.length for d in data))
        denominator = 1.0
        outputs, loss_sum = [], 0.0
        with model_mode(self.local.model, train=True):
            for datum in data:
                logprobs_N = self._logprobs(datum)
                denominator = self._denominator(data, datum, loss_fn)
                loss = self._token_losses(datum, loss_fn, config or {}, logprobs_N).sum() / denominator
                loss.backward()
                loss_sum += loss.item() * denominator
                outputs.append({"logprobs": self._tensor(logprobs_N.detach().numpy().astype(np.float32))})
        return self._output(outputs, loss_sum, denominator)

    def forward(self, data: list, loss_fn: str, config: dict | None) -> Any:
        """The logprobs of every target, no gradient (the SDKs' ``forward``)."""
        import torch

        from retool.engines.local.model import model_mode

        with torch.no_grad(), model_mode(self.local.model, train=False):
            outputs = [{"logprobs": self._tensor(self._logprobs(d).numpy().astype(np.float32))} for d in data]
        return self._output(outputs, 0.0, 1.0)

    def _denominator(self, data: list, datum: Any, loss_fn: str) -> float:
        """What this datum's summed loss is divided by in this call (:data:`DENOMINATORS`)."""
        kind = self.service.denominator
        if kind == "sum":
            return 1.0
        if kind == "samples":
            return float(len(data))
        if kind == "datum_tokens":
            return max(float(self._active(datum, loss_fn).sum()), 1.0)
        if kind == "advantage_tokens":
            return max(float(sum((self._active(d, loss_fn) & self._advantaged(d)).sum() for d in data)), 1.0)
        # call_tokens: the call's active targets (not -100; cross-entropy: weight != 0)
        return float(sum(self._active(d, loss_fn).sum() for d in data))

    def _advantaged(self, datum: Any) -> Any:
        import torch

        advantages = datum.loss_fn_inputs.get("advantages")
        if advantages is None:
            return torch.ones(len(datum.loss_fn_inputs["target_tokens"].tolist()), dtype=torch.bool)
        return torch.tensor(advantages.tolist()) != 0

    def _output(self, outputs: list, loss_sum: float, denominator: float) -> Any:
        if self.service.flavour == "tinker":
            import tinker

            return tinker.types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs,
                                                      metrics={"loss:sum": loss_sum})
        import pytrio

        return pytrio.types.ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={
            "loss_sum": loss_sum, "loss_mean": loss_sum / max(denominator, 1.0), "token_count": denominator})

    def _logprobs(self, datum: Any) -> Any:
        import torch

        inputs = datum.model_input.to_ints()
        targets = [t if t >= 0 else 0 for t in datum.loss_fn_inputs["target_tokens"].tolist()]
        logits = self.local.model(input_ids=torch.tensor([inputs]), use_cache=False).logits[0].float()
        return logits.log_softmax(-1)[torch.arange(len(inputs)), torch.tensor(targets)]

    def _active(self, datum: Any, loss_fn: str) -> Any:
        import torch

        active = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist()) != -100
        if loss_fn == "cross_entropy" and "weights" in datum.loss_fn_inputs:
            active &= torch.tensor(datum.loss_fn_inputs["weights"].tolist()) != 0
        return active

    def _token_losses(self, datum: Any, loss_fn: str, config: dict, logprobs_N: Any) -> Any:
        import torch

        inputs = {k: torch.tensor(v.tolist(), dtype=torch.float32) for k, v in datum.loss_fn_inputs.items()
                  if k != "target_tokens"}
        if loss_fn == "cross_entropy":
            weights = inputs.get("weights", torch.ones_like(logprobs_N))
            losses = -weights * logprobs_N
        else:
            ratio = (logprobs_N - inputs["logprobs"]).exp()
            advantages = inputs["advantages"]
            if loss_fn == "ppo":
                clipped = ratio.clamp(config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
                losses = -torch.minimum(ratio * advantages, clipped * advantages)
            elif loss_fn == "importance_sampling":
                losses = -ratio * advantages
            else:
                raise ValueError(f"fake service: unsupported loss {loss_fn}")
        return losses.where(self._active(datum, loss_fn), torch.zeros_like(losses))

    def _tensor(self, array: np.ndarray) -> Any:
        if self.service.flavour == "tinker":
            import tinker

            return tinker.types.TensorData.from_numpy(array)
        import pytrio

        return pytrio.types.TensorData.from_numpy(array)

    def optim_step(self, params: Any) -> Any:
        import torch

        self.service.requests.append(("optim_step", params))
        local = self.local
        for group in local.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        self.grads.append([p.grad.detach().clone() for p in local.params])
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
        self.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(local.params, max_norm)))
        local.optimizer.step()
        local.optimizer.zero_grad(set_to_none=True)
        local.optim_steps += 1
        if self.service.flavour == "tinker":
            import tinker

            return tinker.types.OptimStepResponse(metrics={})
        import pytrio

        return pytrio.types.OptimStepResponse(metrics={})

    def save(self, kind: str, name: str) -> Any:
        self.service.bill("CheckpointBillingEvent", count=1)
        folder = self.service.root / kind / name
        self.local.save_state(folder)
        if kind == "external_weights":
            tinker_layout(folder / "adapter", folder / "tinker_adapter")
        path = self.service.path(kind, name)
        if self.service.flavour == "tinker":
            import tinker

            cls = {"weights": tinker.types.SaveWeightsResponse, "sampler_weights": tinker.types.SaveWeightsForSamplerResponse,
                   "external_weights": tinker.types.SaveWeightsExternalResponse}[kind]
            return cls(path=path)
        import pytrio

        cls = pytrio.types.SaveWeightsResponse if kind == "weights" else pytrio.types.SaveWeightsForSamplerResponse
        return cls(path=path, model=self.model, size=sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))

    def ephemeral_sampler(self) -> FakeSampler:
        """A sampler on the current weights, saved outside the account's checkpoints (as
        the services' ephemeral snapshots are): ``save_weights_and_get_sampling_client``."""
        name = f"snapshot-{uuid.uuid4().hex[:8]}"
        self.local.save_state(self.service.root / "ephemeral" / name)
        return self.service.sampler(self.service.path("ephemeral", name), None, count=False)


def tinker_layout(peft_folder: Path, target: Path) -> None:
    """A PEFT adapter in Tinker's documented adapter layout (tinker-cookbook's weights
    README and fixtures): keys under ``base_model.model.``, the output layer named
    ``model.unembed_tokens``, and an ``adapter_config.json`` of ``r`` and ``lora_alpha``
    only. (The tiny test models have no fused Q/K/V; a Qwen3.5 fixture covers that.)"""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((peft_folder / "adapter_config.json").read_text())
    weights = load_file(peft_folder / "adapter_model.safetensors")
    renamed = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
               .replace("base_model.model.lm_head.", "base_model.model.model.unembed_tokens."): v
               for k, v in weights.items()}
    assert all(k.startswith("base_model.model.") for k in renamed), sorted(renamed)[:2]
    target.mkdir(parents=True)
    save_file(renamed, str(target / "adapter_model.safetensors"))
    (target / "adapter_config.json").write_text(json.dumps({"r": config["r"], "lora_alpha": config["lora_alpha"]}))


class FakeSampler:
    """A sampling client with fixed weights: the local engine's sampler on its own loop."""

    def __init__(self, service: FakeService, local_sampler: Any) -> None:
        self.service, self.local = service, local_sampler
        self.seen: list[tuple[int, ...]] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="fake-sampler").start()

    def cache_hits(self, prompt: list[int]) -> int:
        """A prefix cache: the longest prefix this prompt shares with one sent before."""
        best = 0
        for seen in self.seen:
            n = 0
            for a, b in zip(seen, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.seen.append(tuple(prompt))
        return best

    def submit(self, prompt: Any, num_samples: int, params: Any) -> Any:
        try:
            self.service.check("sample")
        except Exception as err:
            return self.service.future(error=err)
        return self.service.wrap(asyncio.run_coroutine_threadsafe(self._sample(prompt, num_samples, params), self.loop))

    def compute_logprobs(self, prompt: Any) -> Any:
        """Both SDKs' ``compute_logprobs``: the logprob of every prompt token given those
        before it (``None`` for the first), from this sampler's weights."""
        try:
            self.service.check("compute_logprobs")
        except Exception as err:
            return self.service.future(error=err)

        async def score() -> list[float | None]:
            tokens = prompt.to_ints()
            return [None, *await self.local.compute_logprobs(tokens, 1)]

        return self.service.wrap(asyncio.run_coroutine_threadsafe(score(), self.loop))

    async def _sample(self, prompt: Any, num_samples: int, params: Any) -> Any:
        from retool.engines.base import SamplingParams

        stop = tuple(int(t) for t in params.stop) if params.stop else ()
        ours = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                              top_k=max(params.top_k, 0), stop_token_ids=stop, seed=params.seed)
        self.service.sample_requests.append((num_samples, params.seed))
        if self.service.duplicate_seeded and params.seed is not None and num_samples > 1:
            one = await self.local.sample(prompt.to_ints(), 1, ours)
            result = type(one)(one.sequences * num_samples)
        else:
            result = await self.local.sample(prompt.to_ints(), num_samples, ours)
        reasons = ["length" if s.stop_reason.value == "length" else "stop" for s in result.sequences]
        if self.service.flavour == "tinker":
            import tinker

            hits, length = self.cache_hits(prompt.to_ints()), prompt.length
            self.service.bill("SamplingPrefillBillingEvent", cached=False, token_count=length - hits)
            self.service.bill("SamplingPrefillBillingEvent", cached=True, token_count=hits + (num_samples - 1) * length)
            self.service.bill("SamplingSampleBillingEvent", token_count=sum(len(s.tokens) for s in result.sequences))
            return tinker.types.SampleResponse(prompt_cache_hit_tokens=hits, sequences=[
                tinker.types.SampledSequence(stop_reason=r, sequence_id=uuid.uuid4().hex,
                                             tokens_np=np.asarray(s.tokens, dtype=np.int32),
                                             logprobs_np=np.asarray(s.logprobs, dtype=np.float32))
                for s, r in zip(result.sequences, reasons)])
        import pytrio

        return pytrio.types.SampleResponse(
            sequences=[pytrio.types.SampleSequence(stop_reason=r, tokens=list(s.tokens),
                                                   logprobs=[float(np.float32(x)) for x in s.logprobs])
                       for s, r in zip(result.sequences, reasons)],
            input_tokens=len(prompt.to_ints()), output_tokens=sum(len(s.tokens) for s in result.sequences))


# ---------------------------------------------------------------- the SDK-shaped clients


class _Base:
    service: FakeService


class TinkerTrainingClient:
    """``tinker.TrainingClient``'s methods the adapter uses, with the real signatures."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self._t = trainer

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        return self._t.submit("forward_backward", self._t.forward_backward, data, loss_fn, loss_fn_config)

    def forward(self, data, loss_fn, loss_fn_config=None):
        return self._t.submit("forward", self._t.forward, data, loss_fn, loss_fn_config)

    def optim_step(self, optim_params=None, *, adam_params=None):
        return self._t.submit("optim_step", self._t.optim_step, optim_params or adam_params)

    def save_state(self, name, ttl_seconds=None, overwrite=False, user_metadata=None):
        return self._t.submit("save_state", self._t.save, "weights", name)

    def save_weights_for_sampler(self, name, ttl_seconds=None, user_metadata=None):
        assert ttl_seconds is None or 3600 <= ttl_seconds <= 10 * 365 * 86400, "Tinker's documented TTL range"
        return self._t.submit("save_weights_for_sampler", self._t.save, "sampler_weights", name)

    def save_weights_external(self, name, ttl_seconds=None, age_encryption_recipients=None):
        assert ttl_seconds is None or 3600 <= ttl_seconds <= 10 * 365 * 86400, "Tinker's documented TTL range"
        return self._t.submit("save_weights_external", self._t.save, "external_weights", name)

    def save_weights_and_get_sampling_client(self, name=None, retry_config=None, record_stability_info=False,
                                             kind="snapshot"):
        type(self).last_retry_config = retry_config
        return self._t.submit("save_weights_and_get_sampling_client",
                              lambda: TinkerSamplingClient(self._t.ephemeral_sampler()))


class TinkerRestClient:
    """``tinker.RestClient``: signed URLs (here ``file://``) for exported weights."""

    service: FakeService

    def __init__(self, _holder=None, *, base_url=None, api_key=None):
        pass

    def get_external_weights_urls(self, tinker_path):
        import datetime

        import tinker

        try:
            adapter = self.service.folder(tinker_path) / "tinker_adapter"
        except Exception as err:
            return self.service.future(error=err)
        urls = {f.name: f.resolve().as_uri() for f in adapter.iterdir() if f.is_file()}
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        return self.service.future(tinker.types.ExternalWeightsUrlsResponse(urls=urls, expires=expires))


    def delete_checkpoint_from_tinker_path(self, tinker_path):
        import shutil

        try:
            folder = self.service.folder(tinker_path)
        except Exception as err:
            return self.service.future(error=err)
        shutil.rmtree(folder)
        self.service.deleted.append(tinker_path)
        return self.service.future(None)


class TinkerSamplingClient:
    def __init__(self, sampler: FakeSampler) -> None:
        self._s = sampler

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False, topk_prompt_logprobs=0,
               topk_sample_logprobs=0, target_prompt_logprobs=None, prompt_alt_tokens_k=0,
               prompt_logprobs_last_n=None):
        return self._s.submit(prompt, num_samples, sampling_params)

    def compute_logprobs(self, prompt, prompt_logprobs_last_n=None):
        return self._s.compute_logprobs(prompt)


class TinkerServiceClient:
    """``tinker.ServiceClient`` on the fake service (create_* return futures, as Tinker's do)."""

    service: FakeService

    def __init__(self, user_metadata=None, project_id=None, *, display_name=None, base_url=None, api_key=None,
                 default_headers_overrides=None, **kwargs):
        self.base_url = base_url
        type(self).last_base_url = base_url

    def _later(self, fn, *args):
        try:
            return self.service.future(fn(*args))
        except Exception as err:
            return self.service.future(error=err)

    def create_lora_training_client(self, base_model, rank=32, seed=None, train_mlp=True, train_attn=True,
                                    train_unembed=True, user_metadata=None, optimizer=None):
        return self._later(lambda: TinkerTrainingClient(self.service.lora_trainer(base_model, rank, seed,
                                                                                  train_unembed)))

    def create_training_client_from_state(self, path, base_model=None, user_metadata=None,
                                          weights_access_token=None, optimizer=None):
        return self._later(lambda: TinkerTrainingClient(self.service.trainer_from_state(path, False)))

    def create_training_client_from_state_with_optimizer(self, path, base_model=None, user_metadata=None,
                                                         weights_access_token=None):
        return self._later(lambda: TinkerTrainingClient(self.service.trainer_from_state(path, True)))

    def create_sampling_client(self, model_path=None, base_model=None, retry_config=None,
                               record_stability_info=False):
        type(self).last_retry_config = retry_config
        return self._later(lambda: TinkerSamplingClient(self.service.sampler(model_path, base_model)))

    def close(self, status, detail=None):
        type(self).closed_with = status
        def finish():
            self.service.check("close")  # fail("close", ...) makes it fail
            self.service.closed.append(status)
        return self._later(finish)


class PytrioTrainingClient:
    """``pytrio.TrainingClient``'s methods the adapter uses, with the real signatures."""

    def __init__(self, trainer: FakeTrainer) -> None:
        self._t = trainer

    def forward_backward(self, data, loss_fn="cross_entropy", loss_fn_config=None, auto_shift=False):
        return self._t.submit("forward_backward", self._t.forward_backward, data, loss_fn, loss_fn_config)

    def forward(self, data, loss_fn="cross_entropy", loss_fn_config=None, auto_shift=False):
        return self._t.submit("forward", self._t.forward, data, loss_fn, loss_fn_config)

    def optim_step(self, adam_params):
        return self._t.submit("optim_step", self._t.optim_step, adam_params)

    def save_state(self, name, ttl_seconds=None, overwrite=False):
        return self._t.submit("save_state", self._t.save, "weights", name)

    def save_weights_for_sampler(self, name, ttl_seconds=None):
        return self._t.submit("save_weights_for_sampler", self._t.save, "sampler_weights", name)

    def save_weights_and_get_sampling_client(self):
        self._t.service.check("save_weights_and_get_sampling_client")
        return PytrioSamplingClient(self._t.ephemeral_sampler())


class PytrioSamplingClient:
    def __init__(self, sampler: FakeSampler) -> None:
        self._s = sampler

    def sample(self, prompt, num_samples=1, sampling_params=None, include_prompt_logprobs=False,
               topk_prompt_logprobs=0, return_text=True):
        return self._s.submit(prompt, num_samples, sampling_params)

    def compute_logprobs(self, prompt):
        return self._s.compute_logprobs(prompt)


class PytrioServiceClient:
    """``pytrio.ServiceClient`` on the fake service (create_* return clients, as PyTRIO's do)."""

    service: FakeService

    def __init__(self, api_key=None):
        self.service.check("login")
        self._runtime = _PytrioRuntime(self.service)

    def create_lora_training_client(self, base_model, rank=32, seed=None, train_mlp=True, train_attn=True,
                                    train_unembed=True):
        return PytrioTrainingClient(self.service.lora_trainer(base_model, rank, seed, train_unembed))

    def create_sampling_client(self, base_model, model_path=None):
        return PytrioSamplingClient(self.service.sampler(model_path, base_model))

    def create_training_client_from_state(self, path):
        return PytrioTrainingClient(self.service.trainer_from_state(path, False))

    def create_training_client_from_state_with_optimizer(self, path):
        return PytrioTrainingClient(self.service.trainer_from_state(path, True))

    def create_rest_client(self):
        rest = PytrioRestClient()
        rest.service = self.service
        return rest


class _PytrioRuntime:
    """PyTRIO 0.2.9's private ``ServiceRuntime``: ``shutdown(status)`` closes the session."""

    def __init__(self, service: FakeService) -> None:
        self.service = service

    def shutdown(self, status="ENDED"):
        assert status in ("ENDED", "CANCELLED"), "PyTRIO's ServiceSessionCloseStatus"
        self.service.closed.append(status)


class PytrioRestClient:
    """``pytrio.RestClient``: the account's checkpoints, downloaded as tar archives."""

    service: FakeService

    def list_user_checkpoints(self, limit=100, offset=0):
        import datetime

        import pytrio

        saved = sorted((self.service.root / "sampler_weights").iterdir()) if (self.service.root / "sampler_weights").is_dir() else []
        page = [pytrio.types.Checkpoint(checkpoint_id=f"ckpt-{f.name}", checkpoint_type="sampler",
                                        time=datetime.datetime.now(datetime.timezone.utc),
                                        path=self.service.path("sampler_weights", f.name))
                for f in saved[offset:offset + limit]]
        done: Future = Future()
        done.set_result(pytrio.types.CheckpointsListResponse(checkpoints=page))
        return done

    def download_checkpoint(self, checkpoint_id, destination_path, *, resume=True):
        import tarfile

        import pytrio

        adapter = self.service.root / "sampler_weights" / checkpoint_id.removeprefix("ckpt-") / "adapter"
        with tarfile.open(destination_path, "w:gz") as tar:
            tar.add(adapter, arcname=checkpoint_id)
        size = Path(destination_path).stat().st_size
        done: Future = Future()
        done.set_result(pytrio.types.CheckpointDownloadResult(checkpoint_id=checkpoint_id, path=str(destination_path),
                                                             bytes_written=size, file_size_bytes=size,
                                                             status_code=200, resumed=False))
        return done


FAKES = {"tinker": (TinkerServiceClient, TinkerTrainingClient, TinkerSamplingClient),
         "pytrio": (PytrioServiceClient, PytrioTrainingClient, PytrioSamplingClient)}
"""Per flavour: the fake ServiceClient, TrainingClient and SamplingClient classes."""


def install(service: FakeService, monkeypatch: Any = None) -> type:
    """Make ``<sdk>.ServiceClient`` the fake's, bound to ``service``; returns the class."""
    import importlib

    sdk = importlib.import_module(service.flavour)
    cls = type(f"Fake{service.flavour.title()}ServiceClient", (FAKES[service.flavour][0],), {"service": service})
    replace = {"ServiceClient": cls}
    if service.flavour == "tinker":
        replace["RestClient"] = type("FakeTinkerRestClient", (TinkerRestClient,), {"service": service})
    for name, value in replace.items():
        if monkeypatch is not None:
            monkeypatch.setattr(sdk, name, value)
        else:
            setattr(sdk, name, value)
    return cls


def main(argv: list[str]) -> int:
    """``python -m tests.fake_tinker ROOT FLAVOUR -- retool args``: run retool on the fake."""
    import sys

    from retool.cli import main as cli_main

    root, flavour, rest = argv[0], argv[1], argv[argv.index("--") + 1:]
    install(FakeService(root, flavour))
    code = cli_main(rest)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    import os
    import sys

    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the fake's worker threads would keep the interpreter alive
