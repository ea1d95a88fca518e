"""A multi-turn tool-use task: arithmetic questions answered with a calculator (or Python) tool.

The agent function ``calculator_agent`` (``rollout.agent_fn: noria.agent.tool_task:calculator_agent``)
talks OpenAI chat completions to the session server: it sends the question with the tool list,
runs every tool call the policy makes and appends the results as ``tool`` messages, until the
policy answers without a tool call or a limit is hit. The session server records the tokens.

Each episode ends with one status, and each status has an explicit reward (``STATUS_REWARDS``):

=======================  ==================================================  ===========
status                   when                                                reward
=======================  ==================================================  ===========
``solved``               the final answer holds the right number             1.0
``wrong_answer``         a final answer without the right number             0.0
``turn_limit``           still calling tools after ``max_turns`` turns        0.0
``unparsable_tool_call`` a ``<tool_call>`` tag whose body is not a JSON call  0.0
``env_timeout``          a tool ran past ``tool_timeout_s``                  none: FAILED
``env_error``            the sandbox could not run the python tool           none: FAILED
``truncated``            the model hit its token limit mid-turn              0.0
=======================  ==================================================  ===========

FAILED samples are excluded from training and counted (the environment is at fault, not the
policy). ``metadata`` records the status, the number of valid tool calls and the turns.

Tools: ``calculator(expression)`` evaluates +, -, *, /, //, %, ** and parentheses on numbers by
walking the AST (no ``eval``; exponents above 64 refused); ``python(code)`` runs code in the
sandbox (``noria.agent.sandbox``, isolated). Settings come from the prompt's metadata when present
(``max_turns``, ``tool_timeout_s``), else the module defaults.

Not guaranteed: the answer check takes the last number in the final message (``\\boxed{}`` first
if present); units and words are ignored.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import re
from typing import Any

import httpx

MAX_TURNS = 3
TOOL_TIMEOUT_S = 5.0
SYSTEM = (
    "You are a helpful assistant. You cannot multiply large numbers in your head: call the calculator "
    "tool, then give the final answer as a number."
)
STATUS_REWARDS: dict[str, float | None] = {
    "solved": 1.0,
    "wrong_answer": 0.0,
    "turn_limit": 0.0,
    "unparsable_tool_call": 0.0,
    "env_timeout": None,
    "env_error": None,
    "truncated": 0.0,
}
"""Reward per episode status; None makes the sample FAILED (excluded from training, counted)."""

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly, e.g. 123 * 45.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandbox and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip


class ToolError(Exception):
    """The tool refused its input; the message goes back to the policy as the tool's answer."""


class ToolEnvironmentError(Exception):
    """The tool's environment failed (the sandbox could not start): the sample fails, the policy never sees it."""


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text."""

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ToolError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ToolError(f"unsupported expression: {ast.dump(node)[:60]}")

    try:
        value = walk(ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError) as e:
        raise ToolError(f"cannot evaluate {expression!r}: {e}") from e
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


async def run_tool(call: dict[str, Any], timeout_s: float) -> str:
    """One tool call's answer; ``TimeoutError`` past ``timeout_s``."""
    f = call.get("function", call)
    try:
        args = json.loads(f.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    if not isinstance(args, dict):
        return "error: arguments must be an object"
    if f.get("name") == "calculator":
        try:
            return await asyncio.wait_for(asyncio.to_thread(calculate, str(args.get("expression", ""))), timeout_s)
        except ToolError as e:
            return f"error: {e}"
    if f.get("name") == "python":
        from noria.agent.sandbox import SandboxLimits, SandboxUnavailable, run_python

        limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))
        try:
            result = await asyncio.to_thread(run_python, str(args.get("code", "")), limits)
        except SandboxUnavailable as e:
            raise ToolEnvironmentError(str(e)) from e
        if result.status == "timeout":
            raise TimeoutError("python tool timed out")
        if result.status == "sandbox_error":
            raise ToolEnvironmentError(f"the sandbox could not start: {result.stderr[-500:]}")
        return (result.stdout or result.stderr)[-2000:]
    return f"error: unknown tool {f.get('name')!r}"


def final_number(text: str) -> str | None:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", boxed[-1] if boxed else text.replace(",", ""))
    return numbers[-1] if numbers else None


def outcome(status: str, turns: int, calls: int, detail: str = "") -> dict[str, Any]:
    """The agent function's result for an episode that ended with ``status`` (``detail``: why, for a failure)."""
    meta = {"agent_status": status, "tool_calls": calls, "agent_turns": turns, "solved": status == "solved"}
    reward = STATUS_REWARDS[status]
    if reward is None:
        return {"status": "failed", "status_reason": f"{status}: {detail}" if detail else status, "metadata": meta}
    return {"reward": reward, "metadata": meta}


def question(prompt: Any) -> str:
    if isinstance(prompt.prompt, str):
        return prompt.prompt
    return next(m["content"] for m in reversed(prompt.prompt) if m["role"] == "user")


async def calculator_agent(ctx: Any, prompt: Any, base_url: str) -> dict[str, Any]:
    """Agent function: ask, run tool calls, score the final answer (see the module docstring)."""
    meta = prompt.metadata or {}
    max_turns = int(meta.get("max_turns", MAX_TURNS))
    timeout_s = float(meta.get("tool_timeout_s", TOOL_TIMEOUT_S))
    tools = [CALCULATOR, PYTHON] if meta.get("python_tool") else [CALCULATOR]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(prompt)}]
    calls = 0
    async with httpx.AsyncClient(timeout=None) as http:
        for turn in range(1, max_turns + 1):
            r = await http.post(f"{base_url}/chat/completions", json={"messages": messages, "tools": tools})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            message = choice["message"]
            messages.append(message)
            if choice.get("noria_unparsable_tool_calls"):
                return outcome("unparsable_tool_call", turn, calls)
            if choice["finish_reason"] == "length":
                return outcome("truncated", turn, calls)
            if not message.get("tool_calls"):
                right = final_number(message.get("content") or "") == str(prompt.label)
                return outcome("solved" if right else "wrong_answer", turn, calls)
            for call in message["tool_calls"]:
                try:
                    answer = await run_tool(call, timeout_s)
                except TimeoutError:
                    return outcome("env_timeout", turn, calls)
                except ToolEnvironmentError as e:
                    return outcome("env_error", turn, calls, str(e))
                calls += 1
                messages.append({"role": "tool", "content": answer, "tool_call_id": call.get("id", "")})
    return outcome("turn_limit", max_turns, calls)


def reward(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Reward function for samples the agent did not score (it always does): the solved flag."""
    return float(bool(metadata.get("solved")))
