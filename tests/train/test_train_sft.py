"""SFT: the loss mask of a multi-turn chat covers exactly the assistant tokens; SFT trains.

CPU, tiny tokenizer with a ChatML template (``tiny_model_dir``); about a second.
"""

from __future__ import annotations

import json

import pytest
import torch

from noria.models import load_tokenizer
from noria.train.losses import sft_loss
from noria.train.sft import SFTDataError, chat_sample, read_chat_jsonl, sft_batches, chat_samples
from train_util import make_backend

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "Compute 4 * 6."},
    {"role": "assistant", "content": "4 * 6 = 24."},
]


def test_mask_covers_exactly_assistant_tokens(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    s = chat_sample(CHAT, tok)
    ids = s.prompt_ids + s.response_ids
    mask = [0] * len(s.prompt_ids) + s.loss_mask
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    trained = [tok.decode([i for i, m in zip(ids, mask) if m])]
    assert trained == ["The answer is 5.<|im_end|>\n4 * 6 = 24.<|im_end|>\n"]
    # Each assistant span sits right after its generation prompt, so the masked runs are contiguous.
    runs = "".join(map(str, mask)).strip("0").split("0")
    assert len([r for r in runs if r]) == 2
    assert s.prompt_ids == tok(tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def test_template_that_rewrites_history_is_refused(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    # Only the last two messages are rendered: adding a turn changes the earlier text.
    tok.chat_template = (
        "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(SFTDataError, match="not prefix-consistent at message"):
        chat_sample(CHAT, tok, where="row 7")


def test_bad_rows(tmp_path, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(SFTDataError, match="no assistant"):
        chat_sample(CHAT[:2], tok)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SFTDataError, match="chat.jsonl:3"):
        read_chat_jsonl(path)


def test_sft_steps_lower_the_nll(tiny_model_dir, tmp_path):
    torch.set_num_threads(1)
    tok = load_tokenizer(tiny_model_dir)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)))
    samples = chat_samples(read_chat_jsonl(path), tok)
    backend = make_backend(tiny_model_dir, loss_fn=None, algorithm="sft", param_dtype="bfloat16", micro_batch_tokens=64)
    assert backend.loss_fn is sft_loss
    batch = next(sft_batches(samples, batch_size=4))
    losses = [backend.train_step(batch)["nll"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}).encode(), r"messages\[1\]\.content"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), r"messages\[0\]\.role"),
        (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    ],
    ids=["message without content", "unknown role", "invalid utf-8"],
)
def test_bad_chat_row_names_file_line_and_field(tmp_path, line, pattern):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(json.dumps({"messages": CHAT}).encode() + b"\n" + line + b"\n")
    with pytest.raises(SFTDataError, match=rf"chat.jsonl:2: .*{pattern}"):
        read_chat_jsonl(path)
