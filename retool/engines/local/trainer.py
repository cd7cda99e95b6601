"""``LocalTrainingClient``: the training role of the local engine, and its checkpoints.

It owns the model (LoRA adapter via PEFT by default, full fine-tuning as an option),
the Adam optimiser and the RNG streams. ``forward_backward`` splits the datums into
micro-batches under a token budget (length-bucketed, padding-free packed or packed with
a shared prompt prefix computed once per micro-batch, or with ``prefix_once`` once per
call: ``trained_prefix``; ``retool.algo.plan_micro_batches``) and scales
every micro-batch by the whole batch's token count, so accumulated gradients equal the
full-batch gradient of the token-mean loss. The same forward gives the policy's entropy
(``train/entropy``) and, with ``logprob_chunk_tokens``, computes the output layer and
log-softmax chunk by chunk (:func:`chunked_logprobs`) so the logits never exist whole;
with ``train_precision='bf16'`` the layers below the output head run under bf16
autocast (:func:`resolve_train_precision`: fp32 master weights and optimiser, output
head, log-softmax and loss in fp32); a sampler-trainer correction in the loss config
(``algo.behaviour_weights``) weighs each token by ``pi_old / mu``, ``pi_old`` being that
forward's logprobs. ``optim_step`` applies Adam(W);
``save_state``/``load_state`` write and read a resumable checkpoint folder (weights,
optimiser moments, RNG states, sampler seed and call counter). Its ``sampler`` shares
the model; a lock keeps sampling and training from overlapping, and every change of
weights empties the sampler's KV store.

Not covered: loading the model (``model``), sampling (``sampler``), multiple GPUs,
quantised (QLoRA) training, the trainer loop's own files (step, data cursor: next to a
checkpoint folder, never inside).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
import random
import shutil
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from retool import algo
from retool.atomic import replace_folder
from retool.config import ConfigError
from retool.engines.base import AdamParams, ForwardBackwardOutput, OptimStepOutput, run_now
from retool.engines.local.config import LocalEngineConfig
from retool.engines.local import base_spill, hf_compat, lean_decode, memory
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
from retool.engines.local.probe import model_logprobs
from retool.engines.local.sampler import LocalSamplingClient
from retool.engines.local.trained_prefix import TrainedPrefix, decoder_and_head, trained_prefix, usable_prefix_length
from retool.engines.settings import TRAIN_PRECISIONS
from retool.types import Datum

STATE_FORMAT = 1
"""Version of the folder layout ``save_state`` writes."""

HEAD_IN_BF16 = False
"""Whether ``train_precision='bf16'`` runs the output head (hidden x vocabulary, the largest
single matmul: 576 x 49,152 for SmolLM2) under bf16 autocast too. Off: on the demo's RL
step it raised the mean logprob error against fp32 1.7x (0.039 against 0.023) and the
largest gradient difference 2x, for ~20 % of the step's CPU time (``bench/train_memory.py``
variant ``head16``, ``docs/benchmarks.md``)."""


PREFIX_PACKINGS = ("shared-prefix", "prefix-tree")
"""The packed layouts that compute a prefix once (and so can run ``prefix_once``)."""


TRIM_EVERY_MICRO_BATCH = True
"""Hand the memory a micro-batch's activations and logits freed back to the system before
the next one (``memory.release_free_memory``). Without it glibc keeps those freed pages in
its arenas, where the next micro-batch of another shape cannot reuse all of them, and the
process grows over a ``forward_backward`` call: on the demo's RL step (16 trajectories, 4
micro-batches, SmolLM2 fp32) a peak RSS of 2,613-2,798 MiB without it against 2,158-2,189
with it, in the same time and to the same bits (``bench/train_memory.py --variants
chunk=256+ckpt+once+keep,chunk=256+ckpt+once``)."""


TRIM_EVERY_LAYER = True
"""On a CPU, also hand freed memory back after every decoder layer's forward in a training
call (``memory.trim_after_each``): within one micro-batch's forward glibc otherwise spreads
the layers' short-lived tensors over the whole free space of its arenas. On a real RL step
of the demo (seed 131's first: 56 trajectories, 8 micro-batches, fp32, ``prefix-tree``) the
trainer's peak RSS 1,789-1,884 MiB with it against 2,304-2,367 without, the same logprobs
and gradients to the bit, the call 0.95-1.02x the time (``bench/train_memory.py --trajectories
runs/demo/rl/trajectories/step_000001.jsonl.gz --variants
chunk=256+ckpt+once+tree,chunk=256+ckpt+once+tree+nolayertrim``). Trimming before each layer
too bought 10-30 MiB more for more time; trims inside the backward (a gradient hook on each
layer's output) 1.60 against 2.15-2.46 GiB, but at 1.25-1.28x the time: not taken."""


HEAD_GRADIENT_WHERE_TRAINED = True
"""With ``logprob_chunk_tokens``, run the output layer with a gradient only at trained
targets and once per distinct position and target elsewhere (:func:`split_logprobs`).
Off: every target with a gradient, a shared prompt's positions once per datum (the same
values and gradients, more products; ``bench/train_memory.py`` variant ``fullhead``)."""


class LocalTrainingClient:
    """The training role of the local engine (see the module docstring).

    Construction loads the model, applies LoRA (unless ``full_finetune``), optionally
    loads ``init_from`` weights and creates the optimiser. ``sampler`` is the
    :class:`LocalSamplingClient` that shares the model.
    """

    def __init__(self, config: LocalEngineConfig) -> None:
        if config.packing not in algo.PACKINGS:
            raise ValueError(f"unknown packing {config.packing!r}; choose one of {algo.PACKINGS}")
        if config.logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens must be >= 0, got {config.logprob_chunk_tokens}")
        if config.train_precision not in TRAIN_PRECISIONS:
            raise ValueError(f"unknown train_precision {config.train_precision!r}; choose one of {TRAIN_PRECISIONS}")
        self.config = config
        base, self.tokenizer = load_model(config.model, device=config.device, dtype=config.dtype,
                                          trust_remote_code=config.trust_remote_code)
        self.device = base.device
        self.train_precision, self.precision_reason = resolve_train_precision(config.train_precision, self.device)
        self._bf16_compute = False  # the start-up checks below run in fp32; set at the end
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
        self.sampler = LocalSamplingClient(self.model, self.tokenizer, self._lock, seed=config.seed,
                                           settings=config.sampler)
        if config.logprob_chunk_tokens or config.prefix_once:
            check_chunkable(self.model)
        if config.prefix_once:
            _check_prefix_once(config)
        if config.packing != "bucketed":
            self._check_packing_is_exact()
        self._head_apart = _has_separate_head(self.model)
        self._bf16_compute = self.train_precision == "bf16"
        self.base_in_bf16 = self._bf16_compute and self._can_store_base_in_bf16()
        if self.base_in_bf16:
            store_frozen_matrices(self.model, torch.bfloat16)
        if config.sampler.spill_base:
            self._start_spilling()

    def _start_spilling(self) -> None:
        """``LocalSettings.spill_base``: hand the sampler a ``BaseSpill`` of the layers'
        frozen matrices (LoRA, lean loop, a temporary folder on disk), or say in one line why
        not. Every other tensor of the model becomes a copy of its own first: a model loaded
        from safetensors holds its weights as slices of the memory-mapped file, and one
        slice left keeps the whole file mapped and resident."""
        matrices = [] if self.config.full_finetune else lean_decode.layer_matrices(self.model)
        directory = base_spill.spill_directory()
        if self.config.full_finetune:
            why = "a full fine-tune trains them"
        elif self.sampler.decode_loop != "lean" or not matrices:
            why = "the lean decode loop does not cover this model"
        elif directory is None:
            why = "the temporary folder is in memory (set TMPDIR to a folder on disk)"
        else:
            why = ""
        if why:
            print(f"local trainer: spill_base off: {why}", file=sys.stderr, flush=True)
            return
        spilled = {id(m) for m in matrices}
        for tensor in itertools.chain(self.model.parameters(), self.model.buffers()):
            if id(tensor) not in spilled:
                tensor.data = tensor.data.clone()
        self.sampler.base_spill = base_spill.BaseSpill(matrices, directory)

    def _can_store_base_in_bf16(self) -> bool:
        """Whether the frozen base matrices may be kept in bf16 (``store_frozen_matrices``):
        a LoRA run whose every forward runs under bf16 autocast — the trainer's, and the
        sampler's, which then decodes in bf16 from its own merged copy and never runs the
        model's modules (``lean_decode.covers``). An fp32 sampler, the ``own``/``generate``
        decode loops or a full fine-tune keep fp32 weights."""
        return (not self.config.full_finetune and self.sampler.dtype == torch.bfloat16
                and self.sampler.decode_loop == "lean" and lean_decode.covers(self.model))

    @property
    def precision_note(self) -> str:
        """One line for the run's log: the training precision chosen, and why."""
        weights = str(self.model.dtype).removeprefix("torch.")
        if self.base_in_bf16:
            weights = f"frozen base matrices bfloat16, the rest {weights}"
        return f"local trainer: train_precision {self.train_precision} ({self.precision_reason}); weights {weights}"

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
        shared, plan = self._plan(data)
        once = usable_prefix_length(data, shared) if self.config.prefix_once else 0
        stats = _LossStats()
        logprobs_D: list[tuple[float, ...]] = [()] * len(data)
        with self._lock, model_mode(self.model, train=True):
            # The weights change at the next optim_step: the sampler's merged lean weights and
            # stored KV (up to the model's size + kv_cache_mb) would be dropped then; dropping
            # them now (and handing their pages back to the system) keeps them out of the
            # training step's peak memory.
            self.sampler.clear_kv_cache()
            memory.release_free_memory()
            self.sampler.restore_base()
            trimmed = TRIM_EVERY_LAYER and self.device.type == "cpu"  # glibc's heap: a CPU's tensors only
            layers = getattr(decoder_and_head(self.model)[0], "layers", ()) if trimmed else ()
            try:
                with memory.trim_after_each(layers):
                    self._micro_batches(data, plan, once, loss_fn, config, total_weight, stats, logprobs_D)
            except BaseException:  # no partial gradient may reach a later optim_step
                self._discard_gradient()
                raise
        memory.release_free_memory()  # the micro-batches' activations and logits are freed now
        self._pending_gradient = True
        return ForwardBackwardOutput(tuple(logprobs_D), stats.metrics(loss_fn, len(data), len(plan)))

    def _plan(self, data: Sequence[Datum]) -> tuple[int, list[tuple[int, ...]]]:
        """The input prefix every datum shares (with a prefix packing; else 0) and the
        micro-batches of ``data`` under ``micro_batch_tokens``, that prefix counted once each."""
        shared = _shared_prefix_length(data) if self.config.packing in PREFIX_PACKINGS else 0
        plan = algo.plan_micro_batches([d.num_tokens - shared for d in data],
                                       max(1, self.config.micro_batch_tokens - shared), self.config.packing,
                                       sequences_D=[d.input_tokens_N[shared:] for d in data]
                                       if self.config.packing == "prefix-tree" else None)
        return shared, list(plan)

    def _micro_batches(self, data: Sequence[Datum], plan: Sequence[tuple[int, ...]], once: int, loss_fn: str,
                       config: dict[str, float], total_weight: float, stats: _LossStats,
                       logprobs_D: list[tuple[float, ...]]) -> None:
        """The forward and backward of every micro-batch of ``plan`` (and of the call's prefix,
        run once, with ``once``); each datum's logprobs into ``logprobs_D``."""
        prefix = self._trained_prefix(data, once, config["temperature"]) if once else None
        for indices in plan:
            logprobs_B = self._micro_batch_backward(data, indices, loss_fn, config, total_weight, stats, prefix)
            if TRIM_EVERY_MICRO_BATCH:
                memory.release_free_memory()
            for i, logprobs_N in zip(indices, logprobs_B):
                logprobs_D[i] = logprobs_N
        if prefix is not None:
            prefix.backward()

    def _micro_batch_backward(self, data: Sequence[Datum], indices: tuple[int, ...], loss_fn: str,
                              config: dict[str, float], total_weight: float, stats: _LossStats,
                              prefix: TrainedPrefix | None = None) -> list[tuple[float, ...]]:
        """Forward and backward of the datums ``indices``; their share of the token mean.
        With ``prefix`` (computed once for the call) only the datums' suffixes run here."""
        batch = [data[i] for i in indices]
        if prefix is None:
            logprobs_B, entropy_B = self._target_logprobs(batch, config["temperature"])
        else:
            suffix = self._shared_prefix_logprobs(batch, config["temperature"], prefix)
            logprobs_B, entropy_B = prefix.prepend(indices, *suffix)
        logprobs_N = torch.cat(logprobs_B)
        weights_N = self._cat(batch, "weights_N")
        inputs = algo.LossInputs()
        if loss_fn in algo.RL_LOSSES:
            inputs = algo.LossInputs(self._cat(batch, "sampler_logprobs_N"), self._cat(batch, "advantages_N"))
        if loss_fn in algo.RL_LOSSES and algo.behaviour_correction_on(config):
            inputs = self._with_behaviour_weights(batch, logprobs_B, inputs, config, stats)
        terms = algo.LOSSES[loss_fn](logprobs_N, inputs, config)
        loss = algo.weighted_sum(terms.loss_N, weights_N, total_weight)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} in the micro-batch of datums {list(indices)} "
                f"(loss_fn={loss_fn!r}); the pending gradient was discarded, the weights are unchanged")
        if loss.requires_grad:  # not when no target of this micro-batch is trained (split_logprobs)
            loss.backward()
        stats.add(loss, logprobs_N.detach(), weights_N, inputs, terms, torch.cat(entropy_B))
        return [tuple(lp.detach().float().cpu().tolist()) for lp in logprobs_B]

    def _with_behaviour_weights(self, batch: list[Datum], logprobs_B: list[Any], inputs: algo.LossInputs,
                                config: dict[str, float], stats: _LossStats) -> algo.LossInputs:
        """``inputs`` with each datum's sampler-trainer weights (``algo.behaviour_weights``),
        ``pi_old`` being this forward's logprobs, detached."""
        weights_B = []
        for d, logprobs_N in zip(batch, logprobs_B):
            sampler_N = torch.tensor(d.sampler_logprobs_N, dtype=torch.float32, device=self.device)
            trained_N = torch.tensor(d.weights_N, device=self.device) != 0
            weights = algo.behaviour_weights(logprobs_N.detach().float(), sampler_N, trained_N, config)
            stats.add_behaviour(weights, trained_N)
            weights_B.append(weights.weight_N)
        return dataclasses.replace(inputs, behaviour_weights_N=torch.cat(weights_B))

    def _cat(self, batch: list[Datum], name: str) -> Any:
        values = [v for d in batch for v in getattr(d, name)]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _target_logprobs(self, batch: list[Datum], temperature: float) -> tuple[list[Any], list[Any]]:
        """Per datum, ``log_softmax(logits / temperature)`` of each target token, and the
        policy's entropy at each position (detached), from the same forward."""
        if self.config.packing in PREFIX_PACKINGS and len(batch) > 1:
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
        trained = torch.tensor([[w != 0 for w in d.weights_N] + [False] * (width - n) for d, n in zip(batch, lengths)],
                               device=self.device)
        logprobs, entropy = self._policy_logprobs({"input_ids": inputs, "attention_mask": mask}, targets,
                                                  temperature, trained=trained)
        return ([logprobs[row, :n] for row, n in enumerate(lengths)],
                [entropy[row, :n] for row, n in enumerate(lengths)])

    def _packed_logprobs(self, batch: list[Datum], temperature: float) -> tuple[list[Any], list[Any]]:
        lengths = [d.num_tokens for d in batch]
        inputs = torch.tensor([[t for d in batch for t in d.input_tokens_N]], device=self.device)
        targets = torch.tensor([[t for d in batch for t in d.target_tokens_N]], device=self.device)
        positions = torch.tensor([[p for n in lengths for p in range(n)]], device=self.device)
        logprobs, entropy = self._policy_logprobs({"input_ids": inputs, "position_ids": positions}, targets,
                                                  temperature, trained=_trained(batch, self.device)[None])
        return list(logprobs[0].split(lengths)), list(entropy[0].split(lengths))

    def _trained_prefix(self, data: Sequence[Datum], length: int, temperature: float) -> TrainedPrefix:
        """The first ``length`` input tokens of every datum, run once (``prefix_once``)."""
        chunk = self.config.logprob_chunk_tokens
        _, head = decoder_and_head(self.model)

        def logprobs(hidden_NH: Any, targets_N: Any, trained_N: Any, temperature: float) -> tuple[Any, Any]:
            with self._head_autocast():
                if chunk:
                    if not HEAD_GRADIENT_WHERE_TRAINED:
                        trained_N = torch.ones_like(trained_N)
                    return split_logprobs(head, hidden_NH, None, targets_N, trained_N, temperature, chunk)
                scaled = head(hidden_NH).float() / temperature
                return _gather_logprobs(scaled, targets_N), _entropy(scaled)

        return trained_prefix(self.model, data, length, temperature, logprobs, compute=self._autocast)

    def _shared_prefix_logprobs(self, batch: list[Datum], temperature: float,
                                past: TrainedPrefix | None = None) -> tuple[list[Any], list[Any]]:
        """Packed logprobs with the common input prefix of ``batch`` computed once.

        ``shared-prefix``: one row ``[prefix, suffix_1, ..., suffix_B]``: the prefix attends
        causally to itself, each suffix to the whole prefix and causally to itself (a
        custom 4D mask), with the positions it has in its own sequence. ``prefix-tree``:
        one row of the inputs' prefix tree (``algo.prefix_tree``), each node attending to
        its ancestors and itself at its depth, so every prefix that two or more datums
        share (not only the one all share) runs once. Logits at a shared position
        depend only on what precedes it, so they are the same for every datum through
        it; each datum's logprobs gather its own targets from them (gradients add up
        through the gather). With chunked logprobs the shared positions' hidden states
        are gathered instead, so the output projection runs once per datum there (the
        layers below still run once).

        With ``past`` (the call's prefix, computed once) the row holds only what follows
        it: it attends to ``past``'s keys and values too, its positions continue after
        them, and the logprobs returned are those of the targets after ``past``.
        """
        past_length = past.length if past is not None else 0
        inputs_B = [d.input_tokens_N[past_length:] for d in batch]
        lengths = [len(x) for x in inputs_B]
        device = self.device
        if self.config.packing == "prefix-tree":
            tree = algo.prefix_tree(inputs_B)
            tokens = list(tree.tokens_L)
            positions = [past_length + depth for depth in tree.depths_L]
            mask = _ancestor_mask(tree, device)
            rows = torch.tensor([node for path in tree.paths_D for node in path], device=device)
        else:
            tokens, positions, mask, rows = _shared_prefix_layout(inputs_B, past_length, device)
        targets = torch.tensor([t for d in batch for t in d.target_tokens_N[past_length:]], device=device)
        inputs = {"input_ids": torch.tensor([tokens], device=device),
                  "position_ids": torch.tensor([positions], device=device)}
        if past is not None:
            mask = torch.cat([mask.new_ones(len(tokens), past_length), mask], dim=1)
            inputs.update(hf_compat.forward_cache_kwargs(past.cache()))
        inputs["attention_mask"] = mask[None, None]
        with hf_compat.checkpointing_keeps_cache(self.model) if past is not None else contextlib.nullcontext():
            logprobs, entropy = self._policy_logprobs(inputs, targets, temperature, rows=rows,
                                                      trained=_trained(batch, self.device, past_length))
        return list(logprobs.split(lengths)), list(entropy.split(lengths))

    def _policy_logprobs(self, inputs: dict[str, Any], targets: Any, temperature: float,
                         rows: Any = None, trained: Any = None) -> tuple[Any, Any]:
        """Target logprobs and (detached) entropies of one forward, shaped like ``targets``.

        ``rows`` (shared-prefix layout) picks, for each target, the position of the single
        row of ``inputs`` that predicts it. With ``logprob_chunk_tokens`` the output layer
        and log-softmax run chunk by chunk, with a gradient only at the ``trained`` targets
        (a bool tensor like ``targets``; none: all), the others once per distinct position
        and target (:func:`split_logprobs`); otherwise the full logits are built at once.
        """
        chunk = self.config.logprob_chunk_tokens
        if not chunk:
            scaled = self._logits(inputs).float() / temperature
            if rows is not None:
                return _rows_logprobs(scaled[0], rows, targets)
            return _gather_logprobs(scaled, targets), _entropy(scaled)
        decoder, head = decoder_and_head(self.model)
        with self._autocast():
            hidden = decoder(**inputs, use_cache=False).last_hidden_state
        hidden_PH = hidden[0] if rows is not None else hidden.reshape(-1, hidden.shape[-1])
        if trained is None or not HEAD_GRADIENT_WHERE_TRAINED:
            trained = torch.ones_like(targets, dtype=torch.bool)
        with self._head_autocast():
            logprobs, entropy = split_logprobs(head, hidden_PH, rows, targets.reshape(-1), trained.reshape(-1),
                                               temperature, chunk)
        return logprobs.reshape(targets.shape), entropy.reshape(targets.shape)

    def _logits(self, inputs: dict[str, Any]) -> Any:
        """The model's logits for ``inputs``; under bf16, the head apart in fp32 where it can be."""
        if not (self._bf16_compute and self._head_apart):
            with self._autocast():
                return self.model(**inputs, use_cache=False).logits
        decoder, head = decoder_and_head(self.model)
        with self._autocast():
            hidden = decoder(**inputs, use_cache=False).last_hidden_state
        with self._head_autocast():
            return head(hidden)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when training in bf16 (``train_precision``), else nothing."""
        if not self._bf16_compute:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _head_autocast(self) -> contextlib.AbstractContextManager:
        """The output head's arithmetic: fp32 unless ``HEAD_IN_BF16`` (then as the layers')."""
        return self._autocast() if HEAD_IN_BF16 else contextlib.nullcontext()

    def _check_packing_is_exact(self) -> None:
        """Refuse packed layouts (and ``prefix_once``) when they change logprobs (e.g.
        recurrent layers, or attention that ignores a cache). Runs in fp32 (bf16 weights
        upcast for it, and back): whether layers respect packed boundaries does not depend
        on the compute dtype, and bf16 rounding differs between layouts by more than a
        tolerance that would still tell a boundary leak apart."""
        with fp32_weights(self.model):
            diff = self._packing_diff()
        if not diff <= 1e-3:
            raise ConfigError(
                f"packing={self.config.packing!r}{' with prefix_once' * self.config.prefix_once} changes this "
                f"model's logprobs (max diff {diff:.2g}): its layers do not respect packed-sequence boundaries "
                "or a prefix's keys and values. Use packing='bucketed'.")

    def _packing_diff(self) -> float:
        """Largest logprob difference of the packed layouts from running each sequence alone."""
        generator = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, self.vocab_size, (n,), generator=generator).tolist() for n in (7, 12)]
        tokens.append(tokens[1][:5] + tokens[0][:4])  # shares a 5-token prefix with the second
        tokens.append(tokens[1][:8] + tokens[0][:3])  # and an 8-token one (a deeper branch of a prefix tree)
        batch = [Datum(tuple(t[:-1]), tuple(t[1:]), (1.0,) * (len(t) - 1)) for t in tokens]
        with torch.no_grad(), model_mode(self.model, train=False):
            alone = torch.cat([self._packed_logprobs([d], 1.0)[0][0] for d in batch])
            packed = torch.cat(self._packed_logprobs(batch, 1.0)[0])
            diffs = [(packed - alone).abs().max().item()]
            if self.config.packing in PREFIX_PACKINGS:
                shared = torch.cat(self._shared_prefix_logprobs(batch[1:], 1.0)[0])
                diffs.append((shared - alone[6:]).abs().max().item())
            if self.config.prefix_once:
                prefix = self._trained_prefix(batch[1:], 5, 1.0)
                once = prefix.prepend([0, 1, 2], *self._shared_prefix_logprobs(batch[1:], 1.0, prefix))[0]
                diffs.append((torch.cat(once) - alone[6:]).abs().max().item())
        return max(diffs)

    # ------------------------------------------------------------ optimiser

    def optim_step(self, adam_params: AdamParams = AdamParams()) -> OptimStepOutput:
        """One Adam(W) update with the accumulated gradient; then the gradient is cleared.

        Raises ``RuntimeError`` when no ``forward_backward`` preceded it and
        ``FloatingPointError`` (discarding the gradient, not stepping) when the gradient
        norm is not finite.
        """
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
            self.sampler.restore_base()
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
                "train_precision": self.train_precision, "config": asdict(c)}

    def _rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(), "numpy": _plain(np.random.get_state()),
                "sampler_seed": self.sampler.seed, "sampler_calls": self.sampler.calls}

    def _set_rng_state(self, state: dict[str, Any]) -> None:
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

    def compute_logprobs(self, tokens: Sequence[int], start: int) -> tuple[float, ...]:
        """The trainer's teacher-forced logprobs of ``tokens[start:]`` (forward only; the
        weight-sync guard's probe, ``retool.weight_sync``)."""
        with self._lock:
            self.sampler.restore_base()
            # bf16 base matrices run only under autocast: the probe then computes as training does
            return model_logprobs(self.model, tokens, start, self._logits if self.base_in_bf16 else None)

    def save_weights_for_sampler(self, name: str | None = None) -> LocalSamplingClient:
        """The sampler that shares this model: it samples with the current weights.

        Nothing is written (``name`` is accepted for Tinker compatibility); later
        ``optim_step`` calls change what the returned sampler samples with.
        """
        return self.sampler

    def keep_reference(self) -> None:
        """Copy the trainable weights as they are now: the reference policy that
        :meth:`reference_logprobs` scores with (``retool train --kl-coef``). A LoRA adapter
        is a few MB; with ``--full-finetune`` the copy is the whole model."""
        with self._lock:
            self._reference = [p.detach().clone() for p in self.params]

    def reference_logprobs(self, data: Sequence[Datum], temperature: float = 1.0) -> tuple[tuple[float, ...], ...]:
        """Each datum's target logprobs (``log_softmax(logits / temperature)``) under the weights
        :meth:`keep_reference` copied: forward only, in eval mode, micro-batched and packed as
        ``forward_backward`` is. The current weights are swapped back in before the lock is
        released, so training and sampling never see the reference."""
        reference = getattr(self, "_reference", None)
        if reference is None:
            raise RuntimeError("reference_logprobs needs keep_reference() first")
        _validate_data(data, "cross_entropy", self.vocab_size)
        _, plan = self._plan(data)
        out: list[tuple[float, ...]] = [()] * len(data)
        with self._lock, torch.no_grad(), model_mode(self.model, train=False):
            self.sampler.restore_base()
            current = [p.detach().clone() for p in self.params]
            try:
                for p, r in zip(self.params, reference):
                    p.copy_(r)
                for indices in plan:
                    logprobs_B, _ = self._target_logprobs([data[i] for i in indices], temperature)
                    for i, logprobs_N in zip(indices, logprobs_B):
                        out[i] = tuple(logprobs_N.float().cpu().tolist())
            finally:
                for p, c in zip(self.params, current):
                    p.copy_(c)
        memory.release_free_memory()
        return tuple(out)

    def frozen_sampler(self) -> LocalSamplingClient:
        """A sampler on a copy of the current weights that later updates leave alone
        (``retool train --max-staleness``): the frozen base weights are shared with the live
        model, the trainable ones (a LoRA adapter: a few MB) and the buffers copied. With
        ``--full-finetune`` the whole model is copied. The copy has its own lock, so it
        samples while the live model trains."""
        with self._lock:
            self.sampler.stop_spilling()  # the copy shares the frozen matrices: they stay in from now on
            shared: dict[int, Any] = {id(p): p for p in self.model.parameters() if not p.requires_grad}
            model = copy.deepcopy(self.model, memo=shared)
        return LocalSamplingClient(model, self.tokenizer, threading.Lock(), seed=self.sampler.seed,
                                   settings=self.config.sampler)

    def close(self, status: str = "success") -> None:
        """End the run's use of the client: the local engine holds no process or session,
        so this frees the sampler's stored KV caches (up to ``sampler.kv_cache_mb``); the
        model and optimiser go with the client. ``status`` is not recorded anywhere.
        Harmless to call twice; the client still works afterwards (caches refill)."""
        self.sampler.clear_kv_cache()


