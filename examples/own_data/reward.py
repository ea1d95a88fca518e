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
    """1.0 when the answer names the capital and says little else, 0.5 when it names it in a longer
    answer, 0.0 when it does not name it."""
    rewards = []
    for completion, city in zip(completions, answer):
        text = _text(completion).strip()
        named = city.lower() in text.lower()
        rewards.append(0.0 if not named else 1.0 if len(text.split()) <= len(city.split()) + 2 else 0.5)
    return rewards
