"""What a run costs: ``cost/step`` and ``cost/total`` from token counts and sandbox CPU time.

The trainer counts, per step, the prompt tokens the sampler prefilled
(``tokens/prefill``), the tokens it sampled (``tokens/sampled``), the tokens trained
(``tokens/trained``) and the CPU seconds the sandbox's code calls used
(``sandbox/cpu_s``); ``retool sft`` counts trained tokens and ``retool eval`` prefilled
and sampled tokens and sandbox CPU. Given a price table — the user's own numbers in a
small TOML file, none built in — a step costs::

    cost = (prefill * prefill_price + sampled * sample_price + trained * train_price) / 1e6
           + cpu_s * sandbox_cpu_hour_price / 3600

with token prices in USD per million tokens and ``sandbox_cpu_hour`` in USD per CPU-hour.
A table holds one ``[ENGINE]`` table of defaults per engine (``tinker``, ``pytrio``,
``local``, ``vllm``: the local engines' tokens can be priced too, e.g. at what the GPU
hour costs per token) and optional ``[ENGINE."MODEL"]`` tables that override them::

    [tinker]
    prefill = 0.1
    sample = 0.3
    train = 0.3
    sandbox_cpu_hour = 0.05

    [tinker."Qwen/Qwen3.5-4B"]
    train = 0.4

``--price-table`` adds the cost metrics (and ``usd=`` on the progress line);
``--max-cost`` (train, sft) ends a run cleanly, after a checkpoint, once another step
like the last would pass the budget.

Not covered: storage of checkpoints, minimum charges, discounts, prefix-cache pricing
(the services bill cached prompt tokens differently; ``tokens/prefill`` counts what the
sampler was sent, so this is an upper bound there), the CPU time of the grader.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retool.config import ConfigError, option, require

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PRICE_KEYS = ("prefill", "sample", "train", "sandbox_cpu_hour")


@dataclass(frozen=True)
class Prices:
    """USD per million tokens of each kind, and per CPU-hour of sandboxed code."""

    prefill: float = 0.0
    sample: float = 0.0
    train: float = 0.0
    sandbox_cpu_hour: float = 0.0

    def step_cost(self, metrics: Mapping[str, float]) -> float:
        """The cost of one step from its ``tokens/*`` and ``sandbox/cpu_s`` metrics."""
        tokens = (metrics.get("tokens/prefill", 0.0) * self.prefill + metrics.get("tokens/sampled", 0.0) * self.sample
                  + metrics.get("tokens/trained", 0.0) * self.train) / 1e6
        return tokens + metrics.get("sandbox/cpu_s", 0.0) * self.sandbox_cpu_hour / 3600


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
        raise ConfigError(f"price table {path}: prices must be numbers >= 0 (USD per million tokens, "
                          "sandbox_cpu_hour per CPU-hour)")
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


# ---------------------------------------------------------------- the flags


@dataclass
class PriceTableOption:
    """``--price-table`` (``retool eval``; with :class:`CostOptions` in train and sft)."""

    price_table: str | None = option(None, "TOML price table, your own USD per million tokens and per sandbox "
                                           "CPU-hour, by engine and model (configs/prices/example.toml); adds "
                                           "cost/step and cost/total; none = no cost metrics")


@dataclass
class CostOptions(PriceTableOption):
    """``--price-table`` and ``--max-cost`` of ``retool train`` and ``retool sft``."""

    max_cost: float | None = option(None, "stop cleanly, after a checkpoint, before another step would pass "
                                          "this many USD of cost/total (needs --price-table)")

    def validate_cost(self) -> None:
        require(self.max_cost is None or self.max_cost > 0, f"max_cost must be > 0, got {self.max_cost}")
        require(self.max_cost is None or self.price_table is not None, "max_cost needs a price_table")


def cost_meter(cfg: Any, engine: str, model: str) -> CostMeter | None:
    """The meter ``cfg``'s ``price_table`` (and ``max_cost``) describe, or ``None``
    without a table; a bad table is a :class:`ConfigError` before anything loads."""
    if cfg.price_table is None:
        return None
    return CostMeter(load_prices(cfg.price_table, engine, model), getattr(cfg, "max_cost", None))
