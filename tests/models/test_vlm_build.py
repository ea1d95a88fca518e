"""The VLM builder on the tiny Llama: the folder it writes is an Idefics3 model and processor that
transformers loads and generates from, prompts of the ``digits_sum`` task render through its
processor, and the alignment stage makes image tokens look like the slots' digit embeddings (CPU)."""

from __future__ import annotations

import pytest
import torch

from noria.data import generate_split, render_prompts
from noria.data.vision_chat import load_processor, prompt_images
from noria.models import vlm_build


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm")
    vlm_build.build_vlm(tiny_model_dir, out, align_steps=1, sft_steps=1, batches=(2, 2))
    return out


def test_folder_loads_in_transformers_and_answers(built):
    from transformers import AutoModelForImageTextToText, Idefics3ForConditionalGeneration

    model = AutoModelForImageTextToText.from_pretrained(str(built))
    assert isinstance(model, Idefics3ForConditionalGeneration)
    assert model.config.vision_config.image_size == vlm_build.IMAGE_SIZE and model.config.scale_factor == 2
    prompts, answers = vlm_build.heldout_answers(built, n=3, batch=3, max_new_tokens=3)
    assert [p.source for p in prompts] == ["task:digits_sum/test"] * 3 and len(answers) == 3


def test_task_prompts_render_with_the_folders_processor(built, tiny_model_dir):
    processor = load_processor(built)
    assert load_processor(tiny_model_dir) is None  # a text model has no processor
    prompts = generate_split("digits_sum", "test", {"n_test": 2})
    rendered = render_prompts(prompts, processor)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for r in rendered:
        assert r.ids.count(image_id) == vlm_build.IMAGE_SEQ_LEN
        assert r.images == tuple(prompt_images(r.prompt)) and len(r.images) == 1
    text = processor.tokenizer.decode(rendered[0].ids)
    assert text.startswith("<|im_start|>user\n<fake_token_around_image><global-img><image>")
    assert text.endswith("What is the sum of the digits in the image?<|im_end|>\n<|im_start|>assistant\n")


def test_alignment_puts_image_tokens_near_their_digits_embedding(tiny_model_dir):
    import numpy as np

    processor = vlm_build.make_processor(tiny_model_dir)
    torch.manual_seed(0)
    model = vlm_build.make_model(tiny_model_dir, processor.tokenizer)
    embed = model.model.text_model.get_input_embeddings().weight.detach().clone()
    drawn = [vlm_build._draw(np.random.default_rng(5), vlm_build._pool()) for _ in range(8)]

    def loss() -> float:
        with torch.no_grad():
            logits = vlm_build.image_token_logits(model, processor, drawn)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), vlm_build.slot_classes(drawn).reshape(-1)).item()

    assert vlm_build.slot_classes(drawn[:1])[0].tolist()[:4] == [
        next((d for d, s in zip(drawn[0][1], drawn[0][2]) if s == col), 10) for col in range(4)
    ]
    before = loss()
    vlm_build.align(model, processor, steps=12, batch=4)
    assert loss() < 0.85 * before
    assert torch.equal(model.model.text_model.get_input_embeddings().weight, embed)  # the LM's embeddings stay


def test_warm_start_answers_list_the_digits_and_sometimes_the_sum():
    assert vlm_build.answer_text([3, 7], with_sum=False) == "The digits are 3, 7."
    assert vlm_build.answer_text([3, 7, 1], with_sum=True) == "The digits are 3, 7, 1, so the sum is 3 + 7 = 10, 10 + 1 = 11."
    assert vlm_build.answer_text([8], with_sum=True) == "The digits are 8, so the sum is 8."
