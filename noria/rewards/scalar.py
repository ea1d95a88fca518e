"""A scalar reward model (``reward.model.kind: scalar``): a sequence-classification model whose one
logit scores the sample (Bradley-Terry), by a forward pass over the chat-templated prompt + response.

What this module owns: ``rm_input_ids`` (what the reward model reads: the prompt's chat, or the
text prompt as one user message, followed by the response as the assistant's message, through the
reward model's own chat template; without one, prompt text + response), ``ScalarReward`` (the
judge's scorer, cache and failure handling, with one classify request per row instead of a verdict)
and its two clients: ``ClassifyClient`` (SGLang's ``POST /classify`` with ``input_ids`` and a
``rid`` the answer must echo in ``meta_info.id``: ``noria serve`` of the folder, or SGLang with
``--is-embedding``) and ``LocalClassifyClient`` (the model in this process, ``reward.model.in_process``).

How a logit becomes the reward (``reward.model.scale``): ``raw`` keeps it, as the peers do: TRL's
GRPOTrainer takes ``logits[:, 0]`` of the chat-templated prompt + completion, verl's reward model
worker and Reward Loop put the raw score at the last token, and OpenRLHF returns the value head at
EOS (optionally normalized by the mean/std stored with the model). GRPO then standardizes rewards
within each group, so the logit's offset and scale do not matter there. ``sigmoid`` maps it into
(0, 1) (the Bradley-Terry probability of beating a response scored 0), for mixing with a 0/1 rule
and for ``reward/agreement``. Standardizing per group is not offered here: it needs the whole
group, which per-sample scoring (``reward.score_each_sample``) does not wait for; the advantage
does it anyway.

Failure: as the judge's (``JudgeFailure`` kinds): timeouts and refused connections are retried
per request, an answer echoing another request id is refused (``mismatch``), an HTTP error or an
answer without one finite logit fails the row (``raised``). vLLM's ``/classify`` (OpenAI-style
``data[].probs``, softmaxed) is not this shape: serve the folder with ``noria serve`` or SGLang.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

from noria.config.reward import RewardModelConfig
from noria.rewards.judge import JudgeClient, JudgeFailure, prompt_text


def rm_input_ids(tokenizer: Any, prompt: Any, response: str) -> list[int]:
    """The reward model's token ids for (prompt, response)."""
    if getattr(tokenizer, "chat_template", None):
        chat = [dict(m) for m in prompt] if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt_text(prompt)}]
        rendered = tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": response}], tokenize=False)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(prompt_text(prompt) + response))


def scaled(cfg: RewardModelConfig, logit: float) -> float:
    """The reward of a logit (``reward.model.scale``)."""
    if cfg.scale == "sigmoid":
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))
    return logit


def one_logit(name: str, values: Any) -> float:
    """The single finite logit of a classify answer; ``JudgeFailure`` (raised) otherwise."""
    if not isinstance(values, list) or len(values) != 1 or not isinstance(values[0], (int, float)) or isinstance(values[0], bool):
        shown = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
        raise JudgeFailure("raised", f"{name}: a scalar reward model answers one logit, got {shown} (num_labels must be 1)")
    if not math.isfinite(values[0]):
        raise JudgeFailure("raised", f"{name}: the reward model's logit is {values[0]}")
    return float(values[0])


class ClassifyClient(JudgeClient):
    """One ``/classify`` request per row, with the judge's timeouts, retries and id check."""

    def __init__(self, cfg: RewardModelConfig, url: str, api_key: str | None, tokenizer: Any) -> None:
        super().__init__(cfg, url, api_key, tokenizer)
        self.name = f"reward model {cfg.name!r} at {self.url}"

    async def _request(self, http: httpx.AsyncClient, ids: Any, rid: str) -> float:
        data = self._json(await http.post("/classify", json={"input_ids": list(ids), "rid": rid}))
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, dict) or "embedding" not in data:
            raise JudgeFailure("raised", f"{self.name}: a /classify answer without embedding")
        self._check_echo((data.get("meta_info") or {}).get("id"), rid, required=True)
        return one_logit(self.name, data["embedding"])


class NoHttp:
    """An async context with no HTTP client: for clients that reach their model without one."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: Any) -> None:
        return None


class LocalClassifyClient(JudgeClient):
    """The reward model in this process (``noria.engine.server.classifier.SequenceClassifier``)."""

    def __init__(self, cfg: RewardModelConfig, classifier: Any, tokenizer: Any) -> None:
        super().__init__(cfg, "in-process", None, tokenizer)
        self.classifier = classifier
        self.name = f"reward model {cfg.name!r} in process"

    def http(self) -> Any:
        return NoHttp()

    async def _request(self, http: Any, ids: Any, rid: str) -> float:
        try:
            (values,) = await self.classifier.classify([list(ids)])
        except Exception as e:  # classify: a forward that fails fails this row, naming the model
            raise JudgeFailure("raised", f"{self.name}: {type(e).__name__}: {e}") from e
        return one_logit(self.name, values)


def scalar_score_fn(cfg: RewardModelConfig, client: JudgeClient) -> Any:
    """The per-row scoring of ``ModelReward`` for a scalar reward model: one classify request."""

    async def judge(http: Any, row: Any, limit: Any, out: Any) -> float:
        try:
            ids = rm_input_ids(client.tokenizer, row.prompt, row.response)
        except Exception as e:  # classify: a chat template that fails fails this sample
            raise JudgeFailure("raised", f"{client.name}: the chat template failed: {type(e).__name__}: {e}") from e
        async with limit:
            logit, seconds = await client.ask(http, ids)
        out.latencies.append(seconds)
        return scaled(cfg, float(logit))

    return judge
