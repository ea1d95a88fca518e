"""Evaluation: accuracy of a model on a task's held-out split.

Flow: config -> prompts (loaded and validated first, so bad data fails before any model loads) ->
tokenizer -> rendered prompt ids (over-long ones dropped and counted) -> model -> batched generation
-> ``Sample`` records -> rewards -> accuracy. Results go to the run folder as ``eval.json`` (the
figures) and ``samples.jsonl`` (every answer with its reward and status), next to the resolved
``config.yaml``.

Generation runs on the built-in rollout engine (continuous batching, all answers submitted at
once) for native architectures, and on transformers' ``generate`` for any other. Accuracy is the
mean reward over every answer: an answer whose reward failed counts as wrong (so a reward that times
out on hard answers cannot raise accuracy), and the failures are also reported separately
(``n_failed``, ``failed_reasons``). An evaluation in which not one answer could be scored is an
error (``NoriaError``), not an accuracy.


``noria.eval.config`` is the config section (a leaf); this ``__init__`` imports the runner only
when asked, so loading a config stays light.
"""

from typing import Any

__all__ = ["EvalResult", "run_eval"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from noria.eval import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'noria.eval' has no attribute {name!r}")
