"""``RetoolAgentLoop`` against the real verl classes, a scripted server manager and the
real sandbox and grader.

The server manager serves scripted assistant turns as token outputs (verl's real
``TokenOutput``, stop reason ``completed`` for both stop and length, as vLLM reports
them). Every field of the ``AgentLoopOutput`` is checked, and the ids must equal what
retool's own rollout produces for the same script (one renderer, one state machine).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    DictConfigWrap,
    _agent_loop_registry,
)
from verl.workers.rollout.replica import TokenOutput

from retool.engines.base import SamplingParams
from retool.integrations.verl import agent_loop as loop_module
from retool.integrations.verl.agent_loop import RetoolAgentLoop
from retool.protocol import build_messages
from retool.render import Renderer
from retool.reward import agrade
from retool.rollout import Rollout, RolloutConfig, RolloutError
from retool.types import Problem, StopReason
from tests.scripted import ScriptedSampler
from tests.tokenizers import qwen25_tokenizer, qwen35_tokenizer

PROBLEM = Problem(id="p0", question="What is 6 times 7?", answer="42", data_source="test")
TRAIN_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def hermes_call(code: str, prefix: str = "[traj 0] ") -> str:
    body = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    return f"{prefix}Let me compute.\n<tool_call>\n{body}\n</tool_call>"


def xml_call(code: str, prefix: str = "[traj 0] ") -> str:
    return (f"{prefix}Let me compute.\n<tool_call>\n<function=code_interpreter>\n<parameter=code>\n"
            f"{code}\n</parameter>\n</function>\n</tool_call>")


class ScriptedServerManager:
    """verl's ``server_manager.generate`` over :class:`tests.scripted.ScriptedSampler`."""

    def __init__(self, tokenizer, script, *, aborted: bool = False):
        self.sampler = ScriptedSampler(tokenizer, [script])
        self.aborted = aborted
        self.calls: list[dict] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        self.calls.append({"request_id": request_id, "prompt_len": len(prompt_ids), **sampling_params})
        params = SamplingParams(max_tokens=sampling_params["max_tokens"],
                                stop_token_ids=tuple(sampling_params["stop_token_ids"]))
        (seq,) = (await self.sampler.sample(prompt_ids, 1, params)).sequences
        return TokenOutput(token_ids=list(seq.tokens), log_probs=list(seq.logprobs),
                           stop_reason="aborted" if self.aborted else "completed")


@pytest.fixture(scope="module", autouse=True)
def close_shared_sandboxes():
    yield
    for sandbox in loop_module._SANDBOXES.values():
        sandbox.close()
    loop_module._SANDBOXES.clear()


def make_loop(tokenizer, server, *, response_length=4096, **settings):
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 1024,
                                                             "response_length": response_length}},
                            "data": {"apply_chat_template_kwargs": {}}})
    settings.setdefault("sandbox_timeout_s", 30.0)  # generous: a loaded CI machine
    settings.setdefault("sandbox_workers", 2)
    return RetoolAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tokenizer,
                           processor=None, dataset_cls=None, data_config=DictConfigWrap(cfg.data),
                           hf_model_type="qwen2", name="retool", **settings)


def row(problem=PROBLEM) -> dict:
    return {"raw_prompt": build_messages(problem.question), "data_source": problem.data_source,
            "reward_model": {"style": "rule", "ground_truth": problem.answer},
            "extra_info": {"id": problem.id, "question": problem.question}, "index": 0}


def run_loop(tokenizer, script, params=TRAIN_PARAMS, **settings):
    server = ScriptedServerManager(tokenizer, script)

    async def go():
        return await make_loop(tokenizer, server, **settings).run(dict(params), **row())

    return asyncio.run(go()), server


def retool_rollout(tokenizer, script, sandbox, **config):
    """retool's own rollout of the same script (the reference the loop must equal)."""
    rollout = Rollout(Renderer(tokenizer), ScriptedSampler(tokenizer, [script]), sandbox, agrade,
                      RolloutConfig(sandbox_timeout_s=30.0, **config))
    return asyncio.run(rollout.group(PROBLEM, 1))[0]


def shared_sandbox():
    (sandbox,) = loop_module._SANDBOXES.values()
    return sandbox


