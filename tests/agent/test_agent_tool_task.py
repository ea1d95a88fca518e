"""The calculator tool-use task: each episode status with its reward, on a scripted engine through the
real session server (CPU, loopback only), and the calculator itself."""

from __future__ import annotations

import asyncio

import pytest

from noria.agent.session import SessionServer
from noria.agent.tool_task import ToolError, calculate, calculator_agent
from noria.engine.protocol import SamplingParams
from noria.types import Prompt
from session_util import Scripted, qwen3_tokenizer

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'


def calc_call(expr: str) -> str:
    return CALL.format(name="calculator", args='{"expression": "%s"}' % expr)


def episode(tmp_path, answers, **meta):
    tok = qwen3_tokenizer(tmp_path)
    engine = Scripted(tok, answers)

    async def run():
        async with SessionServer(engine, tok, SamplingParams(max_new_tokens=64)) as server:
            session = server.open("e")
            prompt = Prompt("What is 123 * 45?", label="5535", metadata=meta)
            result = await calculator_agent(None, prompt, server.base_url("e"))
            server.close("e")
            return result, session

    return asyncio.run(run())


def test_solved_after_a_tool_call(tmp_path):
    result, session = episode(tmp_path, [calc_call("123 * 45"), "The answer is 5535.<|im_end|>"])
    assert result["reward"] == 1.0 and result["metadata"]["agent_status"] == "solved" and result["metadata"]["tool_calls"] == 1
    text = session.fmt.tokenizer.decode(session.response_ids, skip_special_tokens=False)
    assert "<tool_response>\n5535\n</tool_response>" in text  # the tool's answer is in the trajectory, mask 0
    assert session.turns == 2


def test_wrong_answer(tmp_path):
    result, _ = episode(tmp_path, ["It is 5000.<|im_end|>"])
    assert (result["reward"], result["metadata"]["agent_status"]) == (0.0, "wrong_answer")


def test_unparsable_tool_call(tmp_path):
    result, _ = episode(tmp_path, ["<tool_call>\n{calculator: 123*45\n</tool_call><|im_end|>"])
    assert (result["reward"], result["metadata"]["agent_status"]) == (0.0, "unparsable_tool_call")


def test_turn_limit(tmp_path):
    result, session = episode(tmp_path, [calc_call("1 + 1")] * 2, max_turns=2)
    assert (result["reward"], result["metadata"]["agent_status"]) == (0.0, "turn_limit") and session.turns == 2


def test_environment_timeout_is_a_failure_not_a_zero(tmp_path):
    loop = CALL.format(name="python", args='{"code": "while True: pass"}')
    result, _ = episode(tmp_path, [loop], python_tool=True, tool_timeout_s=1.0)
    assert result["status"] == "failed" and result["status_reason"] == "env_timeout" and "reward" not in result


def test_sandbox_that_cannot_run_fails_the_sample_never_answers_the_model(tmp_path, monkeypatch):
    import shutil

    bin_dir = tmp_path / "bin"  # a machine without bubblewrap
    bin_dir.mkdir()
    for tool in ("unshare", "setpriv", "mount", "sh"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    run = CALL.format(name="python", args='{"code": "print(6 * 7)"}')
    result, session = episode(tmp_path, [run, "The answer is 5535.<|im_end|>"], python_tool=True)
    assert result["status"] == "failed" and result["status_reason"].startswith("env_error: ") and "bubblewrap" in result["status_reason"]
    assert session.turns == 1  # the error never went back to the policy as the tool's answer


def test_calculator():
    assert calculate("123 * 45") == "5535" and calculate("(2+3)^2") == "25" and calculate("7/2") == "3.5"
    for bad in ("__import__('os')", "2 ** 1000000", "1/0", "a + 1"):
        with pytest.raises(ToolError):
            calculate(bad)
