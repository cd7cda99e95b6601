"""``retool eval``: results file, summary, resume after a torn line and after SIGKILL, checkpoints.

Real components throughout: the rollout, renderer, grader and sandbox, the local engine
with a tiny random Llama (real SmolLM2 tokenizer, Hermes template), the real checkpoint
layout written by ``retool.runs.save_checkpoint``. The policy is scripted only where
a test needs tool calls and known answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retool.config import ConfigError, make_config
from retool.evaluate import (
    EvalConfig,
    EvalError,
    EvalModel,
    ModelChoice,
    ProblemSampler,
    choose_model,
    evaluate,
    load_eval_model,
    problem_seed,
)
from retool.results import read_results
from retool.runs import resolve_checkpoint
from tests.scripted import ScriptedSampler
from tests.tiny import tiny_model_dir
from tests.tokenizers import qwen25_tokenizer

pytestmark = pytest.mark.timeout(300)  # evals load a tiny model (one kills and reruns an eval in a subprocess)

REPO = Path(__file__).resolve().parent.parent


def write_dataset(path: Path, answers: list[int]) -> Path:
    rows = [{"id": f"q{i}", "question": f"What is {a - i} plus {i}?", "answer": str(a)} for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(row: dict) -> dict:
    """A problem row without its timing, and with logprobs rounded: BLAS kernels may
    differ in the last bit between processes (memory alignment), tokens may not."""
    samples = [{**s, "logprobs_T": [round(x, 4) for x in s["logprobs_T"]]} for s in row["samples"]]
    return {**{k: v for k, v in row.items() if k != "time_s"}, "samples": samples}


def hermes_call(code: str, prefix: str) -> str:
    body = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    return f"{prefix}Let me compute.\n<tool_call>\n{body}\n</tool_call>"


# ---------------------------------------------------------------- scripted policy, tool mode


SCRIPTS = [[hermes_call("print(6*7)", "[traj 0] "), "So it is \\boxed{42}."], ["[traj 1] It is \\boxed{41}."]]


def scripted_eval(tmp_path: Path, **overrides) -> tuple:
    data = write_dataset(tmp_path / "set.jsonl", [42, 41, 7])
    cfg = make_config(EvalConfig, **{"dataset": str(data), "val_n": 2, "concurrency": 2,
                                     "output": str(tmp_path / "out.jsonl"), **overrides})
    tokenizer = qwen25_tokenizer()
    model = EvalModel(tokenizer, ScriptedSampler(tokenizer, SCRIPTS), ModelChoice(model="Qwen/Qwen2.5-7B-Instruct"))
    return cfg, model


def test_retool_eval_writes_trajectories_and_the_summary(tmp_path):
    cfg, model = scripted_eval(tmp_path)
    report = evaluate(cfg, model)

    header, *problems, summary = lines(report.path)
    assert header["type"] == "header" and header["label"] == "base" and header["mode"] == "retool"
    assert header["val_n"] == 2 and header["sampling"]["top_p"] == 0.7 and header["sampling"]["temperature"] == 1.0
    assert sorted(p["problem_id"] for p in problems) == ["q0", "q1", "q2"]
    by_id = {p["problem_id"]: p for p in problems}
    assert [by_id[q]["num_correct"] for q in ("q0", "q1", "q2")] == [1, 1, 0]
    call_turn = by_id["q0"]["samples"][0]["turns"][0]
    assert call_turn["exchange"]["call"] == {"kind": "valid", "code": "print(6*7)", "raw": call_turn["exchange"]["call"]["raw"]}
    assert call_turn["exchange"]["result"]["status"] == "ok" and call_turn["exchange"]["result"]["stdout"] == "42\n"
    assert call_turn["exchange"]["response"] == "42\n"
    assert by_id["q0"]["samples"][0]["grade"] == {"reward": 1.0, "correct": True, "formatted": True,
                                                  "answer": "42", "grader_error": None}

    # Hand computation: per-problem accuracy [1/2, 1/2, 0].
    assert summary["type"] == "summary" and summary["k"] == 2 and summary["num_problems"] == 3
    assert summary["average@k"] == pytest.approx(1 / 3) and summary["pass@k"] == pytest.approx(2 / 3)
    assert summary["pass@k_unbiased"] == {"1": pytest.approx(1 / 3), "2": pytest.approx(2 / 3)}
    assert summary["average@k_stderr"] == pytest.approx(1 / 6)
    assert summary["format"] == 1.0 and summary["code_calls"] == 0.5 and summary["turns"] == 1.5
    assert report.sampled_problems == 3 and report.sampler_requests == 3 * 2  # fork + one second turn each
    # The report readers (plots, viewer) accept the file.
    assert read_results(report.path).summary.to_json() == summary


def test_stateful_eval_keeps_variables_per_trajectory_and_records_the_mode(tmp_path):
    from tests.test_sandbox import _sandbox_uid_processes

    scripts = [[hermes_call("x = 6*7", "[traj 0] "), hermes_call("print(x)", ""), "So it is \\boxed{42}."],
               ["[traj 1] It is \\boxed{41}."]]
    data = write_dataset(tmp_path / "set.jsonl", [42])
    cfg = make_config(EvalConfig, dataset=str(data), val_n=2, concurrency=2, output=str(tmp_path / "out.jsonl"),
                      interpreter="stateful")
    tokenizer = qwen25_tokenizer()
    model = EvalModel(tokenizer, ScriptedSampler(tokenizer, scripts), ModelChoice(model="Qwen/Qwen2.5-7B-Instruct"))
    report = evaluate(cfg, model)
    header, problem, _ = lines(report.path)
    assert header["sandbox"]["interpreter"] == "stateful"
    second = problem["samples"][0]["turns"][1]["exchange"]
    assert second["result"]["stdout"] == "42\n" and problem["num_correct"] == 1
    assert _sandbox_uid_processes() == []
    from retool.replay import load_source, run_replay  # replay runs each trajectory in one session again

    items, limits = load_source(report.path)
    assert limits.interpreter == "stateful"
    assert all(call.reproduces for call in run_replay(items, limits)) and _sandbox_uid_processes() == []
    (tmp_path / "plain").mkdir()
    plain = evaluate(*scripted_eval(tmp_path / "plain"))
    assert "interpreter" not in lines(plain.path)[0]["sandbox"]  # stateless headers are as before


def test_other_settings_refuse_to_resume_and_overwrite_starts_afresh(tmp_path):
    cfg, model = scripted_eval(tmp_path)
    evaluate(cfg, model)
    before = Path(cfg.output).read_bytes()
    changed, _ = scripted_eval(tmp_path, top_p=0.9)
    with pytest.raises(ConfigError, match=r"(?s)sampling\.top_p: file has 0\.7, this run has 0\.9.*--overwrite"):
        evaluate(changed, model)
    assert Path(cfg.output).read_bytes() == before

    again, _ = scripted_eval(tmp_path, top_p=0.9, overwrite=True)
    report = evaluate(again, model)
    assert report.sampled_problems == 3 and lines(report.path)[0]["sampling"]["top_p"] == 0.9


def test_a_file_that_is_not_an_eval_is_left_alone(tmp_path):
    cfg, model = scripted_eval(tmp_path)
    Path(cfg.output).write_text('{"step": 1, "reward/mean": 0.5}\n')
    with pytest.raises(EvalError, match="not an eval results file"):
        evaluate(cfg, model)
    assert Path(cfg.output).read_text() == '{"step": 1, "reward/mean": 0.5}\n'


def test_a_damaged_line_inside_the_file_is_an_error(tmp_path):
    cfg, model = scripted_eval(tmp_path)
    evaluate(cfg, model)
    text = Path(cfg.output).read_text().splitlines(keepends=True)
    text[1] = text[1][:50] + "\n"
    Path(cfg.output).write_text("".join(text))
    with pytest.raises(EvalError, match=r"out\.jsonl:2: not valid JSON"):
        evaluate(cfg, model)


# ---------------------------------------------------------------- seeding


class Recorder:
    """Answers every request with no tokens and remembers the seeds it was given."""

    def __init__(self):
        self.seeds = []

    async def sample(self, prompt_tokens, num_samples, params):
        from retool.engines.base import SampleResult

        self.seeds.append((tuple(prompt_tokens), params.seed))
        return SampleResult(())


def test_request_seeds_depend_on_context_and_occurrence_not_on_order():
    import asyncio

    from retool.engines.base import SamplingParams

    params = SamplingParams(max_tokens=4)

    async def ask(sampler, contexts):
        for c in contexts:
            await sampler.sample(c, 1, params)

    forward, backward = Recorder(), Recorder()
    asyncio.run(ask(ProblemSampler(forward, seed=7), [(1, 2), (1, 3), (1, 2)]))
    asyncio.run(ask(ProblemSampler(backward, seed=7), [(1, 3), (1, 2), (1, 2)]))
    assert sorted(forward.seeds) == sorted(backward.seeds)
    seeds = [s for _, s in forward.seeds]
    assert len(set(seeds)) == 3 and all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)

    other = Recorder()
    asyncio.run(ask(ProblemSampler(other, seed=8), [(1, 2)]))
    assert other.seeds[0][1] not in seeds
    unseeded = Recorder()
    asyncio.run(ask(ProblemSampler(unseeded, seed=None), [(1, 2)]))
    assert unseeded.seeds == [((1, 2), None)]
    assert problem_seed(42, "aime25-1") == problem_seed(42, "aime25-1") != problem_seed(42, "aime25-2")


# ---------------------------------------------------------------- the tiny local model


def tiny_config(tmp_path: Path, out: str, **overrides) -> EvalConfig:
    data = tmp_path / "set.jsonl"
    if not data.exists():
        write_dataset(data, [7, 9, 11, 13, 15, 17])
    return make_config(EvalConfig, **{"model": str(tiny_model_dir()), "chat_template": "hermes",
                                      "dataset": str(data), "mode": "text", "val_n": 2, "max_turn_tokens": 8, "top_p": 1.0,
                                      "max_trajectory_tokens": 512, "concurrency": 2,
                                      "output": str(tmp_path / out), **overrides})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("tiny"), "unused.jsonl")
    return load_eval_model(cfg, choose_model(cfg))


@pytest.fixture(scope="module")
def baseline(tiny, tmp_path_factory):
    """An uninterrupted eval of the 6-problem set."""
    folder = tmp_path_factory.mktemp("baseline")
    return folder, evaluate(tiny_config(folder, "full.jsonl"), tiny)


def test_resume_after_a_torn_line_samples_only_missing_problems(tiny, baseline, tmp_path):
    folder, full = baseline
    assert full.sampled_problems == 6 and full.sampler_requests == 6  # text mode: one request per problem
    text = full.path.read_text().splitlines(keepends=True)
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(text[:4]) + text[4][: len(text[4]) // 2])  # header, 3 problems, a torn line
    cfg = tiny_config(folder, "unused.jsonl", output=str(partial))

    resumed = evaluate(cfg, tiny)
    assert resumed.resumed_problems == 3 and resumed.sampled_problems == 3 and resumed.sampler_requests == 3
    assert resumed.summary == full.summary
    rows = {r["problem_id"]: comparable(r) for r in lines(partial) if r["type"] == "problem"}
    assert rows == {r["problem_id"]: comparable(r) for r in lines(full.path) if r["type"] == "problem"}

    again = evaluate(cfg, tiny)
    assert again.sampled_problems == 0 and again.sampler_requests == 0 and again.summary == full.summary
    assert [r["type"] for r in lines(partial)].count("summary") == 1


def test_new_files_seed_by_position_and_old_files_resume_under_their_context_seeds(tiny, baseline, tmp_path):
    folder, full = baseline
    assert full.header.seeding == "position" and lines(full.path)[0]["seeding"] == "position"
    old = dict(lines(full.path)[0])
    del old["seeding"]  # a header as files written before the scheme was recorded have it
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(old) + "\n")
    cfg = tiny_config(folder, "unused.jsonl", output=str(path))
    context = evaluate(cfg, tiny)
    assert context.header.seeding is None and context.sampled_problems == 6
    rows = {r["problem_id"]: comparable(r) for r in lines(path) if r["type"] == "problem"}
    assert rows != {r["problem_id"]: comparable(r) for r in lines(full.path) if r["type"] == "problem"}

    text = path.read_text().splitlines(keepends=True)
    path.write_text("".join(text[:4]))  # the header and 3 problems: killed, then re-run
    resumed = evaluate(cfg, tiny)
    assert resumed.resumed_problems == 3 and resumed.summary == context.summary
    assert {r["problem_id"]: comparable(r) for r in lines(path) if r["type"] == "problem"} == rows


CLI = """
import asyncio, sys
from retool import evaluate
from retool.cli import main
# A slower sampler (0.5 s per request) so the test can kill the eval between problems.
fast = evaluate.ProblemSampler.sample
async def slow(self, *args):
    await asyncio.sleep(0.5)
    return await fast(self, *args)
