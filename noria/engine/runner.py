"""The model runner: one scheduled step -> one forward of the native model -> logits to sample.

All new tokens of all chunks are flattened into one row ``[1, N]`` with their positions. The model
runs with a :class:`PagedAttentionContext`, which in every layer (1) writes the new K/V into the
pools at their slots and (2) attends:

- chunks of one token (decode) together, through ``paged_decode_attention`` over the block tables
  (the C++ kernel of ``noria.engine.kernels`` or the torch reference in ``attention_ref``);
- longer chunks (prefill, possibly after a cached prefix) one sequence at a time: gather that
  sequence's slots and run SDPA with a bottom-right-aligned causal mask; except on CPU with the C++
  kernel, where every token of the step is a query of the paged kernel (a prefill token at
  position p over its sequence's first p + 1 slots: causal attention, one call per layer, and a
  token's attention does not depend on how its prompt was chunked).

Only the last position of each sampling chunk goes through ``lm_head``. On CPU in bf16 (outside
deterministic mode) the layers run through ``inference.FastDecoder`` (fused, prepacked matmuls,
same numerics); ``refresh_weights`` must follow every weight update (it drops the packed copies at
once and makes new ones on a background thread; the model's own modules serve meanwhile).

This is the only engine module with device code (with ``sampling``): metadata is built on the
host and moved once per step; nothing here reads device values back (deterministic mode aside:
``exact_attention`` reads a step's smallest position). Blocking: the forward itself (torch
releases the GIL).

On CUDA (``noria.engine.cuda``): decode attention is the Triton paged kernel when Triton imports
(``attention: auto``), and a step made only of decode chunks replays a captured CUDA graph of
the whole forward (``DecodeGraphs``; outside deterministic mode). Prefill chunks run eagerly,
through SDPA per sequence.

LoRA adapters (``noria.engine.lora``): a step with a row on an adapter sets the row -> adapter
mapping (``LoraRegistry.begin``) around its forward; the targeted layers add each row's delta,
through the model's modules or the fast decoder's packed layers (``lora_ops.LoraPackedLayer``).
Such a step never replays a CUDA graph (it runs eagerly; steps of base rows alone still do): the
graphs capture the base forward only.

``engine.quantization: fp8``: the model's decoder-block linears carry FP8 copies of their weights
(``noria.engine.fp8``; re-made by ``refresh_weights``) and every path (eager, graphs, the fused
decoder) multiplies with them; the CPU packed path is off.

``engine.quantization: int8 | int4`` (CPU): the fast decoder runs the integer layers of
``noria.engine.quant`` for every step, and ``refresh_weights`` re-quantizes them in place before
the commit returns (``FastDecoder.requantize``), so the model's own modules never serve. In
deterministic mode the integer layers do not run: each decoder-block linear computes with its
weight quantized and dequantized by the same recipe (``quant.FakeQuant``, re-made when the weight
changes) on the exact path, which is what a trainer with ``train.qat`` computes too.

Deterministic mode: the model runs its own modules in exact numerics
(``DecoderLM.set_exact_numerics``, switched on for the engine's model here: linear layers as 2-D
matmuls of at most ``DETERMINISTIC_ROWS`` rows), and all attention (decode and prefill) goes
through ``noria.models.attention.exact_attention``, whose result for a token depends only on that
token's query and its prefix. Each token then gets the same bits whatever shares its step or
however its prompt was chunked, and the same bits as the trainer's deterministic forward
(``FSDPBackend(deterministic=True)``), which runs the same arithmetic over whole sequences.
On CUDA the exact numerics run the fixed-order Triton kernels of ``noria.models.exact_cuda``
(measured batch-invariant on an H200, tests/engine/test_exact_cuda.py). Not guaranteed: batch invariance
outside deterministic mode, or in deterministic mode in another dtype than bf16, or on a device
that is neither the CPU nor CUDA with Triton.
"""

from __future__ import annotations


from collections.abc import Callable

import torch

from noria.engine import attention_ref, fp8, inference, kernels, quant, vision
from noria.engine.kv_cache import KVCache
from noria.engine.lora_ops import LoraPackedLayer
from noria.engine.paged_context import DecodeFn, DecodeMeta, PagedAttentionContext, PrefillMeta
from noria.engine.scheduler import Chunk
from noria.models.attention import attention_scale
from noria.models.decoder import DecoderLM
from noria.models.moe import Routing, graph_capturable

