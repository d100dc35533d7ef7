"""The demo's synthetic verifiable task: small integer arithmetic, e.g. prompt "23+45=", answer "68".

The format is compact on purpose: the tiny tokenizer (`rlpipe.stages.common.tiny.train_tokenizer`)
splits digits into single tokens, so "23+45=" is BOS 2 3 + 4 5 = (7 tokens) and the answer "68" is
two tokens plus EOS. A rule-based verifier checks the response against the `answer` column
(exact match after stripping whitespace).

Problems are enumerated from the difficulty knobs (operand range, operations), shuffled with the
seed, and cut into disjoint train / held-out splits, so the held-out accuracy measures
generalisation to unseen problems of the same distribution.

Usage (the `task` stage does this from its config):
    task = ArithmeticTask(a_range=(0, 99), b_range=(0, 99), ops=("+",))
    paths = write_task(run_dir / "task", task, n_train=4000, n_heldout=200, seed=0)
    texts = tokenizer_texts(task)             # for train_tokenizer (the base_model stage)

Tool use (`sft_tool_fraction` of the task stage): an SFT answer may be a calculator trace in the
raw-text episode format of `rlpipe.stages.rollout.environments.tools`; prompt and answer read

    23*45=<tool_call>
    {"name": "calculator", "arguments": {"expression": "23*45"}}
    </tool_call>
    <tool_response>
    1035
    </tool_response>
    1035

where the `<tool_response>` block (with the new lines around it) is what the environment
inserts; the sft stage trains on the rest only (`SFTConfig.mask_tool_responses`).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from rlpipe.schemas import PROMPTS, Manifest, write_table_artifact

Op = Literal["+", "-", "*"]
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticTask:
    """Difficulty knobs of the arithmetic task.

    Attributes:
        a_range: (lowest, highest) first operand, inclusive; (0, 99) gives two-digit numbers.
        b_range: (lowest, highest) second operand, inclusive; (0, 9) makes '+' much easier
            (units-digit table plus a carry into the copied tens digit).
        ops: operations to draw from: '+', '-' (a >= b, so answers stay non-negative), '*'.
        zero_pad: write both operands with leading zeros to the width of the largest operand
            ("07+35="): every digit then sits at a fixed position, which small models learn much
            faster. Answers are never padded.
        question: the prompt's text as a format string of {a}, {op} and {b} ("What is {a} {op}
            {b}?"), for a model that reads questions; None: the compact "23+45=".
    """

    a_range: tuple[int, int] = (0, 99)
    b_range: tuple[int, int] = (0, 99)
    ops: tuple[Op, ...] = ("+",)
    zero_pad: bool = False
    question: str | None = None

    @property
    def width(self) -> int:
        """Digits per operand in the prompt (0: no padding)."""
        return len(str(max(self.a_range[1], self.b_range[1]))) if self.zero_pad else 0

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("a_range", self.a_range), ("b_range", self.b_range)):
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 0 <= low <= high, got {(lo, hi)}")
        unknown = [o for o in self.ops if o not in _APPLY]
        if unknown or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {sorted(_APPLY)}, got {self.ops}")
        if self.question is not None:
            check_question(self.question)


def check_question(question: str) -> None:
    """Raises ValueError when `question` is not a format string of {a}, {op} and {b} alone."""
    try:
        question.format(a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"question {question!r} must be a format string with only {{a}}, {{op}} and {{b}} "
                         f"in braces (double a literal brace: '{{{{'): {type(e).__name__}: {e}") from None


#: The task the SFT warm-start study settled on (measured with the real sft + evaluate stages,
#: size 'demo' model, 1 torch thread): 200 SFT problems, 100 held-out, SFT max_steps=300,
#: batch 32, lr 3e-3, warmup 20, cosine -> held-out greedy accuracy 0.28 / 0.49 / 0.30 for
#: seeds 0 / 1 / 2, 17.5-19.2 s of SFT CPU time each. Two-digit sums with b in 0..99 or
#: a in 0..99 learn far slower (under 10% after 400 steps).
DEMO_TASK = ArithmeticTask(a_range=(0, 29), b_range=(0, 9))


@dataclass(frozen=True)
class Problem:
    a: int
    op: Op
    b: int
    width: int = 0
    """Operands are zero-padded to this many digits (0: no padding)."""
    question: str | None = None
    """The prompt as a question (ArithmeticTask.question); None: the compact form."""

    @property
    def prompt(self) -> str:
        if self.question is not None:
            return self.question.format(a=self.a, op=self.op, b=self.b)
        return f"{self.a:0{self.width}d}{self.op}{self.b:0{self.width}d}=" if self.width else f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(_APPLY[self.op](self.a, self.b))

    @property
    def text(self) -> str:
        """Prompt followed by its answer: one SFT / tokenizer training text."""
        return self.prompt + self.answer

    @property
    def prompt_id(self) -> str:
        """'23+45' whatever the prompt's form."""
        return f"{self.a:0{self.width}d}{self.op}{self.b:0{self.width}d}" if self.width else f"{self.a}{self.op}{self.b}"


