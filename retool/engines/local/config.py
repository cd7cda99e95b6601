"""``LocalEngineConfig``: every setting of the local engine, one flat frozen record.

Not covered: what the settings do (``trainer``, ``sampler``, ``model``); the trainer's
own step settings (``retool.engines.base.AdamParams``, ``SamplingParams``).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    """``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32`` or ``bfloat16``.
    bf16 on a CPU is ~30x slower than fp32 here; LoRA weights stay fp32 either way."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch (padded size when bucketed)."""
    packing: str = "bucketed"
    """``bucketed`` (similar lengths, right-padded), ``packed`` (padding-free, one row
    per micro-batch) or ``shared-prefix`` (packed, and the prompt prefix all sequences
    of a micro-batch share — system prompt, tool declaration, a group's question — is
    computed once; 2-3x less compute for short RL/SFT turns under a long prompt). The
    last two need a pure-attention model (checked at start-up)."""
    logprob_chunk_tokens: int = 0
    """0: build the full logits of a micro-batch at once (``tokens x vocabulary`` floats,
    and as much again for their gradient). N > 0: compute the output layer and
    log-softmax N tokens at a time, recomputed in the backward, so the logits' memory is
    ``N x vocabulary`` whatever the micro-batch (same values and gradients; one extra
    output-layer matmul). E.g. 1024 for a 150-250k vocabulary on a GPU."""
    sample_window_s: float = 0.01
    """How long the sampler waits for concurrent requests before a ``generate`` call."""
    max_sample_rows: int = 64
    """Most sequences generated together in one ``generate`` call."""
    sample_prefix_cache: bool = True
    """Compute a prompt prefix the rows of a ``generate`` call share once (see
    ``LocalSamplingClient``); off for models whose cache is not pure attention."""
    sample_kv_cache_mb: int = 1024
    """Memory for the KV caches of earlier sequences that later turns continue (see
    ``LocalSamplingClient``); 0 turns the reuse off. Pure-attention models only."""
    fast_sampling: bool = True
    """Let the sampler use its prefix cache, KV store, reserved decode room and own decode
    loop, which reach into transformers' cache internals (``hf_compat``); it uses them
    only on a tested transformers release and unless ``RETOOL_FAST_SAMPLING=0``. Off:
    plain ``generate``, the same tokens, slower."""
    decode_loop: str = "lean"
    """``lean``: the sampler's own decode loop with lean decode steps (merged LoRA weights,
    the shared prefix's KV read once; Llama/Qwen2/Qwen3 models, others get ``own``);
    ``own``: that loop through the model's forward pass, once per token, finished rows
    dropped from the batch; ``generate``: one HF ``generate`` call per batch (the first
    path). All give the same tokens up to float rounding. See ``LocalSamplingClient``."""
    seed: int = 42
    """Seeds the adapter initialisation and the sampling stream."""
    init_from: str | None = None
    """A ``save_state`` folder or PEFT adapter folder whose weights start training
    (weights only: e.g. the SFT adapter an RL run starts from)."""
    trust_remote_code: bool = False
