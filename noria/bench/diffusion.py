"""``noria bench diffusion``: images/s of the diffusion engine's batched sampler against diffusers'
pipeline-style sampling of the same DiT and steps, and the DiT trainer's samples/s.

Cases (all on one random-weight ``diffusers.DiTTransformer2DModel``, written once as a diffusers
folder and loaded by every side; ``--shape``):

- ``digits``: the DiT of ``examples/sft_dit_digits.yaml`` (8x8x1 pixels, patch 2, 4 layers of width
  128), the CPU default; ``tiny`` (2 layers of width 32) is the smoke test's;
- ``sd3-medium``: SD3-medium-sized blocks (24 layers, 24 heads of 64 = width 1536, patch 2) on
  the latent of a 512x512 image (64x64x16, 1024 tokens), 1000 classes: the CUDA default. A DiT
  block (adaLN-Zero self-attention on class + timestep), not SD3's joint text-image block; the
  matmul shapes per image token are SD3-medium's.

Figures:

- sampling (``images_per_s``), for each of ``--batch`` (a comma list: 8 and 64 on a CPU, where
  the engine's per-step overhead shows most at 8), B images of ``--steps`` denoising steps, every
  side on the same device and dtype:

  - ``noria`` ``ode``: ``DiffusionEngine.generate_batch`` of B requests with noise level 0 (one
    seed and generator per image, step-level continuous batching, each step's latent kept; the B
    requests join the batch at the same step);
  - ``noria`` ``sde``: the same with Flow-GRPO's SDE (``diffusion.noise_level``): what an RL rollout
    costs, per-step noise from each image's generator and log-probabilities included;
  - peer ``diffusers_pipeline``: ``DiTPipeline.__call__``'s denoising loop with guidance 1 (no
    CFG) and diffusers' ``FlowMatchEulerDiscreteScheduler`` (the ODE), one batch of B, one
    generator. The pipeline itself cannot run here: it needs a VAE and a scheduler with
    ``scale_model_input``, which the flow-matching scheduler lacks; the loop is its code without
    those two lines. The peer column of the ``sde`` case is the same ODE loop (diffusers has no SDE
    step with a log-probability), so its ratio is the price of the rollout's extra work.
  - ``bound`` (CUDA only): images/s if each denoising step were only its matmuls (linears and
    attention products) at the bf16 GEMM rate measured in the run.

- training (``samples_per_s``), ``DiffusionTrainer`` (fp32 masters, compute in the dtype):

  - ``sft``: images/s of flow-matching SFT steps of ``--train-images`` images; peer
    ``diffusers_train_loop``: the same step as diffusers' training scripts write it (the model's
    own forward on fp32 weights, under ``torch.autocast`` when the dtype is bf16, MSE to the
    velocity target, AdamW);
  - ``flow_grpo``: images/s of Flow-GRPO optimizer steps on engine trajectories of
    ``--train-images`` images, every one of the ``--steps`` transitions trained (no peer: no
    library trains this objective).

Blocking: everything runs in this process, one side after the other; after one warm-up of each
side, ``--repeats`` rounds in which every side runs once (interleaved, so a machine that slows down
for a while slows every side), the best of each side kept. Imports only torch, diffusers and noria (no scikit-learn),
so a GPU machine needs diffusers' wheel and nothing else.

Not measured: the VAE (pixel latents here), CFG, HTTP serving, several processes.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from noria.bench import print_table, write_json

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"sample_size": 8, "in_channels": 1, "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16,
             "num_embeds_ada_norm": 10},
    "digits": {"sample_size": 8, "in_channels": 1, "num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32,
               "num_embeds_ada_norm": 10},
    "sd3-medium": {"sample_size": 64, "in_channels": 16, "num_layers": 24, "num_attention_heads": 24,
                   "attention_head_dim": 64, "num_embeds_ada_norm": 1000},
}  # fmt: skip
"""DiT shapes by ``--shape`` (the rest of the config is ``BASE``); every one has at least 10 classes
(images are asked for class ``i % 10``)."""
BASE = {"_class_name": "DiTTransformer2DModel", "patch_size": 2, "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False, "activation_fn": "gelu-approximate", "attention_bias": True}  # fmt: skip


def add_arguments(parser) -> None:
    """``noria bench diffusion``'s arguments."""
    parser.description = (
        "Images/s of the diffusion engine's batched sampler (ODE, and the SDE with log-probabilities that RL "
        "rollouts use) against diffusers' DiTPipeline denoising loop on the same random DiT, same steps, same "
        "device and dtype; and the DiT trainer's samples/s (flow-matching SFT vs a diffusers-style training "
        "loop, and Flow-GRPO steps)."
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="DiT shape (default: digits on cpu, sd3-medium on cuda)")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny and small counts: a smoke test of this code")
    parser.add_argument("--dtype", default="auto", help="auto (noria.hardware: bf16 on CUDA and bf16-native CPUs), bfloat16, float32")
    parser.add_argument("--batch", default=None, help="images sampled together, a comma list (default 8,64 cpu, 32 cuda)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per image (default 10 cpu, 20 cuda)")
    parser.add_argument("--noise-level", type=float, default=0.7, help="the SDE's noise level a")
    parser.add_argument("--train-images", type=int, default=None, help="images per training step (default 64 cpu, 8 cuda)")
    parser.add_argument("--micro-batch", type=int, default=None, help="images (SFT) or (image, step) pairs (RL) per micro-batch")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side (after one warm-up); the best is kept")
    parser.add_argument("--parts", default="sample,train", help="comma list: sample, train")
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    cuda = args.device.startswith("cuda")
    shape = "tiny" if args.tiny else args.shape or ("sd3-medium" if cuda else "digits")
    small = 4 if args.tiny else None
    micro = args.micro_batch or (8 if cuda else None)  # a 1024-token image: 8 per micro-batch fit activations
    opts = {
        "batches": _batches(args.batch) if args.batch else [small] if small else [32] if cuda else [8, 64],
        "steps": args.steps or (3 if args.tiny else 20 if cuda else 10),
        "train_images": args.train_images or small or (8 if cuda else 64),
        "micro_batch": micro,
        "repeats": 1 if args.tiny else args.repeats,
        "noise_level": args.noise_level,
    }
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"sample", "train"}
    if unknown:
        raise SystemExit(f"--parts: unknown part(s) {', '.join(sorted(unknown))}; use sample, train")
    run(shape, args.device, args.dtype, parts, args.json, **opts)
    return 0


