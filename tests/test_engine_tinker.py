"""The ``tinker`` / ``pytrio`` engines against a fake service (``tests/fake_tinker.py``)
that answers with the real SDK types and computes the services' own losses on a tiny
model: conversions, exact parity with the local engine (loss, gradient, grad norm,
weights, Adam moments), ``retool train``/``eval`` end to end, checkpoints and resume,
faults, and that the API key leaves no trace. A live smoke test runs only with a key."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from retool import algo
from retool.cli import main as cli_main
from retool.config import make_config
from retool.engines import ServiceSettings
from retool.engines.base import AdamParams, SamplingParams
from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.types import StopReason
from tests.fake_tinker import FAKE_LORA_ALPHA, FAKES, FakeService, install
from tests.tiny import DIGIT_QUESTION, boxed_digit_model_dir

import pytrio  # noqa: E402  -- the test extra pins both SDKs: missing, these tests fail, never skip
import tinker  # noqa: E402

from retool.engines import tinker as adapter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)  # tiny models load; the kill-and-resume tests run subprocesses
SDKS = {"tinker": tinker, "pytrio": pytrio}
FLAVOURS = tuple(SDKS)
PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model() -> str:
    return str(boxed_digit_model_dir())


def rl_datums(n: int, seed: int) -> list:
    """RL datums of varied lengths, off-policy sampler logprobs (PPO clips some)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 5 + 3 * i
        tokens = torch.randint(3, 500, (length,), generator=g).tolist()
        logprobs = (-4.2 + torch.randn(length, generator=g)).tolist()
        out.append(algo.make_datum(tokens, [0, 0] + [1] * (length - 2), logprobs, advantage=(-1.0) ** i * (0.5 + i)))
    return out


def rel(a: list, b: list) -> float:
    """``|a - b| / |b|`` over a list of tensors taken as one vector."""
    a, b = [x.detach() for x in a], [y.detach() for y in b]
    num = sum(float(((x.double() - y.double()) ** 2).sum()) for x, y in zip(a, b)) ** 0.5
    return num / max(sum(float((y.double() ** 2).sum()) for y in b) ** 0.5, 1e-30)


# ---------------------------------------------------------------- conversions on the real types


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_datums_become_the_sdks_datums_with_the_services_scaling(flavour):
    import importlib

    types = importlib.import_module(f"{flavour}.types")
    datum = algo.make_datum([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -1.5, -2.5], advantage=2.0)
    sent = adapter.sdk_datum(adapter.FLAVOURS[flavour], datum, "ppo", total_weight=4.0)
    assert isinstance(sent, types.Datum) and isinstance(sent.model_input, types.ModelInput)
    assert sent.model_input.to_ints() == [5, 6, 7]
    got = {k: v.tolist() for k, v in sent.loss_fn_inputs.items()}
    assert got["logprobs"] == [0.0, -1.5, -2.5]
    if flavour == "tinker":  # documented token sum: advantage x weight / N, every target kept
        assert got["target_tokens"] == [6, 7, 8] and got["advantages"] == [0.0, 0.5, 0.5]
    else:  # inferred mean over non-ignored targets: untrained targets are -100
        assert got["target_tokens"] == [-100, 7, 8] and got["advantages"] == [0.0, 2.0, 2.0]
    sft = adapter.sdk_datum(adapter.FLAVOURS[flavour], algo.make_datum([1, 2, 3], [0, 1, 1]), "cross_entropy", 2.0)
    assert set(sft.loss_fn_inputs) == {"target_tokens", "weights"}
    assert sft.loss_fn_inputs["weights"].tolist() == ([0.5, 0.5] if flavour == "tinker" else [1.0, 1.0])


def test_pytrio_refuses_fractional_weights():
    datum = dataclasses.replace(algo.make_datum([1, 2, 3], [0, 1, 1]), weights_N=(0.5, 1.0))
    with pytest.raises(ValueError, match="weights of 0 or 1"):
        adapter.sdk_datum(adapter.PYTRIO, datum, "cross_entropy", 1.5)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_sampling_and_adam_params_map_the_off_values(flavour):
    import importlib

    types = importlib.import_module(f"{flavour}.types")
    f = adapter.FLAVOURS[flavour]
    off = adapter.sdk_sampling_params(f, SamplingParams(max_tokens=9))
    assert isinstance(off, types.SamplingParams)
    assert (off.top_k, off.stop, off.max_tokens, off.temperature) == (-1, None, 9, 1.0)
    on = adapter.sdk_sampling_params(f, SamplingParams(max_tokens=3, top_k=5, top_p=0.9, stop_token_ids=(7,), seed=1))
    assert (on.top_k, list(on.stop), on.top_p, on.seed) == (5, [7], 0.9, 1)
    adam = adapter.sdk_adam_params(f, AdamParams())
    assert isinstance(adam, types.AdamParams)
    assert adam.eps == 1e-8 and types.AdamParams().eps != 1e-8  # ours passed explicitly
    assert adam.grad_clip_norm == 0.0
    assert adapter.sdk_adam_params(f, AdamParams(grad_clip_norm=1.5)).grad_clip_norm == 1.5


def test_sampled_sequences_keep_the_stop_token_and_reason():
    seq = adapter.from_sdk_sequence([4, 9, 2], [-0.5, -1.0, -0.1], "stop")
    assert seq.tokens == (4, 9, 2) and seq.stop_reason is StopReason.STOP
    assert adapter.from_sdk_sequence([4], [-0.5], "length").stop_reason is StopReason.LENGTH
    with pytest.raises(ValueError, match="one logprob per token"):
        adapter.from_sdk_sequence([4, 5], None, "stop")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_fake_clients_have_the_real_sdk_signatures(flavour):
    import importlib

    sdk = importlib.import_module(flavour)
    from tests import fake_tinker

    real = (sdk.ServiceClient, sdk.TrainingClient, sdk.SamplingClient, sdk.RestClient)
    fakes = (*FAKES[flavour], getattr(fake_tinker, f"{flavour.title()}RestClient"))
    for fake_cls, real_cls in zip(fakes, real):
        for name, method in vars(fake_cls).items():
            if name.startswith("_") and not (name == "__init__" and fake_cls in (fakes[0], fakes[3])):
                continue
            if not callable(method):
                continue
            fake_params = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
            real_params = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(real_cls, name)).parameters.values()]
            assert [p[:2] for p in fake_params] == [p[:2] for p in real_params], f"{real_cls.__name__}.{name}"


def test_importing_the_registry_imports_no_sdk():
    code = "import sys, retool.engines, retool.train, retool.cli; retool.cli.build_parser(); print('tinker' in sys.modules or 'pytrio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "False"


def test_what_the_services_cannot_do_is_refused_before_anything_loads():
    from retool.config import ConfigError
    from retool.train import TrainConfig

    for engine in FLAVOURS:
        for bad, message in ((dict(dual_clip=3.0), "dual-clip"), (dict(temperature=0.7), "temperature"),
                             (dict(top_p=0.9), "top_p"), (dict(full_finetune=True), "full fine-tuning"),
                             (dict(packing="packed"), "packing"), (dict(behaviour_is="token-tis"), "--behaviour-is")):
            with pytest.raises(ConfigError, match=message):
                make_config(TrainConfig, engine=engine, **bad)


# ---------------------------------------------------------------- parity with the local engine


def pair(tmp_path: Path, flavour: str, monkeypatch, **service_options):
    service = FakeService(tmp_path / f"service-{flavour}", flavour, **service_options)
    install(service, monkeypatch)
    client = adapter.create_training_client(flavour, model=model(), lora_rank=4, seed=3)
    local = LocalTrainingClient(LocalEngineConfig(model=model(), lora_rank=4, lora_alpha=FAKE_LORA_ALPHA, seed=3))
    return service, client, local


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_steps_equal_the_local_engine_in_loss_gradient_weights_and_adam_moments(flavour, tmp_path, monkeypatch):
    """Step 1: one forward_backward; step 2: two of different token counts, one optim_step.
    A sum-vs-mean slip would scale the gradient by the token count, which Adam would
    almost hide in the weights, so the gradients themselves are compared."""
    service, client, local = pair(tmp_path, flavour, monkeypatch)
    adam = AdamParams(learning_rate=1e-2)
    figures = {}
    for step, calls in enumerate([[rl_datums(4, 0)], [rl_datums(2, 1), rl_datums(5, 2)]], start=1):
        for datums in calls:
            ours = client.submit_forward_backward(datums, "ppo", PPO)
            theirs = local.forward_backward(datums, "ppo", PPO)
            ours = ours.result()
            for key in ("train/loss", "train/sampler_logprob_diff", "train/approx_kl", "train/clip_frac",
                        "train/tokens"):
                assert ours.metrics[key] == pytest.approx(theirs.metrics[key], rel=1e-5), key
            figures[f"loss_rel_{step}"] = abs(ours.metrics["train/loss"] / theirs.metrics["train/loss"] - 1)
        local_grads = [p.grad.detach().clone() for p in local.params]
        client.submit_optim_step(adam).result()
        norm = local.optim_step(adam).metrics["train/grad_norm"]
        trainer = service.training_clients[-1]
        figures[f"grad_rel_{step}"] = rel(trainer.grads[-1], local_grads)
        figures[f"grad_norm_rel_{step}"] = abs(trainer.grad_norms[-1] / norm - 1)
        assert figures[f"grad_rel_{step}"] < 1e-5
        assert figures[f"grad_norm_rel_{step}"] < 1e-5
    fake = service.training_clients[-1].local
    figures["weights_rel"] = rel(fake.params, local.params)
    moments = [(fake.optimizer.state[p][m], local.optimizer.state[q][m])
               for p, q in zip(fake.params, local.params) for m in ("exp_avg", "exp_avg_sq")]
    figures["exp_avg_rel"] = rel([a for a, _ in moments[0::2]], [b for _, b in moments[0::2]])
    figures["exp_avg_sq_rel"] = rel([a for a, _ in moments[1::2]], [b for _, b in moments[1::2]])
    assert figures["weights_rel"] < 1e-4 and figures["exp_avg_rel"] < 1e-4 and figures["exp_avg_sq_rel"] < 1e-4
    print(f"\nparity {flavour}: " + ", ".join(f"{k}={v:.1e}" for k, v in figures.items()))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_train_steps_equal_the_local_engines_on_the_same_trajectories(flavour, tmp_path, monkeypatch):
    """``retool.train.train_step`` twice on each engine, both fed the same trajectories
    (the local engine's step-1 rollout; step 2 is off-policy, so PPO clips): the same
    loss, clip fraction and gradients."""
    import asyncio

    from retool.train import build_trainer, train_step
    from tests.test_train import tiny_config

    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    common = dict(lora_rank=4, lora_alpha=FAKE_LORA_ALPHA, seed=3, max_steps=2, lr=1e-2)
    local = build_trainer(tiny_config(tmp_path, run_dir=str(tmp_path / "l"), **common))
    remote = build_trainer(tiny_config(tmp_path, engine=flavour, run_dir=str(tmp_path / "r"), **common))
    local.rollout.sampler = local.engine.save_weights_for_sampler()  # as a step takes it
    groups = {p.id: g for p, g in zip(local.problems, asyncio.run(local.rollout.groups(local.problems, 4)))}

    async def same_group(problem, group_size, **kwargs):
        return list(groups[problem.id])

    local_grads = []
    real_submit = local.engine.submit_optim_step

    def submit_and_record(adam):
        local_grads.append([p.grad.detach().clone() for p in local.engine.params])
        return real_submit(adam)

    monkeypatch.setattr(local.engine, "submit_optim_step", submit_and_record)
    for trainer in (local, remote):
        trainer.rollout.group = same_group
    for step in (1, 2):
        ours, _ = train_step(remote, step)
        theirs, _ = train_step(local, step)
        for key in ("train/loss", "train/clip_frac", "train/approx_kl", "train/tokens"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)  # step 1: ~0
        grad_rel = rel(service.training_clients[-1].grads[-1], local_grads[-1])
        norm = service.training_clients[-1].grad_norms[-1]
        print(f"\ntrain_step parity {flavour} step {step}: loss {ours['train/loss']:.6g} vs {theirs['train/loss']:.6g}, "
              f"clip_frac {ours['train/clip_frac']:.4g} vs {theirs['train/clip_frac']:.4g}, grad_rel {grad_rel:.1e}, "
              f"grad_norm {norm:.6g} vs {theirs['train/grad_norm']:.6g}")
        assert grad_rel < 1e-5
        assert norm == pytest.approx(theirs["train/grad_norm"], rel=1e-5)
    for trainer in (local, remote):
        if trainer.sandbox is not None:
            trainer.sandbox.close()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_mis_scaled_loss_would_be_caught(flavour, tmp_path, monkeypatch):
    """The other flavour's reduction on this service gives a different gradient: the
    parity check is not blind to a sum-versus-mean mistake."""
    service, client, local = pair(tmp_path, flavour, monkeypatch)
    client.flavour = dataclasses.replace(client.flavour, token_sum=not client.flavour.token_sum)
    datums = rl_datums(4, 0)
    client.forward_backward(datums, "ppo", PPO)
    local.forward_backward(datums, "ppo", PPO)
    local_grads = [p.grad.detach().clone() for p in local.params]
    client.optim_step(AdamParams())
    assert rel(service.training_clients[-1].grads[-1], local_grads) > 0.5


def test_cross_entropy_matches_the_local_engine(tmp_path, monkeypatch):
    for flavour in FLAVOURS:
        service, client, local = pair(tmp_path / flavour, flavour, monkeypatch)
        datums = [algo.make_datum(d.input_tokens_N + d.target_tokens_N[-1:], (0,) + tuple(int(w) for w in d.weights_N))
                  for d in rl_datums(3, 4)]
        ours, theirs = client.forward_backward(datums, "cross_entropy"), local.forward_backward(datums, "cross_entropy")
        assert ours.metrics["train/loss"] == pytest.approx(theirs.metrics["train/loss"], rel=1e-5)
        local_grads = [p.grad.detach().clone() for p in local.params]
        client.optim_step(AdamParams())
        assert rel(service.training_clients[-1].grads[-1], local_grads) < 1e-5


def test_a_poisoned_batch_is_never_sent(tmp_path, monkeypatch):
    service, client, _ = pair(tmp_path, "tinker", monkeypatch)
    bad = dataclasses.replace(rl_datums(1, 0)[0], sampler_logprobs_N=(float("nan"),) * 4)
    with pytest.raises(FloatingPointError, match="nothing was sent"):
        client.submit_forward_backward([bad], "ppo", PPO)
    assert service.calls["forward_backward"] == 0
    with pytest.raises(ValueError, match="dual-clip"):
        client.submit_forward_backward(rl_datums(1, 0), "ppo", {**PPO, "dual_clip": 3.0})
    with pytest.raises(ValueError, match="no sampler-trainer correction"):
        client.submit_forward_backward(rl_datums(1, 0), "ppo", {**PPO, "behaviour_token_cap": 2.0})
    assert service.calls["forward_backward"] == 0


# ---------------------------------------------------------------- retool train / eval on the fake


def digit_problems(path: Path, n: int = 6) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "question": DIGIT_QUESTION, "answer": "2"}) + "\n"
                            for i in range(n)))
    return path


def train_args(tmp_path: Path, run: Path, engine: str, steps: int = 2) -> list[str]:
    return ["train", "--engine", engine, "--model", model(), "--chat-template", "hermes",
            "--train-data", str(digit_problems(tmp_path / "train.jsonl")), "--batch-size", "2", "--group-size", "4",
            "--max-steps", str(steps), "--max-turn-tokens", "12", "--max-trajectory-tokens", "600", "--mode", "text",
            "--sandbox-workers", "2", "--run-dir", str(run), "--save-every", "1", "--lora-rank", "4",
            "--lr", "5e-3", "--save-trajectories"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_retool_train_and_eval_run_on_the_fake_service(flavour, tmp_path, monkeypatch, capsys):
    from retool.log import read_metrics

    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, flavour)) == 0, capsys.readouterr().err
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("train/loss", "train/approx_kl", "train/clip_frac", "train/sampler_logprob_diff", "engine/errors",
                "engine/retries", "tokens/prefill", "tokens/sampled", "tokens/trained", "time/service_busy",
                "time/service_window"):
        assert key in rows[-1], key
    for row in rows:  # the client's own measure of the service's share of the step
        assert 0 < row["time/service_busy"] <= row["time/service_window"]
    assert rows[-1]["train/optim_steps"] == 2.0
    engine_json = json.loads((run / "checkpoints" / "step_000002" / "engine" / "engine.json").read_text())
    assert engine_json["engine"] == flavour and engine_json["weights"].startswith("tinker://fake/")
    assert sorted(p.name for p in (run / "checkpoints" / "step_000002" / "engine").iterdir()) == ["engine.json"]
    # on-policy: an ephemeral sampler on the current weights every step (the SDKs'
    # save_weights_and_get_sampling_client), none at start-up on untrained weights, and
    # no named sampler checkpoint but the one each checkpoint saves (save_every 1)
    assert service.calls["save_weights_and_get_sampling_client"] == 2
    assert service.calls["create_sampling_client"] == 0 and service.calls["save_weights_for_sampler"] == 2
    assert service.closed == (["success"] if flavour == "tinker" else ["ENDED"])
    assert [kind for kind, _ in service.requests] == ["forward_backward", "optim_step"] * 2

    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"id": "q", "question": DIGIT_QUESTION, "answer": "2"}) + "\n")
    for source in (["--checkpoint", str(run)], ["--model", model()]):
        out = tmp_path / f"eval-{len(source[1])}.jsonl"
        code = cli_main(["eval", "--engine", flavour, *source, "--chat-template", "hermes", "--dataset", str(data),
                         "--mode", "text", "--val-n", "2", "--max-turn-tokens", "8", "--max-trajectory-tokens", "512",
                         "--output", str(out)])
        assert code == 0, capsys.readouterr().err
        assert out.is_file()


def test_seeded_multi_sample_requests_become_distinct_requests_per_flavour():
    seeded = SamplingParams(max_tokens=4, seed=11)
    tinker_plan = adapter.plan_requests(adapter.TINKER, 3, seeded)
    assert [r.num_samples for r in tinker_plan] == [1, 1, 1]
    seeds = [r.params.seed for r in tinker_plan]
    assert len(set(seeds)) == 3 and seeds == [r.params.seed for r in adapter.plan_requests(adapter.TINKER, 3, seeded)]
    (pytrio_plan,) = adapter.plan_requests(adapter.PYTRIO, 3, seeded)
    assert pytrio_plan.num_samples == 3 and pytrio_plan.params.seed is None
    for flavour in (adapter.TINKER, adapter.PYTRIO):  # one sample, or no seed: sent as asked
        assert adapter.plan_requests(flavour, 1, seeded) == (adapter.SampleRequest(1, seeded),)
        unseeded = SamplingParams(max_tokens=4)
        assert adapter.plan_requests(flavour, 5, unseeded) == (adapter.SampleRequest(5, unseeded),)
    with pytest.raises(ValueError, match="num_samples"):
        adapter.plan_requests(adapter.TINKER, 0, seeded)


def test_request_usage_counts_what_each_service_prefills_and_caches():
    """By hand: Tinker prefills a prompt once per sample and bills a multi-sample request's
    other samples as cached; PyTRIO reports each call's input tokens, nothing cached."""
    seeded, unseeded = SamplingParams(max_tokens=4, seed=3), SamplingParams(max_tokens=4)
    one_request = (adapter.SampleRequest(4, unseeded),)
    usage = adapter.request_usage(10, None, one_request, [tinker.types.SampleResponse(sequences=[],
                                                                                     prompt_cache_hit_tokens=6)])
    assert (usage["tokens/prefill_service"], usage["tokens/prefill_cached"]) == (40, 6 + 3 * 10)
    split = adapter.plan_requests(adapter.TINKER, 4, seeded)
    hits = [0, 10, 10, 9]
    usage = adapter.request_usage(10, 3, split, [tinker.types.SampleResponse(sequences=[], prompt_cache_hit_tokens=h)
                                                 for h in hits])
    assert (usage["tokens/prefill_service"], usage["tokens/prefill_cached"]) == (40, 29)
    assert (usage["engine/sample_requests"], usage["engine/split_requests"], usage["engine/unseeded_requests"]) == (4, 3, 0)
    pytrio_plan = adapter.plan_requests(adapter.PYTRIO, 4, seeded)
    usage = adapter.request_usage(10, 3, pytrio_plan, [pytrio.types.SampleResponse(sequences=[], input_tokens=11)])
    assert (usage["tokens/prefill_service"], usage["tokens/prefill_cached"], usage["engine/unseeded_requests"]) == (
        11, 0, 1)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_groups_stay_distinct_when_the_service_repeats_seeded_samples(flavour, tmp_path, monkeypatch, capsys):
    """The fake reproduces the reported Tinker behaviour (a seeded request for n > 1
    samples answers n identical sequences): every group of a run is still n distinct
    trajectories, the requests say how (split / unseeded) and what it cost is counted."""
    import asyncio
    import gzip

    from retool.log import read_metrics

    service = FakeService(tmp_path / "service", flavour, duplicate_seeded=True)
    install(service, monkeypatch)
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=8, seed=5)
    raw = FAKES[flavour][2](service.sampler(None, model())).sample(
        SDKS[flavour].types.ModelInput.from_ints(prompt), 4,
        adapter.sdk_sampling_params(adapter.FLAVOURS[flavour], params)).result()
    assert len({tuple(s.tokens) for s in raw.sequences}) == 1  # the reported behaviour, reproduced
    client = adapter.create_training_client(flavour, model=model(), lora_rank=4, seed=0)
    sampler = client.save_weights_for_sampler()
    got = asyncio.run(sampler.sample(prompt, 4, params)).sequences
    assert len({s.tokens for s in got}) > 1  # independent draws (a tiny model may repeat one by chance)
    if flavour == "tinker":  # each is the draw of its own derived seed: replayable one by one
        for seq, request in zip(got, adapter.plan_requests(adapter.TINKER, 4, params)):
            assert asyncio.run(sampler.sample(prompt, 1, request.params)).sequences[0].tokens == seq.tokens
    client.close()

    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, flavour, steps=1)) == 0, capsys.readouterr().err
    groups: dict[int, list] = {}
    with gzip.open(run / "trajectories" / "step_000001.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            groups.setdefault(row["group"], []).append(tuple(row["trajectory"]["tokens_T"]))
    distinct = [len(set(g)) for g in groups.values()]
    assert len(groups) == 2 and all(len(g) == 4 for g in groups.values()) and min(distinct) > 1, distinct
    row = read_metrics(run / "metrics.jsonl")[0]
    if flavour == "tinker":  # split: 4 seeded single-sample requests per group's (only) turn
        assert (row["engine/split_requests"], row["engine/unseeded_requests"]) == (6, 0)
        assert all(n == 1 and seed is not None for n, seed in service.sample_requests[-8:])
        assert row["tokens/prefill_service"] == 4 * row["tokens/prefill"]
    else:  # one request per group, sent unseeded: the prompt is prefilled once
        assert (row["engine/split_requests"], row["engine/unseeded_requests"]) == (0, 2)
        assert service.sample_requests[-2:] == [(4, None), (4, None)]
        assert row["tokens/prefill_service"] == row["tokens/prefill"]
    print(f"\n{flavour}: distinct trajectories per group {distinct} (the service alone: 1); "
          f"{row['engine/sample_requests']:g} requests for 2 groups of 4; prefill sent "
          f"{row['tokens/prefill_service']:g} (rollout counts {row['tokens/prefill']:g}), cached "
          f"{row['tokens/prefill_cached']:g}")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_reference_runs_unembedding_and_adam_eps_are_available(flavour, tmp_path, monkeypatch, capsys):
    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    seen = []
    real = service.lora_trainer
    monkeypatch.setattr(service, "lora_trainer", lambda *a: seen.append(a[3]) or real(*a))
    run = tmp_path / "run"
    prefix = f"--{flavour}-"
    assert cli_main(train_args(tmp_path, run, flavour, steps=1) + [prefix + "train-unembed", prefix + "adam-eps",
                                                                   "1e-12"]) == 0, capsys.readouterr().err
    assert seen == [True]
    assert [p.eps for kind, p in service.requests if kind == "optim_step"] == [1e-12]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_closing_the_training_client_ends_the_session_once(flavour, tmp_path, monkeypatch, caplog):
    """``close_training_client`` passes how the run ended to ``close(status)``: Tinker's
    session is closed with it (PyTRIO's SDK has no close), the thread pools stop, and a
    second close sends nothing."""
    from retool.engines import close_training_client

    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    client = adapter.create_training_client(flavour, model=model(), lora_rank=4, seed=3)
    with caplog.at_level("WARNING", logger="retool.engines"):
        close_training_client(client, KeyboardInterrupt())
        close_training_client(client)
    assert client._sample_pool._shutdown and client._result_pool._shutdown
    assert service.calls["close"] == (1 if flavour == "tinker" else 0)
    if flavour == "tinker":
        assert client.service.closed_with == "interrupted"
    assert not caplog.records


def test_a_tinker_session_that_cannot_be_closed_is_logged_once(tmp_path, monkeypatch, caplog):
    from retool.engines import close_training_client

    service = FakeService(tmp_path / "service", "tinker")
    install(service, monkeypatch)
    client = adapter.create_training_client("tinker", model=model(), lora_rank=4, seed=3)
    service.fail("close", 500)
    with caplog.at_level("WARNING", logger="retool.engines"):
        close_training_client(client, RuntimeError("the step failed"))
    [record] = caplog.records
    assert "closing the tinker session (errored) failed" in record.getMessage()
    assert "InternalServerError" in record.getMessage()


def test_an_unknown_model_stops_with_one_clear_line(tmp_path, monkeypatch, capsys):
    install(FakeService(tmp_path / "service", "tinker"), monkeypatch)
    args = train_args(tmp_path, tmp_path / "run", "tinker")
    args[args.index("--model") + 1] = str(boxed_digit_model_dir().parent / "no-such-model")
    assert cli_main(args) != 0
    err = capsys.readouterr().err
    assert "no-such-model" in err and len([line for line in err.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize("flavour, where", [("tinker", "create_lora_training_client"), ("pytrio", "login")])
def test_an_authentication_error_stops_with_one_clear_line(flavour, where, tmp_path, monkeypatch, capsys):
    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    service.fail(where, 401)
    secret = "tml-planted-secret-key-0123456789"
    key_env = adapter.FLAVOURS[flavour].key_env
    monkeypatch.setenv(key_env, secret)
    assert cli_main(train_args(tmp_path, tmp_path / "run", flavour)) == 2
    err = capsys.readouterr().err
    assert "refused the credentials" in err and key_env in err and secret not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_resume_creates_only_the_checkpoints_client_and_closes_it(flavour, tmp_path, monkeypatch, capsys):
    """A resume makes no fresh run on the service and no sampler on untrained weights:
    its one training client comes from the checkpoint's state with its optimizer, its
    samplers are the steps' ephemeral ones, and the session is closed at the end."""
    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, flavour, steps=1)) == 0, capsys.readouterr().err
    before = dict(service.calls)
    service.closed.clear()
    assert cli_main(["train", "--resume", str(run), "--max-steps", "2"]) == 0, capsys.readouterr().err
    new = {k: v - before.get(k, 0) for k, v in service.calls.items() if v != before.get(k, 0)}
    assert new.get("create_lora_training_client", 0) == 0
    assert new["create_training_client_from_state"] == 1 and len(service.training_clients) == 2
    assert new.get("create_sampling_client", 0) == 0 and new["save_weights_and_get_sampling_client"] == 1
    assert service.training_clients[-1].local.optim_steps == 2  # the checkpoint's step, then one more
    assert service.closed == (["success"] if flavour == "tinker" else ["ENDED"])


@pytest.mark.parametrize("status", [429, 500, "timeout"])
def test_transient_sampling_failures_are_retried_and_counted(status, tmp_path, monkeypatch, capsys):
    from retool.log import read_metrics

    service = FakeService(tmp_path / "service", "tinker")
    install(service, monkeypatch)
    service.fail("sample", status)
    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, "tinker", steps=1)) == 0, capsys.readouterr().err
    row = read_metrics(run / "metrics.jsonl")[0]
    assert row["engine/errors"] >= 1 and row["engine/retries"] >= 1
    assert service.calls["optim_step"] == 1  # never re-sent


