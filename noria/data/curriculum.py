"""Online difficulty pools: prompts the policy always solves or always fails are set aside and revisited.

What this module owns: ``Curriculum``, a ``PromptSource`` with difficulty pools (``data.curriculum``).
The job tells it each scored group's rewards (``observe``). A group is *easy* when every reward is at
least ``easy_reward``, *hard* when every reward is at most ``hard_reward``, else *mixed*. A prompt whose
last ``window`` groups were all easy moves to the easy pool, all hard to the hard pool. Pooled
prompts are skipped by the data cursor; each prompt handed out is instead drawn from the easy pool
with probability ``easy_rate`` and from the hard pool with ``hard_rate`` (oldest first), so a pooled
prompt is revisited at a set rate. A revisit that comes out mixed returns the prompt to the cursor's
rotation; one that comes out the same keeps it pooled.

Why: a group whose rewards are all equal has zero advantage everywhere under GRPO, so it costs a
full rollout and teaches nothing; prime-rl's difficulty pools and DAPO's dynamic sampling both act
on that. Dynamic sampling (``rollout.buffer.filters: [zero_reward_variance]``) drops such a group
after it was generated; the pools stop generating it in the first place, while still looking at it
again now and then (a hard prompt may become solvable, an easy one may be forgotten).

Resumable: ``state_dict`` holds the cursor's state (``PromptSource.state_dict``) with each prompt's
recent outcomes, the pools and the draw count of the pool RNG (seeded by ``data.seed``), so a
restored curriculum hands out what the original would have. A checkpoint written without a
curriculum restores into one with empty pools.

Not guaranteed: a prompt is pooled only after ``window`` groups of it were scored, so with few epochs
the pools fill late; revisits do not advance the cursor, so a run with pools may hand out more
prompts than ``epochs`` passes hold (pooled prompts skipped by the cursor make up for it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from noria.data.loader import PromptSource
from noria.types import Prompt

POOLS = ("easy", "hard")


class Curriculum:
    """A ``PromptSource`` whose always-solved and never-solved prompts move to pools revisited at a rate."""

    def __init__(self, source: PromptSource, prompts: Sequence[Prompt], *, window: int, easy_reward: float,
                 hard_reward: float, easy_rate: float, hard_rate: float, seed: int = 0) -> None:
        if window < 1:
            raise ValueError(f"curriculum window must be >= 1, got {window}")
        self.source = source
        self.window, self.easy_reward, self.hard_reward = window, easy_reward, hard_reward
        self.rates = {"easy": easy_rate, "hard": hard_rate}
        self._seed = seed
        self._by_index = {p.index: p for p in prompts}
        self._history: dict[int, deque[str]] = {}
        self._pools: dict[str, deque[int]] = {name: deque() for name in POOLS}
        self._pooled: dict[int, str] = {}  # prompt index -> its pool (also while it is out on a revisit)
        self._draws = 0
        self._interval = {"revisits": 0, "skipped": 0, "pooled": 0, "released": 0}

    @classmethod
    def from_config(cls, source: PromptSource, prompts: Sequence[Prompt], data_cfg: Any) -> Curriculum:
        c = data_cfg.curriculum
        return cls(source, prompts, window=c.window, easy_reward=c.easy_reward, hard_reward=c.hard_reward,
                   easy_rate=c.easy_rate, hard_rate=c.hard_rate, seed=data_cfg.seed)  # fmt: skip

    # ------------------------------------------------------------------ the PromptSource interface

    @property
    def epoch(self) -> int:
        return self.source.epoch

    @property
    def exhausted(self) -> bool:
        return self.source.exhausted

    def __len__(self) -> int:
        return len(self.source)

    def return_prompt(self, prompt: Prompt) -> None:
        self.source.return_prompt(prompt)

    def next_batch(self, n: int) -> list[Prompt]:
        """Up to ``n`` prompts: returned ones first, then per prompt a pool revisit (at the pools'
        rates) or the cursor's next prompt that is not pooled; fewer only when the cursor ran out."""
        batch: list[Prompt] = []
        while len(batch) < n:
            prompt = self._returned() or self._revisit() or self._next_unpooled()
            if prompt is None:
                break
            batch.append(prompt)
        return batch

    def state_dict(self, put_back: Sequence[Prompt] = ()) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(put_back),
            "curriculum": {
                "history": {str(i): list(h) for i, h in self._history.items()},
                "pools": {name: list(pool) for name, pool in self._pools.items()},
                "pooled": {str(i): name for i, name in self._pooled.items()},
                "draws": self._draws,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "curriculum" not in state:  # a checkpoint of a run without pools: its cursor, empty pools
            self.source.load_state_dict(state)
            return
        self.source.load_state_dict(state["source"])
        c = state["curriculum"]
        self._history = {int(i): deque(h, maxlen=self.window) for i, h in c["history"].items()}
        self._pools = {name: deque(int(i) for i in c["pools"].get(name, ())) for name in POOLS}
        self._pooled = {int(i): name for i, name in c["pooled"].items()}
        self._draws = int(c["draws"])

    # ------------------------------------------------------------------------------ outcomes

    def observe(self, prompt: Prompt, rewards: Sequence[float]) -> None:
        """One scored group of ``prompt`` (its samples' rewards): pool, keep pooled, or release it."""
        if not rewards or prompt.index not in self._by_index:
            return
        outcome = "easy" if min(rewards) >= self.easy_reward else "hard" if max(rewards) <= self.hard_reward else "mixed"
        history = self._history.setdefault(prompt.index, deque(maxlen=self.window))
        history.append(outcome)
        pool = self._pooled.get(prompt.index)
        if pool is not None:
            if prompt.index in self._pools[pool]:
                return  # a copy drawn before it was pooled: it waits in its pool as it is
            if outcome == pool:
                self._pools[pool].append(prompt.index)  # stays: back to the end of its pool
            else:
                del self._pooled[prompt.index]
                self._interval["released"] += 1
            return
        if outcome != "mixed" and len(history) == self.window and all(o == outcome for o in history):
            self._pooled[prompt.index] = outcome
            self._pools[outcome].append(prompt.index)
            self._interval["pooled"] += 1

    def metrics(self) -> dict[str, float]:
        """``curriculum/...`` figures: pool sizes now; revisits, prompts skipped by the cursor, pooled and
        released since the last call."""
        out = {f"curriculum/{name}_pool": float(len(self._pools[name])) for name in POOLS}
        out.update({f"curriculum/{k}": float(v) for k, v in self._interval.items()})
        self._interval = dict.fromkeys(self._interval, 0)
        return out

    def pool_of(self, index: int) -> str | None:
        """The pool prompt ``index`` is in (``easy``/``hard``), or None."""
        return self._pooled.get(index)

    # ------------------------------------------------------------------------------ drawing

    def _returned(self) -> Prompt | None:
        """The oldest prompt put back that is not waiting in a pool (those are revisited from there)."""
        while self.source.returned:
            prompt = self.source.next_batch(1)[0]
            if not self._waiting(prompt.index):
                return prompt
            self._interval["skipped"] += 1
        return None

    def _waiting(self, index: int) -> bool:
        pool = self._pooled.get(index)
        return pool is not None and index in self._pools[pool]

    def _revisit(self) -> Prompt | None:
        u = np.random.default_rng([self._seed % 2**64, self._draws]).random()
        self._draws += 1
        low = 0.0
        for name in POOLS:
            if low <= u < low + self.rates[name] and self._pools[name]:
                self._interval["revisits"] += 1
                return self._by_index[self._pools[name].popleft()]  # still in _pooled while out
            low += self.rates[name]
        return None

    def _next_unpooled(self) -> Prompt | None:
        while True:
            batch = self.source.next_batch(1)
            if not batch:
                return None
            if not self._waiting(batch[0].index):
                return batch[0]
            self._interval["skipped"] += 1
