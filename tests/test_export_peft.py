"""A service adapter in Tinker's documented layout becomes a PEFT adapter that loads into
the Hugging Face model (``retool.export.build_peft_adapter``).

The fixture is built from the layout tinker-cookbook documents (its weights README and
test fixtures), not from retool's own folders: keys under ``base_model.model.``, the
output layer as ``model.unembed_tokens``, Qwen3.5's linear-attention Q/K/V as three
adapters ``in_proj_q/k/v`` of unequal widths where Hugging Face fuses ``in_proj_qkv``, and
an ``adapter_config.json`` of ``r`` and ``lora_alpha``. The model is a tiny random
Qwen3.5 (one linear-attention and one full-attention layer, tied embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from retool.export import build_peft_adapter, hf_module

RANK, ALPHA = 2, 6.0
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp("tiny-qwen35")
    config = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention"], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def tinker_modules() -> dict[str, tuple[int, int]]:
    """Module -> (out, in) as Tinker names them for the tiny model: split Q/K/V (Q and K
    16 wide, V 32), the output layer as ``model.unembed_tokens``."""
    layer0, layer1 = "model.layers.0.linear_attn", "model.layers.1.self_attn"
    modules = {f"{layer0}.in_proj_q": (16, 32), f"{layer0}.in_proj_k": (16, 32), f"{layer0}.in_proj_v": (32, 32),
               f"{layer0}.in_proj_z": (32, 32), f"{layer0}.in_proj_a": (4, 32), f"{layer0}.in_proj_b": (4, 32),
               f"{layer0}.out_proj": (32, 32), f"{layer1}.q_proj": (64, 32), f"{layer1}.k_proj": (16, 32),
               f"{layer1}.v_proj": (16, 32), f"{layer1}.o_proj": (32, 32), "model.unembed_tokens": (64, 32)}
    for i in (0, 1):
        modules |= {f"model.layers.{i}.mlp.gate_proj": (48, 32), f"model.layers.{i}.mlp.up_proj": (48, 32),
                    f"model.layers.{i}.mlp.down_proj": (32, 48)}
    return modules


def tinker_adapter(folder: Path, drop: tuple[str, ...] = (), extra: dict | None = None) -> dict[str, tuple]:
    """Write the fixture; return module -> (A, B) as written."""
    g = torch.Generator().manual_seed(1)
    pairs = {m: (torch.randn(RANK, n_in, generator=g), torch.randn(n_out, RANK, generator=g))
             for m, (n_out, n_in) in tinker_modules().items() if m not in drop}
    tensors = {f"base_model.model.{m}.lora_{h}.weight": t for m, (a, b) in pairs.items() for h, t in (("A", a), ("B", b))}
    folder.mkdir(parents=True)
    save_file(tensors | (extra or {}), str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"lora_alpha": ALPHA, "r": RANK}))
    return pairs


def test_a_tinker_adapter_loads_with_peft_and_gives_the_trained_update(qwen35, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pairs = tinker_adapter(tmp_path / "tinker")
    out = build_peft_adapter(tmp_path / "tinker", str(qwen35), tmp_path / "peft")
    config = json.loads((out / "adapter_config.json").read_text())
    qkv = "model.layers.0.linear_attn.in_proj_qkv"
    assert qkv in config["target_modules"] and "lm_head" in config["target_modules"]
    assert not any(t.endswith(("in_proj_q", "in_proj_k", "in_proj_v", "unembed_tokens")) for t in config["target_modules"])
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)

    base = AutoModelForCausalLM.from_pretrained(qwen35, dtype=torch.float32)
    logits_base = base(torch.tensor([[3, 5, 7, 9]])).logits
    model = PeftModel.from_pretrained(base, out)
    scale = ALPHA / RANK

    def delta(module: str) -> torch.Tensor:
        return model.base_model.model.get_submodule(module).get_delta_weight("default")

    # the fused projection's update is the three trained updates stacked, Q || K || V
    expected = torch.cat([pairs[f"model.layers.0.linear_attn.in_proj_{x}"][1]
                          @ pairs[f"model.layers.0.linear_attn.in_proj_{x}"][0] for x in "qkv"]) * scale
    torch.testing.assert_close(delta(qkv), expected)
    b, a = pairs["model.layers.1.self_attn.q_proj"][1], pairs["model.layers.1.self_attn.q_proj"][0]
    torch.testing.assert_close(delta("model.layers.1.self_attn.q_proj"), b @ a * scale)
    b, a = pairs["model.unembed_tokens"][1], pairs["model.unembed_tokens"][0]
    torch.testing.assert_close(delta("lm_head"), b @ a * scale)
    assert not torch.allclose(model(torch.tensor([[3, 5, 7, 9]])).logits, logits_base)


@pytest.mark.parametrize("case, match", [
    ("missing v", "all three are needed"),
    ("unknown module", "does not have"),
    ("bad shape", "do not fit"),
    ("not lora", "not a LoRA A or B weight"),
])
def test_an_adapter_that_does_not_fit_the_model_is_refused_with_its_module(qwen35, tmp_path, case, match):
    drop = ("model.layers.0.linear_attn.in_proj_v",) if case == "missing v" else ()
    extra = {
        "unknown module": {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(RANK, 32),
                           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, RANK)},
        "bad shape": {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": torch.ones(RANK, 31)},
        "not lora": {"base_model.model.model.norm.weight": torch.ones(32)},
    }.get(case)
    tinker_adapter(tmp_path / "tinker", drop=drop, extra=extra)
    with pytest.raises(RuntimeError, match=match):
        build_peft_adapter(tmp_path / "tinker", str(qwen35), tmp_path / "peft")
    assert not (tmp_path / "peft").exists()


def test_module_names_map_to_the_text_or_the_vision_language_model():
    text = {"model.layers.0.mlp.up_proj": (1, 1), "lm_head": (1, 1)}
    vision_language = {"model.language_model.layers.0.mlp.up_proj": (1, 1), "lm_head": (1, 1)}
    assert hf_module("base_model.model.model.layers.0.mlp.up_proj", text) == "model.layers.0.mlp.up_proj"
    assert hf_module("base_model.model.model.layers.0.mlp.up_proj", vision_language) == \
        "model.language_model.layers.0.mlp.up_proj"
    assert hf_module("base_model.model.model.unembed_tokens", vision_language) == "lm_head"
    assert hf_module("base_model.model.model.layers.0.mlp.gate_proj", text) is None
