"""Environments of multi-turn episodes: the interface (`base`), tools and the `tools`
environment (`tools`), and the sandbox that runs model-written code (`sandbox`)."""

from rlpipe.stages.rollout.environments.base import (
    Environment,
    EnvironmentSpec,
    ModelTurn,
    StepResult,
    ToolCall,
    make_environment,
)

__all__ = ["Environment", "EnvironmentSpec", "ModelTurn", "StepResult", "ToolCall", "make_environment"]
