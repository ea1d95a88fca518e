"""``noria bench sync``: seconds and GB/s of a weight push per transport, against the raw primitive.

For each model (SmolLM2-135M from the catalog; ``random-llama-1b``, a random 1.1B Llama built from
TinyLlama's config; ``random-smollm2-135m``, SmolLM2's shapes with random weights; or any model
folder), all bf16, the trainer's tensors (HF names, the tied head left out as
``FSDPBackend.state_dict_for_sync`` does) are pushed as a new version in buckets of ``bucket_mb``,
through ``noria.sync`` exactly as training does, to:

==================== ============================================ ======================================
case                 engine                                       primitive (same bytes, same machine)
==================== ============================================ ======================================
ipc in-process       ``Engine`` in this process                   memcpy: ``copy_`` into warm tensors
ipc shared-memory    ``noria serve`` subprocess: the trainer      memcpy, as above
                     writes into its staging area (a memfd)
broadcast gloo       ``noria serve`` subprocess (gloo group;      gloo broadcast of the bytes as flat
                     large tensors alone, small ones packed)      bucket buffers to a subprocess, acked
disk                 ``Engine`` in this process                   safetensors ``save_file`` + ``load_file``
disk-delta           ``Engine`` in this process, ``sync.delta``   the ``disk`` case's full push (peer)
==================== ============================================ ======================================

The ``disk_delta`` case pushes weights that change as in RL: fp32 master weights take Adam-sized
steps (every weight moves by +-``delta_lr``, the size of Adam's first updates; the main job's
learning rate, 5e-6, by default) and are sent in bf16, so only the elements whose bf16 rounding
moves change bits. One full snapshot first (the warm-up), then ``repeats`` deltas; its rows: seconds
per push (best), bytes written per push (mean) and the fraction of elements changed (mean), with
the ``disk`` case's full push as the peer (``disk``: seconds measured in the same run when that
case runs; bytes: the full snapshot of the same weights).

With ``device="cuda"`` the trainer's tensors and the engines are on the GPU: ipc in-process is a
device copy, the cross-process case goes through a CUDA IPC handle, and there is no broadcast
case (NCCL would need the engine on a second GPU).

A push is timed from the first byte to the last engine's commit (the engine answered and serves
the new version). Every figure is the best of ``repeats`` runs after one warm-up run (which
creates groups, segments, the staging area and staging buffers), push and primitive taking turns
so that a busy spell on a shared machine slows both; ``ratio`` = push seconds / primitive seconds.
``threads`` sets torch's intra-op threads here and in the server (on a small shared machine one
thread gives the steadier figures: see :func:`run`).

The engines run in deterministic mode, which skips the CPU fast path's repacking of fused weights
after an update: that repack belongs to the engine, costs the same on every transport, and is
measured on its own row (``engine repack``, not included in the pushes), and so is a quantized
engine's re-quantization of every block (``engine.quantization=int8`` / ``int4``, on CPU: it runs
inside the commit, beside the unquantized repack as its peer). Verification is off
(``sync.verify`` hashes the bytes: its cost is hashing, not transport).

Not measured: NCCL, engines on other machines.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from noria.process import Child

TRANSPORT_CASES = ("ipc", "ipc_shm", "broadcast", "disk", "disk_delta")
DELTA_LR = 5e-6
"""The main job's learning rate (examples/grpo_smollm2_arithmetic.yaml): the default step size of
the disk_delta case's updates."""
RANDOM_1B = "random-llama-1b"
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    RANDOM_1B: {  # TinyLlama-1.1B's shapes
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    "random-smollm2-135m": {  # SmolLM2-135M's shapes, for machines without the catalog model
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
}  # fmt: skip
"""Models built from a config with random weights (``--models`` names)."""
PRIMITIVES = {"ipc": "memcpy", "ipc_shm": "memcpy", "broadcast": "gloo_broadcast", "disk": "safetensors_write_read"}
SERVED = ("ipc_shm", "broadcast")
"""Cases whose engine is a ``noria serve`` subprocess."""
ENGINE = {"kv_cache_tokens": 256, "block_size": 16, "deterministic": True}


def case_name(case: str, device: str) -> str:
    cuda = device.startswith("cuda")
    return {
        "ipc": f"ipc in-process (Engine in this process, {device})",
        "ipc_shm": f"ipc {'CUDA IPC' if cuda else 'shared-memory'} (noria serve subprocess, {device})",
        "broadcast": f"broadcast {'nccl' if cuda else 'gloo'} (noria serve subprocess, {device})",
        "disk": f"disk safetensors (Engine in this process, {device})",
        "disk_delta": f"disk delta (Engine in this process, {device})",
    }[case]


def add_arguments(parser) -> None:
    """``noria bench sync``'s arguments."""
    parser.description = ("Every tensor of a bf16 model pushed as a new version through noria.sync to an engine in this "
                          "process or a noria serve subprocess; the primitive moves the same bytes (memcpy, gloo "
                          "broadcast, safetensors write+read). Best of --repeats after a warm-up.")
    parser.add_argument("--models", default="smollm2-135m-instruct,random-llama-1b",
                        help="comma-separated catalog names, model folders, random-llama-1b (random 1.1B Llama) or random-smollm2-135m")
    parser.add_argument("--transports", default="ipc,ipc_shm,broadcast,disk,disk_delta", help="comma-separated cases: ipc (an Engine in this process), ipc_shm (a noria serve subprocess through shared "
                        "memory, CUDA IPC on cuda), broadcast (gloo group to a noria serve), disk (safetensors folder), disk_delta "
                        "(disk with sync.delta: what changed since the last push)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="bucket size of the push")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per case (after one warm-up)")
    parser.add_argument("--device", default="cpu", help="where the trainer's tensors and the engines are (cpu, cuda)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads of the trainer and the engine server (default: torch's)")
    parser.add_argument("--delta-lr", type=float, default=DELTA_LR,
                        help="disk_delta: size of each weight's step between pushes (Adam-sized steps at this learning rate)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run([m for m in args.models.split(",") if m], [t for t in args.transports.split(",") if t],
        args.bucket_mb, args.repeats, args.json, device=args.device, threads=args.threads, delta_lr=args.delta_lr)
    return 0


def run(
    models: list[str] | tuple[str, ...] = ("smollm2-135m-instruct", RANDOM_1B),
    transports: list[str] | tuple[str, ...] = TRANSPORT_CASES,
    bucket_mb: int = 256,
    repeats: int = 3,
    json_path: str | None = None,
    work_dir: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    delta_lr: float = DELTA_LR,
) -> list[dict]:
    """Measure every (model, transport) case, print the table, write the JSON; returns the results.
    ``device``: where the trainer's tensors and the engines are (``cuda``: no broadcast case, which
    would need NCCL between two GPUs). ``threads``: torch's intra-op threads in this process and the
    server (default: torch's choice). On a small shared machine one thread is the steadier figure:
    a copy is memory-bound (one thread copies about as fast as two), while a two-thread copy waits
    at every tensor for whichever thread another process has preempted."""
    with _threads(threads):
        return _run(list(models), list(transports), bucket_mb, repeats, json_path, work_dir, device, delta_lr)


def _run(models: list[str], transports: list[str], bucket_mb: int, repeats: int, json_path: str | None,
         work_dir: str | None, device: str, delta_lr: float = DELTA_LR) -> list[dict]:  # fmt: skip
    from noria.bench import write_json

    unknown = set(transports) - set(TRANSPORT_CASES)
    if unknown or repeats < 1 or bucket_mb < 1 or not models:
        raise ValueError(f"bad arguments: transports {sorted(unknown)} unknown (have {TRANSPORT_CASES}), or repeats/bucket_mb < 1")
    if device != "cpu" and "broadcast" in transports:
        raise ValueError("bad arguments: the broadcast case runs on the CPU only (NCCL needs a second GPU for the engine)")
    results = []
    root = Path(tempfile.mkdtemp(prefix="noria-bench-sync-", dir=work_dir))
    try:
        for model in models:
            results += measure_model(model, transports, bucket_mb << 20, repeats, root, device, delta_lr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_results(results)
    if json_path:
        write_json(json_path, "sync", results)
    return results


# ------------------------------------------------------------------------------------------ models


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch intra-op threads here and in the servers started meanwhile (``OMP_NUM_THREADS``)."""
    if n is None:
        yield
        return
    import torch

    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def load_case_model(model: str, root: Path):
    """(DecoderLM in bf16 on the CPU, model folder, label); a random model is written to ``root``."""
    import torch

    from noria.models import load_model
    from noria.models.catalog import model_path

    if model not in RANDOM_MODELS:
        folder = model_path(model)
        return load_model(folder, dtype=torch.bfloat16), folder, Path(str(model)).name
    from noria.models.checkpoint import materialize
    from noria.models.config import ModelArgs
    from noria.models.decoder import DecoderLM
    from noria.sync.disk import write_safetensors

    config = RANDOM_MODELS[model]
    with torch.device("meta"):
        lm = DecoderLM(ModelArgs.from_hf_config(config), hf_config=config).to(torch.bfloat16)
    lm = materialize(lm, "cpu")
    lm.tie_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    folder = root / model
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", list(trainer_tensors(lm).items()))
    (folder / "config.json").write_text(json.dumps(config))
    return lm.eval(), folder, model


def trainer_tensors(lm) -> dict[str, Any]:
    """The tensors a trainer sends: every parameter once (a tied head is the embedding)."""
    seen, out = set(), {}
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach()
    return out


# ----------------------------------------------------------------------------------------- measure


def measure_model(model: str, transports: list[str], bucket_bytes: int, repeats: int, root: Path, device: str = "cpu",
                  delta_lr: float = DELTA_LR) -> list[dict]:  # fmt: skip
    import torch

    lm, folder, label = load_case_model(model, root)
    lm = lm.to(device)
    sent = {n: t.clone() for n, t in trainer_tensors(lm).items()}  # the trainer's own copy
    nbytes = sum(t.numel() * t.element_size() for t in sent.values())
    params = sum(t.numel() for t in sent.values())
    rows, server = [], None
    try:
        for case in transports:
            gc.collect()
            if case == "disk_delta":
                full_s = next((r["noria"] for r in rows if r["metric"] == "push_s" and " disk safetensors " in r["case"]), None)
                rows += measure_delta(lm, sent, bucket_bytes, repeats, root, delta_lr, full_s, f"{label} bf16 params={params / 1e6:.0f}M")
                continue
            if case in SERVED and server is None:  # one subprocess serves every cross-process case
                server = _Server(folder, device, root / f"serve-{label}.log")
            with _pusher(case, lm, server, sent, bucket_bytes, root) as push, _primitive(case, sent, bucket_bytes, repeats, root) as prim:
                push_s, prim_s = _interleaved(push, prim, repeats)
            name = (f"{label} bf16 params={params / 1e6:.0f}M bytes={nbytes / 1e6:.0f}MB bucket={bucket_bytes >> 20}MB "
                    f"{case_name(case, device)} vs {PRIMITIVES[case]}")  # fmt: skip
            rows += _row(name, nbytes, push_s, prim_s)
    finally:
        if server is not None:
            server.stop()
    repack = _repack_seconds(lm)
    if repack is not None:
        rows.append({"case": f"{label} bf16 engine repack after an update (any transport; not in the pushes)",
                     "metric": "repack_s", "noria": _sig(repack), "peers": {}, "bound": None})  # fmt: skip
        for mode, seconds in _requantize_seconds(lm, repeats).items():
            rows.append({"case": f"{label} bf16 engine.quantization={mode}: re-quantization inside the commit (best of {repeats})",
                         "metric": "repack_s", "noria": _sig(seconds), "peers": {"unquantized repack": _sig(repack)},
                         "bound": None})  # fmt: skip
    del lm, sent
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def measure_delta(lm, sent: dict, bucket_bytes: int, repeats: int, root: Path, lr: float, full_s: float | None, label: str) -> list[dict]:
    """The disk_delta case (module docstring): a full snapshot, then ``repeats`` timed deltas of
    Adam-sized steps; the update itself is made outside the timing."""
    import torch

    from noria.config import EngineConfig, SyncConfig
    from noria.engine import Engine
    from noria.sync import build_sync, bucketize

    master = {n: t.float() for n, t in sent.items()}
    gen = torch.Generator(device=next(iter(master.values())).device).manual_seed(0)

    def step() -> dict:
        for t in master.values():  # +-lr on every weight
            t.add_(torch.empty_like(t).bernoulli_(0.5, generator=gen).mul_(2 * lr).sub_(lr))
        return {n: t.to(sent[n].dtype) for n, t in master.items()}

    cfg = SyncConfig(transport="disk", delta=True, bucket_mb=max(1, bucket_bytes >> 20), disk_dir=str(root / "weights-delta"))
    engine = Engine(lm, None, EngineConfig(**ENGINE))
    sync = build_sync(cfg, [engine])
    try:
        version = engine.weight_version + 1
        full = sync.push(bucketize(step(), bucket_bytes), version)
        pushes = []
        for k in range(repeats):
            state = step()
            start = time.perf_counter()
            metrics = sync.push(bucketize(state, bucket_bytes), version + 1 + k)
            pushes.append((time.perf_counter() - start, metrics))
            del state
    finally:
        sync.close()
        engine.shutdown(1)
    name = f"{label} disk delta (Engine in this process) adam-like steps lr={lr:g} vs full disk"
    mean = lambda key: sum(m[key] for _, m in pushes) / len(pushes)  # noqa: E731
    return [
        {"case": name, "metric": "push_s", "noria": _sig(min(s for s, _ in pushes)),
         "peers": {"disk": full_s} if full_s is not None else {}, "bound": None},
        {"case": name, "metric": "bytes_written", "noria": _sig(mean("sync/bytes_written")),
         "peers": {"disk": _sig(full["sync/bytes_written"])}, "bound": None},
        {"case": name, "metric": "changed_frac", "noria": _sig(mean("sync/changed_frac")), "peers": {}, "bound": None},
    ]  # fmt: skip


def _row(name: str, nbytes: int, push_s: float, prim_s: float) -> list[dict]:
    """Two rows per case: GB/s (bound: the primitive's GB/s) and seconds (bound: the primitive's)."""
    return [
        {"case": name, "metric": "gb_per_s", "noria": _sig(nbytes / push_s / 1e9), "peers": {},
         "bound": _sig(nbytes / prim_s / 1e9)},
        {"case": name, "metric": "push_s", "noria": _sig(push_s), "peers": {}, "bound": _sig(prim_s)},
    ]  # fmt: skip


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (tiny models give microseconds)."""
    return float(f"{x:.4g}")


def _interleaved(push: Callable[[], None], primitive: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Best wall times of ``push`` and ``primitive``, run in alternation (so that a busy spell on a
    shared machine slows both) after one warm-up each (groups, segments, staging buffers, page
    faults); CUDA work is waited for."""
    import torch

    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(push), timed(primitive)
    rounds = [(timed(push), timed(primitive)) for _ in range(repeats)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


@contextlib.contextmanager
def _pusher(case: str, lm, server: _Server | None, sent: dict, bucket_bytes: int, root: Path) -> Iterator[Callable[[], None]]:
    """One push of ``sent`` as the next version to the case's engine (the in-process engine runs
    ``lm`` itself: the bench's copy of the weights is not needed meanwhile)."""
    from noria.config import EngineConfig, SyncConfig
    from noria.engine import Engine
    from noria.sync import build_sync, bucketize

    transport = "ipc" if case == "ipc_shm" else case
    cfg = SyncConfig(transport=transport, bucket_mb=max(1, bucket_bytes >> 20), disk_dir=str(root / "weights"))
    engine = None if case in SERVED else Engine(lm, None, EngineConfig(**ENGINE))
    sync = build_sync(cfg, [server.url if engine is None else engine])
    version = itertools.count(_next_version(engine, server))
    try:
        yield lambda: sync.push(bucketize(sent, bucket_bytes), next(version))
    finally:
        sync.close()
        if engine is not None:
            engine.shutdown(1)


def _next_version(engine, server: _Server | None) -> int:
    if engine is not None:
        return engine.weight_version + 1
    import httpx

    return httpx.get(f"{server.url}/get_weight_version").json()["weight_version"] + 1


class _Server:
    """``noria serve`` on a free loopback port, deterministic, small KV cache, logging to ``log_path``."""

    def __init__(self, folder: Path, device: str, log_path: Path) -> None:
        from noria.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "noria.cli", "serve", "--model", str(folder), "--port", str(self.port),
               "--engine.kv_cache_tokens", str(ENGINE["kv_cache_tokens"]), "--engine.block_size", str(ENGINE["block_size"]),
               "--engine.deterministic", "true", "--model.device", device]  # fmt: skip
        self.child = Child.start(cmd, name=f"noria serve at {self.url}", log_path=log_path, env={"TOKENIZERS_PARALLELISM": "false"})
        self.child.wait_http(f"{self.url}/health", timeout_s=300)  # stops it and raises ChildFailed (log tail) on failure

    def stop(self) -> None:
        self.child.stop(timeout_s=60)


# -------------------------------------------------------------------------------------- primitives


@contextlib.contextmanager
def _primitive(case: str, sent: dict, bucket_bytes: int, repeats: int, root: Path) -> Iterator[Callable[[], None]]:
    """The raw primitive moving the same bytes as the case's push."""
    if case in ("ipc", "ipc_shm"):
        yield _memcpy(sent)
    elif case == "broadcast":
        with _gloo_broadcast(sent, bucket_bytes, repeats) as fn:
            yield fn
    else:
        path = root / "primitive.safetensors"
        try:
            yield _safetensors_write_read(sent, path)
        finally:
            path.unlink(missing_ok=True)


def _memcpy(sent: dict) -> Callable[[], None]:
    """``copy_`` of every tensor into a tensor of its own (allocated once)."""
    import torch

    dst = {n: torch.empty_like(t) for n, t in sent.items()}

    def copy() -> None:
        with torch.no_grad():
            for n, t in sent.items():
                dst[n].copy_(t)

    return copy


def _safetensors_write_read(sent: dict, path: Path) -> Callable[[], None]:
    from safetensors.torch import load_file, save_file

    device = str(next(iter(sent.values())).device)

    def write_read() -> None:
        save_file(sent, str(path), metadata={"format": "pt"})
        load_file(str(path), device=device)

    return write_read


@contextlib.contextmanager
def _gloo_broadcast(sent: dict, bucket_bytes: int, repeats: int) -> Iterator[Callable[[], None]]:
    """Flat uint8 buffers of the buckets' sizes broadcast to a subprocess, which acks each round."""
    import torch

    from noria.engine.weight_sources import create_update_group
    from noria.net import free_port
    from noria.sync import bucketize

    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in bucketize(sent, bucket_bytes)]
    buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    port = free_port()
    job = json.dumps({"port": port, "sizes": sizes, "rounds": repeats + 1})
    receiver = Child.start([sys.executable, "-m", "noria.bench.sync", "recv", job], name="bench sync gloo receiver")
    try:
        group = create_update_group("127.0.0.1", port, 0, 2, "bench-gloo", "gloo", timeout_s=300)
        ack = torch.zeros(1)

        def round_trip() -> None:
            for buf in buffers:
                group.broadcast(buf, 0).wait()
            group.broadcast(ack, 1).wait()

        yield round_trip
    finally:
        try:
            receiver.wait(60)
        finally:
            receiver.stop()  # reaped; killed if it did not finish its rounds in time


def _receive_main(job: dict) -> None:
    import torch

    from noria.engine.weight_sources import create_update_group

    group = create_update_group("127.0.0.1", job["port"], 1, 2, "bench-gloo", "gloo", timeout_s=300)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in job["sizes"]]
    for _ in range(job["rounds"]):
        for buf in buffers:
            group.broadcast(buf, 0).wait()
        group.broadcast(torch.ones(1), 1).wait()


