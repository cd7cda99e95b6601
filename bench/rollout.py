"""Rollout scheduling: per-trajectory asyncio tasks vs a per-round barrier.

One group of 8 trajectories, each making 3 sandbox calls then answering. One
trajectory is stuck 5 s in the sandbox in round 1; a few others sleep 1–2 s in other
rounds. A round-barrier schedule (sample every live trajectory, run every call, wait
for all, repeat — what many reproductions do) takes the *sum* of the per-round
maxima; retool's per-trajectory tasks take about the slowest trajectory's own time.

Real components: the sandbox, the renderer (bundled SmolLM2 tokenizer + Hermes
template) and the grader; the policy is the scripted sampler from the tests, with a
fixed delay per request standing in for generation.

    .venv/bin/python bench/rollout.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retool.protocol import build_messages  # noqa: E402
from retool.render import Renderer  # noqa: E402
from retool.reward import agrade  # noqa: E402
from retool.rollout import Rollout, RolloutConfig, _State  # noqa: E402
from retool.sandbox import Sandbox, SandboxConfig  # noqa: E402
from retool.types import Problem  # noqa: E402
from tests.scripted import ScriptedSampler  # noqa: E402

SLEEPS = {(0, 0): 5.0, (1, 1): 2.0, (2, 2): 2.0, (3, 1): 1.0, (4, 2): 1.0}
"""(trajectory, round) → seconds that call sleeps; every other call is instant."""
GROUP, ROUNDS, SAMPLE_DELAY_S = 8, 3, 0.05
PROBLEM = Problem(id="bench", question="What is 6 times 7?", answer="42")


def call(code: str, prefix: str = "") -> str:
    body = json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
    return f"{prefix}Let me compute.\n<tool_call>\n{body}\n</tool_call>"


def scripts() -> list[list[str]]:
    out = []
    for k in range(GROUP):
        turns = [call(f"import time\ntime.sleep({SLEEPS.get((k, r), 0)})\nprint({r})",
                      f"[traj {k}] " if r == 0 else "") for r in range(ROUNDS)]
        out.append([*turns, "\\boxed{42}"])
    return out


async def barrier_group(rollout: Rollout, problem: Problem, n: int) -> None:
    """The baseline: every round waits for all live trajectories before the next."""
    prompt = rollout.renderer.prompt_tokens(build_messages(problem.question))
    sequences = list(await rollout._sample(problem, prompt, n, rollout.config.max_turn_tokens))
    states = [_State(list(prompt), [0] * len(prompt), [0.0] * len(prompt)) for _ in range(n)]
    live = list(range(n))
    for turn in range(rollout.config.max_assistant_turns):
        last = turn == rollout.config.max_assistant_turns - 1
        going = await asyncio.gather(*(rollout._advance(states[i], sequences[i], last) for i in live))
        live = [i for i, go in zip(live, going) if go]
        if not live:
            return
        nxt = await asyncio.gather(*(rollout._sample(problem, states[i].tokens, 1, 256) for i in live))
        for i, seqs in zip(live, nxt):
            sequences[i] = seqs[0]


def main() -> None:
    from transformers import AutoTokenizer

    from retool.bundled import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    renderer = Renderer(tokenizer, chat_template="hermes")
    with Sandbox(SandboxConfig(timeout_s=30, workers=8)) as sandbox:
        def make() -> Rollout:
            sampler = ScriptedSampler(tokenizer, scripts(), delay_s=SAMPLE_DELAY_S)
            return Rollout(renderer, sampler, sandbox, agrade, RolloutConfig(max_turn_tokens=256))

        asyncio.run(make().group(PROBLEM, GROUP))  # warm the sandbox and the grader
        start = time.monotonic()
        trajectories = asyncio.run(make().group(PROBLEM, GROUP))
        ours = time.monotonic() - start
        assert all(t.num_code_calls == ROUNDS and t.grade.correct for t in trajectories)
        start = time.monotonic()
        asyncio.run(barrier_group(make(), PROBLEM, GROUP))
        barrier = time.monotonic() - start

    per_traj = [sum(SLEEPS.get((k, r), 0) for r in range(ROUNDS)) for k in range(GROUP)]
    round_max = [max(SLEEPS.get((k, r), 0) for k in range(GROUP)) for r in range(ROUNDS)]
    print(f"group of {GROUP} trajectories x {ROUNDS} sandbox calls, {SAMPLE_DELAY_S * 1000:.0f} ms per sample call")
    print(f"slowest trajectory's own sandbox time: {max(per_traj):.1f} s; "
          f"sum of per-round maxima: {sum(round_max):.1f} s")
    print(f"round-barrier schedule (baseline): {barrier:6.2f} s")
    print(f"per-trajectory tasks (retool):     {ours:6.2f} s")
    print(f"speed-up: {barrier / ours:.2f}x  (ours / slowest trajectory = {ours / max(per_traj):.2f})")


if __name__ == "__main__":
    main()
