"""``noria bench prefix``: time to first token of a multi-turn workload, with and without the prefix cache.

The workload. ``sessions`` conversations run concurrently, each for ``turns`` turns. Turn 1 is a
user question (the arithmetic task's test prompts) rendered with the tokenizer's chat template.
Turn t+1's prompt is turn t's prompt ids + its generated ids + the ids that close the answer and
add the next user question (rendered with the same template), appended token-in-token-out, so each
request extends the previous one exactly. A session submits its next turn as soon as the previous
one finishes (a closed loop with no think time). Generation is greedy with ``ignore_eos`` for
exactly ``new_tokens`` tokens, so every case sees prompts of the same lengths.

What is measured, per request: TTFT = wall time from ``Engine.submit(..., stream=True)`` to the
streamed callback carrying the first generated token (taken on the engine thread, in the callback).
It includes queueing behind other sessions' steps, the (chunked) prefill and the first sample.
Decode tokens/s = (generated tokens - 1) / (time of the last token - time of the first), averaged
over requests (each request's decode rate while it shares steps with the other sessions).
Hit rate = sum of ``cached_tokens`` / sum of prompt tokens over the case's requests: the same
count the engine's ``metrics()["prefix_hit_rate"]`` keeps (cached tokens at first admission), but
without the warm-up requests in it; ``hit_rate_turn2plus`` counts turns 2 and later only (what a
multi-turn cache can serve: turn 1 shares only the chat template's opening).

Cases, each on fresh engines built in process from the same checkpoint:

- ``engines=1``: ``noria`` has the prefix cache on (defaults: ``engine.block_size`` 16, matches at
  token granularity, copy-on-write of a partly matched block); ``block_match`` matches whole blocks
  only (``RadixCache.token_match = False``: the behaviour before token granularity, so a turn
  recomputes the previous turn's last partial block); ``share_partial`` shares the partly matched
  block in place instead of copying it (``Scheduler.partial_reuse = "share"``); ``block_size_1``
  runs with ``engine.block_size`` 1 (every match is whole blocks and token-granular at once);
  ``no_cache`` runs the same workload with ``EngineConfig(prefix_cache=False)``.
- ``engines=2``: two engines in this process, each with half the torch threads. ``noria`` routes
  with ``LocalRouter.pick`` (a session's key keeps it on the engine its first turn went to);
  ``no_cache`` routes the same way with the cache off; ``load_routing`` ignores the session and
  sends each request to an engine drawn at random (seeded), as sglang-router's ``random`` policy
  does. Random rather than round robin or fewest-in-flight: in this closed loop the sessions move
  in lockstep, and those two policies then send a session back to the engine it just left by
  accident, which hides the miss that session-blind routing causes under real traffic.

What is not measured: decode throughput (see ``noria bench engine``), HTTP or router overhead
(everything is in process), eviction under memory pressure (the KV cache is sized to hold every
session), and think time between turns. Two engines in one process share the GIL and the
machine's cores, so ``engines=2`` figures compare only among themselves, not with ``engines=1``.
"""

from __future__ import annotations

import contextlib
import queue
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from noria.bench import print_table, write_json
from noria.errors import NoriaError

PEERS = ("block_match", "share_partial", "block_size_1", "no_cache", "load_routing")
_PLACEHOLDER = "NORIA_BENCH_ANSWER"


@dataclass
class Conversation:
    """One session's token ids: the first prompt, then what each later turn appends."""

    key: str
    first: list[int]
    closing: list[int]
    """Ids that end an assistant message (e.g. ``<|im_end|>\\n``)."""
    follow_ups: list[list[int]]
    """Per later turn: the ids of the new user message plus the opening of the next answer."""

    @property
    def turns(self) -> int:
        return 1 + len(self.follow_ups)


@dataclass
class Case:
    """One run of the workload: how many engines, how requests are routed, cache on or off."""

    column: str
    engines: int
    routing: str
    """``single``, ``sticky`` or ``random``."""
    prefix_cache: bool
    block_size: int = 16
    token_match: bool = True
    """False: whole-block matches only (the cache before token granularity)."""
    partial_reuse: str = "copy"
    """``copy`` or ``share`` (``Scheduler.partial_reuse``)."""