def create_training_client(**options: Any) -> LocalTrainingClient:
    """The ``local`` entry of ``retool.engines.ENGINES``: options are ``LocalEngineConfig`` fields."""
    return LocalTrainingClient(LocalEngineConfig(**options))


# ---------------------------------------------------------------- training helpers


def resolve_train_precision(choice: str, device: torch.device) -> tuple[str, str]:
    """``(precision, why)`` for ``train_precision`` ``choice`` on ``device``: ``auto`` is
    bf16 on CUDA (where it supports bf16) and on a CPU with native bf16, else fp32 — the
    same probe as the sampler's ``--local-precision auto`` (:func:`lean_decode.native_bf16`),
    so the two never choose differently on one machine."""
    if choice != "auto":
        return choice, "as set"
    native = lean_decode.native_bf16(device)
    if device.type == "cuda":
        return ("bf16", "auto: CUDA") if native else ("fp32", "auto: this GPU has no bf16")
    if native:
        return "bf16", "auto: the CPU has native bf16"
    return "fp32", "auto: the CPU has no native bf16 (it would be emulated, slower than fp32)"


@contextlib.contextmanager
def fp32_weights(model: Any) -> Any:
    """The model's floating-point parameters and buffers in fp32 for a while, then back in
    their own dtypes (exactly: bf16 -> fp32 -> bf16 round-trips). Nothing to do for fp32."""
    tensors = [t for t in itertools.chain(model.parameters(), model.buffers())
               if t.is_floating_point() and t.dtype != torch.float32]
    dtypes = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.float()
    try:
        yield
    finally:
        for t, dtype in zip(tensors, dtypes):
            t.data = t.data.to(dtype)


