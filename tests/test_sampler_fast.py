"""The local sampler's own decode loop (``decode_loop="own"`` and the lean steps of
``"lean"``) against HF ``generate``.

On the tiny random Llama of ``test_engine_local`` (LoRA adapters given non-zero weights,
so that merging them matters): every path samples the same tokens with logprobs within
1e-4 (also where finished rows are dropped from the batch and where the shared-prefix
cache and the KV store lay the rows out), each is reproducible from its seed, the own
loop really shrinks its batch as rows finish, the lean step merges the weights again
after they change, and on tiny random Qwen2 (q/k/v biases) and Qwen3 (q/k norms) models
the lean step's logits equal the model's own forward pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import sys
import threading
from pathlib import Path

import pytest
import torch

from retool.engines import LocalSettings, base
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.engines.local.sampler import LocalSamplingClient
from tests.test_engine_local import (  # noqa: F401 - one_torch_thread and tiny_model are fixtures used here
    build_tiny_model, one_torch_thread, sample, teacher_forced_logprobs, tiny_model)

pytestmark = pytest.mark.timeout(300)

SYSTEM = [2] + [3 + (5 * i) % 40 for i in range(19)]  # a 20-token shared "system prompt"
STOPS = tuple(range(3, 9))  # ~1 in 10 tokens ends a row: rows finish at different steps



def engine(tiny_model: str, loop: str, **overrides) -> LocalTrainingClient:
    """A local engine whose LoRA adapters have non-zero (seeded) weights; ``overrides`` are
    ``LocalSettings`` fields."""
    client = LocalTrainingClient(LocalEngineConfig(model=tiny_model, lora_rank=8, lora_alpha=16.0,
                                                   sampler=LocalSettings(decode_loop=loop, **overrides)))
    perturb_lora(client.model, seed=3)
    return client


def perturb_lora(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def batch(client: LocalTrainingClient, prompts, n: int, params) -> list[base.SampleResult]:
    async def together():
        return await asyncio.gather(*(client.sampler.sample(p, n, params) for p in prompts))
    return asyncio.run(together())


def flat(results: list[base.SampleResult]) -> list[base.SampledSequence]:
    return [s for r in results for s in r.sequences]


PROMPTS = [SYSTEM + [10, 11], SYSTEM + [12], SYSTEM + [13, 14, 15, 16], [2, 20, 21]]


@pytest.mark.parametrize("loop", ["own", "lean"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_own_loop_samples_what_generate_samples(tiny_model, prefix_cache, loop):
    params = base.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, stop_token_ids=STOPS, seed=5)
    own = flat(batch(engine(tiny_model, loop, prefix_cache=prefix_cache), PROMPTS, 4, params))
    hf = flat(batch(engine(tiny_model, "generate", prefix_cache=prefix_cache), PROMPTS, 4, params))
    assert [s.tokens for s in own] == [s.tokens for s in hf]
    assert [s.stop_reason for s in own] == [s.stop_reason for s in hf]
    assert len({len(s.tokens) for s in own}) > 2  # rows really finished at different steps
    for a, b in zip(own, hf):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("loop", ["own", "lean"])
def test_own_loop_logprobs_are_the_teacher_forced_policy(tiny_model, loop):
    client = engine(tiny_model, loop)
    params = base.SamplingParams(max_tokens=10, temperature=0.7, top_k=12, stop_token_ids=STOPS, seed=2)
    for prompt, result in zip(PROMPTS, batch(client, PROMPTS, 3, params)):
        for seq in result.sequences:
            expected = teacher_forced_logprobs(client, prompt, seq.tokens, 0.7)
            assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)
            assert seq.tokens[-1] in STOPS or len(seq.tokens) == 10


def _attention_inputs(dtype, rows: int, n: int, columns: int, prefix: int, seed: int = 0):
    """Random attention inputs in the lean step's layout: 3 KV heads of width 16; the first
    columns of every row but the first masked (rows joined a running batch later)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    bias = torch.zeros(1, rows, n, columns, dtype=dtype)
    bias[:, 1:, :, :columns // 3] = float("-inf")
    return (draw(3, rows, n, 16), draw(3, prefix, 16), draw(3, prefix, 16), draw(3, rows, columns, 16),
            draw(3, rows, columns, 16), bias)


@pytest.mark.parametrize("shape", [(6, 3, 40, 25), (6, 3, 40, 0), (2, 21, 30, 12)],
                         ids=["decode", "decode-no-prefix", "prefill"])
def test_flash_attention_equals_the_plain_products(shape):
    """The cascade over torch's CPU flash kernel (own columns, then the shared prefix, merged
    by log-sum-exp) against one softmax over plain products: fp32 within 1e-5; in bf16 no
    further from the fp64 value than the plain path (each rounds its output to bf16)."""
    from retool.engines.local import lean_decode

    assert lean_decode._cpu_flash_attention()  # torch 2.13 on a CPU has the kernel: the default path
    inputs = _attention_inputs(torch.float32, *shape)
    flash, math = lean_decode._attention_rows_flash(*inputs), lean_decode._attention_rows_math(*inputs)
    assert flash.shape == math.shape == inputs[0].shape
    assert torch.allclose(flash, math, atol=1e-5)
    exact = lean_decode._attention_rows_math(*(t.double() for t in inputs))
    low = [t.to(torch.bfloat16) for t in inputs]
    flash_err = (lean_decode._attention_rows_flash(*low).double() - exact).abs().max()
    math_err = (lean_decode._attention_rows_math(*low).double() - exact).abs().max()
    assert flash_err <= math_err * 1.5 + 1e-3


def test_the_lean_loop_samples_the_same_with_either_attention(tiny_model, monkeypatch):
    """``lean_decode.ATTENTION``: flash (the default on a CPU) and plain products sample the
    same tokens with logprobs within 1e-5 (fp32), rows finishing at different steps."""
    from retool.engines.local import lean_decode

    params = base.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, stop_token_ids=STOPS, seed=5)
    runs = {}
    for kind in ("math", "flash"):
        monkeypatch.setattr(lean_decode, "ATTENTION", kind)
        calls = []
        monkeypatch.setattr(lean_decode, "_attention_rows_flash",
                            lambda *a, _f=lean_decode._attention_rows_flash: calls.append(1) or _f(*a))
        runs[kind] = flat(batch(engine(tiny_model, "lean"), PROMPTS, 4, params))
        assert bool(calls) == (kind == "flash")  # each setting really took its own path
    assert [s.tokens for s in runs["flash"]] == [s.tokens for s in runs["math"]]
    assert len({len(s.tokens) for s in runs["flash"]}) > 2
    for a, b in zip(runs["flash"], runs["math"]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("loop", ["lean", "own", "generate"])
def test_each_loop_is_reproducible_from_its_seed(tiny_model, loop):
    free = base.SamplingParams(max_tokens=8, stop_token_ids=STOPS)
    seeded = base.SamplingParams(max_tokens=8, stop_token_ids=STOPS, seed=9)
    first, second = engine(tiny_model, loop), engine(tiny_model, loop)
    for params in (seeded, free, free):
        assert batch(first, PROMPTS, 2, params) == batch(second, PROMPTS, 2, params)
    assert batch(first, PROMPTS, 2, free) != batch(first, PROMPTS, 2, free)


def test_own_loop_drops_finished_rows_from_the_batch(tiny_model):
    client = engine(tiny_model, "own")  # (the lean steps bypass the model's forward, which this counts)
    widths: list[int] = []
    hook = client.model.register_forward_hook(lambda module, args, kwargs, out: widths.append(
        kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    params = base.SamplingParams(max_tokens=16, temperature=1.0, stop_token_ids=STOPS, seed=1)
    try:
        sequences = flat(batch(client, PROMPTS, 4, params))
    finally:
        hook.remove()
    assert widths[0] <= len(sequences) and widths == sorted(widths, reverse=True) and widths[-1] < widths[0]
    # every decode step ran at least the rows still unfinished at that step
    for step, width in enumerate(widths, start=1):
        assert width >= sum(len(s.tokens) > step for s in sequences)


@pytest.mark.parametrize("loop", ["own", "lean"])
def test_own_loop_fills_the_kv_store_that_the_next_turn_reuses(tiny_model, loop):
    params = base.SamplingParams(max_tokens=6, temperature=0.9, stop_token_ids=STOPS, seed=11)
    client = engine(tiny_model, loop)
    first = sample(client, SYSTEM + [7, 8, 9], 3, params).sequences
    contexts = [SYSTEM + [7, 8, 9] + list(s.tokens) + [40 + i, 41, 42] for i, s in enumerate(first)]
    second = flat(batch(client, contexts, 1, params))
    assert client.sampler.kv_reused_tokens == sum(len(SYSTEM) + 3 + len(s.tokens) - 1 for s in first)
    fresh = flat(batch(engine(tiny_model, loop, kv_cache_mb=0), contexts, 1, params))
    assert [s.tokens for s in second] == [s.tokens for s in fresh]
    for context, seq in zip(contexts, second):
        expected = teacher_forced_logprobs(client, context, seq.tokens, 0.9)
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4)


def test_an_unknown_decode_loop_is_a_clear_error(tiny_model):
    client = engine(tiny_model, "own")
    with pytest.raises(ValueError, match="decode_loop must be one of lean, own, generate"):
        LocalSamplingClient(client.model, client.tokenizer, threading.Lock(),
                            settings=LocalSettings(decode_loop="fast"))
    assert LocalSettings().decode_loop == "lean" == LocalEngineConfig(model=tiny_model).sampler.decode_loop


def test_lean_steps_follow_new_weights(tiny_model):
    """After the weights change (in place, as an optimizer step does) the lean step merges
    them again: its samples are the new policy's."""
    params = base.SamplingParams(max_tokens=10, temperature=0.8, stop_token_ids=STOPS, seed=4)
    client = engine(tiny_model, "lean")
    before = batch(client, PROMPTS, 2, params)
    merged = client.sampler._lean_weights
    perturb_lora(client.model, seed=8)
    after = flat(batch(client, PROMPTS, 2, params))
    assert client.sampler._lean_weights is not merged
    reference = engine(tiny_model, "generate")
    perturb_lora(reference.model, seed=8)
    expected = flat(batch(reference, PROMPTS, 2, params))
    assert [s.tokens for s in after] == [s.tokens for s in expected] != [s.tokens for s in flat(before)]
    for prompt, seq in zip([p for p in PROMPTS for _ in range(2)], after):
        want = teacher_forced_logprobs(client, prompt, seq.tokens, 0.8)
        assert torch.allclose(torch.tensor(seq.logprobs), want, atol=1e-4)


def tiny_config(kind: str):
    from transformers import Qwen2Config, Qwen3Config

    common = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2Config(**common) if kind == "qwen2" else Qwen3Config(head_dim=8, **common)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_lean_step_equals_the_model_forward_on_qwen(kind, monkeypatch):
    """Shared prefix + padded own columns, prefilled by the lean prefill from nothing,
    from the prefix's KV, or from each row's restored KV of its first columns (as a next
    turn over stored KV), + three lean steps: the logits of the model's own forward pass
    over the same rows (same positions, same mask), whether the prefill takes all rows at
    once or one at a time."""
    from transformers import AutoModelForCausalLM

    from retool.engines.local import lean_decode
    from retool.engines.local.kv_cache import Restored

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.3, 0.2)
    weights = lean_decode.decode_weights(model)
    assert weights is not None
    prefix = [5, 6, 7, 8, 9]
    ids = torch.tensor([prefix + [0, 0, 11, 12, 0, 30], prefix + [0, 13, 14, 15, 31, 32],
                        prefix + [16, 17, 18, 19, 0, 33]])
    mask = (ids != 0).long()
    steps = torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28]])
    with torch.no_grad():
        positions, full_positions, expected, prefix_kv = _model_reference(model, ids, mask, steps, len(prefix))
        restored_columns = 4  # each row's columns 5..8 restored, as a later turn over stored KV
        early = model(input_ids=ids[:, :9], attention_mask=mask[:, :9], position_ids=positions[:, :9],
                      use_cache=True).past_key_values
        rows = tuple((0, tuple((layer.keys[r, :, 5:9], layer.values[r, :, 5:9]) for layer in early.layers))
                     for r in range(3))
        starts = {"nothing": None, "prefix": Restored(tuple(prefix_kv)),
                  "stored": Restored(tuple(prefix_kv), rows, restored_columns)}
        for (name, start), chunk_bytes in itertools.product(starts.items(), (2**30, 1)):  # 1: a row at a time
            monkeypatch.setattr(lean_decode, "PREFILL_SCORES_BYTES", chunk_bytes)
            cache, first = lean_decode.LeanCache.prefill(weights, start, ids, mask, positions, 1)
            assert torch.allclose(first, expected[:, ids.shape[1] - 1], atol=1e-4), name
            for step in range(3):  # the third step outgrows the reserved room
                got = cache.step(steps[:, step], full_positions[:, ids.shape[1] + step])
                assert torch.allclose(got, expected[:, ids.shape[1] + step], atol=1e-4), (name, step)


def _model_reference(model, ids, mask, steps, prefix_len: int):
    """What the lean path must reproduce: the rows' positions, those of the rows with
    ``steps`` appended, the model's own logits over them, and the shared prefix's KV."""
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    full_ids, full_mask = torch.cat([ids, steps], 1), torch.cat([mask, torch.ones_like(steps)], 1)
    full_positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    expected = model(input_ids=full_ids, attention_mask=full_mask, position_ids=full_positions).logits
    prefix_kv = [(k[0], v[0]) for k, v in
                 ((layer.keys, layer.values) for layer in
                  model(input_ids=ids[:1, :prefix_len], use_cache=True).past_key_values.layers)]
    return positions, full_positions, expected, prefix_kv


def test_models_the_lean_step_does_not_cover_fall_back_to_the_model_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    from retool.engines.local import lean_decode

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert lean_decode.decode_weights(model) is None
    sliding = tiny_config("qwen2")
    sliding.use_sliding_window, sliding.sliding_window = True, 4
    from transformers import AutoModelForCausalLM

    assert lean_decode.decode_weights(AutoModelForCausalLM.from_config(sliding)) is None


def test_peak_rss_counts_child_processes():
    """The demo's memory line sums the process tree: a child holding 200 MB shows up."""
    import subprocess
    import sys
    import time

    import psutil

    from retool.peak_rss import PeakRSS, tree_memory

    holds = "import sys, time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
            "print('ok', flush=True); time.sleep(3)"
    before = tree_memory(psutil.Process())  # PSS below RSS where this process shares pages with its children
    with PeakRSS(interval_s=0.1) as memory:
        child = subprocess.Popen([sys.executable, "-c", holds], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ok"
        time.sleep(0.5)
        child.kill()
        child.wait()
    assert memory.sampled_bytes >= before.rss_bytes + 150 * 2**20  # the child's pages, on top of this process
    assert memory.sampled_pss_bytes >= before.pss_bytes + 150 * 2**20 - 50 * 2**20  # its own pages are not shared
    assert memory.peak_bytes >= memory.sampled_pss_bytes
    assert "GiB (PSS" in memory.sentence() and "RSS summed" in memory.sentence()


def test_peak_rss_keeps_each_stages_own_peak():
    """A child holding 200 MB during the second stage only: that stage's PSS peak shows
    it, the first's does not (the demo's per-stage figure)."""
    import subprocess
    import sys
    import time

    from retool.peak_rss import PeakRSS

    holds = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); " \
            "print('ok', flush=True); time.sleep(30)"
    with PeakRSS(interval_s=0.1) as memory:
        with memory.stage("small"):
            pass  # one reading on entry, one on exit, even for a stage shorter than the interval
        with memory.stage("large"):
            child = subprocess.Popen([sys.executable, "-c", holds], stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline().strip() == "ok"
            time.sleep(0.3)
        child.kill()
        child.wait()
    small, large = memory.stage_pss_bytes["small"], memory.stage_pss_bytes["large"]
    assert list(memory.stage_pss_bytes) == ["small", "large"]
    assert large >= small + 150 * 2**20 and small > 0
    assert "PSS peak by stage: small " in memory.sentence()


def test_tree_pss_counts_pages_a_forked_child_shares_once():
    """A forked child shares its parent's 200 MB copy-on-write: the RSS sum counts them
    twice, the PSS sum once (the demo's first figure)."""
    import os
    import time

    import psutil

    from retool.peak_rss import tree_memory

    held = bytearray(200 * 2**20)
    held[::4096] = b"x" * len(held[::4096])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: touches nothing, says it is up, waits
        os.write(write, b"1")
        time.sleep(3)
        os._exit(0)
    try:
        os.read(read, 1)
        reading = tree_memory(psutil.Process())
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert reading.unreadable == 0
    assert reading.rss_bytes - reading.pss_bytes >= 150 * 2**20
    del held


@pytest.mark.parametrize("loop,continuous", [("lean", False), ("own", False), ("lean", True)])
def test_a_batch_over_its_kv_budget_is_split_and_samples_the_same(tiny_model, monkeypatch, loop, continuous):
    """Rows whose KV would exceed ``batch_kv_mb`` run as several smaller batches (the
    lean path counts the shared prefix once, the HF paths once per row) — or, batched
    continuously, as one loop that never holds more rows than fit and takes the next ones
    in as rows finish — with the tokens an unlimited batch samples and logprobs within 1e-4
    of the model's own forward."""
    from retool.engines.local import lean_decode

    stepped: list[int] = []
    real_step = lean_decode.LeanCache.step

    def counting(cache, tokens_B, positions_B):
        stepped.append(tokens_B.shape[0])
        return real_step(cache, tokens_B, positions_B)

    monkeypatch.setattr(lean_decode.LeanCache, "step", counting)
    params = base.SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=STOPS, seed=5)
    prompts = [SYSTEM + [10 + i, 11] for i in range(6)]
    whole = engine(tiny_model, loop, batch_kv_mb=0, continuous_batching=continuous)
    expected = flat(batch(whole, prompts, 2, params))
    split = engine(tiny_model, loop, continuous_batching=continuous)
    sampler = split.sampler
    per_token = sampler.kv_bytes_per_token
    own = 2 + 8 if loop == "lean" else len(SYSTEM) + 2 + 8  # columns per row the estimate counts
    shared = len(SYSTEM) if loop == "lean" else 0
    sampler.batch_kv_bytes = (5 * own + shared) * per_token  # room for five rows
    stepped.clear()
    got = flat(batch(split, prompts, 2, params))
    if continuous:  # one loop, at most five rows at a step, every row taken in
        assert whole.sampler.calls == 1 and sampler.calls == 1
        assert max(stepped) == 5 and sampler.rows == 12
    else:
        assert whole.sampler.calls == 1 and sampler.calls == 3  # 12 rows: 4 + 4 + 4, not 5 + 5 + 2
    assert [s.tokens for s in got] == [s.tokens for s in expected]
    for prompt, seq in zip([p for p in prompts for _ in range(2)], got):
        want = teacher_forced_logprobs(split, prompt, seq.tokens, 1.0)
        assert torch.allclose(torch.tensor(seq.logprobs), want, atol=1e-4)
    sampler.batch_kv_bytes = 1  # less than one row: still one row per batch (per step, batched continuously)
    calls = sampler.calls
    stepped.clear()
    assert len(flat(batch(split, prompts[:2], 1, params))) == 2
    assert sampler.calls == calls + (1 if continuous else 2)
    assert not continuous or max(stepped) == 1


