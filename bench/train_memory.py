"""Peak memory and time of the demo's RL (or SFT) training step, layout by layout.

The demo's RL step trains 16 trajectories (2 problems x 8) of ~550 tokens that share a
~380-token system prompt, with ``packing='shared-prefix'`` and ``micro_batch_tokens``
1,280 on SmolLM2-135M + LoRA r32, fp32. This script builds a batch of that shape
(random tokens; the lengths of a measured demo step), and runs one PPO
``forward_backward`` of it once per variant of the trainer's memory settings
(``logprob_chunk_tokens``, ``gradient_checkpointing``, ``micro_batch_tokens``,
``prefix_once``, ``train_precision``), each in a fresh child process. A child builds the engine, runs one warm-up call, resets its peak
RSS (``/proc/self/clear_refs``), runs the measured call and reads ``VmHWM``: the peak
is the process's at its worst moment in the call, and the delta is what the call added
to the RSS before it. It also writes the call's logprobs and gradients, which the
parent compares with the first variant's (the same function, so they agree to float
rounding). Prints one line per variant with the peak, the delta, seconds, the ratio of
both to the first variant, the call's CPU time (user + system, all threads: less
sensitive than wall time to other processes on a shared machine) and its ratio, the
largest and mean logprob differences (the mean over trained tokens is the
``train/sampler_logprob_diff`` PPO would see with an fp32 sampler, when the first variant
is fp32: the fp32 sampler matches the fp32 trainer to ~1e-4), the gradient difference
and cosine, the loss, and the load; with ``--flops`` also the
call's FLOPs (``torch.utils.flop_counter``: matmuls and attention, the work no load
changes) and their ratio.

    python bench/train_memory.py   # the demo's layout, then prefix_once with and without checkpointing
    python bench/train_memory.py --variants chunk=0,chunk=256,chunk=256+ckpt,chunk=256+ckpt+mmap=1048576
    python bench/train_memory.py --shape sft   # the demo's SFT step: 4 dialogues, cross-entropy
    python bench/train_memory.py --flops       # and each variant's FLOPs
    python bench/train_memory.py --variants chunk=256+ckpt+once,chunk=256+ckpt+once+bf16,chunk=256+ckpt+once,chunk=256+ckpt+once+bf16
                                               # fp32 / bf16 autocast, alternated (bf16+head16: the head in bf16 too)
    python bench/train_memory.py --trajectories runs/demo/rl/trajectories/step_000002.jsonl.gz \
        --variants chunk=256+ckpt+once+bf16,chunk=256+ckpt+once+bf16+tree
                                               # a real demo step, shared-prefix against prefix-tree

Random tokens share only the prompt and a group's question; real samples of one problem
also share openings of their answers, which ``prefix-tree`` packing runs once: measure
that layout on a real step (``--trajectories``, a demo's RL trajectory file; the
advantages are each group's rewards less their mean, as GRPO's).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_LENGTHS = (553, 549, 553, 553, 549, 553, 553, 549, 656, 546, 546, 546, 551, 540, 551, 546)
"""Token counts of the 16 trajectories of a measured demo RL step (step 2, seed 42)."""
SHARED = 382
"""The prompt tokens all 16 share (system prompt and tool declaration)."""
QUESTION = 40
"""Tokens a group's 8 trajectories share after that (the question)."""
SFT_LENGTHS = (549, 549, 549, 549)
"""An SFT step of the demo: 4 cold-start dialogues (2,196 tokens as in ``bench/training.py``),
the same shared prompt, each with its own question; only assistant tokens trained."""


def parse_variant(text: str) -> dict[str, int]:
    """``chunk=256+ckpt+mbt=1280`` -> engine settings (chunk = ``logprob_chunk_tokens``,
    ckpt = gradient checkpointing on, mbt = ``micro_batch_tokens``, once = ``prefix_once``
    on; mmap = glibc's ``MALLOC_MMAP_THRESHOLD_`` in bytes for the child, 0 = glibc's own
    dynamic one; tree = ``packing='prefix-tree'`` instead of ``shared-prefix``; bf16 = ``train_precision='bf16'``; head16 = with bf16, the output head in
    bf16 too, ``trainer.HEAD_IN_BF16``; keep = no trim after each micro-batch,
    ``trainer.TRIM_EVERY_MICRO_BATCH`` off: glibc keeps what a micro-batch freed; nolayertrim = no
    trim after each decoder layer's forward, ``trainer.TRIM_EVERY_LAYER`` off; fullhead =
    the output layer with a gradient at every target, a shared prompt's positions once per
    datum, ``trainer.HEAD_GRADIENT_WHERE_TRAINED`` off: the layout before it; recompute = with
    ckpt, the attention kernel run again in the backward too, ``model.SAVE_ATTENTION`` off:
    the checkpointing before it)."""
    out = {"logprob_chunk_tokens": 0, "gradient_checkpointing": 0, "micro_batch_tokens": 1280, "mmap": 0,
           "prefix_once": 0, "bf16": 0, "head16": 0, "keep": 0, "nolayertrim": 0, "fullhead": 0, "tree": 0,
           "recompute": 0}
    names = {"chunk": "logprob_chunk_tokens", "ckpt": "gradient_checkpointing", "mbt": "micro_batch_tokens",
             "mmap": "mmap", "once": "prefix_once", "bf16": "bf16", "head16": "head16", "keep": "keep",
             "nolayertrim": "nolayertrim", "fullhead": "fullhead", "tree": "tree", "recompute": "recompute"}
    for part in text.split("+"):
        key, _, value = part.partition("=")
        if key not in names:
            raise SystemExit(f"unknown variant part {part!r}: use chunk=N, ckpt, mbt=N, once, bf16, head16, keep, "
                             "nolayertrim, fullhead, tree, recompute, mmap=N joined by +")
        out[names[key]] = int(value) if value else 1
    return out


