"""The ``vllm`` engine: the local PEFT trainer, with rollouts and evals sampled by vLLM.

Training is the local engine's (:class:`~retool.engines.local.LocalTrainingClient`:
forward/backward, Adam, checkpoints); sampling goes to a vLLM server, which batches
requests continuously. How the two stay on-policy: ``save_weights_for_sampler`` — which
the RL loop calls at the start of every step, i.e. after the previous ``optim_step`` —
saves the current adapter to a folder the server can read, hot-loads it under a new
name (``POST /v1/load_lora_adapter``) and returns a sampling client bound to that name:
the samples of step N come from step N's weights. A test checks the server's logprobs
against the trainer's after an update.

Older adapters stay loaded while anything may still use them
(:class:`~.adapters.AdapterLeases`): the samplers handed out for them until they are
closed or dropped, and their requests in flight. That is what ``retool train
--max-staleness K`` needs (step ``t + K`` samples with version ``t`` while the trainer
makes the next ones); a managed server then starts with ``--max-loras K + 1`` (at least
2), so every version in use shares a batch. Synchronously (``K = 0``) the previous
adapter has no holder left when the next one loads and is unloaded at once, as before.

The server (:mod:`.server`): by default retool starts ``vllm serve`` from ``.venv-vllm``
(``scripts/setup.sh --vllm``) with LoRA on, the run's LoRA rank, and the logprobs mode
its training settings need (:func:`.client.logprobs_mode_for`; a setting no mode serves
exactly — temperature ≠ 1 *and* top-p < 1 — is refused before anything loads). It loads
while the trainer loads its model, and is stopped with retool. ``--vllm-url`` uses a
server started elsewhere instead: for training, that server must read adapters at the
path retool writes them, declared with ``--vllm-adapter-dir`` (and it must have been
started with ``--enable-lora``, the rank and the logprobs mode the run needs); without
it such a server evaluates only.

Checkpoints are the local engine's folders (``adapter/``, ``optimizer.pt``, ...) with
``engine: vllm`` in ``engine.json``; either engine evaluates or resumes from the other's.

Not covered: full fine-tuning (LoRA only: the server swaps adapters, not weights),
restarting a server that died (the step fails with its log; ``--resume`` continues),
several servers or data parallelism.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from retool.bundled import resolve_model_name
from retool.config import ConfigError
from retool.engines import EngineSampler, ModelConfig, SamplerRequest, VLLMSettings
from retool.engines.base import AdamParams, ENGINE_STATE_FILE, ForwardBackwardOutput, OptimStepOutput
from retool.engines.vllm.adapters import AdapterLeases
from retool.engines.vllm.client import (
    VLLMSamplingClient,
    load_adapter,
    logprobs_mode_for,
    unload_adapter,
)
from retool.engines.vllm.server import (
    BASE_MODEL_NAME,
    FAILED_REQUEST_GRACE_S,
    ManagedServer,
    ServerError,
    ServerOptions,
    health_ok,
)
from retool.types import Datum

__all__ = ["Server", "VLLMSamplingClient", "VLLMTrainingClient", "create_training_client", "sampler",
           "training_client"]


class Server:
    """A vLLM server retool uses: one it started (``managed``) or one at ``--vllm-url``."""

    def __init__(self, settings: VLLMSettings, options: ServerOptions) -> None:
        self.settings = settings
        self.managed = None if settings.url else ManagedServer(options)
        self.url = settings.url.rstrip("/") if settings.url else self.managed.url
        self.adapter_dir = Path(settings.adapter_dir) if settings.adapter_dir else None
        self._tmp = None
        if self.adapter_dir is None and self.managed is not None:
            self._tmp = tempfile.mkdtemp(prefix="retool-vllm-adapters-")
            self.adapter_dir = Path(self._tmp)

    def wait_ready(self) -> None:
        if self.managed is not None:
            self.managed.wait_ready()
        elif not health_ok(self.url):
            raise ServerError(f"no healthy vLLM server at {self.url} (GET /health failed)")

    def close(self) -> None:
        if self.managed is not None:
            self.managed.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def max_loras_for(max_staleness: int) -> int:
    """``--max-loras`` for a run sampling up to ``max_staleness`` steps ahead: the K + 1
    versions it may sample with at once, and never fewer than 2 (the swap's own overlap)."""
    return max(2, max_staleness + 1)


def _server_options(model: str, settings: VLLMSettings, *, rank: int, mode: str, dtype: str,
                    seed: int, max_staleness: int = 0) -> ServerOptions:
    return ServerOptions(model_dir=resolve_model_name(model), venv=settings.venv, max_lora_rank=rank,
                         max_loras=max_loras_for(max_staleness),
                         logprobs_mode=mode, dtype=dtype, seed=seed, kv_cache_gib=settings.kv_cache_gib,
                         gpu_memory_utilization=settings.gpu_memory_utilization,
                         max_model_len=settings.max_model_len, startup_timeout_s=settings.startup_timeout_s,
                         extra_args=settings.extra_args)


def _start(model: str, settings: VLLMSettings, options: ServerOptions) -> Server:
    try:
        return Server(settings, options)
    except ServerError as err:
        raise ConfigError(f"engine vllm: {err}") from None


class VLLMTrainingClient:
    """The local trainer plus a vLLM server that samples with its latest adapter."""

    def __init__(self, trainer: Any, server: Server | Callable[[], Server], *, mode: str, seed: int,
                 stop_token_ids: Sequence[int], timeout_s: float) -> None:
        """``server`` may be a function that starts one: it is called at the first
        ``save_weights_for_sampler`` (``retool sft`` never samples, so starts none)."""
        self._start_server = None if isinstance(server, Server) else server
        if self._start_server is not None:
            server = None
        elif server.adapter_dir is None:
            raise ConfigError("engine vllm: training with --vllm-url needs --vllm-adapter-dir, a folder the server "
                              "reads at the same path (without it that server can only evaluate)")
        self.trainer, self.server, self.mode, self.seed = trainer, server, mode, seed
        self.stop_token_ids, self.timeout_s = tuple(stop_token_ids), timeout_s
        self._loaded: tuple[int, str, Path] | None = None
        """The newest adapter: its weight version, name and folder (``None``: none yet, or the weights changed)."""
        self._seen: Counter = Counter()
        """The newest adapter's occurrence counts (seeds), shared by every sampler of it."""
        self.leases = AdapterLeases(self._unload)
        self.swaps = 0

    # ---- the training role: the local trainer's
    def get_tokenizer(self) -> Any:
        return self.trainer.get_tokenizer()

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        return self.trainer.forward_backward(data, loss_fn, loss_fn_config)

    def optim_step(self, adam_params: AdamParams = AdamParams()) -> OptimStepOutput:
        return self.trainer.optim_step(adam_params)

    def submit_forward_backward(self, data: Sequence[Datum], loss_fn: str,
                                loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        return self.trainer.submit_forward_backward(data, loss_fn, loss_fn_config)

    def submit_optim_step(self, adam_params: AdamParams = AdamParams()) -> Future[OptimStepOutput]:
        return self.trainer.submit_optim_step(adam_params)

    def save_state(self, path: str | Path) -> Path:
        """The local trainer's checkpoint folder, recorded as written by ``vllm``."""
        folder = self.trainer.save_state(path)
        meta_file = folder / ENGINE_STATE_FILE
        meta = json.loads(meta_file.read_text())
        meta["engine"] = "vllm"
        meta_file.write_text(json.dumps(meta, indent=2))
        return folder

    def load_state(self, path: str | Path) -> None:
        self.trainer.load_state(path)
        self._retire()  # the weights changed: the next sampler loads them

    def keep_reference(self) -> None:
        """The local trainer's copy of the weights as they are now (``--kl-coef``)."""
        self.trainer.keep_reference()

    def reference_logprobs(self, data: Sequence[Datum], temperature: float = 1.0) -> tuple[tuple[float, ...], ...]:
        """The local trainer's logprobs of ``data`` under the kept reference weights."""
        return self.trainer.reference_logprobs(data, temperature)

    def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]:
        """The local trainer's teacher-forced logprobs (the weight-sync guard's probe)."""
        return self.trainer.compute_logprobs(tokens, start)

    # ---- the sampling role: the server, with the current adapter
    def save_weights_for_sampler(self, name: str | None = None) -> VLLMSamplingClient:
        """A client sampling with the weights as they are now: unless they are already
        on the server, the adapter is saved and loaded under a new name. Later
        ``optim_step`` calls do not change what it samples with. The adapter stays
        loaded until no client of it is left (closed or dropped) and none of its
        requests is in flight; the previous one goes as soon as that is true of it."""
        if self.server is None:
            self.server = self._start_server()
            self.server.wait_ready()
        version = self.trainer.optim_steps
        if self._loaded is None or self._loaded[0] != version:
            self._load(version, name or f"step{version}-{uuid.uuid4().hex[:8]}")
        _, current, _ = self._loaded
        return VLLMSamplingClient(self.server.url, current, stop_token_ids=self.stop_token_ids, mode=self.mode,
                                  strict=True, seed=self.seed, generation=version, timeout_s=self.timeout_s,
                                  server=self.server.managed, leases=self.leases, seen=self._seen)

    def _load(self, version: int, name: str) -> None:
        """Save the adapter, load it on the server as ``name`` and make it the newest
        (held by this client until a newer one loads)."""
        folder = self.server.adapter_dir / name
        with self.trainer._lock:
            self.trainer.model.save_pretrained(str(folder))
        self._check_alive()
        try:
            load_adapter(self.server.url, name, str(folder))
        except (RuntimeError, OSError) as err:
            self._check_alive(grace_s=FAILED_REQUEST_GRACE_S)
            raise RuntimeError(f"engine vllm: the server could not load adapter {folder}: {err}") from err
        self.leases.add(name, folder)
        self._retire()
        self._loaded, self._seen = (version, name, folder), Counter()
        self.swaps += 1

    def _retire(self) -> None:
        """Stop handing out the newest adapter: this client's hold on it ends."""
        if self._loaded is not None:
            _, name, _ = self._loaded
            self._loaded = None
            self.leases.release(name)

    def _unload(self, name: str) -> None:
        if self.server is not None:
            unload_adapter(self.server.url, name)

    def _check_alive(self, grace_s: float = 0.0) -> None:
        if self.server.managed is not None:
            self.server.managed.check_alive(grace_s)

    def close(self, status: str = "success") -> None:
        """Stop the vLLM server this client started (one at ``--vllm-url`` keeps running)
        and remove its adapter folder, then close the local trainer. ``status`` is not
        recorded anywhere. A second call does nothing."""
        self._loaded = None
        if self.server is not None:
            self.leases.close()  # a server at --vllm-url keeps running: leave it no adapter of this run
            self.server.close()  # safe twice: the process is stopped once, the folder removed once
        self.trainer.close(status)


# ---------------------------------------------------------------- registry entry points


def training_client(cfg: ModelConfig, seed: int, init_from: str | None) -> VLLMTrainingClient:
    """The training client a ``retool train``/``sft`` config describes: the server starts
    first and loads while the local trainer loads its model."""
    # heavy (torch): only training needs the local trainer
    from retool.engines.local import default_stop_token_ids
    from retool.engines.local import training_client as local_training_client

    if cfg.full_finetune:
        raise ConfigError("engine vllm does not support full fine-tuning (it hot-swaps LoRA adapters); "
                          "use a LoRA adapter or --engine local")
    try:
        mode = logprobs_mode_for(getattr(cfg, "temperature", 1.0), getattr(cfg, "top_p", 1.0))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    settings: VLLMSettings = cfg.vllm
    options = _server_options(cfg.model, settings, rank=cfg.lora_rank, mode=mode, dtype=cfg.dtype, seed=seed,
                              max_staleness=getattr(cfg, "max_staleness", 0))
    if not hasattr(cfg, "temperature"):  # retool sft: trains only; a server starts if ever asked to sample
        trainer = local_training_client(cfg, seed, init_from)
        return VLLMTrainingClient(trainer, lambda: _start(cfg.model, settings, options), mode=mode, seed=seed,
                                  stop_token_ids=sorted(default_stop_token_ids(trainer.model, trainer.tokenizer)),
                                  timeout_s=settings.request_timeout_s)
    server = _start(cfg.model, settings, options)
    try:
        trainer = local_training_client(cfg, seed, init_from)  # its own sampler stays unused
        server.wait_ready()
        stop_ids = default_stop_token_ids(trainer.model, trainer.tokenizer)
        return VLLMTrainingClient(trainer, server, mode=mode, seed=seed, stop_token_ids=sorted(stop_ids),
                                  timeout_s=settings.request_timeout_s)
    except ServerError as err:
        server.close()
        raise ConfigError(f"engine vllm: {err}") from None
    except BaseException:
        server.close()
        raise


def create_training_client(**options: Any) -> VLLMTrainingClient:
    """The local trainer's options (``LocalEngineConfig`` fields) plus ``vllm`` (a
    :class:`VLLMSettings`) and ``temperature``/``top_p`` (the training rollouts')."""
    from retool.engines.local import (  # heavy (torch): only training needs the local trainer
        LocalEngineConfig,
        LocalTrainingClient,
        default_stop_token_ids,
    )

    settings = options.pop("vllm", None) or VLLMSettings()
    mode = logprobs_mode_for(options.pop("temperature", 1.0), options.pop("top_p", 1.0))
    config = LocalEngineConfig(**options)
    if config.full_finetune:
        raise ValueError("engine vllm does not support full fine-tuning")
    server = Server(settings, _server_options(config.model, settings, rank=config.lora_rank, mode=mode,
                                              dtype=config.dtype, seed=config.seed))
    try:
        trainer = LocalTrainingClient(config)
        server.wait_ready()
        return VLLMTrainingClient(trainer, server, mode=mode, seed=config.seed,
                                  stop_token_ids=sorted(default_stop_token_ids(trainer.model, trainer.tokenizer)),
                                  timeout_s=settings.request_timeout_s)
    except BaseException:
        server.close()
        raise


def sampler(request: SamplerRequest) -> EngineSampler:
    """A sampler only, for ``retool eval``: the base model, or a checkpoint's adapter
    loaded into the server. Evaluation ignores logprobs, so any sampling setting is served."""
    from transformers import AutoTokenizer  # heavy: only the tokenizer needs it

    settings: VLLMSettings = request.settings or VLLMSettings()
    checkpoint = request.checkpoint
    if checkpoint is not None and checkpoint.full_finetune:
        raise ConfigError("engine vllm evaluates LoRA checkpoints only; evaluate this one with --engine local")
    rank = int((checkpoint.lora or {}).get("rank", 32)) if checkpoint else 16
    server = _start(request.model, settings, _server_options(request.model, settings, rank=rank,
                                                             mode="raw_logprobs", dtype=request.dtype,
                                                             seed=request.seed))
    try:
        resolved = resolve_model_name(request.model)
        tokenizer = AutoTokenizer.from_pretrained(resolved)
        server.wait_ready()
        name = BASE_MODEL_NAME
        if checkpoint is not None:
            adapter = Path(request.checkpoint_dir) / checkpoint.weights
            name = f"eval-{uuid.uuid4().hex[:8]}"
            load_adapter(server.url, name, str(adapter.resolve()))
        client = VLLMSamplingClient(server.url, name, stop_token_ids=_stop_ids(resolved, tokenizer),
                                    mode="raw_logprobs", strict=False, seed=request.seed,
                                    timeout_s=settings.request_timeout_s, server=server.managed)
    except ServerError as err:
        server.close()
        raise ConfigError(f"engine vllm: {err}") from None
    except BaseException:
        server.close()
        raise
    return EngineSampler(tokenizer, client, close=server.close)


def _stop_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """End-of-sequence ids from the model's generation config and its tokenizer (as the
    local engine's ``default_stop_token_ids``, without loading the weights)."""
    from transformers import GenerationConfig  # heavy: only reading the stop ids needs it

    try:
        found = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        found = None
    ids = set(found if isinstance(found, list) else [found] if found is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ConfigError(f"model {model_dir} declares no end-of-sequence token")
    return sorted(ids)
