"""The sampler's own decode loop: one prefill, then one forward pass per token, no ``generate``.

:func:`decode` takes a laid-out batch (``kv_cache``'s layouts: left padding, a shared
prefix, stored KV of earlier turns) and draws tokens with ``decoding.RowSampler.draw``
— the same per-row generators, the same logprobs ``log_softmax(logits / T)`` taken
before top-k/top-p, the same stop rule as the ``generate`` path — but calls the model
itself, and drops finished rows from the batch (their KV is handed to ``on_finished``
first, for the KV store) once a quarter of the rows have finished.

What was measured (``torch.profiler``, SmolLM2-135M fp32 with LoRA, 16 rows of 450
tokens; ``docs/benchmarks.md``): a decode step is ~72 % matrix products and ~28 %
attention; HF ``generate``'s own per-step work (processors over the vocabulary,
stopping criteria) is not measurable against that. What ``generate`` wastes is rows: a
row that hit its stop token is computed until the batch's last row finishes, and a step
costs ~11 ms per row above a single row's 45 ms. On the rollout's own requests (most
rows run to their 128-token budget) the two loops were equally fast within the noise of
a shared machine; the saving grows with the spread of the rows' lengths.

The positions are ``generate``'s (``cumsum(mask) - 1`` at padding, ``+1`` per step);
the model sees the same tokens and mask for every row still running, so each row's
tokens and logprobs equal the ``generate`` path's up to the float rounding that a
different batch composition causes (tested within 1e-4).

With ``lean`` weights (``lean_decode``, the sampler's default for Llama/Qwen models) the
prefill of the rows' own columns (after a shared prefix) and every decode step skip the
model's modules: a ``LeanCache`` (the shared prefix once, each row's own columns,
started from stored KV of earlier turns where rows continue them) is filled by
``LeanCache.prefill`` and stepped by ``LeanCache.step``. Without lean weights the
prefill and every step are the model's forward pass over its HF cache.

Not covered: beam search, stop strings, speculative decoding; caches that are not pure
attention are decoded without dropping rows and without lean steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from retool.engines.local import hf_compat, memory
from retool.engines.local.decoding import RowSampler
from retool.engines.local.hf_compat import KV
from retool.engines.local.kv_cache import Restored
from retool.engines.local.lean_decode import DecodeWeights, LeanCache

DROP_SHARE = 0.25
"""Finished rows are dropped from the batch once they are at least this share of it."""

OnFinished = Callable[[Callable[[], KV], int, list[int], list[float], Any], None]
"""``(row's KV, original row, its tokens, their logprobs, its prompt mask)``: called for a
finished row before it is dropped or the loop ends (pure-attention caches only); the
first argument returns the row's KV (per layer keys and values over every column so far,
the HF cache's layout), whose prompt columns the mask marks (the rest: one per step)."""


TRIM_IN_DECODE = True
"""Hand freed memory back to the system after the prefill and, once per step, after rows are
dropped or admitted (their KV buffers are copied into new ones), not only after the batch
(the sampler's own trim, which a continuous loop never reaches): what glibc kept from them
otherwise stayed resident under the batch's steps."""


@dataclass
class Admitted:
    """Rows a running lean decode loop takes in (:func:`decode`'s ``admit``): prefilled
    apart against the loop's shared prefix, with their first logits."""

    cache: LeanCache
    logits_B: Any
    prompt_masks: list[Any]
    """Each row's mask over its prompt's columns (the shared prefix's included): what
    ``on_finished`` gets for it."""
    max_tokens: list[int]
    next_positions: Any


Admit = Callable[[LeanCache, int], "list[Admitted]"]
"""``admit(cache, running)``: rows for a lean loop whose ``cache`` holds ``running`` rows
still decoding (finished ones are about to leave it), in prefilled parts (none: nothing
to take); it draws the new rows' generators into the loop's ``RowSampler`` itself (their
rows are numbered after the ones before, part after part)."""


def decode(model: Any, cache: Any, input_ids: Any, attention_mask: Any, sampler: RowSampler,
           max_tokens_R: Sequence[int], stop_ids: set[int], on_finished: OnFinished | None = None,
           lean: DecodeWeights | None = None, admit: Admit | None = None) -> list[tuple[list[int], list[float]]]:
    """Tokens and logprobs of every row, each cut at its first stop token (kept) or budget.

    Without ``lean`` weights, ``cache`` is an HF cache holding the KV of the first
    ``cache.get_seq_length()`` columns of ``input_ids`` (or ``None``); with them
    (``lean_decode``) it is a ``kv_cache.Restored`` (or ``None``) and the prefill and
    every step are lean. ``attention_mask`` marks padding with 0.

    ``admit`` (lean only) is asked for more rows whenever finished rows leave the batch
    (a quarter of it, or all): rows it returns join the running ones at the next step
    (continuous batching), numbered after every row before them, and the loop ends
    when no row is left and it has none to give. ``on_finished`` gets each row's prompt mask as it
    is laid out by then.
    """
    rows = len(max_tokens_R)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    if lean is not None:
        step, logits_B = LeanCache.prefill(lean, cache, input_ids, attention_mask, positions, max(max_tokens_R))
        can_drop = True
        prefix_len = (cache or Restored()).prefix_len
    else:
        past = 0 if cache is None else cache.get_seq_length()
        out = model(input_ids=input_ids[:, past:], attention_mask=attention_mask, position_ids=positions[:, past:],
                    use_cache=True, logits_to_keep=1,
                    **({} if cache is None else hf_compat.forward_cache_kwargs(cache)))
        can_drop = hf_compat.pure_attention(hf_compat.cache_of(out))
        step = _HFSteps(model, hf_compat.cache_of(out), attention_mask)
        logits_B = out.logits[:, -1]
        admit = None
    del cache
    if TRIM_IN_DECODE:
        memory.release_free_memory()  # the prefill's activations and scores: not under every step of the batch
    live = list(range(rows))  # original row of each batch row
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in range(rows)]
    masks = list(attention_mask)  # each original row's prompt mask
    budgets = list(max_tokens_R)
    finished: set[int] = set()
    next_positions = positions[:, -1] + 1
    while True:
        chosen_B, logprobs_B = sampler.draw(logits_B, live)
        for b, (token, logprob) in enumerate(zip(chosen_B.tolist(), logprobs_B.tolist())):
            row = live[b]
            if row in finished:
                continue
            tokens, logprobs = results[row]
            tokens.append(token)
            logprobs.append(logprob)
            if token in stop_ids or len(tokens) >= budgets[row]:
                finished.add(row)
                if on_finished is not None and can_drop:
                    on_finished(functools.partial(step.row_kv, b), row, tokens, logprobs, masks[row])
        done_B = [b for b, row in enumerate(live) if row in finished]
        running = len(live) - len(done_B)
        new = admit(step, running) if admit is not None and (not running or len(done_B) >= DROP_SHARE * len(live)) \
            else []
        if not running and not new:
            return results
        copied = bool(can_drop and done_B and (new or len(done_B) >= DROP_SHARE * len(live)))
        if copied:
            keep = torch.tensor([b for b, row in enumerate(live) if row not in finished], device=chosen_B.device,
                                dtype=torch.long)
            dropped = step.keep_rows(keep, trim_front=True)
            live = [live[b] for b in keep.tolist()]
            if dropped:
                kept = set(live)
                masks = [_without_front(m, prefix_len, dropped) if r in kept else m for r, m in enumerate(masks)]
            chosen_B, next_positions = chosen_B[keep], next_positions[keep]
        if live:
            logits_B = step.step(chosen_B, next_positions)
            next_positions = next_positions + 1
        else:
            logits_B = logits_B[:0]
        for part in new:
            first = len(results)
            front_old, front_new = step.admit(part.cache)
            running_rows = set(live)
            masks = [_after_prefix(m, prefix_len, front_old) if r in running_rows else m for r, m in enumerate(masks)]
            masks += [_after_prefix(m, prefix_len, front_new) for m in part.prompt_masks]
            budgets += part.max_tokens
            results += [([], []) for _ in part.max_tokens]
            live += list(range(first, len(results)))
            logits_B = torch.cat([logits_B, part.logits_B])
            next_positions = torch.cat([next_positions, part.next_positions])
        if TRIM_IN_DECODE and (copied or new):
            # once per iteration: the larger KV buffers the kept rows were copied out of, the
            # admitted rows' prefill and the buffers their columns were copied out of
            memory.release_free_memory()


