"""The ``math`` reward: symbolic answer checking with Hugging Face's ``math-verify``.

What this module owns: parsing the gold label and the response with ``math_verify.parse`` and
comparing them with ``math_verify.verify``. math-verify enforces its own time limits with
``signal.alarm``, which only works in the main thread; the reward runner calls rewards from worker
threads and from asyncio, so this module turns those limits off (``parsing_timeout=None``,
``timeout_seconds=None``) and relies on the runner's per-call timeout (``RewardConfig.timeout_s``)
instead.

Not guaranteed: the runner's timeout abandons a call, it cannot interrupt it, so a pathological
expression can keep one worker thread busy (and a CPU core) after its sample is marked failed.
``math-verify`` is imported on first use; it is not installed on every machine.
"""

from __future__ import annotations

from typing import Any


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the 'math' reward needs the 'math-verify' package: pip install math-verify") from e
    _silence_timeout_warning(math_verify)
    return math_verify


def _silence_timeout_warning(math_verify: Any) -> None:
    """math-verify warns once that its timeout is off; here the runner enforces one, so the warning misleads."""
    for module in (math_verify.parser, math_verify.grader):
        if hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True


def parse_gold(label: Any) -> list[Any]:
    """The parsed gold answer; a bare answer like ``42`` or ``\\frac{1}{2}`` is tried inside ``$...$`` too."""
    mv = _math_verify()
    text = str(label).strip()
    gold = mv.parse(text, parsing_timeout=None)
    if not gold and not text.startswith("$"):
        gold = mv.parse(f"${text}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math reward: cannot parse the label {label!r}")
    return gold


def math_reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if math-verify finds the response's answer equivalent to the label, else 0.0."""
    mv = _math_verify()
    gold = parse_gold(label)
    answer = mv.parse(response, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if mv.verify(gold, answer, timeout_seconds=None) else 0.0
