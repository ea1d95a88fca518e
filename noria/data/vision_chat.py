"""Prompts with images: the content parts of chat messages, and rendering them with a model's processor.

What this module owns: how a data row's images become part of its ``Prompt``, and how such a prompt
becomes token ids with the image placeholders expanded.

A row carries images in OpenAI's content-part form inside its messages, or in an ``images`` field
(TRL's and verl's form) that fills the messages' bare ``{"type": "image"}`` parts in order. Parts
accepted (``image_prompt``):

- ``{"type": "text", "text": "..."}``;
- ``{"type": "image"}``: the next image of the row's ``images`` field;
- ``{"type": "image", "image" | "url" | "path": VALUE}`` (Hugging Face's chat form) and
  ``{"type": "image_url", "image_url": {"url": VALUE}}`` (OpenAI's), VALUE being anything
  ``noria.data.images.read_image`` reads: a path relative to the data file, a data URL, bytes.

A string prompt with an ``images`` field becomes one user message: the images, then the text. Each
image is read, checked and put in the image store (``noria.data.images.default_store()``) when the
row is read, so a bad image fails the load naming file, row and field; the prompt keeps only
``{"type": "image", "image": "sha256:..."}`` parts (and ``{"type": "text"}`` ones), which are JSON and
name each image by content hash. Messages without images keep plain string contents.

Rendering (``render_image_prompt``): the processor's chat template writes the text with one image
token per image part, then the processor (``AutoProcessor``, e.g. ``Idefics3Processor``) expands
each into the image's tokens. A model folder without a processor cannot take such prompts
(``DataError`` naming the row).

Not guaranteed: an image part's position among the text parts is kept, but how a template lays out
several images (one message or several) is the template's business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from noria.data.images import default_store, is_image_ref
from noria.data.source import CHAT_ROLES, DataError
from noria.types import Prompt

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""Files whose presence in a model folder means it has a processor (``AutoProcessor`` loads it)."""
_VALUE_KEYS = ("image", "url", "path")


def has_content_parts(value: Any) -> bool:
    """Whether a raw prompt value is messages of which one has a list of content parts."""
    if not isinstance(value, (list, tuple)):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), (list, tuple)) for m in value)


def image_prompt(value: Any, images: Any, base_dir: Path | None, key: str = "prompt", images_key: str = "images") -> tuple[dict[str, Any], ...]:
    """The checked messages of a prompt with images, each image read, checked and stored by hash."""
    row_images = _as_list(images)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"field '{key}': the prompt is empty")
        parts = [{"type": "image"} for _ in row_images] + [{"type": "text", "text": value}]
        value = [{"role": "user", "content": parts}]
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"field '{key}': expected a string or a non-empty list of chat messages, got {type(value).__name__}")
    queue = _Images(row_images, base_dir, images_key)
    messages = tuple(_message(m, f"{key}[{i}]", queue) for i, m in enumerate(value))
    if queue.left():
        raise DataError(
            f"field '{images_key}': {len(row_images)} images but the messages have {queue.used} bare "
            "{'type': 'image'} parts to put them in"
        )
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"field '{key}': the messages contain no 'user' message")
    return messages


def _as_list(images: Any) -> list[Any]:
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


class _Images:
    """The row's ``images`` field, handed out in order to bare image parts."""

    def __init__(self, images: list[Any], base_dir: Path | None, key: str):
        self.images, self.base_dir, self.key, self.used = images, base_dir, key, 0

    def next(self, where: str) -> str:
        if self.used == len(self.images):
            raise DataError(f"field '{where}': an image part without an image, and field '{self.key}' has only {len(self.images)}")
        self.used += 1
        return self.read(self.images[self.used - 1], f"{self.key}[{self.used - 1}]")

    def read(self, value: Any, where: str) -> str:
        if is_image_ref(value):
            if value not in default_store():
                raise DataError(f"field '{where}': image {value} is not in the image store")
            return value
        return default_store().put_value(value, self.base_dir, f"field '{where}'")

    def left(self) -> bool:
        return self.used < len(self.images)


def _message(message: Any, where: str, images: _Images) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise DataError(f"field '{where}': expected a {{'role', 'content'}} object, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise DataError(f"field '{where}.role': {role!r} is not one of {list(CHAT_ROLES)}")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, (list, tuple)):
        raise DataError(f"field '{where}.content': expected a string or a list of content parts, got {type(content).__name__}")
    parts = [_part(p, f"{where}.content[{i}]", images) for i, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(part: Any, where: str, images: _Images) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise DataError(f"field '{where}.text': expected a string, got {type(part.get('text')).__name__}")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if url is None:
            raise DataError(f"field '{where}.image_url': expected {{'url': ...}}")
        return {"type": "image", "image": images.read(url, f"{where}.image_url")}
    if kind == "image":
        given = [k for k in _VALUE_KEYS if part.get(k) is not None]
        ref = images.read(part[given[0]], f"{where}.{given[0]}") if given else images.next(where)
        return {"type": "image", "image": ref}
    raise DataError(f"field '{where}': expected a content part of type text, image or image_url, got {part!r:.80}")


def prompt_images(prompt: Prompt) -> list[str]:
    """The image references of ``prompt``, in the order its messages hold them."""
    if isinstance(prompt.prompt, str):
        return []
    return [
        p["image"] for m in prompt.prompt if not isinstance(m.get("content"), str)
        for p in m["content"] if p.get("type") == "image"
    ]  # fmt: skip


def is_processor(obj: Any) -> bool:
    """Whether ``obj`` is a multimodal processor (it has an image processor) rather than a tokenizer."""
    return getattr(obj, "image_processor", None) is not None


def text_tokenizer(obj: Any) -> Any:
    """The tokenizer of a processor, or ``obj`` itself if it is one."""
    return obj.tokenizer if is_processor(obj) else obj


def load_processor(folder: str | Path) -> Any | None:
    """The folder's ``AutoProcessor`` if it has one (:data:`PROCESSOR_FILES`), else None."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))


def render_image_prompt(prompt: Prompt, processor: Any, text: str, where: str) -> list[int]:
    """Token ids of a prompt with images: ``text`` (its rendering by the chat template, one image
    token per image part) with each image token expanded by ``processor``."""
    if not is_processor(processor):
        raise DataError(f"{where}: the prompt has images but the model has no image processor (no {' or '.join(PROCESSOR_FILES)})")
    images = [default_store().get(ref) for ref in prompt_images(prompt)]
    encoded = processor(text=[text], images=[images], add_special_tokens=False)
    return list(encoded["input_ids"][0])


def image_data(refs: list[str]) -> list[str]:
    """The stored images of ``refs`` as base64 strings (SGLang's ``image_data``): the bytes as read,
    so an engine decodes exactly the image the trainer processes."""
    import base64

    store = default_store()
    return [base64.b64encode(store.encoded(ref)).decode("ascii") for ref in refs]


def stored_pixels(processor: Any, refs: list[str]):
    """FloatTensor [n, 3, S, S]: the processor's pixel values of the stored images ``refs`` (one tile
    each, no splitting), computed as the engine computes them for the same images (decoded, RGB)."""
    store = default_store()
    images = [store.get(ref).convert("RGB") for ref in refs]
    encoded = processor(images=[images], do_image_splitting=False, return_tensors="pt")
    pixels = encoded["pixel_values"]
    return pixels.reshape(-1, *pixels.shape[-3:]).float()
