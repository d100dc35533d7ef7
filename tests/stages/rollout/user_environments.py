"""Environments named by import path in the multi-turn tests ('user_environments:make_echo')."""

from __future__ import annotations

from rlpipe.stages.rollout.environments import StepResult


class Echo:
    """Answers every model turn with the same user message and a reward; max_turns ends it."""

    def __init__(self, reply: str, reward: float):
        self.reply, self.reward = reply, reward

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        return StepResult(messages=({"role": "user", "content": self.reply},), reward=self.reward)


def make_echo(reply: str = "Q: 1+1=", reward: float = 0.25):
    return lambda: Echo(reply, reward)


def explode(what: str) -> str:
    """A tool that misbehaves.

    Args:
        what: 'raise' to raise, 'sleep' to hang.
    """
    if what == "raise":
        raise RuntimeError("the tool broke")
    import time

    time.sleep(60)
    return "woke up"
