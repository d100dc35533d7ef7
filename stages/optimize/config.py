"""Config of the policy-optimisation stage (DeepSpeed; PPO-clip family, GRPO and PPO)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from rlpipe.schemas.config import (
    Assigned,
    ImportRef,
    Input,
    Output,
    Runtime,
    StageConfig,
    Variant,
    name_shorthand,
)
from rlpipe.stages.advantage.config import KLEstimator
from rlpipe.stages.common import LOGPROB_CHUNK_TOKENS
from rlpipe.stages.common.model_loading import ComputeDtype, ModelLoading


# ---------------------------------------------------------------------------------------------
# Policy losses: one variant per loss, each registered with its function in losses.py
# (`@register_policy_loss(<variant>)`; a test keeps the tags equal to the registry's names).
# ---------------------------------------------------------------------------------------------
class PPOClipLoss(Variant):
    """PPO clipped surrogate on the token ratio rho_t (Schulman et al. 2017)."""

    name: Literal["ppo_clip"] = "ppo_clip"
    """Loss name."""
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip range: the ratio is clipped at 1 - eps_low."""
    eps_high: float = Field(0.2, ge=0.0)
    """Upper clip range: 1 + eps_high (> eps_low is DAPO's clip-higher, 0.28)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip constant c > 1 bounding the loss of negative advantages by -c * A; None disables it."""


class GSPOLoss(Variant):
    """GSPO: the clipped surrogate on the sequence ratio s_i = exp(mean_t log rho_t) (Zheng et al. 2025)."""

    name: Literal["gspo"] = "gspo"
    """Loss name."""
    eps_low: float = Field(3e-4, ge=0.0, lt=1.0)
    """Lower clip range of s_i: 1 - eps_low (the paper's 3e-4)."""
    eps_high: float = Field(4e-4, ge=0.0)
    """Upper clip range of s_i: 1 + eps_high (the paper's 4e-4)."""


class TRPOLoss(Variant):
    """TRPO (Schulman et al. 2015): maximise the importance-weighted surrogate subject to
    mean KL(pi_old || pi_new) <= max_kl, by one natural-gradient step per optimizer step (conjugate
    gradient on Fisher-vector products, then a backtracking line search); see trpo.py.

    The policy is not stepped by AdamW (lr, grad_clip and betas do not apply to it); the critic
    still is, as in PPO. Needs ZeRO 0 or 1 (the step is computed on the whole flat parameters).
    """

    name: Literal["trpo"] = "trpo"
    """Loss name."""
    max_kl: float = Field(0.01, gt=0.0)
    """delta: the bound on the mean (over response tokens) KL(pi_old || pi_new) of one step."""
    cg_iters: int = Field(10, ge=1)
    """Conjugate-gradient iterations solving (F + damping I) s = g."""
    cg_damping: float = Field(0.1, ge=0.0)
    """Damping lambda added to the Fisher: (F + lambda I) v (keeps the solve well conditioned)."""
    backtrack_ratio: float = Field(0.5, gt=0.0, lt=1.0)
    """The line search tries step fractions 1, r, r^2, ... of the full step."""
    backtrack_steps: int = Field(10, ge=1)
    """How many step fractions the line search tries before giving up (no update)."""


class CustomLoss(Variant):
    """A user policy loss `fn(logp, old_logp, advantages, mask, **kwargs)`, imported from `function`.

    All four inputs are (B, T) tensors of one micro-batch (B responses, T = longest response):
    `logp` the training policy's per-token log-probs (differentiable), `old_logp` the behaviour
    log-probs, `advantages` the per-token advantages, `mask` 1.0 on real response tokens. `fn`
    returns the per-token loss l[b, t] (to be minimised), a (B, T) tensor differentiable w.r.t.
    `logp`, or an `rlpipe.stages.optimize.losses.PolicyLossOutput` (loss and statistics). The
    stage aggregates it with `agg_mode`; a wrong shape stops it with an error naming `function`.
    """

    name: Literal["custom"] = "custom"
    """Loss name."""
    function: ImportRef
    """Import path 'package.module:function' of the loss (importable on every rank)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed on every call (JSON-able)."""


LossConfig = Annotated[
    PPOClipLoss | GSPOLoss | TRPOLoss | CustomLoss,
    Field(discriminator="name"),
    BeforeValidator(name_shorthand),
]
"""A policy loss and its knobs: `{name: gspo, eps_high: 5e-4}`, or just its name (`gspo`)."""