def check_alignment(out: AgentLoopOutput, trajectory) -> None:
    """Ids, mask and logprobs equal retool's rollout, split at the prompt."""
    p = trajectory.prompt_len
    assert out.prompt_ids == list(trajectory.tokens_T[:p])
    assert out.response_ids == list(trajectory.tokens_T[p:])
    assert out.response_mask == list(trajectory.mask_T[p:])
    assert out.response_logprobs == list(trajectory.logprobs_T[p:])
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    # Scripted logprobs are never 0: a logprob is present exactly where the mask is 1.
    assert all((lp != 0.0) == bool(m) for lp, m in zip(out.response_logprobs, out.response_mask))


def test_registered_under_retool_and_subclasses_the_real_base():
    assert issubclass(RetoolAgentLoop, AgentLoopBase)
    assert _agent_loop_registry["retool"]["_target_"] == \
        "retool.integrations.verl.agent_loop.RetoolAgentLoop"


def test_the_loop_settings_are_retools_budgets_and_the_yaml_sets_each_field():
    from dataclasses import fields

    from retool.config import ConfigError, make_config
    from retool.integrations.verl.launch import VerlConfig, agent_loop_settings
    from retool.rollout import RolloutBudgets

    budgets = {f.name: f.default for f in fields(RolloutBudgets)}
    settings = loop_module.LoopSettings()
    assert {name: getattr(settings, name) for name in budgets} == budgets
    assert set(agent_loop_settings(make_config(VerlConfig))) == {f.name for f in fields(loop_module.LoopSettings)}
    assert loop_module.LoopSettings(sandbox_strict=True).sandbox_config().strict
    with pytest.raises(ConfigError, match="max_turn_tokens must be >= 1"):
        loop_module.LoopSettings(max_turn_tokens=0)


def test_tool_call_result_and_boxed_answer():
    tok = qwen25_tokenizer()
    script = [hermes_call("print(6*7)"), "So the product is \\boxed{42}."]
    out, server = run_loop(tok, script)
    reference = retool_rollout(tok, script, shared_sandbox())

    assert isinstance(out, AgentLoopOutput)
    check_alignment(out, reference)
    assert out.prompt_ids == Renderer(tok).prompt_tokens(build_messages(PROBLEM.question))
    text = tok.decode(out.response_ids)
    assert "<tool_response>\n42\n\n</tool_response>" in text or "<tool_response>\n42\n</tool_response>" in text
    # Tool tokens are mask 0: every masked-in token decodes to the two sampled turns.
    policy = [t for t, m in zip(out.response_ids, out.response_mask) if m]
    assert tok.decode(policy) == f"{script[0]}<|im_end|>{script[1]}<|im_end|>"
    assert out.reward_score == 1.0
    assert out.num_turns == 4  # user, assistant (call), tool, assistant (answer)
    assert out.multi_modal_data is None and out.routed_experts is None
    assert isinstance(out.metrics, AgentLoopMetrics)
    assert out.metrics.tool_calls > 0 and out.metrics.compute_score > 0 and out.metrics.generate_sequences >= 0
    info = out.extra_fields["reward_extra_info"]
    assert info["reward/correct"] == 1.0 and info["reward/format"] == 1.0 and info["reward/mean"] == 1.0
    assert info["rollout/code_calls"] == 1.0 and info["rollout/turns"] == 2.0
    assert info["rollout/valid_tool_call_rate"] == 1.0 and info["rollout/invalid_calls"] == 0.0
    assert info["rollout/stop/stop"] == 1.0 and info["rollout/stop/length"] == 0.0
    assert info["sandbox/calls"] == 1.0 and info["sandbox/count_ok"] == 1.0 and info["sandbox/latency_mean"] > 0
    assert info["rollout/trajectory_tokens"] == len(out.prompt_ids) + len(out.response_ids)
    assert info["rollout/sampled_tokens"] == sum(out.response_mask)
    assert out.extra_fields["turn_scores"] == [] and out.extra_fields["tool_rewards"] == []
    assert out.extra_fields["tool_call_counts"] == 1  # verl's own tool_call_counts/* training metric
    # One sticky request id per trajectory; verl's sampling settings reach every request.
    assert len(server.calls) == 2 and len({c["request_id"] for c in server.calls}) == 1
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for call in server.calls:
        assert call["temperature"] == 1.0 and call["top_p"] == 1.0 and call["top_k"] == -1
        assert call["logprobs"] is True and im_end in call["stop_token_ids"]
    assert server.calls[0]["max_tokens"] == 1024


