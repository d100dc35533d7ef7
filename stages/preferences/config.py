"""Config of the preferences stage: (prompts) -> a `preferences` artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlpipe.schemas.config import Input, Output, StageConfig


class PreferencesConfig(StageConfig):
    """Build preference pairs for Bradley-Terry training.

    kind:
        answers     one pair per row of `prompts` (every row needs an integer answer): chosen is the
                    reference answer, rejected a wrong one of the form `wrong` names.
        arithmetic  `pairs` random sums 'Q: a+b= A:' with the right and a wrong answer.
        keyword     `pairs` random word lists; the chosen one contains the word 'good'.
    """

    output: Annotated[Path, Output("preferences")]
    """Output `preferences` artifact."""
    prompts: Annotated[Path | None, Input("prompts")] = None
    """`prompts` artifact with answers (kind 'answers')."""
    kind: Literal["answers", "arithmetic", "keyword"] = "answers"
    """How pairs are made (see above)."""
    wrong: Literal["near_miss", "zero_padded"] = "near_miss"
    """Kind 'answers': the rejected answer. 'near_miss': the answer +- 1..3 (telling it apart needs
    the sum's last digit, which the 0.7M-parameter built-in model does not learn in a few hundred
    steps); 'zero_padded': the right number in the form an exact-match verifier refuses, '068' for
    '68' (the arithmetic task's flawed SFT answers, `sft_padded_fraction`)."""
    pairs: int = Field(1000, ge=1)
    """Number of pairs of the synthetic kinds ('answers' makes one per prompt)."""
    seed: int = 0
    """Seeds the wrong answers and random texts."""

    @model_validator(mode="after")
    def _prompts_for_answers(self) -> PreferencesConfig:
        if (self.kind == "answers") != (self.prompts is not None):
            raise ValueError("kind 'answers' needs `prompts` (and the synthetic kinds take none)")
        return self