@dataclass
class Figures:
    """What one case measured."""

    ttft_ms: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    later_prompt_tokens: int = 0
    """Prompt tokens of turns 2 and later."""
    later_cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_turn2plus(self) -> float:
        return self.later_cached_tokens / self.later_prompt_tokens if self.later_prompt_tokens else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.ttft_ms, q))


CASES = {
    1: [
        Case("noria", 1, "single", True),
        Case("block_match", 1, "single", True, token_match=False),
        Case("share_partial", 1, "single", True, partial_reuse="share"),
        Case("block_size_1", 1, "single", True, block_size=1),
        Case("no_cache", 1, "single", False),
    ],
    2: [
        Case("noria", 2, "sticky", True),
        Case("no_cache", 2, "sticky", False),
        Case("load_routing", 2, "random", True),
    ],
}


def add_arguments(parser) -> None:
    """``noria bench prefix``'s arguments."""
    parser.description = ("Concurrent sessions, each turn's prompt extending the previous turn's prompt and answer; TTFT "
                          "and prefix-cache hit rate on one engine (cache on vs off) and on two engines in process "
                          "(session-sticky routing vs random routing).")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=6, help="turns per session")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per turn")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="model dtype (auto: see noria info)")
    parser.add_argument("--engines", default="1,2", help="comma-separated engine counts to run (1: the cache's cases, 2: routing)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    counts = tuple(int(x) for x in args.engines.split(",") if x.strip())
    if not counts or any(n not in CASES for n in counts):
        raise NoriaError(f"--engines must list counts among {sorted(CASES)}, got {args.engines!r}")
    run(args.model, args.sessions, args.turns, args.new_tokens, args.json, args.dtype, engine_counts=counts)
    return 0


def run(
    model: str,
    sessions: int,
    turns: int,
    new_tokens: int,
    json_path: str | None,
    dtype: str = "auto",
    engine_counts: tuple[int, ...] = (1, 2),
) -> list[dict]:
    """Measure every case, print one table, write ``json_path`` if given; returns the result rows."""
    from noria.hardware import resolve_dtype
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path

    if sessions < 1 or turns < 1 or new_tokens < 1:
        raise NoriaError("sessions, turns and new_tokens must all be >= 1")
    dtype = resolve_dtype(dtype, "cpu")
    folder = model_path(model)
    conversations = build_conversations(load_tokenizer(folder), sessions, turns)
    figures: dict[int, dict[str, Figures]] = {}
    for count in engine_counts:
        with _torch_threads(max(1, torch.get_num_threads() // count)):
            figures[count] = {c.column: measure(folder, conversations, c, new_tokens, dtype) for c in CASES[count]}
    results = _results(model, dtype, sessions, turns, new_tokens, figures)
    _print(results)
    if json_path:
        write_json(json_path, "prefix", results)
    return results


# ------------------------------------------------------------------------------ workload


def build_conversations(tokenizer: Any, sessions: int, turns: int) -> list[Conversation]:
    """The token ids of every session, rendered with the tokenizer's chat template."""
    from noria.data import generate_split, render_prompts

    if not getattr(tokenizer, "chat_template", None):
        raise NoriaError("the prefix benchmark renders multi-turn chats and needs a tokenizer with a chat template")
    records = generate_split("arithmetic", "test", {"n_test": sessions * turns, "seed": 0})
    firsts = render_prompts(records[:sessions], tokenizer)
    closing = _encode(tokenizer, _closing_text(tokenizer))
    out = []
    for s in range(sessions):
        questions = [r.prompt for r in records[sessions + s * (turns - 1) : sessions + (s + 1) * (turns - 1)]]
        follow_ups = [_encode(tokenizer, _follow_up_text(tokenizer, q)) for q in questions]
        out.append(Conversation(f"session-{s}", firsts[s].ids, closing, follow_ups))
    return out


def _closing_text(tokenizer: Any) -> str:
    """What the template writes after an assistant message's content."""
    text = _render(tokenizer, [_user("?"), _assistant()], generation_prompt=False)
    return text[text.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]


def _follow_up_text(tokenizer: Any, question: str) -> str:
    """What the template adds for a new user message after an answer, up to the next answer."""
    before = _render(tokenizer, [_user("?"), _assistant()], generation_prompt=False)
    after = _render(tokenizer, [_user("?"), _assistant(), _user(question)], generation_prompt=True)
    if not after.startswith(before):
        raise NoriaError("the chat template re-renders earlier turns differently, so turns cannot be appended as ids")
    return after[len(before) :]


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant() -> dict[str, str]:
    return {"role": "assistant", "content": _PLACEHOLDER}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def next_prompt(conversation: Conversation, prompt: list[int], output: list[int], turn: int) -> list[int]:
    """Turn ``turn``'s prompt: the previous prompt and answer, closed, plus the next user message."""
    closing = conversation.closing
    if output and closing and output[-1] == closing[0]:
        closing = closing[1:]  # the answer already ended with the template's end-of-message token
    return prompt + output + closing + conversation.follow_ups[turn - 1]


def longest_prompt(conversation: Conversation, new_tokens: int) -> int:
    """Prompt tokens of the last turn when every answer has ``new_tokens`` tokens."""
    return len(conversation.first) + sum(new_tokens + len(conversation.closing) + len(f) for f in conversation.follow_ups)


# ------------------------------------------------------------------------------ one case


def measure(folder: Path, conversations: list[Conversation], case: Case, new_tokens: int, dtype: str) -> Figures:
    """Run the workload once on fresh engines configured for ``case``."""
    longest = max(longest_prompt(c, new_tokens) for c in conversations) + new_tokens
    engines = [_engine(folder, case, len(conversations), longest, dtype) for _ in range(case.engines)]
    for engine in engines:
        engine.radix.token_match = case.token_match  # set before any request reaches the engine thread
        engine.scheduler.partial_reuse = case.partial_reuse
    try:
        for engine in engines:
            if longest > engine.max_context:
                raise NoriaError(
                    f"the last turn needs {longest} tokens but the model takes {engine.max_context}; "
                    "lower --turns or --new-tokens"
                )
            _warm_up(engine, conversations, new_tokens)
        return _drive(engines, conversations, _router(case, engines), new_tokens)
    finally:
        for engine in engines:
            engine.shutdown(drain_timeout_s=1.0)


def _engine(folder: Path, case: Case, sessions: int, longest: int, dtype: str):
    from noria.config import EngineConfig
    from noria.engine import Engine

    # Room for every session's whole conversation twice over: nothing is evicted in any case.
    config = EngineConfig(
        max_running_requests=sessions,
        kv_cache_tokens=2 * sessions * (longest + 32) + 1024,
        prefix_cache=case.prefix_cache,
        block_size=case.block_size,
    )
    return Engine.from_path(folder, config, dtype=dtype)


def _warm_up(engine: Any, conversations: list[Conversation], new_tokens: int) -> None:
    """One batch of first turns (kernels built, memory touched), then an empty prefix cache."""
    engine.generate_batch([_request(c.first, min(new_tokens, 4)) for c in conversations])
    engine.flush_cache()


def _request(ids: list[int], new_tokens: int, key: str | None = None):
    from noria.engine.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(input_ids=list(ids), sampling=params, return_logprob=False, routing_key=key)


class _Router:
    """Picks an engine per request; ``done`` is told when a request finishes."""

    def __init__(self, pick: Callable[[str], int], done: Callable[[int], None] = lambda i: None) -> None:
        self.pick = pick
        self.done = done


def _router(case: Case, engines: list[Any]) -> _Router:
    if case.routing == "single":
        return _Router(lambda key: 0)
    if case.routing == "random":
        rng = random.Random(0)
        return _Router(lambda key: rng.randrange(len(engines)))
    from noria.router.local import LocalRouter

    local = LocalRouter(engines)

    def pick(key: str) -> int:
        index = local.pick(key, session=True)
        local.inflight[index] += 1
        return index

    def done(index: int) -> None:
        local.inflight[index] -= 1

    return _Router(pick, done)


def _drive(engines: list[Any], conversations: list[Conversation], router: _Router, new_tokens: int) -> Figures:
    """Run every session's turns (each turn submitted when the previous one finished)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    figures = Figures()
    prompts = [c.first for c in conversations]

    def submit(s: int, turn: int) -> None:
        index = router.pick(conversations[s].key)
        first_token: list[float] = []
        start = time.perf_counter()

        def callback(out) -> None:  # engine thread: record the time, hand the rest to the driver
            now = time.perf_counter()
            if out.output_ids and not first_token:
                first_token.append(now)
            if out.finished:
                first = (first_token or [start])[0]
                rate = (len(out.output_ids) - 1) / (now - first) if len(out.output_ids) > 1 and now > first else None
                events.put((s, turn, index, out, first - start, rate))

        engines[index].submit(_request(prompts[s], new_tokens, conversations[s].key), callback, stream=True)

    for s in range(len(conversations)):
        submit(s, 0)
    pending = len(conversations)
    while pending:
        s, turn, index, out, ttft, rate = events.get(timeout=600)
        router.done(index)
        _record(figures, out, ttft, rate, turn)
        if turn + 1 < conversations[s].turns:
            prompts[s] = next_prompt(conversations[s], prompts[s], out.output_ids, turn + 1)
            submit(s, turn + 1)
        else:
            pending -= 1
    return figures


def _record(figures: Figures, out: Any, ttft_s: float, decode_rate: float | None, turn: int) -> None:
    if out.finish_reason.get("type") == "abort" or not out.output_ids:
        raise RuntimeError(f"request {out.rid} ended without output: {out.finish_reason}")
    figures.ttft_ms.append(ttft_s * 1000.0)
    if decode_rate is not None:
        figures.decode_tokens_per_s.append(decode_rate)
    figures.prompt_tokens += out.prompt_tokens
    figures.cached_tokens += out.cached_tokens
    if turn > 0:
        figures.later_prompt_tokens += out.prompt_tokens
        figures.later_cached_tokens += out.cached_tokens


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``n`` inside the block (engines built inside keep it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------ report


def _results(
    model: str, dtype: str, sessions: int, turns: int, new_tokens: int, figures: dict[int, dict[str, Figures]]
) -> list[dict]:
    rows = []
    for count, columns in figures.items():
        case = f"{model} {_short(dtype)} sessions={sessions} turns={turns} new={new_tokens} engines={count}"
        metrics: list[tuple[str, Callable[[Figures], float], int]] = [
            ("ttft_ms", lambda f: float(np.mean(f.ttft_ms)), 1),
            ("ttft_p50_ms", lambda f: f.percentile(50), 1),
            ("ttft_p90_ms", lambda f: f.percentile(90), 1),
            ("hit_rate", lambda f: f.hit_rate, 4),
            ("hit_rate_turn2plus", lambda f: f.hit_rate_turn2plus, 4),
            ("decode_tokens_per_s", lambda f: float(np.mean(f.decode_tokens_per_s)) if f.decode_tokens_per_s else 0.0, 1),
        ]
        for metric, value, digits in metrics:
            rows.append({
                "case": case,
                "metric": metric,
                "noria": round(value(columns["noria"]), digits),
                "peers": {p: round(value(columns[p]), digits) for p in PEERS if p in columns},
                "bound": None,
            })
    return rows


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def _print(results: list[dict]) -> None:
    header = ["case", "metric", "noria", *PEERS, *[f"{p}/noria" for p in PEERS]]
    rows = []
    for r in results:
        peers = [r["peers"].get(p) for p in PEERS]
        timed = r["metric"].endswith("_ms") and r["noria"]
        ratios = [v / r["noria"] if timed and v is not None else None for v in peers]
        rows.append([r["case"], r["metric"], r["noria"], *peers, *ratios])
    print_table("time to first token (ms, lower is better), prefix-cache hit rate and decode tokens/s (higher is better)",
                header, rows)
    print("peer/noria: how many times longer the peer's TTFT is. engines=2 rows: two engines share this "
          "process (GIL, half the torch threads each); compare them with each other, not with engines=1.")
