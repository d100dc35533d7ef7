"""Multi-turn episodes on any rollout engine: one token sequence per episode with a mask of who
wrote each token (1: sampled by the model, trained on; 0: inserted by the environment, never).

The model's tokens are kept exactly as sampled (never re-tokenised), so their log-probs stay the
behaviour policy's; the environment's reply is tokenised on its own and inserted after them:

    prompt | model turn 1 | reply 1 | model turn 2 | ... | model turn n          (mask 1 0 1 .. 1)

`ChatTurns` renders replies with the tokenizer's chat template (the part the template adds for
the reply messages and the next generation prompt, found by rendering a fixed conversation with
and without them, plus whatever closing of the model's turn the model did not sample itself);
`TextTurns` continues raw text (`<tool_response>` blocks, then a new line).

`run_episodes` drives every episode of a batch through the engine's `generate` together, each
advancing on its own: the first turn samples G responses per prompt from the group's seed, as a
single-turn rollout does; each later turn samples one continuation per live episode from a seed
of (group seed, sample, turn). Same seed, same episodes. `EpisodeSampler` is what the rollout
stage calls: groups of episodes as rows of the rollouts schema (`episode_columns`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlpipe.schemas.errors import DataError
from rlpipe.stages.rollout.engines import Engine, Sample, SamplingSpec
from rlpipe.stages.rollout.environments.base import Environment, ModelTurn, StepResult
from rlpipe.stages.rollout.environments.tools import parse_tool_calls, tool_response_text

# ---- how turns become tokens -------------------------------------------------------------------

def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


class ChatTurns:
    """Turns through the tokenizer's chat template (`tools`: the JSON schemas it shows).

    The closing the template writes after an assistant turn (`turn_end`, e.g. '<|im_end|>\n') is
    found by rendering a conversation whose assistant content is a marker no template writes, and
    is compared with the sampled turn as token ids: a turn that ends in the model's own end-of-turn
    token gets the rest of the closing (the new line), a turn cut by max_new_tokens or ended by a
    stop string gets all of it, as ids of the template's special tokens (never plain text that
    reads the same). What is inserted is masked 0: the model is trained on the end-of-turn it
    samples, not on one the environment wrote for it (docs/design.md#multi-turn).
    """

    #: The assistant content of the conversation the closing and the replies are rendered after:
    #: a marker no template writes, so the closing is what follows it (never a letter a template
    #: may also contain).
    _CONTENT = "RLPIPE-ASSISTANT-CONTENT-7F3A"
    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _CONTENT}]

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, system_prompt: str | None = None):
        self.tokenizer, self.tools, self.system_prompt = tokenizer, tools or None, system_prompt
        before = self._render(self._BASE, generation_prompt=False)
        if before.count(self._CONTENT) != 1:
            raise ValueError("the chat template does not write an assistant turn's content once as it is; "
                             "use environment turns as raw text (chat_template: false)")
        self.turn_end = before[before.index(self._CONTENT) + len(self._CONTENT):]
        self.turn_end_ids = _ids(tokenizer(self.turn_end, add_special_tokens=False))
        self._before = before

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def opening(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return _ids(self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=True,
                                                       add_generation_prompt=True))

    def reply(self, messages: Sequence[dict[str, Any]], sampled: list[int]) -> list[int]:
        after = self._render([*self._BASE, *messages], generation_prompt=True)
        if not after.startswith(self._before):
            raise ValueError("the chat template renders earlier turns differently once later ones follow; "
                             "use environment turns as raw text (chat_template: false)")
        close = self.turn_end_ids[sampled_closing(sampled, self.turn_end_ids):]
        return close + _ids(self.tokenizer(after[len(self._before):], add_special_tokens=False))


def uses_chat_template(tokenizer: Any, chat_template: bool | str, checkpoint: Any) -> bool:
    """Whether turns go through `tokenizer`'s chat template, by a stage's `chat_template` knob
    (true, false, or 'auto': when the tokenizer has one); a ConfigError naming `checkpoint` when
    it is true and the tokenizer has none. (The rollout and the sft stage decide it alike.)"""
    from rlpipe.schemas.config_files import ConfigError

    has_template = getattr(tokenizer, "chat_template", None) is not None
    use = has_template if chat_template == "auto" else chat_template
    if use and not has_template:
        raise ConfigError(f"chat_template is true but the tokenizer of {checkpoint} has no chat "
                          "template: set one (tokenizer_config.json 'chat_template') or chat_template=false")
    return bool(use)


def refuse_system_prompt_without_template(system_prompt: str | None, checkpoint: Any) -> None:
    """A ConfigError naming `checkpoint` when a system prompt is set for turns that do not go
    through a chat template (a system turn is a chat turn)."""
    from rlpipe.schemas.config_files import ConfigError

    if system_prompt is not None:
        raise ConfigError(f"system_prompt is set but the tokenizer of {checkpoint} has no chat "
                          "template to put it in: remove system_prompt or give the tokenizer a template")


def sampled_closing(sampled: Sequence[int], closing: Sequence[int]) -> int:
    """How many of the closing's first ids the sampled turn ends with (its end-of-turn token,
    usually 1; 0 for a turn cut by length or ended by a stop string): the largest k with
    sampled[-k:] == closing[:k]."""
    for k in range(min(len(sampled), len(closing)), 0, -1):
        if list(sampled[-k:]) == list(closing[:k]):
            return k
    return 0


class TextTurns:
    """Turns as raw text: each reply message in a block on its own lines."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def opening(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "\n".join(m["content"] for m in messages)
        return _ids(self.tokenizer(text))

    def reply(self, messages: Sequence[dict[str, Any]], sampled: list[int]) -> list[int]:
        blocks = [tool_response_text(m["content"]) if m["role"] == "tool" else m["content"] for m in messages]
        return _ids(self.tokenizer("\n" + "\n".join(blocks) + "\n", add_special_tokens=False))


