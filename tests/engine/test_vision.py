"""A vision-language model through a real ``noria serve`` (tiny random Idefics3, fp32, CPU): greedy
outputs with images equal transformers' generate on the same folder, over SGLang's ``image_data`` and
OpenAI's ``image_url``; the prefix cache is keyed by image content; bad images are 400s."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine_server_util import ServeProcess
from vlm_util import build_tiny_vlm, hf_processor, png_data_url, random_image

PROMPT = "Look: <image> What is it?"
MAX_NEW = 8


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-vlm")
    hf = build_tiny_vlm(folder, seed=1)
    proc = ServeProcess(folder, "--dtype", "float32", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield folder, hf, proc.wait_ready()
    finally:
        proc.stop()


@torch.no_grad()
def _hf_greedy(folder, hf, text: str, images: list, **kwargs) -> tuple[list[int], list[int]]:
    batch = hf_processor(folder)(text=[text], images=[images], return_tensors="pt", **kwargs)
    out = hf.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
    ids = batch["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def _generate(proc, **body):
    body.setdefault("sampling_params", {"max_new_tokens": MAX_NEW, "temperature": 0})
    return httpx.post(f"{proc.url}/generate", json=body, timeout=60)


def test_generate_with_image_data_equals_transformers(vlm_server):
    folder, hf, proc = vlm_server
    outputs = []
    for seed in (10, 11):  # images the model never saw anywhere
        image = random_image(seed)
        prompt_ids, expected = _hf_greedy(folder, hf, PROMPT, [image])
        r = _generate(proc, text=PROMPT, image_data=[png_data_url(image)])
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected
        assert r.json()["meta_info"]["prompt_tokens"] == len(prompt_ids)
        # The expanded ids with the image as bare base64: the same tokens.
        bare = png_data_url(image).split(",", 1)[1]
        again = _generate(proc, input_ids=prompt_ids, image_data=bare)
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == expected
        outputs.append(expected)
    assert outputs[0] != outputs[1]  # the image decides the answer


def test_prefix_cache_is_keyed_by_image_content(vlm_server):
    folder, hf, proc = vlm_server
    text = "Cache test <image> now."
    first = random_image(20)
    ids, expected = _hf_greedy(folder, hf, text, [first])
    start = ids.index(hf.config.image_token_id)
    cold = _generate(proc, text=text, image_data=[png_data_url(first)]).json()
    warm = _generate(proc, text=text, image_data=[png_data_url(first)]).json()
    assert warm["output_ids"] == cold["output_ids"] == expected
    assert warm["meta_info"]["cached_tokens"] == len(ids) - 1
    other = random_image(21)
    _, expected_other = _hf_greedy(folder, hf, text, [other])
    r = _generate(proc, text=text, image_data=[png_data_url(other)]).json()
    assert r["meta_info"]["cached_tokens"] <= start  # the text before the image only
    assert r["output_ids"] == expected_other


def test_chat_image_url_equals_transformers(vlm_server):
    folder, hf, proc = vlm_server
    image = random_image(30)
    tok = hf_processor(folder).tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Describe <image> briefly."}], tokenize=False, add_generation_prompt=True)
    _, expected = _hf_greedy(folder, hf, text, [image], add_special_tokens=False)
    content = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": png_data_url(image)}},
               {"type": "text", "text": " briefly."}]  # fmt: skip
    r = httpx.post(f"{proc.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                   "max_tokens": MAX_NEW, "temperature": 0}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"text": PROMPT, "image_data": ["https://example.com/cat.png"]}, "not fetched"),
        ({"text": PROMPT, "image_data": ["/etc/passwd"]}, "file paths are not read"),
        ({"text": PROMPT, "image_data": ["data:image/png;base64,AAAA"]}, "cannot be decoded"),
        ({"text": "no placeholder", "image_data": ["IMAGE"]}, "1 image(s) but the prompt has 0 <image>"),
        ({"input_ids": [5, 6, 7], "image_data": "IMAGE"}, "run(s) of image tokens"),
        ({"text": ["a <image>", "b"], "image_data": ["IMAGE"]}, "one entry (or null) per prompt"),
    ],
)
def test_bad_image_requests_are_400(vlm_server, body, message):
    _, _, proc = vlm_server
    good = png_data_url(random_image(40))
    body = {k: ([good if v == "IMAGE" else v for v in val] if isinstance(val, list) else good if val == "IMAGE" else val)
            for k, val in body.items()}  # fmt: skip
    r = _generate(proc, **body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_placeholder_count_must_match(vlm_server):
    _, _, proc = vlm_server
    r = _generate(proc, text="two <image> <image>", image_data=[png_data_url(random_image(41))])
    assert r.status_code == 400 and "1 image(s) but the prompt has 2 <image>" in r.json()["error"]["message"]
    r = httpx.post(f"{proc.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and "not fetched" in r.json()["error"]["message"]


@torch.no_grad()
def test_deterministic_engine_equals_the_exact_forward_bitwise(vlm_server):
    """Deterministic mode (bf16): the engine's logprobs with an image, prefilled in chunks that cut the
    image's span and then served from the prefix cache, equal the exact-mode forward of the whole
    sequence from fp32 masters (the trainer's arithmetic) bit for bit."""
    import torch.nn.functional as F

    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.engine.vision import ImagePrompts
    from noria.models import PackedContext, load_model

    folder, _, _ = vlm_server
    config = EngineConfig(kv_cache_tokens=2048, deterministic=True, chunked_prefill_size=6)
    engine = Engine.from_path(folder, config, dtype="bfloat16")
    try:
        ids, images = ImagePrompts(engine.model, folder).from_text(PROMPT, [random_image(50)], "image_data")
        assert images[0].start % 6 and images[0].length > 6  # chunks start inside the image's span and cut it
        req = lambda: GenerateRequest(list(ids), SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), images=images)  # noqa: E731
        cold, warm = (engine.generate_batch([req()])[0] for _ in range(2))
    finally:
        engine.shutdown()
    assert warm.cached_tokens == len(ids) - 1
    assert warm.output_ids == cold.output_ids and warm.logprobs == cold.logprobs
    master = load_model(folder, dtype=torch.float32)
    master.set_exact_numerics(torch.bfloat16)
    full = torch.tensor([ids + cold.output_ids])
    hidden = master.hidden_states(full, attn=PackedContext([full.shape[1]], deterministic=True), pixel_values=images[0].pixel_values[None])
    logits = master.lm_head(hidden[0, len(ids) - 1 : -1]).float()
    expected = F.log_softmax(logits, dim=-1).gather(-1, torch.tensor(cold.output_ids)[:, None])[:, 0]
    assert cold.logprobs == expected.tolist()
    # Default mode (bf16: the packed fast path, on AVX-512 the C++ kernel's prefill): the same tokens.
    engine = Engine.from_path(folder, EngineConfig(kv_cache_tokens=2048, chunked_prefill_size=6), dtype="bfloat16")
    try:
        fast = engine.generate_batch([req()])[0]
    finally:
        engine.shutdown()
    assert fast.output_ids == cold.output_ids
    assert max(abs(a - b) for a, b in zip(fast.logprobs, cold.logprobs)) < 0.05


