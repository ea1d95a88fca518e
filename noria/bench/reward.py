"""``noria bench reward``: a generative judge's throughput and latency, and how much of its scoring
hides behind generation when each sample is scored as it finishes versus per group.

The judge everywhere is the one of ``examples/grpo_smollm2_judge.yaml`` (``ANSWER_JUDGE``: it is asked
for each response's final answer, compared with the reference, ``parser: answer``).

Throughput: ``--rows`` distinct (prompt, response) rows scored by the judge served by ``noria serve``
(``reward.model.engine``, the run's machinery), the cache off, every request sent at once (the
engine batches them) and then one at a time (``reward.model.max_concurrency`` 1): rows/s and the
p50/p99 seconds of one request.

Rollout: the policy in this process (the built-in engine behind ``LocalEngineClient``, as the
colocated placement) generates ``--groups`` groups of ``--n-samples`` arithmetic answers through the
real rollout scheduler, each case with the same seeds (the same answers), scored by:

- ``rule``: the arithmetic task's rule (``numeric``), the baseline;
- ``judge_each``: the served judge, each sample scored as it finishes (``reward.score_each_sample``);
- ``judge_group``: the served judge, each group scored once its last sample finished (``false``);
- ``judge_shared``: the judge on the policy's own engine (``reward.model.engine: shared``, priority
  -1), each sample as it finishes.

Per case: the wall seconds until every group is in the buffer, ``time/reward_s`` (scoring seconds,
summed over scoring calls), ``time/reward_hidden_s`` (the part spent while the sample's group was
still generating) and their ratio, the judge's p50/p99 request seconds, its agreement with the rule.
A judge verdict that does not parse fails its sample (counted, not retried).

Whole steps (``--steps N``, with ``--staleness k``): ``noria train`` of the main job's recipe
(SmolLM2 on the arithmetic task, 8 prompts x 8 samples) in fully asynchronous mode (``max_staleness``
k, ``tis``), the policy's engine its own ``noria serve`` process, in fresh subprocesses, in
``--step-rounds`` rounds of three runs (interleaved: a slow stretch of the machine hits each case):
scored by the rule; by the judge on an engine of its own (a third process; the judge of
``examples/grpo_smollm2_judge.yaml``, reading each answer for ``parser: answer``); by that judge on
the policy's engine (``shared``). Per case: seconds per step over the steps after the first (the
first builds kernels), the median over rounds, and ``vs_rule``, the median over rounds of the ratio
to the rule's step time in the same round; the scoring seconds and the part hidden behind
generation, the judge's p50/p99 (of the middle round). The runs differ in their rewards, so in what they train from step 2
on: read the step time as the cost of a step of this recipe, not of the same samples.

Not measured: several engines, GPUs. On a small CPU the judge's process and the policy's engine share the cores, so a
judge's cost shows in the rollout's wall time: say what else ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from noria.bench import print_table, work_folder, write_json


def add_arguments(parser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the policy (catalog name or HF folder)")
    parser.add_argument("--judge", default=None, help="the judge served by noria serve (default: the policy's model)")
    parser.add_argument("--groups", type=int, default=4, help="groups of the rollout cases")
    parser.add_argument("--n-samples", type=int, default=4, help="samples per group")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="policy tokens per answer")
    parser.add_argument("--judge-tokens", type=int, default=8, help="judge tokens per verdict")
    parser.add_argument("--rows", type=int, default=16, help="rows of the throughput cases")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each rollout case (interleaved); the fastest is reported")
    parser.add_argument("--steps", type=int, default=0, help="whole-step cases: `noria train` steps per case (0: none)")
    parser.add_argument("--staleness", type=int, default=2, help="whole-step cases: rollout.max_staleness (fully async)")
    parser.add_argument("--step-rounds", type=int, default=1, help="whole-step cases: rounds of the cases, interleaved (medians)")
    parser.add_argument("--judge-threads", type=int, default=None,
                        help="whole-step cases: reward.model.engine_threads of the judge's own engine (default: as the run)")
    parser.add_argument("--work-dir", default=None,
                        help="whole-step cases: folder for the configs and run folders (kept; default: a new temporary folder, removed at exit)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")


def main(args) -> int:
    from noria.config import EngineConfig, RunConfig, load
    from noria.engine import Engine
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path
    from noria.rewards.model import start_judge_engine, unbind_judge

    policy = model_path(args.model)
    judge = str(model_path(args.judge)) if args.judge else str(policy)
    config = load(RunConfig, None, [
        "--model.path", str(policy), "--data.task", "arithmetic", "--reward.name", "numeric", "--reward.rule_weight", "0",
        "--reward.model.kind", "judge", "--reward.model.engine", judge, "--reward.model.max_new_tokens", str(args.judge_tokens),
        "--reward.model.cache", "false", "--reward.model.retries", "0", "--reward.model.timeout_s", "300",
        "--reward.model.parser", ANSWER_JUDGE["parser"], "--reward.model.template", ANSWER_JUDGE["template"],
    ])  # fmt: skip
    tokenizer = load_tokenizer(policy)
    engine = Engine.from_path(str(policy), EngineConfig(kv_cache_tokens=16384), dtype=config.model.dtype)
    with tempfile.TemporaryDirectory(prefix="noria-bench-reward-") as tmp:
        child, _ = start_judge_engine(config, Path(tmp))
        try:
            prompts = _prompts(tokenizer, args.groups)
            throughput = _throughput(config, prompts, args.rows)
            rollout = _rollouts(args, config, engine, tokenizer, prompts)
        finally:
            child.stop()
            unbind_judge(config.reward.model.name)
            engine.shutdown(1.0)
    results = throughput + rollout
    _print(throughput, rollout)
    if args.steps > 0:
        results += whole_steps(str(policy), judge, args.steps, args.staleness, args.work_dir, judge_threads=args.judge_threads,
                               rounds=args.step_rounds)
    if args.json:
        write_json(args.json, "reward", results, policy=str(args.model), judge=args.judge or str(args.model))
    return 0


def _prompts(tokenizer: Any, n: int) -> list[tuple[Any, list[int]]]:
    from noria.data import render_prompts
    from noria.data.tasks import generate_split

    records = generate_split("arithmetic", "test", {"n_test": max(n, 8), "seed": 0})[:n]
    return [(r.prompt, r.ids) for r in render_prompts(records, tokenizer)]


# ---------------------------------------------------------------------------------- throughput


def _throughput(config: Any, prompts: list, rows: int) -> list[dict[str, Any]]:
    from noria.rewards.runner import score_async
    from noria.types import Sample, Status

    from noria.rewards.model import bind_judge, model_reward

    served = model_reward(config.reward.model).client
    key = served.headers.get("Authorization", "").removeprefix("Bearer ") or None
    out = []
    for case, concurrency in (("judge_batched", 64), ("judge_one_at_a_time", 1)):
        reward = dataclasses.replace(config.reward, model=dataclasses.replace(config.reward.model, max_concurrency=concurrency))
        bind_judge(reward.model, served.url, key, served.tokenizer)  # the same server, this many requests in flight
        samples = [Sample(prompt_ids=[1], response_text=f"The answer is {i}.", status=Status.COMPLETED, group_id=0, index=i) for i in range(rows)]
        chosen = [prompts[i % len(prompts)][0] for i in range(rows)]
        counts = asyncio.run(score_async(samples, reward, [p.label for p in chosen], prompts=[p.prompt for p in chosen]))
        metrics = counts.as_metrics()
        out.append({
            "case": case, "metric": "judge rows/s", "noria": round(rows / counts.seconds, 3), "peers": {}, "bound": None,
            "latency_p50_s": round(metrics.get("reward/model_latency_s_p50", float("nan")), 4),
            "latency_p99_s": round(metrics.get("reward/model_latency_s_p99", float("nan")), 4),
            "rows": rows, "scored": counts.scored, "failed": dict(counts.failed),
        })  # fmt: skip
    bind_judge(config.reward.model, served.url, key, served.tokenizer)
    return out


# ------------------------------------------------------------------------------------- rollout


def _rollouts(args: Any, config: Any, engine: Any, tokenizer: Any, prompts: list) -> list[dict[str, Any]]:
    from noria.rewards.model import bind_client, unbind_judge
    from noria.rewards.shared import SharedJudgeClient
    from noria.rollout import LocalEngineClient

    client = LocalEngineClient(engine)
    judge = config.reward
    rule = dataclasses.replace(judge, model=dataclasses.replace(judge.model, kind="none"), rule_weight=1.0)
    shared_cfg = dataclasses.replace(judge.model, name="shared", engine="shared")
    bind_client(shared_cfg, SharedJudgeClient(shared_cfg, client, tokenizer))
    cases = [
        ("rule", rule), ("judge_each", judge), ("judge_group", dataclasses.replace(judge, score_each_sample=False)),
        ("judge_shared", dataclasses.replace(judge, model=shared_cfg)),
    ]  # fmt: skip
    _rollout(args, client, tokenizer, prompts, rule)  # a first pass builds the engine's kernels for these batches, untimed
    best: dict[str, tuple[float, dict[str, float]]] = {}
    try:
        for _ in range(args.repeats):  # cases interleaved, so that a slow minute of the machine hits each
            for case, reward in cases:
                wall, m = _rollout(args, client, tokenizer, prompts, reward)
                if case not in best or wall < best[case][0]:
                    best[case] = (wall, m)
    finally:
        unbind_judge("shared")
    out = [_case(case, *best[case]) for case, _ in cases]
    for row in out:
        row["vs_rule"] = round(row["noria"] / out[0]["noria"], 3)  # the rollout's wall time over the rule's
    return out


def _case(case: str, wall: float, m: dict[str, float]) -> dict[str, Any]:
    """One rollout case's JSON entry."""
    seconds, hidden = m.get("time/reward_s", 0.0), m.get("time/reward_hidden_s", 0.0)
    return {
        "case": case, "metric": "rollout wall s", "noria": round(wall, 3), "peers": {}, "bound": None,
        "reward_s": round(seconds, 3), "reward_hidden_s": round(hidden, 3),
        "hidden_frac": round(hidden / seconds, 3) if seconds > 0 else None,
        "latency_p50_s": m.get("reward/model_latency_s_p50"), "latency_p99_s": m.get("reward/model_latency_s_p99"),
        "scored": int(m.get("reward/scored", 0)), "failed": int(m.get("reward/failed", 0)),
        "tokens": int(m.get("rollout/tokens", 0)), "groups_dropped": int(m["buffer/dropped"]), "agreement": m.get("reward/agreement"),
    }  # fmt: skip


