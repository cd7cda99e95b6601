"""``retool plot``: checkpoint comparison and training curves from the report fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from retool import cli
from retool.report import ReportInputError
from retool.report import plots

FIXTURES = Path(__file__).parent / "fixtures" / "report"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(argv: list[str]) -> int:
    """``retool …`` in-process, through retool's real command line."""
    return cli.main(argv)


def _assert_images(paths: list[Path]) -> None:
    import matplotlib.image

    for path in paths:
        assert path.stat().st_size > 1000, path
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == PNG_MAGIC
            height, width, _ = matplotlib.image.imread(path).shape
            assert width > 500 and height > 300
        else:
            assert path.read_text().lstrip().startswith("<?xml") and "<svg" in path.read_text()


@pytest.fixture
def eval_dir(tmp_path) -> Path:
    folder = tmp_path / "eval"
    shutil.copytree(FIXTURES / "eval", folder)
    return folder


def test_checkpoint_figures_from_fixture_results(eval_dir, tmp_path, capsys):
    assert run_cli(["plot", "checkpoints", str(eval_dir), "--output-dir", str(tmp_path / "out")]) == 0
    printed = [Path(line) for line in capsys.readouterr().out.split()]
    names = sorted(p.name for p in printed)
    assert names == ["behaviour_aime25_retool.png", "behaviour_aime25_retool.svg",
                     "behaviour_aime25_text.png", "behaviour_aime25_text.svg",
                     "checkpoints_aime25_retool.png", "checkpoints_aime25_retool.svg",
                     "checkpoints_aime25_text.png", "checkpoints_aime25_text.svg"]
    _assert_images(printed)
    svg = (tmp_path / "out" / "checkpoints_aime25_retool.svg").read_text()
    for text in ("base", "step 20", "step 50", "step 100", "Average@4", "Pass@4", "Format"):
        assert f">{text}<" in svg, text
    svg = (tmp_path / "out" / "behaviour_aime25_retool.svg").read_text()
    for text in ("code lines per call", "first call (% of response)", "self-corrections", "step 100"):
        assert f">{text}<" in svg, text


def test_checkpoints_are_ordered_base_first_then_by_step(eval_dir):
    found, skipped = plots.discover_eval_results(eval_dir)
    retool_mode = [r for r in found if r.header.mode == "retool"]
    points = plots.order_checkpoints([plots.checkpoint_point(r) for r in retool_mode])
    assert [p.label for p in points] == ["base", "step 20", "step 50", "step 100"]  # file names sort otherwise
    summary = json.loads((eval_dir / "step-50.jsonl").read_text().splitlines()[-1])
    assert (points[2].average, points[2].pass_at_k, points[2].format) == \
        (summary["average@k"], summary["pass@k"], summary["format"])
    assert skipped == []
    assert set(points[2].behaviour) >= {"response_tokens", "call_rate", "self_corrections"}  # recomputed: old file


def test_interrupted_eval_is_summarised_from_its_problems(eval_dir):
    path = eval_dir / "step-50.jsonl"
    lines = path.read_text().splitlines()
    full = json.loads(lines[-1])
    path.write_text("\n".join(lines[:-1]) + "\n")  # no summary line: the eval was interrupted
    point = plots.checkpoint_point(plots.read_eval_results(path))
    assert point.label == "step 50 (partial: 4 problems)" and not point.complete
    assert (point.average, point.pass_at_k, point.format) == (full["average@k"], full["pass@k"], full["format"])


def test_other_files_are_skipped_and_named(eval_dir, tmp_path, capsys):
    shutil.copy(FIXTURES / "run" / "metrics.jsonl", eval_dir / "metrics.jsonl")
    header_only = {"type": "header", "step": 5, "dataset": "aime25", "mode": "retool"}
    (eval_dir / "empty.jsonl").write_text(json.dumps(header_only) + "\n")  # started, no problem done
    paths = plots.plot_checkpoints(eval_dir, tmp_path / "out", mode="retool")
    assert [p.name for p in paths] == ["checkpoints_aime25_retool.png", "checkpoints_aime25_retool.svg",
                                       "behaviour_aime25_retool.png", "behaviour_aime25_retool.svg"]
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "empty.jsonl" in err


