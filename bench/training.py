"""Shared-prefix packing vs padded batches: one ``forward_backward`` on real SFT dialogues.

Every RL trajectory and every cold-start dialogue starts with the same few hundred
tokens (system prompt and tool declaration; a GRPO group also shares its question),
while the trained part is short. ``packing='shared-prefix'`` computes that prefix once
per micro-batch instead of once per sequence. This script builds one batch of
synthetic tool dialogues (``retool.tasks``, the demo's cold-start data, rendered with
the rollout's own token layout by ``retool.sft``) and times one forward + backward of
the bucketed baseline and of each other layout on the same engine and weights. It
prints seconds per call, trained tokens per second, the ratio against ``bucketed``
and the largest logprob difference (all layouts compute the same function).

    python bench/training.py --batch-size 4 --repeats 2

``--memory`` measures chunked logprobs instead (``logprob_chunk_tokens``): a tiny random
Qwen3 (2 layers, hidden 64) with the real Qwen3.5 tokenizer and its full vocabulary
(248,077 entries with the added tokens), one ``forward_backward`` of a PPO batch of
``--memory-tokens`` tokens with the full logits and with each chunk size, then the
peak at ``--target`` (8,192 tokens, chunks of 512) scaled from them: the full logits'
peak grows linearly with the tokens and a chunked peak with the chunk (the bench shows
both), and 8,192 x 248k fp32 logits (7.6 GiB a copy) do not fit this machine. Each layout
runs in a fresh child process, which resets its peak RSS (``/proc/self/clear_refs``)
just before the call and reads ``VmHWM`` after it: the peak RSS *delta* of the call is
what the call allocated at its worst moment (after a warm-up call on 8 tokens; glibc's ``MALLOC_MMAP_THRESHOLD_`` is set
to 64 KiB in the child, so a freed tensor leaves RSS at once instead of lingering in the
heap). With layers this small, that delta is the
logits' share (the layers' activations are under 1 % of it). No CUDA is involved.

    python bench/training.py --memory --memory-tokens 256,512 --chunks 32,16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from retool.engines.local import LocalEngineConfig, LocalTrainingClient
from retool.render import Renderer
from retool.dialogues import parse_dialogue
from retool.sft import build_sft_data
from retool.tasks import make_sft_conversations


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--chat-template", default="hermes")
    p.add_argument("--batch-size", type=int, default=4, help="dialogues in the batch")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per layout (the fastest is kept)")
    p.add_argument("--packings", default="bucketed,packed,shared-prefix")
    p.add_argument("--memory", action="store_true", help="measure chunked logprobs' peak memory instead")
    p.add_argument("--memory-tokens", default="256,512", help="token counts of the --memory batches")
    p.add_argument("--chunks", default="32,16", help="logprob_chunk_tokens values --memory compares with 0")
    p.add_argument("--target", default="8192,512", help="TOKENS,CHUNK the --memory result is scaled to")
    p.add_argument("--memory-child", nargs=3, metavar=("MODEL", "TOKENS", "CHUNK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        return memory_child(*args.memory_child)
    if args.memory:
        tokens, target = [int(t) for t in args.memory_tokens.split(",")], args.target.split(",")
        return memory_bench(tokens, [int(c) for c in args.chunks.split(",")], (int(target[0]), int(target[1])))

    engine = LocalTrainingClient(LocalEngineConfig(model=args.model, lora_rank=32, lora_alpha=32.0))
    renderer = Renderer(engine.get_tokenizer(), chat_template=args.chat_template, tools=True)
    rows = make_sft_conversations(args.batch_size, seed=7)
    data = build_sft_data([parse_dialogue(r) for r in rows], renderer)
    datums = data.datums
    tokens = sum(d.num_tokens for d in datums)
    trained = sum(d.num_trained for d in datums)
    print(f"batch: {len(datums)} dialogues, {tokens} tokens ({tokens // len(datums)} per dialogue), "
          f"{trained} trained")

    results: dict[str, tuple[float, list]] = {}
    for packing in [x.strip() for x in args.packings.split(",")]:
        engine.config = dataclasses.replace(engine.config, packing=packing)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.forward_backward(datums, "cross_entropy")
            best = min(best, time.perf_counter() - t0)
            engine._discard_gradient()
        results[packing] = (best, out.logprobs_D)
    base_s, base_lp = results.get("bucketed", next(iter(results.values())))
    for packing, (seconds, logprobs) in results.items():
        diff = max(abs(a - b) for lp_a, lp_b in zip(base_lp, logprobs) for a, b in zip(lp_a, lp_b))
        print(f"{packing:>14}: {seconds:6.2f} s per forward_backward, {trained / seconds:7.1f} trained tok/s, "
              f"{tokens / seconds:7.1f} tok/s; speed-up vs bucketed {base_s / seconds:.2f}x; "
              f"max |logprob diff| {diff:.1e}")
    return 0


# ---------------------------------------------------------------- --memory


def large_vocab_model(folder: Path) -> str:
    """A 2-layer random Qwen3 with the real Qwen3.5 tokenizer saved to ``folder``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tokenizers import qwen35_tokenizer

    tokenizer = qwen35_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def memory_bench(token_counts: list[int], chunks: list[int], target: tuple[int, int]) -> int:
    """Full vs chunked logits at each token count; then the peak at ``target`` (tokens, chunk),
    scaled from the measurements (full: linear in tokens; chunked: linear in the chunk)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = large_vocab_model(Path(tmp))
        rows = {(t, c): _child(model, t, c) for t in token_counts for c in [0, *chunks]}
    vocab = rows[token_counts[0], 0]["vocab"]
    print(f"vocabulary {vocab:,}; one PPO forward_backward (fp32, CPU, LoRA r8, 1 thread); "
          f"load average {os.getloadavg()[0]:.2f}")
    for tokens in token_counts:
        full = rows[tokens, 0]
        copies = full["peak_mib"] / (tokens * vocab * 4 / 2**20)
        for chunk in [0, *chunks]:
            row = rows[tokens, chunk]
            name = f"{tokens} tokens, " + ("full logits" if not chunk else f"chunks of {chunk}")
            diff = max(abs(a - b) for a, b in zip(full["logprobs"], row["logprobs"]))
            print(f"{name:>28}: peak RSS delta {row['peak_mib']:7.1f} MiB, {row['seconds']:5.2f} s; "
                  f"/ full logits {row['peak_mib'] / full['peak_mib']:.3f}; max |logprob diff| {diff:.1e}")
        print(f"{'':>28}  (the full-logits peak is {copies:.1f} fp32 copies of the logits)")
    tokens, chunk = token_counts[-1], chunks[0]
    full_per_token = rows[tokens, 0]["peak_mib"] / tokens
    chunked_per_token = rows[tokens, chunk]["peak_mib"] / chunk
    full_target, chunked_target = full_per_token * target[0], chunked_per_token * target[1]
    print(f"scaled to {target[0]} tokens: full logits {full_target / 1024:.1f} GiB, chunks of {target[1]} "
          f"{chunked_target / 1024:.2f} GiB: ratio {chunked_target / full_target:.3f} "
          f"(1/{full_target / chunked_target:.1f})")
    return 0


def _child(model: str, tokens: int, chunk: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16)}  # big blocks return to the OS when freed
    out = subprocess.run([sys.executable, __file__, "--memory-child", model, str(tokens), str(chunk)],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_child(model: str, tokens: str, chunk: str) -> int:
    import torch

    from retool import algo

    torch.set_num_threads(1)
    engine = LocalTrainingClient(LocalEngineConfig(model=model, lora_rank=8, micro_batch_tokens=int(tokens) + 1,
                                                   logprob_chunk_tokens=int(chunk)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.vocab_size, (int(tokens) + 1,), generator=g).tolist()
    datum = algo.make_datum(ids, [0] + [1] * int(tokens), [-12.0] * (int(tokens) + 1), advantage=1.0)
    engine.forward_backward([algo.make_datum(ids[:9], [0] + [1] * 8, [-12.0] * 9, 1.0)], "ppo")
    engine._discard_gradient()  # a warm-up call: one-off library set-up is not the logits' share
    before = _reset_peak_rss()
    t0 = time.perf_counter()
    out = engine.forward_backward([datum], "ppo")
    seconds = time.perf_counter() - t0
    peak = _peak_rss()
    print(json.dumps({"peak_mib": (peak - before) / 2**20, "seconds": seconds, "vocab": engine.vocab_size,
                      "logprobs": list(out.logprobs_D[0][:64])}))
    return 0


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS to its current RSS; return the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


if __name__ == "__main__":
    raise SystemExit(main())