def _rollout(args: Any, client: Any, tokenizer: Any, prompts: list, reward: Any) -> tuple[float, dict[str, float]]:
    """Every group of ``prompts`` through the rollout scheduler: (wall seconds, its metrics)."""
    from noria.config import RolloutConfig
    from noria.rollout import RolloutContext
    from noria.rollout.buffer import GroupBuffer
    from noria.rollout.scheduler import RolloutScheduler

    feed = iter(prompts)
    n, groups = args.n_samples, len(prompts)
    cfg = RolloutConfig(n_samples=n, prompts_per_step=groups, max_new_tokens=args.max_new_tokens, placement="disaggregated")
    scheduler = RolloutScheduler(
        RolloutContext(client, tokenizer, cfg, seed=7), lambda: next(feed, None), GroupBuffer(capacity=groups), reward,
        n_samples=n, groups_per_step=groups, max_staleness=0, max_in_flight=n * groups, granularity="sample",
    )  # fmt: skip

    async def go() -> tuple[float, dict[str, float]]:
        start = time.perf_counter()
        scheduler.start()
        got = 0
        while got + sum(scheduler.buffer.dropped.values()) < groups:  # a group whose every sample failed is dropped
            got += len(scheduler.buffer.take(groups - got, version=0))
            if got + sum(scheduler.buffer.dropped.values()) < groups:
                await asyncio.wait_for(scheduler.wait_change(), 600)
        wall = time.perf_counter() - start
        metrics = scheduler.metrics()
        metrics["buffer/dropped"] = float(sum(scheduler.buffer.dropped.values()))
        await scheduler.close()
        return wall, metrics

    return asyncio.run(go())


