"""``LocalTrainingClient``: the training role of the local engine, and its checkpoints.

It owns the model (LoRA adapter via PEFT by default, full fine-tuning as an option),
the Adam optimiser and the RNG streams. ``forward_backward`` splits the datums into
micro-batches under a token budget (length-bucketed, padding-free packed or packed with
a shared prompt prefix computed once; ``retool.algo.plan_micro_batches``) and scales
every micro-batch by the whole batch's token count, so accumulated gradients equal the
full-batch gradient of the token-mean loss. ``optim_step`` applies Adam(W);
``save_state``/``load_state`` write and read a resumable checkpoint folder (weights,
optimiser moments, RNG states, sampler seed and call counter). Its ``sampler`` shares
the model; a lock keeps sampling and training from overlapping, and every change of
weights empties the sampler's KV store.

Not covered: loading the model (``model``), sampling (``sampler``), multiple GPUs,
quantised (QLoRA) training, the trainer loop's own files (step, data cursor: next to a
checkpoint folder, never inside).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from retool import algo
from retool.atomic import replace_folder
from retool.engines.base import AdamParams, ForwardBackwardOutput, OptimStepOutput, run_now
from retool.engines.local.config import LocalEngineConfig
from retool.engines.local.kv_cache import common_prefix
from retool.engines.local.model import (
    apply_lora,
    cuda_devices,
    enable_checkpointing,
    load_model,
    load_weights,
    model_mode,
    save_weights,
)
from retool.engines.local.sampler import LocalSamplingClient
from retool.types import Datum

STATE_FORMAT = 1
"""Version of the folder layout ``save_state`` writes."""


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
            enable_checkpointing(base)
        with torch.random.fork_rng(devices=cuda_devices(self.device)):
            torch.manual_seed(config.seed)
            self.model = base if config.full_finetune else apply_lora(base, config)
        if config.init_from:
            load_weights(self.model, Path(config.init_from), config.full_finetune)
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
                                           kv_cache_mb=config.sample_kv_cache_mb,
                                           fast=config.fast_sampling, decode_loop=config.decode_loop)
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
        with self._lock, model_mode(self.model, train=True):
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
        with torch.no_grad(), model_mode(self.model, train=False):
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
            save_weights(self.model, staging, self.config.full_finetune)
            torch.save(self.optimizer.state_dict(), staging / "optimizer.pt")
            torch.save(self._rng_state(), staging / "rng.pt")
        (staging / "engine.json").write_text(json.dumps(self._state_meta(), indent=2))
        replace_folder(staging, path)
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
            load_weights(self.model, path, self.config.full_finetune)
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
    return common_prefix([d.input_tokens_N for d in data]) if len(data) > 1 else 0


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