# ---- episodes ----------------------------------------------------------------------------------

@dataclass
class Turn:
    """One span of an episode's tokens (positions after the prompt, end exclusive)."""

    role: str  # 'model' or 'environment'
    start: int
    end: int
    text: str = ""
    finish_reason: str | None = None  # model turns: 'stop', 'length'; 'context' when the window ran out
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # environment turns: its reply
    reward: float | None = None


@dataclass
class Episode:
    """One episode: the tokens after the prompt, who wrote each, and the turns."""

    prompt_ids: list[int]
    environment: Environment
    messages: list[dict[str, Any]]
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # None where the environment wrote
    turns: list[Turn] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)  # how long each environment step took
    done: bool = False

    @property
    def model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    @property
    def environment_reward(self) -> float | None:
        rewards = [t.reward for t in self.turns if t.reward is not None]
        return sum(rewards) if rewards else None

    def add_model_turn(self, sample: Sample, text: str) -> ModelTurn:
        """Append a sampled turn; `text` is its tokens decoded (a stop string that ended it included)."""
        start = len(self.token_ids)
        self.token_ids += sample.token_ids
        self.mask += [1] * len(sample.token_ids)
        self.logprobs += sample.logprobs
        calls = parse_tool_calls(text)
        self.turns.append(Turn("model", start, len(self.token_ids), text, sample.finish_reason,
                               tool_calls=[{"name": c.name, "arguments": c.arguments, "error": c.error}
                                           for c in calls]))
        self.messages.append({"role": "assistant", "content": text})
        return ModelTurn(text, calls, sample.finish_reason)

    def add_environment_turn(self, result: StepResult, reply_ids: list[int], text: str) -> None:
        start = len(self.token_ids)
        self.token_ids += reply_ids
        self.mask += [0] * len(reply_ids)
        self.logprobs += [None] * len(reply_ids)
        self.turns.append(Turn("environment", start, len(self.token_ids), text, messages=list(result.messages),
                               reward=result.reward))
        self.messages += result.messages


def turn_seed(group_seed: int, sample_index: int, turn: int) -> int:
    """The seed of turn `turn` (>= 1) of sample `sample_index` in a group (63 bits of a SHA-256)."""
    digest = hashlib.sha256(f"{group_seed}/{sample_index}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def run_episodes(engine: Engine, rows: Sequence[dict[str, Any]], group_seeds: Sequence[int],
                 params: SamplingSpec, make_environment: Callable[[], Environment],
                 turns: ChatTurns | TextTurns, max_turns: int) -> list[list[Episode]]:
    """G episodes per prompt row (outer list in row order, inner in sample order)."""
    groups = []
    for row in rows:
        episodes = []
        for _ in range(params.group_size):
            env = make_environment()
            messages = env.reset(row)
            episodes.append(Episode(turns.opening(messages), env, list(messages)))
        need = len(episodes[0].prompt_ids) + params.max_new_tokens
        if need > engine.context_length:
            raise DataError(f"prompt {row.get('prompt_id')!r}: its opening is {len(episodes[0].prompt_ids)} tokens "
                            f"+ max_new_tokens {params.max_new_tokens} = {need} > the model's context of "
                            f"{engine.context_length} tokens")
        groups.append(episodes)
    # Turn 1: G samples per prompt from the group's seed (the group's prompts are the same).
    first = engine.generate([g[0].prompt_ids for g in groups], list(group_seeds), params)
    _advance([(ep, sample) for g, samples in zip(groups, first, strict=True)
              for ep, sample in zip(g, samples, strict=True)], engine, turns, max_turns, params)
    single = replace(params, group_size=1)
    for turn in range(1, max_turns):
        live = [(gi, si, ep) for gi, g in enumerate(groups) for si, ep in enumerate(g) if not ep.done]
        if not live:
            break
        contexts = [ep.prompt_ids + ep.token_ids for _, _, ep in live]
        seeds = [turn_seed(group_seeds[gi], si, turn) for gi, si, _ in live]
        samples = engine.generate(contexts, seeds, single)
        _advance([(ep, s[0]) for (_, _, ep), s in zip(live, samples, strict=True)], engine, turns, max_turns, params)
    return groups