def _batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b]
    except ValueError:
        raise SystemExit(f"--batch: expected a comma list of integers, got {text!r}") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch: every batch must be >= 1, got {text!r}")
    return batches


def run(shape: str, device: str, dtype: str, parts: list[str], json_path: str | None = None, **opts: Any) -> list[dict]:
    """Measure the parts on a random DiT of ``shape``; print the table, write the JSON."""
    from noria import hardware

    dtype = hardware.resolve_dtype(dtype, device)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="noria-bench-dit-") as tmp:
        folder = write_random_dit(Path(tmp) / "dit", shape, dtype)
        name = f"dit-{shape} {dtype} {device}"
        trajectories: list = []
        if "sample" in parts:
            results += sample_cases(folder, name, device, dtype, trajectories, **opts)
        if "train" in parts:
            results += train_cases(folder, name, device, dtype, trajectories, **opts)
    rows = [[r["case"], r["metric"], r["noria"], *(r["peers"].get(p) for p in ("diffusers_pipeline", "diffusers_train_loop")),
             r.get("bound")] for r in results]  # fmt: skip
    print_table("noria bench diffusion", ["case", "metric", "noria", "diffusers_pipeline", "diffusers_train_loop", "bound"], rows)
    if json_path:
        write_json(json_path, "diffusion", results)
    return results


def write_random_dit(folder: Path, shape: str, dtype: str) -> Path:
    """A diffusers folder of a seeded random DiT of ``shape`` whose adaLN-Zero gates are not zero (a
    fresh DiT predicts 0 and its blocks would be skipped by nothing, but the numbers would be dull)."""
    from noria.diffusion.model import cast, load_dit, save_dit

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**BASE, **SHAPES[shape]}))
    model = load_dit(folder, allow_new=True, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0.0, 0.02, generator=gen)
    save_dit(cast(model, dtype=getattr(torch, dtype)), folder)
    return folder


# ----------------------------------------------------------------------------------------- sampling


def sample_cases(folder: Path, name: str, device: str, dtype: str, trajectories: list, *, batches: list[int], steps: int,
                 repeats: int, noise_level: float, **_: Any) -> list[dict]:
    """The ode and sde cases of each batch (see the module docstring); ``trajectories`` receives the
    SDE outputs of the largest batch."""
    bound = None
    out = []
    for batch in batches:
        seconds, model = _sample_batch(folder, device, dtype, batch, steps, repeats, noise_level,
                                       trajectories if batch == max(batches) else [])  # fmt: skip
        if bound is None and device.startswith("cuda"):
            bound = _sampling_bound(model, steps)
        for mode in ("ode", f"sde a={noise_level} logprobs"):
            case = {"case": f"{name} sample {mode} batch={batch} steps={steps}", "metric": "images_per_s",
                    "noria": batch / seconds[mode.split()[0]], "peers": {"diffusers_pipeline": batch / seconds["pipeline"]}}  # fmt: skip
            if bound is not None:
                case["bound"] = bound
            out.append(case)
    _free(device)
    return out


