"""Supervised fine-tuning data: multi-turn chats -> samples whose loss covers assistant tokens only.

How data moves: a JSONL row ``{"messages": [{"role", "content"}, ...]}`` is rendered with the
tokenizer's chat template INCREMENTALLY. For each assistant turn k, the text before it is
``render(messages[:k], add_generation_prompt=True)`` and the text through it is
``render(messages[:k+1])``; the difference is what the model must generate (content plus the
template's end-of-turn marker, e.g. ``...<|im_end|>\\n`` in ChatML), and those tokens get
loss_mask 1. Everything else (system, user, tool turns, role headers) gets 0. Each piece is
tokenized on its own and the ids concatenated, which is how a chat session extends its token list
turn by turn, so the trained ids are exactly what rollouts would see.

This requires a prefix-consistent template: every rendering must start with the previous one. A
template that rewrites earlier turns (e.g. drops past assistant reasoning) or whose generation
prompt is not a prefix of the assistant turn raises :class:`SFTDataError` naming the row and turn.

The resulting :class:`~noria.types.Sample` goes through the same packing and backend as RL, with
``train.algorithm: sft`` selecting the token-mean NLL (``noria.train.losses.sft_loss``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from noria.errors import NoriaError
from noria.train.packing import pack_samples
from noria.types import Sample, TrainBatch


class SFTDataError(NoriaError):
    """A chat row cannot be turned into a training sample (bad row, template not prefix-consistent)."""


def read_chat_jsonl(path: str | Path) -> list[list[dict[str, Any]]]:
    """The ``messages`` of every row of a JSONL file; ``SFTDataError`` names the file, line and field
    of the first bad row (too long, not UTF-8, not JSON, a message without role or content)."""
    from noria.data.source import BadRow, DataError, check_message, jsonl_rows

    rows = []
    for line, row in jsonl_rows(path):
        where = f"{path}:{line.removeprefix('line ')}"
        if isinstance(row, BadRow):
            raise SFTDataError(f"{where}: {row.reason}")
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise SFTDataError(f"{where}: expected an object with 'messages': [{{'role', 'content'}}, ...]")
        try:
            for i, message in enumerate(messages):
                check_message(message, f"messages[{i}]")
        except DataError as e:
            raise SFTDataError(f"{where}: {e}") from e
        rows.append(messages)
    return rows


def chat_sample(messages: Sequence[dict[str, Any]], tokenizer: Any, where: str = "row") -> Sample:
    """Token ids of a chat and a loss mask that is 1 exactly on assistant-generated tokens."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTDataError(f"{where}: the tokenizer has no chat template")
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: no assistant message to train on")
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # text rendered so far
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            head = _render(tokenizer, messages[:k], generation=True)
            _extend(ids, mask, tokenizer, _suffix(done, head, where, k, "generation prompt"), 0)
            done = head
        full = _render(tokenizer, messages[: k + 1], generation=False)
        trained = int(message["role"] == "assistant")
        _extend(ids, mask, tokenizer, _suffix(done, full, where, k, "message"), trained)
        done = full
    first = mask.index(1)
    return Sample(prompt_ids=ids[:first], response_ids=ids[first:], loss_mask=mask[first:], metadata={"source": where})


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], generation: bool) -> str:
    if not messages:
        return tokenizer.apply_chat_template([], tokenize=False, add_generation_prompt=generation) if generation else ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation)


def _suffix(done: str, text: str, where: str, k: int, what: str) -> str:
    if not text.startswith(done):
        raise SFTDataError(
            f"{where}: the chat template is not prefix-consistent at message {k} ({what}): rendering "
            "more messages changed the text of earlier ones, so assistant tokens cannot be located "
            "by incremental rendering (templates that rewrite past turns, e.g. strip reasoning, do this)"
        )
    return text[len(done) :]


def _extend(ids: list[int], mask: list[int], tokenizer: Any, text: str, value: int) -> None:
    if text:
        new = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(new)
        mask.extend([value] * len(new))


def chat_samples(rows: Sequence[Sequence[dict[str, Any]]], tokenizer: Any, max_tokens: int | None = None) -> list[Sample]:
    """``chat_sample`` of every row; rows longer than ``max_tokens`` are truncated on the right."""
    samples = []
    for i, messages in enumerate(rows):
        s = chat_sample(messages, tokenizer, where=f"row {i}")
        if max_tokens is not None and len(s.prompt_ids) + len(s.response_ids) > max_tokens:
            keep = max(max_tokens - len(s.prompt_ids), 0)
            s.response_ids, s.loss_mask = s.response_ids[:keep], s.loss_mask[:keep]
        s.index = i
        samples.append(s)
    return samples


def sft_batches(samples: Sequence[Sample], batch_size: int) -> Iterator[TrainBatch]:
    """Consecutive packed batches of ``batch_size`` samples (the last may be smaller)."""
    for start in range(0, len(samples), batch_size):
        yield pack_samples(samples[start : start + batch_size])
