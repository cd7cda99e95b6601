"""``retool verl-config`` and the verl sampler adapter, in the core environment (no verl).

The composition with verl's real config, the agent loop and the dataset checks run in
``.venv-verl`` (``tests/verl``, via ``tests/test_verl_env.py``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from retool.cli import main
from retool.engines.base import SamplingParams, TransientEngineError
from retool.integrations.verl.launch import hydra_value
from retool.integrations.verl.sampler import ServerManagerSampler, stop_reason_of
from retool.types import StopReason


def tiny_train(tmp_path: Path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text('{"id": "a", "question": "What is 1+1?", "answer": "2"}\n'
                    '{"id": "b", "question": "What is 2+3?", "answer": "5"}\n')
    return str(path)


def test_retool_imports_without_verl():
    code = ("import sys, retool.cli, retool.integrations.verl, retool.integrations.verl.launch, "
            "retool.integrations.verl.sampler; assert 'verl' not in sys.modules; print('ok')")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def test_command_writes_the_launch_folder(tmp_path, capsys):
    out = tmp_path / "launch"
    assert main(["verl-config", "--train-data", tiny_train(tmp_path), "--output-dir", str(out), "--nnodes", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["agent_loop.yaml", "reward_fn.py", "run.sh", "train.parquet",
                                                     "val.parquet"]
    train, val = pq.read_table(out / "train.parquet").to_pylist(), pq.read_table(out / "val.parquet").to_pylist()
    assert len(train) == 2 and len(val) == 30  # AIME 2025
    assert {r["agent_name"] for r in train + val} == {"retool"}
    assert train[0]["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert train[0]["extra_info"]["question"] == "What is 1+1?" and train[0]["prompt"][-1]["role"] == "user"
    script = (out / "run.sh").read_text()
    for line in ("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false",
                 "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                 "actor_rollout_ref.actor.optim.lr=4e-05", "'actor_rollout_ref.actor.optim.betas=[0.9,0.95]'",
                 "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.model.lora_rank=32",
                 "actor_rollout_ref.model.lora_alpha=32.0", "actor_rollout_ref.rollout.n=8",
                 "actor_rollout_ref.rollout.val_kwargs.n=12", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
                 "trainer.nnodes=2", '"data.train_files=${HERE}/train.parquet"'):
        assert f"    {line} \\\n" in script, line
    assert "verl launch folder" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--mode", "text"], "retool mode only"),
    (["--loss", "importance_sampling"], "PPO-clip"),
    (["--refill-rounds", "2"], "dynamic sampling"),
    (["--curriculum", "difficulty"], "difficulty curriculum has no verl equivalent"),
    (["--overlong", "soft"], "not mapped to verl"),
    (["--behaviour-is", "token-tis"], "not mapped to verl"),
    (["--advantage", "passk"], "not mapped to verl"),
    (["--kl-coef", "0.05"], "--kl-coef is not mapped to verl"),
    (["--gpus-per-node", "8", "--tensor-parallel", "3"], "divide"),
    (["--val-top-p", "0"], "val_top_p"),
    (["--temperature", "0"], "temperature must be > 0"),
    (["--interpreter", "stateful"], "stateless interpreter only"),
])
def test_settings_verl_would_run_differently_are_refused(tmp_path, capsys, flags, message):
    assert main(["verl-config", "--train-data", tiny_train(tmp_path), "--output-dir", str(tmp_path / "o"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_missing_training_data_is_one_error_line(tmp_path, capsys):
    assert main(["verl-config", "--train-data", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_hydra_values():
    assert hydra_value(True) == "true" and hydra_value(None) == "null" and hydra_value(4e-5) == "4e-05"
    assert hydra_value([0.9, 0.95]) == "[0.9,0.95]" and hydra_value(["console", "wandb"]) == "[console,wandb]"
    assert hydra_value("Qwen/Qwen3.5-4B") == "Qwen/Qwen3.5-4B" and hydra_value("true") == "'true'"
    assert hydra_value("a b,c") == "'a b,c'" and hydra_value("it's") == "'it\\'s'"


class FakeServer:
    def __init__(self, token_ids, stop_reason="completed", logprobs=True):
        self.token_ids, self.stop_reason, self.logprobs = token_ids, stop_reason, logprobs
        self.calls = []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.calls.append((request_id, list(prompt_ids), dict(sampling_params)))
        lps = [-0.5] * len(self.token_ids) if self.logprobs else None
        return SimpleNamespace(token_ids=self.token_ids, log_probs=lps, stop_reason=self.stop_reason)


def test_sampler_tells_stop_from_length():
    params = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert stop_reason_of([1, 9], params) is StopReason.STOP
    assert stop_reason_of([1, 2, 3], params) is StopReason.LENGTH
    assert stop_reason_of([1, 2, 9], params) is StopReason.STOP  # the stop token is the last allowed one
    assert stop_reason_of([1], params) is StopReason.STOP  # the engine's own end of sequence


def test_sampler_requests_and_sequences():
    server = FakeServer([5, 6, 9])
    sampler = ServerManagerSampler(server, request_id="r")
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(9,))
    result = asyncio.run(sampler.sample([1, 2], 2, params))
    assert [s.tokens for s in result.sequences] == [(5, 6, 9), (5, 6, 9)]
    assert result.sequences[0].logprobs == (-0.5, -0.5, -0.5) and result.sequences[0].stop_reason is StopReason.STOP
    assert [c[0] for c in server.calls] == ["r", "r-1"]
    assert server.calls[0][2] == {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": True,
                                  "stop_token_ids": [9]}


def test_sampler_aborted_is_transient_and_missing_logprobs_is_an_error():
    params = SamplingParams(max_tokens=8, stop_token_ids=(9,))
    with pytest.raises(TransientEngineError):
        asyncio.run(ServerManagerSampler(FakeServer([5], "aborted")).sample([1], 1, params))
    with pytest.raises(RuntimeError, match="calculate_log_probs"):
        asyncio.run(ServerManagerSampler(FakeServer([5], logprobs=False)).sample([1], 1, params))


def test_docs_list_every_verl_flag():
    from retool.config import markdown_table
    from retool.integrations.verl.launch import VerlSettings

    docs = Path(__file__).resolve().parents[1] / "docs" / "verl.md"
    assert markdown_table(VerlSettings) in docs.read_text()
