"""The one module that reaches into transformers' cache internals, behind a version check.

The sampler's fast path (shared-prefix cache, KV store of earlier turns, reserved room
for decode steps; see ``kv_cache``) pads, splices and pre-allocates HF caches: it reads
``cache.layers[i].keys``/``.values``, builds a ``DynamicCache`` from per-layer tensors
(the ``ddp_cache_data`` keyword), swaps layers for a ``DynamicLayer`` subclass that
overrides ``update``, recognises plain attention layers by class name, and hands the
cache to ``generate`` under the keyword of the installed release (``past_key_values``
before the rename, ``cache`` after). The trainer's ``prefix_once`` builds a read-only
cache of ``DynamicLayer`` subclasses over a prefix's keys and values and lets
checkpointed layers keep it (``GradientCheckpointingLayer._can_checkpoint_with_cache``).
None of this is a stable API, so it lives here and nowhere else.

:func:`fast_path_enabled` decides once per sampler whether the fast path may run: when
it is switched off (``LocalSettings.fast_sampling=False`` or the environment
variable ``RETOOL_FAST_SAMPLING=0``) or the installed transformers is outside
:data:`TESTED_TRANSFORMERS` (then with one warning per process), the sampler calls
plain ``generate``: the same tokens, only slower.

Not covered: static, quantised and encoder-decoder caches; sliding-window and
linear-attention layers (:func:`pure_attention` rejects them and the sampler turns its
caches off for that model); transformers releases outside the tested range.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_layers import GradientCheckpointingLayer

TESTED_TRANSFORMERS = ("5.10.4", "5.25.0")
"""Oldest and newest transformers release the fast path was tested on (inclusive):
tests/test_engine_local.py passes on both; releases in between are assumed alike."""

FAST_SAMPLING_ENV = "RETOOL_FAST_SAMPLING"
"""Set to ``0`` to turn the sampler's fast path off by hand (as ``fast_sampling=False``)."""

KV = tuple[tuple[Any, Any], ...]
"""One sequence's (or batch's) cache as plain tensors: per layer ``(keys, values)``."""

_warned = False


def installed_version() -> str:
    return transformers.__version__


def is_tested(version: str) -> bool:
    """Whether ``version`` lies in :data:`TESTED_TRANSFORMERS` (pre-releases of the newest
    tested release count as untested)."""
    low, high = (Version(v) for v in TESTED_TRANSFORMERS)
    return low <= Version(version) <= high


def fast_path_enabled(requested: bool = True) -> bool:
    """Whether the sampler may use the cache internals of this module.

    ``False`` when ``requested`` is false, when :data:`FAST_SAMPLING_ENV` is ``0`` or
    when the installed transformers is untested (warning once per process).
    """
    global _warned
    if not requested or os.environ.get(FAST_SAMPLING_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    version = installed_version()
    if is_tested(version):
        return True
    if not _warned:
        _warned = True
        low, high = TESTED_TRANSFORMERS
        warnings.warn(
            f"transformers {version} is outside the range the local sampler's fast path was "
            f"tested on ({low} to {high}); sampling with plain generate instead (same tokens, "
            f"slower: no prefix cache, no KV store, no reserved room). Set "
            f"{FAST_SAMPLING_ENV}=0 or fast_sampling=False to silence this.", RuntimeWarning, stacklevel=2)
    return False


# ---------------------------------------------------------------- reading caches


def cache_of(output: Any) -> Any:
    """The cache a forward pass or ``generate`` returned (``cache`` or ``past_key_values``)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")


def pure_attention(cache: Any) -> bool:
    """Whether every layer of a cache is a plain (non-sliding) attention KV layer, the
    only kind whose positions the prefix cache and the KV store may pad and splice."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(not getattr(layer, "is_sliding", False)
                                and type(layer).__name__ in ("DynamicLayer", "_ReservedLayer") for layer in layers)


def row_kv(cache: Any, row: int, positions: Any = None) -> KV:
    """Per layer ``(keys, values)`` of one batch row, at ``positions`` (all when ``None``)."""
    if positions is None:
        return tuple((layer.keys[row], layer.values[row]) for layer in cache.layers)
    return tuple((layer.keys[row][:, positions], layer.values[row][:, positions]) for layer in cache.layers)


# ---------------------------------------------------------------- building caches


def cache_from_kv(layers: list[tuple[Any, Any]]) -> Any:
    """A ``DynamicCache`` holding the given per-layer batched ``(keys, values)``."""
    return DynamicCache(ddp_cache_data=layers)


def repeat_rows(cache: Any, rows: int) -> Any:
    """``cache`` (one row) repeated in place for ``rows`` rows."""
    cache.batch_repeat_interleave(rows)
    return cache