def test_the_sdks_own_retries_are_configured_not_wrapped(tmp_path, monkeypatch):
    fake = install(FakeService(tmp_path / "service", "tinker"), monkeypatch)
    client = adapter.create_training_client("tinker", model=model(), lora_rank=4, retry_timeout_s=90.0)
    client.forward_backward(rl_datums(1, 0), "ppo", PPO)
    client.optim_step(AdamParams())
    client.save_weights_for_sampler()
    assert FAKES["tinker"][1].last_retry_config.progress_timeout == 90.0  # on the ephemeral sampler
    client.close()
    assert adapter.sampler(SimpleNamespace(settings=ServiceSettings(retry_timeout_s=45.0), checkpoint=None,
                                           model=model())).sampler.sdk_client is not None
    assert fake.last_retry_config.progress_timeout == 45.0  # on an eval's sampler


def test_a_planted_api_key_leaves_no_trace(tmp_path, monkeypatch, capsys):
    secret = "tml-planted-secret-key-9876543210"
    monkeypatch.setenv("TINKER_API_KEY", secret)
    service = FakeService(tmp_path / "service", "tinker")
    install(service, monkeypatch)
    service.fail("sample", 500)
    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, "tinker", steps=1)) == 0
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err
    for path in run.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix == ".gz":
                import gzip

                data = gzip.decompress(data)
            assert secret.encode() not in data, path


# ---------------------------------------------------------------- kill mid-step, resume exactly