evaluate.ProblemSampler.sample = slow
sys.exit(main(sys.argv[1:]))
"""


def cli_args(cfg: EvalConfig) -> list[str]:
    return ["eval", "--model", cfg.model, "--chat-template", "hermes", "--dataset", cfg.dataset, "--mode", "text",
            "--val-n", str(cfg.val_n), "--max-turn-tokens", str(cfg.max_turn_tokens), "--top-p", str(cfg.top_p),
            "--max-trajectory-tokens", str(cfg.max_trajectory_tokens), "--concurrency", "1", "--output", cfg.output]


def test_sigkill_mid_run_then_rerun_gives_the_identical_summary(tiny, baseline, tmp_path):
    folder, full = baseline
    cfg = tiny_config(folder, "unused.jsonl", output=str(tmp_path / "killed.jsonl"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CLI, *cli_args(cfg)], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out = Path(cfg.output)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b'"type": "problem"') >= 2:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    kinds = [json.loads(line)["type"] for line in out.read_bytes().split(b"\n")[:-1]]
    assert "summary" not in kinds and 2 <= kinds.count("problem") < 6

    done_before = kinds.count("problem")
    resumed = evaluate(cfg, tiny)
    assert resumed.resumed_problems == done_before
    assert resumed.sampled_problems == resumed.sampler_requests == 6 - done_before
    assert resumed.summary == full.summary
    ids = [r["problem_id"] for r in lines(out) if r["type"] == "problem"]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 6


def test_checkpoint_eval_loads_the_adapter_and_the_runs_template(tiny, baseline, tmp_path):
    import torch

    from retool.config import save_config
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.runs import TrainerState, save_checkpoint
    from retool.train import TrainConfig

    run = tmp_path / "run"
    run.mkdir()
    train_cfg = make_config(TrainConfig, model=str(tiny_model_dir()), chat_template="hermes", lora_rank=4,
                            run_dir=str(run))
    save_config(train_cfg, run / "config.json")
    engine = LocalTrainingClient(LocalEngineConfig(model=str(tiny_model_dir()), lora_rank=4, lora_alpha=4.0))
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 2.0)
    save_checkpoint(run, engine, TrainerState(5, 5 * train_cfg.batch_size, {}))

    found = resolve_checkpoint(run)
    checkpoint, engine_dir, step = found.folder, found.engine_dir, found.step
    assert (checkpoint.name, engine_dir.name, step) == ("step_000005", "engine", 5)
    cfg = tiny_config(baseline[0], "unused.jsonl", chat_template=None, model=None, checkpoint=str(run), limit=1,
                      output=str(tmp_path / "ckpt.jsonl"))
    choice = choose_model(cfg)
    assert (choice.model, choice.chat_template, choice.label) == (str(tiny_model_dir()), "hermes", "step 5")
    report = evaluate(cfg, load_eval_model(cfg, choice))
    header = lines(report.path)[0]
    assert (header["step"], header["label"], header["checkpoint"]) == (5, "step 5", str(checkpoint))
    trained = [r["samples"] for r in lines(report.path) if r["type"] == "problem"]
    base = {r["problem_id"]: r["samples"] for r in lines(baseline[1].path) if r["type"] == "problem"}
    # Same seeds, other weights: the sampler's logprobs show the adapter was in use.
    assert all(s["logprobs_T"] != base[s["problem_id"]][i]["logprobs_T"] for row in trained for i, s in enumerate(row))


def test_cli_reports_a_missing_checkpoint_clearly(tmp_path, capsys):
    from retool.cli import main

    assert main(["eval", "--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_nothing_is_written_when_the_template_cannot_be_used(tmp_path):
    from retool.protocol import TemplateError

    cfg, model = scripted_eval(tmp_path)
    broken = EvalModel(model.tokenizer, model.sampler,
                       ModelChoice(model="Qwen/Qwen2.5-7B-Instruct", chat_template="{{ raise_exception('no tools') }}"))
    with pytest.raises(TemplateError):
        evaluate(cfg, broken)
    assert not Path(cfg.output).exists()
