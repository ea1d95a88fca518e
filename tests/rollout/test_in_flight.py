"""In-flight work across a checkpoint (``noria.rollout.in_flight``), on the real built-in engine in
this process and the real scheduler: a record stops every request with its tokens, nothing runs
while it holds, released or resumed each trajectory continues from its tokens, which keep their
logprobs and weight versions; the resume policy and its config checks.

CPU, tiny random Llama, no processes (the whole-run kills are tests/launch/test_resume_in_flight.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from noria.config import EngineConfig, RewardConfig, RolloutConfig
from noria.config.schema import ConfigError
from noria.engine import Engine
from noria.models import load_model, load_tokenizer
from noria.rollout import LocalEngineClient, RolloutContext
from noria.rollout.buffer import GroupBuffer, group_from_dict
from noria.rollout.in_flight import LiveRequests, in_flight_policy, plan_resume, retract_reason
from noria.rollout.scheduler import RolloutScheduler
from noria.types import Group, Prompt, Sample, Status

NEW = 48  # tokens per trajectory: long enough that a record lands in the middle of them


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype=torch.float32)
    engine = Engine(model, load_tokenizer(tiny_model_dir), EngineConfig(kv_cache_tokens=8192), seed=0)
    yield engine
    engine.shutdown(drain_timeout_s=1.0)


def rollout_config(**kw) -> RolloutConfig:
    base = {"n_samples": 4, "prompts_per_step": 2, "max_new_tokens": NEW, "max_staleness": 1, "placement": "disaggregated"}
    return RolloutConfig(**{**base, **kw})


def scheduler_for(engine, prompts: list[Prompt]) -> RolloutScheduler:
    feed = iter([(p, [5 + p.index, 9, 11 + p.index]) for p in prompts])
    ctx = RolloutContext(LocalEngineClient(engine), engine.tokenizer, rollout_config(), seed=1, live=LiveRequests())
    return RolloutScheduler(
        ctx, lambda: next(feed, None), GroupBuffer(capacity=16, max_staleness=1), RewardConfig(name="toy_rewards:digits"),
        n_samples=4, groups_per_step=2, max_staleness=1, max_in_flight=8, granularity="sample",
    )  # fmt: skip


async def all_groups(scheduler: RolloutScheduler, n: int) -> list[Group]:
    groups: list[Group] = []
    while len(groups) < n:
        groups += scheduler.buffer.take(n - len(groups), version=1)
        if len(groups) < n:
            await asyncio.wait_for(scheduler.wait_change(), 60)
    return sorted(groups, key=lambda g: g.group_id)


def partials(record: list[dict]) -> dict[tuple[int, int], Sample]:
    """The recorded trajectories stopped in the middle: (group id, index) -> sample."""
    out = {}
    for g in record:
        for s in group_from_dict(g).samples:
            if s.status is Status.PENDING and s.response_ids:
                out[(s.group_id, s.index)] = s
    return out


def assert_continued(final: Sample, recorded: Sample) -> None:
    n = len(recorded.response_ids)
    assert final.response_ids[:n] == recorded.response_ids
    assert final.rollout_logprobs[:n] == recorded.rollout_logprobs
    assert final.weight_versions[:n] == recorded.weight_versions
    assert len(final.response_ids) == len(final.rollout_logprobs) == len(final.weight_versions) == len(final.loss_mask)
    assert final.status in (Status.COMPLETED, Status.TRUNCATED) and len(final.response_ids) <= NEW


def test_record_stops_every_request_with_its_tokens_and_release_continues_them(engine):
    """Recorded mid-generation: partial trajectories with tokens, logprobs and versions, the engine
    idle while the record holds (every request aborted, none started), the record plain JSON data;
    released, each trajectory ends with its recorded tokens first, then tokens of the weights served now."""
    prompts = [Prompt(prompt=f"q{i}", label="1", index=i) for i in range(2)]

    async def main():
        scheduler = scheduler_for(engine, prompts)
        scheduler.start()
        start = engine.metrics()["generated_tokens"]
        while engine.metrics()["generated_tokens"] < start + 40:  # mid-generation (2 x 4 trajectories of 48 tokens)
            await asyncio.sleep(0.005)
        record = await scheduler.record_in_flight()
        load = engine.get_load()
        await asyncio.sleep(0.1)
        idle = engine.get_load()["num_running_reqs"] + engine.get_load()["num_waiting_reqs"]
        engine.weights.update_from_state_dict(dict(engine.model.state_dict()), version=1)
        scheduler.release_in_flight()
        groups = await all_groups(scheduler, 2)
        await scheduler.close()
        return record, load, idle, groups

    record, load, idle, groups = asyncio.run(main())
    assert json.loads(json.dumps(record)) == record
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0 and idle == 0
    stopped = partials(record)
    assert stopped, "no trajectory was stopped in the middle"
    by_id = {(s.group_id, s.index): s for g in groups for s in g.samples}
    for key, recorded in stopped.items():
        assert 0 < len(recorded.response_ids) < NEW and set(recorded.weight_versions) == {0}
        final = by_id[key]
        assert_continued(final, recorded)
        assert final.weight_versions[len(recorded.response_ids):] == [1] * (len(final.response_ids) - len(recorded.response_ids))
    assert [g.group_id for g in groups] == [0, 1] and all(g.prompt == p for g, p in zip(groups, prompts))


def test_resumed_groups_continue_under_their_ids_from_the_recorded_tokens(engine):
    """A second scheduler (the resumed run) restarts the recorded groups before any new prompt: the
    same group ids and prompts; finished samples unchanged, stopped ones continued from their tokens."""
    prompts = [Prompt(prompt=f"r{i}", label="1", index=10 + i) for i in range(2)]

    async def record_then_resume():
        first = scheduler_for(engine, prompts)
        first.start()
        start = engine.metrics()["generated_tokens"]
        while engine.metrics()["generated_tokens"] < start + 40:
            await asyncio.sleep(0.005)
        record = await first.record_in_flight()
        await first.close()  # the run dies here: nothing of it goes on
        plan = plan_resume({"groups": record}, version=0, rollout=rollout_config())
        second = scheduler_for(engine, [])
        plan.apply(second, lambda p: pytest.fail(f"retracted {p}"))
        second.start()
        groups = await all_groups(second, len(record))
        await second.close()
        return record, plan, groups

    record, plan, groups = asyncio.run(record_then_resume())
    assert len(plan.groups) == len(record) and not plan.reasons
    assert plan.metrics()["resume/in_flight_continued"] == len(record)
    recorded = {g.group_id: g for g in plan.groups}
    assert sorted(recorded) == [g.group_id for g in groups]
    stopped = partials(record)
    assert stopped
    for group in groups:
        assert group.prompt == recorded[group.group_id].prompt
        for final, before in zip(group.samples, recorded[group.group_id].samples):
            if (final.group_id, final.index) in stopped:
                assert_continued(final, stopped[(final.group_id, final.index)])
            elif before.status is not Status.PENDING:  # finished before the record: kept as it was
                assert final.response_ids == before.response_ids and final.rollout_logprobs == before.rollout_logprobs


def test_a_group_already_too_stale_is_retracted_with_the_reason():
    """Its oldest token is of version 0; at the checkpoint's version 3 with max_staleness 1 the buffer
    would drop it whatever follows: it is retracted (prompt back to the source), the reason said."""
    prompt = Prompt(prompt="x", label="1", index=0)
    sample = Sample(prompt_ids=[1, 2], response_ids=[5, 6], loss_mask=[1, 1], rollout_logprobs=[-1.0, -2.0],
                    weight_versions=[0, 1], group_id=7)  # fmt: skip
    group = Group(group_id=7, prompt=prompt, samples=(sample,))
    assert retract_reason(group, version=1, max_staleness=1) is None
    reason = retract_reason(group, version=3, max_staleness=1)
    assert "stale" in reason and "version 0" in reason and "max_staleness is 1" in reason
    from noria.rollout.buffer import group_to_dict

    plan = plan_resume({"groups": [group_to_dict(group)], "retracted": [3, 4], "reason": "why not"}, version=3, rollout=rollout_config())
    assert plan.groups == [] and plan.prompts == [prompt]
    assert plan.reasons == {reason: 1, "why not": 2} and plan.metrics()["resume/in_flight_retracted"] == 3
    assert "3 retracted" in plan.describe() and reason in plan.describe()


def test_policy_auto_continues_only_asynchronous_rl_with_requests_it_can_stop():
    assert in_flight_policy(rollout_config()) == ("continue", "")
    policy, why = in_flight_policy(rollout_config(max_staleness=0))
    assert policy == "retract" and "synchronous RL" in why
    assert in_flight_policy(rollout_config(agent_fn="agent_plugins:echo"))[0] == "retract"
    assert in_flight_policy(rollout_config(resume_in_flight="retract"))[0] == "retract"
    rollout_config(resume_in_flight="continue").validate()
    with pytest.raises(ConfigError, match="resume_in_flight: continue cannot work here: rollout.agent_fn"):
        rollout_config(resume_in_flight="continue", agent_fn="agent_plugins:echo").validate()
    with pytest.raises(ConfigError, match="rollout.engine vllm"):
        rollout_config(resume_in_flight="continue", engine="vllm").validate()


def test_a_stop_string_across_the_seam_ends_the_continued_trajectory(engine):
    """The tokens before the seam came from an earlier request, whose engine never saw the ones after:
    a stop string completed across it is found by the client, which cuts the response there."""
    from noria.rollout.generate import seam_stop

    tok = engine.tokenizer
    before, after = tok.encode("1 ~#", add_special_tokens=False), tok.encode("@! 2 3 4", add_special_tokens=False)
    ctx = RolloutContext(None, tok, rollout_config(stop=["#@"]))
    n = len(before) + len(after)
    sample = Sample(prompt_ids=[1], response_ids=before + after, loss_mask=[1] * n, rollout_logprobs=[-1.0] * n, weight_versions=[0] * n)
    assert seam_stop(ctx, sample, len(before)) == "#@"
    cut = len(sample.response_ids)
    assert len(before) < cut < n and len(sample.rollout_logprobs) == len(sample.weight_versions) == len(sample.loss_mask) == cut
    assert "#@" in tok.decode(sample.response_ids) and "#@" not in tok.decode(sample.response_ids[:-1])
    whole = Sample(prompt_ids=[1], response_ids=before + after, loss_mask=[1] * n, rollout_logprobs=[-1.0] * n, weight_versions=[0] * n)
    assert seam_stop(RolloutContext(None, tok, rollout_config(stop=["%%"])), whole, len(before)) is None and len(whole.response_ids) == n


def test_an_engine_client_that_cannot_stop_one_request_retracts_or_is_refused(engine):
    """An engine fleet's client has no ``abort(rid)``: auto retracts (the reason names it), continue is refused."""
    from noria.errors import NoriaError

    class FleetLike:
        async def generate(self, req): ...

    assert in_flight_policy(rollout_config(), LocalEngineClient(engine)) == ("continue", "")
    policy, why = in_flight_policy(rollout_config(), FleetLike())
    assert policy == "retract" and "FleetLike" in why
    with pytest.raises(NoriaError, match="continue cannot work here: its engine client"):
        in_flight_policy(rollout_config(resume_in_flight="continue"), FleetLike())
