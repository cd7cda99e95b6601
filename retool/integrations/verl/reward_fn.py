"""verl's custom reward-function hook, grading with retool's grader.

``reward.custom_reward_function.path`` points at the launch folder's ``reward_fn.py``,
which re-exports :func:`compute_score`. Rows run by ``RetoolAgentLoop`` never reach it
(the loop sets ``reward_score`` from the final assistant turn); it grades rows run by
any other agent loop, where verl hands over the whole decoded response: the boxed
answer is then looked for in the response's last 300 characters, as retool's grader
always does.

Returns verl's dict form: ``score`` (+1 / −1) plus retool's ``reward/correct`` and
``reward/format``. An unparsable gold answer is a data bug and raises.
"""

from __future__ import annotations

from typing import Any

from retool.reward import grade


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None,
                  **kwargs: Any) -> dict[str, float]:
    """Grade one response against its gold answer (verl's ``compute_score`` signature)."""
    result = grade(solution_str, str(ground_truth))
    return {"score": result.reward, "reward/correct": float(result.correct), "reward/format": float(result.formatted)}