def test_a_continuous_loop_hands_memory_back_after_every_admission(tiny_model, monkeypatch):
    """Rows taken into a running loop are prefilled apart and their KV copied in beside
    the running rows' (the old buffers freed): glibc keeps such freed memory unless told to
    hand it back, and a continuous loop has no batch end to do it at — the demo's eval
    grew 0.4 GiB higher without this. Every admission is followed by a trim before the
    next decode step."""
    from retool.engines.local import lean_decode, memory

    events: list[str] = []
    real_admit, real_step, real_trim = lean_decode.LeanCache.admit, lean_decode.LeanCache.step, \
        memory.release_free_memory

    def admit(cache, other):
        events.append("admit")
        return real_admit(cache, other)

    def step(cache, tokens_B, positions_B):
        events.append("step")
        return real_step(cache, tokens_B, positions_B)

    def trim():
        events.append("trim")
        return real_trim()

    monkeypatch.setattr(lean_decode.LeanCache, "admit", admit)
    monkeypatch.setattr(lean_decode.LeanCache, "step", step)
    monkeypatch.setattr(memory, "release_free_memory", trim)
    params = base.SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=STOPS, seed=5)
    prompts = [SYSTEM + [10 + i, 11] for i in range(6)]
    split = engine(tiny_model, "lean", continuous_batching=True)
    split.sampler.batch_kv_bytes = (5 * (2 + 8) + len(SYSTEM)) * split.sampler.kv_bytes_per_token  # five rows
    assert len(flat(batch(split, prompts, 2, params))) == 12
    admits = [i for i, e in enumerate(events) if e == "admit"]
    assert admits  # rows joined the running loop
    for i in admits:
        following = events[i + 1:]
        assert "trim" in following and ("step" not in following or following.index("trim") < following.index("step"))


