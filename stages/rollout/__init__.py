"""Rollout stage: sample G responses per prompt with the policy (transformers or vLLM engine)."""

from rlpipe.stages.rollout.config import RolloutConfig

__all__ = ["RolloutConfig"]