def store_frozen_matrices(model: Any, dtype: Any) -> None:
    """Keep the frozen weight matrices of the decoder layers' linear products (a LoRA
    run's base weights: 106M of SmolLM2-135M's 135M parameters) in ``dtype``. Under ``train_precision='bf16'`` autocast computes those products with
    bf16 copies of the fp32 weights anyway, so the forward and backward are the same to the
    bit (``tests/test_train_precision.py``) and 212 MB of SmolLM2's memory is freed; the
    embeddings (the tied output head), norms, LoRA and optimiser stay fp32. Every other
    frozen tensor becomes a copy of its own: weights loaded from safetensors are slices of
    the memory-mapped file, and one slice left alive keeps the whole file resident."""
    decoder = lean_decode.decoder_of(model)
    if decoder is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers the bf16 base weights cover")
    cast: set[int] = set()
    for module in decoder.layers.modules():
        if (isinstance(module, torch.nn.Linear) and not module.weight.requires_grad
                and module.weight.is_floating_point() and module.weight.dtype != dtype):
            module.weight.data = module.weight.data.to(dtype)
            cast.add(id(module.weight))
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) not in cast and not tensor.requires_grad:
            tensor.data = tensor.data.clone()
    memory.release_free_memory()


def _has_separate_head(model: Any) -> bool:
    """Whether the model's logits are ``head(decoder(...))`` (``check_chunkable``)."""
    try:
        check_chunkable(model)
    except ValueError:
        return False
    return True


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


