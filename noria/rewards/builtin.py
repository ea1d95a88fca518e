"""Rule-based rewards that need nothing beyond the standard library: exact_match, numeric, format.

Each takes ``(response, label, metadata, **kwargs)`` and returns a float in [0, 1]. A response that
does not contain an answer scores 0.0 (a wrong answer); a label that cannot be used (a ``numeric``
label that is not a number) raises, so the runner marks the sample failed instead of scoring it 0.

Not guaranteed: answer extraction is heuristic: ``numeric`` takes the last ``\\boxed{}`` if there is
one, else the last number in the text, so a response that ends with an unrelated number is read as
answering that number.
"""

from __future__ import annotations

import math
import re
from typing import Any

from noria.rewards.countdown import last_boxed

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def normalize_text(text: str, case_sensitive: bool = False) -> str:
    """Strip, collapse whitespace, drop surrounding ``$`` and a trailing period; casefold unless told."""
    text = " ".join(str(text).split()).strip("$ ").rstrip(".").strip()
    return text if case_sensitive else text.casefold()


def exact_match(
    response: str, label: Any, metadata: dict[str, Any], boxed: bool = False, case_sensitive: bool = False
) -> float:
    """1.0 if the (normalised) response, or its last ``\\boxed{}`` with ``boxed``, equals the label."""
    answer = last_boxed(response) if boxed else response
    if answer is None:
        return 0.0
    return 1.0 if normalize_text(answer, case_sensitive) == normalize_text(str(label), case_sensitive) else 0.0


def numeric(
    response: str, label: Any, metadata: dict[str, Any], rel_tol: float = 1e-6, abs_tol: float = 1e-6
) -> float:
    """1.0 if the response's final number (boxed answer, else last number) equals the label within tolerance."""
    gold = parse_number(str(label))
    if gold is None:
        raise ValueError(f"numeric reward: label {label!r} is not a number")
    answer = extract_number(response)
    if answer is None:
        return 0.0
    return 1.0 if math.isclose(answer, gold, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def extract_number(response: str) -> float | None:
    """The number in the last ``\\boxed{}``, else the last number in the text; None if there is none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return parse_number(boxed)
    matches = _NUMBER.findall(response)
    return parse_number(matches[-1]) if matches else None


def parse_number(text: str) -> float | None:
    """``"1,234"``, ``"-3.5"``, ``"3/4"``, ``"$12$"`` -> a float; None if the text is not one number."""
    text = text.strip().strip("$").strip().replace(",", "").rstrip(".")
    text = re.sub(r"^\\(?:text|mathrm)\{(.*)\}$", r"\1", text).strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except ZeroDivisionError:
        return None


def format_reward(
    response: str, label: Any, metadata: dict[str, Any], pattern: str = r"\\boxed\{.+?\}", fullmatch: bool = False
) -> float:
    """1.0 if the regex ``pattern`` is found in the response (or matches all of it, with ``fullmatch``)."""
    regex = re.compile(pattern, re.DOTALL)
    found = regex.fullmatch(response.strip()) if fullmatch else regex.search(response)
    return 1.0 if found else 0.0
