"""The reference-run rehearsal's harness (``bench/scale.py``), at a small size.

The real ``tinker`` SDK talks to the latency-model service over sockets; the scripted
policy's trajectories are token-exact under the real Qwen3.5 template; the metrics the
bench reads exist; the latency model's sharing and prefix cache behave as documented.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import threading
import time

import pytest

from bench import scale
from bench.scale_policy import ScriptedPolicy, make_problems, solve, tool_call
from bench.tinker_latency import LatencyModel, PrefixCache, ThroughputBudget
from tests.tokenizers import qwen35_tokenizer

pytestmark = pytest.mark.timeout(300)

BENCH_KEYS = ("time/step", "time/rollout", "sandbox/calls", "sandbox/latency_p50", "sandbox/latency_p95",
              "sandbox/queue_wait_p95", "sandbox/run_p95", "sandbox/count_timeout", "reward/correct",
              "rollout/trajectory_tokens", "rollout/code_calls", "rollout/turns", "time/grade", "time/grade_max")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """3 steps x 2 problems x 4 trajectories at the reference run's token budgets."""
    work = tmp_path_factory.mktemp("scale")
    args, model = scale.parse_args(["--steps", "3", "--batch-size", "2", "--group-size", "4", "--problems", "12",
                                    "--sandbox-timeout-s", "3", "--time-scale", "4"])
    tokenizer_dir = scale.qwen35_tokenizer_folder(work / "tokenizer")
    data = scale.write_problems(work / "train.jsonl", args.problems)
    outcome = scale.rehearse(args, model, work / "run", tokenizer_dir, data, kill=False)
    return work / "run" / "run", outcome, args, model


def test_the_real_sdk_trains_three_steps_against_the_latency_service(rehearsal):
    _, outcome, args, model = rehearsal
    assert outcome.returncodes == [0]
    assert [r["step"] for r in outcome.rows] == [1, 2, 3]
    endpoints = {c.endpoint for c in outcome.calls}
    assert endpoints == {"asample", "forward_backward", "optim_step"}
    assert sorted({c.step for c in outcome.calls if c.endpoint == "optim_step"}) == [0, 1, 2]
    assert outcome.tokens["sampled"] > 0 and outcome.tokens["trained"] > 0
    assert outcome.tokens["prefill_new"] < outcome.tokens["prefill"]  # the group's shared prompt is cached
    assert len(outcome.marks) == 4  # the first request, then one mark per optim_step


def test_the_streamed_mode_trains_each_group_in_its_own_call_and_compares_in_one_run(rehearsal, capsys):
    run, outcome, args, model = rehearsal
    streamed = scale.rehearse(args, model, run.parents[1] / "streamed", run.parents[1] / "tokenizer",
                              run.parents[1] / "train.jsonl", kill=False, stream=True)
    assert streamed.returncodes == [0]
    assert [r["step"] for r in streamed.rows] == [1, 2, 3]
    for row in streamed.rows:
        calls = [c for c in streamed.calls if c.endpoint == "forward_backward" and c.step == row["step"] - 1]
        assert len(calls) == row.get("train/stream_calls", 0) <= args.batch_size
        assert ("train/stream_scale" in row) == bool(calls)
    assert sorted({c.step for c in streamed.calls if c.endpoint == "optim_step"}) == [0, 1, 2]
    sync_totals, streamed_totals = (scale.report(o, model, per_step=False) for o in (outcome, streamed))
    ratio = scale.print_stream_comparison(sync_totals, streamed_totals, outcome.rows, streamed.rows, model,
                                          args.batch_size)
    assert ratio == pytest.approx(sync_totals["step_s"] / streamed_totals["step_s"])
    assert "steps/hour: synchronous" in capsys.readouterr().out