@torch.no_grad()
def test_weight_update_reaches_the_vision_path(vlm_server):
    """A weight update of the vision tower and connector (transformers' names) changes what the engine
    answers for an image exactly as it changes transformers' model."""
    from noria.config import EngineConfig
    from noria.engine import Engine, GenerateRequest, SamplingParams
    from noria.engine.vision import ImagePrompts

    folder, hf, _ = vlm_server
    image = random_image(60)
    engine = Engine.from_path(folder, EngineConfig(kv_cache_tokens=2048), dtype="float32")
    names = ("model.connector.modality_projection.proj.weight", "model.vision_model.post_layernorm.weight")
    before = {n: hf.get_parameter(n).detach().clone() for n in names}
    try:
        prompts = ImagePrompts(engine.model, folder)

        def answer() -> list[int]:
            ids, images = prompts.from_text(PROMPT, [image], "image_data")
            return engine.generate_batch([GenerateRequest(ids, SamplingParams(max_new_tokens=MAX_NEW, temperature=0), images=images)])[0].output_ids

        first = answer()
        assert first == _hf_greedy(folder, hf, PROMPT, [image])[1]
        engine.weights.update_from_state_dict({n: -2.0 * t for n, t in before.items()}, version=1)
        for n, t in before.items():
            hf.get_parameter(n).copy_(-2.0 * t)
        second = answer()
        assert second == _hf_greedy(folder, hf, PROMPT, [image])[1]
        assert second != first
    finally:
        engine.shutdown()
        for n, t in before.items():
            hf.get_parameter(n).copy_(t)
