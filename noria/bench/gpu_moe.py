"""``noria bench gpu-moe``: a Qwen3-MoE on one CUDA GPU: engine decode vs transformers' ``generate``,
the cost of route capture, and one RL training step's tokens/s and MFU on active parameters.

Case: a random-init Qwen3-30B-A3B shape pruned to ``--layers`` decoder layers (hidden 2048, 32
query / 4 KV heads of 128, 128 experts of width 768, top-8 with renormalised weights, vocabulary
151936), bf16.

- decode (``decode_tokens_per_s``): B prompts of ``prompt_len`` random ids, greedy, ``ignore_eos``,
  measured like ``noria bench gpu-engine`` (decode tokens/s = B * (N - 1) / (T(N) - T(1))): the
  engine (CUDA graphs; experts through ``torch._grouped_mm``) against HF ``generate`` (transformers'
  ``Qwen3MoeForCausalLM``, the same weights: the native state dict has transformers' names), and
  the bound: every step reading the attention weights, the experts the batch hits (the expected
  number of distinct experts of B tokens routed uniformly) and each sequence's K/V once, at the
  copy bandwidth measured in this run.
- route capture (``route_capture_overhead``): the same engine and batch with every request asking
  for its routes (``return_routed_experts``) against none, interleaved runs, the ratio of decode
  times (the issue's limit: 1.05).
- train (``tokens_per_s``, ``mfu``): ``FSDPBackend.train_step`` (``backend: single``, bf16
  autocast, fp32 masters, activation checkpointing) on packed random sequences; MFU = model FLOPs
  per second over the bf16 matmul rate of this run, with 6 x ACTIVE parameters per token (the
  non-expert weights plus top-k of E experts per MoE layer) plus the attention products.

Blocking: everything runs on the calling thread; needs one CUDA GPU (tens of GiB for the default
shape). Not measured here: multi-GPU expert parallelism (Noria has none).
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from noria.bench import print_table, write_json
from noria.bench.gpu_common import bf16_matmul_rate, copy_bandwidth, decode_seconds, device_name, random_model

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
}  # fmt: skip
"""Qwen3-30B-A3B's config.json less its layer count (``--layers`` sets it)."""

TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "bos_token_id": 1,
        "eos_token_id": 2}
"""``--tiny``: the same architecture at a size that runs on a CPU in seconds (a smoke test of this
benchmark's code, not a figure)."""


def add_arguments(parser) -> None:
    """``noria bench gpu-moe``'s arguments."""
    parser.description = "CUDA: Qwen3-MoE decode vs HF generate, route capture overhead, trainer tokens/s and MFU."
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the pruned Qwen3-30B-A3B shape")
    parser.add_argument("--batches", default="64,256", help="comma-separated decode batch sizes (requests at once)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per request of Noria's engine")
    parser.add_argument("--hf-new-tokens", type=int, default=64, help="new tokens of the HF generate peer")
    parser.add_argument("--capture-repeats", type=int, default=3, help="interleaved runs with and without route capture")
    parser.add_argument("--train-sequences", type=int, default=32, help="sequences in the training step's batch")
    parser.add_argument("--train-len", default="512,1536", help="min,max sequence length of the training step")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="train.micro_batch_tokens of the training step")
    parser.add_argument("--parts", default="decode,capture,train", help="comma list: decode, capture, train")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu with --tiny (a smoke test)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture (smoke test)")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    parts = {p for p in args.parts.split(",") if p}
    batches = [int(b) for b in args.batches.split(",") if b]
    lo, hi = (int(x) for x in args.train_len.split(","))
    run(args.layers, batches, args.prompt_len, args.new_tokens, args.hf_new_tokens, args.capture_repeats,
        args.train_sequences, lo, hi, args.micro_batch_tokens, parts, args.json, args.device, args.tiny)
    return 0


def moe_config(layers: int, tiny: bool = False) -> dict[str, Any]:
    return {**QWEN3_30B_A3B, **(TINY if tiny else {}), "num_hidden_layers": layers}


def _shape_name(config: dict[str, Any]) -> str:
    tiny = config["hidden_size"] == TINY["hidden_size"]
    return f"{'tiny-moe' if tiny else 'qwen3-30b-a3b'} {config['num_hidden_layers']} layers"


