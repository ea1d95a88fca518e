"""A generative judge on the policy's own engines (``reward.model.engine: shared``).

What this module owns: ``SharedJudgeClient``, the judge's request sent through the run's rollout
engine client (in process, ``noria serve``, a fleet's router or SGLang) as a ``GenerateRequest``
with ``priority = reward.model.priority`` (-1 by default; rollout's are 0). The engine's scheduler
admits every waiting request of a higher priority first (``noria.engine.scheduler``; SGLang's
``priority`` field, honoured by SGLang with ``--enable-priority-scheduling``), so judging fills the
batch only where rollout leaves room, and a judge request is retracted before a rollout one when
the KV cache runs short. The prompt is rendered by the policy's chat template.

The caveat: the judge IS the policy at its current weights. Its verdicts change as the policy
trains (a self-rewarding setup), they are not a frozen reference; the scorer's cache
(``reward.model.cache``) may give a verdict of earlier weights for a repeated (prompt, response).
Running requests are never preempted by priority: a judge request admitted while rollout waited for
nothing keeps its slot until it finishes.

Failure: as the judge's (``JudgeFailure`` kinds): the rollout engine failing or timing out
(``EngineFailure``) is ``unreachable``; a request aborted by the engine (a weight update that aborts
requests) fails the sample (``raised``); the answer's request id must be the one sent (``mismatch``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from noria.config.reward import RewardModelConfig
from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.errors import EngineFailure
from noria.rewards.judge import JudgeClient, JudgeFailure
from noria.rewards.scalar import NoHttp


class SharedJudgeClient(JudgeClient):
    """The judge's requests on the run's rollout engines, below rollout's priority."""

    def __init__(self, cfg: RewardModelConfig, engine: Any, tokenizer: Any) -> None:
        super().__init__(cfg, getattr(engine, "name", "the rollout engines"), None, tokenizer)
        self.engine = engine
        self.name = f"judge {cfg.name!r} on the rollout engines ({self.url})"

    def http(self) -> Any:
        return NoHttp()

    async def _request(self, http: Any, messages: Sequence[dict[str, str]], rid: str) -> str:
        cfg, tok = self.cfg, self.tokenizer
        text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        ids = list(tok.encode(text, add_special_tokens=False))
        sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        req = GenerateRequest(input_ids=ids, sampling=sampling, rid=rid or f"judge-{uuid.uuid4().hex}", priority=cfg.priority)
        try:
            out = await self.engine.generate(req)
        except EngineFailure as e:
            raise JudgeFailure("unreachable", f"{self.name}: {e}") from e
        self._check_echo(out.rid, req.rid, required=True)
        if (out.finish_reason or {}).get("type") == "abort":
            raise JudgeFailure("raised", f"{self.name}: the request was aborted ({(out.finish_reason or {}).get('message', '')})")
        return tok.decode(out.output_ids, skip_special_tokens=True)
