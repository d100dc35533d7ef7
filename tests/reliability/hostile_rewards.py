"""Reward functions that misbehave, for the malformed-input catalogue (each gets its rows as
`fn(prompts, responses, answers, **kwargs)`)."""

import os
import sys
import time


def exits(prompts, responses, answers):
    sys.exit(0)


def interrupts(prompts, responses, answers):
    raise KeyboardInterrupt


def sleeps(prompts, responses, answers):
    time.sleep(3600)
    return [0.0] * len(prompts)


def spins(prompts, responses, answers):
    while True:  # pure Python: only a signal can stop it in this process
        pass


def dies(prompts, responses, answers):
    os._exit(3)


def raises(prompts, responses, answers):
    return [1 / 0 for _ in prompts]


def nan_at_1(prompts, responses, answers):
    return [float("nan") if i == 1 else 0.0 for i in range(len(prompts))]


def too_few(prompts, responses, answers):
    return [0.0] * (len(prompts) - 1)


def words(prompts, responses, answers):
    return ["high"] * len(prompts)


NOT_CALLABLE = 3