def run(layers: int = 6, batches: list[int] = (64, 256), prompt_len: int = 512, new_tokens: int = 256,
        hf_new_tokens: int = 64, capture_repeats: int = 3, train_sequences: int = 32, min_len: int = 512,
        max_len: int = 1536, micro_batch_tokens: int = 16384, parts=("decode", "capture", "train"),
        json_path: str | None = None, device: str = "cuda", tiny: bool = False) -> list[dict]:
    if device != "cuda" and not tiny:
        raise ValueError("noria bench gpu-moe measures a CUDA GPU; --device cpu only runs --tiny (a smoke test)")
    config = moe_config(layers, tiny)
    rows: list[dict] = []
    if "decode" in parts or "capture" in parts:
        rows += _engine_rows(config, list(batches), prompt_len, new_tokens, hf_new_tokens, capture_repeats, parts, device)
    if "train" in parts:
        rows.append(_train_row(config, train_sequences, min_len, max_len, micro_batch_tokens, device))
    _print(rows)
    if json_path:
        write_json(json_path, "gpu-moe", rows)
    return rows


# ----------------------------------------------------------------------------------- decode


def _engine_rows(config, batches, prompt_len, new_tokens, hf_new_tokens, repeats, parts, device) -> list[dict]:
    from noria.bench.gpu_engine import random_prompts

    bandwidth = copy_bandwidth() if device == "cuda" else None
    lm = random_model(config, device=device)
    prompts = random_prompts(config["vocab_size"], max(batches), prompt_len)
    rows = []
    for batch in batches:
        if "decode" in parts:
            noria = _decode(lm, prompts[:batch], new_tokens, routes=False)
            hf = _hf_decode(lm, prompts[:batch], hf_new_tokens)
            rows.append({"case": f"{_shape_name(config)} bf16 random batch={batch} "
                                 f"prompt={prompt_len} new={new_tokens} (hf new={hf_new_tokens})",
                         "metric": "decode_tokens_per_s", "noria": round(noria, 1), "peers": {"hf_generate": round(hf, 1)},
                         "bound": _bound(lm, batch, prompt_len, new_tokens, bandwidth),
                         "copy_gbps": bandwidth and round(bandwidth / 1e9, 1), "device": device_name()})
            print(rows[-1], flush=True)
        if "capture" in parts:
            rows.append(_capture(lm, prompts[:batch], new_tokens, repeats))
            print(rows[-1], flush=True)
    del lm
    gc.collect()
    _empty_cache()
    return rows


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def _hf_decode(lm, prompts, new_tokens: int) -> float:
    """HF ``generate``'s decode tokens/s on transformers' own Qwen3-MoE with ``lm``'s weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(lm.hf_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    device = next(lm.parameters()).device
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(lm.state_dict(), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"HF model does not take the native weights: missing {missing}, unexpected {unexpected}")
    ids = torch.tensor(prompts, device=device)

    def gen(n: int) -> float:
        _sync()
        start = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, top_k=None, top_p=None, temperature=None)
        _sync()
        return time.perf_counter() - start

    gen(2)
    seconds = decode_seconds(gen, new_tokens)
    del hf
    gc.collect()
    _empty_cache()
    return len(prompts) * (new_tokens - 1) / seconds


def _decode(lm, prompts, new_tokens: int, routes: bool) -> float:
    from noria.bench.gpu_engine import bench_engine

    engine = bench_engine(lm, len(prompts), len(prompts[0]) + new_tokens)
    try:
        _timed(engine, prompts, 8, routes)  # warm-up: Triton compiles, graphs are captured
        seconds = _decode_seconds(engine, prompts, new_tokens, routes)
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return len(prompts) * (new_tokens - 1) / seconds


def _decode_seconds(engine, prompts, new_tokens: int, routes: bool) -> float:
    return decode_seconds(lambda n: _timed(engine, prompts, n, routes), new_tokens)


def _timed(engine, prompts, n: int, routes: bool) -> float:
    from noria.engine.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(input_ids=p, sampling=params, return_routed_experts=routes) for p in prompts]
    _sync()
    start = time.perf_counter()
    out = engine.generate_batch(reqs)
    seconds = time.perf_counter() - start
    if not all(len(o.output_ids) == n and (o.routed_experts is not None) == routes for o in out):
        raise RuntimeError("the engine returned fewer tokens or routes than asked")
    return seconds


def _capture(lm, prompts, new_tokens: int, repeats: int) -> dict:
    """Decode tokens/s without and with route capture, interleaved on one engine: a ratio of one run."""
    from noria.bench.gpu_engine import bench_engine

    engine = bench_engine(lm, len(prompts), len(prompts[0]) + new_tokens)
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for routes in (False, True):
            _timed(engine, prompts, 8, routes)
        for _ in range(repeats):
            for routes in (False, True):
                times[routes].append(_decode_seconds(engine, prompts, new_tokens, routes))
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    plain, captured = sorted(times[False])[len(times[False]) // 2], sorted(times[True])[len(times[True]) // 2]
    tokens = len(prompts) * (new_tokens - 1)
    return {"case": f"route capture, batch={len(prompts)} new={new_tokens} (median of {repeats} interleaved runs)",
            "metric": "decode_tokens_per_s", "noria": round(tokens / captured, 1),
            "peers": {"no_capture": round(tokens / plain, 1)}, "bound": None,
            "route_capture_overhead": round(captured / plain, 4), "device": device_name()}


def _bound(lm, batch: int, prompt_len: int, new_tokens: int, bandwidth: float | None) -> float | None:
    """Decode tokens/s if each step read the non-expert weights, the experts the batch hits (their
    expected number for uniform routing) and every sequence's K/V once, at ``bandwidth``."""
    from noria.engine.kv_cache import bytes_per_token

    if bandwidth is None:
        return None
    moe = lm.args.moe
    expert_bytes = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if ".experts." in n)
    other = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if ".experts." not in n)
    hit = 1 - (1 - moe.top_k / moe.num_experts) ** batch  # share of a layer's experts some token uses
    kv = bytes_per_token(lm.args, torch.bfloat16)
    seconds = sum(other + hit * expert_bytes + batch * (prompt_len + i) * kv for i in range(1, new_tokens)) / bandwidth
    return round(batch * (new_tokens - 1) / seconds, 1)


