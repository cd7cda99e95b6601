"""Teacher-forced logprobs of a fixed sequence on each side of the local engine, for the
weight-sync guard (``retool.weight_sync``).

- :func:`model_logprobs`: the trainer's side, one forward pass of the model (eval mode,
  no gradient) — the weights the optimiser updates.
- :func:`sampler_logprobs`: the sampler's side, through the sampler's own decode path
  (``decode_loop.decode``) with the tokens forced instead of drawn: with the lean loop,
  its merged LoRA weights (``lean_decode``), the copy a skipped re-merge leaves stale.

Both at temperature 1, the logprob of every token from ``start`` on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from retool.engines.local.decode_loop import decode
from retool.engines.local.model import model_mode


def model_logprobs(model: Any, tokens: Sequence[int], start: int,
                   logits_of: Callable[[dict[str, Any]], Any] | None = None) -> tuple[float, ...]:
    """``log p(tokens[i] | tokens[:i])`` for ``i >= start``, from the model's forward pass
    (``logits_of(inputs)``, e.g. the trainer's own under bf16 autocast; by default the
    model called as it is)."""
    ids = torch.tensor([list(tokens)], device=model.device)
    if logits_of is None:
        def logits_of(inputs: dict[str, Any]) -> Any:
            return model(**inputs, use_cache=False).logits
    with torch.no_grad(), model_mode(model, train=False):
        logits = logits_of({"input_ids": ids})[0, start - 1:-1].float()
    return tuple(logits.log_softmax(-1).gather(1, ids[0, start:, None])[:, 0].tolist())


class _Forced:
    """A row sampler for ``decode`` that 'draws' the given tokens and records their
    temperature-1 logprobs."""

    def __init__(self, forced: Sequence[int]) -> None:
        self.forced, self.taken = list(forced), 0

    def draw(self, scores_B: Any, rows: Sequence[int]) -> tuple[Any, Any]:
        chosen_B = torch.full((len(rows),), self.forced[self.taken], dtype=torch.long, device=scores_B.device)
        self.taken += 1
        return chosen_B, scores_B.float().log_softmax(-1).gather(1, chosen_B[:, None]).squeeze(1)


def sampler_logprobs(sampler: Any, tokens: Sequence[int], start: int) -> tuple[float, ...]:
    """The same logprobs through ``sampler``'s (a ``LocalSamplingClient``) decode path,
    under its lock, with the weights it would sample with now."""
    answer = list(tokens[start:])
    with sampler._lock, torch.no_grad(), model_mode(sampler.model, train=False):
        lean = sampler._lean() if sampler.decode_loop == "lean" else None
        ids = torch.tensor([list(tokens[:start])], device=sampler.model.device)
        rows = decode(sampler.model, None, ids, torch.ones_like(ids), _Forced(answer), [len(answer)], set(),
                      lean=lean)
    return tuple(rows[0][1])