def _sample_batch(folder: Path, device: str, dtype: str, batch: int, steps: int, repeats: int,
                  noise_level: float, trajectories: list) -> tuple[dict[str, float], Any]:
    """Seconds of the engine's ODE and SDE runs and of the diffusers loop at one batch size, and the
    model. The diffusers loop runs the engine's own module: one copy of the weights, so the sides
    differ in their loops alone."""
    from noria.config import EngineConfig
    from noria.diffusion.engine import DiffusionEngine

    engine = DiffusionEngine.from_path(folder, EngineConfig(max_running_requests=batch), dtype, device)
    try:
        return _best({
            "ode": lambda: _engine_images(engine, batch, steps, 0.0),
            "sde": lambda: trajectories.__setitem__(slice(None), _engine_images(engine, batch, steps, noise_level)),
            "pipeline": lambda: pipeline_images(engine.model, batch, steps, device),
        }, repeats), engine.model  # fmt: skip
    finally:
        engine.shutdown()


def _engine_images(engine: Any, batch: int, steps: int, noise_level: float) -> list:
    from noria.diffusion.protocol import ImageRequest

    requests = [ImageRequest(label=i % 10, seed=i, steps=steps, noise_level=noise_level) for i in range(batch)]
    outs = engine.generate_batch(requests, timeout_s=3600)
    bad = [o.finish_reason for o in outs if not o.finished_ok]
    if bad:
        raise RuntimeError(f"the engine failed {len(bad)} of {batch} images: {bad[0]}")
    return outs