def with_reserved_room(cache: Any, model_config: Any, reserve: int) -> Any:
    """``cache`` (or a new empty cache when ``None``) with every attention layer keeping
    room for ``reserve`` more tokens, so that a decode step writes its keys and values in
    place instead of concatenating the whole cache again (HF's ``DynamicLayer`` copies
    every layer's cache at every step: ~30 % of a batched CPU decode step). Caches that
    are not pure attention are returned unchanged (``None`` stays ``None``: generate
    builds its own)."""
    candidate = DynamicCache(config=model_config) if cache is None else cache
    if not pure_attention(candidate):
        return cache
    layer_class = reserved_layer_class()
    for index, layer in enumerate(candidate.layers):
        reserved = layer_class(reserve)
        if layer.is_initialized and layer.keys.numel():
            reserved.update(layer.keys, layer.values)
        candidate.layers[index] = reserved
    return candidate


def keep_rows(cache: Any, index: Any) -> None:
    """Keep only the batch rows ``index`` of ``cache`` (a decode loop dropping finished rows)."""
    for layer in cache.layers:
        if hasattr(layer, "keep_rows"):
            layer.keep_rows(index)
        else:
            layer.keys, layer.values = layer.keys[index], layer.values[index]


def forward_cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand ``cache`` to a model's forward pass (``cache`` or
    ``past_key_values``, as for ``generate``); an empty cache is still passed."""
    return {_generate_cache_keyword(): cache}


def generate_cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand ``cache`` to ``generate`` (none for ``None``)."""
    return {} if cache is None else {_generate_cache_keyword(): cache}


@functools.cache
def _generate_cache_keyword() -> str:
    """``cache`` since transformers renamed ``past_key_values`` (its outputs' field tells)."""
    fields = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    return "cache" if "cache" in fields else "past_key_values"


@functools.cache
def reserved_layer_class() -> Any:
    """``_ReservedLayer``: an HF ``DynamicLayer`` that grows into spare capacity (built
    once, on first use)."""
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

        def keep_rows(self, index: Any) -> None:
            """Keep only the batch rows ``index`` (copying their filled part, with new room)."""
            have = self.keys.shape[-2]
            keys, values = self.keys[index], self.values[index]
            shape = (*keys.shape[:-2], have + self.reserve, keys.shape[-1])
            self._buffers = (keys.new_empty(shape), values.new_empty(shape))
            self._buffers[0][..., :have, :] = keys
            self._buffers[1][..., :have, :] = values
            self.keys, self.values = self._buffers[0][..., :have, :], self._buffers[1][..., :have, :]

    return _ReservedLayer


# ---------------------------------------------------------------- training against a prefix


def read_only_cache(prefix_kv: KV | None, layers: int) -> Any:
    """A cache for a training forward that runs against ``prefix_kv`` (per layer
    ``(keys, values)``; ``None``: no prefix) and records the keys and values it computes.

    Each layer hands attention ``prefix + new`` keys and values but stores nothing, so the
    cache is the same before and after a forward: an activation-checkpointed layer that
    recomputes its forward in the backward sees what it saw the first time. The first
    ``update`` of each layer records its new ``(keys, values)`` (:func:`recorded_kv`): the
    prefix's own forward reads its keys and values from there, still attached to its graph.
    """
    layer_class = read_only_layer_class()
    cache = DynamicCache()
    empty = [None] * layers if prefix_kv is None else prefix_kv
    cache.layers = [layer_class(kv) for kv in empty]
    return cache


def recorded_kv(cache: Any) -> KV:
    """Per layer, the ``(keys, values)`` a :func:`read_only_cache` recorded in its first forward."""
    return tuple(layer.recorded for layer in cache.layers)


@functools.cache
def read_only_layer_class() -> Any:
    """``_ReadOnlyLayer``: an HF ``DynamicLayer`` whose ``update`` returns ``prefix + new``
    without storing ``new`` (built once, on first use)."""
    class _ReadOnlyLayer(DynamicLayer):
        def __init__(self, prefix: tuple[Any, Any] | None) -> None:
            super().__init__()
            self.recorded: tuple[Any, Any] | None = None
            if prefix is not None:
                self.keys, self.values = prefix
                self.is_initialized = True
                self.dtype, self.device = prefix[0].dtype, prefix[0].device

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if self.recorded is None:
                self.recorded = (key_states, value_states)
            if not self.is_initialized:
                return key_states, value_states
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return _ReadOnlyLayer


def checkpointing_keeps_cache_supported() -> bool:
    """Whether this transformers lets an activation-checkpointed layer keep a cache that is
    only read (``GradientCheckpointingLayer._can_checkpoint_with_cache``)."""
    return hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")


@contextlib.contextmanager
def checkpointing_keeps_cache(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s checkpointed layers pass a cache on instead of
    dropping it (safe for :func:`read_only_cache`, whose layers store nothing)."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache
