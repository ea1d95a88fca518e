"""On-policy distillation: the teacher's numbers by both paths, the advantage shaping, the checks.

Real parts only: the built-in engine in process and as a ``noria serve`` process (prefill scoring
over HTTP), the trainer backend with its frozen teacher, the RL step. CPU, tiny random models.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from engine_server_util import ServeProcess
from exact_util import tiny_folder

from noria import hardware
from noria.config import ConfigError, EngineConfig, TrainConfig, load_config
from noria.distill.teacher import EngineTeacher, check_tokenizers
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.errors import NoriaError
from noria.models import load_model
from noria.rollout import HttpEngineClient
from noria.rollout.buffer import group_from_dict, group_to_dict
from noria.train.fsdp import FSDPBackend
from noria.train.opd import shape_advantages, token_kl, topk_kl
from noria.train.rl_step import rl_step
from noria.types import Group, Prompt, Sample, Status

DTYPE = hardware.auto_dtype("cpu")  # float32 on AVX2-only CPUs (NORIA_CPU_ISA=avx2), else bf16
T = 0.8  # rollout temperature: every path scores at it


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(kv_cache_tokens=4096, block_size=4, chunked_prefill_size=24, max_batch_tokens=48, deterministic=True, **kw)


def student_samples(folder, n: int = 4, new_tokens: int = 12) -> list[Sample]:
    """Samples of ``folder``'s model from a deterministic engine at temperature T (prompts of several lengths)."""
    engine = Engine(load_model(folder, dtype=getattr(torch, DTYPE)), None, engine_config())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 290, (k,), generator=gen).tolist() for k in (5, 17, 30, 41)[:n]]
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=new_tokens, temperature=T, seed=i, ignore_eos=True)) for i, p in enumerate(prompts)]
    try:
        outs = engine.generate_batch(reqs)
    finally:
        engine.shutdown()
    return [
        Sample(prompt_ids=p, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids), rollout_logprobs=o.logprobs,
               weight_versions=o.weight_versions, reward=float(i % 2), status=Status.COMPLETED, group_id=0, index=i)
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]  # fmt: skip


def trainer(student, teacher) -> FSDPBackend:
    cfg = TrainConfig(param_dtype=DTYPE, algorithm="rl", teacher=str(teacher))
    cfg.optim.lr = 1e-5
    backend = FSDPBackend(cfg, deterministic=True, temperature=T)
    backend.init(student)
    return backend


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    student = tiny_folder("llama", root / "student")
    torch.manual_seed(7)  # another random model of the same shape and vocabulary: the teacher
    teacher = load_model(student, dtype=torch.float32)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    from noria.models import save_model

    return student, str(save_model(teacher, root / "teacher"))


def test_engine_teacher_equals_trainer_teacher_bitwise(models, tmp_path):
    """The teacher's logprobs of the student's tokens: by prefill on a `noria serve` (HTTP, SGLang's
    fields) and in process, and by the trainer's frozen teacher: the same bits (deterministic mode)."""
    student, teacher = models
    samples = student_samples(student)
    by_trainer = [list(s) for s in _trainer_scores(student, teacher, samples)]
    server = ServeProcess(teacher, "--engine.deterministic", "true", "--dtype", DTYPE, "--engine.block_size", "4",
                          "--engine.chunked_prefill_size", "24", log_dir=tmp_path).wait_ready()  # fmt: skip
    try:
        scorer = EngineTeacher({None: HttpEngineClient(server.url)}, temperature=T)
        http = [Sample(**{**_fields(s), "teacher_logprobs": None}) for s in samples]
        asyncio.run(_score_all(scorer, http))
        raw = _raw_scoring(server.url, samples[0])
    finally:
        server.stop()
    local = Engine(load_model(teacher, dtype=getattr(torch, DTYPE)), None, engine_config())
    try:
        in_process = [
            local.generate_batch([GenerateRequest(s.prompt_ids + s.response_ids, SamplingParams(max_new_tokens=0, temperature=T),
                                                  logprob_start_len=len(s.prompt_ids))])[0].input_logprobs
            for s in samples
        ]  # fmt: skip
    finally:
        local.shutdown()
    assert [s.teacher_logprobs for s in http] == by_trainer
    assert raw == by_trainer[0]
    assert in_process == by_trainer
    assert all(s.teacher_logprobs != s.rollout_logprobs for s in http)  # another model: other numbers


