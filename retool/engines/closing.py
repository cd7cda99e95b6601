"""Releasing a training client when its run ends, whatever ended it."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("retool.engines")


def close_training_client(engine: Any, error: BaseException | None = None) -> None:
    """Release what a training client holds when its run ends (``error``: what ended it,
    ``None`` for a normal end). A service engine ends its SDK session there (Tinker:
    the session is finished and the SDK's background heartbeat, config refresh and
    telemetry stop); vLLM stops the server it started. Never raises: the run's own
    outcome stands, and a failing close is logged once as a warning."""
    if error is None:
        status = "success"
    elif isinstance(error, Exception):
        status = "errored"
    else:  # KeyboardInterrupt, SystemExit
        status = "interrupted"
    try:
        engine.close(status)
    except Exception as err:  # noqa: BLE001 - the run has ended; its own outcome is what it reports
        log.warning("closing the %s training client (run %s) failed: %s: %s",
                    type(engine).__name__, status, type(err).__name__, err)
