"""Built-in rewards: true and false cases of exact_match, numeric, format and countdown (CPU, fast)."""

from __future__ import annotations

import pytest

from noria.rewards import get_reward
from noria.rewards.countdown import ExpressionError, evaluate, extract_expression

COUNTDOWN = {"numbers": [3, 5, 7, 2], "target": 22}


@pytest.mark.parametrize(
    ("response", "label", "kwargs", "expected"),
    [
        ("  Paris. ", "paris", {}, 1.0),
        ("Paris", "London", {}, 0.0),
        ("Paris", "paris", {"case_sensitive": True}, 0.0),
        ("the answer is \\boxed{ 42 }", "42", {"boxed": True}, 1.0),
        ("the answer is 42", "42", {"boxed": True}, 0.0),
    ],
)
def test_exact_match(response, label, kwargs, expected):
    assert get_reward("exact_match")(response, label, {}, **kwargs) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("23 + 48 = 71", "71", 1.0),
        ("So the answer is \\boxed{71}. Check: 3 steps", "71", 1.0),
        ("I think it is 1,234.", "1234", 1.0),
        ("\\boxed{-3.5}", -3.5, 1.0),
        ("\\boxed{3/4}", "0.75", 1.0),
        ("the answer is 70", "71", 0.0),
        ("\\boxed{seventy}", "71", 0.0),
        ("no number here", "71", 0.0),
        ("\\boxed{inf}", "71", 0.0),
    ],
)
def test_numeric(response, label, expected):
    assert get_reward("numeric")(response, label, {}) == expected


def test_numeric_tolerance_and_bad_label():
    numeric = get_reward("numeric")
    assert numeric("3.14159", "3.1416", {}, rel_tol=1e-4) == 1.0
    assert numeric("3.14159", "3.1416", {}) == 0.0
    with pytest.raises(ValueError, match="not a number"):
        numeric("42", "forty-two", {})


def test_format():
    fmt = get_reward("format")
    assert fmt("so \\boxed{7}", None, {}) == 1.0
    assert fmt("so 7", None, {}) == 0.0
    assert fmt("<answer>7</answer>", None, {}, pattern=r"<answer>.+</answer>") == 1.0
    assert fmt("well <answer>7</answer>", None, {}, pattern=r"<answer>.+</answer>", fullmatch=True) == 0.0


@pytest.mark.parametrize(
    "response",
    ["\\boxed{(3 + 5) * 2 + 7 - 1}", "\\boxed{5 * 3 + 7}", "<answer>7*2+(5+3)</answer>", "I get:\n3 * 5 + 7 = 22",
     "\\boxed{7 × 2 + 5 + 3}", "\\boxed{(7 - 3) * 5 + 2 = 22}"],
)
def test_countdown_true(response):
    label = {"numbers": [3, 5, 7, 2, 1], "target": 22}
    assert get_reward("countdown")(response, label, {}) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{3 * 5 + 6}",  # 6 is not given
        "\\boxed{7 * 3 + 7 - 6}",  # 7 used twice
        "\\boxed{3 * 5 + 7 - 2}",  # valid numbers, wrong value
        "\\boxed{22}",  # the target itself is not a given number
        "\\boxed{}",
        "",
    ],
)
def test_countdown_false(response):
    assert get_reward("countdown")(response, COUNTDOWN, {}) == 0.0


def test_countdown_use_all():
    reward = get_reward("countdown")
    assert reward("\\boxed{5 * 3 + 7}", COUNTDOWN, {}) == 1.0
    assert reward("\\boxed{5 * 3 + 7}", COUNTDOWN, {}, use_all=True) == 0.0
    assert reward("\\boxed{(5 * 3 + 7) * (2 / 2)}", {"numbers": [3, 5, 7, 2, 2], "target": 22}, {}, use_all=True) == 1.0


def test_countdown_division_is_exact():
    assert evaluate("7 / 2 * 2")[0] == 7
    assert get_reward("countdown")("\\boxed{7 / 2}", {"numbers": [7, 2], "target": 3}, {}) == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo pwned')",
        "3 ** 5",
        "3 // 5",
        "(3).__class__",
        "abs(3)",
        "3.5 + 1",
        "3; 4",
        "lambda: 3",
        "[3]",
        "9" * 7,  # literal longer than MAX_DIGITS
        "(" * 30 + "3" + ")" * 30,  # nesting past MAX_DEPTH
        "1+" * 150 + "1",  # longer than MAX_CHARS
        "3 / (5 - 5)",
        "(3 + 5",
        "3 +",
    ],
)
def test_countdown_parser_rejects_unsafe_or_malformed(text):
    with pytest.raises(ExpressionError):
        evaluate(text)
    assert get_reward("countdown")(f"\\boxed{{{text}}}", COUNTDOWN, {}) == 0.0


def test_countdown_extraction_prefers_boxed_then_tags():
    assert extract_expression("x <answer>1+2</answer> then \\boxed{3+4}") == "3+4"
    assert extract_expression("x <answer>1+2</answer>\nbye") == "1+2"
    assert extract_expression("\\boxed{(1+2)*\\frac{}{}}") == "(1+2)*\\frac{}{}"


def test_countdown_bad_label_raises():
    with pytest.raises(ValueError, match="countdown label"):
        get_reward("countdown")("\\boxed{1+2}", "3", {})
