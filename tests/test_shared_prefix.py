"""``prefix_once``: the prefix all datums of a training call share, run once per call.

On the local engine's tiny Llama with LoRA: logprobs and LoRA gradients equal those of
the unshared path (``bucketed``: every datum run whole) for calls whose datums share
nothing, everything or part, with and without gradient checkpointing and chunked
logprobs, over several micro-batches; the prefix's tokens really run once; settings
that cannot work are refused with one clear error.
"""

from __future__ import annotations

import pytest
import torch

from retool import algo
from retool.engines.local import LocalEngineConfig, LocalTrainingClient, training_client
from retool.engines.local.kv_cache import common_prefix
from retool.engines.settings import ModelConfig
from tests.test_engine_local import (  # noqa: F401 - one_torch_thread (autouse) and tiny_model are fixtures used here
    VOCAB, assert_same_step, one_torch_thread, perturb_lora_b, tiny_model)

pytestmark = pytest.mark.timeout(300)


def engine(tiny_model: str, **overrides) -> LocalTrainingClient:
    client = LocalTrainingClient(LocalEngineConfig(model=tiny_model, lora_rank=8, lora_alpha=16.0,
                                                   micro_batch_tokens=24, **overrides))
    perturb_lora_b(client)  # LoRA B starts at zero, and A would get no gradient
    return client


def draw(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=generator).tolist()


def datums(sharing: str, train_prompt: bool = False) -> list:
    """Five datums whose tokens share ``nothing``, ``everything`` or ``part`` (a system
    prompt, then a question per group); prompt tokens are trained when ``train_prompt``."""
    g = torch.Generator().manual_seed(3)
    system, questions = draw(g, 10), [draw(g, 3), draw(g, 2)]
    out = []
    for i, length in enumerate((6, 11, 4, 8, 2)):
        if sharing == "nothing":
            prompt = [3 + i] + draw(g, 4)
        elif sharing == "everything":
            prompt, length = system + questions[0], 6
            g.manual_seed(7)  # the same response every time
        else:
            prompt = system + questions[i % 2]
        tokens = prompt + draw(g, length)
        mask = [0] + [int(train_prompt)] * (len(prompt) - 1) + [1] * length
        logprobs = (-4.0 + torch.randn(len(tokens), generator=g)).tolist()
        out.append(algo.make_datum(tokens, mask, logprobs, advantage=(-1.0) ** i * (0.5 + i)))
    return out


@pytest.mark.parametrize("sharing", ["nothing", "everything", "part"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk", [0, 5])
def test_prefix_once_gives_the_unshared_logprobs_and_gradients(tiny_model, sharing, checkpointing, chunk):
    reference = engine(tiny_model, packing="bucketed")
    shared = engine(tiny_model, packing="shared-prefix", prefix_once=True,
                    gradient_checkpointing=checkpointing, logprob_chunk_tokens=chunk)
    assert_same_step(reference, shared, datums(sharing), "ppo")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_prefix_once_trains_weighted_prefix_tokens(tiny_model, checkpointing):
    """SFT-like: the shared prompt's own tokens are trained too (their gradient reaches
    the prefix through its logprobs, not only through its keys and values)."""
    reference = engine(tiny_model, packing="bucketed")
    shared = engine(tiny_model, packing="shared-prefix", prefix_once=True, gradient_checkpointing=checkpointing)
    assert_same_step(reference, shared, datums("part", train_prompt=True), "cross_entropy")


def embedded_tokens(client: LocalTrainingClient, data: list) -> int:
    """How many tokens the model's layers ran in one ``forward_backward`` call."""
    counted = []
    embedding = client.model.get_input_embeddings()
    handle = embedding.register_forward_hook(lambda module, args, out: counted.append(args[0].numel()))
    try:
        client.forward_backward(data, "ppo")
    finally:
        handle.remove()
    return sum(counted)


def test_the_shared_prefix_runs_once_per_call(tiny_model):
    data = datums("part")
    shared = common_prefix([d.input_tokens_N for d in data])
    plan = algo.plan_micro_batches([d.num_tokens - shared for d in data], 24 - shared, "shared-prefix")
    assert shared >= 10 and len(plan) > 1
    per_micro_batch = embedded_tokens(engine(tiny_model, packing="shared-prefix"), data)
    once = embedded_tokens(engine(tiny_model, packing="shared-prefix", prefix_once=True), data)
    # the call's prefix once, then each micro-batch's packed row of what follows it (a
    # question its datums share counted once in that row)
    rows = [[data[i].input_tokens_N[shared:] for i in indices] for indices in plan]
    assert once == shared + sum(sum(map(len, r)) - (len(r) - 1) * common_prefix(r) * (len(r) > 1) for r in rows)
    assert per_micro_batch == sum(shared + sum(map(len, r)) - (len(r) - 1) * common_prefix(r) * (len(r) > 1)
                                  for r in rows)


def test_prefix_once_needs_shared_prefix_packing(tiny_model):
    with pytest.raises(ValueError, match="prefix_once needs packing='shared-prefix' or 'prefix-tree'"):
        engine(tiny_model, packing="packed", prefix_once=True)


def test_prefix_once_reaches_the_engine_from_the_model_settings(tiny_model):
    cfg = ModelConfig(model=tiny_model, lora_rank=8, packing="shared-prefix", prefix_once=True, device="cpu")
    assert training_client(cfg, seed=0, init_from=None).config.prefix_once is True
