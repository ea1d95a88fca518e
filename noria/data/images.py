"""Images in data records: reading, checking, hashing and storing the images a prompt carries.

What this module owns: turning an image value found in a data row into a checked, decoded image,
and the content-addressed store images live in for the rest of a run.

Where an image may come from (``read_image``): a file path, relative to the data file's folder (or
absolute); a data URL (``data:image/png;base64,...``); raw bytes (a Parquet binary column); or a
``{"bytes": ..., "path": ...}`` mapping (how Hugging Face ``datasets`` stores its ``Image`` feature).
Nothing is fetched from the network: an ``http(s)://`` or any other URL is refused, naming the row.

Every image is checked before any model is loaded: at most :data:`MAX_IMAGE_BYTES` encoded,
:data:`MAX_IMAGE_PIXELS` pixels (read from the header, before decoding), a format in
:data:`FORMATS`, one frame, a mode in :data:`MODES`, and it must decode completely (a truncated
file is refused). A bad image raises ``ImageError`` (a ``DataError``) whose message says why; the
data reader prefixes the file and row.

Identity: ``image_hash`` is ``sha256:<hex>`` of the decoded image (mode, size and pixels), so the
same picture as a PNG file and as a data URL is one image, and a re-encoded file with the same
pixels too. ``ImageStore`` keeps each image once under its hash (the encoded bytes as read, decoded
again on ``get``); ``save(folder)`` writes each one once as ``<hex>.<format>``, and ``load`` reads
such a folder back, checking every hash. ``default_store()`` is the process's store, which the data
readers and tasks put images in; prompts refer to their images by hash (``{"type": "image", "image":
"sha256:..."}`` content parts, see ``noria.data.vision_chat``).

Not guaranteed: a JPEG's decoded pixels (hence its hash) may differ between builds of libjpeg; the
store holds every image's encoded bytes in memory for the life of the process.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import threading
from pathlib import Path
from typing import Any

from noria.data.source import DataError

MAX_IMAGE_BYTES = 32 << 20
"""Largest encoded image accepted (bytes)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest image accepted (width x height), checked from the header before decoding."""
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Image formats accepted (as Pillow names them)."""
MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")
"""Pixel modes accepted; others (CMYK, 16-bit, float) are refused rather than converted silently."""
REF_PREFIX = "sha256:"
_REF = re.compile(r"sha256:[0-9a-f]{64}")
_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.DOTALL)
_SUFFIX = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}


class ImageError(DataError):
    """An image that cannot be used: the message says why (the reader adds file and row)."""


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow is part of the cpu extra
        raise ImportError("images in data need Pillow: pip install pillow") from e
    return Image


def decode_image(data: bytes, what: str = "image"):
    """The checked, fully decoded Pillow image of ``data`` (the encoded bytes of one image)."""
    Image = _pil()
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what} is {len(data)} bytes, more than {MAX_IMAGE_BYTES} (noria.data.images.MAX_IMAGE_BYTES)")
    if not data:
        raise ImageError(f"{what} is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, ValueError... for bad data
        raise ImageError(f"{what} cannot be decoded as an image ({e})") from e
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"{what} is {width}x{height} = {width * height} pixels, more than {MAX_IMAGE_PIXELS} (noria.data.images.MAX_IMAGE_PIXELS)"
        )
    if image.format not in FORMATS:
        raise ImageError(f"{what} is in format {image.format}; supported: {', '.join(FORMATS)}")
    if getattr(image, "n_frames", 1) > 1:
        raise ImageError(f"{what} has {image.n_frames} frames; only single-frame images are supported")
    if image.mode not in MODES:
        raise ImageError(f"{what} has pixel mode {image.mode!r}; supported: {', '.join(MODES)}")
    try:
        image.load()
    except Exception as e:  # truncated or corrupt pixel data
        raise ImageError(f"{what} cannot be decoded: {e}") from e
    return image


