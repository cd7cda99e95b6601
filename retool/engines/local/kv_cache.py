"""KV reuse for the local sampler: the shared-prefix cache and the store of earlier turns.

- Shared-prefix cache: when the rows of one ``generate`` call share a prompt prefix of
  at least :data:`MIN_SHARED_PREFIX` tokens (system prompt and tool declaration; a GRPO
  group's whole question), :func:`prefix_kv` runs it once (the HF paths repeat its KV
  for every row, :func:`repeated_cache`; the lean steps read one copy);
  :func:`left_pad` lays rows out ``[prefix, padding, own tokens]`` so the prefix sits
  at the same positions in every row.
- :class:`KVStore`: an LRU store, bounded in bytes, of the KV of earlier sequences
  (prompt + sampled tokens but the last) keyed by their tokens; a sequence that extends
  a stored one (the system prompt) keeps only its own columns. :func:`stored_layout`
  lays rows that continue stored sequences out ``[padding, stored tokens, padding, new
  tokens]`` with the stored KV in place, so only the new tokens are prefilled;
  :func:`restored_layout` does the same for the lean prefill without building an HF
  cache (:class:`Restored`: the shared prefix once, each row's stored KV referenced);
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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from retool.engines.local import hf_compat
from retool.engines.local.hf_compat import KV

MIN_SHARED_PREFIX = 16
"""Shortest common prompt prefix the sampler computes once for a whole batch, and
shortest stored sequence worth reusing."""


@dataclass
class StoredKV:
    """One stored sequence: the KV of its columns after its ``parent`` (the longest stored
    sequence it extends when it was stored: e.g. the system prompt a trajectory starts
    with), which is then not stored again."""

    parent: tuple[int, ...] | None
    tail: KV
    children: int = 0
    """Stored sequences whose parent this is (it is not evicted while they are stored)."""


class KVStore:
    """LRU store of per-sequence KV (``hf_compat.KV``) of at most ``budget_bytes``;
    a budget of 0 stores nothing.

    A sequence that extends a stored one (a trajectory after its stored system prompt or
    earlier turn) keeps only its own columns and refers to it: the store holds the
    system prompt's KV once, not once per trajectory (~3/4 of a demo trajectory's KV).
    ``size`` counts every stored tensor once; an entry others refer to is evicted only
    after them."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], StoredKV] = OrderedDict()
        self.size = 0

    def resize(self, budget_bytes: int) -> None:
        """Set the budget, evicting least recently used entries down to it now."""
        self.budget_bytes = budget_bytes
        self._evict()

    def clear(self) -> None:
        self.entries.clear()
        self.size = 0

    def _longest(self, prompt: tuple[int, ...], shorter: bool) -> tuple[int, ...] | None:
        """The longest stored key that ``prompt`` starts with (strictly shorter with ``shorter``)."""
        best: tuple[int, ...] | None = None
        for key in self.entries:
            fits = len(key) < len(prompt) if shorter else len(key) <= len(prompt)
            if fits and (best is None or len(key) > len(best)) and prompt[:len(key)] == key:
                best = key
        return best

    def lookup(self, prompt: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
        """The longest stored sequence that ``prompt`` continues, as (tokens to reuse, its
        key for :meth:`columns`); at least one prompt token is always left to prefill."""
        best = self._longest(prompt, shorter=False)
        if best is None:
            return None
        self._touch(best)
        return min(len(best), len(prompt) - 1), best

    def columns(self, key: tuple[int, ...], start: int, stop: int) -> KV:
        """Per layer ``(keys, values)`` of columns ``start .. stop`` of the stored sequence
        ``key``: views of stored tensors when they lie in one entry, else a copy."""
        entry = self.entries[key]
        base = 0 if entry.parent is None else len(entry.parent)
        if start >= base:
            return tuple((k[:, start - base:stop - base], v[:, start - base:stop - base]) for k, v in entry.tail)
        head = self.columns(entry.parent, start, min(stop, base))
        if stop <= base:
            return head
        return tuple((torch.cat([hk, k[:, :stop - base]], dim=1), torch.cat([hv, v[:, :stop - base]], dim=1))
                     for (hk, hv), (k, v) in zip(head, entry.tail))

    def remember(self, tokens: tuple[int, ...], kv: KV, positions: Any = None) -> None:
        """Store the KV of ``tokens``: per layer ``(kv_heads, columns, head_dim)``, the
        tokens' columns being ``positions`` (a 1-D index; ``None``: all, in order). Only
        the columns after a stored parent are copied."""
        if not self.budget_bytes or len(tokens) < MIN_SHARED_PREFIX:
            return
        if tokens in self.entries:
            self._touch(tokens)
            return
        parent = self._longest(tokens, shorter=True)
        if parent is not None and len(parent) < MIN_SHARED_PREFIX:
            parent = None
        cut = 0 if parent is None else len(parent)
        if positions is not None:
            tail = tuple((k[:, positions[cut:]], v[:, positions[cut:]]) for k, v in kv)  # copies
        else:
            tail = tuple((k[:, cut:].clone(), v[:, cut:].clone()) if cut else (k, v) for k, v in kv)
        size = nbytes(tail)
        if size > self.budget_bytes:
            return
        if parent is not None:
            self.entries[parent].children += 1
            self._touch(parent)
        self.entries[tokens] = StoredKV(parent, tail)
        self.size += size
        self._evict()

    def _touch(self, key: tuple[int, ...]) -> None:
        """Mark ``key`` and the entries it refers to as just used."""
        while key is not None:
            self.entries.move_to_end(key)
            key = self.entries[key].parent

    def _evict(self) -> None:
        """Drop least recently used entries no other entry refers to until within budget."""
        while self.size > self.budget_bytes:
            key = next(k for k, e in self.entries.items() if not e.children)
            entry = self.entries.pop(key)
            self.size -= nbytes(entry.tail)
            if entry.parent is not None:
                self.entries[entry.parent].children -= 1


def nbytes(kv: KV) -> int:
    """Memory of one stored KV cache (keys and values of every layer)."""
    return sum(k.nbytes + v.nbytes for k, v in kv)


def kv_bytes_per_token(model: Any, dtype: Any = None) -> int:
    """Bytes of keys and values one token takes in a pure-attention cache of ``model``
    (every layer, at ``dtype``, default the model's: a bf16 sampler's cache takes half);
    0 when its config does not say."""
    config = model.config
    layers, heads = getattr(config, "num_hidden_layers", 0), getattr(config, "num_attention_heads", 0)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return 2 * layers * kv_heads * head_dim * (dtype or model.dtype).itemsize


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


def prefix_kv(model: Any, prefix: tuple[int, ...], store: KVStore) -> KV | None:
    """The KV of ``prefix`` (one row; it also goes into ``store``), or ``None`` when the
    model's cache is not pure attention."""
    out = model(input_ids=torch.tensor([prefix], device=model.device), use_cache=True, logits_to_keep=1)
    cache = hf_compat.cache_of(out)
    if not hf_compat.pure_attention(cache):
        return None
    kv = hf_compat.row_kv(cache, 0)
    store.remember(prefix, kv)
    return kv


def repeated_cache(kv: KV, rows: int) -> Any:
    """An HF cache holding one row's KV repeated for ``rows`` rows (the HF paths' prefix cache)."""
    return hf_compat.repeat_rows(hf_compat.cache_from_kv([(k[None], v[None]) for k, v in kv]), rows)


def left_pad(prompts: list[tuple[int, ...]], pad_id: int, device: Any, keep: int = 0) -> tuple[Any, Any]:
    """Pad prompts to one width: after the first ``keep`` tokens (a prefix they all share,
    which then sits at the same positions in every row), so at the left when ``keep`` is 0."""
    width = max(len(p) for p in prompts)
    ids = [list(p[:keep]) + [pad_id] * (width - len(p)) + list(p[keep:]) for p in prompts]
    mask = [[1] * keep + [0] * (width - len(p)) + [1] * (len(p) - keep) for p in prompts]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


@dataclass(frozen=True)
class Restored:
    """KV a lean prefill starts from (``lean_decode.LeanCache.prefill``), without an HF
    cache: the rows' shared prefix once (per layer ``(kv_heads, P, head_dim)``; ``()`` for
    none) and, for rows that continue stored sequences, each row's stored columns after
    that prefix: ``rows[i] = (column, kv)`` puts ``kv`` (per layer ``(kv_heads, n,
    head_dim)``) at the row's own columns ``column .. column + n`` of ``width`` restored
    own columns (the others are padding)."""

    prefix: KV = ()
    rows: tuple[tuple[int, KV], ...] = ()
    width: int = 0

    @property
    def prefix_len(self) -> int:
        return self.prefix[0][0].shape[1] if self.prefix else 0

    @property
    def columns(self) -> int:
        """Leading columns of the batch whose KV this holds."""
        return self.prefix_len + self.width


def _hits(store: KVStore, prompts: list[tuple[int, ...]], shared: int) -> list[tuple[int, tuple[int, ...]]] | None:
    """The stored sequence every prompt continues, or ``None`` when a row continues
    nothing stored or the shared-prefix layout (``shared`` tokens computed once) would
    prefill fewer tokens."""
    if not store.budget_bytes or not store.entries:
        return None
    hits = [store.lookup(p) for p in prompts]
    if any(h is None or h[0] < MIN_SHARED_PREFIX for h in hits):
        return None
    rows, longest = len(prompts), max(len(p) for p in prompts)
    new_len = max(len(p) - h[0] for p, h in zip(prompts, hits))
    if rows * new_len >= shared + rows * (longest - shared):  # prefill work of each layout
        return None
    return hits


def _stored_ids(prompts: list[tuple[int, ...]], reused_R: list[int], keep: int, pad_id: int,
                device: Any) -> tuple[Any, Any]:
    """Ids and mask ``[first keep tokens, padding, rest of the reused tokens, padding, new tokens]``."""
    reuse_len = max(reused_R)
    new_len = max(len(p) - n for p, n in zip(prompts, reused_R))
    ids, mask = [], []
    for p, n in zip(prompts, reused_R):
        a, b = reuse_len - n, new_len - (len(p) - n)
        ids.append(list(p[:keep]) + [pad_id] * a + list(p[keep:n]) + [pad_id] * b + list(p[n:]))
        mask.append([1] * keep + [0] * a + [1] * (n - keep) + [0] * b + [1] * (len(p) - n))
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def stored_layout(store: KVStore, prompts: list[tuple[int, ...]], shared: int, pad_id: int,
                  device: Any) -> tuple[Any, Any, Any, int] | None:
    """HF cache, ids, mask and reused token count that reuse stored KV for every row
    (laid out ``[padding, stored tokens, padding, new tokens]``), or ``None`` (see
    :func:`_hits`)."""
    hits = _hits(store, prompts, shared)
    if hits is None:
        return None
    reuse_len = max(n for n, _ in hits)
    ids, mask = _stored_ids(prompts, [n for n, _ in hits], 0, pad_id, device)
    stored = [store.columns(key, 0, n) for n, key in hits]
    layers = []
    for layer in range(len(stored[0])):
        keys = [F.pad(kv[layer][0], (0, 0, reuse_len - n, 0)) for (n, _), kv in zip(hits, stored)]
        values = [F.pad(kv[layer][1], (0, 0, reuse_len - n, 0)) for (n, _), kv in zip(hits, stored)]
        layers.append((torch.stack(keys), torch.stack(values)))
    return hf_compat.cache_from_kv(layers), ids, mask, sum(n for n, _ in hits)


def restored_layout(store: KVStore, prompts: list[tuple[int, ...]], shared: int, pad_id: int,
                    device: Any, most: int | None = None) -> tuple[Restored, Any, Any, int] | None:
    """:class:`Restored` KV, ids, mask and reused token count that reuse stored KV for
    every row, for the lean prefill, or ``None`` (see :func:`_hits`). Rows are laid out
    ``[shared prefix, padding, rest of the stored tokens, padding, new tokens]``: the
    prefix the prompts share within their stored tokens (at least
    :data:`MIN_SHARED_PREFIX`, else none; at most ``most``) is kept once (the first row's
    stored KV of it), each row's other stored KV is referenced, not copied (where it lies
    in one entry)."""
    hits = _hits(store, prompts, shared)
    if hits is None:
        return None
    reused_R = [n for n, _ in hits]
    keep = min(common_prefix(prompts), min(reused_R), most if most is not None else len(prompts[0]))
    keep = keep if keep >= MIN_SHARED_PREFIX else 0
    width = max(reused_R) - keep
    ids, mask = _stored_ids(prompts, reused_R, keep, pad_id, device)
    prefix = store.columns(hits[0][1], 0, keep) if keep else ()
    rows = tuple((width - (n - keep), store.columns(key, keep, n)) for n, key in hits)
    return Restored(prefix, rows, width), ids, mask, sum(reused_R)


def stored_hit(store: KVStore, prompt: tuple[int, ...], keep: int) -> tuple[int, tuple[int, ...]] | None:
    """The stored sequence ``prompt`` continues beyond its first ``keep`` tokens (the
    running loop's shared prefix; and at least :data:`MIN_SHARED_PREFIX` tokens), as
    :meth:`KVStore.lookup` gives it, else ``None``. A row whose own earlier turn was
    evicted still continues the stored prefix, but only that: it gets ``None`` and is
    prefilled whole after the prefix, not laid out beside rows that reuse their turns
    (an admission's new columns are its longest row's)."""
    hit = store.lookup(prompt) if store.budget_bytes and store.entries else None
    return hit if hit is not None and hit[0] > max(keep, MIN_SHARED_PREFIX - 1) else None


def admitted_layout(store: KVStore, prompts: list[tuple[int, ...]], hits: list[tuple[int, tuple[int, ...]]] | None,
                    keep: int, prefix: KV, pad_id: int, device: Any) -> tuple[Restored, Any, Any, int]:
    """:class:`Restored` KV, ids, mask and reused token count for rows that join a running
    lean decode loop whose shared prefix is their first ``keep`` tokens (its KV:
    ``prefix``). With ``hits`` (every row's :func:`stored_hit`, looked up once by the
    caller, none missing) the rows start from their stored KV after the prefix (laid out
    as :func:`restored_layout`); without, every row is prefilled after the prefix
    (:func:`left_pad`)."""
    if hits is not None:
        if len(hits) != len(prompts) or any(h is None for h in hits):
            raise ValueError("admitted_layout: every row needs its stored hit (or pass hits=None)")
        reused_R = [n for n, _ in hits]
        width = max(reused_R) - keep
        ids, mask = _stored_ids(prompts, reused_R, keep, pad_id, device)
        rows = tuple((width - (n - keep), store.columns(key, keep, n)) for n, key in hits)
        return Restored(prefix, rows, width), ids, mask, sum(reused_R) - keep * len(prompts)
    ids, mask = left_pad(prompts, pad_id, device, keep=keep)
    return Restored(prefix), ids, mask, 0


def store_rows(store: KVStore, cache: Any, attention_mask: Any, prompts: list[tuple[int, ...]],
               sampled_R: list[tuple[int, ...]]) -> bool:
    """Keep each row's KV (prompt + sampled tokens but the last, whose KV was never
    computed); ``False`` (nothing stored) when the cache is not pure attention."""
    if not hf_compat.pure_attention(cache):
        return False
    width = attention_mask.shape[1]
    for k, (prompt, tokens) in enumerate(zip(prompts, sampled_R)):
        kept = len(tokens) - 1
        positions = torch.cat([attention_mask[k].nonzero().squeeze(1),
                               torch.arange(width, width + kept, device=attention_mask.device)])
        store.remember(prompt + tokens[:kept], hf_compat.row_kv(cache, k), positions)
    return True


def store_row(store: KVStore, row_kv: KV, prompt_mask: Any, prompt: tuple[int, ...], tokens: tuple[int, ...]) -> None:
    """Keep the KV of one row of a decode loop's batch (prompt + its tokens but the last):
    ``row_kv`` is laid out as ``prompt_mask`` (the prompt's columns) followed by one
    column per step, from a pure-attention cache."""
    width, kept = prompt_mask.shape[0], len(tokens) - 1
    positions = torch.cat([prompt_mask.nonzero().squeeze(1),
                           torch.arange(width, width + kept, device=prompt_mask.device)])
    store.remember(prompt + tokens[:kept], row_kv, positions)
