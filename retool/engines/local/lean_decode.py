"""A lean decode step for Llama/Qwen-style models: merged weights, shared-prefix attention.

The sampler's decode steps (``decode_loop="lean"``, the default) skip the model's
modules: :func:`decode_weights` reads the weights once per weight version — every LoRA
adapter merged into a copy of its base weight (``W + scale * B @ A``, PEFT's own
``get_delta_weight``), q/k/v fused into one matrix and gate/up into another, each
reordered into oneDNN's blocked layout on a CPU (2.5x faster products at a few rows) — and
:class:`LeanCache` runs one token per row through the 30 layers with four matrix
products, RMSNorm, RoPE and SiLU written out. Its attention reads the rows' shared
prefix (system prompt, tool declaration, a group's question) once for all rows: on a CPU
torch's flash-attention kernel runs once over every row's own columns (their prompt after
the prefix, then the sampled tokens) and once over the one copy of the prefix for all
rows' queries, and the two are merged by their log-sum-exps (:data:`ATTENTION`; elsewhere
two plain matrix products and one softmax over both). The prompt's columns after the prefix are
prefilled the same way (:meth:`LeanCache.prefill`), also when rows continue stored KV
of earlier turns (``kv_cache.restored_layout``: a trajectory's next turn prefills only
its new tokens, through the lean weights, from one copy of the stored KV); only the
shared prefix itself is run through the model.

Models it covers: ``llama`` (SmolLM2, Llama 2/3), ``qwen2`` and ``qwen3`` (per-head
q/k norms) with SiLU MLPs, no sliding window and no tensor-parallel slicing; plain
``nn.Linear`` or PEFT LoRA linears (no DoRA). :func:`decode_weights` returns ``None``
for anything else and the sampler decodes with the model's own forward pass
(``decode_loop="own"``).

Measured (``docs/benchmarks.md``, SmolLM2-135M fp32 with LoRA, 1 thread, busy machine):
a 16-row step at 450 tokens of KV 186 -> 72 ms; the rollout's 16 requests 2.3x the
tokens/s of HF ``generate``. The flash kernel took the demo's bf16 rollout steps
(2 cores, AVX-512) from 90 to 64 ms, and one OpenMP team at a time
(``retool.engines.openmp``) to 41 ms.

Exactness: merged weights and the fused products change float rounding only; the
logprobs of sampled tokens agree with the model's own forward pass within 1e-4
(``tests/test_sampler_fast.py``).

Precision (``decode_weights(..., dtype=torch.bfloat16)``, the sampler's
``precision="bf16"``): the merged matrices (merged in the model's fp32, then rounded
once), the embeddings and every KV buffer are bfloat16, so a step reads half the bytes;
each product takes bf16 inputs and rounds its output to bf16, while the residual stream,
RMSNorm, RoPE and the attention softmax run in fp32 (a bf16 residual stream rounds at
every one of the 30 adds). The output layer's product is bf16 too (:data:`HEAD_DTYPE`;
an fp32 head was measured slower and no closer at its worst) and its logits are fp32
before any softmax. The sampler samples from that bf16 model and returns its logprobs
(``tests/test_sampler_precision.py`` pins how far they are from the fp32 trainer's).
:func:`native_bf16` says whether this machine computes bf16 natively; without it (no
``avx512_bf16``/AMX) bf16 products are several times slower than fp32 ones.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from retool.engines.cpu import cpu_flags as _cpu_flags  # a name of this module: tests set it
from retool.engines.local import memory
from retool.engines.local.hf_compat import KV
from retool.engines.local.kv_cache import Restored

ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""``config.model_type`` values the lean step covers."""

PREFILL_SCORES_BYTES = 64 * 2**20
"""Most memory one chunk of rows of a lean prefill spends on attention scores (and their
mask): rows are prefilled in chunks under it (a batch of 64 rows x 450 new columns
without a shared prefix would need ~500 MB at once)."""

PREFILL_CALL_TOKENS = 32
"""What one more chunk of a lean prefill costs, in prefilled tokens (a chunk runs every
layer once: ~30-40 ms on 2 CPU cores, what ~32 tokens of a long prefill take). Rows are cut
into chunks (:func:`prefill_chunks`) so that the columns a chunk computes for padding
(left of its longest row's new tokens) and its calls cost the least: one row whose
tool output is 535 tokens long no longer makes 7 rows of ~30 new tokens compute 535
each (5.8 s against ~0.6 s in a demo RL step)."""


PREFILL_DISTINCT_ROWS = True
"""Prefill rows that hold the same prompt once and copy their KV (:meth:`LeanCache.prefill`):
a request's ``num_samples`` rows (8 per RL group, 2 per eval problem) cost one row's prefill.
Off: every row is prefilled (``bench/sampling.py --variants``)."""

ATTENTION = "flash"
"""How a lean step's attention runs on a CPU: ``flash`` = torch's CPU flash-attention
kernel, once over the rows' own columns and once over the shared prefix, merged by their
log-sum-exps (the scores never materialized: the demo's decode step 0.71x the time,
``docs/benchmarks.md``); ``math`` = plain matrix products and one softmax (the path
before it, and the one a GPU or a torch without the kernel uses). The same values to
float rounding (fp32: 1e-6; ``tests/test_sampler_fast.py``)."""

