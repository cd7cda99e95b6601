"""KV reuse for the local sampler: the shared-prefix cache and the store of earlier turns.

- Shared-prefix cache: when the rows of one ``generate`` call share a prompt prefix of
  at least :data:`MIN_SHARED_PREFIX` tokens (system prompt and tool declaration; a GRPO
  group's whole question), :func:`prefix_cache` runs it once and repeats its KV for
  every row; :func:`left_pad` lays rows out ``[prefix, padding, own tokens]`` so the
  prefix sits at the same positions in every row.
- :class:`KVStore`: an LRU store, bounded in bytes, of the KV of earlier sequences
  (prompt + sampled tokens but the last) keyed by their tokens. :func:`stored_layout`
  lays rows that continue stored sequences out ``[padding, stored tokens, padding, new
  tokens]`` with the stored KV in place, so only the new tokens are prefilled;
  :func:`store_rows` fills the store after a ``generate`` call.

Both work on plain tensors; turning them into and out of HF cache objects (and the
reserved room of decode steps) is ``hf_compat``'s job. Not covered: models whose cache
is not pure attention (the caller turns reuse off for them), eviction by anything but
recency, sharing the store between processes, and knowing when weights change (the
owner calls :meth:`KVStore.clear`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from retool.engines.local import hf_compat
from retool.engines.local.hf_compat import KV

MIN_SHARED_PREFIX = 16
"""Shortest common prompt prefix the sampler computes once for a whole batch, and
shortest stored sequence worth reusing."""


class KVStore:
    """LRU store of per-sequence KV (``hf_compat.KV``) of at most ``budget_bytes``;
    a budget of 0 stores nothing."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.size = 0

    def clear(self) -> None:
        self.entries.clear()
        self.size = 0

    def lookup(self, prompt: tuple[int, ...]) -> tuple[int, KV] | None:
        """The longest stored sequence that ``prompt`` continues, as (tokens to reuse, KV);
        at least one prompt token is always left to prefill."""
        best: tuple[int, ...] | None = None
        for key in self.entries:
            if len(key) <= len(prompt) and (best is None or len(key) > len(best)) and prompt[:len(key)] == key:
                best = key
        if best is None:
            return None
        self.entries.move_to_end(best)
        return min(len(best), len(prompt) - 1), self.entries[best]

    def remember(self, tokens: tuple[int, ...], kv: KV) -> None:
        if not self.budget_bytes or len(tokens) < MIN_SHARED_PREFIX:
            return
        size = nbytes(kv)
        if size > self.budget_bytes:
            return
        old = self.entries.pop(tokens, None)
        if old is not None:
            self.size -= nbytes(old)
        self.entries[tokens] = kv
        self.size += size
        while self.size > self.budget_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.size -= nbytes(dropped)


def nbytes(kv: KV) -> int:
    """Memory of one stored KV cache (keys and values of every layer)."""
    return sum(k.nbytes + v.nbytes for k, v in kv)


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the prefix every prompt shares."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def shared_prefix_length(prompts: list[tuple[int, ...]]) -> int:
    """The prefix the rows of one call share and the prefix cache may compute once:
    0 when shorter than :data:`MIN_SHARED_PREFIX`; every row keeps one own token."""
    if len(prompts) < 2:
        return 0
    shared = min(common_prefix(prompts), min(len(p) for p in prompts) - 1)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def prefix_cache(model: Any, prefix: tuple[int, ...], rows: int, store: KVStore) -> Any:
    """The HF cache of ``prefix`` repeated for ``rows`` rows (the prefix's KV also goes
    into ``store``), or ``None`` when the model's cache is not pure attention."""
    import torch

    out = model(input_ids=torch.tensor([prefix], device=model.device), use_cache=True)
    cache = hf_compat.cache_of(out)
    if not hf_compat.pure_attention(cache):
        return None
    store.remember(prefix, hf_compat.row_kv(cache, 0))
    return hf_compat.repeat_rows(cache, rows)


