"""RL on a vision-language model end to end (tiny random Idefics3, CPU): rows with images from a
data file go through the rollout (in-process engine, and a ``noria serve`` child over HTTP with
SGLang's ``image_data``) and into the trainer, which sees the same images: in deterministic mode
the trainer's logprobs equal the engine's bit for bit, before and after a weight sync. The run
folder keeps each image once, by content hash. ``noria eval`` answers the same rows as transformers does."""

from __future__ import annotations

import json

import pytest

from noria.config import load_config
from noria.launch.rl import run_rl
from rl_util import read_jsonl, rl_args
from vlm_util import build_tiny_vlm, random_image

TEMPLATE = (
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}Answer:"
)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vlm")
    build_tiny_vlm(folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Eight rows: one image (a relative path), two images, or none, with a label each."""
    folder = tmp_path_factory.mktemp("vlm-data")
    rows = []
    for i in range(8):
        names = [f"pic{i}-{k}.png" for k in range(i % 3)]
        for k, name in enumerate(names):
            random_image(100 + 10 * i + k).save(folder / name)
        rows.append({"prompt": f"What is shown, {i}?", "images": names, "label": str(i)} if names else {"prompt": f"Count to {i}.", "label": str(i)})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def vlm_args(model, data, **extra):
    base = {
        "data.task": None, "data.path": str(data), "data.chat_template": TEMPLATE, "rollout.prompts_per_step": 4,
        "rollout.n_samples": 4, "rollout.max_new_tokens": 6, "engine.deterministic": True, "rollout.temperature": 0.8,
        "train.max_steps": 2, "data.test_path": str(data), "eval.every": 2, "eval.max_new_tokens": 6,
    }  # fmt: skip
    base.update(extra)
    args = rl_args(model, **base)
    i = args.index("--data.task")
    return args[:i] + args[i + 2 :]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_vlm_rl_trains_on_the_images_the_engine_saw(vlm, data, tmp_path, placement):
    run = tmp_path / "run"
    extra = {"rollout.placement": placement, "sync.transport": "disk"} if placement == "disaggregated" else {}
    run_rl(load_config(None, vlm_args(vlm, data, **extra)), run_dir=str(run), progress=False)
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:  # the trainer's logprobs equal the engine's: it saw the same images at the same positions
        assert row["rollout_logprob_abs_diff_max"] == 0.0, row
        assert row["train/samples"] > 0
    grids = sorted(p.name for p in (run / "eval").glob("step-*.png"))  # the held-out images with their answers
    assert grids == ["step-000000.png", "step-000002.png"]
    stored = sorted(p.name for p in (run / "images").iterdir())
    assert len(stored) == sum(i % 3 for i in range(8)) and all(p.endswith(".png") for p in stored)
    samples = [json.loads(line) for f in sorted((run / "rollouts").iterdir()) for line in f.read_text().splitlines()]
    with_images = [s for s in samples if s.get("images")]
    assert with_images and {ref[len("sha256:"):] + ".png" for s in with_images for ref in s["images"]} <= set(stored)


def test_noria_eval_answers_image_prompts_as_transformers_does(vlm, data, tmp_path):
    """``noria eval`` on a vision-language folder runs the built-in engine with the rows' images: its
    greedy answers (fp32) equal transformers' generate on the same ids and pixels."""
    import torch
    from transformers import AutoModelForImageTextToText

    from noria.data import load_prompts
    from noria.data.chat import render_prompt
    from noria.data.vision_chat import load_processor, prompt_images, stored_pixels
    from noria.eval.runner import run_eval

    args = ["--model.path", str(vlm), "--model.dtype", "float32", "--data.path", str(data), "--data.test_path", str(data),
            "--data.chat_template", TEMPLATE, "--reward.name", "toy_rewards:digits", "--eval.max_new_tokens", "6"]  # fmt: skip
    config = load_config(None, args)
    run_eval(config, run_dir=str(tmp_path / "eval"), progress=False)
    answers = {r["group_id"]: r["response"] for r in map(json.loads, (tmp_path / "eval" / "samples.jsonl").read_text().splitlines())}
    processor, hf = load_processor(vlm), AutoModelForImageTextToText.from_pretrained(str(vlm), dtype=torch.float32).eval()
    checked = 0
    for g, prompt in enumerate(load_prompts(config.data, "test")):
        refs = prompt_images(prompt)
        if not refs:
            continue
        ids = torch.tensor([render_prompt(prompt, processor, TEMPLATE)])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=stored_pixels(processor, refs)[None],
                          max_new_tokens=6, do_sample=False)  # fmt: skip
        assert processor.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == answers[g], g
        checked += 1
    assert checked == 5