def run_fake_cli(service_root: Path, flavour: str, args: list[str], failpoints: str | None = None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RETOOL_FAILPOINTS", None)
    if failpoints:
        env["RETOOL_FAILPOINTS"] = failpoints
    return subprocess.run([sys.executable, "-m", "tests.fake_tinker", str(service_root), flavour, "--", *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def final_service_state(run: Path, service_root: Path, step: int) -> dict:
    meta = json.loads((run / "checkpoints" / f"step_{step:06d}" / "engine" / "engine.json").read_text())
    folder = service_root / meta["weights"][len("tinker://fake/"):]
    return torch.load(folder / "optimizer.pt", weights_only=True), folder


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_sigkill_mid_step_then_resume_is_exact(flavour, tmp_path):
    from retool.log import read_metrics
    from safetensors.torch import load_file

    service = tmp_path / "service"
    reference = tmp_path / "reference"
    done = run_fake_cli(service, flavour, train_args(tmp_path, reference, flavour, steps=3))
    assert done.returncode == 0, done.stderr[-2000:]
    crashed = tmp_path / "crashed"
    first = run_fake_cli(service, flavour, train_args(tmp_path, crashed, flavour, steps=3),
                         failpoints="after_rollout@2")
    assert first.returncode == -9, first.stderr[-2000:]
    second = run_fake_cli(service, flavour, ["train", "--resume", str(crashed)])
    assert second.returncode == 0, second.stderr[-2000:]
    assert [r["step"] for r in read_metrics(crashed / "metrics.jsonl")] == [1, 2, 3]
    ref_rows, rows = read_metrics(reference / "metrics.jsonl"), read_metrics(crashed / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref_rows]
    (ref_opt, ref_folder), (opt, folder) = final_service_state(reference, service, 3), final_service_state(crashed, service, 3)
    ref_w, w = load_file(ref_folder / "adapter" / "adapter_model.safetensors"), load_file(folder / "adapter" / "adapter_model.safetensors")
    for name in ref_w:
        torch.testing.assert_close(w[name], ref_w[name], atol=1e-6, rtol=0)
    for key, state in ref_opt["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt["state"][key][moment], state[moment], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- live (only with a key)


LIVE_MODEL = os.environ.get("RETOOL_LIVE_MODEL", "Qwen/Qwen3.5-4B")
"""The live tests' model: the smallest Qwen in Tinker's current lineup (the preset's;
tinker-cookbook lists it), set RETOOL_LIVE_MODEL for another. The previous default,
Qwen3-4B-Instruct-2507, is no longer offered."""
LIVE = pytest.mark.skipif(not (os.environ.get("TINKER_API_KEY") or os.environ.get("PYTRIO_API_KEY")),
                          reason="no TINKER_API_KEY / PYTRIO_API_KEY: the live service is not reachable")


def live_flavour() -> str:
    return "tinker" if os.environ.get("TINKER_API_KEY") else "pytrio"


@LIVE
def test_live_seeded_samples_are_distinct_and_two_steps_run(tmp_path, capsys):
    """On the live service: 8 seeded samples of one prompt are 8 distinct sequences (the
    adapter splits or unseeds the request, :func:`plan_requests`; a raw seeded request
    is reported too, for the record), then two ``retool train`` steps."""
    import asyncio

    flavour = live_flavour()
    client = adapter.create_training_client(flavour, model=LIVE_MODEL, lora_rank=8, seed=0)
    try:
        prompt = client.get_tokenizer().encode("Write one random word:")
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
        sampler = client.save_weights_for_sampler()
        got = asyncio.run(sampler.sample(prompt, 8, params)).sequences
        t = SDKS[flavour].types
        raw = sampler.sdk_client.sample(prompt=t.ModelInput.from_ints(prompt), num_samples=8,
                                        sampling_params=adapter.sdk_sampling_params(adapter.FLAVOURS[flavour],
                                                                                   params)).result()
        print(f"\nlive {flavour}: {len({s.tokens for s in got})} distinct of 8 via the adapter; one raw seeded "
              f"request gave {len({tuple(s.tokens) for s in raw.sequences})} distinct")
        assert len({s.tokens for s in got}) == 8
    finally:
        client.close()
    args = train_args(tmp_path, tmp_path / "run", flavour, steps=2)
    args[args.index("--model") + 1] = LIVE_MODEL
    args = [a for a in args if a not in ("--chat-template", "hermes")]
    assert cli_main(args) == 0, capsys.readouterr().err


# ---------------------------------------------------------------- cost


def test_price_tables_give_the_step_cost(tmp_path):
    from retool.config import ConfigError
    from retool.cost import Prices, load_prices

    table = tmp_path / "prices.toml"
    table.write_text('[tinker]\nprefill = 1.0\nsample = 2.0\ntrain = 3.0\n[tinker."m"]\ntrain = 5.0\n')
    assert load_prices(table, "tinker", "other") == Prices(1.0, 2.0, 3.0)
    prices = load_prices(table, "tinker", "m")
    assert prices == Prices(1.0, 2.0, 5.0)
    step = {"tokens/prefill": 1e6, "tokens/sampled": 2e6, "tokens/trained": 1e5}
    assert prices.step_cost(step) == pytest.approx(1.0 + 4.0 + 0.5)
    with pytest.raises(ConfigError, match=r"no \[pytrio\] table"):
        load_prices(table, "pytrio", "m")
    table.write_text('[tinker]\nprefil = 1.0\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        load_prices(table, "tinker", "m")
    assert load_prices(REPO / "configs" / "prices" / "example.toml", "tinker", "Qwen/Qwen3.5-4B") == Prices(
        units="tinker_billing")
    assert load_prices(REPO / "configs" / "prices" / "example.toml", "pytrio", "Qwen/Qwen3.5-4B") == Prices()


def run_to_max_cost(tmp_path, engine: str, capsys) -> tuple[Path, list[dict]]:
    """Train 5 steps on ``engine`` under a price table and ``--max-cost 0.3``; check that it
    stops cleanly after a checkpoint with the bill priced from the step's tokens, and
    return the run folder and its metric rows (shared by the engines' cost tests)."""
    from retool.log import read_metrics
    from retool.runs import latest_checkpoint

    table = tmp_path / "prices.toml"
    table.write_text(f"[{engine}]\nprefill = 100.0\nsample = 1000.0\ntrain = 1000.0\n")
    run = tmp_path / "run"
    args = train_args(tmp_path, run, engine, steps=5) + ["--save-every", "10", "--price-table", str(table),
                                                         "--max-cost", "0.3"]
    assert cli_main(args) == 0, capsys.readouterr().err
    rows = read_metrics(run / "metrics.jsonl")
    assert 1 <= len(rows) < 5
    last = rows[-1]
    assert last["cost/total"] == pytest.approx(sum(r["cost/step"] for r in rows))
    assert last["cost/step"] == pytest.approx((last["tokens/prefill"] * 100 + last["tokens/sampled"] * 1000
                                               + last["tokens/trained"] * 1000) / 1e6)
    assert last["cost/total"] <= 0.3 < last["cost/total"] + last["cost/step"]
    assert latest_checkpoint(run)[0] == len(rows)  # checkpointed at the stop
    err = capsys.readouterr().err
    assert "would pass --max-cost 0.3" in err and "usd=" in err
    return run, rows


def test_max_cost_stops_cleanly_after_a_checkpoint(tmp_path, monkeypatch, capsys):
    install(FakeService(tmp_path / "service", "pytrio"), monkeypatch)
    run_to_max_cost(tmp_path, "pytrio", capsys)


def test_docs_show_the_service_settings():
    from retool.config import markdown_table
    from retool.engines import ServiceSettings

    docs = (REPO / "docs" / "engines.md").read_text()
    assert markdown_table(ServiceSettings, "tinker_") in docs and markdown_table(ServiceSettings, "pytrio_") in docs


# ---------------------------------------------------------------- SFT on the service, RL from it


def test_sft_on_the_service_then_rl_starts_from_it(tmp_path, monkeypatch, capsys):
    from retool.log import read_metrics
    from tests.test_sft import openai_row

    service = FakeService(tmp_path / "service", "tinker")
    install(service, monkeypatch)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(openai_row()) + "\n")
    sft_run = tmp_path / "sft"
    assert cli_main(["sft", "--engine", "tinker", "--model", model(), "--chat-template", "hermes", "--data", str(data),
                     "--run-dir", str(sft_run), "--batch-size", "1", "--max-steps", "3", "--save-every", "3",
                     "--lora-rank", "4", "--lr", "0.02"]) == 0, capsys.readouterr().err
    losses = [r["sft/loss"] for r in read_metrics(sft_run / "metrics.jsonl")]
    assert losses[-1] < losses[0]
    sft_weights = service.training_clients[-1].local.params
    rl_run = tmp_path / "rl"
    assert cli_main(train_args(tmp_path, rl_run, "tinker", steps=1) + ["--init-from", str(sft_run)]) == 0, \
        capsys.readouterr().err
    assert service.calls["create_training_client_from_state"] == 1
    rl_start = service.training_clients[-1]
    assert rl_start.local.optim_steps == 1  # weights from the SFT run, a fresh optimizer
    assert len(rl_start.grads) == 1 and len(sft_weights) == len(rl_start.local.params)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_export_downloads_a_peft_folder_the_local_engine_loads(flavour, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    service = FakeService(tmp_path / "service", flavour)
    install(service, monkeypatch)
    run = tmp_path / "run"
    assert cli_main(train_args(tmp_path, run, flavour, steps=1)) == 0, capsys.readouterr().err
    out = tmp_path / "adapter"
    service.closed.clear()
    assert cli_main(["export", str(run), "--output-dir", str(out)]) == 0, capsys.readouterr().err
    assert (out / "adapter_config.json").is_file()
    if flavour == "tinker":  # the SDK's own route: a temporary external-weights export, deleted afterwards
        assert [p.split("/")[-2] for p in service.deleted] == ["external_weights"]
        assert not (service.root / "external_weights").exists() or not any((service.root / "external_weights").iterdir())
    assert service.closed == (["success"] if flavour == "tinker" else ["ENDED"])
    trained = service.training_clients[-1].local
    exported = load_file(out / "adapter_model.safetensors")
    local = LocalTrainingClient(LocalEngineConfig(model=model(), lora_rank=4, lora_alpha=FAKE_LORA_ALPHA,
                                                  init_from=str(out)))
    assert len(exported) == len(trained.params)
    for a, b in zip(local.params, trained.params):
        torch.testing.assert_close(a, b)
    assert cli_main(["export", str(run), "--output-dir", str(out)]) == 2  # never overwrites


def test_in_flight_time_is_the_union_of_the_requests_spans():
    """``time/service_busy``: overlapping requests count once, gaps with nothing in flight
    not at all; a request still in flight at a take counts up to it and on into the next
    window."""
    from retool.engines.tinker import InFlight

    now = [0.0]
    meter = InFlight(clock=lambda: now[0])
    assert meter.take() == (0.0, 0.0)  # no request yet: no window

    now[0] = -5.0  # the first window starts at the first request, not when the meter was made

    def at(t: float, *actions) -> None:
        now[0] = t
        for action in actions:
            action()

    at(1.0, meter.enter)               # a sample from 1 to 4
    at(2.0, meter.enter)               # another from 2 to 3, inside it
    at(3.0, meter.exit)
    at(4.0, meter.exit)
    at(6.0, meter.enter)               # nothing in flight from 4 to 6; forward_backward from 6 ...
    now[0] = 7.0
    assert meter.take() == (4.0, 6.0)  # 1-4 and 6-7 of the window 1-7
    at(9.0, meter.exit)                # ... to 9
    now[0] = 10.0
    assert meter.take() == (2.0, 3.0)  # 7-9 of the window 7-10
    now[0] = 12.0
    assert meter.take() == (0.0, 2.0)
