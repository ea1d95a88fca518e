"""Examples of the three rollout plug-in layers (docs/architecture.md, "Plug points"; contracts in noria.agent.plugins).

Put this folder on PYTHONPATH and name one function in the config (only one layer at a time):

    PYTHONPATH=examples noria train examples/agent_calculator_smollm2.yaml \\
        --rollout.agent_fn agent_layers:guess_then_check_agent      # or
        --rollout.generate_fn agent_layers:self_check_generate      # or
        --rollout.rollout_fn agent_layers:best_of_two_rollout

- ``guess_then_check_agent`` (agent function): plain OpenAI chat against the session server, which
  records every token; the agent only decides what to say next.
- ``self_check_generate`` (generate function): records its own tokens: one engine turn, then an
  environment message tokenized by the example (mask 0), then a second engine turn (mask 1).
- ``best_of_two_rollout`` (rollout function): replaces the whole rollout; here it runs the default
  generate function twice per sample slot and keeps the longer answer, returning the groups.
"""

from __future__ import annotations

import asyncio

import httpx

from noria.engine.protocol import GenerateRequest
from noria.rollout.generate import generate_one, sampling_params
from noria.types import Group, Sample, Status


async def guess_then_check_agent(ctx, prompt, base_url: str) -> dict:
    """Agent function: answer, hear "check your answer", answer again; the configured reward scores it."""
    messages = [{"role": "user", "content": prompt.prompt if isinstance(prompt.prompt, str) else prompt.prompt[-1]["content"]}]
    async with httpx.AsyncClient(timeout=600) as http:
        for follow_up in ("Check your answer and state it again as a number.", None):
            r = await http.post(f"{base_url}/chat/completions", json={"messages": messages})
            r.raise_for_status()
            messages.append(r.json()["choices"][0]["message"])
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
    return {"metadata": {"first_answer": messages[1]["content"]}}


async def self_check_generate(ctx, sample: Sample) -> Sample:
    """Generate function: engine turn, environment tokens (mask 0), engine turn; statuses from the last turn."""
    sample = await generate_one(ctx, sample)
    env = ctx.tokenizer.encode("\nAre you sure? Answer again:", add_special_tokens=False)
    sample.response_ids += env
    sample.loss_mask += [0] * len(env)
    sample.rollout_logprobs += [0.0] * len(env)
    sample.weight_versions += [-1] * len(env)
    req = GenerateRequest(sample.prompt_ids + sample.response_ids, sampling_params(ctx, sample))
    out = await ctx.engine.generate(req)
    sample.response_ids += out.output_ids
    sample.loss_mask += [1] * len(out.output_ids)
    sample.rollout_logprobs += list(out.logprobs)
    sample.weight_versions += list(out.weight_versions)
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    sample.status = Status.TRUNCATED if (out.finish_reason or {}).get("type") == "length" else Status.COMPLETED
    return sample


async def best_of_two_rollout(ctx, prompts) -> list[Group]:
    """Rollout function: two tries per sample slot, keep the longer; groups numbered from ctx.first_group_id."""

    async def slot(group_id: int, index: int, ids: list[int]) -> Sample:
        tries = [Sample(prompt_ids=list(ids), group_id=group_id, index=index) for _ in range(2)]
        tries[1].index = index + 1000  # a different sampling seed for the second try
        done = await asyncio.gather(*(generate_one(ctx, s) for s in tries))
        best = max(done, key=lambda s: len(s.response_ids))
        best.index = index
        return best

    groups = []
    for g, (prompt, ids) in enumerate(prompts):
        gid = ctx.first_group_id + g
        samples = await asyncio.gather(*(slot(gid, i, ids) for i in range(ctx.sampling.n_samples)))
        groups.append(Group(gid, prompt, tuple(samples)))
    return groups
