"""The reward of examples/own_data: TRL's reward-function signature, read by Noria from this file.

``noria train examples/own_data/grpo.yaml`` names it as ``reward.name: examples/own_data/reward.py:capital``;
no PYTHONPATH is needed (a file path is imported under its file name, its folder joins sys.path).
Noria calls it once per batch as TRL's GRPOTrainer does: ``completions`` holds the answers (plain text
for text prompts, one assistant message for chat-message prompts), and every column of the data listed in
``data.metadata_keys`` (here ``answer``) arrives as a list of the same length.
"""

from __future__ import annotations


def _text(completion) -> str:
    """A completion as text: TRL passes chat completions as ``[{"role": "assistant", "content": ...}]``."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def capital(completions, answer, **kwargs) -> list[float]:
    """0.0 when the answer does not name the capital; else 1.0 for the city's name alone, 0.1 less for
    each word beyond it, and at least 0.2 ("The capital of Japan is Tokyo." scores 0.5)."""
    rewards = []
    for completion, city in zip(completions, answer):
        text = _text(completion).strip()
        if city.lower() not in text.lower():
            rewards.append(0.0)
            continue
        extra_words = max(0, len(text.split()) - len(city.split()))
        rewards.append(max(0.2, 1.0 - 0.1 * extra_words))
    return rewards