def test_the_metrics_the_bench_reads_exist_and_its_totals_are_sane(rehearsal):
    _, outcome, _, model = rehearsal
    for key in BENCH_KEYS:
        assert all(key in row for row in outcome.rows), key
    totals = scale.report(outcome, model, per_step=False)
    assert totals["steps"] == 3
    assert 0 < totals["service_s"] < totals["wall_s"]
    assert 0 < totals["client_share"] < 1
    assert 0 <= totals["between_samples_s_per_step"] <= totals["client_s_per_step"]
    assert totals["client_share_apart_from_code_calls"] == pytest.approx(
        totals["client_share"] - totals["between_samples_s_per_step"] * totals["steps"] / totals["wall_s"])
    assert totals["sandbox_calls"] > 0
    assert 0 < totals["grade_max_s"] <= totals["grade_s_per_step"] and totals["grade_s"] > 0
    assert len(outcome.samples) == 3 and all(s.fds > 0 and s.procs >= 1 for s in outcome.samples)
    # the client's own measure (an SDK request in flight) of the same steps: the SDK's own work
    # counts as in flight there, so the client's share can only come out lower, not higher
    assert totals["measured_on"] == "service" and totals["client_side_steps"] == 3
    assert 0 < totals["client_side_share"] <= totals["client_share"] + 0.01


def test_trajectories_are_token_exact_under_the_qwen35_template(rehearsal):
    from retool.protocol import TOOL_NAME, build_messages
    from retool.render import Renderer

    run, outcome, _, _ = rehearsal
    renderer = Renderer(qwen35_tokenizer())
    questions = {json.loads(line)["id"]: json.loads(line)["question"]
                 for line in (run.parent.parent / "train.jsonl").read_text().splitlines()}
    checked = 0
    for step in (1, 2, 3):
        for line in gzip.open(run / "trajectories" / f"step_{step:06d}.jsonl.gz"):
            trajectory = json.loads(line)["trajectory"]
            messages = _messages(build_messages(questions[trajectory["problem_id"]]), trajectory["turns"], TOOL_NAME)
            if messages is None:
                continue
            full = renderer.encode(renderer.render(messages, add_generation_prompt=False))
            assert full == trajectory["tokens_T"], trajectory["problem_id"]
            checked += 1
    assert checked >= 6


def _messages(messages: list[dict], turns: list[dict], tool: str) -> list[dict] | None:
    """The OpenAI-format conversation of a finished trajectory whose calls were all valid
    (``None`` for one cut short or with a malformed call: those have no such form)."""
    for turn in turns:
        if turn["stop_reason"] != "stop":
            return None
        exchange = turn["exchange"]
        if exchange is None:
            messages.append({"role": "assistant", "content": turn["text"]})
            continue
        if exchange["call"]["kind"] != "valid":
            return None
        prose = turn["text"].split("<tool_call>", 1)[0].strip()
        call = {"type": "function", "function": {"name": tool, "arguments": {"code": exchange["call"]["code"]}}}
        messages += [{"role": "assistant", "content": prose, "tool_calls": [call]},
                     {"role": "tool", "name": tool, "content": exchange["response"]}]
    return messages


def test_the_policy_has_the_reference_runs_shape_and_real_answers():
    from retool.reward import grade

    policy = ScriptedPolicy(qwen35_tokenizer())
    for problem in make_problems(6):
        assert solve(problem.question) == problem.answer
        context = f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n"
        texts = [policy.text(context, seed) for seed in range(40)]
        answers = [t for t in texts if "\\boxed{" in t]
        correct = [grade(t, str(problem.answer)).correct for t in answers]
        assert any(correct) and not all(correct)
        assert any(tool_call("", False)[:40] in t for t in texts)  # some first turns call the tool
    tokens, logprobs, reason = policy.sample(policy.tokenizer.encode(context), 7, 16, [248046])
    assert len(tokens) == len(logprobs) == 16 and reason == "length"