def pick_decode_fn(attention: str, device: torch.device) -> DecodeFn:
    """``torch``: the reference; ``auto``: the C++ kernel on CPU when it builds, the Triton kernel
    on CUDA when Triton imports; ``cpu_kernel``: the C++ kernel or fail."""
    if attention == "auto" and device.type == "cuda":
        from noria.engine import cuda

        if cuda.triton_available():
            from noria.engine.cuda import paged_attention

            return paged_attention.paged_decode_attention
    if attention == "torch" or device.type != "cpu":
        return attention_ref.paged_decode_attention
    try:
        from noria.engine import kernels
    except ImportError:
        if attention == "cpu_kernel":
            raise
        return attention_ref.paged_decode_attention
    if attention == "cpu_kernel" and kernels.cpu_kernel() is None:
        raise RuntimeError(f"engine.attention=cpu_kernel but the kernel did not build: {kernels.cpu_kernel_failure()}")
    return kernels.paged_decode_attention


class LaunchedStep:
    """A decode step replayed from a CUDA graph and not waited for (``ModelRunner.launch_sampled``)."""

    def __init__(
        self, ids: torch.Tensor, host: torch.Tensor, event: torch.cuda.Event, n: int, routes: torch.Tensor | None = None
    ) -> None:
        self.ids = ids
        """Device [S]: the sampled ids (fp64), for the next step's ``feed``; valid until the graph
        replays again."""
        self._host, self._event, self._n = host, event, n
        self._routes = routes  # pinned host [bucket, L, k], written behind the replay
        self._result: tuple[list[int], list[float]] | None = None

    def routes(self) -> torch.Tensor | None:
        """Host [S, L, k] routes when the launch copied them (a copy of its own). Blocking like
        :meth:`result`."""
        if self._routes is None:
            return None
        self._event.synchronize()
        return self._routes[: self._n].clone()

    def result(self) -> tuple[list[int], list[float]]:
        """(ids, logprobs) of every row. Blocking: until the step and its device->host copy end."""
        if self._result is None:
            self._event.synchronize()
            values = self._host[:, : self._n]
            self._result = values[0].long().tolist(), values[1].tolist()
        return self._result


