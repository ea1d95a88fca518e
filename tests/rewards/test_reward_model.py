"""Rewards served by a model (reward.model): a real judge engine (`noria serve` of the tiny model,
started by the run's own machinery) batching concurrent requests and then killed mid-run; a scripted
judge server on a real 127.0.0.1 socket for the verdicts, the mixed weights, the request-id refusal,
the rubric and the cache; a socket that accepts and never answers for the timeout; the parsers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from noria.config import RunConfig, load
from noria.config.reward import RewardConfig, RewardModelConfig
from noria.errors import NoriaError
from noria.rewards.judge import JudgeFailure, parse_verdict, parse_verdicts
from noria.rewards.model import bind_judge, model_reward, start_judge, unbind_judge
from noria.rewards.registry import eval_reward
from noria.rewards.runner import score_async
from noria.rollout.buffer import DropStreak, GroupBuffer
from noria.types import Group, Prompt, Sample, Status

GOLD_TEMPLATE = "Q: {{ prompt }}\nA: {{ response }}\nGOLD: {{ label }}{% if criterion %}\nC: {{ criterion }}{% endif %}"


def judge_cfg(url: str | None = None, **kw) -> RewardModelConfig:
    base = dict(kind="judge", name="scripted", url=url, api="openai", template=GOLD_TEMPLATE, timeout_s=5.0, retries=0)
    base.update(kw)
    cfg = RewardModelConfig(**base)
    cfg.validate()
    return cfg


def samples_of(*responses: str) -> list[Sample]:
    return [Sample(prompt_ids=[1], response_text=r, status=Status.COMPLETED, group_id=0, index=i) for i, r in enumerate(responses)]


# ------------------------------------------------------------------------------------- parsers


def test_parsers_number_label_boxed_and_unparseable():
    number = RewardModelConfig(kind="judge", url="http://x")
    assert parse_verdict(number, "The answer is fine.\nScore: 7") == pytest.approx(0.7)
    assert parse_verdict(number, "I give it 3 out of... 10") == 1.0  # no `Score:`: the last number
    with pytest.raises(JudgeFailure) as out:
        parse_verdict(number, "Score: 12")
    assert out.value.kind == "unparseable" and "score_range" in str(out.value)
    with pytest.raises(JudgeFailure) as out:
        parse_verdict(number, "no verdict here")
    assert out.value.kind == "unparseable" and "judge 'judge'" in str(out.value)
    label = RewardModelConfig(kind="judge", url="http://x", parser="label", labels={"correct": 1.0, "incorrect": 0.0})
    assert parse_verdict(label, "Verdict: INCORRECT, the sum is off") == 0.0
    assert parse_verdict(label, "This is correct.") == 1.0
    with pytest.raises(JudgeFailure):
        parse_verdict(label, "uncorrectable")  # whole words only
    boxed = RewardModelConfig(kind="judge", url="http://x", parser="boxed", score_range=[1.0, 5.0])
    assert parse_verdict(boxed, r"so \boxed{2} then \boxed{5}") == 1.0
    regex = RewardModelConfig(kind="judge", url="http://x", pattern=r"\[\[(\d+)\]\]")
    assert parse_verdicts(regex, "a [[2]] b [[10]]", 2) == [pytest.approx(0.2), 1.0]
    with pytest.raises(JudgeFailure):
        parse_verdicts(regex, "a [[2]]", 2)
    answer = RewardModelConfig(kind="judge", url="http://x", parser="answer")
    assert parse_verdict(answer, "The final answer is 1,082.", "1082") == 1.0  # the last number, as a number
    assert parse_verdict(answer, r"It says \boxed{82}, then 7 more words", " 82") == 1.0  # a \boxed{} first
    assert parse_verdict(answer, "The final answer is 83.", "82") == 0.0
    assert parse_verdict(answer, "To add 39 + 43, we need", "82") == 0.0  # the judge's last number is what it read
    with pytest.raises(JudgeFailure) as out:
        parse_verdict(answer, "I cannot tell.", "82")
    assert out.value.kind == "unparseable"
    with pytest.raises(JudgeFailure) as out:
        parse_verdict(answer, "42", None)  # nothing to compare with: the sample fails, naming why
    assert out.value.kind == "raised" and "label" in str(out.value)


def test_config_checks_name_the_key():
    with pytest.raises(NoriaError, match="reward.model.kind judge: set exactly one of reward.model.url"):
        RewardModelConfig(kind="judge").validate()
    with pytest.raises(NoriaError, match="reward.model.parser label needs reward.model.labels"):
        RewardModelConfig(kind="judge", url="http://x", parser="label").validate()
    with pytest.raises(NoriaError, match=r"reward.model.rubric\[0\]"):
        RewardModelConfig(kind="judge", url="http://x", rubric=[{"criteria": "x"}]).validate()


# ----------------------------------------------------------------------- a scripted judge server


@contextlib.asynccontextmanager
async def scripted_judge(state: dict):
    """An OpenAI-compatible judge on 127.0.0.1: Score 10 when the answer equals GOLD or holds
    "trick", else 0; one line per criterion listed; echoes X-Request-Id (or another id when told)."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        state["requests"] = state.get("requests", 0) + 1
        text = body["messages"][-1]["content"]
        answer = re.search(r"A: (.*)\nGOLD: (.*?)(\n|$)", text)
        score = 10 if answer.group(1) == answer.group(2) or "trick" in answer.group(1) else 0
        listed = re.findall(r"\b\d+\. ", text)
        content = "\n".join(f"Score: {score}" for _ in listed) if listed else f"Score: {score}"
        rid = request.headers.get("X-Request-Id", "")
        echo = "judge-someone-else" if state.get("wrong_rid") else rid
        return web.json_response({"choices": [{"message": {"content": content}}]}, headers={"X-Request-Id": echo})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def reward_with(cfg: RewardModelConfig, **kw) -> RewardConfig:
    return RewardConfig(name=kw.pop("name", "exact_match"), model=cfg, **kw)


