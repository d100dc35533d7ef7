"""Golden tests of the rule-based components."""

import numpy as np
import pytest

from rlpipe.stages.score.core import combine
from rlpipe.stages.score.verifiers import (
    answer_match,
    extract_answer,
    normalize_text,
    overlong_penalty,
    parse_number,
    regex_format,
)


def test_overlong_three_regions():
    # L_max = 20, L_buf = 4: free up to 16, linear (16 - L) / 4 on 17..20, -1 beyond 20
    L = np.array([0, 10, 16, 17, 18, 20, 21, 100])
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    np.testing.assert_allclose(overlong_penalty(L, max_length=20, buffer=4), expected)


def test_overlong_buffer_equals_max_length():
    # L_buf = L_max = 8: the penalty starts at once, -L / 8
    np.testing.assert_allclose(overlong_penalty(np.array([0, 2, 8, 9]), 8, 8), [0.0, -0.25, -1.0, -1.0])


def test_parse_number():
    assert parse_number(" 1,234 ") == 1234.0
    assert parse_number("-0.5") == -0.5
    assert parse_number("3/4") == 0.75
    assert parse_number("1/0") is None
    assert parse_number("seven") is None


def test_extract_answer_defaults():
    assert extract_answer("so 3 + 4 gives 7, final: 7.", "numeric") == "7"
    assert extract_answer("it is -1,250.5 total", "numeric") == "-1,250.5"
    assert extract_answer("no digits", "numeric") is None
    assert extract_answer("think... A: Paris ", "exact") == " Paris "
    assert extract_answer("Paris", "exact") == "Paris"
    assert extract_answer("#### 42 ####", "exact", pattern=r"#### (\d+)") == "42"
    assert extract_answer("nothing here", "exact", pattern=r"#### (\d+)") is None


@pytest.mark.parametrize(
    ("response", "answer", "mode", "expected"),
    [
        (" 7", "7", "numeric", 1.0),
        (" 7.0", "7", "numeric", 1.0),
        ("I think 3, no wait, 8", "8", "numeric", 1.0),  # the last number counts
        ("8 or 3", "8", "numeric", 0.0),
        (" 1,000", "1000", "numeric", 1.0),
        (" 0.5", "1/2", "numeric", 1.0),
        (" 7.0001", "7", "numeric", 0.0),  # |diff| / 7 = 1.4e-5 > rel_tol 1e-6
        (" 7.0000001", "7", "numeric", 1.0),  # 1.4e-8 < rel_tol
        ("no answer", "7", "numeric", 0.0),
        ("A:  New   York. ", "new york", "exact", 1.0),  # trim, casefold, collapse, trailing period
        ("A: New Yorker", "new york", "exact", 0.0),
        ("Paris", "paris", "exact", 1.0),
    ],
)
def test_answer_match_golden(response, answer, mode, expected):
    assert answer_match(response, answer, mode) == expected


def test_answer_match_pattern_and_bad_reference():
    assert answer_match("The answer is \\boxed{12}.", "12", "numeric", pattern=r"\\boxed\{([^}]*)\}") == 1.0
    assert answer_match("12 but no box", "12", "numeric", pattern=r"\\boxed\{([^}]*)\}") == 0.0
    with pytest.raises(ValueError, match="'twelve' is not a number"):
        answer_match("12", "twelve", "numeric")


def test_normalize_text():
    assert normalize_text("  Hello\n  World. ") == "hello world"


def test_regex_format_golden():
    assert regex_format(" 42", r"^ \d+$") == 1.0
    assert regex_format(" 42 apples", r"^ \d+$") == 0.0
    assert regex_format("x <answer>5</answer> y", r"<answer>.*</answer>") == 1.0
    assert regex_format("x <answer>5</answer> y", r"<answer>.*</answer>", match="fullmatch") == 0.0
    assert regex_format("<answer>5</answer>", r"<answer>.*</answer>", match="fullmatch") == 1.0
    assert regex_format(" 42", r" \d+", match="fullmatch") == 1.0  # whitespace is not stripped
    assert regex_format(" 42\n", r" \d+", match="fullmatch") == 0.0
    assert regex_format(" 42\n", r"\s*\d+\s*", match="fullmatch") == 1.0


def test_combine_golden():
    # R = 2 * [1, 0] + (-0.5) * [0.4, 2] = [1.8, -1.0]
    np.testing.assert_allclose(combine([2.0, -0.5], [np.array([1.0, 0.0]), np.array([0.4, 2.0])]), [1.8, -1.0])


# 'math': LaTeX answers through math-verify, read as TRL's accuracy reward reads them.
@pytest.mark.parametrize(("response", "answer", "expected"), [
    (r"So $x = \boxed{\frac{1}{2}}$.", "0.5", 1.0),  # a fraction equal to a decimal
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    (r"The result is $\boxed{1+x^2}$", "x^2+1", 1.0),  # symbolic equality; a bare LaTeX reference
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\boxed{7}", "$7$", 1.0),
    ("the answer is 7", "7", 0.0),  # no LaTeX answer in the response: TRL's extraction is anchored
    (r"\boxed{3} or \boxed{4}", "4", 0.0),  # the first boxed answer is the answer
])
def test_math_mode_golden(response, answer, expected):
    assert answer_match(response, answer, "math") == expected


def test_math_mode_in_another_thread_and_a_reference_without_math():
    import threading

    # (math-verify's timeouts are SIGALRM, main thread only: a Prefect task's thread runs without them)
    out = []
    worker = threading.Thread(target=lambda: out.append(answer_match(r"\boxed{\frac{1}{2}}", "0.5", "math")))
    worker.start()
    worker.join()
    assert out == [1.0]
    with pytest.raises(ValueError, match=r"reference answer 'see the figure' holds no expression math-verify can parse"):
        answer_match(r"\boxed{1}", "see the figure", "math")


def test_math_mode_without_its_package_is_a_config_error(monkeypatch):
    import importlib.util

    from rlpipe.schemas.config_files import ConfigError, parse_config
    from rlpipe.stages.score.config import AnswerMatchComponent

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ConfigError, match=r"mode 'math' needs the math-verify package: pip install 'rlpipe\[math\]'"):
        parse_config(AnswerMatchComponent, {"name": "acc", "mode": "math"})