def demo_batch(vocab: int, seed: int = 0, shape: str = "rl") -> list:
    """Datums shaped like a demo step: shared prompt, a question per group (``rl``: 16
    trajectories in 2 groups of 8; ``sft``: 4 dialogues, a question each), assistant
    turns trained (weight 1) around an interpreter block (weight 0)."""
    from retool.types import Datum

    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    lengths, group = (DEMO_LENGTHS, 8) if shape == "rl" else (SFT_LENGTHS, 1)
    prompt, questions = draw(SHARED), [draw(QUESTION) for _ in range(len(lengths) // group)]
    data = []
    for i, n in enumerate(lengths):
        tokens = prompt + questions[i // group] + draw(n + 1 - SHARED - QUESTION)
        start = SHARED + QUESTION
        weights = [0.0] * start + [1.0] * (n - start)
        for j in range(start + 60, min(n, start + 90)):  # an interpreter reply: not trained
            weights[j] = 0.0
        advantage = 1.0 if i % 2 else -1.0
        data.append(Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights),
                          sampler_logprobs_N=tuple(-rng.uniform(0.1, 3.0) for _ in range(n)),
                          advantages_N=(advantage,) * n))
    return data


def real_batch(path: str) -> list:
    """The datums of a demo RL step's trajectory file (``rl/trajectories/step_*.jsonl.gz``):
    each trajectory's tokens, policy mask and sampler logprobs, its advantage its reward
    less its group's mean."""
    import gzip
    import json

    from retool import algo

    with gzip.open(path, "rt") as f:
        rows = [json.loads(line)["trajectory"] for line in f]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["problem_id"], []).append(row)
    return [algo.make_datum(row["tokens_T"], row["mask_T"], row["logprobs_T"], advantage=advantage)
            for group in groups.values()
            for row, advantage in zip(group, algo.group_advantages([r["grade"]["reward"] for r in group]))]


