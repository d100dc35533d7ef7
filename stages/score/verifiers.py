"""Rule-based reward components (docs/algorithms.md#rewards, #overlong): pure functions on strings and lengths.

    answer_match   1 if the answer extracted from the response equals the reference, else 0
                   (exact after normalisation, or numeric equivalence)
    regex_format   1 if the response matches a pattern, else 0
    overlong       DAPO overlong shaping (Yu et al. 2025, https://arxiv.org/abs/2503.14476):
                   0 if L <= L_max - L_buf; ((L_max - L_buf) - L) / L_buf in the buffer; -1 beyond L_max
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

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
        ValueError: in 'numeric' mode, when the reference `answer` is not a number.
    """
    found = extract_answer(response, mode, pattern)
    if mode == "exact":
        return float(found is not None and normalize_text(found) == normalize_text(answer))
    want = parse_number(answer)
    if want is None:
        raise ValueError(f"reference answer {answer!r} is not a number (numeric mode)")
    got = parse_number(found) if found is not None else None
    return float(got is not None and math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol))


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
