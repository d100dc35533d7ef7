"""Config of the sft stage (supervised warm start)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlpipe.schemas.config import Assigned, Input, Output, Runtime, StageConfig
from rlpipe.stages.common.model_loading import ModelLoading
from rlpipe.stages.rollout.environments.base import EnvironmentSpec


class SFTConfig(StageConfig):
    """Supervised fine-tuning warm start: next-token loss on prompt+answer text (through the chat
    template, laid out as episodes, where the tokenizer has one), trained with DeepSpeed; writes a
    Hugging Face checkpoint and a `metrics` artifact with the loss curve."""

    base: Annotated[Path, Input("checkpoint")]
    """Checkpoint to start from (Hugging Face directory with tokenizer)."""
    prompts: Annotated[Path, Input("prompts")]
    """`prompts` artifact. Rows with an answer train on prompt+answer+EOS; rows whose answer is
    null are plain text (the prompt column) and train on every token."""
    output: Annotated[Path, Output("checkpoint")]
    """Where to write the fine-tuned checkpoint (model + tokenizer + _manifest.json)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    metrics_output: Annotated[Path | None, Output("metrics")] = None
    """Where to write the `metrics` artifact (loss per step); None: `<output>_metrics` beside it."""
    packing: Annotated[bool, Runtime()] = True
    """Padding-free batches (the examples back to back in rows as wide as the longest, attention
    confined to each: stages/common/forward.py) where the architecture takes them; else padded.
    The same loss up to float rounding. Not part of the cache key."""
    loss_on: Literal["answer", "all"] = "answer"
    """Tokens that carry loss for rows with an answer: 'answer' = answer tokens + EOS only,
    'all' = every token after BOS (prompt included)."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the prompts (fractional allowed); ignored when max_steps is set."""
    max_steps: int | None = Field(None, ge=1)
    """Number of optimizer steps; overrides epochs when set."""
    batch_size: int = Field(32, ge=1)
    """Sequences per optimizer step, over all ranks (must divide by the world size)."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """Decay after warm-up: constant, linear to 0, or cosine to 0."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps from 0 to lr."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip (0 disables)."""
    mask_tool_responses: bool = True
    """Answers with tool use (a `<tool_call>`, then the environment's `<tool_response>` block,
    then more of the model's text, e.g. the task stage's sft_tool_fraction): the reply blocks, with
    the new lines around them, carry no loss (the environment writes them, the model only reads
    them) and are tokenised apart from the model's text, as an episode does. Answers without a
    reply train as before. False: every answer token is a target."""
    chat_template: bool | Literal["auto"] = "auto"
    """Lay each example out through the tokenizer's chat template exactly as an episode lays it
    out (stages/sft/chat.py): the prompt's `messages` (or the plain prompt as one user turn), then
    the answer as the model's turns, each followed by the EOS its generation stops on, and a tool-use
    answer's replies as `tool` turns; the loss on the model's turns only. 'auto': when the
    tokenizer has a template (the tiny local tokenizers have none: prompt + answer + EOS, as
    before). Rows without an answer stay plain text. In a pipeline it follows the rollout's."""
    system_prompt: str | None = None
    """A system turn before each chat example's messages, as the rollout's `system_prompt` (in a
    pipeline it follows the rollout's): the warm start sees what the episodes will show."""
    environment: EnvironmentSpec | None = None
    """The rollout's environment, whose tools' schemas a chat template that shows tools renders in
    each example's opening as in the episodes (in a pipeline it follows the rollout's)."""
    max_length: int = Field(128, ge=2)
    """Sequences longer than this many tokens are truncated (from the right)."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage."""
    seed: int = 0
    """Seeds data order (and dropout, if any)."""
    run: Annotated[str, Assigned()] = "sft"
    """Run name recorded in the metrics rows."""
    iteration: Annotated[int, Assigned()] = 0
    """Iteration recorded in the metrics rows."""

    @model_validator(mode="after")
    def _system_prompt_needs_the_template(self) -> SFTConfig:
        if self.system_prompt is not None and self.chat_template is False:
            raise ValueError("system_prompt needs the chat template (a system turn is a chat turn): "
                             "set chat_template to true or 'auto', or remove system_prompt")
        return self

    @property
    def metrics_path(self) -> Path:
        return self.metrics_output or self.output.with_name(self.output.name + "_metrics")
