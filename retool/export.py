"""``retool export RUN --output-dir DIR``: a run's trained LoRA adapter as a PEFT folder.

``RUN`` is a run folder (its newest complete checkpoint), a ``checkpoints/step_N``
folder or an engine folder. A local-engine checkpoint already holds a PEFT folder
(``adapter/``), which is copied. A service checkpoint (``--engine tinker|pytrio``) holds
only pointers, so the adapter is downloaded from the service
(:func:`retool.engines.tinker.export_adapter`) and converted here
(:func:`build_peft_adapter`) into a PEFT adapter for the Hugging Face model.

**Tinker's names are not Hugging Face's.** Tinker's adapter files are PEFT-shaped
(``adapter_model.safetensors`` with ``<module>.lora_A/B.weight`` keys under
``base_model.model.``, ``adapter_config.json`` with ``r`` and ``lora_alpha``), but its
module names are its own, as tinker-cookbook's adapter builder documents:

- ``model.unembed_tokens`` is the output layer, ``lm_head`` in Hugging Face (also when the
  embeddings are tied: PEFT puts the LoRA on the output side only, as trained);
- Qwen3.5's linear-attention layers are trained as three adapters ``in_proj_q/k/v`` where
  Hugging Face has one fused ``in_proj_qkv`` (rows Q‖K‖V): the three become one LoRA of
  rank ``3r`` (``A`` stacked, ``B`` block-diagonal, ``alpha`` ``3 alpha`` so the scale
  stays ``alpha / r``), which gives exactly the same update;
- a vision-language checkpoint (Qwen3.5's hub class) puts the text model under
  ``model.language_model.``.

Every module is then looked up in the Hugging Face model (built from its config on the
meta device, no weights loaded): a module it lacks, or a shape that does not fit, is an
error naming it; the result is loaded with PEFT into that model before it is written.
Names that are already Hugging Face's pass unchanged (PyTRIO's layout is undocumented).
tinker-cookbook itself does not install beside retool (its ``tml-renderers>=0.4.1`` is
not on the index here); this follows its documented layout, not its code.

Not covered: full fine-tuned weights (a ``model.safetensors``, copy it yourself),
merging the adapter into the base model, MoE expert adapters, age-encrypted exports.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.bundled import resolve_model_name
from retool.config import ConfigError
from retool.engines.base import EngineCheckpoint
from retool.engines.tinker import FLAVOURS, export_adapter
from retool.flag_checks import output_folder, refuse_renamed
from retool.runs import resolve_checkpoint

PEFT_PREFIX = "base_model.model."
"""Where PEFT's (and Tinker's) adapter keys start."""
SPLIT_QKV = ("in_proj_q", "in_proj_k", "in_proj_v")
FUSED_QKV = "in_proj_qkv"
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])(?:\.default)?\.weight$")


def export(run: str | Path, output: str | Path, base_url: str | None = None) -> Path:
    """Write the adapter of ``run``'s checkpoint to the folder ``output``; return it."""
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"--output-dir {output}: the folder exists and is not empty")
    checkpoint = resolve_checkpoint(run, flag="RUN")
    record = EngineCheckpoint.read(checkpoint.engine_dir)
    if record.full_finetune:
        raise ConfigError(f"RUN {run}: a full fine-tune has no adapter (copy {checkpoint.engine_dir}/model.safetensors)")
    if record.engine == "local":
        shutil.copytree(Path(checkpoint.engine_dir) / record.weights, output, dirs_exist_ok=True)
        return output

    if record.engine not in FLAVOURS:
        raise ConfigError(f"RUN {run}: cannot export a checkpoint of the {record.engine} engine")
    return export_adapter(FLAVOURS[record.engine], checkpoint.engine_dir, output, base_url=base_url)


# ---------------------------------------------------------------- service adapters as PEFT adapters


@dataclass(frozen=True)
class ModuleLora:
    """One Hugging Face module's LoRA: ``lora_A`` (rank, in), ``lora_B`` (out, rank)."""

    module: str
    lora_A: Any
    lora_B: Any
    alpha: float


def build_peft_adapter(adapter_dir: str | Path, model: str, output: str | Path) -> Path:
    """Convert the service adapter in ``adapter_dir`` into a PEFT adapter for ``model``
    (a Hugging Face name or folder) in ``output``; checked to load with PEFT first."""
    from safetensors.torch import load_file, save_file  # heavy (torch): only the conversion needs it

    adapter_dir, output = Path(adapter_dir), Path(output)
    config = _adapter_config(adapter_dir)
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    hf_model = meta_model(model)
    linear = {n: (m.out_features, m.in_features) for n, m in hf_model.named_modules()
              if type(m).__name__ == "Linear"}
    loras = to_hf_modules(weights, linear, float(config["lora_alpha"]))
    peft_config = lora_config(loras, int(config["r"]), float(config["lora_alpha"]), model)
    tensors = {f"{PEFT_PREFIX}{m.module}.lora_{half}.weight": t.contiguous()
               for m in loras for half, t in (("A", m.lora_A), ("B", m.lora_B))}
    check_peft_loads(hf_model, peft_config, tensors)
    output.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(output))
    save_file(tensors, str(output / "adapter_model.safetensors"))
    return output


def _adapter_config(folder: Path) -> dict[str, Any]:
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (folder / f).is_file()]
    if missing:
        raise RuntimeError(f"the downloaded adapter has no {', '.join(missing)}; it holds "
                           f"{sorted(p.name for p in folder.iterdir())}")
    config = json.loads((folder / "adapter_config.json").read_text())
    if not all(isinstance(config.get(k), (int, float)) for k in ("r", "lora_alpha")):
        raise RuntimeError(f"{folder / 'adapter_config.json'} has no numeric r and lora_alpha")
    return config


