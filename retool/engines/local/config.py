"""``LocalEngineConfig``: every setting of the local engine, one frozen record (the
sampler's own settings are the ``LocalSettings`` record the ``--local-*`` flags fill).

Not covered: what the settings do (``trainer``, ``sampler``, ``model``); the trainer's
own step settings (``retool.engines.base.AdamParams``, ``SamplingParams``).
"""

from __future__ import annotations

from dataclasses import dataclass

from retool.engines.settings import LocalSettings


@dataclass(frozen=True)
class LocalEngineConfig:
    """Everything the local engine needs; defaults run on the CPU."""

    model: str
    """A Hugging Face hub id, a local model folder, or ``bundled:smollm2`` (no default here:
    commands pass theirs, ``retool.engines.DEFAULT_MODEL`` unless told otherwise)."""
    full_finetune: bool = False
    """Train every parameter instead of a LoRA adapter."""
    lora_rank: int = 32
    lora_alpha: float = 32.0
    """LoRA scale is ``alpha / rank`` (1.0 with the defaults)."""
    lora_dropout: float = 0.0
    lora_targets: str | tuple[str, ...] = "all-linear"
    """PEFT ``target_modules``: ``all-linear`` (every linear layer but the output head;
    covers hybrid models such as Qwen3.5 whose linear-attention layers use
    ``in_proj_*``/``out_proj``) or module-name suffixes like ``("q_proj", "v_proj")``."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """The weights' dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32`` or
    ``bfloat16``; LoRA weights stay fp32 either way. bf16 arithmetic is fast only on a CPU
    with native bf16 instructions (AVX512-BF16 or AMX): on an AMD EPYC with AVX512-BF16
    and torch 2.13 a 2048x576 @ 576x1536 matmul ran at 622 GFLOP/s in bf16 against 154 in
    fp32, and a SmolLM2-135M + LoRA forward+backward 2.1x faster under bf16 autocast;
    CPUs without them emulate bf16 and run it many times slower than fp32. To train in
    bf16 over fp32 weights use ``train_precision``."""
    train_precision: str = "fp32"
    """The arithmetic of the training forward and backward (``forward_backward``,
    ``forward``): ``fp32`` (the weights' own dtype, no autocast), ``bf16``
    (``torch.autocast`` to bfloat16 around the layers below the output head, and so
    around their recomputation under gradient checkpointing and the ``prefix_once``
    prefix; the master weights, LoRA parameters, Adam moments, output head, log-softmax,
    entropy and loss stay fp32) or ``auto`` (bf16 on CUDA and on a CPU with native bf16
    instructions, else fp32; the trainer logs which). The sampler and the weight-sync
    guard's trainer-side probe always run in the weights' dtype."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch (padded size when bucketed)."""
    packing: str = "bucketed"
    """``bucketed`` (similar lengths, right-padded), ``packed`` (padding-free, one row
    per micro-batch), ``shared-prefix`` (packed, and the prompt prefix all sequences
    of a micro-batch share — system prompt, tool declaration, a group's question — is
    computed once; 2-3x less compute for short RL/SFT turns under a long prompt) or
    ``prefix-tree`` (packed as the sequences' prefix tree, ``algo.prefix_tree``: every
    prefix that two or more of them share runs once — in RL, a group's question and the
    opening its samples have in common too). The packed layouts need a pure-attention
    model (checked at start-up)."""
    logprob_chunk_tokens: int = 0
    """0: build the full logits of a micro-batch at once (``tokens x vocabulary`` floats,
    and as much again for their gradient). N > 0: compute the output layer and
    log-softmax N tokens at a time, recomputed in the backward, so the logits' memory is
    ``N x vocabulary`` whatever the micro-batch (same values and gradients; one extra
    output-layer matmul). E.g. 1024 for a 150-250k vocabulary on a GPU."""
    prefix_once: bool = False
    """With ``packing='shared-prefix'`` or ``'prefix-tree'``: run the input prefix every datum of a
    ``forward_backward`` call shares (the rendered system prompt) once per call, not once
    per micro-batch; the micro-batches run only what follows it, against its keys and
    values, and its gradient is the sum of theirs (``trained_prefix``). Same logprobs and
    gradients up to float rounding; needs a model whose logits are ``head(decoder(...))``."""
    sampler: LocalSettings = LocalSettings()
    """The sampler's settings (request window, rows per batch, prefix cache, KV store,
    batch KV budget, fast path, decode loop): ``retool.engines.LocalSettings``, the record
    the ``--local-*`` flags fill; see ``LocalSamplingClient``."""
    seed: int = 42
    """Seeds the adapter initialisation and the sampling stream."""
    init_from: str | None = None
    """A ``save_state`` folder or PEFT adapter folder whose weights start training
    (weights only: e.g. the SFT adapter an RL run starts from)."""
    trust_remote_code: bool = False
