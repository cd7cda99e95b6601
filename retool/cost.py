"""What a run costs: ``cost/step`` and ``cost/total``, in the units the service bills.

Given a price table — the user's own numbers in a small TOML file, none built in — with
token prices in USD per million tokens, ``checkpoint`` in USD per checkpoint operation
and ``sandbox_cpu_hour`` in USD per CPU-hour of sandboxed code, a step costs, by the
table's ``units``:

``units = "policy_tokens"`` (the default; PyTRIO's bill, the local engines)::

    (tokens/prefill * prefill + tokens/sampled * sample + tokens/trained * train) / 1e6

``tokens/prefill`` counts a request's prompt once, ``tokens/trained`` the policy tokens
trained (interpreter tokens excluded). The reference run's PyTRIO bill is in these units.

``units = "tinker_billing"`` (Tinker's documented billing events, ``tinker.types``:
``sampling_prefill`` cached or not, ``sampling_sample``, ``training``, ``checkpoint``)::

    ((tokens/prefill_service - tokens/prefill_cached) * prefill
     + tokens/prefill_cached * prefill_cached + tokens/sampled * sample
     + tokens/forward_backward * train) / 1e6 + engine/checkpoints * checkpoint

``tokens/prefill_service`` is every prompt token the service prefilled (once per sample:
Tinker bills a multi-sample request's other samples as cached), ``tokens/prefill_cached``
what it reported as cached (``prompt_cache_hit_tokens``), ``tokens/forward_backward``
every token of every datum sent to ``forward_backward`` (interpreter and prompt tokens
included: Tinker's ``training`` event counts "tokens processed by forward/backward
passes"; that it is every input token is inferred, not documented), ``engine/checkpoints``
the persistent checkpoints saved (two per retool checkpoint: state and sampler weights;
counted into the step after the save, so the run's last checkpoint is not in its total).

Both add ``sandbox/cpu_s * sandbox_cpu_hour / 3600``. A table holds one ``[ENGINE]``
table of defaults per engine (``tinker``, ``pytrio``, ``local``, ``vllm``) and optional
``[ENGINE."MODEL"]`` tables that override them::

    [tinker]
    units = "tinker_billing"
    prefill = 0.1
    prefill_cached = 0.02
    sample = 0.3
    train = 0.3
    checkpoint = 0.0

    [tinker."Qwen/Qwen3.5-4B"]
    train = 0.4

``--price-table`` adds the cost metrics (and ``usd=`` on the progress line);
``--max-cost`` (train, sft) ends a run cleanly, after a checkpoint, once another step
like the last would pass the budget.

Not covered: checkpoint storage (Tinker bills gigabyte-hours), minimum charges,
discounts, the CPU time of the grader; ``retool eval`` and ``retool sft`` price what they
count (eval: prefill and sampled tokens, sft: trained tokens) in ``policy_tokens`` units.
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

PRICE_KEYS = ("prefill", "prefill_cached", "sample", "train", "checkpoint", "sandbox_cpu_hour")
UNITS = ("policy_tokens", "tinker_billing")


@dataclass(frozen=True)
class Prices:
    """USD per million tokens of each kind, per checkpoint operation and per CPU-hour of
    sandboxed code, in the ``units`` the service bills (module docstring)."""

    prefill: float = 0.0
    sample: float = 0.0
    train: float = 0.0
    sandbox_cpu_hour: float = 0.0
    prefill_cached: float = 0.0
    checkpoint: float = 0.0
    units: str = "policy_tokens"

    def step_cost(self, metrics: Mapping[str, float]) -> float:
        """The cost of one step from its ``tokens/*``, ``engine/checkpoints`` and
        ``sandbox/cpu_s`` metrics."""
        m = metrics.get
        sandbox = m("sandbox/cpu_s", 0.0) * self.sandbox_cpu_hour / 3600
        if self.units == "tinker_billing":
            cached = m("tokens/prefill_cached", 0.0)
            tokens = ((m("tokens/prefill_service", 0.0) - cached) * self.prefill + cached * self.prefill_cached
                      + m("tokens/sampled", 0.0) * self.sample + m("tokens/forward_backward", 0.0) * self.train)
            return tokens / 1e6 + m("engine/checkpoints", 0.0) * self.checkpoint + sandbox
        tokens = m("tokens/prefill", 0.0) * self.prefill + m("tokens/sampled", 0.0) * self.sample \
            + m("tokens/trained", 0.0) * self.train
        return tokens / 1e6 + sandbox


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
    units = values.pop("units", "policy_tokens")
    if units not in UNITS:
        raise ConfigError(f"price table {path}: units {units!r} in [{engine}]; known: {UNITS}")
    unknown = set(values) - set(PRICE_KEYS)
    if unknown:
        raise ConfigError(f"price table {path}: unknown keys {sorted(unknown)} in [{engine}]; known: "
                          f"{PRICE_KEYS + ('units',)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values.values()):
        raise ConfigError(f"price table {path}: prices must be numbers >= 0 (USD per million tokens, "
                          "checkpoint per checkpoint, sandbox_cpu_hour per CPU-hour)")
    if units == "policy_tokens" and {"prefill_cached", "checkpoint"} & set(values):
        raise ConfigError(f"price table {path}: prefill_cached and checkpoint need units = \"tinker_billing\" "
                          f"in [{engine}] (policy_tokens units price neither)")
    return Prices(units=units, **{k: float(v) for k, v in values.items()})


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
