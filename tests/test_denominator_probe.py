"""Which denominator does a service divide a ``forward_backward`` call's summed loss by?

PyTRIO does not document it; retool infers the call's active targets from its client
(``retool.engines.tinker``). Its ``loss_mean`` metric cannot tell: the SDK computes it
itself. This probe reads the answer from the update the service applies.

Two calls accumulate into one ``optim_step``: ``X`` (``n`` targets, advantage +1) in the
first, ``X`` with advantage ``-k`` in the second, next to tokens of advantage 0. The
gradients cancel, and the weights stay put, exactly when ``k`` is the ratio of the two
calls' denominators. Three layouts give each candidate (:data:`DENOMINATORS`) its own
signature of cancelling ``k``s, with ``m = 2n`` zero-advantage tokens:

=================  ==========================  ==========================  ================
candidate          A: X | X + datum Y (m)      B: X | X + m tokens         C: X, X | X
=================  ==========================  ==========================  ================
call_tokens        (n+m)/n = 3                 3                           1
samples            2                           1                           1
advantage_tokens   1                           1                           1 (2n / 2n)
datum_tokens       1                           3                           2
sum                1                           1                           2
=================  ==========================  ==========================  ================

Adam runs with ``beta1 = 0`` (no momentum carried between rounds) and no weight decay,
so a zero gradient is a zero update; the change of ``X``'s logprobs (``forward``, no
gradient) measures each update. Every layout tries each of its distinct ``k``s; the one
that moves the weights least, by far, is its cancelling ``k``.

The fake service (``tests/fake_tinker.py``) divides by whichever candidate it is told,
so the probe is tested against all five; with a key it runs against the live service and
checks retool's assumption (PyTRIO: ``call_tokens``; Tinker, documented: ``sum``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from retool.engines import tinker as adapter
from tests.fake_tinker import DENOMINATORS, FakeService, install
from tests.tiny import boxed_digit_model_dir

pytestmark = pytest.mark.timeout(300)

N, M = 6, 12
"""X's targets and the zero-advantage tokens beside it (m = 2n)."""
SIGNATURES = {"call_tokens": (3.0, 3.0, 1.0), "samples": (2.0, 1.0, 1.0), "advantage_tokens": (1.0, 1.0, 1.0),
              "datum_tokens": (1.0, 3.0, 2.0), "sum": (1.0, 1.0, 2.0)}
"""The cancelling k of layouts A, B, C under each candidate (module docstring)."""
ASSUMED = {"pytrio": "call_tokens", "tinker": "sum"}
"""What retool's loss conversion assumes for each flavour."""


@dataclass(frozen=True)
class Row:
    """One datum of a probe call: its tokens and the advantage of each target."""

    tokens: tuple[int, ...]
    advantages: tuple[float, ...]


def layouts(x: Sequence[int], y: Sequence[int]) -> dict[str, tuple[list[Row], Any]]:
    """Per layout: the first call, and the second call as a function of ``k`` (``x``:
    ``N + 1`` tokens, ``y``: ``M + 1``)."""
    x, y = tuple(x), tuple(y)
    plus = Row(x, (1.0,) * N)
    return {
        "A": ([plus], lambda k: [Row(x, (-k,) * N), Row(y, (0.0,) * M)]),
        "B": ([plus], lambda k: [Row(x + y[:M], (-k,) * N + (0.0,) * M)]),
        "C": ([plus, plus], lambda k: [Row(x, (-k,) * N)]),
    }