KV_COPIES_BENCH = Path(__file__).resolve().parents[1] / "bench" / "kv_copies.py"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap: Linux only")
def test_a_cache_copied_into_new_buffers_hands_the_old_ones_back_as_it_goes():
    """Admitting rows copies every layer's KV buffers into new, larger ones, one layer at a
    time. glibc keeps each freed buffer in its heap, where the next layer's larger one does
    not fit, so without trims the process grows by the whole new cache though only a layer
    of old and new is alive at once; with them it grows by the cache's growth, a layer and
    at most ``TRIM_BYTES``. The probe (a fresh process, its anonymous resident memory after
    each new buffer and before each trim: ``bench/kv_copies.py``'s replay, one admission)
    sees the first case well above the bound the second must keep."""
    from retool.engines.local import lean_decode, memory
    if memory._glibc() is None:
        pytest.skip("not glibc")
    spec = importlib.util.spec_from_file_location("kv_copies", KV_COPIES_BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def growth(trim_bytes: int) -> tuple[int, int, int, int]:
        r = bench.replay(trim_bytes, rows=16, width=200, rounds=1, join=4, drop=False)
        return r["peak"] - r["joined"], r["kv_before"], r["kv"], r["kv"] // 30  # growth with both caches built

    untrimmed, old, new, layer = growth(0)
    bound = new - old + 2 * layer + lean_decode.TRIM_BYTES + 48 * 2**20  # what the trimmed loop may grow by
    # Untrimmed, the heap took most of the new cache beside the freed old one: 0.80-0.88 of it in
    # runs on one machine (how many freed buffers coalesce into a reusable gap varies), > 2x the bound.
    assert untrimmed > max(0.6 * new, 1.5 * bound)
    trimmed, *_ = growth(lean_decode.TRIM_BYTES)
    assert trimmed < bound


def test_two_event_loops_sampling_at_once_each_get_their_own_answers(tiny_model):
    """Rollouts of two steps on their own threads share one sampler (``--max-staleness``):
    each loop's requests are batched and answered on that loop, none is left waiting for
    a loop that has ended, and each gets what it gets alone (seeded requests)."""
    client = engine(tiny_model, "lean")
    params = [base.SamplingParams(max_tokens=10, temperature=0.9, stop_token_ids=STOPS, seed=s) for s in (4, 7)]
    alone = [flat(batch(client, PROMPTS, 3, p)) for p in params]
    both_running = threading.Barrier(2, timeout=30)
    results: dict[int, list[base.SampledSequence]] = {}

    def rollout(k: int) -> None:
        async def main():
            both_running.wait()  # both loops submit before either is served
            return await asyncio.gather(*(client.sampler.sample(p, 3, params[k]) for p in PROMPTS))
        results[k] = flat(asyncio.run(main()))

    threads = [threading.Thread(target=rollout, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a loop's requests were never answered"
    assert [[s.tokens for s in results[k]] for k in (0, 1)] == [[s.tokens for s in alone[k]] for k in (0, 1)]
    for k in (0, 1):
        for a, b in zip(results[k], alone[k]):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert not client.sampler._queues  # each loop's queue dropped once it emptied


def test_a_requests_samples_are_prefilled_once_and_sample_what_every_row_prefilled_samples(tiny_model, monkeypatch):
    """The lean prefill runs a prompt asked for n samples once and copies its KV to the n rows;
    the rows then sample what they sample with every row prefilled (same seeds), logprobs equal
    to float rounding. The probe counts the rows each prefill ran, and sees all of them with the
    switch off."""
    from retool.engines.local import lean_decode

    prefilled: list[int] = []
    real = lean_decode.LeanCache._prefill_rows.__func__

    def counting(cls, weights, start, input_ids, *rest):
        prefilled.append(input_ids.shape[0])
        return real(cls, weights, start, input_ids, *rest)

    monkeypatch.setattr(lean_decode.LeanCache, "_prefill_rows", classmethod(counting))
    params = base.SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=STOPS, seed=4)
    once = flat(batch(engine(tiny_model, "lean", kv_cache_mb=0), PROMPTS, 4, params))
    assert prefilled == [len(PROMPTS)]
    monkeypatch.setattr(lean_decode, "PREFILL_DISTINCT_ROWS", False)
    prefilled.clear()
    every = flat(batch(engine(tiny_model, "lean", kv_cache_mb=0), PROMPTS, 4, params))
    assert prefilled == [4 * len(PROMPTS)]
    assert [s.tokens for s in once] == [s.tokens for s in every]
    assert len({s.tokens for s in once}) > len(PROMPTS)  # the copies sampled apart from their seeds
    for a, b in zip(once, every):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_next_turns_join_a_running_batch_and_sample_what_batches_in_turn_sample(tiny_model):
    """Batched continuously, a trajectory's next turn joins the loop its first turn ran in
    while other rows still decode (rows of other lengths: the loop's columns are padded in
    front of the shorter ones), starting from its stored KV, and every turn samples what
    the chunked batches sample, with logprobs within 1e-4 of the model's own forward."""
    params = [base.SamplingParams(max_tokens=6 + 5 * (i % 3), temperature=1.0, stop_token_ids=STOPS, seed=i)
              for i in range(6)]
    prompts = [SYSTEM + [10 + i] * (1 + 3 * (i % 3) + 20 * (i >= 4)) for i in range(6)]  # the last two long

    def run(client: LocalTrainingClient) -> list[tuple[base.SampledSequence, base.SampledSequence]]:
        async def trajectory(i: int):
            first = (await client.sampler.sample(prompts[i], 1, params[i])).sequences[0]
            second = (await client.sampler.sample(prompts[i] + list(first.tokens) + [30, 31, 32], 1,
                                                  dataclasses.replace(params[i], seed=100 + i))).sequences[0]
            return first, second

        async def together():
            return await asyncio.gather(*(trajectory(i) for i in range(6)))
        return asyncio.run(together())

    from retool.engines.local import lean_decode

    fronts: list[tuple[int, int]] = []
    real_admit, real_keep = lean_decode.LeanCache.admit, lean_decode.LeanCache.keep_rows
    dropped: list[int] = []

    def admit(cache, other):
        fronts.append(real_admit(cache, other))
        return fronts[-1]

    def keep_rows(cache, index, trim_front=False):
        dropped.append(real_keep(cache, index, trim_front))
        return dropped[-1]

    continuous = engine(tiny_model, "lean", max_sample_rows=4)
    chunked = engine(tiny_model, "lean", max_sample_rows=4, continuous_batching=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lean_decode.LeanCache, "admit", admit)
        patch.setattr(lean_decode.LeanCache, "keep_rows", keep_rows)
        got = run(continuous)
    expected = run(chunked)
    assert any(mine for mine, _ in fronts) and any(theirs for _, theirs in fronts)  # both sides got front columns
    assert any(dropped)  # front columns no kept row used went once the rows they lined up with had left
    assert [(a.tokens, b.tokens) for a, b in got] == [(a.tokens, b.tokens) for a, b in expected]
    assert continuous.sampler.calls < chunked.sampler.calls  # turns joined a running loop
    assert continuous.sampler.kv_reused_tokens > 0  # second turns started from their stored first turns
    for i, (first, second) in enumerate(got):
        for prompt, seq in ((prompts[i], first), (prompts[i] + list(first.tokens) + [30, 31, 32], second)):
            want = teacher_forced_logprobs(continuous, prompt, seq.tokens, 1.0)
            assert torch.allclose(torch.tensor(seq.logprobs), want, atol=1e-4)


def test_an_admission_keeps_rows_whose_stored_turns_were_evicted_apart(tiny_model, monkeypatch):
    """Four trajectories' second turns join a running loop together, two of them after the
    KV store's own LRU evicted their first turns (its budget lowered). The two that
    continue their stored turns are admitted together from that KV; the evicted two, which
    continue only the loop's shared prefix, are prefilled whole after it in an admission
    of their own (laid out together, every row would prefill as many new columns as the
    longest); every turn samples what the chunked batches sample, with logprobs within
    1e-4 of the model's own forward."""
    from retool.engines.local import kv_cache

    sampler_module = sys.modules[LocalSamplingClient.__module__]  # the package's name `sampler` is a function
    params = [base.SamplingParams(max_tokens=6 + 3 * i, temperature=1.0, stop_token_ids=STOPS, seed=i)
              for i in range(4)]
    prompts = [SYSTEM + [10 + i] * (2 + 5 * i) for i in range(4)]
    fillers = [SYSTEM + [40], SYSTEM + [41]]  # a loop whose shared prefix is SYSTEM, done after one token
    filler_params = base.SamplingParams(max_tokens=1, temperature=1.0, stop_token_ids=STOPS, seed=9)
    admissions: list[tuple[list[int], bool]] = []  # (trajectories, from their stored turns) per admitted batch
    real_layout = kv_cache.admitted_layout

    def layout(store, rows, hits, *rest):
        admissions.append(([p[len(SYSTEM)] - 10 for p in rows], hits is not None))
        return real_layout(store, rows, hits, *rest)

    monkeypatch.setattr(kv_cache, "admitted_layout", layout)
    armed, started, joined = threading.Event(), threading.Event(), threading.Event()
    real_decode = sampler_module.decode

    def gated_decode(*args, admit=None, **kwargs):  # the fillers' first admission waits for the second turns
        def gated(step, running):
            if armed.is_set() and not started.is_set():
                started.set()
                assert joined.wait(30)
            return admit(step, running)
        return real_decode(*args, admit=gated if admit is not None else None, **kwargs)

    monkeypatch.setattr(sampler_module, "decode", gated_decode)

    def run(client: LocalTrainingClient, continuous: bool) -> list[base.SampledSequence]:
        async def first_turns():
            return [r.sequences[0] for r in await asyncio.gather(
                *(client.sampler.sample(p, 1, q) for p, q in zip(prompts, params)))]
        firsts = asyncio.run(first_turns())
        seconds = [p + list(f.tokens) + [30, 31, 32] for p, f in zip(prompts, firsts)]
        store = client.sampler.kv_store
        hits = [store.lookup(tuple(p)) for p in (seconds[1], seconds[3], seconds[0], seconds[2])]  # 1, 3 least recent
        assert all(n > len(SYSTEM) for n, _ in hits)  # every first turn stored
        evicted = [key for _, key in hits[:2]]
        room = 2 * kv_cache.kv_bytes_per_token(client.model)  # the fillers' one-token turns, stored after them
        client.sampler.kv_cache_bytes = store.size - sum(kv_cache.nbytes(store.entries[k].tail) for k in evicted) + room
        assert set(evicted).isdisjoint(store.entries) and {key for _, key in hits[2:]} <= set(store.entries)
        assert tuple(SYSTEM) in store.entries  # the shared prefix they still continue

        async def second_turns():
            armed.set()
            loop_rows = asyncio.gather(*(client.sampler.sample(f, 1, filler_params) for f in fillers))
            if continuous:
                await asyncio.to_thread(started.wait, 30)
            else:
                await loop_rows
            turns = [asyncio.ensure_future(client.sampler.sample(p, 1, dataclasses.replace(q, seed=100 + i)))
                     for i, (p, q) in enumerate(zip(seconds, params))]
            await asyncio.sleep(0.05)  # every second turn queued before the loop takes any
            joined.set()
            await loop_rows
            return [r.sequences[0] for r in await asyncio.gather(*turns)]
        return firsts, seconds, asyncio.run(second_turns())

    continuous = engine(tiny_model, "lean", max_sample_rows=8)
    got = run(continuous, True)
    assert sorted(admissions) == [([0, 2], True), ([1, 3], False)]  # one take, split by what each row continues
    expected = run(engine(tiny_model, "lean", max_sample_rows=8, continuous_batching=False), False)
    assert [s.tokens for s in got[0] + got[2]] == [s.tokens for s in expected[0] + expected[2]]
    for prompt, seq in zip(got[1], got[2]):
        want = teacher_forced_logprobs(continuous, prompt, seq.tokens, 1.0)
        assert torch.allclose(torch.tensor(seq.logprobs), want, atol=1e-4)


def test_a_continuous_batch_shares_only_the_prefix_every_waiting_row_has(tiny_model):
    """Two groups of four with their own question and room for four rows at a time: the loop
    starts with the first group but keeps only the system prompt as its shared prefix (not
    that group's question), so the second group joins the same loop as rows finish."""
    params = base.SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=STOPS, seed=2)
    prompts = [SYSTEM + [10, 11, 12], SYSTEM + [20, 21]]
    continuous = engine(tiny_model, "lean", max_sample_rows=4)
    chunked = engine(tiny_model, "lean", max_sample_rows=4, continuous_batching=False)
    got, expected = flat(batch(continuous, prompts, 4, params)), flat(batch(chunked, prompts, 4, params))
    assert continuous.sampler.calls == 1 and chunked.sampler.calls == 2
    assert [s.tokens for s in got] == [s.tokens for s in expected]
    for a, b in zip(got, expected):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_prefill_chunks_cut_rows_in_order_at_the_least_cost():
    """Every cut covers the rows once, in order; each chunk skips exactly the columns that are
    padding in all its rows; the cost is the least over every contiguous cut (brute force on
    small cases); a chunk over the scores bound is a single row."""
    import random

    from retool.engines.local import lean_decode

    def cost(chunks, new_R, width):
        return sum((b - a) * max(min(width, max(1, n)) for n in new_R[a:b]) + lean_decode.PREFILL_CALL_TOKENS
                   for a, b, _ in chunks)

    def cuts(n):
        for mask in range(2 ** (n - 1)):
            bounds = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
            yield list(zip(bounds, bounds[1:]))

    rng = random.Random(0)
    for _ in range(200):
        rows, width = rng.randint(1, 7), rng.randint(1, 600)
        new_R = [min(width, rng.choice([rng.randint(0, 40), rng.randint(1, width)])) for _ in range(rows)]
        chunks = lean_decode.prefill_chunks(new_R, width, 1)
        assert [a for a, _, _ in chunks] == [0] + [b for _, b, _ in chunks[:-1]] and chunks[-1][1] == rows
        for a, b, skip in chunks:
            assert skip == width - min(width, max(max(1, n) for n in new_R[a:b]))
        best = min(cost([(a, b, 0) for a, b in cut], new_R, width) for cut in cuts(rows))
        assert cost(chunks, new_R, width) == best
    # one long row among short ones gets a chunk of its own; the short ones skip its padding
    chunks = lean_decode.prefill_chunks([28, 28, 28, 535, 28, 28, 28], 535, 1)
    assert (3, 4, 0) in chunks and all(skip == 535 - 28 for a, b, skip in chunks if (a, b) != (3, 4))
    # the scores bound: chunks of one row each when a row's scores alone reach it
    assert lean_decode.prefill_chunks([10, 10, 10], 10, lean_decode.PREFILL_SCORES_BYTES // 10) == \
        [(0, 1, 0), (1, 2, 0), (2, 3, 0)]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_lean_prefill_of_rows_of_very_different_lengths_equals_the_model_forward(kind):
    """A long row (a long tool output) among short ones, after a shared prefix: the short
    rows skip the long row's padding columns (zero KV, masked), and the prefill's logits and
    the next steps' equal the model's own forward over the same padded rows."""
    from transformers import AutoModelForCausalLM

    from retool.engines.local import lean_decode
    from retool.engines.local.kv_cache import Restored

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    weights = lean_decode.decode_weights(model)
    prefix, width = [5, 6, 7, 8, 9], 120
    lengths = [3, 4, width, 2, 5]
    ids = torch.tensor([prefix + [0] * (width - n) + [10 + (r * 7 + i) % 50 for i in range(n)]
                        for r, n in enumerate(lengths)])
    mask = (ids != 0).long()
    mask[:, :len(prefix)] = 1
    steps = torch.tensor([[20 + r, 30 + r] for r in range(len(lengths))])
    assert len(lean_decode.prefill_chunks(lengths, width, 1)) > 1  # the long row is cut apart
    with torch.no_grad():
        positions, full_positions, expected, prefix_kv = _model_reference(model, ids, mask, steps, len(prefix))
        cache, first = lean_decode.LeanCache.prefill(weights, Restored(tuple(prefix_kv)), ids, mask, positions, 2)
        assert torch.allclose(first, expected[:, ids.shape[1] - 1], atol=1e-4)
        for step in range(2):
            got = cache.step(steps[:, step], full_positions[:, ids.shape[1] + step])
            assert torch.allclose(got, expected[:, ids.shape[1] + step], atol=1e-4), step
