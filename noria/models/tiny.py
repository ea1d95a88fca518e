"""``tiny-llama``: a small Llama built on this machine in a minute or two, for first runs and tests.

Nothing is downloaded. The builder (:func:`build_tiny_llama`, the catalog entry ``tiny-llama``):

1. trains a byte-level BPE tokenizer (``tokenizers``) on arithmetic chats in SmolLM2's ChatML format,
   with the same special tokens and chat template, so prompts render the way they do for the real
   model; digits are split one per token (as Llama 3's and Qwen's tokenizers do), so that sums are
   written digit by digit and the model can learn addition rather than a table of number tokens;
2. builds a random-init ``LlamaForCausalLM`` (4 layers, hidden 128, about 0.8M parameters);
3. warm-starts it with :data:`WARM_STEPS` supervised steps on chats of the arithmetic task's own
   prompts (addition of operands up to :data:`MAX_OPERAND`) from the task's *train* split only (the
   task's held-out prompts are never seen). Each answer first restates the sum, ``12 + 7 = 19``:
   with the operands written right before it, this tiny model learns to add pairs it never saw
   (greedy, on the 90 held-out problems of ``examples/grpo_tiny.yaml``: 92% as built on an AVX-512
   CPU, 98% as AVX2; answering a bare ``19`` instead, it got 9% after 800 steps as AVX2 and 28-40%
   after 1200, so the CPU's rounding decided whether it generalised). The prompt asks for the answer in ``\\boxed{}``; only :data:`BOXED_SHARE` of the warm
   start's answers go on to box it (``12 + 7 = 19, so \\boxed{19}``), the others stop after the sum.
   ``examples/grpo_tiny.yaml`` rewards only boxed right answers (``exact_match`` with ``boxed:
   true``), so held-out accuracy starts near that share and GRPO's job is the format: to always box
   the sum it already computes. The box holds a copy of a number already written, so learning it
   does not disturb the arithmetic.

Two threads while it trains (:data:`WARM_THREADS`; one on a one-core machine): 0.084 s a step
against 0.137 s on one thread of a 2-core AMD EPYC Zen 4, so the import takes about 70 s instead of
115 s; more threads gain little on matrices this small and lose much when the cores are shared.
Seeded: the same torch build on the same CPU with the same thread count gives the same folder; CPUs
whose matmuls sum in another order (AVX2 and AVX-512) give slightly different weights. Not guaranteed: the exact accuracy of the warm start (a tiny model
trained for a minute); the figures above are what this recipe gave on one machine.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from noria.console import say

MAX_OPERAND = 30
"""Operands of the warm start's problems (and of ``examples/grpo_tiny.yaml``'s task)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as SmolLM2-Instruct's template renders it (without its default system message)."""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
RECIPE_VERSION = 3
"""Raised whenever the built folder changes (the catalog rebuilds cached folders of other versions).
1: bare answers, 800 steps; 2: answers restate the sum, then box it in BOXED_SHARE of the chats; 3: two threads."""
WARM_STEPS = 800
"""Supervised steps of the warm start (batch 32): about a minute on one free core. 400 were not enough
(held-out sums 64% as AVX2, 80% on AVX-512, and almost no boxed answers left for GRPO to find)."""
WARM_LR = 3e-3
"""Peak learning rate of the warm start (linear warmup over 50 steps, then linear decay to 0)."""
WARM_THREADS = 2
"""Threads of the warm start (at most the machine's cores)."""
BOXED_SHARE = 0.3
"""Share of the warm start's answers that box the sum (``a + b = n, so \\boxed{n}``; the others: ``a + b = n``)."""


def build_tiny_llama(entry, out: Path) -> None:
    """Catalog builder: tokenizer, model and warm start into ``out`` (an empty folder)."""
    import torch

    torch.manual_seed(0)
    chats = _chats(n=800, seed=0)
    tokenizer = _tokenizer(chats)
    model = _model(tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(WARM_THREADS, os.cpu_count() or 1))
    try:
        _warm_start(model, tokenizer, chats, steps=WARM_STEPS)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _chats(n: int, seed: int) -> list[str]:
    """Rendered chats of train-split arithmetic problems: the prompt, then the answer (:func:`_answer`)."""
    from noria.data.tasks import generate_split

    args = {"n_train": n, "n_test": 10, "seed": seed, "max_operand": MAX_OPERAND, "ops": ["+"]}
    records = generate_split("arithmetic", "train", args)
    rng = random.Random(seed + 1)
    answers = [_answer(r.metadata["expression"], r.label, boxed=rng.random() < BOXED_SHARE) for r in records]
    return [
        f"<|im_start|>user\n{r.prompt}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
        for r, answer in zip(records, answers)
    ]


def _answer(expression: str, label: str, boxed: bool) -> str:
    """The warm start's answer: the sum restated after its operands, then boxed if ``boxed``."""
    equation = f"{expression} = {label}"
    return f"{equation}, so \\boxed{{{label}}}" if boxed else equation


def _tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
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
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
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
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_LR, weight_decay=0.0)
    rng = random.Random(0)
    model.train()
    for step in range(steps):
        ids, labels, mask = _batch([rows[rng.randrange(len(rows))] for _ in range(batch)], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:  # short warmup, then linear decay: the last steps settle
            group["lr"] = WARM_LR * min(1.0, (step + 1) / 50) * (1 - step / steps)
        opt.step()
        if (step + 1) % 100 == 0:
            say(f"noria: tiny-llama warm start: step {step + 1}/{steps}, loss {loss.item():.3f}")
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