def test_mixed_weights_components_agreement_and_cache():
    async def main():
        state: dict = {}
        async with scripted_judge(state) as url:
            unbind_judge("scripted")
            reward = reward_with(judge_cfg(url), rule_weight=0.25)
            reward.model.weight = 0.75
            samples = samples_of("4", "5", "trick")
            counts = await score_async(samples, reward, ["4"] * 3, prompts=["2+2?"] * 3)
            # rule (exact_match): 1, 0, 0; judge: 1, 0, 1 ("trick" fools it)
            assert [s.reward for s in samples] == [1.0, 0.0, 0.75]
            assert samples[2].metadata["rewards"] == {"exact_match": 0.0, "scripted": 1.0}
            metrics = counts.as_metrics()
            assert metrics["reward/component/exact_match"] == pytest.approx(1 / 3)
            assert metrics["reward/component/scripted"] == pytest.approx(2 / 3)
            assert metrics["reward/agreement"] == pytest.approx(2 / 3)
            assert metrics["reward/model_latency_s_p50"] > 0 and metrics["reward/model_cache_hits"] == 0
            assert state["requests"] == 3
            again = samples_of("4", "5", "trick")
            counts = await score_async(again, reward, ["4"] * 3, prompts=["2+2?"] * 3)
            assert counts.model_cache_hits == 3 and state["requests"] == 3  # same judge, prompt, response: cached
            assert [s.reward for s in again] == [1.0, 0.0, 0.75]
            same = samples_of("7", "7", "7")  # one group, one answer: asked once
            counts = await score_async(same, reward, ["4"] * 3, prompts=["3+3?"] * 3)
            assert state["requests"] == 4 and counts.model_cache_hits == 2 and counts.scored == 3
            # held-out accuracy is the rule's alone
            assert eval_reward(reward).model.kind == "none" and eval_reward(reward).name == "exact_match"

    asyncio.run(main())


def test_rubric_each_and_all_and_request_id_mismatch_is_refused():
    async def main():
        state: dict = {}
        async with scripted_judge(state) as url:
            rubric = [{"criterion": "right sum", "weight": 3.0}, {"criterion": "short", "weight": 1.0}]
            for mode, requests in (("each", 4), ("all", 2)):
                unbind_judge("scripted")
                state.clear()
                samples = samples_of("4", "5")
                reward = reward_with(judge_cfg(url, rubric=rubric, rubric_mode=mode), rule_weight=0.0)
                counts = await score_async(samples, reward, ["4", "4"], prompts=["2+2?"] * 2)
                assert [s.reward for s in samples] == [1.0, 0.0] and counts.scored == 2, samples[0].status_reason
                assert state["requests"] == requests, mode
            unbind_judge("scripted")
            state["wrong_rid"] = True
            samples = samples_of("4")
            counts = await score_async(samples, reward_with(judge_cfg(url), rule_weight=0.0), ["4"], prompts=["2+2?"])
            assert counts.failed["mismatch"] == 1 and samples[0].reward is None and samples[0].status is Status.FAILED
            assert "refused" in samples[0].status_reason and url in samples[0].status_reason

    asyncio.run(main())


