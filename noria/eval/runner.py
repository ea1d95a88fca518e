"""``run_eval``: the body of ``noria eval`` (see the package docstring for the flow)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from noria.config import RunConfig, save_config
from noria.errors import NoriaError
from noria.metrics import Progress
from noria.types import Prompt, Sample, Status

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class EvalResult:
    """Figures of one evaluation (written to eval.json)."""

    model: str
    data: str
    split: str
    n_prompts: int
    n_samples: int
    n_scored: int
    n_failed: int
    accuracy: float | None
    dropped_long_prompts: int
    truncated: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    failed_reasons: dict[str, int] = field(default_factory=dict)
    run_dir: str = ""


def run_eval(config: RunConfig, run_dir: str | None = None, output: str | None = None, progress: bool = True) -> EvalResult:
    """Evaluate ``config.model`` on ``config.data``'s ``config.eval.split``; print and save the result."""
    from noria.data import load_prompts
    from noria.data.vision_chat import load_processor
    from noria.models import load_tokenizer
    from noria.models.catalog import model_path

    cfg = config.eval
    prompts = load_prompts(config.data, cfg.split)  # validates every row before any model loads
    if cfg.limit is not None:
        prompts = prompts[: cfg.limit]
    folder = model_path(config.model.path)
    tokenizer = load_tokenizer(folder)
    prompt_ids, kept, dropped = _render(prompts, load_processor(folder) or tokenizer, config)  # a VLM's processor: images
    out_dir = _run_dir(config, run_dir)
    save_config(config, out_dir / "config.yaml")

    generate = _generate_engine if _runs_on_engine(folder, config) else _generate_hf
    start = time.perf_counter()
    samples = generate(folder, tokenizer, prompt_ids, kept, config, progress)
    seconds = time.perf_counter() - start
    counts = _score(samples, kept, config)

    result = _summarise(config, samples, counts, len(kept), dropped, seconds, out_dir)
    _write(result, samples, kept, out_dir, output)
    _print_table(result)
    check_scored(samples, f"evaluation ({out_dir / 'samples.jsonl'})")
    return result


def accuracy(samples: list[Sample]) -> float | None:
    """Mean reward over every answer; an answer without a reward (its reward failed, or its generation
    was aborted) counts as wrong, so failures cannot raise accuracy. None when there is no answer."""
    return sum(s.reward or 0.0 for s in samples) / len(samples) if samples else None


def check_scored(samples: list[Sample], what: str) -> None:
    """NoriaError when not one of ``samples`` got a reward: the figure would measure nothing."""
    if samples and all(s.reward is None for s in samples):
        reasons = Counter(s.status_reason or s.status.value for s in samples).most_common(1)
        raise NoriaError(f"{what}: every one of the {len(samples)} answers failed to score; most common: {reasons[0][0]}")


def _render(prompts: list[Prompt], tokenizer, config: RunConfig):
    from noria.data import drop_long, render_prompts

    rendered = render_prompts(prompts, tokenizer, config.data.chat_template, config.data.system_prompt)
    kept, dropped = drop_long(rendered, config.data.max_prompt_tokens)
    if dropped:
        log.warning("dropped %d prompts longer than data.max_prompt_tokens=%s", dropped, config.data.max_prompt_tokens)
    if not kept:
        raise NoriaError(f"no prompts left to evaluate ({len(prompts)} loaded, {dropped} over data.max_prompt_tokens)")
    return [r.ids for r in kept], [r.prompt for r in kept], dropped


def _run_dir(config: RunConfig, run_dir: str | None) -> Path:
    folder = run_dir or config.run_dir or f"runs/eval-{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _runs_on_engine(folder: Path, config: RunConfig) -> bool:
    """The built-in engine serves native architectures (vision-language ones too); anything else goes
    through transformers."""
    from noria.engine import serves_natively

    return serves_natively(folder, config.model.impl)