def _print(throughput: list[dict], rollout: list[dict]) -> None:
    print_table(
        "judge throughput (rows/s, higher is better) and request latency",
        ["case", "rows/s", "p50 s", "p99 s", "scored", "failed"],
        [[r["case"], r["noria"], r["latency_p50_s"], r["latency_p99_s"], r["scored"], sum(r["failed"].values())] for r in throughput],
    )
    print()
    print_table(
        "rollout until every group is scored (wall s, lower is better); scoring hidden behind generation",
        ["case", "wall s", "vs rule", "reward s", "hidden s", "hidden frac", "p50 s", "p99 s", "scored", "failed"],
        [[r["case"], r["noria"], r["vs_rule"], r["reward_s"], r["reward_hidden_s"], r["hidden_frac"], r["latency_p50_s"], r["latency_p99_s"],
          r["scored"], r["failed"]] for r in rollout],
    )  # fmt: skip


# ----------------------------------------------------------------------------------- whole steps

ANSWER_JUDGE = {
    "kind": "judge", "name": "judge", "weight": 1.0, "parser": "answer", "max_new_tokens": 16, "temperature": 0.0,
    "template": "What is the final answer in the text below? Reply with the number only.\n\nText: {{ response }}",
    "timeout_s": 120.0, "retries": 1,
}  # fmt: skip
"""The judge of ``examples/grpo_smollm2_judge.yaml``: it reads each answer off the response."""


