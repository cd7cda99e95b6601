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
(the same draws whatever else shares its batch; the same tokens up to the float
rounding of the batch's layout, which in bf16 can change a token: ``SamplingParams``)
and from ``(config.seed, generate calls so far, row position)``
otherwise (the same run of requests, batched the same way, repeats exactly;
``save_state``/``load_state`` carry the seed and call counter).

Model defaults such as a shipped ``generation_config`` with ``top_k=20`` are ignored on
purpose: the caller's ``SamplingParams`` are the whole truth about how tokens are drawn.

KV reuse across turns: the sampler keeps the KV cache of every sequence it generated
(prompt + sampled tokens) in a bounded LRU store, so the next turn of a trajectory —
its previous context, the tool message, a new assistant header — prefills only the new
tokens instead of the whole context; any change of weights (``optim_step``,
``load_state``) empties the store.

Fast path: the prefix cache, the KV store and the decode steps' reserved room reach into
transformers' cache internals; they run only on a transformers release in
``hf_compat.TESTED_TRANSFORMERS`` and can be switched off (``LocalSettings.fast_sampling=False``
or ``RETOOL_FAST_SAMPLING=0``). Off, the sampler calls plain ``generate``: same tokens, slower.

Modules, each using only the ones listed after it:

- ``trainer``: ``LocalTrainingClient`` (forward/backward, micro-batches, packing, Adam,
  checkpoints) and ``create_training_client``.
- ``trained_prefix``: the prompt prefix of a training call, run once for all its micro-batches.
- ``sampler``: ``LocalSamplingClient`` (request batching, layouts, the choice of loop).
- ``decode_loop``: the sampler's own decode loop (one forward per token, finished rows dropped).
- ``lean_decode``: lean decode steps for Llama/Qwen models (merged weights, shared-prefix attention).
- ``decoding``: the row sampler (logprobs, top-k/top-p, draws), stopping criterion, per-row seeding.
- ``memory``: glibc arena cap and ``malloc_trim`` after every batch.
- ``kv_cache``: shared-prefix cache and the LRU store of earlier sequences' KV.
- ``hf_compat``: everything that touches transformers' cache internals, version check.
- ``model``: loading, device/dtype, LoRA, neutral generation config.
- ``config``: ``LocalEngineConfig``.

Not covered: multiple GPUs, quantised (QLoRA) training, stop strings, speculative decoding.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from retool.engines import EngineSampler, LocalSettings, ModelConfig, SamplerRequest
from retool.engines.local.config import LocalEngineConfig
from retool.engines.local.model import (
    apply_lora,
    default_stop_token_ids,
    load_model,
    load_weights,
    resolve_device,
    resolve_dtype,
)
from retool.engines.local.sampler import LocalSamplingClient
from retool.engines.local.trainer import STATE_FORMAT, LocalTrainingClient, create_training_client

__all__ = [
    "STATE_FORMAT", "LocalEngineConfig", "LocalSamplingClient", "LocalTrainingClient", "apply_lora",
    "create_training_client", "default_stop_token_ids", "load_model", "resolve_device", "resolve_dtype",
    "sampler", "training_client",
]


def training_client(cfg: ModelConfig, seed: int, init_from: str | None) -> LocalTrainingClient:
    """The training client a ``retool train``/``retool sft`` config describes, starting
    from the weights in the checkpoint folder ``init_from`` when given."""
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else tuple(cfg.lora_targets.split(","))
    client = LocalTrainingClient(LocalEngineConfig(
        model=cfg.model, full_finetune=cfg.full_finetune, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
        lora_targets=targets, device=cfg.device, dtype=cfg.dtype,
        gradient_checkpointing=cfg.gradient_checkpointing, micro_batch_tokens=cfg.micro_batch_tokens,
        packing=cfg.packing, logprob_chunk_tokens=cfg.logprob_chunk_tokens, prefix_once=cfg.prefix_once, seed=seed,
        train_precision=cfg.train_precision, init_from=init_from,
        sampler=cfg.local))
    print(client.precision_note, file=sys.stderr)
    return client


def sampler(request: SamplerRequest) -> EngineSampler:
    """A sampler only, for ``retool eval``: the base model, or a checkpoint's weights in
    the adapter shape it was saved with. No optimiser and no gradients are set up; the
    weights never change, so the sampler frees the model's matrices once it holds its
    merged copy (``LocalSamplingClient(frozen=True)``; in fp32 too)."""
    model, tokenizer = load_model(request.model, device=request.device, dtype=request.dtype)
    checkpoint = request.checkpoint
    if checkpoint is not None:
        if not checkpoint.full_finetune:
            model = apply_lora(model, _adapter_config(request.model, checkpoint.lora or {}))
        load_weights(model, Path(request.checkpoint_dir), checkpoint.full_finetune)
    model.requires_grad_(False)
    client = LocalSamplingClient(model, tokenizer, threading.Lock(), seed=request.seed,
                                 settings=request.settings or LocalSettings(), frozen=True)
    return EngineSampler(tokenizer, client)


def _adapter_config(model: str, lora: dict[str, Any]) -> LocalEngineConfig:
    targets = lora.get("targets", "all-linear")
    return LocalEngineConfig(model=model, lora_rank=lora.get("rank", 32), lora_alpha=lora.get("alpha", 32.0),
                             lora_dropout=lora.get("dropout", 0.0),
                             lora_targets=tuple(targets) if isinstance(targets, list) else targets)