_FLASH = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None)
"""torch's CPU flash-attention op, ``(q, k, v, *, attn_mask, scale) -> (out, logsumexp)``:
the kernel behind ``F.scaled_dot_product_attention`` on a CPU, called directly for its
log-sum-exp, which the cascade needs and the public function does not return."""

TRIM_BYTES = 32 * 2**20
"""When a ``LeanCache`` copies its buffers into new ones (rows admitted or dropped, more
room), it does so layer by layer and hands the old buffers' memory back to the system
(``memory.release_free_memory``) after every this many bytes of them (0: never). glibc
keeps a freed buffer in its heap, where the next layer's new one, a little larger, does not
fit: without the trims the process grew by about the whole cache at every copy, though
only one layer's old and new buffers are alive at once. Measured on a demo eval (a seed's
160 problems after SFT, 2-core CPU, peak PSS of the process tree): 2,443-2,675 MiB in three
runs without trims, 2,209-2,252 MiB in four with them, the same tokens; a trim every 32 MiB
made 1,126 calls, 6.5 s of the eval's 273 s; one after every layer 5,880 calls, 15.7 s."""

PRECISIONS = ("fp32", "bf16", "auto")
"""The sampler's ``precision`` settings (``LocalSettings.precision``)."""

HEAD_DTYPE: Any = None
"""Dtype of the output layer's product under bf16: ``None`` = the decode dtype (bf16 weights,
half the bytes of the largest matrix); its logits are always turned to fp32 before the
log-softmax. (A float32 head was measured as well, ``docs/benchmarks.md``.)"""


def native_bf16(device: Any) -> bool:
    """Whether ``device`` computes bfloat16 products natively: a CUDA GPU that supports
    bf16, or a CPU with oneDNN and ``avx512_bf16`` or AMX (read from ``/proc/cpuinfo``;
    other systems count as without)."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def resolve_precision(precision: str, device: Any) -> Any:
    """The dtype the lean steps decode in for a ``precision`` setting: ``None`` for fp32
    (the model's own weights as they are), ``torch.bfloat16`` for bf16, and for auto
    bf16 exactly when :func:`native_bf16`. Auto's choice is printed once per process."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        native = native_bf16(device)
        _say_auto(str(torch.device(device)), native)
        return torch.bfloat16 if native else None
    return torch.bfloat16 if precision == "bf16" else None


@functools.cache
def _say_auto(device: str, native: bool) -> None:
    why = "computes bf16 natively" if native else "has no native bf16 (avx512_bf16/AMX)"
    print(f"[sampler] precision auto -> {'bf16' if native else 'fp32'}: {device} {why}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, LoRA merged; ``qkv``/``gate_up`` are fused (out, in)."""

    input_norm: Any
    qkv: Any
    qkv_bias: Any
    q_norm: Any
    k_norm: Any
    o: Any
    o_bias: Any
    post_norm: Any
    gate_up: Any
    down: Any


@dataclass(frozen=True)
class DecodeWeights:
    """Everything a decode step reads, for one weight version of the model."""

    layers: tuple[LayerWeights, ...]
    embed: Any
    final_norm: Any
    head: Any
    rotary: Any
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    version: tuple
    dtype: Any = None
    """The dtype the weights were cast to (``None``: the model's own)."""


def apart_from(weights: DecodeWeights, model: Any) -> DecodeWeights:
    """``weights`` with every tensor that shares memory with ``model`` (an unmerged fp32
    matrix, the embeddings, a norm) replaced by a copy of its own, so that freeing the
    model's tensors frees their memory — and a model loaded from safetensors, whose
    weights are slices of the memory-mapped file, no longer keeps any of the file mapped."""
    shared = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())
              if t.numel()}

    copies: dict[int, Any] = {}  # one copy of a tensor read twice (tied embeddings and head)

    def own(value: Any) -> Any:
        if (isinstance(value, torch.Tensor) and value.layout == torch.strided  # oneDNN-packed: its own already
                and value.numel() and value.untyped_storage().data_ptr() in shared):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in copies:
                copies[key] = value.clone()
            return copies[key]
        return value

    layers = tuple(LayerWeights(*(own(getattr(layer, f.name)) for f in dataclasses.fields(LayerWeights)))
                   for layer in weights.layers)
    return dataclasses.replace(weights, layers=layers, embed=own(weights.embed), final_norm=own(weights.final_norm),
                               head=own(weights.head))


def weight_version(model: Any, trained_only: bool = False) -> tuple:
    """Changes whenever any parameter (with ``trained_only``, any trained one: the frozen
    ones a ``base_spill`` frees and reads back never change value) is replaced or updated
    in place (optimizer steps, ``load_state_dict``, merging)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters() if p.requires_grad or not trained_only)


def decode_weights(model: Any, previous: DecodeWeights | None = None, dtype: Any = None) -> DecodeWeights | None:
    """The lean step's weights for ``model`` (``previous`` again while its weights have not
    changed), or ``None`` when the architecture is not covered (see the module doc).
    ``dtype`` (e.g. ``torch.bfloat16``) casts every weight once, after merging; ``None``
    keeps the model's dtype."""
    version = weight_version(model)
    if previous is not None and previous.version == version and previous.dtype == dtype:
        return previous
    inner = decoder_of(model)
    if inner is None:
        return None
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cast = functools.partial(_cast, dtype=dtype)
    try:
        layers = tuple(_layer_weights(layer, dtype) for layer in inner.layers)
    except _Unsupported:
        return None
    head = model.get_output_embeddings()
    if not _head_covered(head):
        return None
    head_weight = _packed(_cast(head.weight.detach(), HEAD_DTYPE or dtype))
    return DecodeWeights(layers, cast(inner.embed_tokens.weight.detach()), _vector(inner.norm.weight, dtype),
                         head_weight,
                         inner.rotary_emb,
                         float(config.rms_norm_eps), config.num_attention_heads, config.num_key_value_heads,
                         head_dim, version, dtype)