def _raw_scoring(url: str, s: Sample) -> list[float]:
    """SGLang's wire format: input_token_logprobs from logprob_start_len, top-k per position; a
    start outside the prompt is a 400 naming the field."""
    import httpx

    body = {"input_ids": s.prompt_ids + s.response_ids, "sampling_params": {"max_new_tokens": 0, "temperature": T},
            "return_logprob": True, "logprob_start_len": len(s.prompt_ids), "top_logprobs_num": 2}  # fmt: skip
    info = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    assert info["completion_tokens"] == 0 and len(info["input_top_logprobs"]) == len(s.response_ids)
    assert [e[1] for e in info["input_token_logprobs"]] == s.response_ids
    bad = httpx.post(f"{url}/generate", json={**body, "logprob_start_len": len(body["input_ids"])}, timeout=60)
    assert bad.status_code == 400 and "logprob_start_len" in bad.text
    return [e[0] for e in info["input_token_logprobs"]]


def _fields(s: Sample) -> dict:
    return {k: getattr(s, k) for k in Sample.__dataclass_fields__}


async def _score_all(scorer: EngineTeacher, samples: list[Sample]) -> None:
    await asyncio.gather(*(scorer.score(s) for s in samples))
    await scorer.aclose()


def _trainer_scores(student, teacher, samples: list[Sample]) -> list[list[float]]:
    from noria.train.opd import score_in_trainer

    copies = [Sample(**{**_fields(s), "teacher_logprobs": None}) for s in samples]
    assert score_in_trainer(trainer(student, teacher), copies) > 0
    return [s.teacher_logprobs for s in copies]


def test_reverse_kl_is_zero_when_teacher_is_student(models):
    """Teacher = student, deterministic: every token's reverse KL is exactly 0, so OPD changes no advantage."""
    student, _ = models
    samples = student_samples(student)
    backend = trainer(student, student)
    cfg = backend.cfg
    cfg.loss.opd_coef, cfg.steps_per_rollout = 1.0, 1
    metrics = rl_step(backend, [Group(0, Prompt("p"), tuple(samples))], cfg, weight_version=0)
    assert metrics["opd/reverse_kl_mean"] == 0.0 and metrics["opd/reverse_kl_max"] == 0.0
    assert metrics["time/teacher_s"] > 0
    assert all(s.teacher_logprobs == s.rollout_logprobs for s in samples)


def test_advantage_shaping_and_records():
    s = Sample(prompt_ids=[1, 2], response_ids=[5, 6, 7], loss_mask=[1, 0, 1], rollout_logprobs=[-1.0, 0.0, -2.0],
               teacher_logprobs=[-1.5, 0.0, -1.0], reward=1.0, status=Status.COMPLETED)  # fmt: skip
    assert token_kl(s) == [0.5, 0.0, -1.0]
    shaped, m = shape_advantages([s], [2.0], coef=0.5, pure=False)
    assert shaped == [[1.75, 2.0, 2.5]] and m == {"opd/reverse_kl_mean": -0.25, "opd/reverse_kl_max": 0.5}
    assert shape_advantages([s], [2.0], coef=0.5, pure=True)[0] == [[-0.25, -0.0, 0.5]]
    with pytest.raises(ValueError, match="no teacher logprob"):
        token_kl(Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[-1.0]))
    # top-k: equal lists give 0, a teacher that prefers another token gives a positive KL.
    same = [(3, -0.1), (4, -2.5)]
    assert topk_kl(same, same) == 0.0
    assert topk_kl(same, [(4, -0.1), (3, -2.5)]) > 1.0
    # The buffer's JSON state (checkpoints) keeps the teacher's numbers exactly.
    s.teacher_top_logprobs = [[(3, -0.25)], [], [(9, -1.0 / 3)]]
    back = group_from_dict(group_to_dict(Group(0, Prompt("p"), (s,)))).samples[0]
    assert back.teacher_logprobs == s.teacher_logprobs
    assert [[tuple(e) for e in step] for step in back.teacher_top_logprobs] == s.teacher_top_logprobs


def test_tokenizer_mismatch_is_refused_naming_both(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from noria.models import load_tokenizer

    student = load_tokenizer(tiny_model_dir)
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["<extra>"])
    with pytest.raises(NoriaError, match=r"teacher big-teacher and the student small-student differ .*vocabulary"):
        check_tokenizers(student, other, "big-teacher", "small-student")
    check_tokenizers(student, load_tokenizer(tiny_model_dir), "t", "s")  # the same tokenizer passes


