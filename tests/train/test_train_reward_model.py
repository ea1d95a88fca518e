"""A scalar reward model trained by `noria train` (train.algorithm reward_model), on the tiny random model.

One run of the job raises the held-out pairwise accuracy it records in eval.jsonl: the tiny random
model cannot add, so its pairs (arithmetic prompts) prefer what the prompt asks for, a boxed answer
or the bare number, which it learns within a few dozen steps and applies to prompts it never saw
(about 50% before: the two kinds of pair pull a fixed preference both ways). The run's final folder
loads with transformers' AutoModelForSequenceClassification, and its scores equal what the scalar
reward (reward.model.kind scalar, in process) gives the same prompt and response. Pairs made from
the arithmetic task prefer the right answer. A step whose micro-batches cut pairs in two takes the
same update as one that keeps them whole. Bad pair rows and unsupported configs are refused naming
the file, line and field, or the key.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from noria.config import RunConfig, load, load_config
from noria.data.pairs import MAX_OFFSET, read_pairs
from noria.errors import NoriaError
from noria.launch.sft import run_sft

TASK = {"n_train": 40, "n_test": 12, "seed": 0, "ops": ["+"], "max_operand": 20}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def format_pairs(held_out: bool) -> list[dict]:
    """Addition prompts asking for a boxed answer or the bare number; the answer in the asked form is chosen."""
    rows = []
    for a in range(24):
        for b in range(0, 24, 3):
            if ((a + b) % 5 == 0) != held_out:  # held-out prompts are never trained on
                continue
            boxed, n = random.Random(a * 100 + b).random() < 0.5, a + b
            ask = "Put the final answer in \\boxed{}." if boxed else "Answer with the number only."
            answers = (f"\\boxed{{{n}}}", f"{n}") if boxed else (f"{n}", f"\\boxed{{{n}}}")
            rows.append({"prompt": f"What is {a} + {b}? {ask}", "chosen": answers[0], "rejected": answers[1]})
    return rows


def write_pairs(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rm_args(model_dir, **overrides) -> list[str]:
    fields = {
        "model.path": model_dir, "model.dtype": "float32", "train.algorithm": "reward_model", "train.global_batch": 8,
        "train.max_steps": 40, "data.epochs": 4, "train.optim.lr": 3e-3, "train.micro_batch_tokens": 4096,
        "eval.every": 20, "eval.batch_size": 64, "seed": 0,
    }  # fmt: skip
    fields.update(overrides)
    return [a for k, v in fields.items() for a in (f"--{k}", str(v))]


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    data = {"data.path": write_pairs(tmp / "train.jsonl", format_pairs(False)), "data.test_path": write_pairs(tmp / "test.jsonl", format_pairs(True))}
    return run_sft(load_config(None, rm_args(tiny_model_dir, **data)), run_dir=str(tmp / "run"), progress=False)


def test_reward_model_learns_the_held_out_pairs(rm_run):
    evals = [json.loads(line) for line in (rm_run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 20, 40] and all(e["n_pairs"] == len(format_pairs(True)) for e in evals)
    before, after = evals[0]["pair_accuracy"], evals[-1]["pair_accuracy"]
    assert before <= 0.7 and after >= 0.9 and evals[-1]["loss"] < evals[0]["loss"], evals
    rows = [json.loads(line) for line in (rm_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41)) and {"loss", "pair_accuracy", "margin"} <= set(rows[0])
    assert (rm_run / "checkpoints" / "step-000040").is_dir()  # what --resume extends the run from


def test_its_report_has_the_reward_model_page(rm_run, tmp_path):
    """``noria report`` of a reward-model run: its own plots (pairwise loss, pair accuracy and margin,
    gradient norm and learning rate, tokens/s), every metric they plot documented, and the held-out
    pair accuracy in the summary (an RL page would look for an accuracy these rows do not have)."""
    import html

    from noria.metric_names import undocumented
    from noria.runview.report import RM_FIGURES, figures_of, load_run, write_report

    data = load_run(rm_run)
    assert data.algorithm == "reward_model" and figures_of(data) is RM_FIGURES
    assert undocumented(k for spec in RM_FIGURES for k in spec.keys) == []
    page = write_report(rm_run, tmp_path / "report").read_text()
    for spec in RM_FIGURES:
        assert (tmp_path / "report" / f"{spec.slug}.png").stat().st_size > 5000 and spec.title in page
    first, last = (json.loads(line) for line in (rm_run / "eval.jsonl").read_text().splitlines()[:: 2])
    summary = f"{first['pair_accuracy']:.1%} at step 0 -> {last['pair_accuracy']:.1%} at step 40"
    assert f"held-out pair accuracy</th><td>{html.escape(summary)}</td>" in page


def test_final_folder_scores_as_the_scalar_reward(rm_run, tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from noria.rewards.model import start_judge, unbind_judge
    from noria.rewards.runner import score_async
    from noria.rewards.scalar import rm_input_ids
    from noria.types import Sample, Status

    final = rm_run / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    tokenizer = AutoTokenizer.from_pretrained(final)
    pairs = format_pairs(True)[:3]
    prompts = [p["prompt"] for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p["chosen"], p["rejected"])]
    with torch.inference_mode():
        expected = [float(model(torch.tensor([rm_input_ids(tokenizer, p, r)])).logits[0, 0]) for p, r in zip(prompts, responses)]
    assert all(c > r for c, r in zip(expected[0::2], expected[1::2]))  # it learned these
    config = load(RunConfig, None, [
        "--model.path", str(tiny_model_dir), "--model.dtype", "float32", "--data.task", "arithmetic",
        "--reward.name", "numeric", "--reward.rule_weight", "0", "--reward.model.kind", "scalar", "--reward.model.name",
        "trained-rm", "--reward.model.engine", str(final), "--reward.model.in_process", "true",
    ])  # fmt: skip
    try:
        assert start_judge(config, tmp_path) == []
        samples = [Sample(prompt_ids=[1], response_text=r, status=Status.COMPLETED, group_id=0, index=i) for i, r in enumerate(responses)]
        counts = asyncio.run(score_async(samples, config.reward, [0] * len(samples), prompts=prompts))
        assert counts.scored == len(samples)
        assert [s.reward for s in samples] == pytest.approx(expected, abs=1e-4)
    finally:
        unbind_judge("trained-rm")


def test_arithmetic_pairs_prefer_the_right_answer(tiny_model_dir):
    from noria.launch.reward_model import prepare_pairs
    from noria.models import load_tokenizer
    from noria.rewards.scalar import rm_input_ids

    config = load_config(None, rm_args(tiny_model_dir, **{"data.task": "arithmetic", "data.task_args": json.dumps(TASK)}))
    data = prepare_pairs(config)
    assert len(data.pairs) == TASK["n_train"] and len(data.held_out) == TASK["n_test"]
    again = prepare_pairs(config)
    assert again.pairs == data.pairs and again.held_out == data.held_out  # seeded: the same pairs every time
    tok = load_tokenizer(tiny_model_dir)
    seen = set()
    for record, (chosen, rejected) in zip(data.records, data.pairs):
        seen.add(record.prompt)
        a, b = (int(x) for x in record.prompt.split("?")[0].removeprefix("What is ").split(" + "))
        text = tok.decode(chosen)
        assert f"\\boxed{{{a + b}}}" in text and chosen == rm_input_ids(tok, record.prompt, text.split("assistant\n")[-1].split("<|im_end|>")[0])
        wrong = int(tok.decode(rejected).split("\\boxed{")[-1].split("}")[0])
        assert wrong != a + b and abs(wrong - a - b) <= MAX_OFFSET
    held = {tok.decode(c).split("user\n")[-1].split("<|im_end|>")[0] for c, _ in data.held_out}
    assert len(held) == TASK["n_test"] and not held & seen  # held-out prompts are never trained on


def test_pairs_cut_between_micro_batches_take_the_same_step(tiny_model_dir):
    from noria.config import TrainConfig
    from noria.models import load_tokenizer
    from noria.rewards.scalar import rm_input_ids
    from noria.train.reward_model import RewardModelBackend, pack_pairs

    tok = load_tokenizer(tiny_model_dir)
    pairs = format_pairs(False)[:6]
    batch = pack_pairs([(rm_input_ids(tok, p["prompt"], p["chosen"]), rm_input_ids(tok, p["prompt"], p["rejected"])) for p in pairs])
    longest = int(torch.diff(batch.cu_seqlens).max())
    stepped = []
    for budget in (4096, longest):  # one micro-batch; then one sequence per micro-batch, every pair cut
        cfg = TrainConfig(algorithm="reward_model", param_dtype="float32", micro_batch_tokens=budget)
        cfg.optim.lr, cfg.optim.eps = 1.0, 1.0  # AdamW's first step is then about lr * g: the weights show the gradient
        backend = RewardModelBackend(cfg, seed=0)
        backend.init(tiny_model_dir, total_steps=1)
        metrics = backend.train_pairs(batch)
        stepped.append((metrics, torch.cat([p.detach().flatten() for p in backend.policy.parameters()])))
    (whole, w_whole), (cut, w_cut) = stepped
    for key in ("loss", "pair_accuracy", "margin", "grad_norm"):
        assert cut[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key
    assert (w_cut - w_whole).abs().max() < 1e-6 and whole["grad_norm"] > 1e-3


def test_bad_pair_rows_are_named(tmp_path, tiny_model_dir, capsys):
    from noria.cli import main

    good = {"prompt": "What is 1 + 1?", "chosen": "\\boxed{2}", "rejected": "\\boxed{3}"}
    path = tmp_path / "pairs.jsonl"
    rows = [good, {"prompt": "What is 2 + 2?", "chosen": "4"}, good]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(NoriaError, match=f"{path}:2: field 'rejected' is missing"):
        read_pairs(path)
    rows[1] = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "chosen": "4", "rejected": "4"}
    path.write_text("\n\n".join(json.dumps(r) for r in rows) + "\n")  # blank lines: line numbers stay the file's
    with pytest.raises(NoriaError, match=f"{path}:3: field 'rejected' is the same text as 'chosen'"):
        read_pairs(path)
    rows[1] = {"prompt": "What is 2 + 2?", "chosen": [{"role": "assistant", "content": "4"}], "rejected": 5}
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(NoriaError, match=f"{path}:2: field 'rejected': expected a string"):
        read_pairs(path)
    # through the command line: one line naming the row, before any model loads
    args = rm_args(tiny_model_dir, **{"data.path": path, "eval.every": 0})
    (tmp_path / "rm.yaml").write_text("name: rm-bad-rows\n")
    assert main(["train", str(tmp_path / "rm.yaml"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"{path}:2: field 'rejected'" in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data.task": "arithmetic", "train.backend": "megatron"}, "reward_model runs on train.backend single or fsdp2, not megatron"),
        ({"data.task": "arithmetic", "train.lora.enabled": "true"}, "train.lora.enabled is not supported"),
        ({"data.task": "arithmetic", "data.chat_template": "chat.jinja"}, "data.chat_template must be true or false"),
        ({"data.path": "pairs.jsonl"}, "eval.every > 0 with train.algorithm reward_model"),
        ({"data.path": "pairs.csv", "eval.every": 0}, "'pairs.csv' is neither a .jsonl file nor a folder"),
    ],
)
def test_config_refuses_what_a_reward_model_run_cannot_do(tiny_model_dir, overrides, message):
    with pytest.raises(NoriaError, match=message):
        load_config(None, rm_args(tiny_model_dir, **overrides))


def write_rollouts(run, groups) -> None:
    """A run folder's rollouts/step-*.jsonl in the recorded format (the fields rollout_pairs reads)."""
    (run / "rollouts").mkdir(parents=True)
    for step in (1, 2):
        rows = [{"step": step, "group_id": g, "index": i, "prompt": prompt, "label": "0", "response": text, "reward": reward,
                 "status": "completed" if reward is not None else "failed"}
                for g, (prompt, answers) in enumerate(groups) if g % 2 == step - 1 for i, (text, reward) in enumerate(answers)]  # fmt: skip
        (run / "rollouts" / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_pairs_from_a_runs_rollouts(tmp_path, tiny_model_dir):
    from noria.data.pairs import rollout_pairs
    from noria.launch.reward_model import prepare_pairs

    run = tmp_path / "grpo-run"
    groups = [(f"What is {a} + 1?", [(f"{a + 1}", 1.0), (f"{a + 2}", 0.0), (f"{a}", 0.0), ("no idea", None), (f"{a + 1}.", 1.0),
                                     (f"{a + 2}", 0.0), (f"{a + 9}", 0.0)]) for a in range(60)]  # fmt: skip
    groups.append(("What is 7 + 7?", [("14", 1.0), ("14", 1.0)]))  # one reward only: no pair
    write_rollouts(run, groups)
    train, test = rollout_pairs(run, "train"), rollout_pairs(run, "test")
    assert train and test and not {p.prompt for p in train} & {p.prompt for p in test}  # a prompt is trained on or held out
    assert len(train) + len(test) == 60 * 4  # at most 4 pairs a group
    for pair in train + test:
        a = int(pair.prompt.split()[2])
        assert pair.chosen.rstrip(".") == str(a + 1) and pair.rejected in (str(a + 2), str(a), str(a + 9)), pair  # never the failed one
        assert pair.where.startswith(str(run / "rollouts" / "step-"))
    first = [p for p in train + test if p.prompt == "What is 0 + 1?"]
    assert [p.rejected for p in first][:2] == ["9", "2"]  # the best against the worst first
    # a run folder as data.path: train pairs from it, held-out pairs from its held-out tenth
    data = prepare_pairs(load_config(None, rm_args(tiny_model_dir, **{"data.path": run, "eval.every": 5})))
    assert len(data.pairs) == len(train) and len(data.held_out) == len(test)
    (run / "rollouts" / "step-000002.jsonl").write_text('{"step": 2, "group_id": 1}\n')
    with pytest.raises(NoriaError, match=r"step-000002.jsonl:1: not a recorded trajectory: field\(s\) prompt, response, reward missing"):
        rollout_pairs(run, "train")
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(NoriaError, match="must be an RL run's, with rollouts/step-"):
        rollout_pairs(tmp_path / "not-a-run")