@torch.no_grad()
def pipeline_images(model: Any, batch: int, steps: int, device: str) -> torch.Tensor:
    """``DiTPipeline.__call__``'s loop (guidance 1, latents out) with the flow-matching scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.utils.torch_utils import randn_tensor

    c, size = model.config.in_channels, model.config.sample_size
    generator = torch.Generator(device).manual_seed(0)
    latents = randn_tensor((batch, c, size, size), generator=generator, device=torch.device(device), dtype=model.dtype)
    labels = torch.arange(batch, device=device) % model.config.num_embeds_ada_norm
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(steps, device=device)
    for t in scheduler.timesteps:
        timesteps = t[None].to(device).expand(batch)
        noise_pred = model(latents, timestep=timesteps, class_labels=labels).sample
        latents = scheduler.step(noise_pred[:, :c], t, latents).prev_sample
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return latents


def _sampling_bound(model: Any, steps: int) -> float:
    """Images/s of matmuls alone at the measured bf16 GEMM rate (see the module docstring)."""
    from noria.bench.gpu_common import bf16_matmul_rate

    return bf16_matmul_rate() / (steps * dit_flops_per_image(model))


def dit_flops_per_image(model: Any) -> float:
    """Forward FLOPs of one image through the DiT: 2 x (linear weights x tokens) + attention's two
    products (4 x tokens^2 x width per layer)."""
    c = model.config
    tokens = (c.sample_size // c.patch_size) ** 2
    width = c.num_attention_heads * c.attention_head_dim
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    # attention and MLP weights (and the last projection) see every token; the adaLN and
    # embedding weights see one conditioning vector per image
    token_linear = sum(m.weight.numel() for n, m in linears if ("transformer_blocks" in n and "norm" not in n) or n == "proj_out_2")
    linear = sum(m.weight.numel() for _, m in linears)
    return 2.0 * (token_linear * tokens + (linear - token_linear)) + 4.0 * tokens * tokens * width * c.num_layers


# ----------------------------------------------------------------------------------------- training


def train_cases(folder: Path, name: str, device: str, dtype: str, trajectories: list, *, steps: int, train_images: int,
                micro_batch: int | None, repeats: int, noise_level: float, **_: Any) -> list[dict]:
    """The sft and flow_grpo cases (see the module docstring)."""
    from noria.config import DiffusionConfig

    dcfg = DiffusionConfig(steps=steps, noise_level=noise_level)
    trainer = _trainer(folder, "sft", device, dtype, dcfg, micro_batch or train_images)
    x, labels = _clean_latents(trainer.model, train_images)
    sft = _best({"sft": lambda: trainer.sft_step(x, labels)}, repeats)["sft"]
    trainer = None  # freed before the next side loads its model
    _free(device)
    loop = _best({"loop": _diffusers_train_loop(folder, device, dtype, x, labels, micro_batch or train_images)}, repeats)["loop"]
    _free(device)
    samples = _rl_samples(folder, device, dtype, trajectories, train_images, steps, noise_level)
    trainer = _trainer(folder, "rl", device, dtype, dcfg, micro_batch or train_images * steps)
    advantages = [(-1.0) ** i for i in range(len(samples))]
    rl = _best({"rl": lambda: trainer.rl_steps(samples, advantages, 1)}, repeats)["rl"]
    trainer = None
    _free(device)
    n = len(samples)
    return [
        {"case": f"{name} train sft images={train_images}", "metric": "samples_per_s", "noria": train_images / sft,
         "peers": {"diffusers_train_loop": train_images / loop}},
        {"case": f"{name} train flow_grpo images={n} steps={steps}", "metric": "samples_per_s", "noria": n / rl,
         "peers": {}},
    ]  # fmt: skip


def _trainer(folder: Path, algorithm: str, device: str, dtype: str, dcfg: Any, micro_batch: int) -> Any:
    from noria.config import TrainConfig
    from noria.diffusion.trainer import DiffusionTrainer

    cfg = TrainConfig(algorithm=algorithm, device=device, param_dtype=dtype, micro_batch_tokens=micro_batch)
    cfg.optim.lr = 1e-5
    cfg.validate()
    trainer = DiffusionTrainer(cfg, dcfg)
    trainer.init(folder)
    return trainer


def _clean_latents(model: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    c, size = model.config.in_channels, model.config.sample_size
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(n, c, size, size, generator=gen) * 2 - 1
    return x, torch.arange(n) % model.config.num_embeds_ada_norm


def _diffusers_train_loop(folder: Path, device: str, dtype: str, x: torch.Tensor, labels: torch.Tensor, micro: int):
    """One flow-matching step as diffusers' training scripts write it (see the module docstring)."""
    from noria.diffusion.model import load_dit

    model = load_dit(folder, torch.float32, device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    c = model.config.in_channels

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for lo in range(0, len(x), micro):
            x0, y = x[lo : lo + micro].to(device), labels[lo : lo + micro].to(device)
            sigma = torch.sigmoid(torch.randn(len(x0), device=device))
            noise = torch.randn_like(x0)
            s = sigma.view(-1, 1, 1, 1)
            with autocast:
                pred = model((1 - s) * x0 + s * noise, timestep=sigma * 1000, class_labels=y).sample[:, :c]
            loss = torch.nn.functional.mse_loss(pred.float(), noise - x0) * len(x0) / len(x)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def _rl_samples(folder: Path, device: str, dtype: str, trajectories: list, n: int, steps: int, noise_level: float) -> list:
    """``n`` trajectory Samples from the sampling part's SDE outputs (sampled now when it did not run)."""
    from noria.diffusion.rollout import generate_fn
    from noria.rollout import LocalEngineClient, RolloutContext
    from noria.types import Sample

    if len(trajectories) < n:
        from noria.config import EngineConfig
        from noria.diffusion.engine import DiffusionEngine

        engine = DiffusionEngine.from_path(folder, EngineConfig(max_running_requests=n), dtype, device)
        try:
            ctx = RolloutContext(LocalEngineClient(engine), None, None, seed=0)
            gen = generate_fn(steps, noise_level, 1.0)
            samples = [Sample(prompt_ids=[i % 10], group_id=0, index=i) for i in range(n)]

            async def generate() -> list:
                return await asyncio.gather(*(gen(ctx, s) for s in samples))

            return asyncio.run(generate())
        finally:
            engine.shutdown()
    return [_sample(out, i, steps, noise_level) for i, out in enumerate(trajectories[:n])]


def _sample(out: Any, i: int, steps: int, noise_level: float) -> Any:
    from noria.types import Sample

    s = Sample(prompt_ids=[i % 10], group_id=0, index=i, response_ids=list(range(steps)), loss_mask=[1] * steps)
    s.rollout_logprobs, s.weight_versions, s.latents = list(out.logprobs), list(out.weight_versions), out.latents
    s.metadata["diffusion"] = {"steps": steps, "noise_level": noise_level, "shift": 1.0, "seed": i}
    return s


# ----------------------------------------------------------------------------------------- timing


def _best(sides: dict[str, Any], repeats: int) -> dict[str, float]:
    """Seconds of the fastest call of each side: one warm-up call each, then ``repeats`` rounds of
    one call of every side in turn."""
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(max(1, repeats)):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