def _cast(tensor: Any, dtype: Any) -> Any:
    """``tensor`` in ``dtype`` (itself when ``dtype`` is ``None`` or already its dtype)."""
    return tensor if tensor is None or dtype is None else tensor.to(dtype)


def _vector(weight: Any, dtype: Any) -> Any:
    """An RMSNorm weight as the lean step reads it: kept in the model's dtype (it scales the
    fp32 residual stream), shared with the model when ``dtype`` is ``None``, else a copy of
    its own, so that a cast copy holds no tensor of the model's: the model's weights may be
    slices of its memory-mapped weights file, each of which keeps the whole file mapped
    (a frozen sampler frees them, ``LocalSamplingClient``)."""
    weight = weight.detach()
    return weight if dtype is None else weight.clone()


class _Unsupported(Exception):
    """A layer the lean step does not cover (the caller falls back)."""


def decoder_of(model: Any) -> Any:
    """The ``*Model`` (embeddings, layers, norm, rotary) inside a (PEFT-wrapped) causal LM
    of a covered architecture, else ``None``."""
    config = model.config
    if (getattr(config, "model_type", None) not in ARCHITECTURES or getattr(config, "hidden_act", None) != "silu"
            or getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "use_sliding_window", False)
            or getattr(config, "mlp_bias", False)):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return None
    return inner


def _layer_weights(layer: Any, dtype: Any) -> LayerWeights:
    """One layer's merged, fused weights, each matrix cast to ``dtype`` (``None``: kept) before
    packing; the RMSNorm weights stay in the model's dtype (they scale the fp32 residual
    stream, :func:`_vector`)."""
    cast = functools.partial(_cast, dtype=dtype)
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = (_merged(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj"))
    o, gate, up, down = _merged(attn.o_proj), _merged(mlp.gate_proj), _merged(mlp.up_proj), _merged(mlp.down_proj)
    if gate[1] is not None or up[1] is not None or down[1] is not None:
        raise _Unsupported("MLP bias")
    biases = [b for _, b in (q, k, v)]
    qkv_bias = None
    if any(b is not None for b in biases):
        qkv_bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                              for (w, _), b in zip((q, k, v), biases)])
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LayerWeights(_vector(layer.input_layernorm.weight, dtype), _packed(cast(torch.cat([q[0], k[0], v[0]]))),
                        cast(qkv_bias), None if q_norm is None else cast(q_norm.weight.detach()),
                        None if k_norm is None else cast(k_norm.weight.detach()),
                        _packed(cast(o[0])), cast(o[1]), _vector(layer.post_attention_layernorm.weight, dtype),
                        _packed(cast(torch.cat([gate[0], up[0]]))), _packed(cast(down[0])))


def _packed(weight: Any) -> Any:
    """``weight`` (out, in) reordered into oneDNN's blocked layout for :func:`_linear` when
    that runs here (fp32 or bf16 on a CPU with oneDNN): ~2.5x faster fp32 products at a
    few rows than the plain layout (measured at 16 rows: 6.4 vs 15.9 ms for the 49k x 576
    head), ~1.3x for bf16 ones (``docs/benchmarks.md``)."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not _onednn_linear(weight.dtype)):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


@functools.cache
def _cpu_flash_attention() -> bool:
    """Whether torch's CPU flash-attention op is present and, on a small input with a
    prefix and a masked column, agrees with :func:`_attention_rows_math` in fp32."""
    if _FLASH is None:
        return False
    generator = torch.Generator().manual_seed(0)
    q, own_k, own_v = (torch.randn(shape, generator=generator) for shape in ((2, 3, 2, 8), (2, 3, 5, 8), (2, 3, 5, 8)))
    prefix_k, prefix_v = torch.randn(2, 4, 8, generator=generator), torch.randn(2, 4, 8, generator=generator)
    bias = torch.zeros(1, 3, 1, 5)
    bias[:, 1:, :, 0] = float("-inf")
    try:
        got = _attention_rows_flash(q, prefix_k, prefix_v, own_k, own_v, bias)
    except (RuntimeError, TypeError) as exc:
        warnings.warn(f"CPU flash attention unavailable ({exc}); lean steps use plain products", RuntimeWarning,
                      stacklevel=2)
        return False
    return bool(torch.allclose(got, _attention_rows_math(q, prefix_k, prefix_v, own_k, own_v, bias), atol=1e-5))


@functools.cache
def _onednn_linear(dtype: Any = torch.float32) -> bool:
    """Whether torch's oneDNN linear (the op ``torch.compile`` uses for frozen CPU weights)
    is present and agrees with a plain product here, in ``dtype``."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=generator).to(dtype), torch.randn(5, 8, generator=generator).to(dtype)
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None,
                                                 "none", [], "")
    except RuntimeError as exc:
        warnings.warn(f"oneDNN linear unavailable ({exc}); lean decode steps use plain products", RuntimeWarning,
                      stacklevel=2)
        return False
    atol = 1e-5 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got.float(), x.float() @ w.float().T, atol=atol))


