"""CUDA graphs of decode steps: one captured forward per batch bucket, replayed with new metadata.

A decode step launches several hundred small kernels (norms, RoPE, projections, the attention
kernel per layer); at rollout batch sizes their launch cost is comparable to the GPU work. A step
made only of decode chunks (one token per sequence) is therefore run from a graph:

- buckets of batch sizes (:data:`BUCKETS`, up to the engine's ``max_running_requests``); a step of
  S sequences uses the smallest bucket B >= S and pads B - S rows;
- static device buffers per bucket: token ids, positions, new K/V slots, block tables padded to
  the widest table the cache allows, context lengths; the step's values are written into them
  (one host->device copy of a pinned staging buffer) and the graph is replayed;
- padded rows write their K/V to the cache's scratch slot (``KVCache.scratch_slot``, outside every
  block) and attend over one token, so they touch nothing a request owns;
- the forward is :class:`~noria.engine.cuda.fused.FusedDecoder` when the model fits (the
  runner's ``fused``), else the model's own modules; the graph ends with the device sampler
  (``fused.sample_rows``) at per-row temperatures and uniforms written before the replay, so a
  plain sampling step (no top-k/top-p/min-p, no top logprobs) reads back 2 x S numbers and
  nothing else;
- the graph's logits ``[B, V]`` and samples ``[2, B]`` are returned as views of their first S
  rows/columns: valid until the next replay (the engine reads them before the next step);
- MoE models: the routers' top-k of every row is a graph output as well ([B, L, k], the
  ``noria.models.moe.Routing`` of the captured forward), copied to the host only for a step
  whose requests asked for routes.

``launch`` replays without waiting: the samples are copied to a pinned host buffer behind the
replay (an event marks the copy), and the next step may take its input ids from them on the device
(``feed``). The host staging buffers come in two sets per graph, used in turn, so that filling one
step never rewrites a buffer whose copy an earlier, still queued replay has not made.

Graphs hold the addresses of the weights and of the K/V pools: :meth:`DecodeGraphs.clear` after
every weight update (``ModelRunner.refresh_weights``), and a replay checks the pools' address
(released and re-allocated memory re-captures). Capture happens lazily, at a bucket's first use.
Not guaranteed: bitwise equality with the eager path (the same kernels run, but a bucket pads the
batch, and cuBLAS may choose another kernel for the padded row count).
"""

from __future__ import annotations

import torch

from noria.engine.cuda import fused
from noria.models.moe import Routing

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


