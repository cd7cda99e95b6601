"""``bench/sampler_invariance.py``: its comparison, and one small run on the tiny model.

The bench is a measurement (``docs/benchmarks.md``); these tests check that it measures
what it says: a sequence that parts is counted with the position where it parts, and the
logprob difference is taken over the tokens before that only; and that it runs end to
end (fp32 on the tiny random Llama, where a seeded request samples the same tokens alone
and in a batch, as ``test_seeded_requests_do_not_depend_on_their_batch`` checks directly).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.test_engine_local import tiny_model  # noqa: F401 - fixture

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sampler_invariance.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("sampler_invariance", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sampler_invariance", module)
    spec.loader.exec_module(module)
    return module


def test_compare_counts_parted_sequences_where_they_part_and_diffs_only_before():
    bench = load_bench()
    alone = {0: [((1, 2, 3), (-0.1, -0.2, -0.3)), ((4, 5), (-1.0, -1.0))]}
    got = {0: [((1, 2, 3), (-0.1, -0.25, -0.3)), ((4, 6), (-1.5, -9.0))]}
    same, total, firsts, largest = bench.compare(alone, got)
    assert (same, total, firsts) == (1, 2, [1])
    assert abs(largest - 0.5) < 1e-9  # -1.0 vs -1.5 at token 0; token 1 (where they part) is not compared
    shorter = {0: [((1, 2), (-0.1, -0.2)), ((4, 5), (-1.0, -1.0))]}  # stopped earlier: parts at its end
    assert bench.compare(alone, shorter)[2] == [2]


def test_a_small_run_on_the_tiny_model_prints_each_variant(tiny_model, capsys, monkeypatch):
    bench = load_bench()
    # the tiny model's tokenizer has no chat special tokens for the rollout's renderer:
    # two prompts sharing a 12-token prefix stand in for the system prompt and questions
    system = [2] + [3 + (5 * i) % 40 for i in range(11)]
    monkeypatch.setattr(bench, "tool_prompts", lambda tokenizer, n: [system + [7, 8, 9], system + [11]][:n])
    bench.measure(SimpleNamespace(model=tiny_model, init_from=None, requests=2, samples=2, max_tokens=5), "fp32")
    out = capsys.readouterr().out
    assert "precision fp32 -> fp32: 2 requests x 2 samples" in out
    for name in ("together", "again (stored KV)"):
        assert any(line.strip().startswith(name) and "4/4 sequences the same as alone" in line
                   for line in out.splitlines())