def _generate_engine(folder: Path, tokenizer, prompt_ids: list[list[int]], prompts: list[Prompt], config: RunConfig, progress: bool):
    """All answers submitted at once to the built-in engine, which batches them continuously."""
    import queue

    from noria.engine import Engine, GenerateRequest, SamplingParams

    cfg = config.eval
    engine = Engine.from_path(folder, config.engine, dtype=config.model.dtype, device=config.model.device)
    images = _prompt_images(engine, folder, prompt_ids, prompts)
    done: queue.SimpleQueue = queue.SimpleQueue()
    jobs = [(g, k) for g in range(len(prompt_ids)) for k in range(cfg.n_samples)]
    try:
        for i, (g, k) in enumerate(jobs):
            params = SamplingParams(
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=None if cfg.temperature == 0 else cfg.seed * 1_000_003 + i,  # reproducible per answer
            )
            req = GenerateRequest(input_ids=prompt_ids[g], sampling=params, images=images(g))
            engine.submit(req, lambda out, i=i: done.put((i, out)))
        outputs: list = [None] * len(jobs)
        with Progress(len(jobs), "eval", "answer", progress) as bar:  # tqdm on a terminal, else plain lines
            for _ in jobs:
                i, out = done.get()
                outputs[i] = out
                bar.update(1)
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return [_engine_sample(prompt_ids[g], out, tokenizer, g, k, prompts[g]) for (g, k), out in zip(jobs, outputs)]


def _prompt_images(engine, folder: Path, prompt_ids: list[list[int]], prompts: list[Prompt]):
    """``g -> `` the engine's image inputs of prompt ``g`` (none for a text prompt), made once each."""
    from functools import cache

    from noria.data.vision_chat import image_data, prompt_images
    from noria.engine.vision import ImagePrompts

    inputs = ImagePrompts(engine.model, folder)

    @cache
    def images(g: int) -> list:
        refs = prompt_images(prompts[g])
        return inputs.from_data(list(prompt_ids[g]), image_data(refs)) if refs else []

    return images


def _engine_sample(prompt: list[int], out, tokenizer, group: int, index: int, record: Prompt) -> Sample:
    reason = (out.finish_reason or {}).get("type")
    status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}.get(reason, Status.ABORTED)
    return Sample(
        prompt_ids=prompt,
        response_ids=list(out.output_ids),
        loss_mask=[1] * len(out.output_ids),
        rollout_logprobs=list(out.logprobs),
        weight_versions=list(out.weight_versions),
        response_text=tokenizer.decode(out.output_ids, skip_special_tokens=True),
        status=status,
        status_reason="" if status is not Status.ABORTED else str((out.finish_reason or {}).get("message", "")),
        group_id=group,
        index=index,
        metadata=dict(record.metadata),
    )


def _generate_hf(folder: Path, tokenizer, prompt_ids: list[list[int]], prompts: list[Prompt], config: RunConfig, progress: bool):
    torch.manual_seed(config.eval.seed)
    return _generate(_load_hf_model(folder, config), tokenizer, prompt_ids, prompts, config, progress)


def _load_hf_model(folder: Path, config: RunConfig):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[config.model.dtype])
    return model.to(config.model.device).eval()


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.inference_mode()
def _generate(model, tokenizer, prompt_ids: list[list[int]], prompts: list[Prompt], config: RunConfig, progress: bool):
    """Batched left-padded generation; prompts are sorted by length so batches pad little."""
    cfg = config.eval
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    jobs = [(g, k) for g in range(len(prompt_ids)) for k in range(cfg.n_samples)]
    jobs.sort(key=lambda job: len(prompt_ids[job[0]]))
    samples: list[Sample | None] = [None] * len(jobs)
    bar = Progress(len(jobs), "eval", "answer", progress)
    for start in range(0, len(jobs), cfg.batch_size):
        batch = jobs[start : start + cfg.batch_size]
        rows = [prompt_ids[g] for g, _ in batch]
        outputs = _generate_batch(model, rows, pad, eos, cfg, config.model.device)
        for (g, k), (job_index, out) in zip(batch, enumerate(outputs, start)):
            samples[job_index] = _to_sample(prompt_ids[g], out, eos, tokenizer, g, k, prompts[g])
        bar.update(len(batch))
    bar.close()
    return sorted(samples, key=lambda s: (s.group_id, s.index))