# ------------------------------------------------------------------------------------ train


def _train_row(config, sequences: int, min_len: int, max_len: int, micro_batch_tokens: int, device: str,
               steps: int = 3) -> dict:
    from noria.models import save_model

    rate = bf16_matmul_rate() if device == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp:
        lm = random_model(config, device=device)
        folder = save_model(lm, Path(tmp) / "moe")  # per-expert HF layout, as checkpoints are
        active = active_params(lm)
        del lm
        _empty_cache()
        fig = _train_step(folder, sequences, min_len, max_len, micro_batch_tokens, steps, device)
    args = fig["args"]
    flops = 6 * active + 6 * args.num_layers * 2 * args.num_heads * args.head_dim * fig["span"]
    tokens_per_s = fig["tokens"] * steps / fig["seconds"]
    return {"case": f"{_shape_name(config)} rl-step bf16-autocast fp32-master "
                    f"seqs={sequences} len={min_len}-{max_len} micro_batch_tokens={micro_batch_tokens}",
            "metric": "tokens_per_s", "noria": round(tokens_per_s, 1), "peers": {},
            "bound": rate and round(rate / flops, 1), "mfu": rate and round(tokens_per_s * flops / rate, 4),
            "active_params": active, "matmul_tflops": rate and round(rate / 1e12, 1),
            "step_s": round(fig["seconds"] / steps, 3), "peak_gpu_gb": round(fig["peak"] / 1e9, 2), "device": device_name()}


def active_params(lm) -> int:
    """Parameters one token uses: all but the experts, plus top-k / E of each MoE layer's experts."""
    moe = lm.args.moe
    experts = sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in lm.parameters()) - experts + experts * moe.top_k // moe.num_experts


def _train_step(folder, sequences, min_len, max_len, micro_batch_tokens, steps, device) -> dict:
    import json

    from noria.config import TrainConfig
    from noria.models.config import ModelArgs
    from noria.train.fsdp import FSDPBackend
    from noria.train.packing import pack_samples
    from noria.types import Sample

    cfg = TrainConfig(algorithm="rl", backend="single", device=device, param_dtype="bfloat16",
                      micro_batch_tokens=micro_batch_tokens, activation_checkpointing=True)
    backend = FSDPBackend(cfg)
    backend.init(str(folder))
    args = ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_len, max_len + 1, (sequences,), generator=g).tolist()
    samples = []
    for n in lengths:
        ids = torch.randint(0, args.vocab_size, (n,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[: n // 2], response_ids=ids[n // 2 :], loss_mask=[1] * (n - n // 2)))
    batch = pack_samples(samples, torch.randn(sequences, generator=g).tolist())
    backend.train_step(batch)  # warm-up
    cuda = device == "cuda"
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        backend.train_step(batch)
    _sync()
    return {"seconds": time.perf_counter() - start, "tokens": sum(lengths), "args": args,
            "span": sum(n * (n + 1) / 2 for n in lengths) / sum(lengths),
            "peak": torch.cuda.max_memory_allocated() if cuda else 0}


def _print(rows: list[dict]) -> None:
    table = []
    for r in rows:
        peer = next(iter(r["peers"].values()), None)
        table.append([r["case"], r["noria"], peer, r["noria"] / peer if peer else None, r["bound"],
                      r.get("mfu"), r.get("route_capture_overhead")])
    print_table(f"Qwen3-MoE on {device_name()} (higher is better)",
                ["case", "noria", "peer", "noria/peer", "bound", "MFU", "capture time ratio"], table)
