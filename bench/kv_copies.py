"""Peak memory and time of a continuous decode loop's KV copies, with and without trims.

A lean decode loop copies its KV buffers into new ones whenever rows join it (``LeanCache.
admit``) or leave it (``keep_rows``), layer by layer. glibc keeps every freed buffer in its
heap; the next layer's new buffer, a little larger after an admission, does not fit there,
so without handing the freed memory back the process grows by about the whole cache at
each copy, though only one layer's old and new buffers are alive at once. The loop hands it
back after every ``lean_decode.TRIM_BYTES`` of freed buffers (``malloc_trim``).

This replays one sequence of copies of the demo eval's shape (SmolLM2-135M's 30 layers, 3
KV heads of 64, fp32; ``--rows`` running rows of ~``--width`` columns, ``--rounds`` times
``--join`` rows admitted, then as many dropped), with small live tensors allocated between
buffers and a logits-sized tensor freed after every copy, as a long-running loop's heap
has. Each setting runs in a fresh process: the peak of its anonymous resident memory (the
heap; read after every new layer buffer and before every trim) above the start,
the KV at the end, the copies' time, the trims made. Prints each against ``TRIM_BYTES=0``
(no trims, the path before) from the same run, and the load.

    python bench/kv_copies.py
    python bench/kv_copies.py --rows 6 --width 800 --rounds 12

Synthetic: the copies, not the decode steps between them; ``docs/benchmarks.md`` has the
demo eval measured end to end (peak tree PSS, the same tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_REPLAY = r"""
import json, sys, time, torch
from retool.engines.local import lean_decode, memory
trim_bytes, rows, width, rounds, join, drop = map(int, sys.argv[1:7])
lean_decode.TRIM_BYTES = trim_bytes
memory.limit_arenas()  # as the sampler does
torch.set_num_threads(1)
torch.empty(30 * 2**20, dtype=torch.uint8).fill_(1)  # glibc's mmap threshold raised, as in a long run
trims, most = 0, 0
real_trim, real_stacked = memory.release_free_memory, lean_decode._stacked

def anonymous():  # anonymous resident memory (the heap), not the pages of the libraries mapped
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

def seen():
    global most
    most = max(most, anonymous())

def stacked(*args):  # after each new layer buffer, when the old ones of the layers before are freed or kept
    out = real_stacked(*args)
    seen()
    return out

def trimmed():  # and just before each trim, where the heap is largest
    seen()
    return real_trim()

def counted():
    global trims
    trims += 1
    return trimmed()
memory.release_free_memory = counted
lean_decode._stacked = stacked
pins = []

def cache(n, w, reserve=128):
    c = object.__new__(lean_decode.LeanCache)
    c.own, c.width = [], w
    c.bias = torch.zeros(n, w + reserve)
    for _ in range(30):
        layer = []
        for _ in range(2):
            layer.append(torch.empty(3, n, w + reserve, 64).fill_(0.5))
            pins.append(torch.ones(2**14))  # small live tensors between buffers (masks, token lists)
        c.own.append(tuple(layer))
    return c

def kv(*caches):
    return sum(t.nbytes for c in caches for layer in c.own for t in layer)

running = cache(rows, width)
real_trim()
start, copies, first, joined = anonymous(), 0.0, None, None
for r in range(rounds):
    joining = cache(join, width + 37 * (r % 5) - 60)
    first, joined = first or kv(running, joining), joined or kv(joining)
    t = time.perf_counter(); running.admit(joining); copies += time.perf_counter() - t
    torch.empty(rows * 49152).fill_(0.0)  # a step's logits, freed
    if drop:
        keep = torch.arange(join, running.rows)
        t = time.perf_counter(); running.keep_rows(keep, trim_front=True); copies += time.perf_counter() - t
        torch.empty(rows * 49152).fill_(0.0)
    trimmed()  # the decode loop trims once per iteration after a copy (decode_loop.TRIM_IN_DECODE)
print(json.dumps({"peak": most - start, "kv": kv(running), "kv_before": first, "joined": joined, "copies_s": copies,
                  "trims": trims}))
"""


def replay(trim_bytes: int, rows: int, width: int, rounds: int, join: int, drop: bool = True) -> dict:
    """One replay in a fresh process: ``rounds`` admissions of ``join`` rows into ``rows`` running
    rows of ~``width`` columns (each followed by as many rows dropped when ``drop``), the
    loop handing freed memory back every ``trim_bytes`` (0: never). Returns the heap's peak
    above the start (``peak``; the start holds the running rows' cache, not the first joining one),
    the KV at the end (``kv``), before the first admission (``kv_before``, both caches) and of the
    first joining rows (``joined``), the copies' time (``copies_s``) and the trims made."""
    out = subprocess.run([sys.executable, "-c", _REPLAY, str(trim_bytes), str(rows), str(width), str(rounds),
                          str(join), str(int(drop))], capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12,
                        help="running rows (12 x 428 columns: ~233 MiB, the demo eval's loop KV bound until "
                             "6715b50, 256 MB; today's 384 holds 1.5x the rows)")
    parser.add_argument("--width", type=int, default=300, help="own columns of each row")
    parser.add_argument("--rounds", type=int, default=8, help="admissions (each followed by as many rows dropped)")
    parser.add_argument("--join", type=int, default=4, help="rows admitted per round")
    args = parser.parse_args()
    from retool.engines.local import lean_decode, memory
    if memory._glibc() is None:
        sys.exit("kv_copies: needs glibc (its heap is what is measured)")
    print(f"load average before: {os.getloadavg()}", flush=True)
    mib = 2**20
    settings = [("no trims (before)", 0), (f"every {lean_decode.TRIM_BYTES // mib} MiB (default)",
                                          lean_decode.TRIM_BYTES), ("after every layer", 1)]
    results = {name: replay(trim_bytes, args.rows, args.width, args.rounds, args.join) for name, trim_bytes in settings}
    base = results[settings[0][0]]
    for name, r in results.items():
        print(f"{name:24s} heap peak above start {r['peak'] / mib:7.1f} MiB ({r['peak'] / base['peak']:.2f}x)  "
              f"KV at the end {r['kv'] / mib:6.1f} MiB  copies {r['copies_s']:.2f} s "
              f"({r['copies_s'] / base['copies_s']:.2f}x)  trims {r['trims']}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
