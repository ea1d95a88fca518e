"""The math-verify reward: correctness, and that it works off the main thread and under asyncio (CPU)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("math_verify")

from noria.config import RewardConfig  # noqa: E402
from noria.rewards import get_reward, score_async  # noqa: E402
from noria.types import Sample  # noqa: E402

CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("So we get \\boxed{71}.", "71", 1.0),
    ("Thus x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("The answer is $\\boxed{72}$.", "71", 0.0),
    ("I do not know.", "71", 0.0),
]


@pytest.mark.parametrize(("response", "label", "expected"), CASES)
def test_math_true_and_false(response, label, expected):
    assert get_reward("math")(response, label, {}) == expected


def test_unparseable_label_raises():
    with pytest.raises(ValueError, match="cannot parse the label"):
        get_reward("math")("\\boxed{1}", "", {})


def test_math_from_worker_threads():
    reward = get_reward("math")
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda case: reward(case[0], case[1], {}), CASES * 2))
    assert results == [expected for _, _, expected in CASES] * 2


def test_math_from_asyncio():
    reward = get_reward("math")

    async def main():
        direct = [await asyncio.to_thread(reward, r, lab, {}) for r, lab, _ in CASES]
        samples = [Sample(prompt_ids=[1], response_text=r) for r, _, _ in CASES]
        counts = await score_async(samples, RewardConfig(name="math"), [lab for _, lab, _ in CASES])
        return direct, samples, counts

    direct, samples, counts = asyncio.run(main())
    expected = [e for _, _, e in CASES]
    assert direct == expected
    assert [s.reward for s in samples] == expected and counts.scored == len(CASES)