def _linear(x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight.T + bias`` for a weight from :func:`_packed` (``x`` in the weight's dtype)."""
    x = x.to(weight.dtype)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def covers(model: Any) -> bool:
    """Whether :func:`decode_weights` covers ``model`` (see the module doc), found without
    merging or copying anything."""
    inner = decoder_of(model)
    if inner is None or not _head_covered(model.get_output_embeddings()):
        return False
    for layer in inner.layers:
        modules = _layer_linears(layer)
        if not all(_linear_covered(m) for m in modules):
            return False
        if any(_base_linear(m).bias is not None for m in modules[4:]):
            return False
    return True


def layer_matrices(model: Any) -> list[Any]:
    """The frozen weight matrices of the decoder layers' linear products (the base of each
    LoRA-wrapped one) — what :func:`decode_weights` merges into its own copy and the lean
    steps never read from the model (``base_spill``); empty when :func:`covers` is false."""
    if not covers(model):
        return []
    weights = (_base_linear(m).weight for layer in decoder_of(model).layers for m in _layer_linears(layer))
    return [w for w in weights if not w.requires_grad]


def _layer_linears(layer: Any) -> list[Any]:
    """A decoder layer's linear modules: attention's q, k, v, o, then the MLP's gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return ([getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            + [getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")])


def _head_covered(head: Any) -> bool:
    """The output layer the lean step reads: a plain matrix (no LoRA, no bias)."""
    return _lora_layer(head) is None and getattr(head, "bias", None) is None


def _linear_covered(module: Any) -> bool:
    lora = _lora_layer(module)
    if lora is None:
        return isinstance(module, torch.nn.Linear)
    return isinstance(lora.get_base_layer(), torch.nn.Linear) and not any(lora.use_dora.values())


def _base_linear(module: Any) -> Any:
    lora = _lora_layer(module)
    return module if lora is None else lora.get_base_layer()


def _lora_layer(module: Any) -> Any:
    from peft.tuners.lora import LoraLayer  # peft: heavy (~0.6 s); a full fine-tune run loads it only here

    return module if isinstance(module, LoraLayer) else None


def _merged(module: Any) -> tuple[Any, Any]:
    """(weight, bias) of a linear layer with its active LoRA adapters merged (a copy)."""
    if not _linear_covered(module):
        raise _Unsupported(type(module).__name__)
    lora = _lora_layer(module)
    if lora is None:
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    base = lora.get_base_layer()
    weight = base.weight.detach()
    deltas = [] if lora.disable_adapters or lora.merged else [
        lora.get_delta_weight(name).detach() for name in lora.active_adapters if name in lora.lora_A]
    if deltas:
        # Added in the wider of the two dtypes, then rounded once to the base's: a bf16 base
        # under an fp32 adapter (the trainer's frozen base under --train-precision bf16) is
        # merged in fp32, as an fp32 base was.
        wide = torch.promote_types(weight.dtype, deltas[0].dtype)
        merged = weight.to(wide)
        for delta in deltas:
            merged = merged + delta.to(wide)
        weight = merged.to(weight.dtype)
    return weight, None if base.bias is None else base.bias.detach()


class LeanCache:
    """The KV of a decode loop's rows: the shared prefix once (``kv_heads, P, head_dim``
    per layer) and each row's own columns (``kv_heads, rows, capacity, head_dim``) with
    room for ``reserve`` more, plus an additive mask (``-inf`` at padding).

    It starts from ``start`` (``kv_cache.Restored``: the prefix, and stored KV of each
    row's earlier columns, copied into place once; padding columns are zeros) with
    ``own_mask`` the mask of those ``start.width`` restored own columns."""

    def __init__(self, weights: DecodeWeights, start: Restored, own_mask: Any, reserve: int) -> None:
        w = self.weights = weights
        rows, width = own_mask.shape
        self.width, capacity = width, width + max(1, reserve)
        empty = w.embed.new_empty((w.kv_heads, 0, w.head_dim))
        self.prefix = list(start.prefix) or [(empty, empty)] * len(w.layers)
        self.own = []
        for layer in range(len(w.layers)):
            buffers = tuple(w.embed.new_empty((w.kv_heads, rows, capacity, w.head_dim)) for _ in range(2))
            for buffer in buffers:
                buffer[:, :, :width].zero_()
            for row, (column, kv) in enumerate(start.rows):
                for buffer, stored in zip(buffers, kv[layer]):
                    buffer[:, row, column:column + stored.shape[1]] = stored
            self.own.append(buffers)
        self.bias = torch.zeros((rows, capacity), dtype=w.embed.dtype, device=w.embed.device)
        self.bias[:, :width].masked_fill_(own_mask == 0, float("-inf"))

    @classmethod
    def prefill(cls, weights: DecodeWeights, start: Restored | None, input_ids: Any, attention_mask: Any,
                positions: Any, reserve: int) -> tuple[LeanCache, Any]:
        """Prefill every column after the ``start.columns`` whose KV ``start`` holds (its
        shared prefix, then each row's restored columns; ``None``: nothing) with the lean
        weights: the lean cache and the last column's logits ``(rows, vocab)``.

        Rows that are the same prompt (the ``num_samples`` rows of one request: a GRPO
        group's question after the shared system prompt, an eval's samples of a problem) and
        restore nothing of their own are prefilled once and their KV copied to each of them
        (``PREFILL_DISTINCT_ROWS``): the same values up to the float rounding of products
        over fewer rows."""
        start = start or Restored()
        if PREFILL_DISTINCT_ROWS and not start.rows:
            first_U, inverse_R = _distinct_rows(torch.cat([input_ids, attention_mask.to(input_ids.dtype), positions], 1))
            if len(first_U) < input_ids.shape[0]:
                cache, logits_U = cls._prefill_rows(weights, start, input_ids[first_U], attention_mask[first_U],
                                                    positions[first_U], reserve)
                cache.keep_rows(inverse_R)
                return cache, logits_U[inverse_R]
        return cls._prefill_rows(weights, start, input_ids, attention_mask, positions, reserve)

    @classmethod
    def _prefill_rows(cls, weights: DecodeWeights, start: Restored, input_ids: Any, attention_mask: Any,
                      positions: Any, reserve: int) -> tuple[LeanCache, Any]:
        past, prefix_len = start.columns, start.prefix_len
        width = input_ids.shape[1] - past
        cache = cls(weights, start, attention_mask[:, prefix_len:past], width + reserve)
        new_mask = attention_mask[:, past:]
        # a row's new columns: from its first unmasked one to the end (its prompt is left-padded)
        first_R = torch.where(new_mask.any(1), (new_mask != 0).int().argmax(1), width - 1)
        keys = prefix_len + cache.width + width
        logits = [cache._prefill(slice(a, b), input_ids[a:b, past + skip:], new_mask[a:b, skip:],
                                 positions[a:b, past + skip:], skip)
                  for a, b, skip in prefill_chunks((width - first_R).tolist(), width,
                                                   4 * weights.heads * keys)]  # fp32 score bytes per query column
        cache.bias[:, cache.width:cache.width + width].masked_fill_(new_mask == 0, float("-inf"))
        cache.width += width
        return cache, torch.cat(logits)

    def _prefill(self, rows_slice: slice, ids_BT: Any, mask_BT: Any, positions_BT: Any, skip: int = 0) -> Any:
        """Run the new columns of the rows ``rows_slice`` through every layer (causal within a
        row, padding masked; a padding column sees itself, so nothing is all-masked; every
        column sees the restored ones that are not padding), filling their cache after the
        restored columns and ``skip`` columns that are padding in all of these rows (not
        computed: zero KV, masked); the last column's logits."""
        w = self.weights
        rows, width = ids_BT.shape
        group, d = w.heads // w.kv_heads, w.head_dim
        if skip:
            for all_k, all_v in self.own:
                all_k[:, rows_slice, self.width:self.width + skip].zero_()
                all_v[:, rows_slice, self.width:self.width + skip].zero_()
        old = self.width + skip
        x = _stream(w, w.embed[ids_BT].reshape(rows * width, -1))
        cos, sin = w.rotary(x.view(rows, width, -1), positions_BT)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (rows, width, 1, head_dim)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids_BT.device).tril()
        allowed = causal & ((mask_BT[:, None, :] != 0) | torch.eye(width, dtype=torch.bool, device=ids_BT.device))
        before = self.bias[rows_slice, None, :old].expand(rows, width, old)
        if skip:
            before = before.clone()
            before[..., self.width:] = float("-inf")
        bias = torch.cat([before, self.bias.new_zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))], dim=-1)
        bias = bias[:, :, None].expand(rows, width, group, old + width).reshape(1, rows, width * group, old + width)
        hidden = x.shape[-1]
        q_size, kv_size = w.heads * d, w.kv_heads * d
        for layer, (pk, pv), (all_k, all_v) in zip(w.layers, self.prefix, self.own):
            own_k, own_v = all_k[:, rows_slice], all_v[:, rows_slice]  # views: writes fill the cache
            h = F.rms_norm(x, (hidden,), layer.input_norm, w.eps)
            qkv = _linear(h, layer.qkv, layer.qkv_bias).view(rows, width, -1)
            q = qkv[..., :q_size].reshape(rows, width, w.heads, d)
            k = qkv[..., q_size:q_size + kv_size].reshape(rows, width, w.kv_heads, d)
            if layer.q_norm is not None:
                q = F.rms_norm(q, (d,), layer.q_norm, w.eps)
                k = F.rms_norm(k, (d,), layer.k_norm, w.eps)
            own_k[:, :, old:old + width] = _rope(k, cos, sin).permute(2, 0, 1, 3)
            own_v[:, :, old:old + width] = \
                qkv[..., q_size + kv_size:].reshape(rows, width, w.kv_heads, d).permute(2, 0, 1, 3)
            q = _rope(q, cos, sin).to(own_k.dtype).view(rows, width, w.kv_heads, group, d).permute(2, 0, 1, 3, 4)
            attn = _attention_rows(q.reshape(w.kv_heads, rows, width * group, d), pk, pv,
                                   own_k[:, :, :old + width], own_v[:, :, :old + width], bias)
            attn = attn.view(w.kv_heads, rows, width, group, d).permute(1, 2, 0, 3, 4).reshape(rows * width, -1)
            x = x + _linear(attn, layer.o, layer.o_bias)
            h = F.rms_norm(x, (hidden,), layer.post_norm, w.eps)
            gate, up = _linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.down)
        return _logits(w, x.view(rows, width, hidden)[:, -1])

    @property
    def rows(self) -> int:
        return self.bias.shape[0]

    @property
    def capacity(self) -> int:
        """Own columns each row has room for (written and reserved)."""
        return self.bias.shape[1]

    def admit(self, other: LeanCache) -> tuple[int, int]:
        """Take the rows of ``other`` (the same weights and shared prefix, prefilled apart)
        in after this cache's rows. Each row's own columns stay contiguous and end at the
        common write column: the narrower cache's rows get masked columns in front of
        theirs. Returns how many such columns this cache's rows and ``other``'s rows got
        (their prompt masks grow by as many after the prefix)."""
        front_self, front_other = max(0, other.width - self.width), max(0, self.width - other.width)
        capacity = max(self.capacity + front_self, other.capacity + front_other)
        self._copy_layers(lambda layer: tuple(_stacked(mine, front_self, theirs, front_other, capacity)
                                              for mine, theirs in zip(self.own[layer], other.own[layer])), other)
        self.bias = torch.cat([_placed_bias(self.bias, front_self, capacity),
                               _placed_bias(other.bias, front_other, capacity)])
        self.width = max(self.width, other.width)
        return front_self, front_other

    def keep_rows(self, index: Any, trim_front: bool = False) -> int:
        """Keep only the batch rows ``index`` (layer by layer, so that the old and the new
        buffers of one layer, not of all, are alive at once). With ``trim_front``, also drop
        the leading own columns that none of the kept rows uses: the masked columns rows got
        in front of theirs to line up with rows that have since left. Without it a
        continuous loop's columns would only grow — every row would hold, and attend over,
        every column since the loop began. Returns how many columns were dropped (each kept
        row's prompt mask loses as many after the shared prefix)."""
        bias = self.bias[index]
        first = 0
        if trim_front:
            used = torch.isfinite(bias[:, :self.width]).any(0).nonzero()
            first = int(used[0]) if len(used) else 0
        self._copy_layers(lambda layer: tuple(t[:, index, first:] for t in self.own[layer]))
        self.bias = bias[:, first:]
        self.width -= first
        return first

    def row_kv(self, row: int) -> KV:
        """Per layer ``(keys, values)`` of batch row ``row`` over every column so far (prefix
        columns, its own prompt columns, one per step): the HF cache's layout."""
        return tuple((torch.cat([pk, k[:, row, :self.width]], dim=1), torch.cat([pv, v[:, row, :self.width]], dim=1))
                     for (pk, pv), (k, v) in zip(self.prefix, self.own))

    def step(self, tokens_B: Any, positions_B: Any) -> Any:
        """Feed one token per row at its position; returns the next-token logits ``(rows, vocab)``."""
        w = self.weights
        rows, col = tokens_B.shape[0], self.width
        if col == self.own[0][0].shape[2]:
            self._grow()
        x = _stream(w, w.embed[tokens_B])
        cos, sin = w.rotary(x[:, None], positions_B[:, None])
        cos, sin = cos[:, None, 0], sin[:, None, 0]  # (rows, 1, head_dim)
        hidden = x.shape[-1]
        q_size, kv_size = w.heads * w.head_dim, w.kv_heads * w.head_dim
        self.bias[:, col] = 0.0
        bias = self.bias[None, :, None, :col + 1]
        for layer, (pk, pv), (own_k, own_v) in zip(w.layers, self.prefix, self.own):
            h = F.rms_norm(x, (hidden,), layer.input_norm, w.eps)
            qkv = _linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].view(rows, w.heads, w.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(rows, w.kv_heads, w.head_dim)
            if layer.q_norm is not None:
                q = F.rms_norm(q, (w.head_dim,), layer.q_norm, w.eps)
                k = F.rms_norm(k, (w.head_dim,), layer.k_norm, w.eps)
            own_k[:, :, col] = _rope(k, cos, sin).transpose(0, 1)
            own_v[:, :, col] = qkv[:, q_size + kv_size:].view(rows, w.kv_heads, w.head_dim).transpose(0, 1)
            attn = _attention(_rope(q, cos, sin).to(own_k.dtype), pk, pv, own_k[:, :, :col + 1],
                              own_v[:, :, :col + 1], bias, w.kv_heads)
            x = x + _linear(attn, layer.o, layer.o_bias)
            h = F.rms_norm(x, (hidden,), layer.post_norm, w.eps)
            gate, up = _linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.down)
        self.width = col + 1
        return _logits(w, x)

    def _copy_layers(self, copy: Callable[[int], tuple], other: LeanCache | None = None) -> None:
        """Replace each layer's buffers by ``copy(layer)`` (new ones, made from the old), layer
        by layer, so that one layer's old and new buffers, not all, are alive at once; the old
        ones (and ``other``'s of that layer, which ``copy`` took in) are freed as it goes, their
        memory handed back to the system after every :data:`TRIM_BYTES` of them."""
        freed = 0
        for layer in range(len(self.own)):
            freed += sum(t.nbytes for t in self.own[layer] + (other.own[layer] if other is not None else ()))
            self.own[layer] = copy(layer)
            if other is not None:
                other.own[layer] = ()
            if TRIM_BYTES and freed >= TRIM_BYTES:
                memory.release_free_memory()
                freed = 0

    def _grow(self) -> None:
        """Double the room of every row's columns (only when the reserve ran out)."""
        extra = max(16, self.width)
        self._copy_layers(lambda layer: tuple(F.pad(t, (0, 0, 0, extra)) for t in self.own[layer]))
        self.bias = F.pad(self.bias, (0, extra))


