"""Reward functions for the RL loop tests, loaded by import path (``toy_rewards:digits``)."""

from __future__ import annotations


def digits(response: str, label, metadata) -> float:
    """Share of the response's non-space characters that are digits: a random model scores a
    little, a policy that learned to answer with digits only scores 1."""
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def flaky(response: str, label, metadata) -> float:
    """``digits``, but raises for responses that contain the letter ``a`` (a failing reward)."""
    if "a" in response:
        raise RuntimeError("flaky reward: refused a response with an 'a'")
    return digits(response, label, metadata)


def slow_digits(response: str, label, metadata) -> float:
    """``digits`` after a random pause of up to 30 ms (reward latency for the asynchronous-RL tests)."""
    import random
    import time

    time.sleep(random.random() * 0.03)
    return digits(response, label, metadata)
