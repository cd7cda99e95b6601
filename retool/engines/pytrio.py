"""The ``pytrio`` engine: the Tinker adapter (:mod:`retool.engines.tinker`) in its PyTRIO
flavour. Everything lives there; this module only binds the flavour, so the registry
can import each engine by name."""

from __future__ import annotations

from typing import Any

from retool.engines.tinker import PYTRIO, ServiceTrainingClient
from retool.engines.tinker import create_training_client as _create_training_client
from retool.engines.tinker import sampler as _sampler
from retool.engines.tinker import training_client as _training_client


def create_training_client(**options: Any) -> ServiceTrainingClient:
    return _create_training_client(PYTRIO, **options)


def training_client(cfg: Any, seed: int, init_from: str | None) -> ServiceTrainingClient:
    return _training_client(cfg, seed, init_from, PYTRIO)


def sampler(request: Any) -> Any:
    return _sampler(request, PYTRIO)