def prefill_chunks(new_R: Sequence[int], width: int, bytes_per_column: int) -> list[tuple[int, int, int]]:
    """How a lean prefill cuts its rows: ``(first row, end row, skip)`` per chunk, in order.

    Row ``r`` has ``new_R[r]`` new columns at the end of the batch's ``width`` (the rest is
    its left padding); a chunk computes the columns of its longest row for every one of its
    rows (it skips the ``skip`` columns before them, padding in all its rows). The cut
    costs the least ``rows x computed columns + PREFILL_CALL_TOKENS`` summed over the
    chunks (rows stay in order: a chunk is a slice of the cache), each within
    :data:`PREFILL_SCORES_BYTES` of scores (``bytes_per_column`` per row and computed
    column) or a single row."""
    rows = len(new_R)
    computed_R = [min(width, max(1, n)) for n in new_R]  # at least the last column (its logits)
    best = [0.0] + [math.inf] * rows  # best[b]: the least cost of rows [0, b)
    cut = [0] * (rows + 1)
    for b in range(1, rows + 1):
        longest = 0
        for a in range(b - 1, -1, -1):
            longest = max(longest, computed_R[a])
            if a < b - 1 and (b - a) * longest * bytes_per_column > PREFILL_SCORES_BYTES:
                break
            cost = best[a] + (b - a) * longest + PREFILL_CALL_TOKENS
            if cost < best[b]:
                best[b], cut[b] = cost, a
    chunks = []
    b = rows
    while b > 0:
        a = cut[b]
        chunks.append((a, b, width - max(computed_R[a:b])))
        b = a
    return chunks[::-1]