def test_a_judge_that_never_answers_times_out_per_request_with_retries():
    with socket.socket() as hole:  # accepts connections (the backlog) and never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        unbind_judge("scripted")
        reward = reward_with(judge_cfg(url, timeout_s=0.3, retries=1), rule_weight=0.0)
        samples = samples_of("4", "5")
        counts = asyncio.run(score_async(samples, reward, ["4", "4"], prompts=["2+2?"] * 2))
    assert counts.failed["timeout"] == 2 and counts.scored == 0
    assert all("timeout_s=0.3" in s.status_reason and "after 2 tries" in s.status_reason for s in samples)
    assert "judge 'scripted' at " + url in samples[0].status_reason


def test_a_scoring_call_cancelled_mid_request_leaves_no_failing_task_behind():
    """A run that stops cancels its scoring call; the request it shares (shielded, so that another
    waiter keeps it) goes on, and its retry meets a closed client: that is a failed sample, never an
    exception that no one retrieves ("Task exception was never retrieved" at every stop)."""
    import gc

    async def main(url: str) -> list[dict]:
        seen: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: seen.append(context))
        reward = reward_with(judge_cfg(url, timeout_s=0.2, retries=1), rule_weight=0.0)
        call = asyncio.ensure_future(score_async(samples_of("4"), reward, ["4"], prompts=["2+2?"]))
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.6)  # the shielded request's first try times out; its retry finds the client closed
        gc.collect()
        return seen

    with socket.socket() as hole:  # accepts connections (the backlog) and never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        unbind_judge("scripted")
        seen = asyncio.run(main(f"http://127.0.0.1:{hole.getsockname()[1]}"))
    assert seen == []


# ------------------------------------------------------------------------- a real judge engine


def engine_metrics(url: str, headers: dict) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^noria_engine_(\w+) ([-\d.e+]+)$", text, re.MULTILINE)}


def test_real_judge_engine_batches_then_dies_and_the_run_stops_naming_it(tiny_model_dir, tmp_path, monkeypatch):
    config = load(RunConfig, None, [
        "--model.path", str(tiny_model_dir), "--data.task", "arithmetic", "--reward.model.kind", "judge",
        "--reward.model.engine", str(tiny_model_dir), "--reward.model.max_new_tokens", "12",
        "--reward.model.retries", "0", "--reward.rule_weight", "0", "--engine.kv_cache_tokens", "4096",
        "--reward.model.engine_threads", "1",
    ])  # fmt: skip
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # set, it would win over engine_threads
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    (child,) = start_judge(config, tmp_path)
    try:
        environ = (Path("/proc") / str(child.pid) / "environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ  # reward.model.engine_threads
        assert b"OMP_WAIT_POLICY=PASSIVE" in environ  # a CPU judge sleeps between parallel regions
        scorer = model_reward(config.reward.model)
        url, headers = scorer.client.url, scorer.client.headers
        reward = dataclasses.replace(config.reward, name="exact_match")
        before = engine_metrics(url, headers)
        samples = samples_of(*(str(n) for n in range(8)))
        counts = asyncio.run(score_async(samples, reward, ["3"] * 8, prompts=["What is 1 + 2?"] * 8))
        after = engine_metrics(url, headers)
        # the random tiny judge rarely writes a score: each sample is scored or fails as unparseable, never otherwise
        assert counts.scored + counts.failed["unparseable"] == 8 and scorer.client.requests == 8
        tokens, steps = after["generated_tokens"] - before["generated_tokens"], after["steps"] - before["steps"]
        assert tokens > steps > 0, (tokens, steps)  # more than one request per engine step: batched
        child.kill()
        dead = samples_of("1", "2")
        counts = asyncio.run(score_async(dead, reward, ["3"] * 2, prompts=["What is 1 + 2?"] * 2))
        assert counts.failed["unreachable"] == 2
        assert f"judge 'judge' at {url} is unreachable" in dead[0].status_reason
        # the run's existing failure counting stops it, naming the judge
        streak = DropStreak(1)
        buffer = GroupBuffer(capacity=4, max_staleness=0, filters=[], on_drop=streak.dropped)
        group = Group(group_id=0, prompt=Prompt(prompt="What is 1 + 2?", label="3"), samples=tuple(dead))
        with pytest.raises(NoriaError, match=f"no group could be trained.*judge 'judge' at {re.escape(url)} is unreachable"):
            asyncio.run(buffer.put(group))
    finally:
        child.stop()
        unbind_judge("judge")


def test_bound_judge_refuses_unknown_engine_outside_a_run():
    unbind_judge("judge")
    cfg = RewardModelConfig(kind="judge", engine="some-model")
    with pytest.raises(NoriaError, match="reward.model.engine 'some-model'"):
        model_reward(cfg)
    bind_judge(cfg, "http://127.0.0.1:9", None, None)  # bound: no error
    assert model_reward(cfg).client.url == "http://127.0.0.1:9"
    unbind_judge("judge")
