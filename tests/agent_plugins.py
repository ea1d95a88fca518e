"""Plug-ins for the agent tests, loaded by import path (``agent_plugins:two_turn_agent``)."""

from __future__ import annotations

import asyncio

import httpx

from noria.rollout.generate import generate_one
from noria.types import Group, Sample, Status

OBSERVATION = "Now answer with digits only."


async def two_turn_agent(ctx, prompt, base_url):
    """Ask, append an environment observation, ask again; the reward function scores the last answer."""
    messages = [{"role": "user", "content": prompt.prompt}]
    async with httpx.AsyncClient(timeout=120) as http:
        for _ in range(2):
            r = await http.post(f"{base_url}/chat/completions", json={"messages": messages})
            r.raise_for_status()
            messages += [r.json()["choices"][0]["message"], {"role": "tool", "content": OBSERVATION}]
    return {"metadata": {"final_answer": messages[-2]["content"]}}


def digits_of_final(response, label, metadata) -> float:
    """Share of digits in the agent's final answer (the multi-turn twin of toy_rewards.digits)."""
    chars = [c for c in metadata.get("final_answer", "") if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


async def scoring_agent(ctx, prompt, base_url):
    """One turn; scores itself (reward 0.25) and names a status."""
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()
    return {"reward": 0.25, "status": "truncated", "metadata": {"scored_by": "agent"}}


async def raising_agent(ctx, prompt, base_url):
    raise RuntimeError("environment crashed")


async def slow_agent(ctx, prompt, base_url):
    await asyncio.sleep(30)
    return {}


async def env_step_generate(ctx, sample: Sample) -> Sample:
    """A generate function that records its own tokens: one engine turn plus 3 environment tokens."""
    sample = await generate_one(ctx, sample)
    env = [5, 6, 7]
    sample.response_ids += env
    sample.loss_mask += [0] * len(env)
    sample.rollout_logprobs += [0.0] * len(env)
    sample.weight_versions += [-1] * len(env)
    sample.metadata["env_tokens"] = len(env)
    return sample


async def constant_rollout(ctx, prompts):
    """A rollout function: one fixed two-token sample per prompt, scored by the configured reward."""
    groups = []
    for i, (prompt, ids) in enumerate(prompts):
        s = Sample(list(ids), [11, 12], [1, 1], [-0.1, -0.2], [0, 0], response_text="12", status=Status.COMPLETED)
        s.group_id, s.index = ctx.first_group_id + i, 0
        groups.append(Group(ctx.first_group_id + i, prompt, (s,)))
    return groups


async def broken_rollout(ctx, prompts):
    """Violates the contract: the mask is shorter than the response."""
    s = Sample([1], [11, 12], [1], [-0.1], [0])
    return [Group(ctx.first_group_id + i, p, (s,)) for i, (p, _) in enumerate(prompts)]


def not_async(ctx, sample):
    return sample


TOOL_TOKEN = "<tool_call>"


async def tiny_tool_agent(ctx, prompt, base_url):
    """A tool protocol a tiny random model can stumble on: any reply holding the ``<tool_call>`` token
    calls the ``answer`` tool, whose result comes back as a tool message for a second turn.
    Reward 1 for an episode that called the tool, 0 otherwise (statuses: ``solved`` / ``no_tool_call``)."""
    messages = [{"role": "user", "content": prompt.prompt}]
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{base_url}/chat/completions", json={"messages": messages})
        r.raise_for_status()
        reply = r.json()["choices"][0]
        messages.append(reply["message"])
        text = reply["message"]["content"] + "".join(reply.get("noria_unparsable_tool_calls") or [])
        if TOOL_TOKEN not in text:
            return {"reward": 0.0, "metadata": {"agent_status": "no_tool_call"}}
        messages.append({"role": "tool", "content": f"answer: {prompt.label}"})
        r = await http.post(f"{base_url}/chat/completions", json={"messages": messages})
        r.raise_for_status()
    return {"reward": 1.0, "metadata": {"agent_status": "solved"}}