def _check_prefix_once(config: LocalEngineConfig) -> None:
    """Refuse ``prefix_once`` where it cannot run."""
    if config.packing not in PREFIX_PACKINGS:
        raise ValueError(f"prefix_once needs packing='shared-prefix' or 'prefix-tree', got packing={config.packing!r}")
    if config.gradient_checkpointing and not hf_compat.checkpointing_keeps_cache_supported():
        raise ValueError(f"prefix_once with gradient_checkpointing needs a transformers release whose "
                         f"checkpointed layers can keep a cache (this is {hf_compat.installed_version()}); "
                         "turn one of them off")


def _trained(batch: Sequence[Datum], device: Any, start: int = 0) -> Any:
    """Whether each target of ``batch`` from position ``start`` on is trained (weight not 0), concatenated."""
    return torch.tensor([w != 0 for d in batch for w in d.weights_N[start:]], dtype=torch.bool, device=device)


def _shared_prefix_layout(inputs_B: Sequence[Sequence[int]], past_length: int,
                          device: Any) -> tuple[list[int], list[int], Any, Any]:
    """The ``shared-prefix`` row of ``inputs_B``: its tokens, positions, attention mask and,
    for each input position of each datum, the row that computes it."""
    shared = common_prefix(inputs_B) if len(inputs_B) > 1 else 0
    lengths = [len(x) for x in inputs_B]
    suffixes = [list(x[shared:]) for x in inputs_B]
    tokens = list(inputs_B[0][:shared]) + [t for s in suffixes for t in s]
    positions = [past_length + p for p in [*range(shared), *(p for n in lengths for p in range(shared, n))]]
    segment = [-1] * shared + [i for i, s in enumerate(suffixes) for _ in s]
    starts, offset = [], shared
    for s in suffixes:
        starts.append(offset)
        offset += len(s)
    seg = torch.tensor(segment, device=device)
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=device).tril()
    mask = causal & ((seg[None, :] == -1) | (seg[None, :] == seg[:, None]))
    rows = torch.tensor([r for start, n in zip(starts, lengths) for r in [*range(shared), *range(start, start + n - shared)]],
                        device=device)
    return tokens, positions, mask, rows


