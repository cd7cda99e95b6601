"""The local sampler's own decode loop (``decode_loop="own"``) against HF ``generate``.

On the tiny random Llama of ``test_engine_local``: both paths sample the same tokens
with logprobs within 1e-4 (also where finished rows are dropped from the batch and
where the shared-prefix cache and the KV store lay the rows out), each is reproducible
from its seed, and the own loop really shrinks its batch as rows finish.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from retool.engines import LocalSettings, base
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.engines.local.sampler import LocalSamplingClient
from tests.test_engine_local import build_tiny_model, sample, teacher_forced_logprobs

pytestmark = pytest.mark.timeout(300)

SYSTEM = [2] + [3 + (5 * i) % 40 for i in range(19)]  # a 20-token shared "system prompt"
STOPS = tuple(range(3, 9))  # ~1 in 10 tokens ends a row: rows finish at different steps


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def engine(tiny_model: str, loop: str, **overrides) -> LocalTrainingClient:
    return LocalTrainingClient(LocalEngineConfig(model=tiny_model, lora_rank=8, lora_alpha=16.0,
                                                 decode_loop=loop, **overrides))


def batch(client: LocalTrainingClient, prompts, n: int, params) -> list[base.SampleResult]:
    async def together():
        return await asyncio.gather(*(client.sampler.sample(p, n, params) for p in prompts))
    return asyncio.run(together())


def flat(results: list[base.SampleResult]) -> list[base.SampledSequence]:
    return [s for r in results for s in r.sequences]


PROMPTS = [SYSTEM + [10, 11], SYSTEM + [12], SYSTEM + [13, 14, 15, 16], [2, 20, 21]]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_own_loop_samples_what_generate_samples(tiny_model, prefix_cache):
    params = base.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, stop_token_ids=STOPS, seed=5)
    own = flat(batch(engine(tiny_model, "own", sample_prefix_cache=prefix_cache), PROMPTS, 4, params))
    hf = flat(batch(engine(tiny_model, "generate", sample_prefix_cache=prefix_cache), PROMPTS, 4, params))
    assert [s.tokens for s in own] == [s.tokens for s in hf]
    assert [s.stop_reason for s in own] == [s.stop_reason for s in hf]
    assert len({len(s.tokens) for s in own}) > 2  # rows really finished at different steps
    for a, b in zip(own, hf):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_own_loop_logprobs_are_the_teacher_forced_policy(tiny_model):
    client = engine(tiny_model, "own")
    params = base.SamplingParams(max_tokens=10, temperature=0.7, top_k=12, stop_token_ids=STOPS, seed=2)
    for prompt, result in zip(PROMPTS, batch(client, PROMPTS, 3, params)):
        for seq in result.sequences:
            expected = teacher_forced_logprobs(client, prompt, seq.tokens, 0.7)
            assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)
            assert seq.tokens[-1] in STOPS or len(seq.tokens) == 10


@pytest.mark.parametrize("loop", ["own", "generate"])
def test_each_loop_is_reproducible_from_its_seed(tiny_model, loop):
    free = base.SamplingParams(max_tokens=8, stop_token_ids=STOPS)
    seeded = base.SamplingParams(max_tokens=8, stop_token_ids=STOPS, seed=9)
    first, second = engine(tiny_model, loop), engine(tiny_model, loop)
    for params in (seeded, free, free):
        assert batch(first, PROMPTS, 2, params) == batch(second, PROMPTS, 2, params)
    assert batch(first, PROMPTS, 2, free) != batch(first, PROMPTS, 2, free)


def test_own_loop_drops_finished_rows_from_the_batch(tiny_model):
    client = engine(tiny_model, "own")
    widths: list[int] = []
    hook = client.model.register_forward_hook(lambda module, args, kwargs, out: widths.append(
        kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    params = base.SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=STOPS, seed=1)
    try:
        sequences = flat(batch(client, PROMPTS, 4, params))
    finally:
        hook.remove()
    assert widths[0] == len(sequences) and widths == sorted(widths, reverse=True) and widths[-1] < widths[0]
    # every decode step ran at least the rows still unfinished at that step
    for step, width in enumerate(widths, start=1):
        assert width >= sum(len(s.tokens) > step for s in sequences)


def test_own_loop_fills_the_kv_store_that_the_next_turn_reuses(tiny_model):
    params = base.SamplingParams(max_tokens=6, temperature=0.9, stop_token_ids=STOPS, seed=11)
    client = engine(tiny_model, "own")
    first = sample(client, SYSTEM + [7, 8, 9], 3, params).sequences
    contexts = [SYSTEM + [7, 8, 9] + list(s.tokens) + [40 + i, 41, 42] for i, s in enumerate(first)]
    second = flat(batch(client, contexts, 1, params))
    assert client.sampler.kv_reused_tokens == sum(len(SYSTEM) + 3 + len(s.tokens) - 1 for s in first)
    fresh = flat(batch(engine(tiny_model, "own", sample_kv_cache_mb=0), contexts, 1, params))
    assert [s.tokens for s in second] == [s.tokens for s in fresh]
    for context, seq in zip(contexts, second):
        expected = teacher_forced_logprobs(client, context, seq.tokens, 0.9)
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)


def test_an_unknown_decode_loop_is_a_clear_error(tiny_model):
    client = engine(tiny_model, "own")
    with pytest.raises(ValueError, match="decode_loop must be one of own, generate"):
        LocalSamplingClient(client.model, client.tokenizer, threading.Lock(), decode_loop="fast")
    assert LocalSettings().decode_loop == "own"


def test_peak_rss_counts_child_processes():
    """The demo's memory line sums the process tree: a child holding 200 MB shows up."""
    import subprocess
    import sys
    import time

    import psutil

    from retool.peak_rss import PeakRSS, tree_rss_bytes

    holds = "import sys, time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
            "print('ok', flush=True); time.sleep(3)"
    before = tree_rss_bytes(psutil.Process())
    with PeakRSS(interval_s=0.1) as memory:
        child = subprocess.Popen([sys.executable, "-c", holds], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ok"
        time.sleep(0.5)
        child.kill()
        child.wait()
    assert memory.sampled_bytes >= before + 150 * 2**20  # the child's pages, on top of this process
    assert memory.peak_bytes >= memory.sampled_bytes
    assert "GiB resident" in memory.sentence()
