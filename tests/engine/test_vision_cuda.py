"""The vision-language engine path on a CUDA GPU (skipped without one): prefill splices image
embeddings on the device, decode steps run from CUDA graphs, and greedy outputs equal transformers'
generate on the same GPU in fp32; a prefix-cache hit on the same image keeps them."""

from __future__ import annotations

import pytest
import torch

from vlm_util import build_tiny_vlm, hf_processor, random_image

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = "Look: <image> What is it?"


@torch.no_grad()
def test_cuda_engine_with_images_equals_transformers(tmp_path):
    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.engine.vision import ImagePrompts

    hf = build_tiny_vlm(tmp_path, seed=2).to("cuda")
    processor = hf_processor(tmp_path)
    engine = Engine.from_path(tmp_path, EngineConfig(kv_cache_tokens=4096), dtype="float32", device="cuda")
    try:
        assert engine.runner.graphs is not None  # decode steps replay CUDA graphs
        prompts = ImagePrompts(engine.model, tmp_path)
        for seed in (0, 1):
            image = random_image(seed)
            batch = processor(text=[PROMPT], images=[[image]], return_tensors="pt").to("cuda")
            n = batch["input_ids"].shape[1]
            expected = hf.generate(**batch, max_new_tokens=12, do_sample=False)[0, n:].tolist()
            ids, images = prompts.from_text(PROMPT, [image], "image_data")
            req = lambda: GenerateRequest(list(ids), SamplingParams(max_new_tokens=12, temperature=0), images=images)  # noqa: E731
            cold, warm = (engine.generate_batch([req()])[0] for _ in range(2))
            assert cold.output_ids == expected
            assert warm.output_ids == expected and warm.cached_tokens == n - 1
    finally:
        engine.shutdown()
