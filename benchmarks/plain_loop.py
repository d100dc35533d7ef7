"""The plain loop `bench_loop.py` puts beside the pipeline: one process, everything in memory, the
same math as the stages (see bench_loop.py's doc)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


class PlainGRPO:
    """One iteration = sample, reward, advantages, (reference), one persistent-AdamW update, all in
    memory; the knobs are the pipeline plan's stage configs of the same iteration."""

    def __init__(self, plan: Any):
        from rlpipe.schemas import PROMPTS, read_table_artifact
        from rlpipe.stages.common.deepspeed import use_bf16
        from rlpipe.stages.common.tiny import load_checkpoint
        from rlpipe.stages.optimize.core import lr_factor
        from rlpipe.stages.rollout.hf_engine import TransformersEngine

        self.plan = plan
        calls = {c.name: c.config for c in plan.iteration(0)}
        unsupported = [name for name in ("filter",) if name in calls]
        if calls["optimize"].critic is not None or unsupported or calls["rollout"].engine != "transformers":
            raise SystemExit("bench_loop: the plain loop implements GRPO-style presets (no critic, no filter, "
                             "the transformers engine)")
        o = calls["optimize"]
        start = plan.start_policy()
        self.model, self.tokenizer = load_checkpoint(start)  # its own trainable copy
        self.reference = load_checkpoint(start)[0] if calls.get("reference") is not None else None
        self.engine = TransformersEngine(start, calls["rollout"])
        self.engine.model = self.model  # the engine's decode loop over the plain loop's model
        # The rollout's device (a GPU where there is one), the pipeline's too; where optimize trains
        # in bf16 (DeepSpeed: bf16 weights, fp32 masters), the plain loop's forward and backward run
        # under bf16 autocast over fp32 weights: the same matrix products, AdamW on fp32 as its masters.
        self.device = self.engine.device
        self.model.to(self.device)
        if self.reference is not None:
            self.reference.to(self.device)
        self.bf16 = self.device.type == "cuda" and use_bf16(o.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, o.lr_schedule, warmup_steps=o.warmup_steps, total_steps=o.total_steps, min_lr_ratio=o.min_lr_ratio))
        self.prompts = read_table_artifact(calls["rollout"].prompts, PROMPTS).to_pylist()
        self.rewards: list[float] = []
        self.phases: list[dict[str, float]] = []  # per iteration: seconds of sample, reward+advantages, optimize

    def iteration(self, k: int) -> None:
        from rlpipe.stages.common.forward import pack, response_logprobs, teacher_forced_logprobs
        from rlpipe.stages.rollout.core import group_seed, select_prompts
        from rlpipe.stages.rollout.engines import SamplingSpec

        calls = {c.name: c.config for c in self.plan.iteration(k)}
        r, o = calls["rollout"], calls["optimize"]
        # 1. Sample: the rollout stage's prompts, seeds, batches and knobs.
        groups = [self.prompts[i] for i in select_prompts(len(self.prompts), r.group_count(), r.prompt_offset)]
        prompt_ids = [list(self.tokenizer(g["prompt"]).input_ids) for g in groups]
        params = SamplingSpec(group_size=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), stop_token_ids=tuple(r.stop_token_ids))
        t0 = time.perf_counter()
        self.model.eval()
        samples = []
        for lo in range(0, len(groups), r.batch_size):
            ids = range(lo, min(lo + r.batch_size, len(groups)))
            samples += self.engine.generate([prompt_ids[g] for g in ids],
                                            [group_seed(r.seed, r.iteration, g) for g in ids], params)
        rows = [(g, i, s) for g, group in enumerate(samples) for i, s in enumerate(group)]  # (group_id, sample_index)
        prompts = [prompt_ids[g] for g, _, _ in rows]
        responses = [s.token_ids for _, _, s in rows]
        t1 = time.perf_counter()
        # 2. Reward: the score stage's components, R = sum_k w_k r_k.
        reward = self._reward(calls["score"], groups, rows)
        self.rewards.append(float(reward.mean()))
        # 3. Advantages: the preset's estimator on (R, group ids); A_t = A_i on every token.
        adv = self._advantages(calls["advantage"], reward, rows, responses)
        ref = (teacher_forced_logprobs(self.reference, prompts, responses, self.engine.pad_id)
               if self.reference is not None else None)
        t2 = time.perf_counter()
        # 4. Optimize: the stage's row schedule, loss and one persistent AdamW.
        self._optimize(o, prompts, responses, adv, ref, pack, response_logprobs)
        self.phases.append({"sample": t1 - t0, "reward+advantage": t2 - t1, "optimize": time.perf_counter() - t2})

    def _reward(self, score: Any, groups: list[dict], rows: list) -> np.ndarray:
        from rlpipe.stages.score.core import combine
        from rlpipe.stages.score.scorers import Rows, build_scorer, run_scorer

        view = Rows(shard=Path("plain"), prompts=[groups[g]["prompt"] for g, _, _ in rows],
                    responses=[s.text for _, _, s in rows], answers=[groups[g]["answer"] for g, _, _ in rows],
                    lengths=np.array([len(s.token_ids) for _, _, s in rows]), group_ids=[g for g, _, _ in rows],
                    sample_indices=[i for _, i, _ in rows], metadata=[{} for _ in rows])
        values = [run_scorer(c, build_scorer(c), view) for c in score.components]
        return combine([c.weight for c in score.components], values)

    def _advantages(self, advantage: Any, reward: np.ndarray, rows: list, responses: list) -> list[np.ndarray]:
        from rlpipe.stages.advantage.estimators import AdvantageInputs, compute_advantages
        from rlpipe.stages.advantage.kl import last_token_rewards
        from rlpipe.stages.common.tables import length_mask

        if advantage.kl.in_reward:
            raise SystemExit("bench_loop: KL in the reward is not in the plain loop")
        rewards = torch.tensor(reward, dtype=torch.float64)
        mask = length_mask(torch.tensor([len(x) for x in responses], dtype=torch.long))
        out = compute_advantages(advantage.estimator, AdvantageInputs(
            rewards, torch.tensor([g for g, _, _ in rows]), mask, last_token_rewards(rewards, mask)))
        return [out.token_advantages[b, : len(x)].float().numpy() for b, x in enumerate(responses)]

    def _optimize(self, o: Any, prompts: list, responses: list, adv: list, ref: list | None, pack: Any,
                  response_logprobs: Any) -> None:
        from rlpipe.stages.optimize.core import (
            PolicyObjective,
            epoch_order,
            policy_micro_loss,
            step_slices,
        )
        from rlpipe.stages.optimize.data import pad_rows

        obj = PolicyObjective(loss=o.loss, agg_mode=o.agg_mode, kl_estimator=o.kl_estimator, kl_beta=o.kl_beta,
                              entropy_coef=o.entropy_coef, kl_clamp=o.kl_clamp)
        n = len(responses)
        lengths = np.array([len(x) for x in responses])
        max_len = o.max_len or int(lengths.max())
        old: dict[int, np.ndarray] = {}
        self.model.train()
        for epoch in range(o.epochs):
            for micro_batches in step_slices(epoch_order(n, o.seed, epoch, o.shuffle), o.minibatch_size or n, 1, 0,
                                             o.micro_batch_size):
                picked = lengths[np.concatenate(micro_batches)]
                n_tok, n_seq = float(picked.sum()), float((picked > 0).sum())
                for rows in micro_batches:
                    packed = pack([prompts[i] for i in rows], [responses[i] for i in rows],
                                  self.engine.pad_id).to(self.device)
                    T = packed.mask.shape[1]
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                        logits = self.model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
                    logp = response_logprobs(logits, packed)
                    if int(rows[0]) not in old:  # before the first update: old = this forward, detached
                        old.update({int(i): logp[b, : len(responses[i])].detach().cpu().numpy().copy()
                                    for b, i in enumerate(rows)})
                    old_b, adv_b, ref_b = (None if x is None else pad_rows(x, rows, T).to(self.device)
                                           for x in (old, adv, ref))
                    loss, _ = policy_micro_loss(
                        obj, logp, old_b, adv_b, packed.mask, token_count=n_tok, seq_count=n_seq,
                        max_len=max_len, ref_logp=ref_b)
                    loss.backward()
                if o.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
                self.opt.step()
                self.schedule.step()
                self.opt.zero_grad(set_to_none=True)
