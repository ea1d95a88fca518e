"""The countdown reward: a safe parser and evaluator for the expression a model writes.

What this module owns: reading an arithmetic expression from a response (the last ``\\boxed{...}``,
else the last ``<answer>...</answer>``, else the last non-empty line), parsing it with a small
recursive-descent parser, evaluating it exactly with ``fractions.Fraction``, and checking that it
uses only the given numbers, each at most as often as it is given, and equals the target.

The grammar is the whole attack surface, so it is tiny: non-negative integer literals, ``+ - * /``,
unary minus, parentheses and spaces (``×``/``÷`` are read as ``*``/``/``; a trailing ``= N`` is
ignored). Nothing is ever passed to ``eval``; names, attribute access, calls, ``**``, decimals and
anything else are rejected with ``ExpressionError``. Length (``MAX_CHARS``), nesting depth
(``MAX_DEPTH``) and literal size (``MAX_DIGITS``) are bounded, so a response cannot make the
evaluator run long or recurse deeply.

Not guaranteed: the magnitude of intermediate products is bounded only through those limits (at
most ``MAX_CHARS / MAX_DIGITS`` factors of ``MAX_DIGITS`` digits), which is cheap for Python
integers; a malformed or unsafe response scores 0.0 (it is a wrong answer, not a reward failure),
while a malformed *label* raises.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Any

MAX_CHARS = 200
MAX_DEPTH = 20
MAX_DIGITS = 6
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ExpressionError(ValueError):
    """The text is not a safe countdown expression."""


def countdown_reward(response: str, label: Any, metadata: dict[str, Any], use_all: bool = False) -> float:
    """1.0 if the response's expression equals the target using only the given numbers, else 0.0."""
    numbers, target = _read_label(label)
    try:
        value, used = evaluate(extract_expression(response))
    except ExpressionError:
        return 0.0
    if not uses_numbers(used, numbers, use_all):
        return 0.0
    return 1.0 if value == target else 0.0


def _read_label(label: Any) -> tuple[list[int], int]:
    if not isinstance(label, dict) or "numbers" not in label or "target" not in label:
        raise ValueError(f"countdown label must be {{'numbers': [...], 'target': N}}, got {label!r}")
    numbers, target = label["numbers"], label["target"]
    if not isinstance(numbers, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise ValueError(f"countdown label 'numbers' must be a list of integers, got {numbers!r}")
    if not isinstance(target, int) or isinstance(target, bool):
        raise ValueError(f"countdown label 'target' must be an integer, got {target!r}")
    return numbers, target


def uses_numbers(used: list[int], given: list[int], use_all: bool = False) -> bool:
    """Whether ``used`` takes each given number at most as often as given (exactly, with ``use_all``)."""
    have, want = Counter(given), Counter(used)
    if use_all:
        return have == want
    return all(want[n] <= have[n] for n in want)


# ------------------------------------------------------------------------------------- extraction


def extract_expression(response: str) -> str:
    """The candidate expression: last ``\\boxed{}``, else last ``<answer>`` tag, else last line."""
    boxed = last_boxed(response)
    if boxed is not None:
        return _strip_equals(boxed)
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return _strip_equals(tags[-1])
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if not lines:
        raise ExpressionError("the response is empty")
    return _strip_equals(lines[-1])


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def _strip_equals(text: str) -> str:
    text = text.strip().strip("$").strip()
    return re.sub(r"=\s*-?\d+\s*$", "", text).strip()


# ------------------------------------------------------------------------------ parse and evaluate


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of ``text`` and the integer literals it uses; ``ExpressionError`` if not safe."""
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    parser = _Parser(_tokenize(text.replace("×", "*").replace("÷", "/")))
    value = parser.expression(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after the expression")
    return value, parser.numbers


def _tokenize(text: str) -> list[str]:
    tokens = []
    for number, other in _TOKEN.findall(text):
        if number:
            if len(number) > MAX_DIGITS:
                raise ExpressionError(f"number {number[:10]}... has more than {MAX_DIGITS} digits")
            tokens.append(number)
        elif other.strip():
            if other not in "+-*/()":
                raise ExpressionError(f"character {other!r} is not allowed (only digits, + - * / and parentheses)")
            tokens.append(other)
    if not tokens:
        raise ExpressionError("the expression is empty")
    return tokens


class _Parser:
    """expression := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := '-' factor | number | '(' expression ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("the expression ends too early")
        self.pos += 1
        return token

    def expression(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            if self.peek() == op:
                raise ExpressionError(f"operator {op * 2!r} is not allowed")
            right = self.factor(depth)
            if op == "/" and right == 0:
                raise ExpressionError("division by zero")
            value = value * right if op == "*" else value / right
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ExpressionError(f"expression nested deeper than {MAX_DEPTH}")
        token = self.take()
        if token == "-":
            return -self.factor(depth + 1)
        if token == "(":
            value = self.expression(depth + 1)
            if self.take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if token[0] in "0123456789":
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise ExpressionError(f"unexpected {token!r}")
