"""The engine's CUDA path: a Triton kernel for paged decode attention and CUDA graphs of decode steps.

Nothing here is imported on the CPU path, and nothing here imports Triton at module load: the
runner asks :func:`triton_available` first, so CPU CI (no Triton, no GPU) never touches it.

- :mod:`~noria.engine.cuda.paged_attention`: ``paged_decode_attention`` with the signature of
  ``attention_ref.paged_decode_attention``; one Triton program per (sequence, KV head) streams the
  sequence's pages once and serves every query head of the GQA group with an online softmax.
- :mod:`~noria.engine.cuda.graphs`: :class:`DecodeGraphs`, one captured decode forward per batch
  bucket; a step of only decode chunks fills static input buffers and replays.

Not guaranteed: batch invariance (the kernel's reduction order depends on the context length only,
but cuBLAS picks GEMM kernels by row count); deterministic mode does not use this path (its CUDA
kernels are ``noria.models.exact_cuda``'s). :func:`triton_available` is the one check both use.
"""

from __future__ import annotations

from noria.models.exact_cuda import available as triton_available

__all__ = ["triton_available"]
