"""retool inside verl: the same protocol, renderer, sandbox and grader on verl's Ray trainer.

- :mod:`.sampler` — :class:`ServerManagerSampler`, retool's ``SamplingClient`` over
  verl's server manager (``await generate(request_id, prompt_ids=, sampling_params=)``).
  No verl import: it only calls that method.
- :mod:`.agent_loop` — ``RetoolAgentLoop``, a subclass of verl's real ``AgentLoopBase``
  that drives :class:`retool.rollout.Rollout` (one state machine) through that sampler.
  Importing it imports verl.
- :mod:`.reward_fn` — ``compute_score``, verl's custom reward-function hook, grading
  with :mod:`retool.reward` (used for rows not run by the agent loop; the loop sets the
  score itself).
- :mod:`.launch` — ``retool verl-config``: writes a launch folder (parquet data, agent
  loop YAML, reward hook, ``run.sh`` with every algorithm setting explicit).

Nothing here imports verl at package import time; see ``docs/verl.md``.
"""
