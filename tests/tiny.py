"""Tiny randomly initialised chat models for fast CPU tests of the whole pipeline.

- ``tiny_model_dir()``: a 2-layer Llama (hidden 32) with the real SmolLM2 tokenizer
  (vocab 49,152, ChatML), so renderer, Hermes template and engines see a real
  tokenizer. Its 49k-wide output layer makes training steps cost seconds here.
- ``small_vocab_model_dir()``: the same architecture with a byte-level BPE tokenizer
  of 512 tokens trained on retool's own prompts (ChatML special tokens included):
  any text still encodes, and a training step costs milliseconds.
- ``boxed_digit_model_dir()``: the small-vocab model fine-tuned to answer
  ``\\boxed{d}`` with a random digit — an RL environment in miniature.

All are built once per machine under the retool cache and reused; treat them as
read-only and pair them with ``chat_template="hermes"``.
"""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

_VERSION = "2"
DIGIT_QUESTION = "Reply with one digit in a box."
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _cache(name: str) -> Path:
    from retool.bundled import cache_dir

    return cache_dir() / "test-models" / f"{name}-v{_VERSION}"


def _save(target: Path, model, tokenizer) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            pass
    return target


def _tiny_llama(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@functools.cache
def tiny_model_dir() -> Path:
    """Tiny random Llama + the real SmolLM2 tokenizer (49,152 tokens)."""
    target = _cache("tiny-llama-smollm2-tok")
    if (target / "config.json").is_file():
        return target
    from transformers import AutoTokenizer

    from retool.bundled import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    return _save(target, _tiny_llama(tokenizer), tokenizer)


def small_vocab_tokenizer():
    """A 512-token byte-level BPE trained on retool's prompts, with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from retool.protocol import SYSTEM_PROMPT, TEXT_SYSTEM_PROMPT, TOOL_SCHEMA
    from retool.render import load_chat_template

    import json

    corpus = [SYSTEM_PROMPT, TEXT_SYSTEM_PROMPT, json.dumps(TOOL_SCHEMA), load_chat_template("hermes"),
              DIGIT_QUESTION, *[f"\\boxed{{{d}}}" for d in range(100)], "print(6 * 7)\n42\n"] * 20
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)


@functools.cache
def small_vocab_model_dir() -> Path:
    """Tiny random Llama + the 512-token tokenizer (fast to train)."""
    target = _cache("tiny-llama-small-vocab")
    if (target / "config.json").is_file():
        return target
    tokenizer = small_vocab_tokenizer()
    return _save(target, _tiny_llama(tokenizer), tokenizer)


@functools.cache
def boxed_digit_model_dir() -> Path:
    """The small-vocab model fine-tuned to answer ``\\boxed{d}`` with a random digit d.

    Asked :data:`DIGIT_QUESTION` (text or tool mode, Hermes template), it ends its turn
    with a box around a roughly uniform digit, so a one-digit gold answer is right
    about 1 time in 10: rewards vary within a group and the policy gradient is not
    zero. Trained with the local engine's own cross-entropy loss (seconds).
    """
    target = _cache("tiny-boxed-digit")
    if (target / "config.json").is_file():
        return target
    from retool import algo
    from retool.engines.base import AdamParams
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.protocol import build_messages
    from retool.render import Renderer

    engine = LocalTrainingClient(LocalEngineConfig(model=str(small_vocab_model_dir()), full_finetune=True, seed=0))
    tokenizer = engine.get_tokenizer()
    prompts = []
    for tools in (False, True):
        renderer = Renderer(tokenizer, chat_template="hermes", tools=tools)
        prompts.append(renderer.prompt_tokens(build_messages(DIGIT_QUESTION, tools=tools)))
    rng = random.Random(0)
    for _ in range(80):
        datums = []
        for i in range(16):
            prompt = prompts[i % 2]
            answer = renderer.encode(f"\\boxed{{{rng.randrange(10)}}}") + [renderer.end_of_turn_id]
            segment = renderer.final_turn(answer, [0.0] * len(answer))
            datums.append(algo.make_datum([*prompt, *segment.tokens], [0] * len(prompt) + list(segment.mask)))
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(AdamParams(learning_rate=1e-2))
    return _save(target, engine.model, tokenizer)
