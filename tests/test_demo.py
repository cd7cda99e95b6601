"""``retool demo`` end to end on the small-vocab tiny model (the real demo uses SmolLM2)."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest

from retool.cli import main as cli_main
from retool.config import ConfigError, make_config
from retool.demo import STAGES, DemoConfig, check_identity, gain_sentence
from retool.protocol import system_prompt
from retool.report import read_eval_results
from retool.report.compare import Comparison, MetricComparison, compare
from tests.tiny import small_vocab_model_dir

pytestmark = pytest.mark.timeout(900)  # the demo test runs every stage: SFT, RL and three evals

TINY_ARGS = ["--quick", "--sft-dialogues", "16", "--sft-steps", "2", "--rl-problems", "8", "--rl-steps", "2",
             "--eval-problems", "2", "--eval-samples", "2", "--base-eval-problems", "1", "--max-turn-tokens", "16",
             "--max-trajectory-tokens", "900"]


def test_demo_runs_every_stage_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--model", str(small_vocab_model_dir()), "--output-dir", str(out), *TINY_ARGS]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert all(stage in printed for stage in STAGES) and str(out) in printed
    assert "RL vs SFT on the same 2 held-out problems" in printed and "too small to show learning" in printed
    summaries = json.loads((out / "summary.json").read_text())
    gain = summaries.pop("rl_vs_sft")
    peak_pss = summaries.pop("peak_pss_mb")
    assert summaries.pop("peak_rss_mb") >= peak_pss > 100  # the process tree's peak memory
    assert "peak memory: " in printed and "GiB (PSS" in printed
    by_stage = summaries.pop("peak_pss_mb_by_stage")  # which stage set the peak
    assert list(by_stage) == ["eval before SFT", "SFT", "eval after SFT", "RL", "eval after RL"]
    assert all(100 < peak <= peak_pss for peak in by_stage.values())
    assert "PSS peak by stage: eval before SFT " in printed
    rollouts = summaries.pop("rl_rollouts")
    # each stage's wall time in this invocation, printed and in summary.json
    stage_seconds = summaries.pop("stage_seconds")
    assert list(stage_seconds) == ["data", "eval before SFT", "SFT", "eval after SFT", "RL", "eval after RL"]
    assert stage_seconds["RL"] > 0 and "stages (wall time): data " in printed and ", RL " in printed
    assert list(summaries) == list(STAGES)
    # the base model is evaluated on the first --base-eval-problems only; SFT and RL on all
    assert [s["num_problems"] for s in summaries.values()] == [1, 2, 2]
    assert all(s["k"] == 2 for s in summaries.values())
    # The paired comparison is retool compare's, on the after-SFT and after-RL eval files.
    expected = compare(out / "eval" / "after-sft.jsonl", out / "eval" / "after-rl.jsonl").metric("accuracy")
    assert gain["problems"] == 2 and gain["accuracy"]["difference"] == expected.difference
    assert gain["accuracy"]["after"] == summaries["after RL"]["average@k"]
    assert gain["significant"] is expected.significant
    for name in ("plots/checkpoints_test_retool.png", "plots/checkpoints_test_retool.svg", "plots/training.png",
                 "view.html", "summary.md", "sft/manifest.json", "rl/manifest.json", "data/sft.jsonl"):
        assert (out / name).is_file(), name
    markdown = (out / "summary.md").read_text()
    assert "| after RL |" in markdown and "| accuracy |" in markdown and "paired s.e." in markdown
    # the informative share: mixed-reward groups of all the RL stage rolled out, refills included
    rl_metrics = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rollouts["groups"] == sum(r["rollout/groups"] for r in rl_metrics) >= 2
    assert rollouts["informative_groups"] == round(sum(r["rollout/groups"] * r["rollout/informative_group_rate"]
                                                       for r in rl_metrics))
    sentence = f"{rollouts['informative_groups']} of {rollouts['groups']} groups informative"
    assert sentence in printed and sentence in markdown
    rl_config = json.loads((out / "rl" / "config.json").read_text())
    assert rl_config["curriculum"] == "difficulty"
    # every code call of the evals and of RL runs under the demo's own memory bound
    assert rl_config["sandbox_memory_mb"] == DemoConfig().sandbox_memory_mb == 256
    for stage in STAGES:
        header = read_eval_results(out / "eval" / f"{stage.replace(' ', '-').lower()}.jsonl").header
        assert header.sandbox is not None and header.sandbox.memory_mb == 256
    assert "End of RL" not in printed  # one RL step in --quick: no first and last steps to compare
    rl_rows = (out / "rl" / "metrics.jsonl").read_text().splitlines()

    # Re-running resumes every stage: nothing is trained or sampled again.
    assert cli_main(argv) == 0
    assert (out / "rl" / "metrics.jsonl").read_text().splitlines() == rl_rows
    for stage in STAGES:
        lines = (out / "eval" / f"{stage.replace(' ', '-').lower()}.jsonl").read_text().splitlines()
        assert sum(json.loads(line)["type"] == "problem" for line in lines) == (1 if stage == STAGES[0] else 2)


def test_stateful_demo_teaches_and_runs_every_stage_in_sessions(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--model", str(small_vocab_model_dir()), "--output-dir", str(out), "--interpreter", "stateful",
            *TINY_ARGS, "--max-trajectory-tokens", "1200"]  # two-call dialogues are longer
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "stateful interpreter" in printed
    # SFT dialogues of two calls, the second reusing the first's variables, with the stateful prompt
    dialogue = json.loads((out / "data" / "sft.jsonl").read_text().splitlines()[0])
    assert sum(m["role"] == "tool" for m in dialogue["messages"]) == 2
    assert dialogue["messages"][0]["content"] == system_prompt("stateful")
    assert json.loads((out / "sft" / "config.json").read_text())["interpreter"] == "stateful"
    assert json.loads((out / "rl" / "config.json").read_text())["interpreter"] == "stateful"
    for stage in STAGES:
        header = json.loads((out / "eval" / f"{stage.replace(' ', '-').lower()}.jsonl").read_text().splitlines()[0])
        assert header["sandbox"]["interpreter"] == "stateful", stage
    assert (out / "summary.md").read_text().startswith("Interpreter: stateful")


def test_a_rerun_with_another_seed_or_interpreter_is_refused(tmp_path, capsys):
    out = tmp_path / "demo"
    check_identity(DemoConfig(seed=7), out.mkdir() or out)
    check_identity(DemoConfig(seed=7, rl_steps=20), out)  # sizes may change: the stages resume or extend
    assert cli_main(["demo", "--output-dir", str(out), "--seed", "8", "--interpreter", "stateful"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed 7 → 8" in err and "--interpreter 'stateless' → 'stateful'" in err
    assert "use another --output-dir" in err
    with pytest.raises(ConfigError, match="--rl-difficulty '' → 'product=1'"):
        check_identity(DemoConfig(seed=7, rl_difficulty="product=1"), out)  # the stored RL problems are level 0
    with pytest.raises(ConfigError, match="--rl-max-staleness 0 → 1"):
        check_identity(DemoConfig(seed=7, rl_max_staleness=1), out)  # the stored RL stage sampled, then trained
    with pytest.raises(ConfigError, match="--sft-recovery-share 0.0 → 0.1"):
        check_identity(DemoConfig(seed=7, sft_recovery_share=0.1), out)  # the stored SFT dialogues have none
    (out / "demo.json").write_text("{")
    with pytest.raises(ConfigError, match="unreadable"):
        check_identity(DemoConfig(seed=7), out)


def test_sft_dialogues_over_the_trajectory_budget_are_one_error_line(tmp_path, capsys):
    argv = ["demo", "--model", str(small_vocab_model_dir()), "--output-dir", str(tmp_path / "demo"), *TINY_ARGS,
            "--max-trajectory-tokens", "200"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: all 16 dialogues are longer than max_seq_tokens=200"), err[-1]


def test_a_failed_weight_sync_check_is_one_error_line(tmp_path, capsys, monkeypatch):
    from retool import demo
    from retool.weight_sync import WeightSyncError

    def sampler_on_other_weights(cfg):
        raise WeightSyncError("weight-sync check failed on engine local at step 1: the sampler is not on the "
                              "trainer's current weights")

    monkeypatch.setattr(demo, "run_demo", sampler_on_other_weights)
    assert cli_main(["demo", "--output-dir", str(tmp_path / "demo")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: weight-sync check failed on engine local at step 1: the sampler is not on the trainer's "
                   "current weights"]


def test_quick_shrinks_the_defaults():
    quick = DemoConfig(quick=True).shrunk()
    full = DemoConfig()
    assert quick.rl_steps < full.rl_steps and quick.eval_problems < full.eval_problems
    assert DemoConfig().shrunk() == full


def test_bad_sizes_are_rejected(capsys):
    assert cli_main(["demo", "--rl-group-size", "1"]) == 2
    assert "rl_group_size must be >= 2" in capsys.readouterr().err
    assert cli_main(["demo", "--rl-difficulty", "product=9"]) == 2
    assert "--rl-difficulty: difficulty: levels must be 0..2" in capsys.readouterr().err
    assert cli_main(["demo", "--rl-max-staleness", "-1"]) == 2
    assert "rl_max_staleness must be >= 0" in capsys.readouterr().err
    assert cli_main(["demo", "--sft-recovery-share", "2"]) == 2
    assert "sft_recovery_share must be in [0, 1], got 2.0" in capsys.readouterr().err
    assert cli_main(["demo", "--sft-recovery-share", "0.1", "--max-code-calls", "1"]) == 2
    assert "sft_recovery_share needs --interpreter stateless, --max-code-calls >= 2" in capsys.readouterr().err


def _gain(before: float, after: float, stderr: float | None) -> Comparison:
    return Comparison(Path("a"), Path("b"), 64, 0, 0, (MetricComparison("accuracy", before, after, stderr),))


def test_gain_sentence_gives_the_verdict():
    assert "z = +3.00 (more than 2 standard errors: RL helped" in gain_sentence(_gain(0.4, 0.7, 0.1))
    assert "within 2 standard errors: noise; after SFT at 40.0%, the most RL could gain is +60.0 points" \
        in gain_sentence(_gain(0.4, 0.5, 0.1))
    assert "the most RL could gain" not in gain_sentence(_gain(0.4, 0.7, 0.1))
    assert "RL hurt" in gain_sentence(_gain(0.7, 0.4, 0.1))
    assert "no paired standard error" in gain_sentence(_gain(0.5, 0.5, 0.0))


def test_summary_shows_the_behaviour_figures_of_every_stage_and_their_paired_differences():
    from retool.demo import summary_markdown
    from retool.results import read_results

    eval_dir = Path(__file__).parent / "fixtures" / "report" / "eval"
    summaries = {stage: read_results(eval_dir / name).summary
                 for stage, name in zip(STAGES, ("base.jsonl", "step-20.jsonl", "step-100.jsonl"))}
    summaries = {stage: dataclasses.replace(s, behaviour={"response_tokens": 40.0, "call_rate": 0.5,
                                                          "self_corrections": 0.25})
                 for stage, s in summaries.items()}
    text = summary_markdown(summaries, compare(eval_dir / "step-20.jsonl", eval_dir / "step-100.jsonl"))
    assert text.count("response 40 tokens, calls in 50%, 0.25 self-corrections per sample") == 3
    for name in ("response_tokens", "code_lines_per_call", "call_success_rate", "first_call_position"):
        assert f"| {name} |" in text


def test_the_informative_share_counts_every_rolled_out_group(tmp_path):
    from retool.demo import RolloutShare, rl_rollouts

    assert rl_rollouts(tmp_path) is None  # no RL run yet
    rows = [{"step": 1, "rollout/groups": 6.0, "rollout/informative_group_rate": 2 / 6},
            {"step": 2, "rollout/groups": 2.0, "rollout/degenerate_group_rate": 0.5}]  # a row from before the rate
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    share = rl_rollouts(tmp_path)
    assert share == RolloutShare(steps=2, groups=8, informative=3) and share.share == 3 / 8
    assert share.sentence() == "RL rollouts: 3 of 8 groups informative (38%, mixed rewards) over 2 steps"


def test_the_end_of_rl_compares_pooled_counts_of_the_first_and_last_steps(tmp_path):
    from retool.demo import EndOfRL, Rate, rl_end

    def row(step, groups, fmt, attempts, valid):
        return {"step": step, "rollout/groups": groups, "reward/format": fmt,
                "rollout/tool_call_attempts": attempts, "rollout/valid_tool_call_rate": valid}

    (tmp_path / "config.json").write_text(json.dumps({"group_size": 8}))
    rows = [row(1, 2, 12 / 16, 1.0, 1.0), row(2, 3, 1.0, 1.0, 1.0), row(3, 2, 0.5, 1.0, 0.5),
            row(4, 2, 14 / 16, 1.0, 15 / 16), row(4, 2, 13 / 16, 1.0, 14 / 16),  # step 4 resumed: its last row
            row(5, 2, 1.0, 1.5, 23 / 24)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    end = rl_end(tmp_path)
    # steps 1-2: 16 + 24 trajectories; steps 4-5: 16 + 16 (step 3 is in neither)
    assert end == EndOfRL(2, Rate(36, 40), Rate(29, 32), Rate(40, 40), Rate(37, 40))
    diff, stderr = EndOfRL.difference(end.first_valid, end.last_valid)
    assert diff == pytest.approx(-0.075) and stderr == pytest.approx((0.925 * 0.075 / 40) ** 0.5)
    assert EndOfRL.verdict(end.first_format, end.last_format) == "no lower"
    assert EndOfRL.verdict(end.first_valid, end.last_valid) == "lower, within 2 s.e. (noise)"
    assert EndOfRL.verdict(Rate(40, 40), Rate(30, 40)) == "lower by more than 2 s.e."
    assert end.sentence() == ("End of RL (first 2 steps → last 2, rollouts pooled): format 90% of 40 → 91% of 32, "
                              "+0.6 pts, s.e. 7.0: no lower; valid calls 100% of 40 → 92% of 40, -7.5 pts, s.e. 4.2: "
                              "lower, within 2 s.e. (noise)")
    assert end.to_json()["valid_tool_call_rate"]["first"] == [40, 40]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert rl_end(tmp_path) is None  # one step: nothing to compare


def test_the_rl_stage_samples_ahead_with_rl_max_staleness(tmp_path, monkeypatch):
    from retool import demo

    seen = []
    monkeypatch.setattr(demo, "train", lambda cfg, resume: seen.append(cfg) or Path(cfg.run_dir))
    for k in (0, 1):
        demo.run_rl(DemoConfig(rl_max_staleness=k), tmp_path / f"k{k}", tmp_path / "rl.jsonl", tmp_path / "sft")
    assert [cfg.max_staleness for cfg in seen] == [0, 1]


def test_the_rl_stage_penalises_malformed_calls_unless_told_not_to(tmp_path, monkeypatch, capsys):
    from retool import demo

    seen = []
    monkeypatch.setattr(demo, "train", lambda cfg, resume: seen.append(cfg) or Path(cfg.run_dir))
    for penalty in (None, 0.0):
        cfg = DemoConfig() if penalty is None else DemoConfig(rl_invalid_call_penalty=penalty)
        demo.run_rl(cfg, tmp_path / f"p{penalty}", tmp_path / "rl.jsonl", tmp_path / "sft")
    assert [c.invalid_call_penalty for c in seen] == [0.5, 0.0]
    assert [c.lr_schedule for c in seen] == ["constant", "constant"]
    demo.run_rl(DemoConfig(rl_lr_schedule="cosine"), tmp_path / "cosine", tmp_path / "rl.jsonl", tmp_path / "sft")
    assert seen[-1].lr_schedule == "cosine" and seen[-1].lr == DemoConfig().rl_lr
    assert cli_main(["demo", "--rl-invalid-call-penalty", "-1"]) == 2
    assert "rl_invalid_call_penalty must be in [0, 2], got -1.0" in capsys.readouterr().err


def test_the_demo_passes_its_sandbox_memory_bound_to_the_evals_and_rl(tmp_path, monkeypatch):
    """A runaway call the model writes (``2 ** 550 ** 782``) would hold up to retool eval's
    and train's 2 GiB per call; the demo's peak counts the sandbox, so it sets its own bound."""
    from retool import demo

    seen = []
    monkeypatch.setattr(demo, "train", lambda cfg, resume: seen.append(cfg) or Path(cfg.run_dir))
    monkeypatch.setattr(demo, "evaluate", lambda cfg: seen.append(cfg) or types.SimpleNamespace(summary=None))
    for mb in (256, 512):
        cfg = DemoConfig(sandbox_memory_mb=mb)
        demo.run_rl(cfg, tmp_path / f"rl{mb}", tmp_path / "rl.jsonl", tmp_path / "sft")
        demo.run_eval(cfg, tmp_path, tmp_path / "test.jsonl", "after SFT", None)
    assert [c.sandbox_memory_mb for c in seen] == [256, 256, 512, 512]
    with pytest.raises(ConfigError, match="sandbox_memory_mb must be >= 1"):
        make_config(DemoConfig, sandbox_memory_mb=0)