def _repack_seconds(lm) -> float | None:
    from noria.engine import inference

    if not inference.supported(lm):
        return None
    fast = inference.FastDecoder(lm)
    start = time.perf_counter()
    fast.refresh()
    return time.perf_counter() - start


def _requantize_seconds(lm, repeats: int) -> dict[str, float]:
    """Per integer mode the model can be served with here (CPU), the best of ``repeats`` re-quantizations
    of every decoder block (``FastDecoder.requantize``: what a quantized engine's commit adds)."""
    from noria.engine import inference, quant

    out = {}
    for mode in quant.MODES:
        if quant.supported(lm, mode) is not None:
            continue
        fast, best = inference.FastDecoder(lm, quantization=mode), float("inf")
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            fast.requantize()
            best = min(best, time.perf_counter() - start)
        out[mode] = best
    return out


# -------------------------------------------------------------------------------------------- table


def print_results(results: list[dict]) -> None:
    from noria.bench import print_table

    seconds = {r["case"]: r for r in results if r["metric"] == "push_s"}
    rows = []
    for r in results:
        if r["metric"] == "repack_s":
            rows.append([r["case"], r["noria"], None, None, None, None])
        elif r["metric"] == "gb_per_s":
            s = seconds[r["case"]]
            rows.append([r["case"], s["noria"], r["noria"], s["bound"], r["bound"], s["noria"] / s["bound"]])
    header = ["case", "push_s", "push_GB/s", "primitive_s", "primitive_GB/s", "ratio"]
    print_table("weight sync: one push of every tensor, best of the repeats (ratio = push / primitive time)", header, rows)
    delta = {(r["case"], r["metric"]): r for r in results if r["metric"] in ("bytes_written", "changed_frac")}
    if delta:
        rows = []
        for (case, metric), r in delta.items():
            if metric == "bytes_written":
                s, changed = seconds[case], delta[(case, "changed_frac")]["noria"]
                full_b, full_s = r["peers"].get("disk"), s["peers"].get("disk")
                rows.append([case, s["noria"], full_s, r["noria"] / 1e6, full_b / 1e6, r["noria"] / full_b, changed])
        header = ["case", "push_s", "full_disk_s", "written_MB", "full_MB", "bytes_ratio", "changed_frac"]
        print_table("weight sync on disk: a delta per push against a full snapshot (seconds: best; bytes: mean)", header, rows)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        _receive_main(json.loads(sys.argv[2]))
