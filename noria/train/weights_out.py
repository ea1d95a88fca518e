"""Weights out of a distributed trainer: the sync buckets that only rank 0 gets and the HF folder
that only rank 0 writes. Shared by the PyTorch backend (``noria.train.fsdp``) and the Megatron
backend (``noria.train.megatron.backend``), which differ only in how a full tensor is gathered.

Each backend gives its full tensors as a lazy iterator whose every item is a collective (FSDP2: an
all-gather per tensor; Megatron: the tensor- and expert-parallel parts), and says whether this rank
is the writer (FSDP2: rank 0; Megatron: global rank 0, since every tensor-parallel rank is rank 0
of its data-parallel group). Every rank runs the iterator to the end in the same order; the writer
keeps what it yields::

    rank0_buckets(tensors, bucket_bytes, writer)   # writer: buckets of (HF name, tensor); others: nothing
    export_hf(folder, state, materialize, ...)     # writer: save_model(materialize(state)); all: barrier

What blocks on what: every rank's ``export_hf`` returns once the writer has written (the barrier).
Not guaranteed: progress when a rank stops reading the tensors early (the others wait in a
collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from noria.models import DecoderLM, save_model
from noria.models.checkpoint import bucketize

Named = Iterable[tuple[str, torch.Tensor]]


def rank0_buckets(tensors: Named, bucket_bytes: int, writer: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of about ``bucket_bytes`` of ``tensors`` on the writer; nothing on the other ranks,
    which still run ``tensors`` to the end (the gathers are collective)."""
    if not writer:
        for _ in tensors:
            pass
        return
    yield from bucketize(tensors, bucket_bytes)


def export_hf(
    folder: str | Path, state: dict[str, torch.Tensor], materialize: Callable[[dict[str, torch.Tensor]], nn.Module],
    source: str | Path, writer: bool, distributed: bool, then: Callable[[Path], None] | None = None,
) -> Path:
    """The writer saves ``materialize(state)`` as an HF folder with ``source``'s tokenizer files, then
    runs ``then(folder)``; every rank waits for it (a barrier when ``distributed``)."""
    if writer:
        save_model(materialize(state), folder, source=source)
        if then is not None:
            then(Path(folder))
    if distributed:
        dist.barrier()
    return Path(folder)


def decoder_holding(state: dict[str, torch.Tensor], args, hf_config, dtype: torch.dtype) -> DecoderLM:
    """An unsharded CPU ``DecoderLM`` in ``dtype`` holding ``state`` (built on the meta device, so no
    second copy of the weights is allocated), for ``save_model``; the family's own class (a
    vision-language model keeps its vision tower and connector)."""
    from noria.models.checkpoint import native_class

    with torch.device("meta"):
        model = native_class(dict(hf_config or {}))(args, hf_config=hf_config).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model