def _ancestor_mask(tree: algo.PrefixTree, device: Any) -> Any:
    """``mask[i, j]``: node ``j`` of ``tree`` is node ``i`` or one of its ancestors.

    The nodes a datum added are the end of its path, numbered in order: their rows are
    their parent's row plus a causal block among themselves."""
    size = len(tree.tokens_L)
    mask = torch.zeros(size, size, dtype=torch.bool)
    seen = 0
    for path in tree.paths_D:
        first = next((k for k, node in enumerate(path) if node >= seen), None)
        if first is None:  # the same tokens as an earlier datum (or a prefix of them)
            continue
        start, end = path[first], path[-1] + 1
        if first:
            mask[start:end] = mask[path[first - 1]]
        mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        seen = end
    return mask.to(device)


def _shared_prefix_length(data: Sequence[Datum]) -> int:
    """Length of the input-token prefix every datum of ``data`` shares (0 for one datum)."""
    return common_prefix([d.input_tokens_N for d in data]) if len(data) > 1 else 0


def _gather_logprobs(scaled: Any, targets: Any) -> Any:
    """``log_softmax(scaled)[target]`` without materialising the full log-softmax."""
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - scaled.logsumexp(-1)


def _rows_logprobs(scaled_PV: Any, rows_N: Any, targets_N: Any) -> tuple[Any, Any]:
    """Logprobs of ``targets_N`` at positions ``rows_N`` of ``scaled_PV``, and entropies there."""
    logprobs_N = scaled_PV[rows_N, targets_N] - scaled_PV.logsumexp(-1)[rows_N]
    return logprobs_N, _entropy(scaled_PV)[rows_N]


