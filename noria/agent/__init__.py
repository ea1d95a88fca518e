"""Agentic multi-turn rollout: the session server, the plug-in layers, tools and their sandbox.

Modules::

    chat_format.py  token-in-token-out chat rendering (first turn whole, later turns as deltas),
                    assistant parsing (thinking blocks, tool calls); SmolLM2 and Qwen3 formats
    session.py      SessionServer: OpenAI chat completions per session on 127.0.0.1; records the
                    exact engine ids / logprobs / versions and turns them into a Sample
    plugins.py      the rollout / generate / agent function layers, loaded by import path
    tool_task.py    a calculator tool-use task: agent function, statuses with explicit rewards
    sandbox.py      untrusted code in bubblewrap: new namespaces, no capabilities, limits (docs/guarantees.md)

Data flow: ``noria.rollout.generate.run_rollout`` picks the layer the config names; an agent
function talks HTTP to the session server, which calls the engine (or router) with the session id
as routing key. Sessions never go to an engine without a key (``noria.router``).
"""