class LoRAConfig(BaseModel):
    """LoRA adapters on the policy (peft; stages/optimize/lora.py, docs/algorithms.md#lora):
    h = W x + (alpha / r) B A x on each targeted linear layer, W frozen, only A and B trained.

    No dropout knob: optimize runs without dropout (the first ratio must be exactly 1 and the PPO
    ratio free of dropout noise; engine.disable_dropout), so LoRA dropout is 0 too."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    r: int = Field(8, ge=1)
    """Rank r of the update B A."""
    alpha: float = Field(16.0, gt=0.0)
    """alpha of the scale alpha / r of the update."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Layers that get adapters: 'all-linear' (peft: every linear layer but the output head, on
    any architecture), or module-name suffixes such as [q_proj, v_proj]."""


#: Iterations between train-state saves where the optimize engines stay alive (`state_every`).
DEFAULT_STATE_EVERY = 10


class OptimizeConfig(StageConfig):
    """Optimise the policy (and the PPO critic) on saved rollouts and advantages with DeepSpeed.

    Reads the rollouts (tokens, rollout log-probs) and advantages artifacts joined on
    (iteration, group_id, sample_index), runs `epochs` passes of shuffled minibatches, and writes the
    new policy (and critic) as Hugging Face checkpoints plus a `metrics` artifact.
    The training state (fp32 master weights, AdamW moments and step counts, LR-scheduler state, the
    stage's RNG state, the global step) persists between iterations: read from `train_state` when
    given (then the optimize steps of the `replay` checkpoints, when saved every `state_every`
    iterations), written to `train_state_output` (DeepSpeed's own checkpoint; see state.py).
    """

    policy: Annotated[Path, Input("checkpoint")]
    """Policy checkpoint to start from (Hugging Face directory)."""
    rollouts: Annotated[Path, Input("rollouts")]
    """`rollouts` artifact: prompt/response token ids and the rollout engine's log-probs."""
    advantages: Annotated[Path, Input("advantages")]
    """`advantages` artifact: per-token advantages (+ returns, values, ref log-probs)."""
    reference: Annotated[Path | None, Input("reference")] = None
    """Optional `reference` artifact with per-token reference log-probs (used instead of the
    advantages' `ref_logprobs` column when given)."""
    critic: Annotated[Path | None, Input("checkpoint")] = None
    """Critic checkpoint (PPO): a critic (critic_init stage) or reward-model checkpoint, or a causal
    LM whose backbone gets a new scalar head (scalar_head.py). None: no critic is trained."""
    output: Annotated[Path, Output("checkpoint")]
    """Where the new policy checkpoint goes (its `_manifest.json` is written last of all)."""
    loading: Annotated[ModelLoading, Runtime()] = ModelLoading()
    """How the stage loads its models (trust_remote_code, attn_implementation); in a preset,
    `model.loading` sets it for every stage. Not part of the cache key."""
    train_state: Annotated[Path | None, Input("train_state")] = None
    """The last saved `train_state` artifact to continue from (optimizer moments, fp32 masters, LR
    schedule, global step, RNG); None: a fresh AdamW at global step 0."""
    replay: Annotated[list[Path], Input("checkpoint")] = []
    """Policy checkpoints written by the optimize runs after `train_state` that saved no state
    (`state_every` > 1), oldest first. Their optimize steps are rerun from `train_state`, each on its
    own inputs with its own knobs (as its manifest records them; nothing is written), before this
    run's: unless a warm engine of this process holds the state after the last of them. The replayed
    policy must equal the last checkpoint bit for bit (else a clear error: a changed input or
    nondeterminism). Empty: this run continues from `train_state` itself."""
    critic_output: Annotated[Path | None, Output("checkpoint")] = None
    """Where the new critic checkpoint goes; required when `critic` is set."""
    metrics_output: Annotated[Path, Output("metrics")]
    """Where the `metrics` artifact (one row per step and metric) goes."""
    train_state_output: Annotated[Path | None, Output("train_state", background=True)] = None
    """Where the training state after this stage goes (DeepSpeed checkpoint + manifest); None:
    not written."""
    run: Annotated[str, Assigned()] = "run"
    """Run name written into the metrics rows."""

    loss: LossConfig = PPOClipLoss()
    """Policy loss and its knobs, `{name: ..., <knob>: ...}` or a bare name; name: ppo_clip, gspo,
    trpo (a KL-constrained natural-gradient step instead of AdamW), custom (a user function)."""
    agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation over tokens and sequences (denominators are global over ranks and micro-batches)."""
    max_len: int | None = Field(None, ge=1)
    """Constant L of seq-mean-token-sum-norm; None: the longest response of the batch, in tokens the
    model sampled (an episode's environment tokens are not counted)."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator for KL in the loss (and the logged KL to the reference)."""
    kl_clamp: bool = True
    """Clamp the k3 estimate (log-ratio to [-20, 20], value to <= 10; stages/advantage/kl.py):
    one token far off the reference cannot put e^40 into the loss."""
    kl_beta: float = Field(0.0, ge=0.0)
    """beta of `+ beta * agg(k)`; > 0 needs reference log-probs (advantages or `reference`)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """c_H of the entropy bonus `- c_H * agg(H)`."""
    value_coef: float = Field(0.5, ge=0.0)
    """c_V: scale of the critic's clipped value loss."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """eps_v of the clipped value loss; None: plain 0.5 (V - R)^2."""

    lr: float = Field(1e-6, gt=0.0)
    """Policy peak learning rate (AdamW), scaled per optimizer step by `lr_schedule`."""
    critic_lr: float = Field(1e-5, gt=0.0)
    """Critic peak learning rate (AdamW), scaled by the same schedule."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR factor over the whole run, counted in optimizer steps s across iterations (the step count
    persists in the train state): warm-up (s + 1) / warmup_steps for s < warmup_steps, then
    constant 1, linear 1 - (1 - m) p or cosine m + (1 - m) (1 + cos(pi p)) / 2 with
    p = (s - warmup_steps) / (total_steps - warmup_steps) clamped to [0, 1], m = min_lr_ratio."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up at the start of the run (0: none)."""
    total_steps: int | None = Field(None, ge=1)
    """Optimizer steps of the whole run (iterations x steps per iteration, where steps per
    iteration = epochs x rows / minibatch_size); needed by linear and cosine."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """m: the factor linear and cosine decay to at `total_steps`."""
    state_every: int | None = Field(None, ge=1)
    """N: the pipeline writes the train state (~12-16 bytes per parameter) after iterations N-1,
    2N-1, ... and the last one. An iteration after one that saved none reads the last saved state
    plus the policy checkpoints since (`replay`): where the engines stay alive between iterations
    (in the driver's process, or on resident workers) nothing is replayed; a resumed run replays
    those (at most N-1) iterations' optimize steps from their saved artifacts, says what that cost,
    and ends identical to an uninterrupted run. 1: every iteration saves it (nothing is ever
    replayed). None (the default): `DEFAULT_STATE_EVERY` (10) where the engines stay alive, 1 where
    every call launches anew (`launch.resident: false`, which would replay every run since the last
    save at each iteration). Why 10: saving costs ~14 bytes per parameter on the disk each time
    (a 7B model: ~100 GB), and trainers save on a cadence (NeMo-RL and SkyRL every 10 steps, verl
    and OpenRLHF only when asked); a crash then costs at most 9 replayed optimize runs, which
    resume recomputes from artifacts instead of losing them (docs/design.md#train-state)."""
    policy_weights: Annotated[Literal["every_iteration", "with_train_state"], Runtime()] = "every_iteration"
    """Which iterations write the new policy's weight files. 'every_iteration': all (every policy
    can be loaded later: a rollout or evaluation rerun alone from any iteration). 'with_train_state':
    only those that save the train state (`state_every`), the last one and those that evaluate;
    between them the checkpoint holds its config, tokenizer and a manifest with the weights' hashes
    (the same content hash: `Manifest.not_written`), and the weights reach the next rollout in memory
    only (the local runner's transformers engine, or resident members over the weight channel). For a
    policy whose write takes longer than an iteration's compute (a 1B bf16 policy is 1.9 GB: ~1.8 s
    at 1.1 GB/s, against ~0.35 s of compute on an H200; docs/cluster.md#gpu). A resumed run
    recomputes the unwritten policy it needs by rerunning its optimize run (the same bytes, replayed
    from the last saved train state like `state_every`'s). Where the policy is not handed over in
    memory (several ranks without resident workers, LoRA) every iteration writes it. Not part of the
    cache key: the checkpoint's content is the same either way."""
    background_state_save: bool = True
    """Write the train state in a background thread after the policy checkpoint (which the next
    rollout reads), so it leaves the critical path: the next stages run while it is written, and
    the next optimize in the same process waits for it. Its manifest is written last, so a kill
    mid-save leaves no complete-looking state (the rerun recomputes it). False: written before
    the stage returns."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (policy and critic)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Max global gradient norm; 0 disables clipping."""
    epochs: int = Field(1, ge=1)
    """K passes over the batch."""
    minibatch_size: int | None = Field(None, ge=1)
    """Rows per optimizer step over all ranks; None: the whole batch (one step per epoch)."""
    micro_batch_size: int = Field(8, ge=1)
    """Rows per forward/backward pass on one rank (gradient accumulation fills the minibatch); with
    `max_tokens_per_micro_batch`, the most rows one may hold."""
    max_tokens_per_micro_batch: Annotated[int | None, Runtime()] = Field(None, ge=1)
    """Cut each rank's share of a step into micro-batches by tokens (prompt + response) instead of
    rows: the fewest micro-batches of at most this many tokens (and `micro_batch_size` rows) on the
    rank that needs the most, the same count on every rank, each rank's balanced by tokens. The
    step's loss keeps its global token and sequence counts, so the gradient is the same however cut
    (up to summation order). None: `micro_batch_size` rows each. Not part of the cache key."""
    packing: Annotated[bool, Runtime()] = True
    """Padding-free forward and backward passes: a micro-batch's sequences back to back in one row,
    attention confined to each (forward.py), on the architectures where transformers supports it
    (forward.PACKED_MODEL_TYPES; others pad), when the batch's sequences differ in length (one
    length: padded, a plain causal mask). The same log-probs as padded rows up to float rounding.
    Not part of the cache key."""
    logprob_chunk_tokens: int | None = Field(LOGPROB_CHUNK_TOKENS, ge=1)
    """Response tokens whose vocabulary-sized logits exist at once (log-probs and entropy): the LM
    head is applied to the response positions only, this many at a time, in fp32, and each chunk
    is recomputed in the backward instead of kept. Extra memory about (2 x chunk x V + V x H) x 4
    bytes (the chunk's logits, their gradient and the head's weight gradient: 0.33 GB at 256 tokens,
    V = 151,936 and H = 64) instead of the full logits and 4 x rows x response length x V x 4 bytes
    (benchmarks/bench_memory.py).
    None: one chunk of every token (nothing recomputed). Any size gives the same log-probs and
    entropies up to the rounding of the head's matmul over other rows (tests/stages/common)."""
    shuffle: bool = True
    """Shuffle rows (seeded) before cutting each epoch into minibatches."""
    group_by_length: bool = True
    """Within each rank's share of a step, order the rows by length before cutting them into
    micro-batches (as TRL's `group_by_length`), so each micro-batch pads to a length near its rows'
    own: the same rows per step and rank, the same gradient up to summation order, less padding.
    False: micro-batches in the shuffled order."""
    kl_target: float | None = Field(None, gt=0.0)
    """Early stop: stop optimising once a step's approx KL to the old policy exceeds this."""
    recompute_old_logprobs: bool = True
    """Old log-probs from the training model (the optimize input policy, so the first ratio is
    exactly 1); False: use the rollout engine's log-probs (the rollout policy)."""
    tis_cap: float | None = Field(None, gt=0.0)
    """C of truncated importance sampling for the rollout engine / trainer mismatch: the policy
    loss of token t is multiplied by w_t = min(exp(old_t - rollout_t), C) (detached), old_t the
    trainer's old log-prob, rollout_t the engine's (`response_logprobs`). None: off. Needs
    recompute_old_logprobs (else old_t is rollout_t and w_t = 1)."""
    mismatch_mask: float | None = Field(None, gt=0.0)
    """Sequence masking: a response whose mean over its tokens of |old_t - rollout_t| exceeds this
    contributes no policy loss (its KL and entropy terms stay). None: off. Needs
    recompute_old_logprobs."""
    old_logprobs_forward: Literal["training", "separate"] = "training"
    """With recompute_old_logprobs: 'training' takes the old log-probs of the first optimizer
    step's rows from that step's own forward (detached; before any update they are the same
    numbers) and runs a separate no-grad forward only for the other rows; 'separate' runs it for
    every row before training."""

    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of every weight (`{r: 8, alpha: 16}`); None: full fine-tuning.
    The output checkpoint holds the merged weights (rollout loads a plain model) and the adapter
    in output/adapter/; the train state carries the adapters, their AdamW state and the frozen
    base; with kl_beta > 0 and no reference log-probs given, the reference is the same model with
    its adapters disabled. Needs peft (`pip install 'rlpipe[lora]'`); ZeRO 0-2."""

    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage (the template cluster/deepspeed/zero<stage>.json)."""
    offload_optimizer: bool = False
    """ZeRO 1-3: the optimizer state (fp32 masters and AdamW's two moments: 12 of the ~16 bytes a
    trained parameter takes in bf16) in host memory, the optimizer step taken there by the torch
    AdamW (DeepSpeed's ZeRO-Offload): a policy fits on fewer GPUs, at the price of each step's
    gradients down and weights up over PCIe and a CPU step. The same update (bit for bit on a CPU
    run); a train state saved with it on loads with it off and back."""
    offload_params: bool = False
    """ZeRO 3: the parameters' partitions in host memory as well, each module's fetched for its
    forward and backward (ZeRO-Infinity's CPU offload): the least GPU memory, the most traffic."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    dtype: ComputeDtype = "auto"
    """What the policy trains in: 'auto' (bf16 where CUDA is present, else fp32), 'fp32' or 'bf16'
    (bf16 weights and activations, fp32 master weights and AdamW state); in a preset, `model.dtype`
    sets it with the frozen roles'."""
    max_shard_size: str = Field("5GB", pattern=r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
    """Policy and critic checkpoints larger than this are written as several safetensors files
    plus model.safetensors.index.json (Hugging Face's max_shard_size: '5GB', '500MB'); the
    rollout engines, the reference stage and replay read either layout. Under ZeRO-3 with the
    weight channel each file is gathered, sent and written by one rank (partitioned_handoff.py):
    a rank holds at least one file's worth, so a smaller size spreads a small model over more ranks."""
    seed: int = 0
    """Seeds shuffling and the critic head's init."""

    def cache_dict(self) -> dict[str, Any]:
        """As every stage's, less `background_state_save`: when the state is written never
        changes what is written."""
        return {k: v for k, v in super().cache_dict().items() if k != "background_state_save"}

    @model_validator(mode="after")
    def _check(self) -> OptimizeConfig:
        if self.critic is not None and self.critic_output is None:
            raise ValueError("critic is set: set critic_output (where the trained critic goes)")
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs total_steps (optimizer steps of the whole "
                             "run: iterations x epochs x rows / minibatch_size)")
        if self.total_steps is not None and self.warmup_steps >= self.total_steps and self.lr_schedule != "constant":
            raise ValueError(f"warmup_steps {self.warmup_steps} must be < total_steps {self.total_steps}")
        if self.lora is not None and self.zero_stage == 3:
            raise ValueError("lora: ZeRO 3 is not supported (it would partition the frozen base and the adapters "
                             "alike); use zero_stage 0-2: the adapters' optimizer state is small")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1-3 (ZeRO-Offload moves the partitioned optimizer "
                             "state to host memory; ZeRO 0 has none)")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage 3 (only ZeRO 3 partitions the parameters), got "
                             f"{self.zero_stage}; offload_optimizer works from ZeRO 1")
        if isinstance(self.loss, TRPOLoss) and self.zero_stage > 1:
            raise ValueError(f"loss trpo needs zero_stage 0 or 1, got {self.zero_stage}: ZeRO 2/3 partition the "
                             "gradients (and ZeRO 3 the parameters) over ranks, while the conjugate gradient and "
                             "the line search work on the whole flat parameter and gradient vectors")
        if (self.tis_cap is not None or self.mismatch_mask is not None) and not self.recompute_old_logprobs:
            raise ValueError("tis_cap / mismatch_mask need recompute_old_logprobs: true (without it the old "
                             "log-probs are the rollout engine's and there is no mismatch to correct)")
        if self.minibatch_size is not None and self.minibatch_size % self.micro_batch_size:
            raise ValueError(
                f"minibatch_size {self.minibatch_size} is not a multiple of micro_batch_size {self.micro_batch_size}"
            )
        return self
