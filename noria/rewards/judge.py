"""A generative judge's request and verdict: the prompt from a Jinja template, one HTTP request to
the judge server, and the verdict parsed into a score in [0, 1].

What this module owns: ``render_messages`` (the template, sandboxed, given the sample's prompt,
response, label, metadata and a rubric criterion), ``JudgeClient`` (one request: SGLang's native
``/generate`` with a request id the answer must echo, or OpenAI's ``/v1/chat/completions`` with an
``X-Request-Id`` header; per-request timeout and retries) and ``parse_verdict`` / ``parse_verdicts``
(a number, a label or a ``\\boxed{}`` score, mapped to [0, 1]; or, with ``parser: answer``, the
final answer the judge read off the response, scored 1 when it equals the sample's label: a judge
too small to grade, such as SmolLM2-135M, can still extract an answer reliably).

Failure (``JudgeFailure``, its ``kind`` one of the runner's failure kinds): a request that times out
or cannot connect is tried ``retries`` more times, then fails the sample (``timeout`` or
``unreachable``); an answer whose echoed request id is another request's is refused
(``mismatch``): it is never scored; an HTTP error fails the sample (``raised``); a verdict with no
score in it fails the sample (``unparseable``). The message names the judge and its URL.

Not guaranteed: ``api: openai`` servers that do not echo ``X-Request-Id`` (Noria's and SGLang's OpenAI
routes do not) cannot be checked for a mismatch; a judge that answers with a score for the wrong
sample in the right request is not detected.
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from noria.config.reward import DEFAULT_JUDGE_TEMPLATE, RewardModelConfig
from noria.rewards.countdown import last_boxed

JUDGE_FAILURE_KINDS: tuple[str, ...] = ("unparseable", "unreachable", "mismatch", "timeout", "raised")
"""Every kind of a judge's failure (``reward/failed/<kind>``): a verdict with no score, a server that
cannot be reached, an answer to another request, no answer in time, an HTTP or template error."""
DEFAULT_NUMBER_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"
_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeFailure(Exception):
    """A judge request gave no usable verdict; ``kind`` classifies it (``reward/failed/<kind>``)."""

    def __init__(self, kind: str, reason: str) -> None:
        if kind not in JUDGE_FAILURE_KINDS:
            raise ValueError(f"judge failure kind {kind!r} is not one of {JUDGE_FAILURE_KINDS}")
        super().__init__(reason)
        self.kind = kind


# ---------------------------------------------------------------------------------------- prompt


@functools.lru_cache(maxsize=16)
def _template(source: str) -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(source)


def prompt_text(prompt: Any) -> str:
    """The task's prompt as text: a string as is; a chat's last user message."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return "" if prompt is None else str(prompt)


def render_messages(
    cfg: RewardModelConfig, prompt: Any, response: str, label: Any, metadata: dict[str, Any], criterion: str = ""
) -> list[dict[str, str]]:
    """The judge's chat messages for one sample (and one rubric criterion, or every one listed)."""
    try:
        text = _template(cfg.template or DEFAULT_JUDGE_TEMPLATE).render(
            prompt=prompt_text(prompt), messages=prompt if isinstance(prompt, (list, tuple)) else [],
            response=response, label=label, metadata=metadata, criterion=criterion,
        )  # fmt: skip
    except Exception as e:  # classify: a template error fails this sample, naming the template
        raise JudgeFailure("raised", f"judge {cfg.name!r}: reward.model.template failed: {type(e).__name__}: {e}") from e
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": text}]


# --------------------------------------------------------------------------------------- verdict


def parse_verdict(cfg: RewardModelConfig, text: str, label: Any = None) -> float:
    """The judge's reply as a score in [0, 1]; ``JudgeFailure("unparseable")`` when it holds none.
    ``label``: the sample's reference answer (``parser: answer`` compares with it)."""
    return parse_verdicts(cfg, text, 1, label)[0]


def parse_verdicts(cfg: RewardModelConfig, text: str, n: int, label: Any = None) -> list[float]:
    """The first ``n`` verdicts of a reply, in order (rubric_mode all: one per criterion)."""
    if cfg.parser == "label":
        found = _labels(cfg, text)
    elif cfg.parser == "boxed":
        found = _boxed_numbers(text)
    elif cfg.parser == "answer":
        found = _answers(cfg, text)
    else:
        found = _numbers(cfg, text)
    if len(found) < n:
        shown = text.strip().replace("\n", " ")[:120]
        raise JudgeFailure("unparseable", f"judge {cfg.name!r}: {len(found)} of {n} verdicts ({cfg.parser}) in its reply {shown!r}")
    if cfg.parser == "label":
        return [float(cfg.labels[_label_key(cfg, v)]) for v in found[:n]]
    if cfg.parser == "answer":
        reference = _reference(cfg, label)
        return [1.0 if v == reference else 0.0 for v in found[:n]]
    return [_scale(cfg, v) for v in found[:n]]


def _captured(pattern: str, text: str) -> list[str]:
    """Every match's first group (the whole match where the pattern has one group)."""
    return [m if isinstance(m, str) else m[0] for m in re.findall(pattern, text)]


def _numbers(cfg: RewardModelConfig, text: str) -> list[float]:
    if cfg.pattern or re.search(DEFAULT_NUMBER_PATTERN, text):
        return [float(v) for v in _captured(cfg.pattern or DEFAULT_NUMBER_PATTERN, text) if _is_number(v)]
    numbers = _LAST_NUMBER.findall(text)
    return [float(numbers[-1])] if numbers else []


