"""Rendering prompts to token ids with a real (locally trained) BPE tokenizer (CPU, ~1 s)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from noria.data import DataError, drop_long, render_prompt, render_prompts
from noria.data.chat import render_text
from noria.types import Prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is 23 + 48? Put the final answer in a box.",
    "Using the numbers 3, 5 and 7, write an expression that equals 22.",
    "You are a helpful assistant. Be brief and precise.",
    "The quick brown fox jumps over the lazy dog.",
]


def train_tokenizer(with_template: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>")
    if with_template:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


@pytest.fixture(scope="module")
def chat_tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(with_template=True)


@pytest.fixture(scope="module")
def plain_tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(with_template=False)


def test_string_prompt_rendered_with_template_and_system(chat_tok):
    prompt = Prompt("What is 23 + 48?")
    text = render_text(prompt, chat_tok, system_prompt="Be brief.")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 23 + 48?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = render_prompt(prompt, chat_tok, system_prompt="Be brief.")
    assert chat_tok.decode(ids) == text
    assert ids[0] == chat_tok.convert_tokens_to_ids("<|im_start|>")


def test_message_prompt_rendered_as_given(chat_tok):
    prompt = Prompt(({"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                     {"role": "user", "content": "What is 1 + 1?"}))
    text = render_text(prompt, chat_tok, system_prompt="ignored for message prompts")
    assert text.count("<|im_start|>") == 4 and "ignored" not in text


def test_plain_text_without_template(plain_tok, chat_tok):
    prompt = Prompt("What is 23 + 48?")
    assert render_text(prompt, plain_tok, system_prompt="Be brief.") == "Be brief.\n\nWhat is 23 + 48?"
    assert render_text(prompt, chat_tok, chat_template=False) == "What is 23 + 48?"
    ids = render_prompt(prompt, plain_tok)
    assert plain_tok.decode(ids) == "What is 23 + 48?"


def test_messages_without_template_is_an_error(plain_tok, chat_tok):
    prompt = Prompt(({"role": "user", "content": "hi"},), source="d.jsonl", index=4)
    with pytest.raises(DataError, match="d.jsonl row index 4.*no chat template"):
        render_prompt(prompt, plain_tok)
    with pytest.raises(DataError, match="chat_template is off"):
        render_prompt(prompt, chat_tok, chat_template=False)


def test_empty_rendering_is_an_error(plain_tok):
    with pytest.raises(DataError, match="renders to no tokens"):
        render_prompt(Prompt(""), plain_tok)


def test_drop_long_counts(chat_tok):
    prompts = [Prompt("What is 1 + 1?"), Prompt("The quick brown fox jumps over the lazy dog. " * 5)]
    rendered = render_prompts(prompts, chat_tok)
    limit = len(rendered[0].ids)
    kept, dropped = drop_long(rendered, limit)
    assert [r.prompt for r in kept] == prompts[:1] and dropped == 1
    assert drop_long(rendered, None) == (rendered, 0)


TURNS = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


def test_a_custom_template_as_a_string_or_a_file(plain_tok, chat_tok, tmp_path):
    prompt = Prompt("What is 1 + 1?", "2", {}, 0, "t")
    want = "[system] Be brief.\n[user] What is 1 + 1?\n[assistant] "
    # a tokenizer without a template gets one; one with a template gets this one instead
    for tok in (plain_tok, chat_tok):
        assert render_text(prompt, tok, TURNS, "Be brief.") == want
    path = tmp_path / "turns.jinja"
    path.write_text(TURNS)
    assert render_text(prompt, chat_tok, str(path), "Be brief.") == want
    ids = render_prompt(prompt, plain_tok, str(path), "Be brief.")
    assert plain_tok.decode(ids) == want  # the template writes every token: no BOS added on top


def test_a_chat_template_that_is_neither_a_file_nor_a_template_is_refused(chat_tok, tmp_path, capsys):
    from noria.cli import main

    with pytest.raises(DataError, match="data.chat_template: 'no/such.jinja' is neither a Jinja template nor a file"):
        render_text(Prompt("q", None, {}, 0, "t"), chat_tok, "no/such.jinja")
    assert main(["config", "--model.path", "m", "--data.task", "arithmetic", "--data.chat_template", "no/such.jinja"]) == 2
    assert "data.chat_template" in capsys.readouterr().err
    assert main(["config", "--model.path", "m", "--data.task", "arithmetic", "--data.chat_template", "false"]) == 0
    assert "chat_template: false" in capsys.readouterr().out
