"""Images in token-in-token-out sessions (a vision-language policy): the image parts of the messages
a client sends, read and kept by content hash, as the session's record keeps its tokens.

What this module owns: ``message_images`` (the images of messages, in the order a chat template
renders them). Parts read: OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` and
``{"type": "image", "image": ...}``, in any message (a user turn, or a ``tool`` result: an agent's
tool may return a picture). Each image is put in the process's image store
(``noria.data.images.default_store``), so the rollout's sample names it (``Sample.images``) and the
trainer processes the same bytes the engine was sent.

Failure: an image that is not a data URL or base64 (an ``http://`` URL, a file path), or that does
not decode, is a ``BadRequest`` naming the message and part: the session server answers 400 and
records nothing. Images are never downloaded and no local file is read, as in ``noria serve``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from noria.agent.session_bounds import BadRequest


def message_images(messages: list[dict[str, Any]]) -> list[str]:
    """The ``sha256:`` references of the image parts of ``messages``, in order."""
    refs = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            value = _image_value(part)
            if value is not None:
                refs.append(_store(value, f"messages[{i}].content[{k}]"))
    return refs


def _image_value(part: Any) -> Any:
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if part.get("type") == "image":
        return part.get("image") or part.get("url")
    return None


def _store(value: Any, where: str) -> str:
    from noria.data.images import ImageError, decode_image, default_store

    if not isinstance(value, str):
        raise BadRequest(f"{where}: an image must be a data URL or base64 string, got {type(value).__name__}")
    text = value.strip()
    try:
        if text.startswith("data:"):
            return default_store().put_value(text, None, where)
        if "://" in text[:16]:
            raise BadRequest(f"{where}: {text.split('://')[0]}:// URLs are not fetched (images are never downloaded); send a data URL")
        try:
            data = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"{where}: neither a data URL (data:image/...;base64,...) nor base64 ({e}); file paths are not read") from e
        return default_store().put(decode_image(data, where), data)
    except ImageError as e:
        raise BadRequest(str(e)) from e
