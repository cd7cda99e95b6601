"""The demo's held-out eval with the local sampler's batches run in turn vs continuously.

Runs ``retool eval`` as the demo does (the arithmetic task's held-out problems, 2 samples
each, tool on, turns of <= 128 tokens, <= 2 code calls, the real sandbox and grader) on a
cold-start SFT adapter, alternating two sampler settings in one run:

- ``chunked`` (``--local-continuous-batching false``, the path before): a batch's rows run
  in chunks one after another (``--local-max-sample-rows``, ``--local-batch-kv-mb``), each
  chunk until its longest row ends; a request that arrives meanwhile waits for the next
  batch;
- ``continuous`` (the default): rows join the running decode loop as others finish — the
  batch's later rows and the next turns of trajectories whose code calls came back.

Every request is seeded by its place (``seeding position``), so both settings sample the
same tokens up to float rounding: the bench prints tokens/s of each, the ratio, how many
samples agree token for token, accuracy, and the load. Needs an adapter: the demo's
(``retool demo`` writes ``runs/demo/sft``) or any ``retool sft`` run folder's checkpoint.

    python bench/continuous.py --checkpoint runs/demo/sft --problems 48 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retool import tasks  # noqa: E402
from retool.config import make_config  # noqa: E402
from retool.engines.settings import LocalSettings  # noqa: E402
from retool.evaluate import EvalConfig, evaluate  # noqa: E402
from retool.serialize import to_jsonable  # noqa: E402

VARIANTS = {"chunked": False, "continuous": True}


def run_eval(checkpoint: str, data: Path, problems: int, continuous: bool, out: Path) -> tuple[float, dict]:
    """One eval; its wall time and its samples' tokens by (problem, sample)."""
    cfg = make_config(EvalConfig, dataset=str(data), mode="retool", model="bundled:smollm2", chat_template="hermes",
                      checkpoint=checkpoint, label="bench", val_n=2, max_turn_tokens=128,
                      max_trajectory_tokens=1024, max_code_calls=2, max_assistant_turns=3, seed=42,
                      sandbox_workers=4, concurrency=problems, local=LocalSettings(continuous_batching=continuous),
                      output=str(out))
    start = time.perf_counter()
    summary = evaluate(cfg).summary
    seconds = time.perf_counter() - start
    samples = {}
    for line in out.read_text().splitlines():
        row = json.loads(line)
        if row.get("type") == "problem":
            for i, sample in enumerate(row["samples"]):
                samples[(row["problem_id"], i)] = tuple(sample["tokens_T"])
    return seconds, {"samples": samples, "sampled": summary.sampled_tokens * summary.num_samples,
                     "accuracy": summary.average_at_k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="runs/demo/sft", help="an SFT run folder or checkpoint")
    parser.add_argument("--problems", type=int, default=48, help="held-out problems (x 2 samples)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each variant")
    parser.add_argument("--seed", type=int, default=42, help="seed of the held-out problems (the demo's)")
    args = parser.parse_args()
    if not Path(args.checkpoint).exists():
        raise SystemExit(f"bench/continuous.py: no adapter at {args.checkpoint} (run `retool demo` first, or pass "
                         "--checkpoint)")
    print(f"load at start {os.getloadavg()}", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "test.jsonl"
        tasks.write_jsonl(data, map(to_jsonable, tasks.make_problems(args.problems, args.seed, "test")))
        for repeat in range(args.repeats):
            for name, continuous in VARIANTS.items():
                wall, results[name] = run_eval(args.checkpoint, data, args.problems, continuous,
                                               Path(tmp) / f"{name}-{repeat}.jsonl")
                seconds[name].append(wall)
                print(f"{name}: {wall:.1f} s, load {os.getloadavg()[0]:.2f}", flush=True)
    base = min(seconds["chunked"])
    for name in VARIANTS:
        best, sampled = min(seconds[name]), results[name]["sampled"]
        print(f"{name}: {sampled / best:.1f} sampled tok/s ({sampled:.0f} tokens, best {best:.1f} s of "
              f"{', '.join(f'{s:.1f}' for s in seconds[name])}); {base / best:.2f}x chunked; "
              f"accuracy {results[name]['accuracy']:.3f}")
    a, b = results["chunked"]["samples"], results["continuous"]["samples"]
    print(f"samples with the same tokens: {sum(a[k] == b.get(k) for k in a)} of {len(a)}")
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
