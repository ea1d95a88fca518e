"""Reward functions loaded by import path in tests (``reward_plugins:name``); tests/ is on sys.path.

Each one exercises one branch of the reward runner's contract; ``RELEASE`` lets a test end a
"hanging" reward so that no thread outlives the test session.
"""

from __future__ import annotations

import asyncio
import threading

RELEASE = threading.Event()


def length_at_least(response, label, metadata, min_chars=1):
    """1.0 if the response has at least ``min_chars`` characters."""
    return 1.0 if len(response) >= min_chars else 0.0


def matches_metadata(response, label, metadata):
    """True when the response equals the metadata's ``expected`` (a bool reward)."""
    return response == metadata["expected"]


async def async_exact(response, label, metadata):
    """An async reward: await, then compare."""
    await asyncio.sleep(0)
    return float(response == label)


def raises(response, label, metadata):
    raise RuntimeError("checker crashed")


def hangs(response, label, metadata):
    """Blocks until the test sets RELEASE (or 30 s), far past any timeout the tests use."""
    RELEASE.wait(30)
    return 1.0


async def async_hangs(response, label, metadata):
    await asyncio.sleep(30)
    return 1.0


def returns_text(response, label, metadata):
    return "1.0"


def returns_none(response, label, metadata):
    return None


def returns_nan(response, label, metadata):
    return float("nan")


def raises_timeout_error(response, label, metadata):
    raise TimeoutError("the checker's own timeout")


NOT_CALLABLE = 3


def fails_on_odd_labels(response, label, metadata):
    """1.0 for every answer whose label is even; raises for odd labels (a reward that fails on part of the answers)."""
    if int(label) % 2:
        raise RuntimeError("odd label refused")
    return 1.0
