"""The advantage stage (`python -m rlpipe.stages.advantage`): scores (+ rollouts, + reference)
-> advantages.

- `estimators`: advantage estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline, gae) and their
  registry; `kl`: KL estimators, KL-in-reward token rewards, KL controllers; `stats`: summaries.
"""
