"""Rendering prompts to token ids, and dropping the ones that are too long.

What this module owns: the one place where a ``Prompt`` becomes the ``prompt_ids`` a rollout starts
from. With ``chat_template`` on and a tokenizer that has a template, a string prompt becomes
``[system?, user]`` messages and a message prompt is used as is; both are rendered with
``add_generation_prompt=True``. Otherwise a string prompt is tokenized as plain text (the system
prompt, if any, prepended with a blank line). A message prompt without a usable template is an
error, as is a prompt that renders to no tokens.

The template is rendered to text and then tokenized without adding special tokens, because the
template already writes the ones it wants (a BOS added on top would be doubled). ``data.chat_template``
may also name a Jinja file or hold a template itself (``resolve_chat_template``): that template is
applied with the tokenizer in place of its own.

A prompt with images (``noria.data.vision_chat``) needs a processor in place of the tokenizer: its
chat template writes an image token per image part, and the processor expands each into the
image's tokens; ``RenderedPrompt.images`` lists the images by content hash, in that order.

Not guaranteed: the rendered ids equal what a chat server would produce for the same messages only
if it uses the same tokenizer and template; ``system_prompt`` is not added to message prompts
(they carry their own system message if they want one).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noria.data.source import DataError
from noria.data.vision_chat import is_processor, prompt_images, text_tokenizer
from noria.types import Prompt


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt and its token ids."""

    prompt: Prompt
    ids: list[int]
    """Token ids of the rendered prompt, shape [P], P >= 1."""
    images: tuple[str, ...] = ()
    """The prompt's images (``sha256:`` references, ``noria.data.images``) in the order of their tokens."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


@functools.lru_cache(maxsize=8)
def resolve_chat_template(value: bool | str) -> bool | str:
    """``data.chat_template`` as used: True / False as given; a string is a Jinja template if it looks
    like one (``{%`` or ``{{`` in it), else the path of a file holding one (read once)."""
    if isinstance(value, bool):
        return value
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(f"data.chat_template: {value!r} is neither a Jinja template nor a file (not found: {path.resolve()})")
    return path.read_text()


def _template_on(chat_template: bool | str, tokenizer: Any) -> bool:
    return isinstance(chat_template, str) or (chat_template and has_chat_template(tokenizer))


def prompt_messages(prompt: Prompt, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages of ``prompt``: its own, or ``[system?, user]`` for a string prompt."""
    if not isinstance(prompt.prompt, str):
        return [dict(m) for m in prompt.prompt]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": prompt.prompt}]


def render_text(prompt: Prompt, tokenizer: Any, chat_template: bool | str = True, system_prompt: str | None = None) -> str:
    """The exact text the model sees before generating its answer."""
    chat_template = resolve_chat_template(chat_template)
    if _has_images(prompt) and not is_processor(tokenizer):
        raise DataError(f"{_where(prompt)}: the prompt has images but the model has no image processor (a folder AutoProcessor loads)")
    if _template_on(chat_template, tokenizer):
        messages = prompt_messages(prompt, system_prompt)
        own = {"chat_template": chat_template} if isinstance(chat_template, str) else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **own)
    if not isinstance(prompt.prompt, str):
        why = "chat_template is off" if not chat_template else "the tokenizer has no chat template"
        raise DataError(f"{_where(prompt)}: prompt is a list of chat messages but {why}")
    return f"{system_prompt}\n\n{prompt.prompt}" if system_prompt else prompt.prompt


def render_prompt(
    prompt: Prompt, tokenizer: Any, chat_template: bool | str = True, system_prompt: str | None = None
) -> list[int]:
    """Token ids of ``prompt`` ready for generation; an empty rendering raises ``DataError``."""
    text = render_text(prompt, tokenizer, chat_template, system_prompt)
    if _has_images(prompt):
        from noria.data.vision_chat import render_image_prompt

        ids = render_image_prompt(prompt, tokenizer, text, _where(prompt))
    else:
        add_special = not _template_on(resolve_chat_template(chat_template), tokenizer)
        ids = list(text_tokenizer(tokenizer)(text, add_special_tokens=add_special)["input_ids"])
    if not ids:
        raise DataError(f"{_where(prompt)}: prompt renders to no tokens")
    return ids


def render_prompts(
    prompts: Iterable[Prompt], tokenizer: Any, chat_template: bool | str = True, system_prompt: str | None = None
) -> list[RenderedPrompt]:
    """``render_prompt`` for each prompt, in order."""
    return [RenderedPrompt(p, render_prompt(p, tokenizer, chat_template, system_prompt), tuple(prompt_images(p))) for p in prompts]


def drop_long(rendered: Sequence[RenderedPrompt], max_tokens: int | None) -> tuple[list[RenderedPrompt], int]:
    """Keep prompts of at most ``max_tokens`` tokens (all if None); return (kept, number dropped)."""
    if max_tokens is None:
        return list(rendered), 0
    kept = [r for r in rendered if len(r.ids) <= max_tokens]
    return kept, len(rendered) - len(kept)


def check_fit(rendered: Sequence[RenderedPrompt], context: int | None, max_prompt_tokens: int | None) -> None:
    """``DataError`` naming the first prompt of ``context`` tokens or more: the engine refuses it (no
    room left to answer), which would otherwise surface at rollout time, many steps in."""
    if context is None:
        return
    for r in rendered:
        if len(r.ids) >= context:
            raise DataError(
                f"{_where(r.prompt)}: the prompt has {len(r.ids)} tokens, but the engine's context (prompt + output) is "
                f"{context}; set data.max_prompt_tokens (now {max_prompt_tokens}) below {context} to drop such prompts, "
                "or raise engine.max_context"
            )


def _has_images(prompt: Prompt) -> bool:
    return not isinstance(prompt.prompt, str) and any(not isinstance(m.get("content"), str) for m in prompt.prompt)


def _where(prompt: Prompt) -> str:
    return f"{prompt.source or 'prompt'} row index {prompt.index}"
