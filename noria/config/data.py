"""The ``data`` section: where prompts come from (a built-in task or files) and how they are rendered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from noria.config.schema import ConfigError, option


@dataclass
class CurriculumConfig:
    """Online difficulty pools (``data.curriculum``). Owner: ``noria.data.curriculum`` (``Curriculum``)."""

    enabled: bool = option(
        False,
        "Move prompts whose last `window` groups were all easy (every reward >= easy_reward) or all hard (every reward "
        "<= hard_reward) out of the data cursor's rotation into an easy or a hard pool, revisited at easy_rate / "
        "hard_rate; a revisit with mixed rewards puts the prompt back in rotation. Pools and outcomes are checkpointed.",
    )
    window: int = option(2, "Groups of one prompt, in a row, that must all be easy (or all hard) to pool it.")
    easy_reward: float = option(1.0, "A group is easy when every sample's reward is at least this.")
    hard_reward: float = option(0.0, "A group is hard when every sample's reward is at most this.")
    easy_rate: float = option(0.05, "Share of the prompts handed out that are drawn from the easy pool (when it has any).")
    hard_rate: float = option(0.1, "Share of the prompts handed out that are drawn from the hard pool (when it has any).")

    def validate(self) -> None:
        if self.window < 1:
            raise ConfigError(f"data.curriculum.window must be >= 1, got {self.window}")
        if self.hard_reward >= self.easy_reward:
            raise ConfigError(
                f"data.curriculum.hard_reward ({self.hard_reward}) must be below easy_reward ({self.easy_reward})"
            )
        for key in ("easy_rate", "hard_rate"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"data.curriculum.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.easy_rate + self.hard_rate > 1.0:
            raise ConfigError(
                f"data.curriculum.easy_rate + hard_rate must be <= 1, got {self.easy_rate} + {self.hard_rate}"
            )


@dataclass
class DataConfig:
    """Where prompts come from: a file (JSONL, Parquet, HF datasets folder) or a built-in task.
    Owner: ``noria.data`` (``load_prompts``, ``PromptSource``)."""

    task: str | None = option(
        None, "Built-in synthetic task: arithmetic, countdown (text prompts), digits_sum (images of 1-4 handwritten "
        "digits, asking for their sum: a vision-language model), or digits (class labels for an image model: a run "
        "with the diffusion section); exclusive with `path`."
    )
    task_args: dict[str, Any] = option(
        factory=dict, help="Task-specific arguments (e.g. n_train, n_test, seed); each task rejects unknown ones."
    )
    path: str | None = option(
        None,
        "Training data file or folder (.jsonl, .parquet, or a saved HF dataset), or a Hugging Face Hub dataset id "
        "Org/Name (pinned as Org/Name@revision) read with the datasets library.",
    )
    test_path: str | None = option(None, "Held-out data for evaluation, same format as `path`.")
    split: str = option("train", "Split of `path` to train on, when it holds several (a hub dataset, a saved DatasetDict).")
    test_split: str = option("test", "Split of `test_path` to evaluate on, when it holds several.")
    subset: str | None = option(None, "Configuration (subset) of a hub dataset with several, e.g. main; null: its only one.")
    format: Literal["auto", "jsonl", "parquet", "hf"] = option("auto", "File format; auto picks it from the extension.")
    prompt_key: str = option("prompt", "Field holding the prompt: a string, or a list of chat messages.")
    label_key: str | None = option("label", "Field holding the reference answer; null if the data has none.")
    metadata_keys: list[str] = option(factory=list, help="Extra fields copied into each prompt's metadata.")
    chat_template: bool | str = option(
        True,
        "true: render prompts with the tokenizer's chat template; false: plain text; a path to a Jinja file, or a "
        "Jinja template itself (it holds `{%` or `{{`): render with that template instead of the tokenizer's.",
    )
    system_prompt: str | None = option(None, "System message prepended when rendering string prompts as chat.")
    shuffle: bool = option(True, "Shuffle the training prompts each epoch (seeded).")
    seed: int = option(0, "Seed of the shuffle.")
    epochs: int = option(1, "Passes over the training data; the source stops after this many.")
    max_prompt_tokens: int | None = option(None, "Drop prompts longer than this many tokens at load (count logged).")
    skip_bad_rows: bool = option(False, "Skip malformed rows (counted and reported) instead of failing.")
    curriculum: CurriculumConfig = option(
        factory=lambda: CurriculumConfig(), help="Online difficulty pools: always-solved and never-solved prompts revisited at a rate."
    )

    def validate(self) -> None:
        self.curriculum.validate()
        if (self.task is None) == (self.path is None):
            raise ConfigError("data: set exactly one of data.task (a built-in task) or data.path (a data file)")
        if self.epochs < 1:
            raise ConfigError(f"data.epochs must be >= 1, got {self.epochs}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
