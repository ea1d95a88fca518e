"""Helpers of the RL run tests (tests/launch/, tests/eval/, tests/test_preflight.py): the arguments
of a tiny arithmetic run, its asynchronous and fleet variants, readers of a run folder, and runs
with spies or a kill in the middle (spies, not mocks: the engine still generates every token and
the trainer still trains)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from noria.launch.job import LocalJob
from noria.loop import rl_loop


def rl_args(model: Path, **extra) -> list[str]:
    base = {
        "model.path": str(model),
        "data.task": "arithmetic",
        "data.task_args": "{n_train: 400, n_test: 16, max_operand: 30, ops: ['+']}",
        "reward.name": "toy_rewards:digits",
        "rollout.n_samples": 8,
        "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 8,
        "train.optim.lr": "3e-3",
        "engine.kv_cache_tokens": 4096,
    }
    base.update(extra)
    out = []
    for k, v in base.items():
        out += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rewards(run: Path) -> list[float]:
    return [row["rollout/reward_mean"] for row in read_jsonl(run / "metrics.jsonl")]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# ------------------------------------------------------------------------------------ asynchronous RL


def async_args(model, **extra):
    base = {
        "rollout.placement": "disaggregated", "rollout.max_staleness": 1, "train.loss.off_policy": "tis",
        "reward.name": "toy_rewards:slow_digits", "rollout.n_samples": 4, "rollout.prompts_per_step": 4,
        "train.max_steps": 6, "sync.transport": "disk",
    }  # fmt: skip
    base.update(extra)
    return rl_args(model, **base)


def run_spied(config, run_dir, resume=None):
    """Run the loop with random generate and train latencies; returns [(version at train time, groups)]."""
    job = LocalJob.build(config, str(run_dir), resume, False)
    trained = []
    rng = random.Random(0)
    real_generate, real_train = job.client.generate, job.train

    async def slow_generate(req):
        await asyncio.sleep(rng.random() * 0.05)
        return await real_generate(req)

    def slow_train(groups):
        trained.append((job.weight_version, list(groups)))
        time.sleep(rng.random() * 0.2)
        return real_train(groups)

    job.client.generate, job.train = slow_generate, slow_train
    try:
        asyncio.run(job.run(rl_loop))
    finally:
        job.close()
    return trained, job


# ------------------------------------------------------------------------------------ engine fleets


def fleet_args(model, **extra):
    base = {
        "rollout.placement": "disaggregated", "engine.deterministic": True, "rollout.n_samples": 4,
        "train.max_steps": 3, "sync.verify": True,
    }  # fmt: skip
    base.update(extra)
    return rl_args(model, **base)


def steps(run) -> list[dict]:
    return read_jsonl(run / "metrics.jsonl")


def check_nothing_lost(trained: list[int], rows: list[dict], batch: int) -> None:
    """Every group id trained at most once, every step a full batch, and every id skipped below the
    last one trained accounted for: dropped by a buffer filter, still waiting, or in flight at the end."""
    assert len(trained) == len(set(trained)) == batch * len(rows), "a group was trained twice, or a batch came short"
    skipped = set(range(max(trained) + 1)) - set(trained)
    dropped = sum(v for k, v in rows[-1].items() if k.startswith("buffer/dropped/"))
    assert len(skipped) <= dropped + rows[-1]["buffer/size"] + rows[-1]["rollout/in_flight_groups"], skipped


def run_with_a_kill(job, kill_at: int, kill, busy: str | None = None) -> list:
    """Run the loop; ``kill()`` once ``kill_at`` requests were sent, and with ``busy`` (an engine's
    URL) only once that engine has a request in flight (else its requests may all have been answered
    when the kill lands, and nothing would be regenerated). Returns the trained groups."""
    trained, sent = [], [0]
    real_generate, real_train = job.client.generate, job.train
    killer: list[asyncio.Task] = []

    async def kill_when_busy():
        if busy is not None:
            auth = {"Authorization": f"Bearer {job.api_key}"}
            async with httpx.AsyncClient(timeout=10) as client:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    load = (await client.get(f"{busy}/get_load", headers=auth)).json()
                    if load["num_running_reqs"] or load["num_waiting_reqs"]:
                        break
                    await asyncio.sleep(0.002)
        else:
            await asyncio.sleep(0.05)  # in flight on an engine
        kill()

    async def generate(req):
        sent[0] += 1
        if sent[0] == kill_at:
            killer.append(asyncio.ensure_future(kill_when_busy()))
        return await real_generate(req)

    def train(groups):
        trained.extend(g.group_id for g in groups)
        return real_train(groups)

    job.client.generate, job.train = generate, train
    asyncio.run(job.run(rl_loop))
    assert killer and killer[0].done(), "the run ended before the kill"
    return trained
