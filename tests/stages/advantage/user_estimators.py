"""User advantage estimators for the tests (imported by path `user_estimators:<name>`)."""

import torch


def scaled_reward(inputs, scale=1.0):
    """A (B,) sequence advantage: scale * r_i."""
    return scale * inputs.rewards


def token_index(inputs):
    """A (B, T) token advantage: t + 1 (padding included: the stage must zero it)."""
    return torch.arange(1, inputs.mask.shape[1] + 1, dtype=inputs.rewards.dtype).expand_as(inputs.mask)


def wrong_shape(inputs):
    return inputs.rewards[:-1]


def not_a_tensor(inputs):
    return inputs.rewards.tolist()


NOT_CALLABLE = 3
