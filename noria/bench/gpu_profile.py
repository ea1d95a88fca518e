"""``noria bench gpu-profile``: where a decode step's time goes on the GPU.

1. The Triton paged decode kernel alone (Qwen3 shapes: 16 query heads, 8 KV heads of 128, pages of
   16), for S sequences of ``context`` tokens: its time against the time of reading the same K/V
   bytes at the copy bandwidth measured in the run, for a sweep of tile sizes and launch settings.
2. One engine decode step of a Qwen3-size model at batch S: the graph replay's GPU time (CUDA
   events), and on the host: filling the graph's inputs, launching it, waiting for and reading
   the sampled ids, the scheduler's processing of the results and its next schedule, and the
   whole step as the engine loop sees it, averaged over the decode steps of one batch; with the
   fused decoder (``noria.engine.cuda.fused``) and, for comparison, with the model's own modules.
   The engine runs with ``engine.overlap: off`` here, so that the host's share shows in series
   (with the overlap it runs while the GPU works on the next step).
"""

from __future__ import annotations

import itertools
import time

import torch

from noria.bench import print_table, write_json
from noria.bench.gpu_common import copy_bandwidth, cuda_median_s, device_name, random_model


def add_arguments(parser) -> None:
    """``noria bench gpu-profile``'s arguments."""
    parser.description = "CUDA: decode kernel vs bandwidth (tile sweep) and one decode step's breakdown."
    parser.add_argument("--batches", default="64,256", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=768, help="tokens already in each request's KV cache")
    parser.add_argument("--model", default="qwen3-0.6b", help="random-init Qwen3 size: qwen3-0.6b, qwen3-1.7b")
    parser.add_argument("--no-sweep", action="store_true", help="skip the attention kernel's tile sweep")
    parser.add_argument("--no-unfused", action="store_true", help="skip the steps without the fused decoder")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run([int(b) for b in args.batches.split(",") if b], args.context, args.model, args.json,
        sweep=not args.no_sweep, unfused=not args.no_unfused)
    return 0


def run(batches=(64, 256), context: int = 768, model: str = "qwen3-0.6b", json_path: str | None = None,
        sweep: bool = True, unfused: bool = True) -> list[dict]:
    bandwidth = copy_bandwidth()
    rows = _kernel_sweep(batches, context, bandwidth) if sweep else []
    rows += _step_breakdown(model, batches, context)
    if unfused:  # the same steps with the model's own modules in the graph (no fused kernels)
        rows += _step_breakdown(model, batches, context, fused=False)
    print_table(f"decode profile on {device_name()} (copy bandwidth {bandwidth / 1e9:.0f} GB/s)",
                ["case", "metric", "value"], [[r["case"], r["metric"], r["noria"]] for r in rows])
    if json_path:
        write_json(json_path, "gpu-profile", rows)
    return rows