def test_the_timeout_rate_turns_calls_into_timeouts_and_changes_nothing_else():
    """``--timeout-rate``: the reference run's 2-3 % of calls at the timeout, not the
    default 0.4 %; the same plans, turns and answers, only snippets become endless loops."""
    tokenizer = qwen35_tokenizer()
    default, reference = ScriptedPolicy(tokenizer), ScriptedPolicy(tokenizer, timeout_rate=0.025)
    loop = "while True:"
    contexts = [f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n" for p in make_problems(9)]
    pairs = [(default.text(c, seed), reference.text(c, seed)) for c in contexts for seed in range(200)]
    calls = [pair for pair in pairs if "<tool_call>" in pair[0]]
    loops = [sum(loop in text for text in side) for side in zip(*calls)]
    assert loops[0] < loops[1] and 0.01 < loops[1] / len(calls) < 0.05
    for before, after in pairs:  # a call that did not become a loop is the same text
        assert before == after or (loop in after and loop not in before)
        assert before.split("<tool_call>")[0] == after.split("<tool_call>")[0]
    with pytest.raises(ValueError, match="timeout_rate"):
        ScriptedPolicy(tokenizer, timeout_rate=0.95)


def test_requests_in_flight_share_the_throughput_budget():
    budget = ThroughputBudget()
    try:
        start = time.monotonic()
        budget.run(0.2, 0.0)
        alone = time.monotonic() - start
        threads = [threading.Thread(target=budget.run, args=(0.2, 0.0)) for _ in range(3)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shared = time.monotonic() - start
        start = time.monotonic()
        budget.run(0.01, 0.3)  # little work, but no faster than its floor
        floored = time.monotonic() - start
    finally:
        budget.close()
    assert 0.18 < alone < 0.5
    assert 0.55 < shared < 1.2  # three jobs share one server: ~3x as long
    assert 0.28 < floored < 0.6


def test_the_prefix_cache_prices_a_repeated_prompt_once():
    cache = PrefixCache(capacity_tokens=10_000)
    prompt = list(range(300))
    assert cache.lookup_and_add("sampler-a", prompt) == 0
    assert cache.lookup_and_add("sampler-a", prompt + [1, 2, 3]) == 256  # whole 64-token blocks
    assert cache.lookup_and_add("sampler-b", prompt) == 0  # new weights, new cache


def test_every_latency_model_rate_is_a_flag():
    args, model = scale.parse_args(["--steps", "3", "--decode-rate", "1000", "--time-scale", "10"])
    assert model == LatencyModel(decode_rate=1000.0, time_scale=10.0)
    assert isinstance(args, argparse.Namespace) and args.kill is False


@pytest.mark.parametrize("ahead", [0, 2], ids=["synchronous", "sampling-2-ahead"])
def test_a_sigkill_and_resume_ask_the_service_what_an_uninterrupted_run_asks(tmp_path, ahead):
    """Synchronous: the redone steps ask exactly what they asked before the kill. Sampling
    2 ahead (its checkpoint listed only once the groups ahead of it are stored): the redone
    steps train the same datums, and the samples of both runs together are the
    uninterrupted run's; the probe: a sample the uninterrupted run did not ask is seen."""
    args, model = scale.parse_args(["--steps", "4", "--save-every", "2", "--kill-after", "2", "--batch-size", "2",
                                    "--group-size", "4", "--problems", "12", "--sandbox-timeout-s", "3",
                                    "--time-scale", "4", *([f"--train-arg=--max-staleness={ahead}"] if ahead else [])])
    assert args.kill
    tokenizer_dir = scale.qwen35_tokenizer_folder(tmp_path / "tokenizer")
    data = scale.write_problems(tmp_path / "train.jsonl", args.problems)
    killed = scale.rehearse(args, model, tmp_path / "killed", tokenizer_dir, data, kill=True)
    assert killed.returncodes[0] < 0 and killed.returncodes[1] == 0  # SIGKILLed, then finished
    assert killed.resumed_samples and all(s.procs > 1 for s in killed.resumed_samples)  # its own steps only
    assert sorted({int(r["step"]) for r in killed.rows}) == [1, 2, 3, 4]
    assert killed.redone[0], killed.redone[1]  # step 3 (and more, ahead), done before the kill and again after it
    assert killed.order[0], killed.order[1]  # the same, read from the trajectories files
    assert "0 vs 0 calls" not in killed.redone[1]
    assert scale.samples_ahead(tmp_path / "killed" / "run") == bool(ahead)
    if not ahead:
        assert killed.killed_after == 3 and killed.resumed_from == 2  # the step-2 checkpoint: steps 3, 4 asked again
        assert killed.order == (True, "steps 3-3 redone")
    else:  # the step-2 checkpoint, if listed by the kill (once steps 3-4's groups were stored), else none
        assert killed.killed_after == 3 and killed.resumed_from in (0, 2)
    uninterrupted = scale.rehearse(args, model, tmp_path / "uninterrupted", tokenizer_dir, data, kill=False)
    same, detail = scale.same_calls(uninterrupted.calls, killed.calls, ahead=bool(ahead))
    assert same, detail
    if ahead:
        extra = dataclasses.replace(next(c for c in killed.calls if c.endpoint == "asample"), digest="0" * 24)
        assert not scale.same_calls(uninterrupted.calls, [*killed.calls, extra], ahead=True)[0]


def test_a_tokenizer_setting_must_be_a_folder(tmp_path):
    from retool.config import ConfigError
    from retool.engines import ServiceSettings
    from retool.engines.tinker import load_tokenizer

    with pytest.raises(ConfigError, match="tokenizer must be a folder"):
        ServiceSettings(tokenizer=str(tmp_path / "missing")).validate()
    folder = scale.qwen35_tokenizer_folder(tmp_path / "qwen3.5")
    ServiceSettings(tokenizer=str(folder)).validate()
    tokenizer = load_tokenizer("Qwen/Qwen3.5-4B", str(folder))  # offline: nothing asked of the hub
    assert tokenizer.chat_template == qwen35_tokenizer().chat_template
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [248046]


@pytest.mark.parametrize("flags, message", [(["--time-scale", "0"], "time_scale must be > 0"),
                                            (["--decode-rate", "-5"], "decode_rate must be > 0"),
                                            (["--steps", "0"], "must be >= 1"),
                                            (["--steps", "50", "--kill"], "--kill needs --steps > 101"),
                                            (["--steps", "200", "--stream-groups"], "add --no-kill"),
                                            (["--max-staleness", "-1"], "must be >= 0"),
                                            (["--engine", "vllm", "--steps", "4", "--max-staleness", "1", "2"],
                                             "compares one --max-staleness K"),
                                            (["--engine", "vllm", "--steps", "3", "--max-staleness", "2"],
                                             "--steps >= K + 2"),
                                            (["--timeout-rate", "0.9"], "--timeout-rate must be in [0, 0.5]"),
                                            (["--timeout-rate", "-0.1"], "--timeout-rate must be in [0, 0.5]"),
                                            (["--engine", "vllm", "--steps", "4", "--max-staleness", "1",
                                              "--timeout-rate", "0.02"], "--timeout-rate")])
def test_bad_bench_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        scale.parse_args(flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_vllm_comparison_counts_neither_the_first_step_nor_the_last_k():
    """Step 1 of a run sampling K ahead also starts step 2's rollout, and its last K steps only
    train: the steps/hour of both modes come from steps 2 .. N - K, the same ones."""
    lagged = [{"step": 1, "time/step": 25.0}, {"step": 2, "time/step": 17.0}, {"step": 3, "time/step": 16.0},
              {"step": 4, "time/step": 4.0}]
    assert [r["step"] for r in scale.steady_rows(lagged, 1)] == [2, 3]
    assert [r["step"] for r in scale.steady_rows(lagged, 2)] == [2]
    assert [r["step"] for r in scale.steady_rows(lagged, 0)] == [2, 3, 4]
    assert scale.steady_rows([], 1) == []


def test_several_lags_are_compared_in_one_run():
    args, _ = scale.parse_args(["--steps", "20", "--no-kill", "--max-staleness", "2", "1", "0", "2"])
    assert args.lags == [1, 2] and args.max_staleness == 1
    args, _ = scale.parse_args(["--steps", "20", "--no-kill"])
    assert args.lags == [] and args.max_staleness == 0


def test_the_sandbox_wait_bench_splits_queueing_from_the_hand_over():
    from bench import scale_sandbox

    code = scale_sandbox.burst_snippets(8, seed=0)
    assert len(code) == 8 and not any("while True" in c for c in code)  # no call only measures the timeout
    bursts = [code[:4], code[4:]]
    alone = scale_sandbox.measure("alone", 2, bursts[:1], 10.0, one_at_a_time=True)
    queued = scale_sandbox.measure("2 workers", 2, bursts, 10.0)
    assert (alone.calls, queued.calls) == (4, 8)
    for figures in (alone, queued):
        assert 0 <= figures.wait_p50 <= figures.wait_p95 and 0 < figures.run_p50 <= figures.run_p95
        assert figures.calls_per_s > 0
    with pytest.raises(SystemExit):
        scale_sandbox.main(["--workers", "0"])


@pytest.mark.parametrize("demote", [False, True])
def test_the_sandbox_wait_bench_runs_spinning_calls_beside_the_bursts(demote, capsys):
    from bench import scale_sandbox

    code = scale_sandbox.burst_snippets(4, seed=1)
    started = time.monotonic()
    figures = scale_sandbox.measure("spinning", 3, [code[:2], code[2:]], 10.0, loops=1, loop_timeout_s=1.0,
                                    demote=demote)
    assert figures.calls == 4 and 0 < figures.run_p50 <= figures.run_p95
    assert time.monotonic() - started >= 2 * 1.0  # each burst waited for its spinning call's timeout
    with pytest.raises(SystemExit):
        scale_sandbox.main(["--workers", "2", "--loops", "2"])
    assert "must each be > --loops" in capsys.readouterr().err


SECRET = "tml-planted-secret-key-0123456789abcdef"


def test_the_real_service_mode_measures_from_the_client_and_keeps_to_the_budget(tmp_path, monkeypatch, capsys):
    """``--service tinker`` against a service the bench did not start (here a latency-model
    server stands in for the paid one: the bench is given only its URL and finds the key in
    the environment): the client-side split, the tokens from the run's own metrics, the
    price table's cost, and ``--max-cost`` ending the run cleanly; the key in no output."""
    from bench.tinker_latency import LatencyTinkerServer

    prices = tmp_path / "prices.toml"
    prices.write_text('[tinker]\nunits = "tinker_billing"\nprefill = 1.0\nprefill_cached = 0.5\nsample = 2.0\n'
                      "train = 3.0\ncheckpoint = 0.0\n")
    monkeypatch.setenv("TINKER_API_KEY", SECRET)
    work = tmp_path / "work"
    with LatencyTinkerServer(tmp_path / "service", qwen35_tokenizer(), LatencyModel(time_scale=4)) as server:
        flags = ["--service", "tinker", "--base-url", server.url, "--steps", "3", "--batch-size", "2",
                 "--group-size", "4", "--problems", "12", "--sandbox-timeout-s", "3", "--price-table", str(prices),
                 "--work-dir", str(work), "--json", str(tmp_path / "totals.json"),
                 "--train-arg=--weight-sync-check-every=0"]  # the stand-in has no weights to check
        code = scale.main(flags + ["--max-cost", "1e-6"])  # less than one step: it ends after step 1
        assert code == 0
        out = capsys.readouterr().out
        assert "the run stopped after 1 of 3 steps" in out
        assert len(server.calls) > 0  # the service the bench was pointed at did the work
    totals = json.loads((tmp_path / "totals.json").read_text())
    assert totals["steps"] == 1 and totals["measured_on"] == "client"
    assert 0 < totals["service_s"] < totals["wall_s"] and 0 < totals["client_share"] < 1
    assert totals["tokens_sampled"] > 0 and totals["tokens_trained"] > 0 and 0 < totals["cost_total"]
    assert "measured by the client" in out and "cost:" in out and "between two samples" not in out
    leaked = [p for p in work.rglob("*") if p.is_file() and not p.name.endswith(".gz")
              and SECRET.encode() in p.read_bytes()]
    assert SECRET not in out and not leaked


@pytest.mark.parametrize("env, flags, message", [
    (None, ["--service", "tinker"], "needs your API key in TINKER_API_KEY"),
    (None, ["--service", "pytrio"], "needs your API key in PYTRIO_API_KEY"),
    ("TINKER_API_KEY", ["--service", "tinker"], "needs --max-cost USD and --price-table FILE"),
    ("TINKER_API_KEY", ["--service", "tinker", "--max-cost", "5", "--price-table", "missing.toml"], "no such file"),
    ("TINKER_API_KEY", ["--service", "tinker", "--max-cost", "5", "--price-table", "PRICES", "--max-staleness", "1"],
     "runs one run"),
    ("TINKER_API_KEY", ["--service", "tinker", "--max-cost", "5", "--price-table", "PRICES", "--decode-rate", "9"],
     "latency-model flags do not apply (decode_rate)"),
    (None, ["--max-cost", "5"], "are for --service tinker/pytrio")])
def test_the_real_service_mode_refuses_what_it_cannot_do_in_one_line(env, flags, message, monkeypatch, capsys):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("PYTRIO_API_KEY", raising=False)
    if env:
        monkeypatch.setenv(env, SECRET)
    prices = str(scale.ROOT / "configs" / "prices" / "example.toml")
    with pytest.raises(SystemExit) as exit_:
        scale.parse_args(["--steps", "3"] + [prices if f == "PRICES" else f for f in flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and SECRET not in err
