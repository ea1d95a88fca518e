"""Chat-template handling for token-in-token-out sessions: first render, appended deltas, parsing.

What this module owns: turning chat messages into the token ids the engine sees, in two moves,
and turning the engine's text back into an OpenAI assistant message.

- ``first_ids(messages, tools)``: the whole first turn rendered with the tokenizer's template
  (``add_generation_prompt=True``) and tokenized without extra special tokens.
- ``appended_ids(messages, tools)``: only the messages appended after an assistant turn. They are
  rendered after a fixed stand-in history (system?, user, assistant ``_STANDIN``); the text from the
  end-of-turn marker that closes the stand-in assistant to the end (generation prompt included) is
  the delta. So earlier turns are never re-rendered, and templates that rewrite history (Qwen3
  drops the ``<think>`` block of assistant turns before the last user query) cannot change the
  tokens the policy already produced.
- ``parse_assistant(text)``: ``<think>...</think>`` becomes ``reasoning_content``; each
  ``<tool_call>{json}</tool_call>`` (an object, or a list of objects as SmolLM2 writes them)
  becomes an OpenAI ``tool_calls`` entry; a tag whose body is not JSON is reported as unparsable,
  never silently dropped.

Families: ChatML templates (SmolLM2, Qwen2.5, Qwen3: end of turn ``<|im_end|>``). A template that
does not mention ``tools`` (SmolLM2's) gets the tool list written into the system message here in
the format SmolLM2 was tuned on (calls as a JSON list inside ``<tool_call>``), and its ``tool``
messages are sent as user turns wrapped in ``<tool_response>``, as SmolLM2 saw them; the parser
reads both the list form and Qwen3's one-object form. ``QWEN3_TEMPLATE`` is Qwen3's format written
out (tools header, ``<tool_response>`` blocks folded into a user turn, thinking gated by the last
user query, ``enable_thinking=False`` generation prompt) for tokenizers that ship without it.

Not guaranteed: the delta tokenizes at a special-token boundary (``\\n<|im_start|>`` after the
marker), so concatenating it with the recorded ids equals tokenizing the text in one piece only for
templates whose turns start with a special token; other families need their own marker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jinja2

from noria.errors import NoriaError

_STANDIN = "noria-standin-assistant-turn"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN_TOOL_CALL = "<tool_call>"

TOOLS_SYSTEM = (
    "You compose function calls. Given a question and the functions below, call one or more of them when "
    "they help answer it.\nYou have access to the following tools:\n<tools>{tools}</tools>\n"
    "To call functions, answer with only a list of calls in this format:\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}\n]</tool_call>\n'
    "After the tool responses arrive, give the final answer."
)
"""The tool instructions written into the system message for templates without tool support."""

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1, tool_chain=true) %}"
    "{%- for m in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}"
    "{%- if ns.tool_chain and m.role == 'user' and m.content is string and not (m.content.startswith('<tool_response>')"
    " and m.content.endswith('</tool_response>')) %}{%- set ns.tool_chain = false %}{%- set ns.last_query = i %}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if m.reasoning_content is not string and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in (m.tool_calls or []) %}{%- set f = call.function if call.function else call %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


class TemplateError(NoriaError):
    """The chat template cannot be used token-in-token-out (no end-of-turn marker, unstable prefix)."""


@dataclass
class ParsedAssistant:
    """An assistant turn's text split into the parts an OpenAI client reads."""

    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    unparsable_tool_calls: list[str] = field(default_factory=list)
    """Bodies of ``<tool_call>`` tags that were not valid JSON calls (or an unclosed tag)."""

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ChatFormat:
    """Token-in-token-out rendering for one tokenizer's (ChatML-family) chat template."""

    def __init__(self, tokenizer: Any, end_of_turn: str = "<|im_end|>") -> None:
        from noria.data.vision_chat import is_processor

        self.processor = tokenizer if is_processor(tokenizer) else None
        """A vision-language model's processor (given in place of the tokenizer): image parts render
        as its image placeholder, which it expands into the image's tokens."""
        if self.processor is not None:
            tokenizer = self.processor.tokenizer
        template = getattr(self.processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        if not template:
            raise TemplateError("the tokenizer has no chat template; a chat session needs one")
        if end_of_turn not in template:
            raise TemplateError(f"the chat template never writes {end_of_turn!r}; only ChatML-family templates are supported")
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn
        ids = tokenizer.encode(end_of_turn, add_special_tokens=False)
        if len(ids) != 1:
            raise TemplateError(f"{end_of_turn!r} is not one token in this tokenizer (got {ids})")
        self.end_of_turn_id = ids[0]
        self.native_tools = "tools" in template
        self.template = template

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool, **kwargs: Any) -> str:
        """The chat template's text; ``TemplateError`` when it cannot render these (the client's) messages."""
        try:
            messages = [dict(m) for m in messages]
            if not self.native_tools:
                messages = [tool_as_user(m) for m in messages]
                if tools:
                    messages = with_tools_in_system(messages, tools)
                    tools = None
            extra = {"tools": tools} if tools else {}
            if self.processor is not None:  # the processor's template, which renders image parts
                extra["chat_template"] = self.template
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra, **kwargs
            )
        except (TemplateError, jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # classified: the messages are the client's, so the template failing on them is a bad request
            raise TemplateError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from e

    def encode(self, text: str, images: list[str] | None = None) -> list[int]:
        """Token ids of ``text``; with ``images`` (stored references, one per placeholder in ``text``)
        each placeholder expanded by the processor into its image's tokens."""
        if images:
            return self._encode_images(text, images)
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, ValueError, UnicodeEncodeError) as e:  # e.g. a lone surrogate in the client's text
            raise TemplateError(f"the text cannot be tokenized: {type(e).__name__}: {e}") from e

    def _encode_images(self, text: str, images: list[str]) -> list[int]:
        from noria.data.images import default_store
        from noria.engine.vision import IMAGE_PLACEHOLDER

        if self.processor is None:
            raise TemplateError("the messages hold images but the model takes none (no image processor)")
        if text.count(IMAGE_PLACEHOLDER) != len(images):
            raise TemplateError(f"the chat template wrote {text.count(IMAGE_PLACEHOLDER)} image placeholders for {len(images)} images")
        pictures = [default_store().get(ref).convert("RGB") for ref in images]
        encoded = self.processor(text=[text], images=[pictures], add_special_tokens=False, do_image_splitting=False)
        return [int(t) for t in encoded["input_ids"][0]]

    def first_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, images: list[str] | None = None, **kwargs: Any) -> list[int]:
        """The first turn, rendered whole, ready for generation (``images``: the messages' images)."""
        return self.encode(self.render(messages, tools, True, **kwargs), images)

    def appended_text(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Text of ``messages`` appended after an assistant turn's end-of-turn marker (+ generation prompt)."""
        if not messages:
            raise TemplateError("no messages appended after the last assistant turn")
        standin = [{"role": "user", "content": "noria-standin-user"}, {"role": "assistant", "content": _STANDIN}]
        if tools:  # the tools header is part of the (already recorded) first turn
            standin.insert(0, {"role": "system", "content": "noria-standin-system"})
        full = self.render(standin + [dict(m) for m in messages], tools, True, **kwargs)
        at = full.find(_STANDIN)
        end = full.find(self.end_of_turn, at) if at >= 0 else -1
        if end < 0:
            raise TemplateError("cannot find the stand-in assistant turn in the rendered template")
        return full[end + len(self.end_of_turn) :]

    def appended_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None, images: list[str] | None = None, **kwargs: Any) -> list[int]:
        return self.encode(self.appended_text(messages, tools, **kwargs), images)

    def parse_assistant(self, text: str) -> ParsedAssistant:
        """Split decoded assistant text (end-of-turn marker removed) into reasoning, content, tool calls."""
        text = text.split(self.end_of_turn)[0]
        reasoning = None
        if "</think>" in text:
            head, text = text.split("</think>", 1)
            reasoning = head.split("<think>")[-1].strip("\n")
            text = text.lstrip("\n")
        calls, bad = parse_tool_calls(text)
        content = _TOOL_CALL.sub("", text).strip() if calls or bad else text
        return ParsedAssistant(content, reasoning, calls, bad)


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(OpenAI tool calls, unparsable bodies) from ``<tool_call>`` tags in ``text``."""
    calls: list[dict[str, Any]] = []
    bad: list[str] = []
    for body in _TOOL_CALL.findall(text):
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            bad.append(body)
            continue
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                bad.append(body)
                continue
            args = item.get("arguments", {})
            calls.append({
                "id": f"call_{len(calls)}",
                "type": "function",
                "function": {"name": item["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            })  # fmt: skip
    if text.count(_OPEN_TOOL_CALL) > len(_TOOL_CALL.findall(text)):
        bad.append(text[text.rfind(_OPEN_TOOL_CALL) :])  # opened, never closed
    return calls, bad


def tool_as_user(message: dict[str, Any]) -> dict[str, Any]:
    """A ``tool`` message as the user turn a template without tool support should show."""
    if message.get("role") != "tool":
        return message
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts (a tool's picture among them) keep their order inside the wrapper
        return {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *content, {"type": "text", "text": "\n</tool_response>"}]}
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """``messages`` with the tool instructions appended to (or as) the system message."""
    listing = json.dumps([t.get("function", t) for t in tools])
    text = TOOLS_SYSTEM.format(tools=listing)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