class Probe:
    """The probe on one SDK training client (raw SDK calls, importance-sampling loss)."""

    def __init__(self, flavour: str, sdk_client: Any, lr: float = 1e-2, eps: float = 1e-4) -> None:
        self.flavour, self.client = flavour, sdk_client
        self.t = importlib.import_module(f"{flavour}.types")
        self.adam = self.t.AdamParams(learning_rate=lr, beta1=0.0, beta2=0.999, eps=eps, weight_decay=0.0,
                                      grad_clip_norm=0.0)

    def datum(self, row: Row, sampler_logprobs: Sequence[float]) -> Any:
        inputs = {"target_tokens": np.asarray(row.tokens[1:], dtype=np.int64),
                  "logprobs": np.asarray(sampler_logprobs, dtype=np.float32),
                  "advantages": np.asarray(row.advantages, dtype=np.float32)}
        return self.t.Datum(model_input=self.t.ModelInput.from_ints(list(row.tokens[:-1])),
                            loss_fn_inputs={k: self.t.TensorData.from_numpy(v) for k, v in inputs.items()})

    def logprobs(self, rows: Sequence[Row]) -> list[np.ndarray]:
        data = [self.t.Datum(model_input=self.t.ModelInput.from_ints(list(r.tokens[:-1])), loss_fn_inputs={
            "target_tokens": self.t.TensorData.from_numpy(np.asarray(r.tokens[1:], dtype=np.int64)),
            "weights": self.t.TensorData.from_numpy(np.ones(len(r.tokens) - 1, dtype=np.float32))}) for r in rows]
        out = self.client.forward(data, "cross_entropy").result()
        return [np.asarray(o["logprobs"].tolist(), dtype=np.float64) for o in out.loss_fn_outputs]

    def movement(self, first: list[Row], second: list[Row]) -> float:
        """How far one update, from the two calls' accumulated gradients, moves X's logprobs."""
        x = first[0]
        before = self.logprobs([x] + second)
        sampler = {r.tokens: lp for r, lp in zip([x] + second, before)}  # on-policy: ratio 1
        for call in (first, second):
            self.client.forward_backward([self.datum(r, sampler[r.tokens]) for r in call], "importance_sampling").result()
        self.client.optim_step(self.adam).result()
        return float(np.abs(self.logprobs([x])[0] - before[0]).sum())

    def run(self, x: Sequence[int], y: Sequence[int]) -> tuple[str | None, dict[str, dict[float, float]]]:
        """The candidate whose signature matches (``None`` if none does), and the
        movement per layout and ``k``."""
        moved: dict[str, dict[float, float]] = {}
        found = []
        for i, (name, (first, second)) in enumerate(layouts(x, y).items()):
            ks = sorted({sig[i] for sig in SIGNATURES.values()})
            moved[name] = {k: self.movement(first, second(k)) for k in ks}
            least, *rest = sorted(moved[name].values())
            found.append(min(moved[name], key=moved[name].get) if least < 0.05 * min(rest) else None)
        matches = [c for c, sig in SIGNATURES.items() if tuple(found) == sig]
        return (matches[0] if matches else None), moved


def probe_tokens(vocab: int, seed: int = 0) -> tuple[list[int], list[int]]:
    g = np.random.default_rng(seed)
    return g.integers(3, vocab, N + 1).tolist(), g.integers(3, vocab, M + 1).tolist()


def test_the_signatures_tell_every_candidate_apart():
    assert set(SIGNATURES) == set(DENOMINATORS)
    assert len(set(SIGNATURES.values())) == len(SIGNATURES)


@pytest.mark.parametrize("denominator", DENOMINATORS)
def test_the_probe_finds_the_denominator_the_service_uses(denominator, tmp_path, monkeypatch):
    service = FakeService(tmp_path / "service", "pytrio", denominator=denominator)
    install(service, monkeypatch)
    client = adapter.create_training_client("pytrio", model=str(boxed_digit_model_dir()), lora_rank=4, seed=0)
    try:
        found, moved = Probe("pytrio", client.sdk_client).run(*probe_tokens(client.get_tokenizer().vocab_size))
    finally:
        client.close()
    print(f"\n{denominator}: found {found}; movement per layout and k {moved}")
    assert found == denominator, moved


@pytest.mark.skipif(not (os.environ.get("TINKER_API_KEY") or os.environ.get("PYTRIO_API_KEY")),
                    reason="no TINKER_API_KEY / PYTRIO_API_KEY: the live service is not reachable")
def test_live_the_service_divides_by_what_retool_assumes():
    from tests.test_engine_tinker import LIVE_MODEL, live_flavour

    flavour = live_flavour()
    client = adapter.create_training_client(flavour, model=LIVE_MODEL, lora_rank=8, seed=0)
    try:
        found, moved = Probe(flavour, client.sdk_client, lr=1e-3).run(*probe_tokens(1000))
    finally:
        client.close()
    print(f"\nlive {flavour}: the service divides by {found}; movement per layout and k: {moved}")
    assert found == ASSUMED[flavour], moved