def child(variant: str, out_file: str, shape: str = "rl", flops: str = "") -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from retool.engines.local import LocalEngineConfig, LocalTrainingClient, model, trainer

    settings = parse_variant(variant)
    model.SAVE_ATTENTION = not settings["recompute"]
    trainer.HEAD_IN_BF16 = bool(settings["head16"])
    trainer.TRIM_EVERY_MICRO_BATCH = not settings["keep"]
    trainer.TRIM_EVERY_LAYER = not settings["nolayertrim"]
    trainer.HEAD_GRADIENT_WHERE_TRAINED = not settings["fullhead"]
    engine = LocalTrainingClient(LocalEngineConfig(
        model="bundled:smollm2", packing="prefix-tree" if settings["tree"] else "shared-prefix", device="cpu",
        dtype="float32",
        micro_batch_tokens=settings["micro_batch_tokens"], logprob_chunk_tokens=settings["logprob_chunk_tokens"],
        gradient_checkpointing=bool(settings["gradient_checkpointing"]), prefix_once=bool(settings["prefix_once"]),
        train_precision="bf16" if settings["bf16"] else "fp32"))
    data = demo_batch(engine.vocab_size, shape=shape) if shape in ("rl", "sft") else real_batch(shape)
    loss_fn = "ppo" if shape != "sft" else "cross_entropy"
    engine.forward_backward(data[:2], loss_fn)  # warm-up: first-call allocations are not the step's
    engine._discard_gradient()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start, cpu_start = time.perf_counter(), time.process_time()
    out = engine.forward_backward(data, loss_fn)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _status_kib("VmHWM")
    grads = {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    total_flops = 0
    if flops:  # the same call again, its matmul and attention FLOPs counted: a figure no load changes
        engine._discard_gradient()
        with FlopCounterMode(display=False) as counter:
            engine.forward_backward(data, loss_fn)
        total_flops = counter.get_total_flops()
    torch.save({"logprobs": out.logprobs_D, "weights": [d.weights_N for d in data], "grads": grads, "peak_kib": peak, "before_kib": before,
                "seconds": seconds, "cpu_seconds": cpu_seconds, "flops": total_flops, "micro_batches": out.metrics["train/micro_batches"],
                "loss": out.metrics["train/loss"]}, out_file)
    return 0


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def compare(base: dict, other: dict) -> tuple[float, float, float, float]:
    """Largest logprob difference, the mean one over trained tokens, the largest gradient
    difference relative to the largest gradient entry, and the cosine of the whole
    gradients (over every trained tensor; LoRA A gets none from a fresh adapter, whose B
    is zero)."""
    import torch

    pairs = [(abs(a - b), w) for x, y, ws in zip(base["logprobs"], other["logprobs"], base["weights"])
             for a, b, w in zip(x, y, ws)]
    lp = max(d for d, _ in pairs)
    trained = [d for d, w in pairs if w != 0]
    scale = max(float(g.abs().max()) for g in base["grads"].values())
    grad = max(float((base["grads"][k] - other["grads"][k]).abs().max()) for k in base["grads"])
    flat = lambda r: torch.cat([r["grads"][k].double().flatten() for k in base["grads"]])  # noqa: E731
    cosine = float(torch.nn.functional.cosine_similarity(flat(base), flat(other), dim=0))
    return lp, sum(trained) / len(trained), grad / scale, cosine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="chunk=256+ckpt,chunk=256+ckpt+once,chunk=256+once",
                   help="comma-separated; the first is the baseline (see parse_variant)")
    p.add_argument("--shape", choices=("rl", "sft"), default="rl",
                   help="rl: the demo's RL step (16 trajectories, PPO); sft: its SFT step (4 dialogues)")
    p.add_argument("--trajectories", metavar="FILE",
                   help="a demo RL step's trajectory file (rl/trajectories/step_N.jsonl.gz) to train instead of "
                        "random tokens (PPO)")
    p.add_argument("--flops", action="store_true",
                   help="also count each variant's FLOPs (torch's FlopCounterMode; one more call per variant)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    import torch

    variants = args.variants.split(",")
    for v in variants:
        parse_variant(v)
    shape = args.trajectories or args.shape
    if args.trajectories:
        if not Path(args.trajectories).is_file():
            raise SystemExit(f"error: no trajectory file {args.trajectories}")
        lengths = tuple(d.num_tokens for d in real_batch(args.trajectories))
    else:
        lengths = DEMO_LENGTHS if args.shape == "rl" else SFT_LENGTHS
    print(f"load at start {os.getloadavg()}; {shape} batch: {len(lengths)} datums, {sum(lengths)} tokens")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            path = Path(tmp) / f"{len(results)}.pt"
            mmap = parse_variant(v)["mmap"]
            env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(mmap)} if mmap else {})}
            subprocess.run([sys.executable, __file__, "--child", v, str(path), shape,
                            "flops" if args.flops else ""], check=True, env=env)
            results.append(torch.load(path, weights_only=False))
            _report(v, results[0], results[-1])
    print(f"load at end {os.getloadavg()}")
    return 0


def _report(variant: str, base: dict, r: dict) -> None:
    lp, mean_lp, grad, cosine = compare(base, r)
    mib = lambda kib: kib / 1024  # noqa: E731
    print(f"{variant:<22} peak {mib(r['peak_kib']):7.0f} MiB  (+{mib(r['peak_kib'] - r['before_kib']):5.0f} "
          f"over {mib(r['before_kib']):5.0f})  x{r['peak_kib'] / base['peak_kib']:.2f}   "
          f"{r['seconds']:6.1f} s x{r['seconds'] / base['seconds']:.2f}   "
          f"cpu {r['cpu_seconds']:6.1f} s x{r['cpu_seconds'] / base['cpu_seconds']:.2f}   {_flops(base, r)}"
          f"{r['micro_batches']:.0f} micro-batches  "
          f"|dlogprob| max {lp:.1e} trained mean {mean_lp:.1e}  max |dgrad|/max|grad| {grad:.1e} "
          f"cos {cosine:.5f}  loss {r['loss']:.4f}  load {os.getloadavg()[0]:.1f}", flush=True)


def _flops(base: dict, r: dict) -> str:
    if not r.get("flops"):
        return ""
    return f"{r['flops'] / 1e12:5.2f} TFLOP x{r['flops'] / base['flops']:.2f}   "


if __name__ == "__main__":
    sys.exit(main())
