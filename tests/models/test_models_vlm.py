"""The native Idefics3 family (noria.models.vlm) against transformers, on a tiny random model with
images in the prompt (CPU, fp32), and its HF checkpoint folders both ways."""

from __future__ import annotations

import json

import pytest
import torch

from noria.models import DecoderLM, load_model, save_model
from noria.models.config import UnsupportedModel
from noria.models.vlm import VisionLM, pixel_shuffle
from vlm_util import IMAGE_SEQ_LEN, build_tiny_vlm, hf_processor, random_image

TOL = 1e-4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vlm")
    hf = build_tiny_vlm(folder)
    return folder, hf, load_model(folder)


def _batch(folder, prompts: list[str], images: list[list]):
    return hf_processor(folder)(text=prompts, images=images, padding=True, return_tensors="pt")


@torch.no_grad()
def test_logits_equal_transformers_with_images(vlm):
    folder, hf, native = vlm
    assert isinstance(native, VisionLM) and isinstance(native, DecoderLM)
    batch = _batch(folder, ["What is <image> here?", "Two: <image> and <image>."], [[random_image(0)], [random_image(1), random_image(2)]])
    ids = batch["input_ids"]
    assert int((ids == native.vision.image_token_id).sum()) == 3 * IMAGE_SEQ_LEN
    ref = hf(**batch).logits
    # The processor pads the image lists to [B, 2]; the native model takes the real images in order.
    pixels = torch.cat([batch["pixel_values"][0, :1], batch["pixel_values"][1]])
    masks = torch.cat([batch["pixel_attention_mask"][0, :1], batch["pixel_attention_mask"][1]])
    from noria.models import PaddedContext

    out = native(ids, attn=PaddedContext(batch["attention_mask"]), pixel_values=pixels, pixel_attention_mask=masks)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out[real], ref[real], atol=TOL, rtol=TOL)
    # The image changes the logits after it: the splice is not a no-op.
    other = native(ids[:1], pixel_values=batch["pixel_values"][1, :1])
    assert (other[0, -1] - out[0, -1]).abs().max() > 1e-3


@torch.no_grad()
def test_text_only_and_features_match_transformers(vlm):
    folder, hf, native = vlm
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(native(ids), hf(input_ids=ids).logits, atol=TOL, rtol=TOL)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ref = hf.model.get_image_features(pixels[None]).pooler_output[0].view(2, IMAGE_SEQ_LEN, -1)
    torch.testing.assert_close(native.image_features(pixels), ref, atol=TOL, rtol=TOL)


def test_pixel_shuffle_order():
    # 4x4 grid of 1-d features numbered by position; r = 2 takes (row pairs) x (column pairs) as transformers does.
    x = torch.arange(16.0).view(1, 16, 1)
    out = pixel_shuffle(x, 2)
    assert out.shape == (1, 4, 4)
    assert out[0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]
    assert out[0, 1].tolist() == [2.0, 3.0, 6.0, 7.0]


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_save_loads_in_transformers(vlm, tmp_path, tie):
    from transformers import Idefics3ForConditionalGeneration

    src = vlm[0]
    if tie:  # a tied head: a folder of its own
        src = tmp_path / "src"
        build_tiny_vlm(src, seed=3, tie=True)
    native = load_model(src)
    assert native.args.tie_word_embeddings is tie
    out = save_model(native, tmp_path / "out", source=src)
    assert json.loads((out / "config.json").read_text())["model_type"] == "idefics3"
    assert (out / "processor_config.json").is_file() and (out / "tokenizer.json").is_file()
    back = Idefics3ForConditionalGeneration.from_pretrained(str(out)).eval()
    batch = _batch(src, ["An image: <image>!"], [[random_image(4)]])
    ref = back(**batch).logits
    mine = native(batch["input_ids"], pixel_values=batch["pixel_values"][0])
    torch.testing.assert_close(mine, ref, atol=TOL, rtol=TOL)
    assert torch.equal(load_model(out).model.connector.modality_projection.proj.weight,
                       native.model.connector.modality_projection.proj.weight)  # fmt: skip


@torch.no_grad()
def test_bad_inputs_are_named(vlm, tmp_path):
    _, _, native = vlm
    ids = torch.full((1, 5), 3)
    with pytest.raises(ValueError, match="0 image tokens"):
        native(ids, pixel_values=torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, 32, 32\]"):
        native.image_features(torch.zeros(1, 3, 16, 16))
    cfg = json.loads((vlm[0] / "config.json").read_text())
    cfg["text_config"]["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="text_config.model_type"):
        load_model(tmp_path)


@torch.no_grad()
def test_packed_sequences_take_their_images_in_order(vlm):
    """The trainer's layout: sequences packed in one row, their images concatenated in the same order;
    each sequence gets the hidden states it has alone."""
    from noria.models import PackedContext

    folder, _, native = vlm
    rows = [_batch(folder, [text], [[random_image(seed)]]) for text, seed in (("A <image> b", 7), ("Say <image>!", 8))]
    alone = [native.hidden_states(r["input_ids"], pixel_values=r["pixel_values"][0])[0] for r in rows]
    ids = torch.cat([r["input_ids"] for r in rows], dim=1)
    pixels = torch.cat([r["pixel_values"][0] for r in rows])
    packed = native.hidden_states(ids, attn=PackedContext([r["input_ids"].shape[1] for r in rows]), pixel_values=pixels)[0]
    torch.testing.assert_close(packed, torch.cat(alone), atol=TOL, rtol=TOL)
