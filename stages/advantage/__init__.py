"""Advantages and the forward passes before them (ALGORITHMS.md sections 4-5).

- `estimators`: advantage estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline, gae) and their
  registry `ADVANTAGE_ESTIMATORS`; `kl`: KL estimators, KL-in-reward token rewards, KL controllers.
- `run` (`python -m rlpipe.stages.advantage`): scores (+ rollouts, + reference) -> advantages.
- `reference` (`python -m rlpipe.stages.advantage.reference_main`): rollouts -> reference
  log-probs and critic values; `critic`: build a critic checkpoint from a policy checkpoint.
"""
