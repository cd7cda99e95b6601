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

Not covered: beam search, stop strings, speculative decoding; caches that are not pure
attention are decoded without dropping rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from retool.engines.local import hf_compat
from retool.engines.local.decoding import RowSampler

DROP_SHARE = 0.25
"""Finished rows are dropped from the batch once they are at least this share of it."""

OnFinished = Callable[[Any, int, int, list[int]], None]
"""``(cache, batch row, original row, its tokens)``: called for a finished row while
its KV is still in ``cache`` (before it is dropped or the loop ends)."""


def decode(model: Any, cache: Any, input_ids: Any, attention_mask: Any, sampler: RowSampler,
           max_tokens_R: Sequence[int], stop_ids: set[int],
           on_finished: OnFinished | None = None) -> list[tuple[list[int], list[float]]]:
    """Tokens and logprobs of every row, each cut at its first stop token (kept) or budget.

    ``cache`` holds the KV of the first ``cache.get_seq_length()`` columns of
    ``input_ids`` (or is ``None``); ``attention_mask`` marks padding with 0.
    """
    import torch

    rows = len(max_tokens_R)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    past = 0 if cache is None else cache.get_seq_length()
    out = model(input_ids=input_ids[:, past:], attention_mask=attention_mask, position_ids=positions[:, past:],
                use_cache=True, logits_to_keep=1, **({} if cache is None else hf_compat.forward_cache_kwargs(cache)))
    cache = hf_compat.cache_of(out)
    can_drop = hf_compat.pure_attention(cache)
    live = list(range(rows))  # original row of each batch row
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in range(rows)]
    finished: set[int] = set()
    next_positions = positions[:, -1:] + 1
    mask = attention_mask
    while True:
        chosen_B, logprobs_B = sampler.draw(out.logits[:, -1], live)
        for b, (token, logprob) in enumerate(zip(chosen_B.tolist(), logprobs_B.tolist())):
            row = live[b]
            if row in finished:
                continue
            tokens, logprobs = results[row]
            tokens.append(token)
            logprobs.append(logprob)
            if token in stop_ids or len(tokens) >= max_tokens_R[row]:
                finished.add(row)
                if on_finished is not None:
                    on_finished(cache, b, row, tokens)
        if len(finished) == rows:
            return results
        done_B = [b for b, row in enumerate(live) if row in finished]
        if can_drop and len(done_B) >= DROP_SHARE * len(live):
            keep = torch.tensor([b for b, row in enumerate(live) if row not in finished], device=mask.device)
            hf_compat.keep_rows(cache, keep)
            live = [live[b] for b in keep.tolist()]
            chosen_B, mask, next_positions = chosen_B[keep], mask[keep], next_positions[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = model(input_ids=chosen_B[:, None], attention_mask=mask, position_ids=next_positions,
                    use_cache=True, **hf_compat.forward_cache_kwargs(cache))
        cache = hf_compat.cache_of(out)
        next_positions = next_positions + 1
