"""``tiny-llama``: a small Llama built on this machine in about half a minute, for first runs and tests.

Nothing is downloaded. The builder (:func:`build_tiny_llama`, the catalog entry ``tiny-llama``):

1. trains a byte-level BPE tokenizer (``tokenizers``) on arithmetic chats in SmolLM2's ChatML format,
   with the same special tokens and chat template, so prompts render the way they do for the real
   model;
2. builds a random-init ``LlamaForCausalLM`` (4 layers, hidden 128, about 1M parameters);
3. warm-starts it with a few hundred supervised steps on chats of the arithmetic task's own
   prompts (addition of operands up to :data:`MAX_OPERAND`, answers as ``\\boxed{n}``) drawn from
   the task's *train* split, so the model knows the answer format and is right on some problems,
   not all: greedy held-out accuracy lands around 10-40%, leaving GRPO something to learn.

Seeded: the same torch build on the same CPU gives the same folder; CPUs whose matmuls sum in
another order (AVX2 and AVX-512) give slightly different weights, with the same behaviour.
Not guaranteed: the exact accuracy of the warm start (it is a tiny model trained for seconds).
"""

from __future__ import annotations

import random
from pathlib import Path

MAX_OPERAND = 30
"""Operands of the warm start's problems (and of ``examples/grpo_tiny.yaml``'s task)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as SmolLM2-Instruct's template renders it (without its default system message)."""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WARM_STEPS = 400
"""Supervised steps of the warm start (batch 32): about 20 s on 2 cores."""


def build_tiny_llama(entry, out: Path) -> None:
    """Catalog builder: tokenizer, model and warm start into ``out`` (an empty folder)."""
    import torch

    torch.manual_seed(0)
    chats = _chats(n=800, seed=0)
    tokenizer = _tokenizer(chats)
    model = _model(tokenizer)
    _warm_start(model, tokenizer, chats, steps=WARM_STEPS)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _chats(n: int, seed: int) -> list[str]:
    """Rendered chats of train-split arithmetic problems: the prompt, then ``\\boxed{answer}``."""
    from noria.data.tasks import generate_split

    args = {"n_train": n, "n_test": 10, "seed": seed, "max_operand": MAX_OPERAND, "ops": ["+"]}
    records = generate_split("arithmetic", "train", args)
    return [
        f"<|im_start|>user\n{r.prompt}<|im_end|>\n<|im_start|>assistant\n\\boxed{{{r.label}}}<|im_end|>\n"
        for r in records
    ]


def _tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", model_max_length=512,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _model(tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def _warm_start(model, tokenizer, chats: list[str], steps: int, batch: int = 32) -> None:
    """Next-token loss on the assistant's answer only (the prompt is context), AdamW, fp32."""
    import torch

    marker = "<|im_start|>assistant\n"
    rows = []
    for chat in chats:
        head, answer = chat.split(marker)
        prompt_ids = tokenizer(head + marker)["input_ids"]
        answer_ids = tokenizer(answer)["input_ids"]
        rows.append((prompt_ids + answer_ids, len(prompt_ids)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(0)
    model.train()
    for step in range(steps):
        ids, labels, mask = _batch([rows[rng.randrange(len(rows))] for _ in range(batch)], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:  # linear decay: the last steps settle
            group["lr"] = 3e-3 * (1 - step / steps)
        opt.step()
    model.eval()


def _batch(rows, pad: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, start) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, start : len(row)] = torch.tensor(row[start:])
        mask[i, : len(row)] = 1
    return ids, labels, mask
