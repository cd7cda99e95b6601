"""JSON round-trips for the typed records (trajectory logs, eval results, viewers).

``to_jsonable`` turns any record of :mod:`retool.types` into plain JSON values
(dataclasses → dicts, enums → their values, tuples → lists, bytes → base64 text);
``trajectory_from_jsonable`` rebuilds a :class:`~retool.types.Trajectory` exactly, so a
saved trajectory can be re-read by the viewer, the evaluator's resume logic, or tests.

Every dict written for a record carries the record's field names unchanged (a field
added later with ``metadata={"omit_if_none": True}`` is left out while it is ``None``,
so files written before it existed stay byte for byte the same); the
trajectory dict additionally keeps ``tokens_T``/``mask_T``/``logprobs_T`` as lists of
the same length (checked on load).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
from typing import Any

from retool.types import (
    ExecStatus,
    ExecutionResult,
    Grade,
    InvalidToolCall,
    StopReason,
    ToolCall,
    ToolExchange,
    Trajectory,
    Turn,
)


def to_jsonable(obj: Any) -> Any:
    """Plain-JSON form of a record (or of containers of records)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
               if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
        if isinstance(obj, (ToolCall, InvalidToolCall)):
            out["kind"] = "valid" if isinstance(obj, ToolCall) else "invalid"
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _PLAIN for v in obj):  # token, mask and logprob tuples: 14x faster than one call each
            return list(obj)
        return [to_jsonable(v) for v in obj]
    return obj


_PLAIN = (int, float, str, bool, type(None))
"""Values :func:`to_jsonable` returns as they are (JSON's own)."""


def _call_from(d: dict) -> ToolCall | InvalidToolCall:
    if d.get("kind") == "invalid":
        return InvalidToolCall(reason=d["reason"], message=d["message"], raw=d.get("raw", ""))
    return ToolCall(code=d["code"], raw=d.get("raw", ""))


def _result_from(d: dict | None) -> ExecutionResult | None:
    if d is None:
        return None
    fields = dict(d)
    fields["status"] = ExecStatus(fields["status"])
    fields["isolation"] = tuple(fields.get("isolation", ()))
    fields["files"] = {k: base64.b64decode(v) for k, v in fields.get("files", {}).items()}
    return ExecutionResult(**fields)


def _turn_from(d: dict) -> Turn:
    exchange = None
    if d.get("exchange") is not None:
        e = d["exchange"]
        exchange = ToolExchange(
            call=_call_from(e["call"]),
            result=_result_from(e.get("result")),
            response=e["response"],
            latency_s=e.get("latency_s", 0.0),
        )
    return Turn(
        text=d["text"],
        num_tokens=d["num_tokens"],
        stop_reason=StopReason(d["stop_reason"]),
        exchange=exchange,
    )


def trajectory_from_jsonable(d: dict) -> Trajectory:
    """Rebuild a :class:`Trajectory` written by :func:`to_jsonable`.

    Raises ``ValueError`` when the per-token arrays disagree in length.
    """
    tokens, mask, logprobs = d["tokens_T"], d["mask_T"], d["logprobs_T"]
    if not len(tokens) == len(mask) == len(logprobs):
        raise ValueError(
            f"trajectory {d.get('problem_id')!r}: tokens/mask/logprobs lengths differ "
            f"({len(tokens)}/{len(mask)}/{len(logprobs)})"
        )
    return Trajectory(
        problem_id=d["problem_id"],
        prompt_len=d["prompt_len"],
        tokens_T=tuple(tokens),
        mask_T=tuple(mask),
        logprobs_T=tuple(logprobs),
        turns=tuple(_turn_from(t) for t in d["turns"]),
        grade=Grade(**d["grade"]),
        stop_reason=StopReason(d.get("stop_reason", "stop")),
        versions_T=tuple(d["versions_T"]) if d.get("versions_T") is not None else None,
    )