def meta_model(model: str) -> Any:
    """The Hugging Face causal LM of ``model`` on the meta device (its config only)."""
    # torch and transformers: heavy, only the conversion needs them
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_name(model))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def hf_module(name: str, linear: dict[str, tuple[int, int]]) -> str | None:
    """The Hugging Face module an adapter module name means, or ``None`` if none."""
    name = name.removeprefix(PEFT_PREFIX)
    if name in ("model.unembed_tokens", "unembed_tokens"):
        name = "lm_head"
    candidates = [name]
    if name.startswith("model.") and not name.startswith("model.language_model."):
        candidates.append("model.language_model." + name.removeprefix("model."))
    return next((c for c in candidates if c in linear), None)


def to_hf_modules(weights: dict[str, Any], linear: dict[str, tuple[int, int]], alpha: float) -> list[ModuleLora]:
    """The adapter's LoRAs on Hugging Face modules: renamed, split Q/K/V fused, and
    every shape checked against the module's (module docstring)."""
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in weights.items():
        match = _KEY.match(key)
        if match is None:
            raise RuntimeError(f"the adapter holds {key!r}, which is not a LoRA A or B weight")
        pairs.setdefault(match["module"], {})[match["half"]] = tensor
    loras, split = [], {}
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise RuntimeError(f"the adapter has only lora_{''.join(pair)} for {name}")
        target = hf_module(name, linear)
        leaf = name.rsplit(".", 1)[-1]
        if target is None and leaf in SPLIT_QKV:
            fused = hf_module(name[: -len(leaf)] + FUSED_QKV, linear)
            if fused is not None:
                split.setdefault(fused, {})[leaf] = pair
                continue
        if target is None:
            raise RuntimeError(f"the adapter trains {name}, which the Hugging Face model does not have "
                               f"(e.g. it has {next(iter(linear), '?')})")
        loras.append(_checked(ModuleLora(target, pair["A"], pair["B"], alpha), linear))
    loras += [_checked(fuse_qkv(fused, parts, alpha), linear) for fused, parts in sorted(split.items())]
    if not loras:
        raise RuntimeError("the adapter holds no LoRA weights")
    return sorted(loras, key=lambda m: m.module)


def fuse_qkv(module: str, parts: dict[str, dict[str, Any]], alpha: float) -> ModuleLora:
    """Three LoRAs on the rows Q‖K‖V of one fused projection as one LoRA of their summed
    rank: ``A`` stacked, ``B`` block-diagonal, ``alpha`` scaled with the rank."""
    import torch  # heavy: only the conversion needs it

    missing = [leaf for leaf in SPLIT_QKV if leaf not in parts]
    if missing:
        raise RuntimeError(f"{module}: the adapter trains {sorted(parts)} but not {missing}; all three "
                           "are needed to fuse them")
    a_parts = [parts[leaf]["A"] for leaf in SPLIT_QKV]
    b_parts = [parts[leaf]["B"] for leaf in SPLIT_QKV]
    rank = a_parts[0].shape[0]
    return ModuleLora(module, torch.cat(a_parts, dim=0), torch.block_diag(*b_parts),
                      alpha * sum(a.shape[0] for a in a_parts) / rank)


def _checked(lora: ModuleLora, linear: dict[str, tuple[int, int]]) -> ModuleLora:
    out_features, in_features = linear[lora.module]
    rank = lora.lora_A.shape[0]
    if tuple(lora.lora_A.shape) != (rank, in_features) or tuple(lora.lora_B.shape) != (out_features, rank):
        raise RuntimeError(f"{lora.module}: LoRA A {tuple(lora.lora_A.shape)} / B {tuple(lora.lora_B.shape)} do not "
                           f"fit the module ({out_features} x {in_features})")
    return lora


def lora_config(loras: list[ModuleLora], rank: int, alpha: float, model: str) -> Any:
    """PEFT's ``LoraConfig`` for ``loras``: exact module paths as targets, and the fused
    modules' own rank and alpha."""
    from peft import LoraConfig  # heavy (torch, transformers): only the conversion needs it

    odd = [m for m in loras if m.lora_A.shape[0] != rank]
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=[m.module for m in loras], lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=model,
                      rank_pattern={re.escape(m.module): int(m.lora_A.shape[0]) for m in odd},
                      alpha_pattern={re.escape(m.module): m.alpha for m in odd})


def check_peft_loads(model: Any, config: Any, tensors: dict[str, Any]) -> None:
    """Inject ``config`` into the (meta) model with PEFT and load ``tensors``: every key
    must find its module and shape, and every LoRA module its weights."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict  # heavy: only the check needs it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # meta tensors: the copy is a no-op, the key and shape checks are not
        injected = inject_adapter_in_model(config, model)
        result = set_peft_model_state_dict(injected, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()})
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise RuntimeError(f"the converted adapter does not load with PEFT: unexpected {result.unexpected_keys[:3]}, "
                           f"missing {missing[:3]}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", description=__doc__.split("\n\n")[0])
    p.add_argument("run", metavar="RUN", help="a run folder, a checkpoints/step_N folder or an engine folder")
    p.add_argument("--output-dir", required=True, help="the folder to write (must be new or empty)")
    refuse_renamed(p, "--output", "--output-dir", "export writes a folder")
    p.add_argument("--base-url", default=None, help="service URL for a service checkpoint (default: the SDK's "
                                                    "environment variable or its default)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        folder = export(args.run, output_folder(args.output_dir, "--output-dir"), base_url=args.base_url)
    except (ConfigError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"adapter: {folder}")
    return 0
