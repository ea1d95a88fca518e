"""Reward functions written for TRL's GRPOTrainer, as TRL's documentation shows them (GRPO trainer page,
"Using a custom reward function"), loaded unchanged by import path (``trl_rewards:reward_func``)."""

import re


def reward_len(completions, **kwargs):
    """TRL's docs, example 1 (standard format): reward completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def reward_func(completions, ground_truth, **kwargs):
    """TRL's docs, example 3: reward completions whose \\boxed{} content equals the dataset's ``ground_truth``."""
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def format_reward_func(completions, **kwargs):
    """TRL's docs, example 2 (conversational format): reward completions that have a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


async def async_reward(completions, prompts, completion_ids, **kwargs):
    """An async batched reward (TRL awaits those too): the prompt's length parity, per completion."""
    return [float(len(p) % 2) for p, _ in zip(prompts, completions)]


def wrong_length(completions, **kwargs):
    """Breaks the batched contract at call time: one value for the whole batch."""
    return [1.0]


def without_kwargs(completions):
    """Breaks the batched contract at load: TRL passes prompts, completion_ids and dataset columns too."""
    return [0.0 for _ in completions]
