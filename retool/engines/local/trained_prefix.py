"""The prompt prefix of a training call, computed once for all its micro-batches.

Every datum of an RL or SFT batch starts with the same rendered system prompt (tool
instructions), often the longest part of a sequence. :func:`trained_prefix` runs that
prefix through the model once per ``forward_backward`` call (batch 1, with gradients,
LoRA active) and keeps what the micro-batches need from it as leaf tensors: each
layer's keys and values, and the logprobs (and entropies) of every datum's targets at
the prefix's positions (the last of them predicts the datum's first suffix token). A
micro-batch then runs only its datums' suffixes against those keys and values
(``hf_compat.read_only_cache``, positions offset by the prefix length), and its
backward adds gradients into the leaves; :meth:`TrainedPrefix.backward`, after the last
micro-batch, sends those summed gradients through the prefix's own graph once. Logprobs
and gradients equal those of running every datum whole (up to float rounding).

Not covered: models whose logits are not ``output_layer(decoder(...))`` or that are not
pure attention (the trainer refuses the switch for them); sharing beyond the prefix all
datums of the call have in common (the trainer's ``shared-prefix`` packing shares a
micro-batch's further common prefix inside its packed row).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from retool.engines.local import hf_compat
from retool.types import Datum


@dataclass(frozen=True)
class TrainedPrefix:
    """The shared prefix of one call: its length, its graph's outputs and their leaves.

    ``kv_leaves`` (per layer ``(keys, values)``, batch 1) are what the micro-batches attend
    to; ``logprob_leaf_U`` holds the logprobs of the ``U`` distinct (position, target)
    pairs of the prefix over all datums, ``index_DP`` picks each datum's ``P`` of them.
    """

    length: int
    kv_leaves: hf_compat.KV
    kv_outputs: hf_compat.KV
    logprob_leaf_U: Any
    logprob_output_U: Any
    entropy_U: Any
    index_DP: Any

    def cache(self) -> Any:
        """A fresh read-only cache over the prefix's keys and values, for one micro-batch."""
        return hf_compat.read_only_cache(self.kv_leaves, len(self.kv_leaves))

    def prepend(self, indices: Sequence[int], logprobs_B: list[Any],
                entropy_B: list[Any]) -> tuple[list[Any], list[Any]]:
        """Each datum's prefix logprobs and entropies put before its suffix's."""
        rows = [self.index_DP[i] for i in indices]
        return ([torch.cat([self.logprob_leaf_U[r], lp]) for r, lp in zip(rows, logprobs_B)],
                [torch.cat([self.entropy_U[r], e]) for r, e in zip(rows, entropy_B)])

    def backward(self) -> None:
        """Send the gradients the micro-batches left in the leaves through the prefix's graph."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self._outputs(), self._leaves()) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])

    def _outputs(self) -> list[Any]:
        return [self.logprob_output_U, *(t for kv in self.kv_outputs for t in kv)]

    def _leaves(self) -> list[Any]:
        return [self.logprob_leaf_U, *(t for kv in self.kv_leaves for t in kv)]


def usable_prefix_length(data: Sequence[Datum], common: int) -> int:
    """The prefix to compute once: the common input prefix ``common`` of ``data``, less
    what keeps at least one suffix token in every datum (0: not worth it or impossible)."""
    if len(data) < 2:
        return 0
    return max(0, min([common] + [d.num_tokens - 1 for d in data]))


def trained_prefix(model: Any, data: Sequence[Datum], length: int, temperature: float, logprobs: Any,
                   compute: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> TrainedPrefix:
    """Run the first ``length`` input tokens (shared by every datum of ``data``) once.

    ``logprobs(hidden_NH, targets_N, trained_N, temperature)`` turns hidden states into
    target logprobs and detached entropies (the trainer's output layer, whole or in
    chunks); ``trained_N`` says which (position, target) pairs some datum trains (loss
    weight not 0), the only ones that need a gradient.
    ``compute()`` is the context the layers below the head run in (the trainer's bf16
    autocast, or nothing): their keys and values then have its dtype, as the
    micro-batches' own do. The deferred backward needs no context (autograd keeps each
    operation's dtype; checkpointed layers recompute under the one they ran in).
    """
    device = model.device
    tokens = torch.tensor([list(data[0].input_tokens_N[:length])], device=device)
    targets_DP = torch.tensor([list(d.target_tokens_N[:length]) for d in data], device=device)
    vocab = int(targets_DP.max()) + 1
    positions_DP = torch.arange(length, device=device).expand_as(targets_DP)
    pairs_U, index_DP = torch.unique(positions_DP * vocab + targets_DP, return_inverse=True)
    trained_DP = torch.tensor([[w != 0 for w in d.weights_N[:length]] for d in data], device=device)
    trained_U = torch.zeros(len(pairs_U), dtype=torch.bool, device=device)
    trained_U[index_DP[trained_DP]] = True
    decoder, _ = decoder_and_head(model)
    cache = hf_compat.read_only_cache(None, decoder.config.num_hidden_layers)
    with hf_compat.checkpointing_keeps_cache(model), compute():
        hidden = decoder(input_ids=tokens, **hf_compat.forward_cache_kwargs(cache), use_cache=False).last_hidden_state
    logprob_U, entropy_U = logprobs(hidden[0][pairs_U // vocab], pairs_U % vocab, trained_U, temperature)
    kv_outputs = hf_compat.recorded_kv(cache)
    kv_leaves = tuple((k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
                      for k, v in kv_outputs)
    leaf_U = logprob_U.detach().requires_grad_(logprob_U.requires_grad)
    return TrainedPrefix(length, kv_leaves, kv_outputs, leaf_U, logprob_U, entropy_U.detach(), index_DP)


def decoder_and_head(model: Any) -> tuple[Any, Any]:
    """The layers below the output projection and the projection itself (PEFT-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()