def test_malformed_call_gets_retools_error_message():
    tok = qwen25_tokenizer()
    script = ["[traj 0] <tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \n</tool_call>",
              "\\boxed{42}"]
    out, _ = run_loop(tok, script)
    reference = retool_rollout(tok, script, shared_sandbox())
    check_alignment(out, reference)
    assert "Invalid tool call" in tok.decode(out.response_ids)
    assert out.reward_score == 1.0 and out.num_turns == 4 and out.metrics.tool_calls == 0.0
    info = out.extra_fields["reward_extra_info"]
    assert info["rollout/invalid_calls"] == 1.0 and info["rollout/valid_tool_call_rate"] == 0.0
    assert info["rollout/code_calls"] == 0.0 and info["sandbox/calls"] == 0.0
    assert info["rollout/tool_call_attempts"] == 1.0


def test_turn_budget_cut_is_length_not_stop():
    tok = qwen25_tokenizer()
    script = ["[traj 0] " + "let me think about this " * 20 + "\\boxed{42}"]
    out, server = run_loop(tok, script, max_turn_tokens=16)
    reference = retool_rollout(tok, script, shared_sandbox(), max_turn_tokens=16)
    check_alignment(out, reference)
    assert sum(out.response_mask) == 16 and server.calls[0]["max_tokens"] == 16
    assert out.reward_score == -1.0 and out.num_turns == 2
    info = out.extra_fields["reward_extra_info"]
    assert info["rollout/stop/length"] == 1.0 and info["rollout/stop/stop"] == 0.0
    assert info["reward/format"] == 0.0


def test_code_call_budget_and_trajectory_budget():
    tok = qwen25_tokenizer()
    script = [hermes_call("print(1)"), hermes_call("print(2)", ""), "\\boxed{42}"]
    out, _ = run_loop(tok, script, max_code_calls=1)
    check_alignment(out, retool_rollout(tok, script, shared_sandbox(), max_code_calls=1))
    info = out.extra_fields["reward_extra_info"]
    assert info["rollout/code_calls"] == 1.0 and info["rollout/budget_exhausted_calls"] == 1.0
    assert "limit of 1 code executions" in tok.decode(out.response_ids)
    # verl's response_length caps the trajectory at prompt + response_length tokens: the
    # call fits, its tool message would not, so the trajectory ends on retool's "budget".
    out, server = run_loop(tok, script, response_length=40)
    assert len(out.response_ids) <= 40 and server.calls[0]["max_tokens"] == 40 and len(server.calls) == 1
    assert out.extra_fields["reward_extra_info"]["rollout/stop/budget"] == 1.0


def test_validation_sampling_reaches_the_server():
    tok = qwen25_tokenizer()
    params = {"temperature": 0.6, "top_p": 0.7, "top_k": 20, "repetition_penalty": 1.0, "logprobs": True}
    out, server = run_loop(tok, ["[traj 0] \\boxed{42}"], params=params)
    assert out.reward_score == 1.0
    (call,) = server.calls
    assert (call["temperature"], call["top_p"], call["top_k"]) == (0.6, 0.7, 20)


def test_qwen35_xml_calls_are_the_same_state_machine():
    tok = qwen35_tokenizer()
    script = [xml_call("print(6*7)"), "So \\boxed{42}."]
    out, _ = run_loop(tok, script)
    check_alignment(out, retool_rollout(tok, script, shared_sandbox()))
    assert out.reward_score == 1.0 and out.extra_fields["reward_extra_info"]["sandbox/count_ok"] == 1.0


def test_aborted_generation_is_a_transient_rollout_error():
    tok = qwen25_tokenizer()
    server = ScriptedServerManager(tok, ["[traj 0] \\boxed{42}"], aborted=True)

    async def go():
        return await make_loop(tok, server).run(dict(TRAIN_PARAMS), **row())

    with pytest.raises(RolloutError) as err:
        asyncio.run(go())
    assert err.value.transient


