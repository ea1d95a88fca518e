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

The ``eval`` config section is ``noria.config.eval``.
"""

from noria.eval.runner import EvalResult, run_eval

__all__ = ["EvalResult", "run_eval"]
