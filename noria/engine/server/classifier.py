"""A sequence-classification model (a scalar reward model) scored in batches: what ``noria serve``
runs for such a folder, and what a run loads in its own process for a trainer-side reward model.

What this module owns: ``is_sequence_classifier`` (a folder whose ``config.json`` names a
``*ForSequenceClassification`` architecture) and ``SequenceClassifier`` (transformers'
``AutoModelForSequenceClassification`` of that folder, frozen, weight version 0): ``classify`` takes
rows of token ids and answers each row's logits (one logit for a Bradley-Terry reward model).

How it batches: one daemon thread loads the model and runs the forwards. It takes the oldest waiting row, then every
other row already waiting (at most ``max_batch``), right-pads them with the model's pad id and runs
one forward; rows that arrive meanwhile wait for the next one. So concurrent callers share forwards
without a fixed waiting window. Results reach each caller's own event loop (any loop, any thread).

Failure: a forward that raises fails every row of its batch with that error (the caller sees it);
the thread keeps serving. Not guaranteed: rows longer than the model's context are refused by the
caller's checks, not truncated here; generation, weight updates and the KV cache do not exist for
such a model (the server answers 400 on ``/generate``).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from noria.engine.protocol import RequestError

MAX_BATCH = 64
"""Rows one forward takes at most."""


def is_sequence_classifier(folder: str | Path) -> bool:
    """Whether the HF folder holds a sequence-classification model (its config's architectures)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    archs = json.loads(path.read_text()).get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


class SequenceClassifier:
    """A frozen ``AutoModelForSequenceClassification`` scoring rows of token ids in batches."""

    def __init__(self, load: Callable[[], tuple[Any, Any]], max_batch: int = MAX_BATCH) -> None:
        """``load`` returns (model, tokenizer); it runs on the forward thread, which then runs every
        forward: one thread of the process does torch work, so no idle OpenMP team of another
        thread (a loader's) adds workers beyond the cores (libgomp then stops spinning between ops;
        see ``noria.openmp``). On a busy 2-core machine a forward of the tiny model took
        about 0.5 s on torch's 2 threads and 5 ms with ``OMP_NUM_THREADS=1``: small reward models
        want one thread there."""
        self.max_batch = max_batch
        self.weight_version = 0
        self.forwards = 0
        """Forward passes run so far (``/metrics``: rows / forwards is the batching)."""
        self.rows = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(load,), name="noria-classifier", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _setup(self, model: Any, tokenizer: Any) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        pad = getattr(model.config, "pad_token_id", None)
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the sequence classifier has no pad_token_id (config.json or tokenizer): its last token cannot be found")
        model.config.pad_token_id = pad  # transformers pools at the last token that is not the pad id
        self.pad_id = int(pad)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.vocab_size = int(model.config.vocab_size)
        self.num_labels = int(model.config.num_labels)
        self.device = next(model.parameters()).device

    @classmethod
    def from_path(cls, path: str | Path, dtype: str = "auto", device: str = "cpu") -> SequenceClassifier:
        """Load the folder (``dtype`` ``auto``: this machine's, as the engine's) and its tokenizer."""

        def load() -> tuple[Any, Any]:
            import torch
            from transformers import AutoModelForSequenceClassification

            from noria import hardware
            from noria.models import try_tokenizer

            resolved = hardware.resolve_dtype(dtype, device)
            model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=getattr(torch, resolved)).to(device)
            return model, try_tokenizer(str(path))

        return cls(load)

    # ------------------------------------------------------------------------------ scoring

    async def classify(self, rows: list[list[int]]) -> list[list[float]]:
        """Each row's logits (``num_labels`` floats), the rows batched with other callers' rows."""
        loop = asyncio.get_running_loop()
        futures = []
        for i, ids in enumerate(rows):
            if not ids:
                raise RequestError(f"input_ids[{i}] is empty: a row needs at least one token")
            if self.max_context is not None and len(ids) > self.max_context:
                raise RequestError(f"input_ids[{i}] has {len(ids)} tokens, more than the model's context of {self.max_context}")
            future = loop.create_future()
            self._queue.put((ids, loop, future))
            futures.append(future)
        return list(await asyncio.gather(*futures))

    def forward(self, rows: list[list[int]]) -> list[list[float]]:
        """One forward of right-padded ``rows``: their logits in float32, on the host."""
        import torch

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits.float().cpu().tolist()

    def _serve(self, load: Callable[[], tuple[Any, Any]]) -> None:
        try:
            self._setup(*load())
        except BaseException as e:  # noqa: BLE001 -- raised by the constructor, on its thread
            self._error = e
            return
        finally:
            self._ready.set()
        while True:
            batch = [self._queue.get()]
            if batch[0] is None:
                return
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                results: list[Any] = self.forward([ids for ids, _, _ in batch])
                self.forwards += 1
                self.rows += len(batch)
                outcomes = [(True, r) for r in results]
            except Exception as e:  # noqa: BLE001 -- handed to every caller of the batch
                outcomes = [(False, e)] * len(batch)
            for (_, loop, future), outcome in zip(batch, outcomes):
                _deliver(loop, future, outcome)

    # -------------------------------------------------------------- what the server asks of an engine

    async def generate(self, req: Any) -> Any:
        raise RequestError("this server serves a sequence-classification model: score with POST /classify, not generation")

    def stream(self, req: Any) -> Any:
        raise RequestError("this server serves a sequence-classification model: score with POST /classify, not generation")

    def abort(self, rid: str) -> None:
        return None

    def get_load(self) -> dict[str, Any]:
        return {"num_waiting_reqs": self._queue.qsize()}

    def metrics(self) -> dict[str, Any]:
        return {"classify_forwards": self.forwards, "classify_rows": self.rows}

    def shutdown(self, timeout: float = 0.0) -> None:
        self._queue.put(None)


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future, outcome: tuple[bool, Any]) -> None:
    def settle() -> None:
        if future.done():  # the caller went away
            return
        ok, value = outcome
        future.set_result(value) if ok else future.set_exception(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop has closed
        pass