ENTROPY_BLOCK_FLOATS = 2**24
"""Floats (64 MiB) of the blocks in which entropies are computed from logits that exist
already: the entropy's extra memory is a small block, not another copy of the logits."""


def _entropy(scaled: Any) -> Any:
    """``-sum(p * log p)`` of ``softmax(scaled)`` over the last axis, detached, block by block."""
    with torch.no_grad():
        flat = scaled.detach().reshape(-1, scaled.shape[-1])
        rows = max(1, ENTROPY_BLOCK_FLOATS // flat.shape[-1])
        blocks = [_block_entropy(block) for block in flat.split(rows)]
        return torch.cat(blocks).reshape(scaled.shape[:-1])


def _block_entropy(scaled_CV: Any) -> Any:
    lse_C = scaled_CV.logsumexp(-1)
    return lse_C - (scaled_CV.softmax(-1) * scaled_CV).sum(-1)


UNCHUNKABLE_CONFIG_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Model-config fields that change logits after the output projection; a model that sets
one is refused ``logprob_chunk_tokens`` (its logits are not ``head(hidden)``)."""


def check_chunkable(model: Any) -> None:
    """Raise ``ValueError`` unless the model's logits are exactly ``head(decoder(...))``."""
    config = getattr(model, "config", None)
    found = [k for k in UNCHUNKABLE_CONFIG_KEYS if getattr(config, k, None) not in (None, 1, 1.0)]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if found or not hasattr(base, "get_decoder") or base.get_output_embeddings() is None:
        why = f"its config sets {found[0]}" if found else "it has no separate decoder and output layer"
        raise ValueError(f"logprob_chunk_tokens needs logits = output_layer(hidden), but {why}; "
                         "set logprob_chunk_tokens=0")


def split_logprobs(head: Any, hidden_PH: Any, rows_N: Any, targets_N: Any, trained_N: Any, temperature: float,
                   chunk_tokens: int) -> tuple[Any, Any]:
    """Target logprobs at positions ``rows_N`` of ``hidden_PH``, with a gradient only where
    the target is trained (``trained_N``: its loss weight is not 0).

    The trained targets go through :func:`chunked_logprobs` (chunks checkpointed, their
    entropies computed). Every other target — prompt, template and interpreter tokens,
    whose loss weight is 0, so whose gradient is 0 anyway — is computed once per distinct
    (position, target) pair, without a graph: one output-layer product each instead of
    three (forward, recomputation, backward), and the shared prompt's positions of a
    ``shared-prefix`` row once instead of once per datum: the demo's SFT step (4 dialogues
    of ~550 tokens, ~120 trained each, after a shared 382-token prompt) 0.76x the FLOPs.
    A trained pair that several datums share (a ``prefix-tree`` node on the path of
    several samples) also runs once, its gradient the sum of theirs. Values and gradients
    are those of computing every target with a gradient (up to the float rounding of a
    matmul split by rows); entropies are computed at the trained targets only (the only
    ones ``train/entropy`` reads) and are 0 elsewhere.
    """
    rows_N = torch.arange(targets_N.numel(), device=targets_N.device) if rows_N is None else rows_N
    trained_T = trained_N.nonzero().squeeze(-1)
    other_O = (~trained_N).nonzero().squeeze(-1)
    logprobs_N = hidden_PH.new_zeros(targets_N.shape, dtype=torch.float32)
    entropy_N = torch.zeros(targets_N.shape, dtype=torch.float32, device=targets_N.device)
    vocab = int(targets_N.max()) + 1 if targets_N.numel() else 1
    if other_O.numel():
        pairs_U, index_O = torch.unique(rows_N[other_O] * vocab + targets_N[other_O], return_inverse=True)
        with torch.no_grad():
            logprobs_U = torch.cat([_gather_logprobs(head(hidden_PH[rows_C // vocab]).float() / temperature,
                                                     rows_C % vocab) for rows_C in pairs_U.split(chunk_tokens)])
        logprobs_N = logprobs_N.index_copy(0, other_O, logprobs_U[index_O])
    if trained_T.numel():
        # a (position, target) pair several datums train (a prefix tree's shared node) runs once;
        # the gather's backward adds their gradients
        pairs_U, index_T = torch.unique(rows_N[trained_T] * vocab + targets_N[trained_T], return_inverse=True)
        logprobs_U, entropy_U = chunked_logprobs(head, hidden_PH[pairs_U // vocab], pairs_U % vocab,
                                                 temperature, chunk_tokens)
        logprobs_N = logprobs_N.index_copy(0, trained_T, logprobs_U[index_T])
        entropy_N = entropy_N.index_copy(0, trained_T, entropy_U[index_T])
    return logprobs_N, entropy_N


def chunked_logprobs(head: Any, hidden_NH: Any, targets_N: Any, temperature: float,
                     chunk_tokens: int) -> tuple[Any, Any]:
    """Target logprobs ``log_softmax(head(hidden) / T)[target]`` and entropies, chunk by chunk.

    Each chunk of ``chunk_tokens`` positions is an activation checkpoint
    (``torch.utils.checkpoint``, non-reentrant): its logits exist only while it is
    computed, and again, one chunk at a time, in the backward. So the peak memory of the
    logits is one ``chunk_tokens x vocabulary`` block (in the forward and the backward)
    instead of ``N x vocabulary``, for one extra output-layer matmul per chunk in the
    backward. Values and gradients are those of the full computation (up to the float
    rounding of a matmul split by rows). Entropies are detached.
    """
    logprobs, entropies = [], []
    for hidden_CH, targets_C in zip(hidden_NH.split(chunk_tokens), targets_N.split(chunk_tokens)):
        logprobs_C, entropy_C = checkpoint(_chunk_terms, head, hidden_CH, targets_C, temperature,
                                           use_reentrant=False)
        logprobs.append(logprobs_C)
        entropies.append(entropy_C)
    return torch.cat(logprobs), torch.cat(entropies).detach()


def _chunk_terms(head: Any, hidden_CH: Any, targets_C: Any, temperature: float) -> tuple[Any, Any]:
    scaled_CV = head(hidden_CH).float() / temperature
    return _gather_logprobs(scaled_CV, targets_C), _entropy(scaled_CV)


@dataclass
class _LossStats:
    """Running sums over the micro-batches of one ``forward_backward`` call."""

    loss: float = 0.0
    tokens: int = 0
    clipped: int = 0
    abs_diff: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_seen: bool = False
    behaviour_tokens: int = 0
    behaviour_ratio: float = 0.0
    behaviour_max: float = 0.0
    behaviour_limited: int = 0

    def add_behaviour(self, weights: algo.BehaviourWeights, trained_N: Any) -> None:
        ratio_N = weights.ratio_N[trained_N]
        self.behaviour_tokens += int(trained_N.sum())
        self.behaviour_ratio += ratio_N.sum().item()
        self.behaviour_max = max(self.behaviour_max, ratio_N.max().item() if ratio_N.numel() else 0.0)
        self.behaviour_limited += int(weights.limited_N.sum())

    def add(self, loss: Any, logprobs_N: Any, weights_N: Any, inputs: algo.LossInputs,
            terms: algo.LossTerms, entropy_N: Any) -> None:
        trained_N = weights_N != 0
        self.loss += loss.item()
        self.tokens += int(trained_N.sum())
        self.entropy += entropy_N[trained_N].sum().item()
        if terms.clipped_N is not None:
            self.clip_seen = True
            self.clipped += int((terms.clipped_N & trained_N).sum())
        if inputs.sampler_logprobs_N is not None:
            diff_N = (logprobs_N - inputs.sampler_logprobs_N)[trained_N]
            self.abs_diff += diff_N.abs().sum().item()
            self.kl += (diff_N.exp() - 1 - diff_N).sum().item()

    def metrics(self, loss_fn: str, sequences: int, micro_batches: int) -> dict[str, float]:
        out = {"train/loss": self.loss, "train/tokens": float(self.tokens),
               "train/sequences": float(sequences), "train/micro_batches": float(micro_batches),
               "train/entropy": self.entropy / self.tokens}
        if loss_fn in algo.RL_LOSSES:
            out["train/sampler_logprob_diff"] = self.abs_diff / self.tokens
            out["train/approx_kl"] = self.kl / self.tokens
        if self.clip_seen:
            out["train/clip_frac"] = self.clipped / self.tokens
        if self.behaviour_tokens:
            out["train/behaviour_ratio_mean"] = self.behaviour_ratio / self.behaviour_tokens
            out["train/behaviour_ratio_max"] = self.behaviour_max
            out["train/behaviour_limited_frac"] = self.behaviour_limited / self.behaviour_tokens
        return out


def _plain(numpy_state: tuple) -> tuple:
    """numpy's RNG state with its key array as a list, so ``torch.load(weights_only=True)`` reads it."""
    kind, keys, pos, has_gauss, cached = numpy_state
    return (kind, keys.tolist(), pos, has_gauss, cached)