def _answers(cfg: RewardModelConfig, text: str) -> list[float]:
    if cfg.pattern:
        values = [v.replace(",", "") for v in _captured(cfg.pattern, text)]
        return [float(v) for v in values if _is_number(v)]
    return _boxed_numbers(text) or [float(v) for v in _LAST_NUMBER.findall(text.replace(",", ""))[-1:]]


def _reference(cfg: RewardModelConfig, label: Any) -> float:
    """The sample's label as a number (``parser: answer``); a label that is none fails the sample."""
    text = str(label).strip().replace(",", "") if label is not None else ""
    if not _is_number(text):
        raise JudgeFailure("raised", f"judge {cfg.name!r}: parser answer compares with the sample's label, a number; got {label!r}")
    return float(text)


def _boxed_numbers(text: str) -> list[float]:
    inner = last_boxed(text)
    return [float(inner.strip())] if inner is not None and _is_number(inner.strip()) else []


def _labels(cfg: RewardModelConfig, text: str) -> list[str]:
    if cfg.pattern:
        return [v for v in _captured(cfg.pattern, text) if _label_key(cfg, v)]
    keys = sorted(cfg.labels, key=len, reverse=True)  # "incorrect" before "correct"
    regex = re.compile(r"\b(" + "|".join(re.escape(k) for k in keys) + r")\b", re.IGNORECASE)
    return regex.findall(text)


def _label_key(cfg: RewardModelConfig, value: str) -> str | None:
    folded = value.strip().casefold()
    return next((k for k in cfg.labels if k.casefold() == folded), None)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _scale(cfg: RewardModelConfig, value: float) -> float:
    low, high = cfg.score_range
    if not low <= value <= high:
        raise JudgeFailure("unparseable", f"judge {cfg.name!r}: score {value:g} is outside reward.model.score_range {cfg.score_range}")
    return (value - low) / (high - low)


# --------------------------------------------------------------------------------------- request


class JudgeClient:
    """Requests to one judge server; ``name`` is what errors call it (the judge's name and URL)."""

    def __init__(self, cfg: RewardModelConfig, url: str, api_key: str | None = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.url = url.rstrip("/")
        self.name = f"judge {cfg.name!r} at {self.url}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        """api sglang: the tokenizer whose chat template renders the messages."""
        self.requests = 0
        """Requests answered so far."""

    def http(self) -> httpx.AsyncClient:
        """An HTTP client for one scoring call (clients are bound to the event loop that uses them)."""
        limits = httpx.Limits(max_connections=self.cfg.max_concurrency, max_keepalive_connections=self.cfg.max_concurrency)
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=self.cfg.timeout_s, limits=limits)

    async def ask(self, http: httpx.AsyncClient, messages: Sequence[dict[str, str]]) -> tuple[str, float]:
        """The judge's reply to ``messages`` and the seconds its answered try took: tried ``1 + retries``
        times on a timeout or a refused connection; ``JudgeFailure`` when no try gave an answer that
        belongs to this request."""
        failure: JudgeFailure | None = None
        for _ in range(1 + self.cfg.retries):
            rid = f"judge-{uuid.uuid4().hex}"
            loop = asyncio.get_running_loop()
            start = loop.time()
            try:
                text = await asyncio.wait_for(self._request(http, messages, rid), self.cfg.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                failure = JudgeFailure("timeout", f"{self.name}: no answer within reward.model.timeout_s={self.cfg.timeout_s:g} s")
                continue
            except httpx.TransportError as e:
                failure = JudgeFailure("unreachable", f"{self.name} is unreachable: {type(e).__name__}: {e}")
                continue
            self.requests += 1
            return text, loop.time() - start
        assert failure is not None
        raise JudgeFailure(failure.kind, f"{failure} (after {1 + self.cfg.retries} tries)")

    async def _request(self, http: httpx.AsyncClient, messages: Sequence[dict[str, str]], rid: str) -> str:
        cfg = self.cfg
        if cfg.api == "openai":
            body: dict[str, Any] = {"messages": list(messages), "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
            if cfg.served_model:
                body["model"] = cfg.served_model
            response = await http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": rid})
            data = self._json(response)
            echoed = response.headers.get("x-request-id")
            self._check_echo(echoed, rid)
            try:
                return str(data["choices"][0]["message"]["content"] or "")
            except (KeyError, IndexError, TypeError) as e:
                raise JudgeFailure("raised", f"{self.name}: a chat answer without choices[0].message.content") from e
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        body = {"text": text, "rid": rid, "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}}
        data = self._json(await http.post("/generate", json=body))
        if not isinstance(data, dict) or "text" not in data:
            raise JudgeFailure("raised", f"{self.name}: a /generate answer without text")
        self._check_echo((data.get("meta_info") or {}).get("id"), rid, required=True)
        return str(data["text"])

    def _json(self, response: httpx.Response) -> Any:
        if response.status_code != 200:
            raise JudgeFailure("raised", f"{self.name}: HTTP {response.status_code}: {response.text[:200]}")
        try:
            return response.json()
        except ValueError as e:
            raise JudgeFailure("raised", f"{self.name}: an answer that is not JSON: {response.text[:120]!r}") from e

    def _check_echo(self, echoed: Any, rid: str, required: bool = False) -> None:
        if echoed is None and not required:
            return
        if echoed != rid:
            raise JudgeFailure(
                "mismatch", f"{self.name} answered request {echoed!r} to request {rid!r}: refused (an answer for another sample)"
            )