class DecodeGraphs:
    """Captured decode forwards of one runner, keyed by (batch bucket, table-width bucket)."""

    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        self.kv = runner.kv
        self.device = runner.device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self._graphs: dict[tuple[int, int], dict] = {}
        self._pool = None
        self._pools_ptr = None
        self._last: dict | None = None
        from noria.engine.cuda import triton_available

        self.device_sampling = triton_available()
        """The graph ends with the Triton sampler (else the caller samples from the logits)."""

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None

    def bucket(self, n: int) -> int | None:
        """The smallest batch bucket holding n sequences (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    @staticmethod
    def width_bucket(blocks: int) -> int:
        """Block-table width of a graph: the next power of two (at least 16 blocks)."""
        return max(16, 1 << (blocks - 1).bit_length())

    def forward(self, chunks):
        """Replay the step's graph (greedy rows) and return its logits [S, V], a view of the graph's
        buffer valid until the next replay: the caller samples from them."""
        g, n = self._launch(chunks, None, None, None)
        self._last = g
        return g["logits"][:n]

    def routes(self, n: int) -> torch.Tensor:
        """MoE models: the routes [n, L, k] of the last :meth:`forward`'s rows (a device view)."""
        return self._last["routes"][:n]

    def launch(
        self, chunks, temps: list[float], uniforms: torch.Tensor, feed: torch.Tensor | None = None,
        routes: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event, torch.Tensor | None]:
        """Replay with the graph's sampler at ``temps`` and ``uniforms`` (``fused.sample_rows``), input
        ids from ``feed`` (device [S]) when the chunks are pending, and without waiting: (sampled ids on the device [S] (fp64; valid until this graph's
        next replay), pinned host copy [2, bucket] of ids and logprobs, event recorded after that
        copy). The host copy alternates between two buffers per graph: it holds this step's values
        until the graph's second replay after this one. ``routes`` (MoE models): the graph's routes
        are copied behind it too, into the 4th value (pinned host [bucket, L, k], same turns)."""
        g, n = self._launch(chunks, temps, uniforms, feed)
        host = g["host_sampled"][g["turn"]]
        host.copy_(g["sampled"], non_blocking=True)
        host_routes = None
        if routes:
            host_routes = g["host_routes"][g["turn"]]
            host_routes.copy_(g["routes"], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return g["sampled"][0, :n], host, event, host_routes

    def _launch(self, chunks, temps, uniforms, feed):
        ptr = self.kv.k_pools[0].data_ptr()
        if ptr != self._pools_ptr:
            self.clear()
            self._pools_ptr = ptr
        n = len(chunks)
        key = (self.bucket(n), self.width_bucket(max(len(c.block_table) for c in chunks)))
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        g = self._graphs[key]
        g["turn"] ^= 1
        self._fill(g, chunks, key[0], temps)
        if feed is not None:
            g["meta"][0, :n].copy_(feed)
        if uniforms is not None:
            g["uniforms"][:n].copy_(uniforms)
        g["graph"].replay()
        return g, n

    def _fill(self, g: dict, chunks, size: int, temps: list[float] | None) -> None:
        # The host buffers are pinned and contiguous, exactly the device buffers' shapes: a
        # non-blocking copy of a strided slice would go through a pageable temporary that can be
        # freed before the copy runs. Each graph has two sets and alternates (``turn``): with
        # overlapped steps, the host rewrites one set while the previous replay's copy from the
        # other may still be queued; a set's own previous copy belongs to a step already finished.
        bs = self.kv.block_size
        n = len(chunks)
        turn = g["turn"]
        host = g["host_meta"][turn].numpy()
        starts = [c.start for c in chunks]
        tables = [c.block_table for c in chunks]
        # A pending chunk's id is its ``token`` when the host has it, else ``feed`` overwrites it.
        host[0, :n] = [(c.token or 0) if c.pending else c.req.all_ids[p] for c, p in zip(chunks, starts)]
        host[1, :n] = starts
        host[2, :n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)]
        host[3, :n] = host[1, :n] + 1
        host[0:2, n:size] = 0
        host[2, n:size] = self.kv.scratch_slot
        host[3, n:size] = 1
        # A table row is rewritten only when its row holds another list or the list grew (tables
        # only grow, or are replaced by a new list): entries past a row's context length are never
        # read, and padded rows attend over one token of whatever page their row names.
        tab = g["host_tables"][turn].numpy()
        held = g["held_tables"][turn]
        for i, t in enumerate(tables):
            old = held[i]
            if old[0] is not t or old[1] != len(t):
                tab[i, : len(t)] = t
                held[i] = (t, len(t))
        g["meta"].copy_(g["host_meta"][turn], non_blocking=True)
        g["tables"].copy_(g["host_tables"][turn], non_blocking=True)
        host_temps = g["host_temps"][turn].numpy()
        host_temps[:] = 0.0
        if temps is not None:
            host_temps[:n] = temps
        g["temps"].copy_(g["host_temps"][turn], non_blocking=True)

    def _capture(self, size: int, width: int):
        from noria.engine.paged_context import DecodeMeta, PagedAttentionContext

        dev = self.device
        meta = torch.zeros(4, size, dtype=torch.long, device=dev)
        meta[2].fill_(self.kv.scratch_slot)
        meta[3].fill_(1)
        tables = torch.zeros(size, width, dtype=torch.int32, device=dev)
        host_meta = [torch.zeros(4, size, dtype=torch.long).pin_memory() for _ in range(2)]
        host_tables = [torch.zeros(size, width, dtype=torch.int32).pin_memory() for _ in range(2)]
        host_sampled = [torch.zeros(2, size, dtype=torch.float64).pin_memory() for _ in range(2)]
        ids, positions, slots = meta[0].unsqueeze(0), meta[1].unsqueeze(0), meta[2]
        lens = torch.ones(size, dtype=torch.int32, device=dev)
        rows = torch.arange(size, device=dev)
        temps = torch.zeros(size, dtype=torch.float32, device=dev)
        host_temps = [torch.zeros(size, dtype=torch.float32).pin_memory() for _ in range(2)]
        uniforms = torch.zeros(size, dtype=torch.float32, device=dev)
        sampled = torch.empty(2, size, dtype=torch.float64, device=dev)
        runner = self.runner
        kv = self.kv

        def attend(layer: int, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
            return runner.decode_fn(q, k_pool, v_pool, tables, lens, kv.block_size, runner.scale)

        moe = bool(runner.model.args.moe_layers)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            lens.copy_(meta[3])  # int64 -> int32 inside the graph
            # MoE: the routers' choices are a graph output too (a few bytes per row; read back only
            # when a request asks for them).
            routing = Routing() if moe else None
            if runner.fused is not None:
                hidden = runner.fused.hidden_states(meta[0], meta[1], slots, kv, attend, routing)
            else:
                ctx = PagedAttentionContext(
                    kv, positions, slots, DecodeMeta(rows, tables, lens, None), [], runner.decode_fn, runner.scale
                )
                hidden = runner.model.hidden_states(ids, positions, attn=ctx, routing=routing)[0]
            logits = runner.model.lm_head(hidden)
            if self.device_sampling:
                fused.sample_rows(logits, temps, uniforms, sampled)
            return logits, (routing.routes()[0] if moe else None)

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels, settle the allocator
                run()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: weight staging on a caller thread may use the GPU during a capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, routes = run()
        host_routes = [torch.zeros(routes.shape, dtype=routes.dtype).pin_memory() for _ in range(2)] if moe else None
        # Every tensor the graph reads or writes stays referenced here: memory freed after capture
        # would be handed to other tensors while replays still use its address.
        return {"graph": graph, "meta": meta, "tables": tables, "lens": lens, "rows": rows, "temps": temps,
                "host_temps": host_temps, "uniforms": uniforms, "sampled": sampled,
                "host_meta": host_meta, "host_tables": host_tables, "host_sampled": host_sampled,
                "held_tables": [[(None, 0)] * size for _ in range(2)], "turn": 0, "logits": logits,
                "routes": routes, "host_routes": host_routes}