def left_pad(prompts: list[tuple[int, ...]], pad_id: int, device: Any, keep: int = 0) -> tuple[Any, Any]:
    """Pad prompts to one width: after the first ``keep`` tokens (a prefix they all share,
    which then sits at the same positions in every row), so at the left when ``keep`` is 0."""
    import torch

    width = max(len(p) for p in prompts)
    ids = [list(p[:keep]) + [pad_id] * (width - len(p)) + list(p[keep:]) for p in prompts]
    mask = [[1] * keep + [0] * (width - len(p)) + [1] * (len(p) - keep) for p in prompts]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def stored_layout(store: KVStore, prompts: list[tuple[int, ...]], shared: int, pad_id: int,
                  device: Any) -> tuple[Any, Any, Any, int] | None:
    """Cache, ids, mask and reused token count that reuse stored KV for every row, or
    ``None`` when a row continues nothing stored or the shared-prefix layout (``shared``
    tokens computed once) would prefill fewer tokens."""
    import torch
    import torch.nn.functional as F

    if not store.budget_bytes or not store.entries:
        return None
    hits = [store.lookup(p) for p in prompts]
    if any(h is None or h[0] < MIN_SHARED_PREFIX for h in hits):
        return None
    rows, longest = len(prompts), max(len(p) for p in prompts)
    reuse_len = max(h[0] for h in hits)
    new_len = max(len(p) - h[0] for p, h in zip(prompts, hits))
    if rows * new_len >= shared + rows * (longest - shared):  # prefill work of each layout
        return None
    ids, mask = [], []
    for p, (n, _) in zip(prompts, hits):
        a, b = reuse_len - n, new_len - (len(p) - n)
        ids.append([pad_id] * a + list(p[:n]) + [pad_id] * b + list(p[n:]))
        mask.append([0] * a + [1] * n + [0] * b + [1] * (len(p) - n))
    layers = []
    for layer in range(len(hits[0][1])):
        keys = [F.pad(kv[layer][0][:, :n], (0, 0, reuse_len - n, 0)) for n, kv in hits]
        values = [F.pad(kv[layer][1][:, :n], (0, 0, reuse_len - n, 0)) for n, kv in hits]
        layers.append((torch.stack(keys), torch.stack(values)))
    return (hf_compat.cache_from_kv(layers), torch.tensor(ids, device=device),
            torch.tensor(mask, device=device), sum(n for n, _ in hits))


def store_rows(store: KVStore, cache: Any, attention_mask: Any, prompts: list[tuple[int, ...]],
               sampled_R: list[tuple[int, ...]]) -> bool:
    """Keep each row's KV (prompt + sampled tokens but the last, whose KV was never
    computed); ``False`` (nothing stored) when the cache is not pure attention."""
    import torch

    if not hf_compat.pure_attention(cache):
        return False
    width = attention_mask.shape[1]
    for k, (prompt, tokens) in enumerate(zip(prompts, sampled_R)):
        kept = len(tokens) - 1
        positions = torch.cat([attention_mask[k].nonzero().squeeze(1),
                               torch.arange(width, width + kept, device=attention_mask.device)])
        store.remember(prompt + tokens[:kept], hf_compat.row_kv(cache, k, positions))
    return True


def store_row(store: KVStore, cache: Any, batch_row: int, prompt_mask: Any, prompt: tuple[int, ...],
              tokens: tuple[int, ...]) -> bool:
    """Keep the KV of one row of a decode loop's batch (prompt + its tokens but the last),
    laid out as ``prompt_mask`` (the prompt's columns) followed by one column per step;
    ``False`` (nothing stored) when the cache is not pure attention."""
    import torch

    if not hf_compat.pure_attention(cache):
        return False
    width, kept = prompt_mask.shape[0], len(tokens) - 1
    positions = torch.cat([prompt_mask.nonzero().squeeze(1),
                           torch.arange(width, width + kept, device=prompt_mask.device)])
    store.remember(prompt + tokens[:kept], hf_compat.row_kv(cache, batch_row, positions))
    return True