def test_row_without_gold_answer_is_a_data_bug():
    tok = qwen25_tokenizer()
    bad = {**row(), "reward_model": {"style": "rule"}}

    async def go():
        return await make_loop(tok, ScriptedServerManager(tok, ["x"])).run(dict(TRAIN_PARAMS), **bad)

    with pytest.raises(ValueError, match="ground_truth"):
        asyncio.run(go())


def test_built_from_the_generated_yaml_the_way_verls_worker_builds_it(tmp_path):
    import hydra
    from verl.experimental.agent_loop.agent_loop import ToolListWrap

    from retool.config import make_config
    from retool.integrations.verl.launch import VerlConfig, agent_loop_yaml

    (tmp_path / "agent_loop.yaml").write_text(agent_loop_yaml(make_config(VerlConfig, max_code_calls=3,
                                                                          sandbox_timeout_s=30.0, sandbox_workers=2)))
    (entry,) = OmegaConf.load(tmp_path / "agent_loop.yaml")
    tok = qwen25_tokenizer()
    server = ScriptedServerManager(tok, [hermes_call("print(6*7)"), "\\boxed{42}"])
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 1024, "response_length": 8192}},
                            "data": {"apply_chat_template_kwargs": {}}})

    async def go():
        loop = hydra.utils.instantiate(config=entry, trainer_config=DictConfigWrap(config=cfg), server_manager=server,
                                       tokenizer=tok, processor=None, hf_model_type="qwen2", dataset_cls=None,
                                       data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]))
        assert isinstance(loop, RetoolAgentLoop) and loop.settings.max_code_calls == 3
        return await loop.run(dict(TRAIN_PARAMS), **row())

    out = asyncio.run(go())
    assert out.reward_score == 1.0 and out.extra_fields["reward_extra_info"]["sandbox/count_ok"] == 1.0


def test_verls_worker_postprocessing_batches_the_outputs():
    """verl's own AgentLoopWorker post-processing (padding, rm_scores, non-tensor batch and
    metrics) on a batch of two loop outputs: a correct tool trajectory and a cut one."""
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    tok = qwen25_tokenizer()
    good, _ = run_loop(tok, [hermes_call("print(6*7)"), "So \\boxed{42}."])
    cut, _ = run_loop(tok, ["[traj 0] " + "let me think " * 30], max_turn_tokens=16)
    worker = object.__new__(AgentLoopWorker)  # only the post-processing state, no Ray actor
    worker.rollout_config = OmegaConf.create({"prompt_length": 1024, "response_length": 4096})
    worker.tokenizer, worker.processor, worker.mm_processor_kwargs = tok, None, {}
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False

    async def go():
        return [await worker._agent_loop_postprocess(o, False, **row()) for o in (good, cut)]

    batch = worker._postprocess(asyncio.run(go()), input_non_tensor_batch=None, validate=False)
    assert batch.batch["responses"].shape == (2, 4096) and batch.batch["prompts"].shape == (2, 1024)
    for i, out in enumerate((good, cut)):
        n = len(out.response_ids)
        assert batch.batch["responses"][i, :n].tolist() == out.response_ids
        assert batch.batch["response_mask"][i, :n].tolist() == out.response_mask
        assert batch.batch["response_mask"][i, n:].sum() == 0
        assert batch.batch["rollout_log_probs"][i, :n].tolist() == pytest.approx(out.response_logprobs)
        assert batch.batch["rm_scores"][i].sum().item() == out.reward_score  # on the last response token
        assert batch.batch["rm_scores"][i, n - 1].item() == out.reward_score
    assert batch.non_tensor_batch["__num_turns__"].tolist() == [4, 2]
    assert batch.non_tensor_batch["rollout/stop/length"].tolist() == [0.0, 1.0]
    assert batch.non_tensor_batch["sandbox/count_ok"].tolist() == [1.0, 0.0]
    assert np.array(batch.non_tensor_batch["tool_call_counts"], dtype=float).mean() == 0.5
    assert "reward/correct" in batch.meta_info["reward_extra_keys"]
