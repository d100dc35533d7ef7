"""Build a critic (value-head model) checkpoint from a policy checkpoint.

The critic is the policy's backbone with a one-output token-classification head
(`AutoModelForTokenClassification`, num_labels=1; `LlamaForTokenClassification` for Llama): the
head output at position P_b + t - 1 is V_t, the value of the state before response token t.
The head starts at zero (V = 0 everywhere) or small normal weights (std 1 / (hidden + 1), as
OpenRLHF); dropout on the head is off, so training and evaluation read the same values.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Literal

from rlpipe.schemas import MANIFEST_NAME, InputRef, Manifest, commit_directory

HeadInit = Literal["zero", "normal"]


def critic_from_policy(policy_model, *, head: HeadInit = "zero", seed: int = 0):
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


def build_critic(policy: Path | str, output: Path | str, *, head: HeadInit = "zero", seed: int = 0) -> Manifest:
    """Save a critic initialised from checkpoint `policy` to `output` (Hugging Face format, with
    the policy's tokenizer) and write its checkpoint manifest last."""
    from transformers.utils import logging as hf_logging

    from rlpipe.stages.common.models import checkpoint_key, load_model
    from rlpipe.stages.common.tiny import save_pretrained

    hf_logging.disable_progress_bar()
    started = time.time()
    policy, output = Path(policy), Path(output)
    model, tokenizer = load_model(policy, "causal")
    critic = critic_from_policy(model, head=head, seed=seed)
    output.mkdir(parents=True, exist_ok=True)
    (output / MANIFEST_NAME).unlink(missing_ok=True)
    save_pretrained(critic, tokenizer, output)
    return commit_directory(
        output, stage="critic_init", config={"policy": str(policy), "head": head, "seed": seed},
        inputs={"policy": InputRef(path=str(policy), content_hash=checkpoint_key(policy))},
        wall_time_s=time.time() - started,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m rlpipe.stages.advantage.critic POLICY OUTPUT [--head zero|normal] [--seed N]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rlpipe.stages.advantage.critic",
                                     description="Build a critic checkpoint from a policy checkpoint.")
    parser.add_argument("policy", type=Path, help="policy checkpoint directory (Hugging Face format)")
    parser.add_argument("output", type=Path, help="where to save the critic")
    parser.add_argument("--head", choices=["zero", "normal"], default="zero", help="value-head initialisation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the head initialisation")
    args = parser.parse_args(argv)
    manifest = build_critic(args.policy, args.output, head=args.head, seed=args.seed)
    print(f"critic: wrote {args.output} ({len(manifest.files)} files, content {manifest.content_hash[:12]})")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
