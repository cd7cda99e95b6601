"""``prefix-tree`` packing: every prefix two or more datums share runs once.

The tree itself (``algo.prefix_tree``) against the sequences it was built from; the
planner's micro-batches against their budget; the trainer's ancestor mask against the
ancestor relation computed pair by pair; and on the local engine's tiny Llama with LoRA,
logprobs, loss, entropy and LoRA gradients equal to the unshared path's (``bucketed``:
every datum run whole) for RL-shaped calls — groups whose samples share their question
and an opening of their answer — with and without ``prefix_once``, gradient
checkpointing and chunked logprobs, over one and several micro-batches, while the
model's layers run only the tree's nodes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from retool import algo
from retool.engines.local import trainer
from retool.engines.local.kv_cache import common_prefix
from tests.test_engine_local import (  # noqa: F401 - one_torch_thread (autouse) and tiny_model are fixtures used here
    assert_same_step, one_torch_thread, tiny_model)
from tests.test_shared_prefix import draw, embedded_tokens, engine

pytestmark = pytest.mark.timeout(300)


def all_prefixes(sequences: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(s[:n]) for s in sequences for n in range(1, len(s) + 1)}


def random_sequences(rng: random.Random, n: int) -> list[list[int]]:
    """Sequences that branch off one another at random depths (and a repeat, a prefix of another)."""
    out = [[rng.randrange(5) for _ in range(rng.randint(1, 12))]]
    for _ in range(n - 1):
        base = rng.choice(out)
        out.append(base[:rng.randint(0, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 8))] or [1])
    out.append(list(out[0]))
    out.append(out[1][:max(1, len(out[1]) // 2)])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_tree_holds_every_sequence_and_each_shared_prefix_once(seed):
    sequences = random_sequences(random.Random(seed), 8)
    tree = algo.prefix_tree(sequences)
    assert len(tree.tokens_L) == len(all_prefixes(sequences))  # one node per distinct prefix
    for sequence, path in zip(sequences, tree.paths_D, strict=True):
        assert [tree.tokens_L[node] for node in path] == sequence
        assert [tree.depths_L[node] for node in path] == list(range(len(sequence)))
        assert [tree.parents_L[node] for node in path] == [-1, *path[:-1]]
    assert all(parent < node for node, parent in enumerate(tree.parents_L))  # a parent before its children


def test_a_hand_made_tree():
    tree = algo.prefix_tree([[1, 2, 3], [1, 2, 4, 5], [1, 6], [1, 2, 3]])
    assert tree.tokens_L == (1, 2, 3, 4, 5, 6)
    assert tree.depths_L == (0, 1, 2, 2, 3, 1)
    assert tree.parents_L == (-1, 0, 1, 1, 3, 0)
    assert tree.paths_D == ((0, 1, 2), (0, 1, 3, 4), (0, 5), (0, 1, 2))


@pytest.mark.parametrize("seed", range(20))
def test_the_ancestor_mask_is_the_ancestor_relation(seed):
    tree = algo.prefix_tree(random_sequences(random.Random(seed), 8))
    mask = trainer._ancestor_mask(tree, torch.device("cpu"))
    size = len(tree.tokens_L)
    expected = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        walk = node
        while walk >= 0:
            expected[node, walk] = True
            walk = tree.parents_L[walk]
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("budget", [1, 6, 15, 40])
def test_planned_micro_batches_fit_their_tree_in_the_budget(seed, budget):
    sequences = random_sequences(random.Random(seed), 10)
    plan = algo.plan_micro_batches([len(s) for s in sequences], budget, "prefix-tree", sequences_D=sequences)
    assert sorted(i for batch in plan for i in batch) == list(range(len(sequences)))
    for batch in plan:
        size = len(all_prefixes([sequences[i] for i in batch]))
        assert size <= budget or len(batch) == 1
    # one micro-batch for everything when the whole tree fits
    whole = len(all_prefixes(sequences))
    assert len(algo.plan_micro_batches([len(s) for s in sequences], whole, "prefix-tree", sequences_D=sequences)) == 1


def test_the_planner_takes_sequences_that_match_the_lengths():
    # without sequences, the lengths' sum (never below the tree's size) is the cost
    assert algo.plan_micro_batches([3, 4, 5], 7, "prefix-tree") == algo.plan_micro_batches([3, 4, 5], 7, "packed")
    with pytest.raises(ValueError, match="token sequences"):
        algo.plan_micro_batches([3, 4], 10, "prefix-tree", sequences_D=[[1, 2, 3], [1, 2]])


def group_datums(train_prompt: bool = False) -> list:
    """Two groups of three samples under a shared system prompt: each group's question,
    and within a group an opening two of its samples share before they part (as RL
    samples of one problem do); one sample repeats another whole."""
    g = torch.Generator().manual_seed(5)
    system = draw(g, 9)
    out = []
    for group in range(2):
        question, opening = draw(g, 3 + group), draw(g, 4)
        responses = [opening + draw(g, 5), opening[:2] + draw(g, 3), draw(g, 6)]
        responses.append(list(responses[0]))
        for i, response in enumerate(responses):
            prompt = system + question
            tokens = prompt + response
            mask = [0] + [int(train_prompt)] * (len(prompt) - 1) + [1] * len(response)
            logprobs = (-4.0 + torch.randn(len(tokens), generator=g)).tolist()
            out.append(algo.make_datum(tokens, mask, logprobs, advantage=(-1.0) ** i * (0.5 + i + group)))
    return out


@pytest.mark.parametrize("prefix_once", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk", [0, 5])
@pytest.mark.parametrize("budget", [24, 4096])
def test_prefix_tree_gives_the_unshared_logprobs_and_gradients(tiny_model, prefix_once, checkpointing, chunk,
                                                               budget):
    reference = engine(tiny_model, packing="bucketed")
    tree = engine(tiny_model, packing="prefix-tree", prefix_once=prefix_once, gradient_checkpointing=checkpointing,
                  logprob_chunk_tokens=chunk)
    tree.config = dataclasses.replace(tree.config, micro_batch_tokens=budget)
    assert_same_step(reference, tree, group_datums(), "ppo")


@pytest.mark.parametrize("prefix_once", [False, True])
def test_prefix_tree_trains_weighted_prompt_tokens(tiny_model, prefix_once):
    """SFT-like: prompt tokens trained too, so gradients reach shared nodes through their logprobs."""
    reference = engine(tiny_model, packing="bucketed")
    tree = engine(tiny_model, packing="prefix-tree", prefix_once=prefix_once)
    assert_same_step(reference, tree, group_datums(train_prompt=True), "cross_entropy")


@pytest.mark.parametrize("prefix_once", [False, True])
def test_the_layers_run_each_tree_node_once(tiny_model, prefix_once):
    data = group_datums()
    shared = common_prefix([d.input_tokens_N for d in data])
    inputs = [list(d.input_tokens_N[shared:]) for d in data]
    plan = algo.plan_micro_batches([len(x) for x in inputs], 24 - shared, "prefix-tree", sequences_D=inputs)
    assert len(plan) > 1
    trees = [len(all_prefixes([inputs[i] for i in batch])) for batch in plan]
    tree_tokens = embedded_tokens(engine(tiny_model, packing="prefix-tree", prefix_once=prefix_once), data)
    prefix_tokens = embedded_tokens(engine(tiny_model, packing="shared-prefix", prefix_once=prefix_once), data)
    if prefix_once:  # the call's prefix once, then each micro-batch's tree of what follows it
        assert tree_tokens == shared + sum(trees)
    else:  # each micro-batch's tree of its whole inputs (the call's prefix in each)
        assert tree_tokens == sum(shared + t for t in trees)
    assert tree_tokens < prefix_tokens  # the groups' questions and openings ran once


def test_prefix_once_takes_the_prefix_tree(tiny_model):
    assert engine(tiny_model, packing="prefix-tree", prefix_once=True).config.prefix_once is True
    with pytest.raises(ValueError, match="prefix_once needs packing='shared-prefix' or 'prefix-tree'"):
        engine(tiny_model, packing="packed", prefix_once=True)
