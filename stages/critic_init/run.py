"""The critic_init stage: a critic (value-head model) checkpoint from a policy checkpoint.

The critic is the policy's backbone with a one-output token-classification head
(`AutoModelForTokenClassification`, num_labels=1; `LlamaForTokenClassification` for Llama): the
head output at position P_b + t - 1 is V_t, the value of the state before response token t.
The head starts at zero (V = 0 everywhere) or small normal weights (std 1 / (hidden + 1), as
OpenRLHF); dropout on the head is off, so training and evaluation read the same values.
"""

from __future__ import annotations

import copy
import time

from rlpipe.schemas import (
    MANIFEST_NAME,
    Manifest,
    commit_directory,
)
from rlpipe.stages.common.stage_io import begin
from rlpipe.stages.critic_init.config import CriticInitConfig

STAGE = "critic_init"

def critic_from_policy(policy_model, *, head: str = "zero", seed: int = 0):
    """A token-classification model (num_labels=1) with `policy_model`'s backbone weights.

    Args:
        policy_model: a causal LM whose backbone sits at `.model` (Llama-style).
        head: 'zero' (V = 0 at start) or 'normal' (std 1 / (hidden + 1), bias 0).
        seed: seeds the head's initialisation.
    """
    import torch
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy_model.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.architectures = None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        critic = AutoModelForTokenClassification.from_config(config)
        critic.model.load_state_dict(policy_model.model.state_dict())  # embeddings, layers, norm
        with torch.no_grad():
            if head == "zero":
                critic.score.weight.zero_()
            elif head == "normal":
                critic.score.weight.normal_(0.0, 1.0 / (config.hidden_size + 1))
            else:
                raise ValueError(f"head must be 'zero' or 'normal', got {head!r}")
            if critic.score.bias is not None:
                critic.score.bias.zero_()
    return critic.eval()


def run(config: CriticInitConfig, *, force: bool = False) -> Manifest:
    """Save a critic initialised from `config.policy` to `config.output` (Hugging Face format, with
    the policy's tokenizer); the checkpoint manifest is written last."""
    from transformers.utils import logging as hf_logging

    from rlpipe.stages.common.models import load_model
    from rlpipe.stages.common.tiny import save_pretrained

    started = time.time()
    start = begin(STAGE, config, force=force)
    if start.cached is not None:
        return start.cached
    inputs, key = start.inputs, start.key
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(config.policy, "causal")
    critic = critic_from_policy(model, head=config.head, seed=config.seed)
    config.output.mkdir(parents=True, exist_ok=True)
    (config.output / MANIFEST_NAME).unlink(missing_ok=True)
    save_pretrained(critic, tokenizer, config.output)
    return commit_directory(config.output, stage=STAGE, config=config.resolved(), inputs=inputs,
                            cache_key=key, wall_time_s=time.time() - started)