def _advance(pairs: list[tuple[Episode, Sample]], engine: Engine, turns: ChatTurns | TextTurns, max_turns: int,
             params: SamplingSpec) -> None:
    """Add each sampled turn, let its environment answer, and end the episodes that are over.

    An episode always ends on a model turn: when the environment's reply would leave no room for
    another turn of max_new_tokens in the context, the reply is not inserted and the last model
    turn's finish reason is 'context'.
    """
    for ep, sample in pairs:
        said = ep.add_model_turn(sample, turns.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
        started = time.perf_counter()
        result = ep.environment.step(said)
        ep.step_seconds.append(time.perf_counter() - started)
        if result.done or ep.model_turns >= max_turns:
            if result.reward is not None:
                ep.turns[-1].reward = result.reward
            ep.done = True
            continue
        reply = turns.reply(result.messages, sample.token_ids)
        if len(ep.prompt_ids) + len(ep.token_ids) + len(reply) + params.max_new_tokens > engine.context_length:
            ep.turns[-1].finish_reason = "context"  # no room for the reply and another model turn
            ep.done = True
            continue
        ep.add_environment_turn(result, reply, turns.tokenizer.decode(reply, skip_special_tokens=True))


class EpisodeSampler:
    """Groups of episodes as rows of the rollouts schema (`episode_columns`); keeps the totals of
    the environment's step times (`timing`: not in the rows, which stay reproducible)."""

    def __init__(self, engine: Engine, make_environment: Callable[[], Environment], turns: ChatTurns | TextTurns,
                 max_turns: int):
        self.engine, self.make_environment, self.turns, self.max_turns = engine, make_environment, turns, max_turns
        self.timing = {"environment_steps": 0, "environment_s": 0.0, "environment_step_max_s": 0.0}

    def __call__(self, rows: Sequence[dict[str, Any]], group_seeds: Sequence[int],
                 params: SamplingSpec) -> list[list[dict[str, Any]]]:
        groups = run_episodes(self.engine, rows, group_seeds, params, self.make_environment, self.turns,
                              self.max_turns)
        steps = [t for group in groups for ep in group for t in ep.step_seconds]
        self.timing["environment_steps"] += len(steps)
        self.timing["environment_s"] += sum(steps)
        self.timing["environment_step_max_s"] = max([self.timing["environment_step_max_s"], *steps])
        return [[episode_columns(ep, self.engine.tokenizer) for ep in group] for group in groups]


def episode_columns(ep: Episode, tokenizer: Any) -> dict[str, Any]:
    """An episode's columns of the rollouts schema (schemas/rollouts.py, version 3)."""
    model = [t for t in ep.turns if t.role == "model"]
    rewards = [t.reward for t in ep.turns if t.reward is not None]
    return {
        "prompt_token_ids": ep.prompt_ids,
        "response": tokenizer.decode(ep.token_ids, skip_special_tokens=True),
        "response_token_ids": ep.token_ids,
        "response_logprobs": ep.logprobs,
        "response_mask": ep.mask,
        # the row's: its last model turn's ('context' is a truncation as 'length' is)
        "finish_reason": "length" if model[-1].finish_reason == "context" else model[-1].finish_reason,
        "num_turns": len(model),
        "turns": [{
            "role": t.role, "start": t.start, "end": t.end, "text": t.text, "finish_reason": t.finish_reason,
            "tool_calls": [{"name": c["name"], "arguments": json.dumps(c["arguments"], sort_keys=True),
                            "error": c["error"]} for c in t.tool_calls],
            "tool_results": [{"name": m.get("name"), "content": m.get("content")} for m in t.messages
                             if m.get("role") == "tool"],
            "reward": t.reward,
        } for t in ep.turns],
        "environment_reward": sum(rewards) if rewards else None,
    }
