"""Training backends behind one Tinker-shaped interface (see ``retool.engines.base``).

``ENGINES`` maps an engine name to the factory that builds its training client from
keyword options; the trainer picks one by name, once. Engine modules are imported only
when chosen, so importing this package stays cheap.

- ``local``: PyTorch + transformers + PEFT on the CPU or one GPU
  (``retool.engines.local``; options are the fields of ``LocalEngineConfig``).
"""

from __future__ import annotations

import importlib
from typing import Any

from retool.engines.base import (
    AdamParams,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampledSequence,
    SampleResult,
    SamplingClient,
    SamplingParams,
    TrainingClient,
)

ENGINES: dict[str, str] = {
    "local": "retool.engines.local:create_training_client",
}
"""Engine name -> ``module:function`` building its training client from keyword options."""


def create_training_client(engine: str, **options: Any) -> TrainingClient:
    """Build the training client of ``engine`` (a key of ``ENGINES``) from its options."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; available: {sorted(ENGINES)}")
    module_name, function_name = ENGINES[engine].split(":")
    return getattr(importlib.import_module(module_name), function_name)(**options)


__all__ = [
    "ENGINES", "AdamParams", "ForwardBackwardOutput", "OptimStepOutput", "SampleResult",
    "SampledSequence", "SamplingClient", "SamplingParams", "TrainingClient",
    "create_training_client",
]
