"""Loading a config's prompts, and handing them out over epochs with a resumable cursor.

What this module owns:

- ``load_prompts(data_cfg, split)``: the prompts of a built-in task split, or of ``data.path``
  (train) / ``data.test_path`` (test), validated (see ``noria.data.source``).
- ``PromptSource``: hands out prompts in batches, epoch after epoch. Each epoch visits every prompt
  once, in a permutation derived from ``(seed, epoch)`` alone, so any epoch's order can be rebuilt
  without replaying earlier ones. Prompts put back with ``return_prompt`` come out first (oldest
  first) and do not advance the cursor. ``state_dict()`` holds the epoch, the position within it
  and the returned prompts; a source restored from it yields exactly the prompts the original
  would have yielded next.

Not guaranteed: a restored source must be built over the same prompts in the same order (checked
only by count); returned prompts are stored in the state dict as plain data, so their label and
metadata must be JSON-like for the state to be saved as JSON. A source is not thread-safe.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from noria.config import DataConfig
from noria.data import tasks
from noria.data.source import DataError, FieldMap, read_prompt_file
from noria.types import Prompt

log = logging.getLogger(__name__)


def load_prompts(data_cfg: DataConfig, split: str) -> list[Prompt]:
    """The prompts of ``split`` ("train" or "test"): a task split, or the file the config names."""
    if data_cfg.task is not None:
        try:
            return tasks.generate_split(data_cfg.task, split, data_cfg.task_args)
        except ValueError as e:  # unknown task or argument, a problem space too small: name the key
            raise DataError(f"data.task / data.task_args: {e}") from e
    path = _split_path(data_cfg, split)
    fields = FieldMap(data_cfg.prompt_key, data_cfg.label_key, tuple(data_cfg.metadata_keys))
    split_name, key = (data_cfg.split, "data.path") if split == "train" else (data_cfg.test_split, "data.test_path")
    dataset = read_prompt_file(path, fields, data_cfg.format, data_cfg.skip_bad_rows, split_name, data_cfg.subset, key)
    if dataset.n_skipped:
        log.warning("%s: skipped %d bad rows; first reasons: %s", path, dataset.n_skipped, dataset.skip_reasons)
    if not dataset.prompts:
        raise DataError(f"{path}: no usable prompts ({dataset.n_skipped} rows skipped)")
    return dataset.prompts


def _split_path(data_cfg: DataConfig, split: str) -> str:
    if split == "train" and data_cfg.path is not None:
        return data_cfg.path
    if split == "test" and data_cfg.test_path is not None:
        return data_cfg.test_path
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    key = "data.path" if split == "train" else "data.test_path"
    raise DataError(f"the {split} split needs {key} (or data.task) to be set")


class PromptSource:
    """Prompts in batches over ``epochs`` passes, shuffled per epoch, with a resumable cursor."""

    def __init__(self, prompts: Sequence[Prompt], *, shuffle: bool = True, seed: int = 0, epochs: int = 1):
        if not prompts:
            raise ValueError("PromptSource needs at least one prompt")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self._prompts = list(prompts)
        self._shuffle, self._seed, self._epochs = shuffle, seed, epochs
        self._returned: deque[Prompt] = deque()
        self._epoch, self._position = 0, 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, prompts: Sequence[Prompt], data_cfg: DataConfig) -> PromptSource:
        """A source with the config's shuffle, seed and epochs."""
        return cls(prompts, shuffle=data_cfg.shuffle, seed=data_cfg.seed, epochs=data_cfg.epochs)

    @property
    def epoch(self) -> int:
        """The current epoch (0-based); equals ``epochs`` once the source is exhausted."""
        return self._epoch

    @property
    def exhausted(self) -> bool:
        """True when every epoch has been handed out and no returned prompt is waiting."""
        return self._epoch >= self._epochs and not self._returned

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def returned(self) -> int:
        """Prompts put back and not yet handed out again."""
        return len(self._returned)

    def next_batch(self, n: int) -> list[Prompt]:
        """Up to ``n`` prompts: returned ones first, then the cursor's; fewer only when exhausted."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch: list[Prompt] = []
        while len(batch) < n and self._returned:
            batch.append(self._returned.popleft())
        while len(batch) < n and self._epoch < self._epochs:
            batch.append(self._prompts[self._order[self._position]])
            self._advance()
        return batch

    def return_prompt(self, prompt: Prompt) -> None:
        """Put ``prompt`` back; it comes out before any new prompt (returned ones in order)."""
        self._returned.append(prompt)

    def state_dict(self, put_back: Sequence[Prompt] = ()) -> dict[str, Any]:
        """The cursor as plain data: epoch, position, returned prompts and the source's settings;
        ``put_back``: prompts that would come out first as if returned before the others (a
        checkpoint's unfinished groups), the source itself unchanged."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "n_prompts": len(self._prompts),
            "seed": self._seed,
            "shuffle": self._shuffle,
            "returned": [_prompt_to_dict(p) for p in [*put_back, *self._returned]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; it must come from a source over the same prompts and settings."""
        for key in ("n_prompts", "seed", "shuffle"):
            mine = len(self._prompts) if key == "n_prompts" else getattr(self, f"_{key}")
            if state[key] != mine:
                raise ValueError(f"prompt source state has {key}={state[key]!r}, this source has {mine!r}")
        if not 0 <= state["position"] < len(self._prompts):
            raise ValueError(f"prompt source state position {state['position']} is out of range")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self._epoch)
        self._returned = deque(_prompt_from_dict(d) for d in state["returned"])

    def _advance(self) -> None:
        self._position += 1
        if self._position == len(self._prompts):
            self._epoch, self._position = self._epoch + 1, 0
            self._order = self._epoch_order(self._epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._prompts))
        return np.random.default_rng([self._seed % 2**64, epoch]).permutation(len(self._prompts))


def _prompt_to_dict(prompt: Prompt) -> dict[str, Any]:
    text = prompt.prompt if isinstance(prompt.prompt, str) else [dict(m) for m in prompt.prompt]
    return {
        "prompt": text,
        "label": prompt.label,
        "metadata": dict(prompt.metadata),
        "index": prompt.index,
        "source": prompt.source,
    }


def _prompt_from_dict(data: dict[str, Any]) -> Prompt:
    text = data["prompt"] if isinstance(data["prompt"], str) else tuple(dict(m) for m in data["prompt"])
    return Prompt(text, data["label"], dict(data["metadata"]), data["index"], data["source"])