def _stacked(mine: Any, front_mine: int, theirs: Any, front_theirs: int, capacity: int) -> Any:
    """One buffer (kv_heads, rows, ``capacity`` columns, head_dim) with the rows of ``mine``
    then those of ``theirs``, each row's columns after ``front_*`` zero columns and zeros
    after them (one new buffer: no padded copies of each on the way)."""
    rows = mine.shape[1]
    out = mine.new_zeros((mine.shape[0], rows + theirs.shape[1], capacity, mine.shape[3]))
    out[:, :rows, front_mine:front_mine + mine.shape[2]] = mine
    out[:, rows:, front_theirs:front_theirs + theirs.shape[2]] = theirs
    return out


def _placed_bias(bias: Any, front: int, capacity: int) -> Any:
    """``bias`` (rows, columns) with ``front`` masked columns before its own and open room
    up to ``capacity`` after."""
    placed = F.pad(bias, (front, capacity - front - bias.shape[1]))
    placed[:, :front] = float("-inf")
    return placed


def _distinct_rows(rows_RC: Any) -> tuple[Any, Any]:
    """The first index of each distinct row of ``rows_RC``, in order, and for every row the
    position of its distinct row among them."""
    _, inverse_R = torch.unique(rows_RC, dim=0, return_inverse=True)
    index_R = torch.arange(len(inverse_R), device=rows_RC.device)
    first_D = torch.full((int(inverse_R.max()) + 1,), len(inverse_R), device=rows_RC.device)
    first_D = first_D.scatter_reduce(0, inverse_R, index_R, "amin")
    first_U, order = first_D.sort()
    rank_D = torch.empty_like(order)
    rank_D[order] = torch.arange(len(order), device=rows_RC.device)
    return first_U, rank_D[inverse_R]


