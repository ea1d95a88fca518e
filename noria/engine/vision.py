"""Images in the built-in engine: a prompt's images, their embeddings at prefill, their cache keys.

A request to a vision-language model (``noria.models.vlm.VisionLM``) carries its images as
:class:`ImageInput` s (``GenerateRequest.images``): each one's pixel values (the model's image
processor's output, one tile) and the span of placeholder tokens it fills in ``input_ids``
(``image_seq_len`` tokens of ``image_token_id`` from ``start``). The prompt's token ids are the
expanded ones, as transformers' processor writes them.

Prefill (:class:`ImageEmbedder`, owned by the runner): a step whose chunks cover placeholder
positions runs the vision tower and connector on each image the first time one of its positions is
computed (once per image object: the ``n`` choices of one prompt share it), and the step's input
embeddings are the token embeddings with those rows replaced. Decode steps and steps without image
positions are untouched (CUDA graphs included). The embeddings are kept while the image object
lives (weakly keyed), and dropped at every weight update.

Prefix cache: the radix tree keys blocks by token ids, and every image's placeholder ids are the
same, so two different images would share cached K/V. :func:`cache_ids` gives the ids the cache
sees instead: each placeholder replaced by a negative id drawn from the image's content hash (the
SHA-256 of its pixel values) and its offset in the span. The same image after the same prefix hits;
another image never does.

Server side (:class:`ImagePrompts`): SGLang's ``image_data`` (one per image, a data URL or bare
base64) and OpenAI's ``image_url`` data URLs are decoded and checked by ``noria.data.images``, run
through the model folder's transformers processor (``do_image_splitting`` off: one tile per
image), and each ``<image>`` of a text prompt is expanded there. Nothing is fetched: ``http(s)://``
URLs and file paths are refused with a 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from noria.engine.protocol import GenerateRequest, RequestError

IMAGE_PLACEHOLDER = "<image>"
"""The image token of a text prompt (Idefics3's); the processor expands each one to the image's span."""
MAX_IMAGES = 16
"""Images one request may carry."""


@dataclass(eq=False)
class ImageInput:
    """One image of a prompt: pixel values and the placeholder span they fill."""

    pixel_values: torch.Tensor
    """[3, S, S] float32: the image processor's output for one tile."""
    start: int
    """Position in ``input_ids`` of the span's first placeholder token."""
    length: int
    """Placeholder tokens of the span (the model's ``image_seq_len``)."""
    digest: str = ""
    """SHA-256 hex of the pixel values (the prefix cache's key); computed when empty."""
    pixel_mask: torch.Tensor | None = None
    """[S, S]: 1 on real pixels (all, without splitting); None means all."""

    def __post_init__(self) -> None:
        if not self.digest:
            values = self.pixel_values.detach().to("cpu", torch.float32).contiguous()
            self.digest = hashlib.sha256(values.numpy().tobytes()).hexdigest()

    @property
    def end(self) -> int:
        return self.start + self.length


def image_spans(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of ``image_token_id`` in ``ids``, in order."""
    spans, i = [], 0
    while i < len(ids):
        if ids[i] == image_token_id:
            j = i
            while j < len(ids) and ids[j] == image_token_id:
                j += 1
            spans.append((i, j - i))
            i = j
        else:
            i += 1
    return spans


def check_request(model: Any, req: GenerateRequest, name: str = "image_data") -> None:
    """Raise ``RequestError`` unless ``req``'s images fit ``model`` and its prompt: a vision model,
    one placeholder span of ``image_seq_len`` tokens per image, in order, covering every placeholder."""
    images = req.images
    vision = getattr(model, "vision", None)
    if not images:
        return
    if vision is None:
        raise RequestError(f"{name}: this model ({model.args.model_type}) takes no images")
    if len(images) > MAX_IMAGES:
        raise RequestError(f"{name}: {len(images)} images; at most {MAX_IMAGES} per request")
    spans = image_spans(req.input_ids, vision.image_token_id)
    if len(spans) != len(images):
        raise RequestError(
            f"{name}: {len(images)} image(s) but the prompt has {len(spans)} run(s) of image tokens "
            f"(id {vision.image_token_id}); each image needs one run of {vision.image_seq_len}"
        )
    shape = (3, vision.image_size, vision.image_size)
    for i, (image, (start, length)) in enumerate(zip(images, spans)):
        if (image.start, image.length) != (start, length) or length != vision.image_seq_len:
            raise RequestError(
                f"{name}[{i}]: image tokens at {start}..{start + length} ({length}); the model takes runs of "
                f"{vision.image_seq_len} (the image says {image.start}..{image.end})"
            )
        if tuple(image.pixel_values.shape) != shape:
            raise RequestError(f"{name}[{i}]: pixel values of shape {tuple(image.pixel_values.shape)}, expected {shape}")


def cache_ids(ids: list[int], images: list[ImageInput]) -> list[int]:
    """``ids`` as the prefix cache keys them: each image's placeholders replaced by negative ids
    drawn from its content hash and offset (never a real token id)."""
    if not images:
        return ids
    keyed = list(ids)
    for image in images:
        base = (int(image.digest[:15], 16) + 1) << 16
        keyed[image.start : image.end] = [-(base + j) for j in range(min(image.length, len(ids) - image.start))]
    return keyed[: len(ids)]


class ImageEmbedder:
    """The runner's image path of a ``VisionLM``: a step's input embeddings with its images spliced in."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._features: weakref.WeakKeyDictionary[ImageInput, torch.Tensor] = weakref.WeakKeyDictionary()

    def clear(self) -> None:
        """Forget computed embeddings (after a weight update)."""
        self._features.clear()

    @staticmethod
    def touches(chunks: list) -> bool:
        """Whether a chunk of the step computes an image position."""
        return any(image.start < c.start + c.n and c.start < image.end for c in chunks for image in c.req.request.images)

    def embeds(self, chunks: list, ids: torch.Tensor) -> torch.Tensor | None:
        """Input embeddings [1, N, H] of the step's flattened ``ids`` [1, N] with image rows replaced,
        or None when no chunk computes an image position (the model embeds the ids itself)."""
        rows, parts, row = [], [], 0
        for c in chunks:
            for image in c.req.request.images:
                lo, hi = max(c.start, image.start), min(c.start + c.n, image.end)
                if lo < hi:
                    rows.append(torch.arange(row + lo - c.start, row + hi - c.start))
                    parts.append(self._image(image)[lo - image.start : hi - image.start])
            row += c.n
        if not rows:
            return None
        h = self.model.model.embed_tokens(ids)
        index = torch.cat(rows).to(h.device)
        h[0].index_copy_(0, index, torch.cat(parts).to(h.dtype))
        return h

    @torch.no_grad()
    def _image(self, image: ImageInput) -> torch.Tensor:
        features = self._features.get(image)
        if features is None:
            device = self.model.lm_head.weight.device
            mask = None if image.pixel_mask is None else image.pixel_mask[None].to(device)
            features = self.model.image_features(image.pixel_values[None].to(device), mask)[0]
            self._features[image] = features
        return features


# ---------------------------------------------------------------------------------- server side


class ImagePrompts:
    """Prompts with images for the server: decoded ``image_data`` / ``image_url`` values through the
    model folder's processor into expanded token ids and :class:`ImageInput` s."""

    def __init__(self, model: Any, folder: str | Path) -> None:
        self.vision = getattr(model, "vision", None)
        self.folder = Path(folder)
        self._processor = None
        self._lock = threading.RLock()  # one processor call at a time: a fast tokenizer is not shared across threads

    def processor(self) -> Any:
        self._require()
        with self._lock:
            if self._processor is None:
                from transformers import AutoProcessor

                try:
                    self._processor = AutoProcessor.from_pretrained(str(self.folder))
                except (OSError, ValueError) as e:
                    raise RequestError(f"image_data: the model folder {self.folder} has no usable image processor ({e})") from e
                if getattr(self._processor, "image_processor", None) is None:
                    raise RequestError(f"image_data: the model folder {self.folder} has no image processor")
        return self._processor

    def decode(self, values: Any, name: str) -> list[Any]:
        """Decoded images of a list of data URLs / bare base64 strings (a single string is one image)."""
        self._require(name)
        if isinstance(values, str):
            values = [values]
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise RequestError(f"{name} must be a data URL / base64 string or a non-empty list of them")
        if len(values) > MAX_IMAGES:
            raise RequestError(f"{name}: {len(values)} images; at most {MAX_IMAGES} per request")
        return [decode_image_value(v, f"{name}[{i}]") for i, v in enumerate(values)]

    def _require(self, name: str = "image_data") -> None:
        if self.vision is None:
            raise RequestError(f"{name}: this model takes no images (not a vision-language model)")

    def from_text(self, text: str, images: list[Any], name: str, add_special_tokens: bool = True) -> tuple[list[int], list[ImageInput]]:
        """Token ids of ``text`` with each ``<image>`` expanded, and the images' inputs."""
        count = text.count(IMAGE_PLACEHOLDER)
        if count != len(images):
            raise RequestError(f"{name}: {len(images)} image(s) but the prompt has {count} {IMAGE_PLACEHOLDER} placeholder(s)")
        encoded = self._process(text=[text], images=[images], add_special_tokens=add_special_tokens)
        ids = [int(t) for t in encoded["input_ids"][0]]
        return ids, self._inputs(ids, encoded, name)

    def from_ids(self, ids: list[int], images: list[Any], name: str) -> list[ImageInput]:
        """The images' inputs for ids already expanded (one run of ``image_seq_len`` per image)."""
        encoded = self._process(images=[images])
        return self._inputs(ids, encoded, name)

    def from_data(self, ids: list[int], image_data: list[str], name: str = "image_data") -> list[ImageInput]:
        """The images' inputs of a request's ``image_data`` (base64 / data URLs) for ids already expanded."""
        return self.from_ids(ids, self.decode(list(image_data), name), name)

    def _process(self, **kwargs: Any) -> Any:
        processor = self.processor()
        try:
            with self._lock:
                return processor(**kwargs, do_image_splitting=False, return_tensors="pt")
        except (ValueError, TypeError, OSError) as e:
            raise RequestError(f"image_data: the image processor refused the input ({e})") from e

    def _inputs(self, ids: list[int], encoded: Any, name: str) -> list[ImageInput]:
        pixels = encoded["pixel_values"].reshape(-1, *encoded["pixel_values"].shape[-3:])
        masks = encoded.get("pixel_attention_mask")
        masks = None if masks is None else masks.reshape(-1, *masks.shape[-2:])
        spans = image_spans(ids, self.vision.image_token_id)
        if len(spans) != len(pixels):
            raise RequestError(
                f"{name}: {len(pixels)} image tile(s) but the prompt has {len(spans)} run(s) of image tokens "
                f"(id {self.vision.image_token_id}); input_ids must hold each image's expanded placeholder tokens"
            )
        return [
            ImageInput(pixel_values=pixels[i].float(), start=start, length=length,
                       pixel_mask=None if masks is None or bool(masks[i].all()) else masks[i])
            for i, (start, length) in enumerate(spans)
        ]  # fmt: skip


_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")


def decode_image_value(value: str, name: str) -> Any:
    """A Pillow image (RGB) of a data URL or bare base64 string; anything else is a ``RequestError``:
    URLs are never fetched and the server reads no local files."""
    from noria.data.images import ImageError, decode_image, read_image

    text = value.strip()
    scheme = _SCHEME.match(text)
    if scheme:
        raise RequestError(f"{name}: {scheme.group(1)}:// URLs are not fetched (images are never downloaded); send a data URL or base64")
    try:
        if text.startswith("data:"):
            image = read_image(text, None, name)[0]
        else:
            try:
                data = base64.b64decode("".join(text.split()), validate=True)
            except (binascii.Error, ValueError) as e:
                raise RequestError(f"{name}: neither a data URL (data:image/...;base64,...) nor base64 ({e}); file paths are not read") from e
            image = decode_image(data, name)
    except ImageError as e:
        raise RequestError(str(e)) from e
    return image.convert("RGB")