def _after_prefix(mask: Any, prefix_len: int, columns: int) -> Any:
    """``mask`` with ``columns`` masked columns put after its first ``prefix_len``."""
    if not columns:
        return mask
    return torch.cat([mask[:prefix_len], mask.new_zeros(columns), mask[prefix_len:]])


def _without_front(mask: Any, prefix_len: int, columns: int) -> Any:
    """``mask`` without the ``columns`` (masked) columns after its first ``prefix_len``."""
    return torch.cat([mask[:prefix_len], mask[prefix_len + columns:]])


class _HFSteps:
    """Decode steps through the model's own forward pass and its HF cache."""

    def __init__(self, model: Any, cache: Any, attention_mask: Any) -> None:
        self.model, self.cache, self.mask = model, cache, attention_mask

    def step(self, tokens_B: Any, positions_B: Any) -> Any:
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        out = self.model(input_ids=tokens_B[:, None], attention_mask=self.mask, position_ids=positions_B[:, None],
                         use_cache=True, **hf_compat.forward_cache_kwargs(self.cache))
        self.cache = hf_compat.cache_of(out)
        return out.logits[:, -1]

    def keep_rows(self, index: Any, trim_front: bool = False) -> int:
        """Keep only the batch rows ``index``; HF caches keep their columns (0 dropped)."""
        hf_compat.keep_rows(self.cache, index)
        self.mask = self.mask[index]
        return 0

    def row_kv(self, row: int) -> KV:
        return hf_compat.row_kv(self.cache, row)