def step_config(policy: str, judge: str | None, steps: int, staleness: int) -> dict[str, Any]:
    """The main job's recipe, fully asynchronous, scored by the rule (``judge`` None), by a judge
    served by its own engine (a model), or by the policy's engine (``shared``)."""
    reward: dict[str, Any] = {"name": "numeric"}
    if judge is not None:
        reward.update(rule_weight=0.0, model={**ANSWER_JUDGE, "engine": judge})
    return {
        "name": f"bench-reward-{'rule' if judge is None else 'shared' if judge == 'shared' else 'judge'}",
        "seed": 0,
        "model": {"path": policy},
        "data": {"task": "arithmetic", "task_args": {"n_train": 2000, "n_test": 200, "seed": 0, "ops": ["+"]}, "shuffle": True},
        "reward": reward,
        "rollout": {"n_samples": 8, "prompts_per_step": 8, "max_new_tokens": 32, "temperature": 0.7,
                    "placement": "disaggregated", "max_staleness": staleness},
        "train": {"max_steps": steps, "micro_batch_tokens": 4096, "activation_checkpointing": True, "logprob_chunk_tokens": 128,
                  "onednn_cache_capacity": 64, "loss": {"off_policy": "tis"},
                  "optim": {"state_dtype": "int8", "lr": 5e-6, "warmup_steps": 0, "grad_clip": 1.0}},
        "eval": {"every": 1000, "limit": 8},
    }  # fmt: skip


STEP_CASES = {"steps_rule": None, "steps_judge_engine": "engine", "steps_judge_shared": "shared"}
"""The whole-step cases and where each one's judge runs (None: the rule scores)."""


def whole_steps(
    policy: str, judge: str, steps: int, staleness: int, work_dir: str | None, cases: tuple[str, ...] = tuple(STEP_CASES),
    judge_threads: int | None = None, rounds: int = 1,
) -> list[dict[str, Any]]:
    """The whole-step cases (module docstring): one ``noria train`` per case and round, each in a fresh
    subprocess, the cases interleaved round by round (a slow stretch of the machine hits each); the
    first of ``cases`` is the baseline. Per case: the median step time over the rounds, and
    ``vs_rule`` the median over rounds of its step time over the baseline's in the same round."""
    import statistics

    work = work_folder(work_dir, "noria-bench-reward-steps-")
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    for r in range(rounds):
        for case in cases:
            who = {"engine": judge, "shared": "shared"}.get(STEP_CASES[case])
            cfg = step_config(policy, who, steps, staleness)
            if judge_threads is not None and STEP_CASES[case] == "engine":
                cfg["reward"]["model"]["engine_threads"] = judge_threads
            name = case if rounds == 1 else f"{case}-{r + 1}"
            runs[case].append(_step_run(work, name, cfg, f"async k={staleness}, reward {who or 'rule'}"))
    out = []
    for case, done in runs.items():
        row = dict(done[len(done) // 2] if rounds % 2 else done[0], case=case, staleness=staleness)
        row["noria"] = round(statistics.median(d["noria"] for d in done), 3)
        row["rounds_s"] = [d["noria"] for d in done]
        row["vs_rule"] = round(statistics.median(d["noria"] / b["noria"] for d, b in zip(done, runs[cases[0]])), 3)
        out.append(row)
    print()
    print_table(
        f"whole steps, fully async (max_staleness {staleness}), the policy's engine a process of its own; median of {rounds} "
        "round(s) (s per step, lower is better)",
        ["case", "step s", "vs rule", "rounds s", "reward s", "hidden frac", "p50 s", "p99 s", "agreement", "failed", "trainer idle"],
        [[r["case"], r["noria"], r["vs_rule"], " ".join(f"{x:.2f}" for x in r["rounds_s"]), r["reward_s"], r["hidden_frac"],
          r["latency_p50_s"], r["latency_p99_s"], r["agreement"], r["failed"], r["trainer_idle_frac"]] for r in out],
    )  # fmt: skip
    return out


def _step_run(work: Path, name: str, cfg: dict[str, Any], note: str) -> dict[str, Any]:
    """One whole-step run's figures (its steps after the first)."""
    from noria.bench.async_rl import read_rows, train

    f = train(work, name, cfg, note)
    rows = read_rows(work / name / "metrics.jsonl")[1:]
    total = lambda key: sum(r.get(key, 0.0) for r in rows)  # noqa: E731
    scoring, hidden = total("time/reward_s"), total("time/reward_hidden_s")
    return {
        "metric": "step s", "noria": round(f["wall_s"] / f["steps"], 3), "peers": {}, "bound": None, "steps": f["steps"],
        "judge_threads": cfg["reward"].get("model", {}).get("engine_threads"), "reward_s": round(scoring, 3),
        "reward_hidden_s": round(hidden, 3), "hidden_frac": round(hidden / scoring, 3) if scoring > 0 else None,
        "latency_p50_s": rows[-1].get("reward/model_latency_s_p50"), "latency_p99_s": rows[-1].get("reward/model_latency_s_p99"),
        "agreement": rows[-1].get("reward/agreement"), "failed": int(total("reward/failed")), "trainer_idle_frac": f["trainer_idle_frac"],
    }  # fmt: skip