def read_image(value: Any, base_dir: Path | None = None, what: str = "image") -> tuple[Any, bytes]:
    """``(decoded image, encoded bytes)`` of an image value from a data row: a path (relative to
    ``base_dir``), a data URL, bytes, or a ``{"bytes", "path"}`` mapping; ``ImageError`` otherwise."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return read_image(value["bytes"], base_dir, what)
        if value.get("path") is not None:
            return read_image(value["path"], base_dir, what)
        raise ImageError(f"{what}: a mapping needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, str):
        data = _bytes_of_string(value, base_dir, what)
    else:
        raise ImageError(f"{what}: expected a file path, a data URL or bytes, got {type(value).__name__}")
    return decode_image(data, what), data


def _bytes_of_string(value: str, base_dir: Path | None, what: str) -> bytes:
    text = value.strip()
    if text.startswith("data:"):
        return _data_url_bytes(text, what)
    scheme = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*)://", text)
    if scheme:
        raise ImageError(
            f"{what}: {scheme.group(1)}:// URLs are not fetched (images are never downloaded); "
            "give a file path relative to the data file, a data URL or bytes"
        )
    if not text:
        raise ImageError(f"{what}: the image path is empty")
    path = Path(text).expanduser()
    if not path.is_absolute():
        if base_dir is None:
            raise ImageError(f"{what}: relative image path {text!r} needs a data file to be relative to")
        path = base_dir / path
    if not path.is_file():
        raise ImageError(f"{what}: image file not found: {path}")
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise ImageError(f"{what}: {path} is {size} bytes, more than {MAX_IMAGE_BYTES} (noria.data.images.MAX_IMAGE_BYTES)")
    return path.read_bytes()


def _data_url_bytes(url: str, what: str) -> bytes:
    head = _DATA_URL.match(url)
    if head is None:
        raise ImageError(f"{what}: not a valid data URL (expected data:image/<type>;base64,<data>)")
    media, params = head.group(1), head.group(2).split(";")
    if media and not media.startswith("image/"):
        raise ImageError(f"{what}: data URL of media type {media!r}, not an image")
    if "base64" not in params:
        raise ImageError(f"{what}: data URL is not base64-encoded (expected ;base64,)")
    payload = url[head.end() :]
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"{what}: data URL holds more than {MAX_IMAGE_BYTES} bytes (noria.data.images.MAX_IMAGE_BYTES)")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what}: data URL is not valid base64 ({e})") from e


def image_hash(image) -> str:
    """``sha256:<hex>`` of a decoded image's mode, size and pixels (the image's identity)."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return REF_PREFIX + digest.hexdigest()


def is_image_ref(value: Any) -> bool:
    """Whether ``value`` is an image reference ``sha256:<64 hex digits>``."""
    return isinstance(value, str) and _REF.fullmatch(value) is not None


def encode_png(image) -> bytes:
    """The PNG bytes of a Pillow image (lossless; used for images made in memory)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class ImageStore:
    """Images by content hash, each kept once (its encoded bytes); thread-safe."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, ref: object) -> bool:
        return ref in self._data

    def put(self, image, data: bytes | None = None) -> str:
        """Add a decoded image (with its encoded bytes, else PNG-encoded here); returns its reference."""
        ref = image_hash(image)
        with self._lock:
            if ref not in self._data:
                self._data[ref] = data if data is not None else encode_png(image)
        return ref

    def put_value(self, value: Any, base_dir: Path | None = None, what: str = "image") -> str:
        """``read_image`` then ``put``: the reference of a row's image value."""
        image, data = read_image(value, base_dir, what)
        return self.put(image, data)

    def encoded(self, ref: str) -> bytes:
        """The stored bytes of ``ref`` (as read, or PNG); ``KeyError`` naming it if absent."""
        try:
            return self._data[ref]
        except KeyError:
            raise KeyError(f"image {ref} is not in the image store ({len(self._data)} images)") from None

    def get(self, ref: str):
        """The decoded Pillow image of ``ref``."""
        return decode_image(self.encoded(ref), f"stored image {ref}")

    def save(self, folder: str | Path, refs: Any = None) -> int:
        """Write every image (of ``refs`` only, when given) not yet in ``folder`` as ``<hex>.<format>``;
        returns how many were written."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        present = {p.stem for p in folder.iterdir()}
        written = 0
        items = list(self._data.items()) if refs is None else [(r, self.encoded(r)) for r in dict.fromkeys(refs)]
        for ref, data in items:
            hexdigest = ref[len(REF_PREFIX) :]
            if hexdigest in present:
                continue
            fmt = _pil().open(io.BytesIO(data)).format
            tmp = folder / f".{hexdigest}.tmp"
            tmp.write_bytes(data)
            tmp.replace(folder / f"{hexdigest}.{_SUFFIX[fmt]}")
            written += 1
        return written

    def load(self, folder: str | Path) -> int:
        """Read a folder written by ``save``; each file's hash must match its name. Returns the count."""
        count = 0
        for path in sorted(Path(folder).iterdir()):
            if path.name.startswith("."):
                continue
            image, data = read_image(str(path), None, f"stored image {path}")
            ref = self.put(image, data)
            if ref != REF_PREFIX + path.stem:
                raise ImageError(f"stored image {path}: its content hashes to {ref}, not its name")
            count += 1
        return count


_DEFAULT = ImageStore()


def default_store() -> ImageStore:
    """The process's image store (data readers and tasks put images here)."""
    return _DEFAULT
