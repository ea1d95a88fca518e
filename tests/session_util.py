"""Helpers of the session server tests (tests/agent/): an engine that answers from a script, and a
tiny tokenizer with Qwen3's chat format (thinking blocks, tool calls)."""

from __future__ import annotations

from noria.agent.chat_format import QWEN3_TEMPLATE
from noria.engine.protocol import GenerateOutput, GenerateRequest
from tiny_util import build_tokenizer


class Scripted:
    """Answers each request with the next scripted text, tokenized, logprob -0.5 per token, version 3."""

    def __init__(self, tokenizer, answers: list[str]):
        self.tok, self.answers, self.requests = tokenizer, list(answers), []

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        self.requests.append(req)
        ids = self.tok.encode(self.answers.pop(0), add_special_tokens=False)
        return GenerateOutput("r", ids, [-0.5] * len(ids), [3] * len(ids), finish_reason={"type": "stop"}, prompt_tokens=len(req.input_ids))


def qwen3_tokenizer(folder):
    tok = build_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>", "<tool_call>", "</tool_call>"]})
    tok.chat_template = QWEN3_TEMPLATE
    return tok
