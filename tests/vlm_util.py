"""A tiny random Idefics3 (SmolVLM architecture) HF folder built here, no hub: the BPE tokenizer of
``tiny_util`` plus Idefics3's image tokens, a random model (weights re-drawn larger than HF's init,
so that errors show in the logits), and the processor files (image processor without splitting:
one 32-pixel tile per image, 16 image tokens).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from tiny_util import build_tokenizer

IMAGE_SIZE = 32
PATCH = 4
SCALE = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


def build_tiny_vlm(folder: Path, seed: int = 0, tie: bool = False):
    """Save the model, tokenizer and processor into ``folder``; return the transformers model (eval, fp32)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = build_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    config = Idefics3Config(
        text_config=dict(
            model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=IMAGE_SIZE, patch_size=PATCH,
        ),
        scale_factor=SCALE, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    _randomize(model, seed)
    model.save_pretrained(folder)
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}
    )
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN).save_pretrained(folder)
    return model.eval()


def _randomize(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


def random_image(seed: int, size: int = 20):
    """A random RGB PIL image (not square-sized to the tile: the processor resizes it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size + 4, 3), dtype=np.uint8), "RGB")


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def hf_processor(folder: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))