class ModelRunner:
    """Runs the native model over a step's chunks and returns the sampling rows' logits."""

    lora = None
    """The engine's ``noria.engine.lora.LoraRegistry`` (set by the engine), or None."""

    def __init__(
        self,
        model: DecoderLM,
        kv: KVCache,
        device: torch.device,
        attention: str = "auto",
        deterministic: bool = False,
        max_batch: int = 256,
        cuda_graphs: bool = True,
        max_positions: int | None = None,
        quantization: str = "none",
    ) -> None:
        if not isinstance(model, DecoderLM):
            raise TypeError(f"the engine runs the native DecoderLM, got {type(model).__name__}")
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.deterministic = deterministic
        self.images = vision.ImageEmbedder(model) if getattr(model, "vision", None) is not None else None
        """A vision-language model's image path: prefill steps splice image embeddings (``noria.engine.vision``)."""
        self.decode_fn = pick_decode_fn(attention, self.device)
        self.on_hidden: Callable[[list[Chunk], torch.Tensor], None] | None = None
        """Called after an eager forward with the final states of the rows it read logits from
        (sampling rows, then extra rows): the mlp drafter's input (``noria.engine.speculative``)."""
        self.scale = attention_scale(model.args.head_dim)
        self.fp8 = quantization == "fp8"
        """FP8 rollout weights (``noria.engine.fp8``), re-made by :meth:`refresh_weights`."""
        if self.fp8:
            if deterministic:
                raise ValueError("engine.quantization=fp8 cannot be combined with engine.deterministic")
            fp8.quantize_model(model)
        elif quantization in quant.MODES:
            reason = quant.supported(model, quantization)
            if reason is not None:
                raise ValueError(f"engine.quantization={quantization}: {reason}")
            if quantization == "int4":
                quant.warn_if_on_int4_grid(model)
            if deterministic:  # the exact path on the dequantized weights: a trainer with train.qat computes the same
                quant.set_fake_quant(model, quantization, next(model.parameters()).dtype)
        elif quantization != "none":
            raise ValueError(f"engine.quantization must be none, fp8, int8 or int4, got {quantization!r}")
        self.quantized = quantization in quant.MODES and not deterministic
        """Integer weights (``noria.engine.quant``) in the fast decoder, re-quantized by :meth:`refresh_weights`."""
        # Deterministic mode runs exactly the trainer's modules; elsewhere packed (or integer) weights
        # on CPU (not with FP8: the model's layers then carry the FP8 matmuls).
        use_fast = not deterministic and not self.fp8 and (self.quantized or inference.supported(model))
        self.fast = inference.FastDecoder(model, quantization=quantization) if use_fast else None
        self.kernel_prefill = (
            self.device.type == "cpu" and not deterministic and self.decode_fn is kernels.paged_decode_attention
            and kernels.fused_kernels_enabled() and kernels.cpu_kernel() is not None
        )
        """CPU: prefill tokens attend through the C++ paged kernel too (see :meth:`_all_rows_meta`)."""
        if deterministic:
            model.set_exact_numerics(next(model.parameters()).dtype)
        self.graphs = None
        self.fused = None
        """CUDA: the fused decode forward the graphs capture (``noria.engine.cuda.fused``), or None."""
        # MoE: only the grouped expert path (bf16) runs without host synchronisation inside a graph.
        if self.device.type == "cuda" and not deterministic and cuda_graphs and graph_capturable(model):
            from noria.engine.cuda import triton_available
            from noria.engine.cuda.fused import FusedDecoder
            from noria.engine.cuda.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_batch)
            if triton_available() and FusedDecoder.supported(model):
                self.fused = FusedDecoder(model, max_positions or model.args.max_position_embeddings)

    def refresh_weights(self) -> None:
        """Rebuild the engine-only weight copies from the model (call after every weight update)."""
        if self.fast is not None and self.quantized:
            self.fast.requantize()  # in place, before the commit returns: never the unquantized modules
        elif self.fast is not None:
            self.fast.refresh_later()  # the model's modules serve until the new packs are in
        if self.fp8:
            fp8.quantize_model(self.model)
        if self.graphs is not None:  # captured graphs hold the old parameters' addresses
            self.graphs.clear()
        if self.images is not None:
            self.images.clear()

    def _graph_step(self, chunks: list[Chunk]) -> bool:
        return (self.graphs is not None and all(c.n == 1 and c.sample and c.req.lora is None for c in chunks)
                and self.graphs.bucket(len(chunks)) is not None and not (self.images and self.images.touches(chunks)))

    def samples_in_graph(self, chunks: list[Chunk]) -> bool:
        """Whether :meth:`launch_sampled` runs this step (a decode step from a graph that samples)."""
        return self._graph_step(chunks) and self.graphs.device_sampling

    @torch.no_grad()
    def launch_sampled(
        self, chunks: list[Chunk], temps: list[float], uniforms: torch.Tensor, feed: torch.Tensor | None = None,
        routes: bool = False,
    ) -> LaunchedStep:
        """A decode step sampled inside its CUDA graph (plain temperature or greedy rows: see
        ``sampling.device_sampleable``; only when :meth:`samples_in_graph`), queued on the device
        without waiting: every chunk's token id and logprob come back by ``result()`` (one
        device->host read of 2 x S numbers). ``feed`` (device [S]): the chunks' input ids, when they
        are pending (the samples of the step launched just before, see ``Scheduler.follow``).
        ``routes``: also copy the step's MoE routes to the host (``LaunchedStep.routes``)."""
        ids, host, event, host_routes = self.graphs.launch(chunks, temps, uniforms, feed, routes)
        return LaunchedStep(ids, host, event, len(chunks), host_routes)

    @torch.no_grad()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [number of sampling chunks, V] in the model's dtype, in chunk order (the sampler
        works in fp32 and widens on the fly: no fp32 copy of the logits)."""
        return self._forward(chunks, None)

    @torch.no_grad()
    def forward_routed(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, and the routes of the sampling rows (MoE models): [S, L, k] on the host,
        row i the experts of the position that gives sampling chunk i its logits."""
        if self._graph_step(chunks):
            logits = self.graphs.forward(chunks)
            return logits, self.graphs.routes(len(chunks)).cpu()
        routing = Routing()
        logits = self._forward(chunks, routing)
        rows = self._to_device(self._last_rows(chunks), torch.long)
        return logits, routing.routes()[0].index_select(0, rows).cpu()

    @torch.no_grad()
    def forward_scoring(self, chunks: list[Chunk], score_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, and the logits [len(score_rows), V] of the given flattened rows (prefill
        scoring, ``noria.engine.scoring``), from the same forward and the same LM head."""
        n = sum(c.sample for c in chunks)
        logits = self._forward(chunks, None, score_rows)
        return logits[:n], logits[n:]

    def _forward(self, chunks: list[Chunk], routing: Routing | None, extra_rows: list[int] = ()) -> torch.Tensor:
        if self._graph_step(chunks) and not extra_rows:
            return self.graphs.forward(chunks)
        adapters = self.lora is not None and any(c.req.lora is not None for c in chunks)
        if not adapters:
            return self._eager(chunks, routing, extra_rows)
        self.lora.begin([-1 if c.req.lora is None else c.req.lora.slot for c in chunks for _ in range(c.n)])
        try:
            return self._eager(chunks, routing, extra_rows, lora=True)
        finally:
            self.lora.end()

    def _eager(self, chunks: list[Chunk], routing: Routing | None, extra_rows: list[int], lora: bool = False) -> torch.Tensor:
        ids, positions, slots, ctx = self._prepare(chunks)
        rows = self._to_device(self._last_rows(chunks) + list(extra_rows), torch.long)
        embeds = self.images.embeds(chunks, ids) if self.images is not None else None  # None without image rows
        packed = self.fast.packed if self.fast is not None else None  # None while re-packing after an update
        if packed is not None:
            if lora:  # the packed layers add the adapters' deltas too
                packed = packed._replace(layers=[LoraPackedLayer(p, self.lora, i) for i, p in enumerate(packed.layers)])
            hidden = self.fast.hidden_states(ids, positions, ctx, packed, embeds)[0].index_select(0, rows)
            self._observe(chunks, hidden)
            return self.fast.lm_head(hidden, packed)
        extra = {} if embeds is None else {"inputs_embeds": embeds}
        hidden = self.model.hidden_states(ids, positions, attn=ctx, routing=routing, **extra)[0].index_select(0, rows)
        self._observe(chunks, hidden)
        return self.model.lm_head(hidden)

    def _observe(self, chunks: list[Chunk], hidden: torch.Tensor) -> None:
        if self.on_hidden is not None:
            self.on_hidden(chunks, hidden)

    @staticmethod
    def _last_rows(chunks: list[Chunk]) -> list[int]:
        """Flattened row of each sampling chunk's last token."""
        rows, end = [], 0
        for c in chunks:
            end += c.n
            if c.sample:
                rows.append(end - 1)
        return rows

    def _prepare(self, chunks: list[Chunk]):
        bs = self.kv.block_size
        ids, positions, new_slots = [], [], []
        decode_rows, decode_chunks, prefill_rows = [], [], []
        row = 0
        for c in chunks:
            pos = range(c.start, c.start + c.n)
            ids.extend(c.token_ids)
            positions.extend(pos)
            new_slots.extend(c.block_table[p // bs] * bs + p % bs for p in pos)
            if c.n == 1:
                decode_rows.append(row)
                decode_chunks.append(c)
            else:
                prefill_rows.append((row, c))
            row += c.n
        to_dev = self._to_device
        positions_t = to_dev(positions, torch.long).unsqueeze(0)
        if prefill_rows and self.kernel_prefill:
            meta, prefills = self._all_rows_meta(chunks, positions_t[0]), []
        else:
            meta = self._decode_meta(decode_rows, decode_chunks, whole=not prefill_rows)
            prefills = [PrefillMeta(r, c.n, self._context_slots(c)) for r, c in prefill_rows]
        ctx = PagedAttentionContext(
            self.kv,
            positions_t,
            to_dev(new_slots, torch.long),
            meta,
            prefills,
            self.decode_fn,
            self.scale,
            self.deterministic,
        )
        return to_dev(ids, torch.long).unsqueeze(0), positions_t, new_slots, ctx

    def _decode_meta(self, rows: list[int], chunks: list[Chunk], whole: bool = False) -> DecodeMeta | None:
        if not rows:
            return None
        width = max(len(c.block_table) for c in chunks)
        tables = self._to_device([c.block_table + [0] * (width - len(c.block_table)) for c in chunks], torch.int32)
        slots = None
        if self.deterministic:  # the slots of every table entry, cut at the longest context
            slots = attention_ref.slot_ids(tables, self.kv.block_size)[:, : max(c.start + 1 for c in chunks)]
        return DecodeMeta(
            token_idx=self._to_device(rows, torch.long),
            block_tables=tables,
            context_lens=self._to_device([c.start + 1 for c in chunks], torch.int32),
            slots=slots,
            whole=whole,
        )

    def _all_rows_meta(self, chunks: list[Chunk], positions: torch.Tensor) -> DecodeMeta:
        """Every token of the step as a query of the paged kernel: a prefill token at position p
        attends to its sequence's first p + 1 cached tokens (its own K/V are written first), which
        is causal attention; one kernel call per layer instead of a gather + SDPA per sequence."""
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int32)
        owner = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([c.n for c in chunks]))
        return DecodeMeta(
            token_idx=torch.arange(len(owner)),
            block_tables=tables.index_select(0, owner),
            context_lens=(positions + 1).to(torch.int32),
            slots=None,
            whole=True,
        )

    def _context_slots(self, c: Chunk) -> torch.Tensor:
        length = c.start + c.n
        table = self._to_device(c.block_table[: -(-length // self.kv.block_size)], torch.long)
        return attention_ref.slot_ids(table, self.kv.block_size)[:length]

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        # Step metadata is small; one host->device copy per tensor per step.
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
