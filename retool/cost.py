"""What a run costs on a priced service: ``cost/step`` and ``cost/total`` from token counts.

The trainer already counts, per step, the prompt tokens the sampler prefilled
(``tokens/prefill``), the tokens it sampled (``tokens/sampled``) and the tokens trained
(``tokens/trained``). Given a price table — the user's own numbers in a small TOML file,
none built in — a step costs::

    cost = (prefill * prefill_price + sampled * sample_price + trained * train_price) / 1e6

with prices in USD per million tokens. A table holds one ``[ENGINE]`` table of
defaults and optional ``[ENGINE."MODEL"]`` tables that override them::

    [tinker]
    prefill = 0.1
    sample = 0.3
    train = 0.3

    [tinker."Qwen/Qwen3.5-4B"]
    train = 0.4

Not covered: storage of checkpoints, minimum charges, discounts, prefix-cache pricing
(the services bill cached prompt tokens differently; ``tokens/prefill`` counts what the
sampler was sent, so this is an upper bound there).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from retool.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRICE_KEYS = ("prefill", "sample", "train")


@dataclass(frozen=True)
class Prices:
    """USD per million tokens of each kind."""

    prefill: float = 0.0
    sample: float = 0.0
    train: float = 0.0

    def step_cost(self, metrics: Mapping[str, float]) -> float:
        """The cost of one step from its ``tokens/*`` metrics."""
        return (metrics.get("tokens/prefill", 0.0) * self.prefill + metrics.get("tokens/sampled", 0.0) * self.sample
                + metrics.get("tokens/trained", 0.0) * self.train) / 1e6


def load_prices(path: str | Path, engine: str, model: str) -> Prices:
    """The prices of ``model`` on ``engine`` from the TOML table at ``path``."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"price table {path}: {err}") from None
    section = table.get(engine)
    if not isinstance(section, dict):
        raise ConfigError(f"price table {path} has no [{engine}] table")
    values = {k: v for k, v in section.items() if not isinstance(v, dict)}
    override = section.get(model, {})
    values.update(override if isinstance(override, dict) else {})
    unknown = set(values) - set(PRICE_KEYS)
    if unknown:
        raise ConfigError(f"price table {path}: unknown keys {sorted(unknown)} in [{engine}]; known: {PRICE_KEYS}")
    if not all(isinstance(v, (int, float)) and v >= 0 for v in values.values()):
        raise ConfigError(f"price table {path}: prices must be numbers >= 0 (USD per million tokens)")
    return Prices(**{k: float(v) for k, v in values.items()})


@dataclass
class CostMeter:
    """Adds ``cost/step`` and ``cost/total`` to a step's metrics; stops before a budget.

    The running total lives in the trainer's ``totals`` (saved with every checkpoint), so
    a resumed run continues the bill where the checkpoint left it.
    """

    prices: Prices
    max_cost: float | None = None

    def charge(self, metrics: Mapping[str, float], totals: dict[str, float]) -> dict[str, float]:
        cost = self.prices.step_cost(metrics)
        totals["cost/total"] = totals.get("cost/total", 0.0) + cost
        return {"cost/step": cost, "cost/total": totals["cost/total"]}

    def stop_reason(self, metrics: Mapping[str, float]) -> str | None:
        """Why to stop now: another step like this one would pass ``max_cost``."""
        if self.max_cost is None or "cost/total" not in metrics:
            return None
        if metrics["cost/total"] + metrics["cost/step"] > self.max_cost:
            return (f"stopping: cost/total {metrics['cost/total']:.4g} USD plus another step "
                    f"({metrics['cost/step']:.4g}) would pass --max-cost {self.max_cost:g}")
        return None
