"""``noria bench gpu-fp8``: FP8 (e4m3) rollout against bf16 rollout on one Hopper GPU: decode
speed, and the rollout-vs-trainer logprob mismatch with its truncated-importance-sampling weights.

FP8 serving is the engine's option ``engine.quantization: fp8`` (``noria.engine.fp8``): every linear
layer of the decoder blocks keeps an e4m3 copy of its weight with one fp32 scale per output channel
(amax / 448); activations are quantized per row on the fly (a Triton kernel), and
``torch._scaled_mm`` multiplies with both scale vectors (row-wise scaling, Hopper's FP8 tensor
cores) into bf16. Embedding, norms, attention, the KV cache and the head stay bf16. Decode steps
run the fused decoder in CUDA graphs, as in bf16.

Mismatch: the engine samples (T = 1) ``new_tokens`` per prompt and reports each token's logprob;
the trainer's bf16 forward (the policy it trains) recomputes them. Reported per rollout precision:
mean |Δ logprob|, the k1 estimate of KL(rollout || trainer) (mean of rollout - trainer logprob over
rollout samples), and TIS weights w = min(exp(trainer - rollout), C) with C = 2: their mean, and the
share of tokens where the cap bites. A third column recomputes the FP8 rollout's tokens with the
trainer of ``train.qat: fp8`` (the same bf16 model with the engine's weight and input rounding,
``noria.models.quantize``). Random-init weights give flat distributions, so the absolute
mismatch is smaller than a trained model's would be; the fp8-vs-bf16 ratio is the figure.
"""

from __future__ import annotations

import time

import torch

from noria.bench import print_table, write_json
from noria.bench.gpu_common import device_name, random_model
from noria.models.quantize import set_fake_quant

TIS_CAP = 2.0


def add_arguments(parser) -> None:
    """``noria bench gpu-fp8``'s arguments."""
    parser.description = "CUDA (Hopper): FP8 vs bf16 rollout, decode speed and logprob mismatch (TIS)."
    parser.add_argument("--model", default="qwen3-1.7b", help="random-init Qwen3 size: qwen3-0.6b, qwen3-1.7b")
    parser.add_argument("--batch", type=int, default=256, help="requests decoded together")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per request")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    run(args.model, args.batch, args.prompt_len, args.new_tokens, args.json)
    return 0


def run(model: str = "qwen3-1.7b", batch: int = 256, prompt_len: int = 512, new_tokens: int = 256,
        json_path: str | None = None) -> list[dict]:
    from noria.bench.gpu_engine import bench_engine, random_prompts

    bf16 = random_model(model)
    prompts = random_prompts(bf16.args.vocab_size, batch, prompt_len)
    figures = {}
    for precision in ("bf16", "fp8"):
        # The FP8 engine quantizes its own model object: a second one with the same seed (same weights).
        lm = bf16 if precision == "bf16" else random_model(model)
        engine = bench_engine(lm, batch, prompt_len + new_tokens, quantization=precision.replace("bf16", "none"))
        try:
            _sampled(engine, prompts, 8)  # warm-up at the full batch: Triton compiles, graph captures
            t1, _ = _sampled(engine, prompts, 1)
            tn, out = _sampled(engine, prompts, new_tokens)
        finally:
            engine.shutdown(drain_timeout_s=1.0)
        decode = batch * (new_tokens - 1) / (tn - t1)
        figures[precision] = {"decode_tokens_per_s": decode, **_mismatch(bf16, prompts, out)}
        print(precision, {k: round(v, 5) for k, v in figures[precision].items()}, flush=True)
        if precision == "fp8":
            del lm
            torch.cuda.empty_cache()
            # train.qat: fp8: the trainer's forward with the engine's weight and input rounding (fake quantization)
            set_fake_quant(bf16, "fp8", torch.bfloat16)
            figures["fp8_qat"] = {"decode_tokens_per_s": decode, **_mismatch(bf16, prompts, out)}
            set_fake_quant(bf16, None, torch.bfloat16)
            print("fp8 rollout, trainer with train.qat fp8", {k: round(v, 5) for k, v in figures["fp8_qat"].items()}, flush=True)
    rows = []
    case = f"{model} random batch={batch} prompt={prompt_len} new={new_tokens} T=1"
    for metric in ("decode_tokens_per_s", "mean_abs_dlogprob", "kl_k1", "tis_mean", "tis_capped_share"):
        rows.append({"case": case, "metric": metric, "noria": round(figures["fp8"][metric], 6),
                     "peers": {"bf16_rollout": round(figures["bf16"][metric], 6),
                               "fp8_rollout_qat_trainer": round(figures["fp8_qat"][metric], 6)}, "bound": None,
                     "device": device_name()})
    print_table(f"FP8 (e4m3, per-channel weights, per-row activations) vs bf16 rollout on {device_name()}",
                ["metric", "fp8", "fp8, QAT trainer", "bf16", "fp8/bf16"],
                [[r["metric"], r["noria"], r["peers"]["fp8_rollout_qat_trainer"], r["peers"]["bf16_rollout"],
                  r["noria"] / r["peers"]["bf16_rollout"] if r["peers"]["bf16_rollout"] else None] for r in rows])
    if json_path:
        write_json(json_path, "gpu-fp8", rows)
    return rows


def _sampled(engine, prompts, n: int):
    from noria.engine.protocol import GenerateRequest, SamplingParams

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate_batch([
        GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True))
        for p in prompts
    ])
    return time.perf_counter() - start, out


@torch.inference_mode()
def _mismatch(lm, prompts, outputs, rows_per_call: int = 8) -> dict[str, float]:
    """The trainer's bf16 logprobs of the rollout tokens against the rollout's own."""
    diffs = []
    for i in range(0, len(prompts), rows_per_call):
        ids = torch.tensor([p + o.output_ids for p, o in zip(prompts[i : i + rows_per_call], outputs[i : i + rows_per_call])],
                           device="cuda")
        start = len(prompts[i])
        hidden = lm.hidden_states(ids)[:, start - 1 : -1]
        logp = torch.log_softmax(lm.lm_head(hidden).float(), dim=-1)
        trainer = logp.gather(-1, ids[:, start:, None]).squeeze(-1)
        rollout = torch.tensor([o.logprobs for o in outputs[i : i + rows_per_call]], device="cuda")
        diffs.append((trainer - rollout).flatten())
    d = torch.cat(diffs).double()
    w = d.exp()
    return {"mean_abs_dlogprob": d.abs().mean().item(), "kl_k1": (-d).mean().item(),
            "tis_mean": w.clamp(max=TIS_CAP).mean().item(), "tis_capped_share": (w > TIS_CAP).double().mean().item()}