def test_no_matching_results_is_a_clear_error(eval_dir, tmp_path, capsys):
    with pytest.raises(ReportInputError, match="no eval results found"):
        plots.plot_checkpoints(eval_dir, tmp_path, dataset="math500")
    assert run_cli(["plot", "checkpoints", str(tmp_path / "missing")]) == 1
    assert "not a folder of eval results" in capsys.readouterr().err


def test_unwritable_output_folder_is_one_line(eval_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    for kind, source in (("checkpoints", eval_dir), ("training", FIXTURES / "run")):
        assert run_cli(["plot", kind, str(source), "--output-dir", str(blocker / "plots")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot write --output-dir") and len(err.strip().splitlines()) == 1
    assert blocker.read_text() == "keep me"
    assert not (FIXTURES / "run" / "plots").exists()


def test_corrupt_eval_line_names_file_and_line(eval_dir, tmp_path):
    path = eval_dir / "step-20.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportInputError, match=r"step-20.jsonl:3: not valid JSON"):
        plots.plot_checkpoints(eval_dir, tmp_path)


# ---------------------------------------------------------------- training curves


def test_training_curves_from_fixture_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "run", run)
    assert run_cli(["plot", "training", str(run)]) == 0
    printed = [Path(line) for line in capsys.readouterr().out.split()]
    assert printed == [run / "plots" / "training.png", run / "plots" / "training.svg"]
    _assert_images(printed)
    svg = printed[1].read_text()
    for title in ("reward", "valid tool-call rate", "sandbox outcomes", "sandbox latency (s)", "tokens per step"):
        assert f">{title}<" in svg, title


def test_training_panels_skip_absent_and_bad_values(tmp_path):
    rows = [
        {"step": 1, "reward/mean": -0.5, "reward/correct": 0.2, "sandbox/latency_p95": None},
        {"step": 2, "reward/mean": "n/a", "reward/correct": float("nan")},
        {"step": 3, "reward/mean": 0.1, "reward/correct": 0.4, "rollout/code_calls": True},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = plots.metrics_by_step(path)
    assert plots.panel_series(metrics, ("reward/*",)) == {
        "reward/correct": ([1, 3], [0.2, 0.4]), "reward/mean": ([1, 3], [-0.5, 0.1])}
    assert plots.panel_series(metrics, ("sandbox/latency*", "rollout/code_calls")) == {}
    paths = plots.plot_training(path, tmp_path / "out")
    svg = paths[1].read_text()
    assert ">reward<" in svg and ">sandbox latency (s)<" not in svg


def test_a_lagged_run_plots_its_staleness_and_the_behaviour_ratio(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s, "staleness/mean": float(s > 1), "staleness/max": float(s > 1),
             "staleness/share_lag_0": float(s == 1), "staleness/share_lag_1": float(s > 1),
             "train/behaviour_ratio_mean": 1.0, "train/behaviour_ratio_max": 1.5 + s} for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    svg = plots.plot_training(path, tmp_path / "out")[1].read_text()
    for title in ("staleness (versions, --max-staleness)", "tokens by lag (share)", "behaviour IS (--behaviour-is)"):
        assert f">{title}<" in svg, title
    assert plots.panel_series(plots.metrics_by_step(path), ("staleness/share_lag_*",)) == {
        "staleness/share_lag_0": ([1, 2, 3], [1.0, 0.0, 0.0]), "staleness/share_lag_1": ([1, 2, 3], [0.0, 1.0, 1.0])}


def test_resumed_run_keeps_the_last_row_per_step_and_a_cut_last_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.0}\n{"step": 2, "reward/mean": 0.5}\n'
                    '{"step": 2, "reward/mean": 0.7}\n{"step": 3, "reward/me')
    metrics = plots.metrics_by_step(path)
    assert plots.panel_series(metrics, ("reward/mean",)) == {"reward/mean": ([1, 2], [0.0, 0.7])}
    assert "metrics.jsonl:4: dropped a cut-off last line" in capsys.readouterr().err


def test_metrics_without_step_or_known_names_fail_clearly(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"reward/mean": 0.1}\n')
    with pytest.raises(ReportInputError, match="row 1 has no integer 'step'"):
        plots.plot_training(path, tmp_path)
    path.write_text('{"step": 1, "custom/thing": 0.1}\n')
    with pytest.raises(ReportInputError, match="none of the known metrics"):
        plots.plot_training(path, tmp_path)
