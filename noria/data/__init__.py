"""Prompt data: files and built-in tasks in, validated ``Prompt`` records and token ids out.

- ``source``: reading JSONL / Parquet / ``datasets`` files into validated prompts (``DataError``).
- ``tasks``: seeded synthetic tasks (arithmetic, countdown) with disjoint train/test splits.
- ``chat``: rendering prompts to token ids with a tokenizer, dropping over-long ones.
- ``loader``: ``load_prompts`` for a config split, and ``PromptSource`` (epochs, shuffle, cursor).
"""

from noria.data.chat import RenderedPrompt, drop_long, render_prompt, render_prompts
from noria.data.loader import PromptSource, load_prompts
from noria.data.source import DataError, FieldMap, PromptDataset, read_prompt_file
from noria.data.tasks import TASKS, generate_split, get_task

__all__ = [
    "TASKS",
    "DataError",
    "FieldMap",
    "PromptDataset",
    "PromptSource",
    "RenderedPrompt",
    "drop_long",
    "generate_split",
    "get_task",
    "load_prompts",
    "read_prompt_file",
    "render_prompt",
    "render_prompts",
]
