"""``smolvlm-digits``: a small vision-language model built on this machine, from SmolLM2-135M-Instruct.

Nothing is downloaded. The builder (:func:`build_smolvlm_digits`, the catalog entry ``smolvlm-digits``)
makes a transformers ``Idefics3ForConditionalGeneration`` (the SmolVLM family: a SigLIP-style vision
encoder, pixel shuffle and a linear connector in front of a Llama LM) and saves it with its processor,
so ``AutoModelForImageTextToText`` and ``AutoProcessor`` load the folder:

1. the LM is the catalog's ``smollm2-135m-instruct`` (imported first if needed); its tokenizer gets
   Idefics3's image tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
   ``<end_of_utterance>``) and a ChatML template that renders image parts as ``<image>``
   (:data:`CHAT_TEMPLATE`: SmolLM2's own format, so the LM's instruction following carries over);
2. a vision encoder of :data:`VISION` (64x64 pixels in 8x8 patches) and scale factor 2: an image is
   16 ``<image>`` tokens, a 4x4 grid; the ``digits_sum`` task's pictures (4 slots in a row, squashed
   to a square by the processor, which does not split images) put each slot under one column;
3. stage A, alignment (:data:`ALIGN_STEPS`, no LM forward): encoder and connector learn to put each
   image token nearest to the LM's input embedding of the digit in its slot (``_`` for a blank
   slot; cross-entropy over minus squared distances), so image tokens start out as words the LM
   already reads;
4. stage B, the SFT warm start (:data:`SFT_STEPS`, the LM's top layers trained, bf16 autocast where
   the CPU computes bf16 natively): chats asking what digits an image holds (``The digits are 3, 7.``)
   and the ``digits_sum`` question, answered in :data:`SUM_SHARE` of them with the sum worked out one
   digit at a time (``The digits are 3, 7, 1, so the sum is 3 + 7 = 10, 10 + 1 = 11.``) and with the
   digits alone otherwise (so greedy answers mostly stop at the digits: making the model add them up
   is what RL on ``digits_sum`` raises).

Pictures come from the ``digits_sum`` task's train pool only (``noria.data.digits_images``); its
held-out split is never seen. ``heldout_answers`` answers the held-out split greedily with a built folder.
Seeded; not guaranteed: the same weights across CPUs (rounding) or the accuracy figures in the docs.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from pathlib import Path
from typing import Any

from noria.console import say

RECIPE_VERSION = 3
"""Raised whenever the built folder changes (the catalog rebuilds cached folders of other versions)."""
IMAGE_SIZE = 64
PATCH = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE_FACTOR**2
VISION = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4}
"""The vision encoder's size (about 0.6M parameters)."""
ALIGN_STEPS = 600
ALIGN_BATCH = 32
SFT_STEPS = 240
SFT_BATCH = 8
SFT_LR = 2e-4
SFT_TOP_LAYERS = 16
"""The warm start trains the LM's top layers only (and its final norm): backward stops there."""
SUM_SHARE = 0.3
"""Share of the warm start's sum questions answered with the sum (the others: the digits only)."""
SUM_QUESTION_SHARE = 0.5
"""Share of the warm start's chats that ask the sum question (the others ask for the digits)."""
CAPTION_QUESTION = "What digits are in the image?"
BLANK = "_"
THREADS = 2
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (SmolLM2's format, without its default system message); image parts render as ``<image>``,
which the processor expands to the image's tokens."""


def build_smolvlm_digits(entry, out: Path) -> None:
    """Catalog builder: :func:`build_vlm` on ``smollm2-135m-instruct`` (imported first if needed)."""
    from noria.models.catalog import model_path

    build_vlm(model_path("smollm2-135m-instruct"), out)


def build_vlm(lm_folder: Path, out: Path, align_steps: int = ALIGN_STEPS, sft_steps: int = SFT_STEPS, batches: tuple[int, int] = (ALIGN_BATCH, SFT_BATCH)) -> None:
    """Model and processor over the LM in ``lm_folder``, aligned and warm-started, saved into ``out``;
    ``batches`` are the alignment's and the warm start's batch sizes."""
    import torch

    started = time.monotonic()
    torch.manual_seed(0)
    processor = make_processor(lm_folder)
    model = make_model(lm_folder, processor.tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(THREADS, os.cpu_count() or 1))
    try:
        align(model, processor, align_steps, batches[0])
        warm_start(model, processor, sft_steps, batches[1])
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    say(f"noria: {Path(lm_folder).name} + vision built into a VLM in {time.monotonic() - started:.0f} s")


def make_processor(lm_folder: Path):
    """An ``Idefics3Processor`` over SmolLM2's tokenizer with the image tokens, one 64x64 tile per image."""
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(lm_folder))
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}
    )
    return Idefics3Processor(image_processor, tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def make_model(lm_folder: Path, tokenizer):
    """``Idefics3ForConditionalGeneration`` with SmolLM2's weights as its LM (embeddings grown for the
    image tokens: new rows are the mean embedding) and a random vision encoder and connector."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration

    lm = AutoModelForCausalLM.from_pretrained(str(lm_folder), dtype=torch.float32)
    lm.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    text_config = AutoConfig.from_pretrained(str(lm_folder)).to_dict()
    text_config["vocab_size"] = len(tokenizer)
    config = Idefics3Config(
        text_config=text_config,
        vision_config={**VISION, "image_size": IMAGE_SIZE, "patch_size": PATCH},
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Idefics3ForConditionalGeneration(config)
    missing, unexpected = model.model.text_model.load_state_dict(lm.model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 weights do not fit the VLM's LM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def _pool():
    from noria.data.digits_images import DEFAULTS, digit_pool

    return digit_pool("train", DEFAULTS["n_test_digits"])


def _draw(rng, pool):
    """A train-pool composite: (image, digits left to right, their slots)."""
    from noria.data.digits_images import DEFAULTS, draw_composite

    return draw_composite(rng, pool, DEFAULTS)


def slot_token_ids(tokenizer) -> list[int]:
    """The token ids a slot's image tokens align to: the digits 0-9, then :data:`BLANK`."""
    return [tokenizer.convert_tokens_to_ids(t) for t in [*map(str, range(10)), BLANK]]


def slot_classes(drawn: list[tuple[Any, list[int], list[int]]]) -> Any:
    """Per image token [B, IMAGE_SEQ_LEN], the class of its slot's column: the digit, or 10 (blank)."""
    import torch

    side = IMAGE_SIZE // PATCH // SCALE_FACTOR
    rows = []
    for _, digits, slots in drawn:
        column = [10] * side
        for d, s in zip(digits, slots):
            column[s] = d
        rows.append([column[k % side] for k in range(IMAGE_SEQ_LEN)])
    return torch.tensor(rows)


def image_token_logits(model, processor, drawn) -> Any:
    """[B, IMAGE_SEQ_LEN, 11]: minus the squared distance of each image token's features to the LM's
    embedding of each slot class (the digits, then blank)."""
    import torch

    embed = model.model.text_model.get_input_embeddings().weight.detach()[slot_token_ids(processor.tokenizer)]
    pixels = processor.image_processor([[d[0]] for d in drawn], return_tensors="pt")["pixel_values"]
    feats = torch.stack(list(model.model.get_image_features(pixel_values=pixels).pooler_output))
    return -((feats.unsqueeze(-2) - embed) ** 2).sum(-1)


def align(model, processor, steps: int, batch: int = ALIGN_BATCH) -> None:
    """Stage A: vision encoder and connector learn to put each image token nearest (cross-entropy over
    minus squared distances) to the LM's embedding of its slot's digit, or of BLANK; the LM's
    embeddings stay fixed and the LM itself is not run."""
    import numpy as np
    import torch

    if steps <= 0:
        return
    pool, rng = _pool(), np.random.default_rng(1)
    params = [*model.model.vision_model.parameters(), *model.model.connector.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        drawn = [_draw(rng, pool) for _ in range(batch)]
        logits, classes = image_token_logits(model, processor, drawn), slot_classes(drawn)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), classes.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / min(50, 1 + steps // 5)) * (1 - step / steps)
        opt.step()
        if (step + 1) % 25 == 0 or step + 1 == steps:
            accuracy = (logits.argmax(-1) == classes).float().mean().item()
            say(f"noria: smolvlm-digits alignment: step {step + 1}/{steps}, loss {loss.item():.3f}, slot accuracy {accuracy:.0%}")


def answer_text(digits: list[int], with_sum: bool) -> str:
    """The warm start's answer: the digits left to right, then, if ``with_sum``, their sum worked out
    one digit at a time (``The digits are 4, 7, 9, so the sum is 4 + 7 = 11, 11 + 9 = 20.``): a
    135M-parameter LM adds two small numbers far more reliably than it sums four digits in one token."""
    listed = ", ".join(str(d) for d in digits)
    if not with_sum:
        return f"The digits are {listed}."
    totals = list(itertools.accumulate(digits))
    steps = [f"{a} + {d} = {b}" for a, d, b in zip(totals, digits[1:], totals[1:])]
    return f"The digits are {listed}, so the sum is {', '.join(steps) if steps else totals[0]}."


def _chat(rng: random.Random, digits: list[int]) -> tuple[str, str]:
    from noria.data.digits_images import QUESTION

    if rng.random() < SUM_QUESTION_SHARE:
        return QUESTION, answer_text(digits, with_sum=rng.random() < SUM_SHARE)
    return CAPTION_QUESTION, answer_text(digits, with_sum=False)


def _sft_batch(processor, rows: list[tuple[Any, str, str]]):
    """Processor inputs and labels (-100 on the prompt and padding) for (image, question, answer) rows."""

    from noria.data.digits_images import image_message

    prompts = [processor.apply_chat_template([image_message("", q)], tokenize=False, add_generation_prompt=True) for _, q, _ in rows]
    texts = [p + a + "<|im_end|>\n" for p, (_, _, a) in zip(prompts, rows)]
    images = [[img] for img, _, _ in rows]
    inputs = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_lens = [len(processor(text=[p], images=[im], add_special_tokens=False)["input_ids"][0]) for p, im in zip(prompts, images)]
    labels = inputs["input_ids"].clone()
    labels[inputs["attention_mask"] == 0] = -100
    for i, n in enumerate(prompt_lens):
        start = int((inputs["attention_mask"][i] == 0).sum()) if processor.tokenizer.padding_side == "left" else 0
        labels[i, : start + n] = -100
    return inputs, labels


def warm_start(model, processor, steps: int, batch: int = SFT_BATCH) -> None:
    """Stage B: next-token loss on the answers of image chats; only the LM's top
    :data:`SFT_TOP_LAYERS` layers and final norm train (the aligned encoder and the rest stay)."""
    import numpy as np
    import torch

    from noria.hardware import cpu_info

    if steps <= 0:
        return
    pool, rng, chat_rng = _pool(), np.random.default_rng(2), random.Random(3)
    text = model.model.text_model
    trained = [*text.layers[-SFT_TOP_LAYERS:].parameters(), *text.norm.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=SFT_LR, weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_info().bf16_native)
    model.train()
    for step in range(steps):
        rows = []
        for _ in range(batch):
            image, digits, _ = _draw(rng, pool)
            rows.append((image, *_chat(chat_rng, digits)))
        inputs, labels = _sft_batch(processor, rows)
        with autocast:
            loss = model(**inputs, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = SFT_LR * min(1.0, (step + 1) / 10) * (1 - step / steps)
        opt.step()
        if (step + 1) % 10 == 0 or step + 1 == steps:
            say(f"noria: smolvlm-digits warm start: step {step + 1}/{steps}, loss {loss.item():.3f}")
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()


def heldout_answers(folder: str | Path, n: int = 200, batch: int = 16, max_new_tokens: int = 64) -> tuple[list, list[str]]:
    """The first ``n`` held-out ``digits_sum`` prompts and the folder's greedy answers to them, with
    transformers' ``generate`` in fp32 (score them with the ``numeric`` reward). A worked sum of four
    digits is about 51 tokens: ``max_new_tokens`` 64 keeps it whole."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from noria.data.images import default_store
    from noria.data.tasks import generate_split

    processor = AutoProcessor.from_pretrained(str(folder))
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = generate_split("digits_sum", "test", {"n_test": n})
    answers: list[str] = []
    for i in range(0, n, batch):
        chunk = prompts[i : i + batch]
        texts = [processor.apply_chat_template(list(p.prompt), tokenize=False, add_generation_prompt=True) for p in chunk]
        images = [[default_store().get(p.prompt[0]["content"][0]["image"])] for p in chunk]
        inputs = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answers += processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return prompts, answers