def all_problems(task: ArithmeticTask) -> list[Problem]:
    """Every problem the knobs allow, in a fixed order."""
    a_values = range(task.a_range[0], task.a_range[1] + 1)
    b_values = range(task.b_range[0], task.b_range[1] + 1)
    return [
        Problem(a, op, b, task.width, task.question)
        for op in task.ops
        for a, b in itertools.product(a_values, b_values)
        if not (op == "-" and a < b)
    ]


def make_splits(task: ArithmeticTask, n_train: int, n_heldout: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint (train, held-out) problem lists, drawn without replacement with `seed`.

    Raises:
        ValueError: when the knobs allow fewer than n_train + n_heldout distinct problems.
    """
    splits = split_problems(task, {"train": n_train, "heldout": n_heldout}, seed)
    return splits["train"], splits["heldout"]


def split_problems(task: ArithmeticTask, sizes: Mapping[str, int], seed: int) -> dict[str, list[Problem]]:
    """Disjoint named splits: the problems are shuffled with `seed` and cut in the order of `sizes`.

    Raises:
        ValueError: when the knobs allow fewer distinct problems than the sizes add up to.
    """
    problems = all_problems(task)
    need = sum(sizes.values())
    if need > len(problems):
        wanted = " + ".join(f"{n} {name}" for name, n in sizes.items())
        raise ValueError(
            f"{task} has {len(problems)} distinct problems; cannot draw {wanted} "
            f"(widen the operand range or add ops)"
        )
    random.Random(seed).shuffle(problems)
    out, start = {}, 0
    for name, n in sizes.items():
        out[name] = problems[start : start + n]
        start += n
    return out


def write_prompts(path: Path | str, problems: Sequence[Problem], *, split: str, task: ArithmeticTask,
                  seed: int, cache_key: str | None = None) -> Manifest:
    """Write `problems` as a `prompts` artifact (prompt_id, prompt, answer, metadata JSON)."""
    meta = {"task": "arithmetic", "split": split, **_knobs(task)}
    return write_table_artifact(
        path, PROMPTS,
        {
            "prompt_id": [p.prompt_id for p in problems],
            "prompt": [p.prompt for p in problems],
            "answer": [p.answer for p in problems],
            "metadata": [json.dumps({**meta, "a": p.a, "op": p.op, "b": p.b}) for p in problems],
            "messages": [None] * len(problems),
        },
        stage="task",
        config={"task": _knobs(task), "split": split, "seed": seed, "rows": len(problems)},
        cache_key=cache_key,
    )


def _knobs(task: ArithmeticTask) -> dict:
    """The task's knobs as recorded in the artifacts (no question key when there is none: the
    artifacts of a compact task stay what they were before the knob existed)."""
    knobs = asdict(task)
    if knobs["question"] is None:
        del knobs["question"]
    return knobs


def write_task(out_dir: Path | str, task: ArithmeticTask, *, n_train: int, n_heldout: int, seed: int,
               n_sft: int = 0) -> dict[str, Path]:
    """Write the splits as `prompts` artifacts under `out_dir`; returns their paths.

    Args:
        n_train: prompts for RL training ('train').
        n_heldout: prompts for evaluation only ('heldout').
        n_sft: when > 0, a third disjoint split ('sft') for the supervised warm start, so RL
            trains on problems the warm start never saw (as the held-out ones).

    Returns:
        {'train': out_dir/'train', 'heldout': out_dir/'heldout'} (+ 'sft': out_dir/'sft').
    """
    out = Path(out_dir)
    sizes = {"train": n_train, "heldout": n_heldout} | ({"sft": n_sft} if n_sft else {})
    paths = {}
    for name, problems in split_problems(task, sizes, seed).items():
        paths[name] = out / name
        write_prompts(paths[name], problems, split=name, task=task, seed=seed)
    return paths


def write_mixed_format_copy(src: Path | str, dst: Path | str, *, fraction: float, seed: int,
                            pad_from: int = 0, width: int = 3, tool_fraction: float = 0.0,
                            cache_key: str | None = None) -> Manifest:
    """Copy a `prompts` artifact with `fraction` of the answers of problems whose first operand is
    >= `pad_from` (drawn with `seed`) zero-padded to `width` digits ('68' -> '068'): warm-start
    data from two sources with different answer conventions, where the verifier accepts only the
    canonical one.

    With `tool_fraction` > 0, that fraction of all answers (drawn with `seed` from a stream of
    its own, so the padding draws stay those of tool_fraction 0) become calculator traces
    (`calculator_trace`) ending in the answer, padded or not: padding is the convention of a
    source, and a trace from that source writes its final answer the same way. With
    tool_fraction 0 the copy (and its manifest) is what it was before the knob existed.
    """
    from rlpipe.schemas import read_manifest, read_table_artifact

    table = read_table_artifact(src, PROMPTS)
    rng = random.Random(seed)
    rows = {name: table.column(name).to_pylist() for name in PROMPTS.column_names}
    meta = [json.loads(m) for m in rows["metadata"]]
    rows["answer"] = [ans.zfill(width) if m["a"] >= pad_from and rng.random() < fraction else ans
                      for ans, m in zip(rows["answer"], meta, strict=True)]
    config = {"source": str(src), "fraction": fraction, "pad_from": pad_from, "seed": seed, "width": width}
    if tool_fraction > 0:
        traced = tool_draws(len(meta), tool_fraction, seed)
        rows["answer"] = [calculator_trace(m["a"], m["op"], m["b"], ans) if t else ans
                          for ans, m, t in zip(rows["answer"], meta, traced, strict=True)]
        config["tool_fraction"] = tool_fraction
    return write_table_artifact(
        dst, PROMPTS, rows, stage="task", config=config,
        inputs={"prompts": read_manifest(src).as_input(src)}, cache_key=cache_key,
    )


def tool_draws(n: int, fraction: float, seed: int) -> list[bool]:
    """Which of `n` rows use the tool: each with probability `fraction`, from a random stream
    of (`seed`, 'tools'), independent of the padding draws of the same seed."""
    rng = random.Random(f"{seed}/tools")
    return [rng.random() < fraction for _ in range(n)]


def calculator_trace(a: int, op: Op, b: int, answer: str) -> str:
    """An SFT answer that computes `a op b` with the calculator, then writes `answer`.

    The call, the environment's reply around the tool's result and the final answer, exactly as
    a raw-text episode (`TextTurns`) lays them out; the operands unpadded (the calculator reads
    '07' as a syntax error).
    """
    from rlpipe.stages.rollout.environments.tools import (
        calculator,
        tool_call_text,
        tool_response_text,
    )

    expression = f"{a}{op}{b}"
    return (tool_call_text("calculator", {"expression": expression}) + "\n"
            + tool_response_text(calculator(expression)) + "\n" + answer)


#: Operands of the calculator traces the tokenizer is trained on (`tokenizer_texts(tools=True)`).
TOOL_TEXT_OPERANDS = ((3, 2), (17, 5), (42, 42), (64, 7), (85, 19), (91, 30), (26, 8), (58, 13))


def tokenizer_texts(task: ArithmeticTask, tools: bool = False) -> list[str]:
    """Texts to train the tokenizer on: every digit and operator of the task, in a fixed order.

    Digits are single tokens anyway; these texts only need to cover the characters, so they are
    independent of the split (the vocabulary never depends on which problems are held out).

    tools: also calculator traces of a few fixed problems (`TOOL_TEXT_OPERANDS`), so that the
    BPE learns merges for the constant parts of the call format ('<tool_call>', '"expression"',
    ...) and a call costs the model a couple of dozen tokens rather than a hundred bytes.
    """
    texts = ["0123456789", "="] + list(task.ops) + [Problem(a, op, a).text for op in task.ops for a in range(10)]
    if tools:
        # The trace alone: the model writes it after the prompt's tokens, so no merge across '='.
        problems = [Problem(a, op, b) for op in task.ops for a, b in TOOL_TEXT_OPERANDS]
        texts += [calculator_trace(p.a, p.op, p.b, p.answer) for p in problems]
    return texts


def sft_texts(problems: Sequence[Problem]) -> list[str]:
    """Prompt+answer texts of `problems` (for plain-text SFT or a text corpus)."""
    return [p.text for p in problems]
