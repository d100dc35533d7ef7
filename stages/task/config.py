"""Config of the task stage: knobs of the arithmetic task -> train / held-out / SFT prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rlpipe.schemas.config import Output, StageConfig


class TaskConfig(StageConfig):
    """Generate the arithmetic task ('23+45=' -> '68') as disjoint train and held-out `prompts`
    artifacts (no download), and optionally a flawed copy of the training prompts for SFT."""

    train: Annotated[Path, Output("prompts")]
    """Training prompts artifact (SFT and RL draw from these)."""
    heldout: Annotated[Path, Output("prompts")]
    """Held-out prompts artifact for evaluation (disjoint from training)."""
    sft: Annotated[Path | None, Output("prompts")] = None
    """The SFT copy of the training prompts with flawed answers (see sft_padded_fraction) and / or
    calculator traces (see sft_tool_fraction); set when either fraction is > 0."""
    kind: Literal["arithmetic"] = "arithmetic"
    """The task family (only 'arithmetic' for now)."""
    a_range: tuple[int, int] = (0, 99)
    """(lowest, highest) first operand, inclusive."""
    b_range: tuple[int, int] = (0, 99)
    """(lowest, highest) second operand, inclusive; (0, 9) makes '+' much easier."""
    ops: tuple[Literal["+", "-", "*"], ...] = ("+",)
    """Operations drawn from."""
    question: str | None = None
    """The prompt's text as a format string of {a}, {op} and {b}, for a chat or instruct model, e.g.
    'What is {a} {op} {b}? Reply with the number only.' (the chat template is the rollout's); the
    reference answer and the prompt id ('23+45') stay the same. None: the compact '23+45=' the
    demo's own tokenizer is built for."""
    n_train: int = Field(2000, ge=1)
    """Training prompts."""
    n_heldout: int = Field(200, ge=1)
    """Held-out prompts."""
    sft_padded_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Deliberately flawed warm-start data (the demo): in the SFT copy of the training prompts,
    this fraction of the answers of problems whose first operand is >= `sft_padded_from` (drawn
    with the seed) is zero-padded to three digits ('068'), as if those problems came from a second
    source with another answer convention. The verifier accepts only the canonical answer ('68'),
    so the warm start answers many such problems in the wrong form, while sampling still tries
    the canonical one now and then: RL has to learn it from the reward alone. 0: canonical SFT."""
    sft_padded_from: int = Field(0, ge=0)
    """First operand from which SFT answers may be padded (see sft_padded_fraction)."""
    sft_tool_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Tool-use warm-start data: in the SFT copy of the training prompts, this fraction of the
    answers (drawn with the seed, apart from the padding draws) is a calculator trace: the call,
    the tool's reply, then the answer, as a raw-text episode lays them out
    (`rlpipe.stages.task.arithmetic.calculator_trace`); the others stay plain answers, which a
    model that cannot compute them gets wrong: RL has to learn when to call the tool. Composes
    with sft_padded_fraction (a trace's final answer is padded like a plain one). The pipeline's
    base model tokenizer then learns the call format too (`tokenizer_texts(tools=True)`).
    0: no traces."""
    seed: int = Field(0, ge=0)
    """Seeds the split and the SFT copy's draws (padding, tool traces)."""

    @field_validator("question")
    @classmethod
    def _check_question(cls, question: str | None) -> str | None:
        if question is not None:
            from rlpipe.stages.task.arithmetic import check_question

            check_question(question)
        return question

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        for name, (lo, hi) in (("a_range", self.a_range), ("b_range", self.b_range)):
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {[lo, hi]}")
        if not self.ops:
            raise ValueError("ops must name at least one operation of '+', '-', '*'")
        if self.sft is not None and self.sft_padded_fraction == 0 and self.sft_tool_fraction == 0:
            raise ValueError("sft is set but sft_padded_fraction and sft_tool_fraction are 0: the copy would "
                             "equal train")
        return self

    def to_task(self):
        """The task's problem space (`rlpipe.stages.task.arithmetic.ArithmeticTask`)."""
        from rlpipe.stages.task.arithmetic import ArithmeticTask

        return ArithmeticTask(a_range=self.a_range, b_range=self.b_range, ops=self.ops, question=self.question)