def _kernel_sweep(batches, context: int, bandwidth: float) -> list[dict]:
    from noria.engine.cuda import paged_attention as pa

    rows = []
    hq, hkv, d, page = 16, 8, 128, 16
    for s in batches:
        blocks = s * (context // page) + 1
        k = torch.randn(blocks * page, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.randperm(blocks - 1, device="cuda")[: s * (context // page)].view(s, -1).int()
        lens = torch.full((s,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(s, hq, d, device="cuda", dtype=torch.bfloat16)
        floor = s * context * hkv * d * 2 * 2 / (bandwidth / 2)  # K and V read once (copy BW counts read+write)
        default = (pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES)
        best = None
        for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
            pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES = block_n, warps, stages
            try:
                t = cuda_median_s(lambda: pa.paged_decode_attention(q, k, v, tables, lens, page, 0.088), reps=10)
            except Exception as e:  # a setting that does not compile (shared memory) is skipped
                print(f"skip {block_n, warps, stages}: {type(e).__name__}")
                continue
            rows.append({"case": f"kernel S={s} ctx={context} BLOCK_N={block_n} warps={warps} stages={stages}",
                         "metric": "floor_over_time", "noria": round(floor / t, 3), "peers": {}, "bound": 1.0,
                         "us": round(t * 1e6, 1)})
            if best is None or t < best[0]:
                best = (t, block_n, warps, stages)
        pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES = default
        t = cuda_median_s(lambda: pa.paged_decode_attention(q, k, v, tables, lens, page, 0.088), reps=10)
        rows.append({"case": f"kernel S={s} ctx={context} default {default}", "metric": "floor_over_time",
                     "noria": round(floor / t, 3), "peers": {}, "bound": 1.0, "us": round(t * 1e6, 1),
                     "best": {"us": round(best[0] * 1e6, 1), "setting": best[1:]}})
        print(rows[-1], flush=True)
        del k, v
    return rows


def _step_breakdown(model: str, batches, context: int, fused: bool = True) -> list[dict]:
    from noria.bench.gpu_engine import bench_engine, random_prompts, timed_generate

    lm = random_model(model)
    rows = []
    prompt = context - 64
    for s in batches:
        engine = bench_engine(lm, s, context, overlap="off")  # each step's host work in series, to be timed
        if not fused:
            engine.runner.fused = None
        graphs = engine.runner.graphs
        stats: dict[str, list[float]] = {k: [] for k in ("fill", "launch", "sampled", "step", "process", "schedule")}
        decode = {"now": False, "t0": 0.0}

        def timed(obj, attr: str, key: str, only_decode: bool = True):
            orig = getattr(obj, attr)

            def wrapper(*a, **k):
                t = time.perf_counter()
                out = orig(*a, **k)
                if decode["now"] or not only_decode:
                    stats[key].append(time.perf_counter() - t)
                return out

            setattr(obj, attr, wrapper)

        orig_launch, orig_finish = engine._launch, engine._finish

        def launch(chunks, feed=None):
            decode["now"] = all(c.n == 1 for c in chunks)
            decode["t0"] = time.perf_counter()
            return orig_launch(chunks, feed)

        def finish(step):
            if decode["now"]:
                step.result()  # the wait for the device and the read-back
                stats["sampled"].append(time.perf_counter() - decode["t0"])
            orig_finish(step)
            if decode["now"]:
                stats["step"].append(time.perf_counter() - decode["t0"])

        timed(graphs, "_fill", "fill")
        timed(graphs, "_launch", "launch")
        timed(engine.scheduler, "process", "process")
        engine._launch, engine._finish = launch, finish
        prompts = random_prompts(lm.args.vocab_size, s, prompt)
        try:
            timed_generate(engine, prompts, 8)
            for v in stats.values():
                v.clear()
            timed(engine.scheduler, "schedule", "schedule", only_decode=False)
            start = time.perf_counter()
            timed_generate(engine, prompts, 64)
            total = time.perf_counter() - start
            g = next(v for k, v in graphs._graphs.items() if k[0] == graphs.bucket(s))
            replay = cuda_median_s(g["graph"].replay, reps=20)
        finally:
            engine.shutdown(drain_timeout_s=1.0)
        steps = len(stats["step"])
        mean = {k: sum(v) / max(1, len(v)) for k, v in stats.items()}
        loop = total / 64  # every step of the batch, prefill included, per new token
        figures = (
            ("graph_replay_ms", replay * 1e3),
            ("fill_ms", mean["fill"] * 1e3),
            ("launch_ms", (mean["launch"] - mean["fill"]) * 1e3),
            ("wait_and_read_ms", (mean["sampled"] - mean["launch"]) * 1e3),
            ("process_ms", mean["process"] * 1e3),
            ("schedule_ms", mean["schedule"] * 1e3),
            ("decode_step_ms", mean["step"] * 1e3),
            ("loop_ms_per_token", loop * 1e3),
        )
        tag = "fused" if engine.runner.fused is not None else "unfused"
        for metric, value in figures:
            rows.append({"case": f"{model} {tag} step S={s} ctx~{context} ({steps} decode steps)", "metric": metric,
                         "noria": round(value, 3), "peers": {}, "bound": None})
        print(rows[-len(figures):], flush=True)
    return rows
