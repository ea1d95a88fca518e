"""A vision-language policy's images in the trainer: each sample's images (``Sample.images``, content
hash references into the run's image store, ``noria.data.images``) as the pixel values the model
takes, computed by the model folder's processor exactly as the engine computed them for the rollout
(``noria.data.vision_chat.stored_pixels``), so rollout and trainer see the same inputs.

What this module owns: ``SamplePixels``, called by the RL step for each packed slice of samples.
An image the process has not read (a trainer rank in its own process, a resumed run) is looked up
in the run folder's ``images/`` (every image the job read, written once at its start). Pixel values
are kept per image (``CACHE_IMAGES`` at most), since a group's samples share their prompt's images.

Failure: samples with images and a model folder without an image processor, or an image found
neither in the store nor in the run folder, raise ``NoriaError`` naming the image or the folder.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from noria.errors import NoriaError

CACHE_IMAGES = 4096
"""Images whose pixel values are kept between steps."""


class SamplePixels:
    """Per-sample pixel values (``[n, 3, S, S]`` or None) of a batch of samples."""

    def __init__(self, model_folder: str | Path, images_folder: str | Path | None = None) -> None:
        self.model_folder = Path(model_folder)
        self.images_folder = None if images_folder is None else Path(images_folder)
        self._processor: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()

    def __call__(self, samples: Sequence[Any]) -> list | None:
        """The samples' pixel values in their order (None for a sample without images); None when no
        sample has images (a text batch packs as before)."""
        if not any(getattr(s, "images", None) for s in samples):
            return None
        import torch

        return [torch.stack([self._pixels(ref) for ref in s.images]) if s.images else None for s in samples]

    def _pixels(self, ref: str) -> Any:
        if ref in self._cache:
            self._cache.move_to_end(ref)
            return self._cache[ref]
        from noria.data.vision_chat import stored_pixels

        self._find(ref)
        pixels = stored_pixels(self.processor(), [ref])[0]
        self._cache[ref] = pixels
        if len(self._cache) > CACHE_IMAGES:
            self._cache.popitem(last=False)
        return pixels

    def _find(self, ref: str) -> None:
        from noria.data.images import default_store

        store = default_store()
        if ref in store:
            return
        if self.images_folder is not None and self.images_folder.is_dir():
            store.load(self.images_folder)
        if ref not in store:
            where = f" nor in {self.images_folder}" if self.images_folder is not None else ""
            raise NoriaError(f"a sample's image {ref} is neither in this process's image store{where}")

    def processor(self) -> Any:
        if self._processor is None:
            from noria.data.vision_chat import is_processor, load_processor

            self._processor = load_processor(self.model_folder)
            if self._processor is None or not is_processor(self._processor):
                raise NoriaError(f"samples carry images but the model folder {self.model_folder} has no image processor")
        return self._processor
