"""Teachers served by engines: scoring the student's samples by prefill during rollout, and the
start-up check that teacher and student share one tokenizer.

What it owns: ``EngineTeacher`` (one engine client per teacher; several selected by a prompt
metadata key, ``opd.teachers`` / ``opd.teacher_key``), ``with_teacher`` (wraps the rollout's
generate or group function so each finished sample is scored before it is rewarded and reaches the
buffer) and ``check_tokenizers``.

How a sample is scored: one ``/generate`` request with ``input_ids = prompt + response``,
``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len = len(prompt)`` and, for
``opd.top_k``, ``top_logprobs_num`` (SGLang's prefill scoring; the built-in engine implements it in
``noria.engine.scoring``); the answer's ``input_token_logprobs`` are the teacher's logprob of every
response token at the rollout temperature, stored as ``Sample.teacher_logprobs`` (0.0 where the
loss mask is 0). Scoring overlaps generation and training like the rest of the rollout; the
seconds it took go into ``sample.metadata["teacher_s"]``.

What blocks on what: a sample's scoring waits for its teacher engine's answer; generation of other
samples goes on meanwhile. Failure: a teacher engine that is down or answers without the scores
raises ``EngineFailure`` (the run stops, naming it); a sample whose metadata selects no configured
teacher raises ``NoriaError`` (never scored by another teacher).

Not guaranteed: cross-tokenizer distillation (refused at start: the scores would be of other
tokens); a teacher that changes its weights during the run (teachers are not synced).
"""

from __future__ import annotations

import time
import urllib.request
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from noria.engine.protocol import GenerateRequest, SamplingParams
from noria.errors import NoriaError
from noria.types import Sample, Status


class EngineTeacher:
    """Teacher engines by selector value (``None``: the one teacher of every sample)."""

    def __init__(self, clients: Mapping[str | None, Any], key: str = "teacher", temperature: float = 1.0, top_k: int = 0) -> None:
        self.clients = dict(clients)
        self.key = key
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: logprobs at T = 1
        self.top_k = top_k

    def client_for(self, sample: Sample) -> Any:
        if None in self.clients:
            return self.clients[None]
        value = sample.metadata.get(self.key)
        if value is None or str(value) not in self.clients:
            raise NoriaError(
                f"sample {sample.group_id}/{sample.index}: metadata[{self.key!r}] = {value!r} names no teacher of "
                f"opd.teachers ({sorted(str(k) for k in self.clients)})"
            )
        return self.clients[str(value)]

    async def score(self, sample: Sample) -> None:
        """Set ``sample.teacher_logprobs`` (and ``teacher_top_logprobs`` with top-k) from its teacher."""
        if not sample.response_ids:
            sample.teacher_logprobs = []
            sample.teacher_top_logprobs = [] if self.top_k else None
            return
        start = time.perf_counter()
        req = GenerateRequest(
            input_ids=list(sample.prompt_ids) + list(sample.response_ids),
            sampling=SamplingParams(max_new_tokens=0, temperature=self.temperature),
            return_logprob=True, logprob_start_len=len(sample.prompt_ids), top_logprobs_num=self.top_k,
        )  # fmt: skip
        out = await self.client_for(sample).generate(req)
        mask = sample.loss_mask
        sample.teacher_logprobs = [float(lp) if m else 0.0 for lp, m in zip(out.input_logprobs, mask)]
        if self.top_k:
            sample.teacher_top_logprobs = [list(top or []) if m else [] for top, m in zip(out.input_top_logprobs, mask)]
        sample.metadata["teacher_s"] = time.perf_counter() - start

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


def with_teacher(plugin: dict[str, Any], teacher: EngineTeacher) -> dict[str, Any]:
    """The rollout plug-in (``{"generate": fn}`` or ``{"rollout_group": fn}``, as the scheduler takes
    it) with every finished sample scored by ``teacher`` before the reward sees it."""
    if "generate" in plugin:
        generate = plugin["generate"]

        async def generate_and_score(ctx: Any, sample: Sample) -> Sample:
            await generate(ctx, sample)
            if sample.status in (Status.COMPLETED, Status.TRUNCATED):
                await teacher.score(sample)
            return sample

        return {**plugin, "generate": generate_and_score}
    rollout_group = plugin["rollout_group"]

    async def rollout_and_score(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        result = await rollout_group(ctx, *args, **kwargs)
        for group in result.groups:
            for sample in group.samples:
                if sample.status in (Status.COMPLETED, Status.TRUNCATED):
                    await teacher.score(sample)
        return result

    return {**plugin, "rollout_group": rollout_and_score}


def check_tokenizers(student: Any, teacher: Any, teacher_name: str, student_name: str) -> None:
    """NoriaError naming both models when the teacher's tokenizer is not the student's (same
    vocabulary, same ids, same EOS): the teacher's logprobs would be of other tokens."""
    diff = _tokenizer_difference(student, teacher)
    if diff:
        raise NoriaError(
            f"on-policy distillation needs one tokenizer: the teacher {teacher_name} and the student {student_name} differ "
            f"({diff}); cross-tokenizer distillation is not supported"
        )


def _tokenizer_difference(a: Any, b: Any) -> str:
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        return f"vocabulary of {len(vb)} tokens vs {len(va)}"
    changed = [t for t, i in va.items() if vb.get(t) != i]
    if changed:
        return f"{len(changed)} tokens have other ids, e.g. {changed[0]!r}"
    if a.eos_token_id != b.eos_token_id:
        return f"EOS id {b.eos_token_id} vs {a.eos_token_id}"
    return ""


def teacher_tokenizer(url: str, api_key: str | None = None) -> tuple[Any, str]:
    """The tokenizer a teacher server reports (``/model_info``'s ``tokenizer_path``), and that path."""
    from noria.models import load_tokenizer

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url.rstrip('/')}/model_info", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            info = json.loads(r.read())
    except OSError as e:
        raise NoriaError(f"teacher at {url}: /model_info failed ({e}); cannot check its tokenizer") from e
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise NoriaError(f"teacher at {url}: /model_info names no tokenizer_path; cannot check its tokenizer")
    try:
        return load_tokenizer(Path(path) if Path(path).exists() else path), str(path)
    except Exception as e:  # classify: any loading failure means the check cannot be made
        raise NoriaError(f"teacher at {url}: its tokenizer {path!r} cannot be loaded here ({e}); cannot check it") from e
