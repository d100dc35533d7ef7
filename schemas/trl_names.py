"""TRL's GRPOConfig names and where their meaning lives in a preset: the error line a user gets
for a TRL name (`num_generations=8`, `optimize.beta=0.1`) names rlpipe's key instead of listing
the allowed ones (`config.parse_config`). Hints, not aliases: each concept keeps its one rlpipe
name. docs/from_trl.md lists the same table (a test keeps them in step)."""

from __future__ import annotations

#: TRL's name -> (the preset key that holds its meaning, what differs or needs saying).
TRL_NAMES: dict[str, tuple[str, str]] = {
    "num_generations": ("rollout.group_size", "the samples per prompt"),
    "num_iterations": ("optimize.epochs", "the passes over each iteration's rollouts; rlpipe's `iterations` "
                                          "counts RL steps, TRL's max_steps"),
    "max_steps": ("iterations", "RL steps: each samples, scores and updates once"),
    "num_train_epochs": ("iterations", "rlpipe counts RL steps, each on prompts_per_iteration prompts"),
    "beta": ("optimize.kl_beta", "the KL coefficient in the loss (advantage.kl.beta puts KL in the reward)"),
    "epsilon": ("optimize.loss.eps_low", "the lower clip range (optimize.loss.eps_high the upper)"),
    "epsilon_high": ("optimize.loss.eps_high", "the upper clip range"),
    "importance_sampling_level": ("optimize.loss", "optimize.loss=gspo for sequence-level ratios"),
    "loss_type": ("optimize.agg_mode", "how token losses are averaged over tokens and sequences"),
    "scale_rewards": ("advantage.estimator.scale", "the group (or batch) standard deviation the advantages "
                                                   "are divided by"),
    "reward_weights": ("score.components", "a `weight` on each reward component"),
    "max_completion_length": ("rollout.max_new_tokens", "the tokens sampled per response"),
    "temperature": ("rollout.temperature", "the sampling temperature"),
    "top_p": ("rollout.top_p", "nucleus sampling"),
    "top_k": ("rollout.top_k", "top-k sampling"),
    "use_vllm": ("rollout.engine", "rollout.engine=vllm"),
    "vllm_gpu_memory_utilization": ("rollout.gpu_memory_utilization", "vLLM's share of GPU memory"),
    "vllm_tensor_parallel_size": ("rollout.tensor_parallel_size", "vLLM's tensor parallelism"),
    "learning_rate": ("optimize.lr", "the policy's learning rate"),
    "lr_scheduler_type": ("optimize.lr_schedule", "the learning-rate schedule"),
    "warmup_steps": ("optimize.warmup_steps", "optimizer steps of linear warm-up"),
    "weight_decay": ("optimize.weight_decay", "AdamW's weight decay"),
    "max_grad_norm": ("optimize.grad_clip", "the global gradient-norm clip"),
    "per_device_train_batch_size": ("optimize.micro_batch_size", "rows per forward pass on a rank "
                                                                 "(optimize.minibatch_size: rows per optimizer step)"),
    "gradient_accumulation_steps": ("optimize.minibatch_size", "rows per optimizer step; the accumulation "
                                                               "follows from it and optimize.micro_batch_size"),
    "steps_per_generation": ("optimize.minibatch_size", "optimizer steps per iteration = its rows / minibatch_size"),
    "gradient_checkpointing": ("optimize.gradient_checkpointing", "recompute activations in the backward pass"),
    "bf16": ("model.dtype", "model.dtype=bf16: optimize in bf16 (fp32 master weights kept), the frozen roles too"),
    "per_device_eval_batch_size": ("evaluate.batch_size", "the held-out evaluation's batch"),
    "eval_steps": ("eval_every", "iterations between held-out evaluations"),
    "report_to": ("loggers", "the metric sinks: tensorboard, mlflow, wandb"),
    "save_steps": ("keep.checkpoints_every", "the policies a run keeps (every one is written: runs resume)"),
    "save_total_limit": ("keep.checkpoints_every", "which policies a run keeps (keep.best, keep.train_states)"),
    "output_dir": ("--run-dir", "the run directory, an option of `rlpipe run`"),
    "model_init_kwargs": ("model.loading", "how every stage loads its models: trust_remote_code, "
                                           "attn_implementation (the dtype: model.dtype)"),
}


def trl_hint(key: str) -> str | None:
    """For an unknown key at the top of a config (a preset's, or a stage's: `optimize.beta` in a
    preset is the optimize config's `beta`), the line naming rlpipe's key when it is a TRL name;
    else None (a nested key is some variant's knob, not TRL's)."""
    if key not in TRL_NAMES:
        return None
    where, meaning = TRL_NAMES[key]
    return f"TRL's {key} is rlpipe's {where}: {meaning}"
