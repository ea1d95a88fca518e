"""Token-in-token-out sessions with images (a tiny random vision-language model, CPU, loopback): a
two-turn episode whose user turn and a later tool result each carry a picture runs through the
session server on a real in-process engine. The record holds both images' tokens where the
template put them (the tool's among the mask-0 tokens), the sample names the images in order, and
in deterministic mode the trainer's logprobs of every policy token of both turns equal the
engine's bit for bit: engine and trainer saw the same pictures at the same positions. A tool
result with an image URL to fetch is refused (400) and changes nothing."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from exact_util import trainer
from noria.agent.session import SessionServer
from noria.config import EngineConfig
from noria.engine import Engine, SamplingParams
from noria.engine.vision import image_spans
from noria.models.vlm_build import CHAT_TEMPLATE
from noria.rollout.client import LocalEngineClient
from noria.train.images import SamplePixels
from noria.train.packing import pack_samples
from noria.types import Sample
from vlm_util import build_tiny_vlm, hf_processor, png_data_url, random_image


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vlm-chat")
    build_tiny_vlm(folder, seed=4)
    processor = hf_processor(folder)
    processor.chat_template = processor.tokenizer.chat_template = CHAT_TEMPLATE  # ChatML, image parts as <image>
    processor.save_pretrained(folder)
    return folder


def picture(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": png_data_url(random_image(seed))}}


async def episode(folder):
    engine = Engine.from_path(folder, EngineConfig(kv_cache_tokens=4096, deterministic=True), dtype="bfloat16")
    try:
        sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
        async with SessionServer(LocalEngineClient(engine, folder=folder), hf_processor(folder), sampling) as server:
            session = server.open()
            url = server.base_url(session.id) + "/chat/completions"
            messages = [{"role": "user", "content": [picture(1), {"type": "text", "text": "What is it?"}]}]
            async with httpx.AsyncClient(timeout=60) as http:
                first = await http.post(url, json={"messages": messages})
                assert first.status_code == 200, first.text
                messages.append(first.json()["choices"][0]["message"])
                bad = [*messages, {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]
                refused = await http.post(url, json={"messages": bad})
                assert refused.status_code == 400 and "not fetched" in refused.text
                assert len(session.images) == 1 and session.turns == 1  # nothing recorded
                messages.append({"role": "tool", "content": [{"type": "text", "text": "Zoomed in:"}, picture(2)]})
                second = await http.post(url, json={"messages": messages})
                assert second.status_code == 200, second.text
            return session.fill(Sample(prompt_ids=[])), engine.model.vision.image_token_id
    finally:
        engine.shutdown()


def test_multi_turn_episode_with_tool_images_is_token_exact(folder):
    sample, image_token = asyncio.run(episode(folder))
    assert len(sample.images) == 2 and sample.images[0] != sample.images[1]
    ids = sample.prompt_ids + sample.response_ids
    spans = image_spans(ids, image_token)
    assert len(spans) == 2 and spans[0][0] < len(sample.prompt_ids) <= spans[1][0]
    at = spans[1][0] - len(sample.prompt_ids)
    assert sample.loss_mask[at] == 0 and sum(sample.loss_mask) == 10  # the tool's picture is context; 5 + 5 policy tokens
    batch = pack_samples([sample], [1.0], pixel_values=SamplePixels(folder)([sample]))
    got = trainer(folder, deterministic=True).compute_logprobs(batch).logprobs
    mask = batch.loss_mask > 0
    assert got[mask].tolist() == batch.rollout_logprobs[mask].tolist()
    assert torch.isfinite(got[mask]).all()