def _stream(w: DecodeWeights, x: Any) -> Any:
    """The residual stream's dtype: fp32 under a cast copy (bf16 weights round each
    product's output once; summing 30 layers' outputs in bf16 would round at every add),
    else the model's own."""
    return x if w.dtype is None else x.float()


def _logits(w: DecodeWeights, x: Any) -> Any:
    """The next-token logits (rows, vocab) of the last hidden states ``x``, in fp32 (the
    head's product in its own dtype, :data:`HEAD_DTYPE`)."""
    h = F.rms_norm(x, (x.shape[-1],), w.final_norm, w.eps)
    return _linear(h.to(w.head.dtype), w.head).float()


def prefix_kv(weights: DecodeWeights, prefix_ids: Any) -> KV:
    """The KV of one row of tokens ``prefix_ids`` (1-D) through the lean weights, per layer
    ``(kv_heads, P, head_dim)``: the shared prefix of a bf16 sampler, which must be the same
    bf16 model as its decode steps, and of a frozen sampler, which no longer holds the
    model's matrices (a live fp32 sampler runs the model's own forward instead)."""
    ids = prefix_ids[None]
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    cache, _ = LeanCache.prefill(weights, None, ids, torch.ones_like(ids), positions, 0)
    return cache.row_kv(0)


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding of ``x`` (rows, heads, head_dim) as HF's ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _attention(q: Any, prefix_k: Any, prefix_v: Any, own_k: Any, own_v: Any, bias: Any, kv_heads: int) -> Any:
    """One query per row and head over the shared prefix (read once for all rows) and the
    row's own columns; ``(rows, heads * head_dim)``.

    ``q``: (rows, heads, d); ``prefix_*``: (kv_heads, P, d); ``own_*``: (kv_heads, rows, S, d);
    ``bias``: (1, rows, 1, S). Query head ``h`` reads KV head ``h // (heads / kv_heads)``.
    """
    rows, heads, d = q.shape
    q = q.view(rows, kv_heads, heads // kv_heads, d).transpose(0, 1)  # (kv_heads, rows, group, d)
    return _attention_rows(q, prefix_k, prefix_v, own_k, own_v, bias).transpose(0, 1).reshape(rows, heads * d)


def _attention_rows(q: Any, prefix_k: Any, prefix_v: Any, own_k: Any, own_v: Any, bias: Any) -> Any:
    """Softmax attention of queries ``q`` (kv_heads, rows, n, d) over the shared prefix
    (``prefix_*`` (kv_heads, P, d), read once for all rows) and each row's own columns
    (``own_*`` (kv_heads, rows, S, d), ``bias`` (1, rows, n or 1, S) added to their
    scores); (kv_heads, rows, n, d). On a CPU with torch's flash kernel
    (:data:`ATTENTION`), :func:`_attention_rows_flash`; else :func:`_attention_rows_math`."""
    if ATTENTION == "flash" and q.device.type == "cpu" and _cpu_flash_attention():
        return _attention_rows_flash(q, prefix_k, prefix_v, own_k, own_v, bias)
    return _attention_rows_math(q, prefix_k, prefix_v, own_k, own_v, bias)


def _attention_rows_flash(q: Any, prefix_k: Any, prefix_v: Any, own_k: Any, own_v: Any, bias: Any) -> Any:
    """:func:`_attention_rows` as two calls of torch's CPU flash-attention kernel, merged by
    their log-sum-exps (cascade attention): every row's queries over its own columns (a
    batch of rows, one head per KV head with its query heads as the query positions, the
    mask as ``bias``), and all rows' queries over the one copy of the prefix. Neither
    materializes the scores; the kernel accumulates in fp32 and the two parts are merged in
    fp32, rounded once to ``q``'s dtype."""
    kv_heads, rows, n, d = q.shape
    out, lse = _FLASH(q.transpose(0, 1), own_k.transpose(0, 1), own_v.transpose(0, 1),
                      attn_mask=bias[0][:, None].to(q.dtype))
    out, lse = out.transpose(0, 1), lse.transpose(0, 1)  # (kv_heads, rows, n, d), (kv_heads, rows, n)
    if not prefix_k.shape[1]:
        return out
    prefix_out, prefix_lse = _FLASH(q.reshape(1, kv_heads, rows * n, d), prefix_k[None], prefix_v[None])
    prefix_out, prefix_lse = prefix_out.view(kv_heads, rows, n, d), prefix_lse.view(kv_heads, rows, n)
    total = torch.logaddexp(lse, prefix_lse)
    own_share, prefix_share = torch.exp(lse - total)[..., None], torch.exp(prefix_lse - total)[..., None]
    return (out.float() * own_share + prefix_out.float() * prefix_share).to(q.dtype)


def _attention_rows_math(q: Any, prefix_k: Any, prefix_v: Any, own_k: Any, own_v: Any, bias: Any) -> Any:
    """:func:`_attention_rows` in plain products: the prefix's scores are one matrix product
    for all rows, the own columns' a second; one softmax over both (in fp32)."""
    kv_heads, rows, n, d = q.shape
    q = q * d ** -0.5
    prefix_len = prefix_k.shape[1]
    own_scores = torch.matmul(q, own_k.transpose(-1, -2)) + bias  # (kv_heads, rows, n, S)
    if prefix_len:
        prefix_scores = torch.matmul(q.reshape(kv_heads, rows * n, d), prefix_k.transpose(-1, -2))
        scores = torch.cat([prefix_scores.view(kv_heads, rows, n, prefix_len), own_scores], dim=-1)
    else:
        scores = own_scores
    probs = scores.softmax(dim=-1) if scores.dtype == torch.float32 else scores.float().softmax(-1).to(scores.dtype)
    out = torch.matmul(probs[..., prefix_len:], own_v)
    if prefix_len:
        prefix_probs = probs[..., :prefix_len].reshape(kv_heads, rows * n, prefix_len)
        out = out + torch.matmul(prefix_probs, prefix_v).view(kv_heads, rows, n, d)
    return out
