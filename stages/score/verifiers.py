"""Rule-based reward components (docs/algorithms.md#rewards, #overlong): pure functions on strings and lengths.

    answer_match   1 if the answer extracted from the response equals the reference, else 0
                   (exact after normalisation, numeric equivalence, or mathematical equivalence
                   of LaTeX answers through math-verify)
    regex_format   1 if the response matches a pattern, else 0
    overlong       DAPO overlong shaping (Yu et al. 2025, https://arxiv.org/abs/2503.14476):
                   0 if L <= L_max - L_buf; ((L_max - L_buf) - L) / L_buf in the buffer; -1 beyond L_max
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
from fractions import Fraction
from typing import Any

import numpy as np

# A number as written in answers: optional sign, digits with optional thousands commas, optional
# decimals, or a fraction a/b. The last one in a response is taken as its numeric answer.
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|[-+]?\.\d+")


def normalize_text(s: str) -> str:
    """Trim, casefold, collapse runs of whitespace, drop one trailing period."""
    s = " ".join(s.split()).casefold()
    return s[:-1].rstrip() if s.endswith(".") else s


def parse_number(s: str) -> float | None:
    """The value of a number string ('1,234', '-0.5', '3/4', ' 7 '); None if it is not one."""
    s = s.strip().replace(",", "")
    if not s:
        return None
    try:
        if "/" in s:
            num, den = (part.strip() for part in s.split("/", 1))
            return float(Fraction(num) / Fraction(den))
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response: str, mode: str, pattern: str | None = None) -> str | None:
    """The answer text in `response`: the last match of `pattern`'s capture group; by default the
    last number ('numeric') or the text after the last 'A:' ('exact'). None when nothing matches."""
    if pattern is not None:
        matches = re.findall(pattern, response)
        return matches[-1] if matches else None
    if mode == "numeric":
        matches = NUMBER.findall(response)
        return matches[-1] if matches else None
    tail = response.rsplit("A:", 1)
    return tail[-1]


def answer_match(response: str, answer: str, mode: str, pattern: str | None = None,
                 rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 if the response's extracted answer matches `answer`, else 0.0.

    Raises:
        ValueError: in 'numeric' mode, when the reference `answer` is not a number; in 'math'
            mode, when math-verify finds no mathematical expression in it.
    """
    if mode == "math":
        return math_match(extract_answer(response, mode, pattern) if pattern is not None else response, answer)
    found = extract_answer(response, mode, pattern)
    if mode == "exact":
        return float(found is not None and normalize_text(found) == normalize_text(answer))
    want = parse_number(answer)
    if want is None:
        raise ValueError(f"reference answer {answer!r} is not a number (numeric mode)")
    got = parse_number(found) if found is not None else None
    return float(got is not None and math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol))


#: A reference answer written as LaTeX without its $ delimiters (a command, a power, an index, braces).
BARE_LATEX = re.compile(r"[\\^_{}]")
#: The package the 'math' mode needs (an optional extra: `pip install 'rlpipe[math]'`).
MATH_VERIFY = "math_verify"


def math_verify_missing() -> str | None:
    """Why the 'math' mode cannot run here (its package is not installed); None when it can."""
    if importlib.util.find_spec(MATH_VERIFY) is None:
        return "mode 'math' needs the math-verify package: pip install 'rlpipe[math]' (or math-verify)"
    return None


def math_match(response: str, answer: str) -> float:
    """1.0 if the LaTeX answer of `response` is mathematically equal to `answer` (math-verify, as
    TRL's accuracy reward calls it: the reference parsed as LaTeX or a plain expression, its first
    match, or else as bare LaTeX; the response's LaTeX answer, \\boxed{} first, anchored; `verify`
    compares them symbolically and numerically), else 0.0.

    Math-verify bounds its sympy work with SIGALRM timeouts, which only the main thread may set;
    in another thread (a Prefect task) it runs without them.

    Raises:
        ValueError: when the reference `answer` holds no expression math-verify can parse.
    """
    mv, response_config = _math_verify()
    limits: dict[str, Any] = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    gold = mv.parse(answer, extraction_mode="first_match", **limits)
    if not gold and BARE_LATEX.search(answer):  # (`\\frac{1}{2}`, `x^2+1` as MATH writes them: math mode)
        gold = mv.parse(f"${answer}$", extraction_mode="first_match", **limits)
    if all(isinstance(g, str) for g in gold):  # (nothing, or the text itself: no expression)
        raise ValueError(f"reference answer {answer!r} holds no expression math-verify can parse (math mode)")
    found = mv.parse(response, extraction_config=response_config, extraction_mode="first_match", **limits)
    return float(mv.verify(gold, found, **({} if not limits else {"timeout_seconds": None})))


def _math_verify() -> tuple[Any, list[Any]]:
    """The math_verify module and TRL's extraction config for completions (trl.rewards.accuracy_reward)."""
    missing = math_verify_missing()
    if missing is not None:
        raise ValueError(missing)
    import math_verify
    from latex2sympy2_extended import NormalizationConfig

    normalization = NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True, boxed="all",
                                        units=True)
    return math_verify, [math_verify.LatexExtractionConfig(normalization_config=normalization, boxed_match_priority=0,
                                                           try_extract_without_anchor=False)]


def regex_format(response: str, pattern: str, match: str = "search") -> float:
    """1.0 if `response` matches `pattern` ('search': anywhere; 'fullmatch': the whole text)."""
    if match == "fullmatch":
        return float(re.fullmatch(pattern, response) is not None)
    return float(re.search(pattern, response) is not None)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer: int) -> np.ndarray:
    """DAPO soft overlong penalty of each response length.

    Args:
        lengths: response lengths L in tokens.
        max_length: L_max.
        buffer: L_buf (1 <= L_buf <= L_max).

    Returns:
        penalty in [-1, 0]: 0 for L <= L_max - L_buf, ((L_max - L_buf) - L) / L_buf for
        L_max - L_buf < L <= L_max, -1 for L > L_max.

    Shape:
        lengths: (B,). Returns (B,) float64.
    """
    L = np.asarray(lengths, dtype=np.float64)
    start = max_length - buffer
    # ((L_max - L_buf) - L) / L_buf, which is 0 at the start of the buffer and -1 at L_max
    inside = (start - L) / buffer
    return np.where(L <= start, 0.0, np.where(L <= max_length, inside, -1.0))
