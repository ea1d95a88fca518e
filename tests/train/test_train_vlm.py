"""The trainer on the native vision-language family (tiny random Idefics3, CPU): in deterministic mode
its logprobs for sampled answers to image prompts equal the engine's rollout logprobs bit for bit,
through packing, micro-batches that cut the batch between samples and the logprob head; a training
step moves the vision tower and connector too (their gradients reach them through the image tokens).
"""

from __future__ import annotations

import pytest
import torch

from exact_util import trainer
from noria.config import EngineConfig
from noria.engine import Engine, GenerateRequest, SamplingParams
from noria.engine.vision import ImagePrompts
from noria.train.packing import pack_samples
from noria.types import Sample, Status
from vlm_util import build_tiny_vlm, hf_processor, random_image

PROMPTS = ["Look: <image> What is it?", "Two things: <image> and <image>, which?", "Plain text, no picture."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vlm")
    build_tiny_vlm(folder, seed=2)
    return folder


def rollout(folder) -> tuple[list[Sample], list]:
    """Seeded sampled answers (temperature 1) from the deterministic bf16 engine, one batch."""
    engine = Engine.from_path(folder, EngineConfig(kv_cache_tokens=2048, deterministic=True, chunked_prefill_size=8), dtype="bfloat16")
    try:
        prompts = ImagePrompts(engine.model, folder)
        made = [prompts.from_text(text, [random_image(70 + i + k) for k in range(text.count("<image>"))], "image_data")
                if "<image>" in text else (hf_processor(folder)(text=[text])["input_ids"][0], [])
                for i, text in enumerate(PROMPTS)]  # fmt: skip
        requests = [GenerateRequest(list(ids), SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=5 + i), images=images)
                    for i, (ids, images) in enumerate(made)]  # fmt: skip
        outs = engine.generate_batch(requests)
    finally:
        engine.shutdown()
    samples = [Sample(prompt_ids=list(ids), response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids),
                      rollout_logprobs=o.logprobs, weight_versions=[0] * len(o.output_ids), status=Status.COMPLETED)
               for (ids, _), o in zip(made, outs)]  # fmt: skip
    pixels = [torch.stack([im.pixel_values for im in images]) if images else None for _, images in made]
    return samples, pixels


def test_deterministic_trainer_logprobs_with_images_equal_the_engines_bitwise(folder):
    samples, pixels = rollout(folder)
    batch = pack_samples(samples, [1.0, -1.0, 0.5], pixel_values=pixels)
    assert batch.image_counts.tolist() == [1, 2, 0] and batch.pixel_values.shape[0] == 3
    backend = trainer(folder, deterministic=True, micro_batch_tokens=1)  # one sequence per micro-batch
    got = backend.compute_logprobs(batch).logprobs
    mask = batch.loss_mask > 0
    assert got[mask].tolist() == batch.rollout_logprobs[mask].tolist()
    without = backend.compute_logprobs(pack_samples(samples, [1.0, -1.0, 0.5])).logprobs  # the images matter
    assert without[mask][:6].tolist() != got[mask][:6].tolist()
    tower = backend.lm.model.connector.modality_projection.proj.weight
    before = tower.detach().clone()
    backend.train_step(batch)
    assert not torch.equal(before, tower.detach())  # the step reached the connector through the image tokens


def test_freeze_keeps_the_vision_tower_and_lora_adapts_the_language_model_only(folder):
    samples, pixels = rollout(folder)
    batch = pack_samples(samples, [1.0, -1.0, 0.5], pixel_values=pixels)
    backend = trainer(folder, deterministic=False, freeze=["vision"])
    body = backend.lm.model
    tower, connector = body.vision_model.embeddings.patch_embedding.weight, body.connector.modality_projection.proj.weight
    before = tower.detach().clone(), connector.detach().clone()
    backend.train_step(batch)
    assert torch.equal(before[0], tower.detach()) and not torch.equal(before[1], connector.detach())
    assert not any(p is tower for group in backend.optimizer.param_groups for p in group["params"])

    from noria.config.train import LoraConfig

    names = [n for n, _ in trainer(folder, deterministic=False, lora=LoraConfig(enabled=True, rank=4)).lm.named_parameters() if ".lora_A." in n]
    assert names and all(".text_model." in n for n in names)  # the vision tower's q_proj etc. are left alone
    both = [n for n, _ in trainer(folder, deterministic=False, lora=LoraConfig(enabled=True, rank=4, vision=True)).lm.named_parameters() if ".lora_A." in n]
    assert any(".vision_model." in n for n in both)
    with pytest.raises(ValueError, match="train.freeze: 'vision'"):
        from noria.train.freeze import freeze_parts

        freeze_parts(torch.nn.Linear(2, 2), ["vision"])
