"""The OpenAI API of the engine server: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Over the same engine as the native API: chat messages are rendered with the tokenizer's chat
template (its own special tokens, no BOS added on top; a vision-language model's ``image_url`` parts,
data URLs only, become image placeholders in their message's text), ``n`` choices are ``n`` requests (seed + i
for choice i when a seed is given), and streaming merges the choices' partial outputs into one
stream of server-sent chunks. Every response carries the weight version and the engine id; choices
carry their ``token_ids`` and per-token ``weight_versions`` (an extension the session server reads).

Not guaranteed: function calling, ``response_format``, ``echo`` and penalties are refused with a
400, not emulated.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from noria.engine.protocol import GenerateOutput, GenerateRequest, RequestError, SamplingParams
from noria.engine.server.lora_api import adapter_of_model
from noria.engine.server.native_api import NativeApi
from noria.engine.vision import IMAGE_PLACEHOLDER
from noria.engine.server.parsing import (
    INERT_OPENAI,
    check_ids,
    drop_inert,
    encode_text,
    engine_attr,
    is_int,
    read_json,
    reject_unknown,
    sampling_from,
    sse,
    sse_error,
    sse_response,
    token_texts,
    want,
)

if TYPE_CHECKING:
    from noria.engine.server.app import EngineServer


class OpenAIApi:
    """``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` over the same engine."""

    COMMON = {
        "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
        "stop_token_ids", "ignore_eos", "seed", "n", "stream", "logprobs", "routing_key",
    }  # fmt: skip
    COMPLETION = COMMON | {"prompt"}
    CHAT = COMMON | {"messages", "top_logprobs", "add_generation_prompt"}

    def __init__(self, server: EngineServer) -> None:
        self.s = server
        self.native = NativeApi(server)

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.native.model_name, "object": "model", "created": int(self.s.started_at),
            "owned_by": "noria", "root": self.s.model_path, "max_model_len": engine_attr(self.s.engine, "max_context"),
            "weight_version": self.s.engine.weight_version,
        }  # fmt: skip
        names = getattr(getattr(self.s.engine, "lora", None), "names", None) or {}
        adapters = [{**card, "id": name, "parent": card["id"], "adapter_version": v} for name, v in sorted(names.items())]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    # ------------------------------------------------------------------------------ parsing

    def sampling(self, body: dict[str, Any]) -> SamplingParams:
        """OpenAI sampling fields -> ``SamplingParams`` (OpenAI's defaults: 16 tokens for completions)."""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        data = {
            "max_new_tokens": 16 if max_tokens is None and "messages" not in body else max_tokens,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "min_p": body.get("min_p"), "stop": body.get("stop"), "stop_token_ids": body.get("stop_token_ids"),
            "ignore_eos": body.get("ignore_eos"), "seed": body.get("seed"),
        }  # fmt: skip
        data = {k: v for k, v in data.items() if v is not None}
        if "max_new_tokens" in data and is_int(data["max_new_tokens"]) and data["max_new_tokens"] < 1:
            raise RequestError(f"max_tokens must be >= 1, got {data['max_new_tokens']}")
        try:
            return sampling_from(data)
        except RequestError as e:  # name the OpenAI field, not ours
            raise RequestError(str(e).replace("sampling_params.max_new_tokens", "max_tokens").replace("sampling_params.", "")) from e

    def requests(
        self, body: dict[str, Any], prompts: list[list[int]], top_k: int, logprobs: bool, images: list | None = None
    ) -> list[GenerateRequest]:
        """n requests per prompt (seed + i for choice i when a seed is given), in choice order."""
        n = want(body, "n", int, 1)
        if n < 1 or n > 128:
            raise RequestError(f"n must be in [1, 128], got {n}")
        base = self.sampling(body)
        key = want(body, "routing_key", str) or None
        adapter = adapter_of_model(self.s.engine, body.get("model"))  # vLLM's: the model names a LoRA adapter
        reqs = []
        for p, ids in enumerate(prompts):
            self.native.check_context(ids, base, "prompt" if len(prompts) == 1 else f"prompt[{p}]")
            for i in range(n):
                sampling = SamplingParams(**{**base.__dict__, "stop": list(base.stop), "stop_token_ids": list(base.stop_token_ids)})
                if base.seed is not None:
                    sampling.seed = base.seed + i
                reqs.append(GenerateRequest(
                    ids, sampling, rid="", return_logprob=logprobs, top_logprobs_num=top_k, routing_key=key, images=list(images or []),
                    adapter=adapter,
                ))  # fmt: skip
        return reqs

    def completion_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [self.native.tokenize(prompt, "prompt")]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.native.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [check_ids(p, f"prompt[{i}]", self.native.vocab_size) for i, p in enumerate(prompt)]
        if isinstance(prompt, list) and prompt and all(is_int(p) for p in prompt):
            return [check_ids(prompt, "prompt", self.native.vocab_size)]
        if prompt in (None, "", []):
            raise RequestError("prompt is required and must not be empty")
        raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of those")

    def chat_prompt(self, body: dict[str, Any]) -> tuple[list[int], list]:
        """The rendered messages' ids, and their images (``image_url`` parts, data URLs only: each
        becomes the model's image placeholder in its message's text, expanded by its processor)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content}")
        urls: list[str] = []
        plain = [_chat_message(m, i, urls) for i, m in enumerate(messages)]
        tok = self.s.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("messages: this model's tokenizer has no chat template; use /v1/completions")
        add_gen = want(body, "add_generation_prompt", bool, True)
        text = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_gen)
        if urls:  # the template writes its own special tokens, as below
            images = self.native.images()
            return images.from_text(text, images.decode(urls, "image_url"), "messages", add_special_tokens=False)
        # The template writes its own special tokens; adding a BOS on top would double it.
        ids = encode_text(tok, text, "messages", add_special_tokens=False)
        if not ids:
            raise RequestError("messages render to no tokens")
        return ids, []

    # ---------------------------------------------------------------------------- endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = drop_inert(await read_json(request), INERT_OPENAI)
        reject_unknown(body, self.COMPLETION)
        top_k = want(body, "logprobs", int)
        if top_k is not None and not 0 <= top_k <= 20:
            raise RequestError(f"logprobs must be in [0, 20], got {top_k}")
        prompts = self.completion_prompts(body)
        reqs = self.requests(body, prompts, top_k or 0, top_k is not None)
        render = _CompletionRender(self, reqs, top_k is not None)
        return await self._answer(request, body, reqs, render)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = drop_inert(await read_json(request), INERT_OPENAI)
        reject_unknown(body, self.CHAT)
        logprobs = want(body, "logprobs", bool, False)
        top_k = want(body, "top_logprobs", int, 0)
        if not 0 <= top_k <= 20:
            raise RequestError(f"top_logprobs must be in [0, 20], got {top_k}")
        if top_k and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        ids, images = await asyncio.to_thread(self.chat_prompt, body) if _has_images(body) else self.chat_prompt(body)
        reqs = self.requests(body, [ids], top_k, logprobs, images)
        render = _ChatRender(self, reqs, logprobs)
        return await self._answer(request, body, reqs, render)

    async def _answer(self, request: web.Request, body: dict[str, Any], reqs: list[GenerateRequest], render: Any) -> web.StreamResponse:
        if want(body, "stream", bool, False):
            return await self._stream(request, reqs, render)
        outs = await asyncio.gather(*(self.s.generate(r) for r in reqs))
        return web.json_response(render.full(outs))

    async def _stream(self, request: web.Request, reqs: list[GenerateRequest], render: Any) -> web.StreamResponse:
        """Merge the requests' partial outputs into one SSE stream of OpenAI chunks."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, req: GenerateRequest) -> None:
            try:
                async for part in self.s.stream(req):
                    await queue.put((index, part))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            response = await sse_response(request)
            try:
                await self._pump_out(response, queue, tasks, render)
            except (ConnectionResetError, asyncio.CancelledError):
                raise  # the client went away
            except Exception as e:  # noqa: BLE001 -- classified: after the 200, the error is the stream's last event
                await sse_error(response, e)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for t in tasks:
                t.cancel()


    @staticmethod
    async def _pump_out(response: web.StreamResponse, queue: asyncio.Queue, tasks: list, render: Any) -> None:
        """Write the choices' chunks as they come, then the usage chunk; an engine error re-raised."""
        done, finals = 0, [None] * len(tasks)
        while done < len(tasks):
            index, part = await queue.get()
            if part is None:
                done += 1
                continue
            finals[index] = part
            if chunk := render.chunk(index, part):
                await sse(response, chunk)
        for t in tasks:
            t.result()  # re-raise an engine error
        await sse(response, render.usage_chunk(finals))


def _has_images(body: dict[str, Any]) -> bool:
    """Whether a chat body has ``image_url`` parts (its prompt is then made off the event loop)."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )  # fmt: skip


def _chat_message(message: Any, i: int, urls: list[str]) -> dict[str, str]:
    """A message with string content; its ``image_url`` parts' URLs are appended to ``urls`` and
    stand as the image placeholder in its text."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise RequestError(f"{where}.role must be system, user, assistant or tool, got {role!r}")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise RequestError(f"{where}.content[{j}].image_url.url must be a string (a data URL)")
                urls.append(url)
                parts.append(IMAGE_PLACEHOLDER)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{j}]: only text and image_url parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text and image_url parts")
    return {"role": role, "content": content}


def _finish(out: GenerateOutput) -> str | None:
    if out.finish_reason is None:
        return None
    kind = out.finish_reason.get("type")
    return kind if kind in ("stop", "length") else "abort"


def _visible_text(out: GenerateOutput) -> str:
    """The output text without a matched stop string at its end (OpenAI does not return it)."""
    matched = (out.finish_reason or {}).get("matched")
    text = out.text
    if isinstance(matched, str) and matched and matched in text:
        text = text[: text.rindex(matched)]
    return text


@dataclass
class _Render:
    """Shared parts of the OpenAI renderers: ids, usage, per-choice stream offsets."""

    api: OpenAIApi
    reqs: list[GenerateRequest]
    logprobs: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)

    def usage(self, outs: list[GenerateOutput | None]) -> dict[str, int]:
        prompt = sum(len(r.input_ids) for r in self.reqs)
        completion = sum(len(o.output_ids) for o in outs if o is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def version(self, outs: list[GenerateOutput | None]) -> int:
        versions = [o.weight_version for o in outs if o is not None and o.weight_version is not None]
        return max(versions) if versions else self.api.s.engine.weight_version

    def envelope(self, kind: str, choices: list[dict[str, Any]], outs: list[GenerateOutput | None]) -> dict[str, Any]:
        return {
            "id": f"{kind[:4]}-{self.id}", "object": kind, "created": self.created,
            "model": self.api.native.model_name, "choices": choices,
            "weight_version": self.version(outs), "engine_id": self.api.s.engine_id,
        }  # fmt: skip

    def delta(self, index: int, part: GenerateOutput) -> tuple[str, int, int]:
        """New text and the new token range of a cumulative partial output."""
        text = part.text if part.finished is False else _visible_text(part)
        start_text, start_tok = self.sent_text.get(index, 0), self.sent_tokens.get(index, 0)
        self.sent_text[index], self.sent_tokens[index] = len(text), len(part.output_ids)
        return text[start_text:], start_tok, len(part.output_ids)

    def token_ids_extra(self, out: GenerateOutput, start: int = 0, end: int | None = None) -> dict[str, Any]:
        return {"token_ids": out.output_ids[start:end], "weight_versions": out.weight_versions[start:end]}


class _CompletionRender(_Render):
    def logprob_block(self, out: GenerateOutput, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tok = self.api.s.engine.tokenizer
        ids = out.output_ids[start:end]
        tops = (out.top_logprobs or [])[start:end]
        return {
            "tokens": token_texts(tok, ids),
            "token_logprobs": out.logprobs[start:end],
            "top_logprobs": [{t: lp for t, lp in zip(token_texts(tok, [i for i, _ in step]), [lp for _, lp in step])} for step in tops]
            or None,
            "text_offset": None,
        }

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        choices = [
            {"index": i, "text": _visible_text(o), "logprobs": self.logprob_block(o), "finish_reason": _finish(o), **self.token_ids_extra(o)}
            for i, o in enumerate(outs)
        ]
        return {**self.envelope("text_completion", choices, outs), "usage": self.usage(outs)}

    def chunk(self, index: int, part: GenerateOutput) -> dict[str, Any] | None:
        text, start, end = self.delta(index, part)
        if not text and start == end and not part.finished:
            return None
        choice = {"index": index, "text": text, "logprobs": self.logprob_block(part, start, end), "finish_reason": _finish(part), **self.token_ids_extra(part, start, end)}
        return self.envelope("text_completion", [choice], [part])

    def usage_chunk(self, outs: list[GenerateOutput | None]) -> dict[str, Any]:
        return {**self.envelope("text_completion", [], outs), "usage": self.usage(outs)}


class _ChatRender(_Render):
    def logprob_block(self, out: GenerateOutput, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tok = self.api.s.engine.tokenizer
        ids, lps = out.output_ids[start:end], out.logprobs[start:end]
        tops = (out.top_logprobs or [])[start:end] or [[] for _ in ids]
        content = []
        for t, text, lp, step in zip(ids, token_texts(tok, ids), lps, tops):
            top = [{"token": s, "logprob": l, "bytes": list((s or "").encode())} for s, l in zip(token_texts(tok, [i for i, _ in step]), [l for _, l in step])]
            content.append({"token": text, "logprob": lp, "bytes": list((text or "").encode()), "top_logprobs": top, "id": t})
        return {"content": content}

    def full(self, outs: list[GenerateOutput]) -> dict[str, Any]:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": _visible_text(o)}, "logprobs": self.logprob_block(o),
             "finish_reason": _finish(o), **self.token_ids_extra(o)}
            for i, o in enumerate(outs)
        ]  # fmt: skip
        prompt_ids = self.reqs[0].input_ids if self.reqs else []
        return {**self.envelope("chat.completion", choices, outs), "usage": self.usage(outs), "prompt_token_ids": prompt_ids}

    def chunk(self, index: int, part: GenerateOutput) -> dict[str, Any] | None:
        first = index not in self.sent_tokens
        text, start, end = self.delta(index, part)
        if not text and start == end and not part.finished and not first:
            return None
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "logprobs": self.logprob_block(part, start, end), "finish_reason": _finish(part), **self.token_ids_extra(part, start, end)}
        return self.envelope("chat.completion.chunk", [choice], [part])

    def usage_chunk(self, outs: list[GenerateOutput | None]) -> dict[str, Any]:
        return {**self.envelope("chat.completion.chunk", [], outs), "usage": self.usage(outs)}
