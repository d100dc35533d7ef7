"""The critic_init stage: a critic (value-head model) checkpoint from a policy checkpoint.

The critic is a copy of the policy's backbone with a scalar head (`ScalarHeadModel`, any
architecture; saved as scalar_head.py describes): the head output at position P_b + t - 1 is V_t,
the value of the state before response token t. The head starts at zero (V = 0 everywhere) or
small normal weights (std 1 / (hidden + 1), as OpenRLHF); the head has no dropout, so training
and evaluation read the same values.
"""

from __future__ import annotations

import copy
import time

from rlpipe.schemas import (
    Manifest,
    commit_directory,
)
from rlpipe.schemas.staging import staged_directory
from rlpipe.stages.common.stage_io import StageStart, opens
from rlpipe.stages.critic_init.config import CriticInitConfig

STAGE = "critic_init"

def critic_from_policy(policy_model, *, head: str = "zero", seed: int = 0):
    """A `ScalarHeadModel` (kind 'critic') on a copy of `policy_model`'s backbone.

    Args:
        policy_model: a causal LM of any architecture (read-only: its backbone is copied).
        head: 'zero' (V = 0 at start) or 'normal' (std 1 / (hidden + 1), bias 0).
        seed: seeds the head's initialisation.
    """
    from rlpipe.stages.common.scalar_head import backbone_of, wrap

    backbone, hidden = backbone_of(policy_model)
    return wrap(copy.deepcopy(backbone), hidden, "critic", init=head, seed=seed)  # type: ignore[arg-type]


@opens(STAGE)
def run(config: CriticInitConfig, start: StageStart) -> Manifest:
    """Save a critic initialised from `config.policy` to `config.output` (Hugging Face format, with
    the policy's tokenizer); the checkpoint manifest is written last."""
    from transformers.utils import logging as hf_logging

    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.common.tiny import save_pretrained

    inputs, key = start.inputs, start.key
    started = start.started
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(config.policy, "causal")
    critic = critic_from_policy(model, head=config.head, seed=config.seed)
    with staged_directory(config.output) as staging:  # the old checkpoint stays until complete
        save_pretrained(critic, tokenizer, staging)
        return commit_directory(staging, stage=STAGE, config=config.resolved(), inputs=inputs,
                                cache_key=key, wall_time_s=time.time() - started)
