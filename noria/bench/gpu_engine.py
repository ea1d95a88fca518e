"""``noria bench gpu-engine``: decode throughput of the engine on one CUDA GPU, against
transformers' ``generate`` on the same GPU and against the memory-bandwidth bound.

Case: a random-init model of a Qwen3 size (bf16), B prompts of ``prompt_len`` random token ids,
greedy, ``ignore_eos``, exactly ``new_tokens`` new tokens each, all B submitted at once.

- ``noria``: the in-process :class:`~noria.engine.Engine` (Triton paged attention, CUDA graphs
  for decode steps, device sampling). Decode tokens/s = B * (N - 1) / (T(N) - T(1)), where T(n)
  is the wall time of the whole batch with n new tokens: prefill (and its first token) cancels.
- ``hf_generate``: ``AutoModelForCausalLM.generate`` (sdpa attention, dynamic cache) on a batch of
  the same prompts, the same weights, with ``hf_new_tokens`` new tokens (fewer than Noria's when
  asked, to save time: shorter contexts only favour it); decode tokens/s by the same difference.
- ``noria_no_overlap`` (peer, on request): the engine with ``engine.overlap: off`` (each decode
  step waits for the previous one's tokens on the host), to measure what the overlap hides.
- ``bound``: decode tokens/s if every step only read the weights once and every sequence's K/V
  once, at the device-to-device copy bandwidth measured in this run: B * (N - 1) over
  sum over steps of (weight bytes + B * context * KV bytes per token) / bandwidth.

Also measured (``--deterministic``): the engine in deterministic mode (exact attention, row-chunked
linears) on a smaller batch, its decode tokens/s against the default mode, and whether a request's
logprobs are bitwise the same alone and inside a batch on this GPU.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from noria.bench import print_table, write_json
from noria.bench.gpu_common import copy_bandwidth, device_name, random_model


def add_arguments(parser) -> None:
    """``noria bench gpu-engine``'s arguments."""
    parser.description = "CUDA: decode tokens/s of the engine vs HF generate and the bandwidth bound."
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b", help="random-init Qwen3 sizes: qwen3-0.6b, qwen3-1.7b")
    parser.add_argument("--batches", default="64,256", help="comma-separated decode batch sizes (requests at once)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=512, help="new tokens per request (decode timed as T(N) - T(1))")
    parser.add_argument("--hf-new-tokens", type=int, default=128, help="new tokens of the HF generate peer")
    parser.add_argument("--peers", default="hf_generate",
                        help="comma list: hf_generate, noria_no_overlap (the engine with engine.overlap off), or empty")
    parser.add_argument("--no-deterministic", action="store_true", help="skip the deterministic-mode row")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    peers = tuple(p for p in args.peers.split(",") if p)
    run(models, batches, args.prompt_len, args.new_tokens, args.hf_new_tokens, peers, not args.no_deterministic, args.json)
    return 0


def run(
    models: list[str], batches: list[int], prompt_len: int = 512, new_tokens: int = 512, hf_new_tokens: int = 128,
    peers: tuple[str, ...] = ("hf_generate",), deterministic: bool = True, json_path: str | None = None,
) -> list[dict]:
    bandwidth = copy_bandwidth()
    results = []
    for name in models:
        lm = random_model(name)
        prompts = random_prompts(lm.args.vocab_size, max(batches), prompt_len)
        for batch in batches:
            row = _noria(lm, prompts[:batch], new_tokens)
            if "noria_no_overlap" in peers:
                row["noria_no_overlap"] = _noria(lm, prompts[:batch], new_tokens, overlap="off")["noria"]
            if "hf_generate" in peers:
                row["hf_generate"] = _hf(lm, prompts[:batch], hf_new_tokens)
            row["bound"] = _bound(lm, batch, prompt_len, new_tokens, bandwidth)
            row.update(model=name, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                       hf_new_tokens=hf_new_tokens, copy_gbps=bandwidth / 1e9)
            results.append(row)
            _print_partial(row)
        if deterministic and name == models[0]:
            results.append(_deterministic(lm, prompts, prompt_len))
        del lm
        gc.collect()
        torch.cuda.empty_cache()
    rows = [_result(r) for r in results]
    _print(rows)
    if json_path:
        write_json(json_path, "gpu-engine", rows)
    return rows


def random_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    """``n`` seeded random prompts of ``length`` ids (the GPU benchmarks share them)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def bench_engine(lm, batch: int, longest: int, **overrides):
    """An engine sized for ``batch`` requests of up to ``longest`` tokens, no prefix cache."""
    from noria.config import EngineConfig
    from noria.engine import Engine

    config = EngineConfig(max_running_requests=batch, max_batch_tokens=16384, chunked_prefill_size=512,
                          kv_cache_tokens=batch * (longest + 32) + 4096, prefix_cache=False, **overrides)
    return Engine(lm, None, config, eos_token_ids=set())


def timed_generate(engine, prompts, n: int, logprobs: bool = False):
    """(seconds, outputs) of ``n`` greedy tokens per prompt, EOS ignored."""
    from noria.engine.protocol import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate_batch([GenerateRequest(input_ids=p, sampling=params) for p in prompts])
    seconds = time.perf_counter() - start
    assert all(len(o.output_ids) == n for o in out)
    return seconds, out


def _noria(lm, prompts, new_tokens: int, **overrides) -> dict[str, Any]:
    batch = len(prompts)
    engine = bench_engine(lm, batch, len(prompts[0]) + new_tokens, **overrides)
    try:
        timed_generate(engine, prompts, 8)  # warm-up: Triton compiles, graphs are captured
        t1, _ = timed_generate(engine, prompts, 1)
        tn, out = timed_generate(engine, prompts, new_tokens)
        graphs = len(engine.runner.graphs._graphs) if engine.runner.graphs is not None else 0
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return {"noria": batch * (new_tokens - 1) / (tn - t1), "noria_prefill_s": t1, "noria_total_s": tn,
            "noria_end_to_end": batch * new_tokens / tn, "graphs": graphs}


@torch.inference_mode()
def _hf(lm, prompts, new_tokens: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(lm.hf_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(lm.state_dict(), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"HF model does not take the native weights: missing {missing}, unexpected {unexpected}")
    ids = torch.tensor(prompts, device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, top_k=None, top_p=None, temperature=None)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    gen(2)
    t1, tn = gen(1), gen(new_tokens)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return len(prompts) * (new_tokens - 1) / (tn - t1)


def _bound(lm, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    from noria.engine.kv_cache import bytes_per_token

    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())  # tied head counted once
    kv = bytes_per_token(lm.args, torch.bfloat16)
    seconds = sum(weight_bytes + batch * (prompt_len + i) * kv for i in range(1, new_tokens)) / bandwidth
    return batch * (new_tokens - 1) / seconds


def _deterministic(lm, prompts, prompt_len: int, batch: int = 16, new_tokens: int = 32) -> dict[str, Any]:
    """Deterministic vs default mode at a small batch; bitwise batch invariance of logprobs."""
    fast = _noria(lm, prompts[:batch], new_tokens)["noria"]
    engine = bench_engine(lm, batch, prompt_len + new_tokens, deterministic=True)
    try:
        timed_generate(engine, prompts[:2], 4)
        t1, _ = timed_generate(engine, prompts[:batch], 1)
        tn, together = timed_generate(engine, prompts[:batch], new_tokens)
        _, alone = timed_generate(engine, prompts[:1], new_tokens)
    finally:
        engine.shutdown(drain_timeout_s=1.0)
        lm.set_exact_numerics(None)  # the deterministic runner switched the shared model's numerics
    same = together[0].output_ids == alone[0].output_ids and together[0].logprobs == alone[0].logprobs
    return {"deterministic": True, "model": lm.hf_config.get("model_type"), "batch": batch, "new_tokens": new_tokens,
            "prompt_len": prompt_len, "noria": batch * (new_tokens - 1) / (tn - t1), "default_mode": fast,
            "batch_invariant": same}


def _result(r: dict[str, Any]) -> dict[str, Any]:
    if r.get("deterministic"):
        return {"case": f"deterministic mode batch={r['batch']} prompt={r['prompt_len']} new={r['new_tokens']} "
                         f"(bitwise batch-invariant logprobs: {r['batch_invariant']})",
                "metric": "decode_tokens_per_s", "noria": round(r["noria"], 1),
                "peers": {"default_mode": round(r["default_mode"], 1)}, "bound": None,
                "batch_invariant": r["batch_invariant"], "device": device_name()}
    return {"case": f"{r['model']} bf16 random batch={r['batch']} prompt={r['prompt_len']} new={r['new_tokens']} "
                    f"(hf new={r['hf_new_tokens']})",
            "metric": "decode_tokens_per_s", "noria": round(r["noria"], 1),
            "peers": {k: round(r[k], 1) for k in ("hf_generate", "noria_no_overlap") if k in r},
            "bound": round(r["bound"], 1),
            "noria_end_to_end_tokens_per_s": round(r["noria_end_to_end"], 1), "prefill_s": round(r["noria_prefill_s"], 3),
            "copy_gbps": round(r["copy_gbps"], 1), "graphs": r["graphs"], "device": device_name()}


def _print_partial(r: dict[str, Any]) -> None:
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)


def _print(rows: list[dict]) -> None:
    table = []
    for r in rows:
        hf = r["peers"].get("hf_generate") or r["peers"].get("default_mode")
        table.append([r["case"], r["noria"], hf, r["noria"] / hf if hf else None, r["bound"],
                      r["noria"] / r["bound"] if r["bound"] else None, r["peers"].get("noria_no_overlap")])
    print_table(f"decode tokens/s on {device_name()} (higher is better; peer = hf_generate, or default mode)",
                ["case", "noria", "peer", "noria/peer", "bound", "noria/bound", "noria overlap=off"], table)