def _generate_batch(model, rows: list[list[int]], pad: int, eos: list[int], cfg, device: str) -> list[list[int]]:
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p} if cfg.temperature > 0 else {"do_sample": False}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        top_k=None,
        **sampling,
    )
    return out[:, width:].tolist()


def _to_sample(prompt: list[int], generated: list[int], eos: list[int], tokenizer, group: int, index: int, record: Prompt) -> Sample:
    stop = next((i for i, t in enumerate(generated) if t in eos), None)
    response = generated if stop is None else generated[: stop + 1]
    text_ids = response if stop is None else response[:-1]
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=[1] * len(response),
        response_text=tokenizer.decode(text_ids, skip_special_tokens=True),
        status=Status.TRUNCATED if stop is None else Status.COMPLETED,
        group_id=group,
        index=index,
        metadata=dict(record.metadata),
    )


def _score(samples: list[Sample], prompts: list[Prompt], config: RunConfig):
    from noria.rewards import resolve_reward, score
    from noria.rewards.registry import eval_reward

    return score(
        samples, eval_reward(resolve_reward(config)), labels=[prompts[s.group_id].label for s in samples],
        prompts=[prompts[s.group_id].prompt for s in samples],
    )  # fmt: skip


def _summarise(config, samples, counts, n_prompts, dropped, seconds, out_dir) -> EvalResult:
    scored = [s.reward for s in samples if s.reward is not None]
    failed_reasons = Counter(s.status_reason.split(":")[0] for s in samples if s.status is Status.FAILED)
    tokens = sum(len(s.response_ids) for s in samples)
    return EvalResult(
        model=config.model.path,
        data=config.data.task or config.data.test_path or config.data.path or "",
        split=config.eval.split,
        n_prompts=n_prompts,
        n_samples=len(samples),
        n_scored=len(scored),
        n_failed=len(samples) - len(scored),
        accuracy=accuracy(samples),
        dropped_long_prompts=dropped,
        truncated=sum(s.status is Status.TRUNCATED for s in samples),
        generated_tokens=tokens,
        seconds=round(seconds, 3),
        tokens_per_s=round(tokens / seconds, 1) if seconds > 0 else 0.0,
        failed_reasons=dict(failed_reasons),
        run_dir=str(out_dir),
    )


def _write(result: EvalResult, samples: list[Sample], prompts: list[Prompt], out_dir: Path, output: str | None) -> None:
    text = json.dumps(asdict(result), indent=2)
    (out_dir / "eval.json").write_text(text + "\n")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")
    with open(out_dir / "samples.jsonl", "w") as f:
        for s in samples:
            row = {
                "group_id": s.group_id,
                "index": s.index,
                "prompt": prompts[s.group_id].prompt if isinstance(prompts[s.group_id].prompt, str) else list(prompts[s.group_id].prompt),
                "label": prompts[s.group_id].label,
                "response": s.response_text,
                "reward": s.reward,
                "status": s.status.value,
                "status_reason": s.status_reason,
                "response_tokens": len(s.response_ids),
            }
            f.write(json.dumps(row, default=str) + "\n")


def _print_table(r: EvalResult) -> None:
    accuracy = "n/a" if r.accuracy is None else f"{100 * r.accuracy:.1f}%"
    rows = [
        ("model", r.model),
        ("data", f"{r.data} ({r.split})"),
        ("prompts", r.n_prompts),
        ("answers", r.n_samples),
        ("accuracy", accuracy),
        ("reward failed", f"{r.n_failed} {r.failed_reasons or ''}".strip()),
        ("truncated", r.truncated),
        ("dropped (too long)", r.dropped_long_prompts),
        ("generated tokens", r.generated_tokens),
        ("seconds", f"{r.seconds:.1f}"),
        ("tokens/s", f"{r.tokens_per_s:.1f}"),
        ("written to", r.run_dir),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