def test_opd_config_checks(tiny_model_dir):
    base = ["--model.path", str(tiny_model_dir), "--data.task", "arithmetic", "--reward.name", "exact_match"]
    with pytest.raises(ConfigError, match="needs a teacher"):
        load_config(None, [*base, "--train.loss.opd_coef", "0.5"])
    with pytest.raises(ConfigError, match="opd_coef is 0"):
        load_config(None, [*base, "--opd.teacher", str(tiny_model_dir)])
    with pytest.raises(ConfigError, match="top_k compares .*placement: engine"):
        load_config(None, [*base, "--train.loss.opd_coef", "1", "--opd.teacher", "x", "--opd.top_k", "5"])
    c = load_config(None, [*base, "--train.loss.opd_coef", "1", "--opd.teacher", str(tiny_model_dir)])
    assert c.train.teacher == str(tiny_model_dir)  # the trainer's frozen teacher
    assert math.isclose(c.train.loss.opd_coef, 1.0)


def sft_teacher(model_dir, out_dir, steps: int = 40) -> str:
    """A tiny teacher: the tiny model after a few SFT steps on chats whose answers are digits only."""
    from noria.data.tasks import generate_split
    from noria.train.losses import sft_loss
    from noria.train.packing import pack_samples
    from noria.train.sft import chat_samples
    from train_util import make_backend

    tok = load_tokenizer_of(model_dir)
    prompts = generate_split("arithmetic", "train", {"n_train": 64, "n_test": 16, "max_operand": 30, "ops": ["+"]})
    rows = [[{"role": "user", "content": p.prompt}, {"role": "assistant", "content": str(p.label)}] for p in prompts]
    samples = chat_samples(rows, tok)
    backend = make_backend(model_dir, loss_fn=sft_loss, param_dtype=DTYPE)
    for step in range(steps):
        batch = [samples[(step * 16 + i) % len(samples)] for i in range(16)]
        backend.train_step(pack_samples(batch, [1.0] * len(batch)))
    return str(backend.export_hf(out_dir))


def load_tokenizer_of(folder):
    from noria.models import load_tokenizer

    return load_tokenizer(folder)


def run_args(model, **extra) -> list[str]:
    base = {
        "model.path": str(model), "data.task": "arithmetic",
        "data.task_args": "{n_train: 400, n_test: 16, max_operand: 30, ops: ['+']}", "reward.name": "toy_rewards:digits",
        "rollout.n_samples": 4, "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 8, "train.optim.lr": "3e-3",
        "engine.kv_cache_tokens": 4096,
    }  # fmt: skip
    base.update(extra)
    return [x for k, v in base.items() for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def rewards_of(run) -> list[float]:
    import json

    return [json.loads(x)["rollout/reward_mean"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_distilled_student_approaches_its_teacher(tiny_model_dir, tmp_path):
    """Pure distillation (the reverse KL is the only signal; the digits reward is only measured): a
    random tiny student moves from its own score to near the SFT-trained teacher's; teacher
    scoring on a `noria serve` engine with the top-k variant runs too."""
    from noria.launch.rl import run_rl

    teacher = sft_teacher(tiny_model_dir, tmp_path / "teacher")
    run_rl(load_config(None, run_args(teacher, **{"train.max_steps": 2, "train.optim.lr": 0})), run_dir=str(tmp_path / "t"), progress=False)
    teacher_score = sum(rewards_of(tmp_path / "t")) / 2
    run = tmp_path / "opd"
    opd = {"train.max_steps": 50, "train.loss.opd_coef": 1.0, "opd.pure": True, "opd.teacher": teacher, "train.optim.lr": "1e-2"}
    run_rl(load_config(None, run_args(tiny_model_dir, **opd)), run_dir=str(run), progress=False)
    student = rewards_of(run)
    assert teacher_score > 0.8, teacher_score
    assert sum(student[:3]) / 3 < teacher_score - 0.3, (student, teacher_score)
    # Reached: some 6 consecutive steps of the second half average near the teacher. Not the last 6: at
    # this learning rate the tiny student learns in 50 steps but is not stable once there; measured on
    # the 2-core EPYC, it scored 0.91-1.0 at steps 35-39, then 0.0 at steps 41-42, then 1.0 again by 47
    # (the prefix-tree packing; prompt-only packing: a dip to 0.47 at step 48). Any change of summation
    # order moves where the dips fall.
    windows = [sum(student[i : i + 6]) / 6 for i in range(len(student) // 2, len(student) - 5)]
    assert max(windows) > teacher_score - 0.2, (student, teacher_score)
    # The engine path (a teacher `noria serve` the run starts) with the top-k variant, two steps.
    run = tmp_path / "engine"
    extra = {"train.max_steps": 2, "opd.placement": "engine", "opd.top_k": 4}
    run_rl(load_config(None, run_args(tiny_model_dir, **{**opd, **extra})), run_dir=str(run), progress=False)
    import json

    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["opd/reverse_kl_mean"] > 0 and row["opd/teacher_latency_s"] > 0 and "time/teacher_s" not in row
