"""The ``reward`` section (and ``reward.model``): the rule reward by name or import path, a reward
served by a model (a generative judge), how they mix, and their limits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from noria.config.schema import ConfigError, option

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to the problem below. Reply with one line: `Score: N`, N an integer from 0 (wrong) to 10 "
    "(fully correct).\n\nProblem:\n{{ prompt }}\n\nAnswer:\n{{ response }}"
    "{% if criterion %}\n\nCriterion: {{ criterion }}{% endif %}"
)
"""The generative judge's prompt when ``reward.model.template`` is empty (its verdict: ``Score: N``)."""


@dataclass
class RewardModelConfig:
    """A reward served by a model: a generative judge (``kind: judge``) or a scalar reward model
    (``kind: scalar``). Owner: ``noria.rewards.model`` (the scorer, its cache and metrics),
    ``noria.rewards.judge`` (prompt, request, verdict) and ``noria.rewards.scalar`` (the reward model's
    input and score)."""

    kind: Literal["none", "judge", "scalar"] = option(
        "none",
        "none: rule reward only. judge: a generative judge scores every sample: a chat request built from `template`, "
        "its reply parsed by `parser` and mapped to [0, 1]. scalar: a sequence-classification reward model (one logit, "
        "Bradley-Terry) scores the chat-templated prompt + response with one forward pass (`scale` maps the logit).",
    )
    name: str = option("judge", "The judge's name: its metric reward/component/<name>, and what errors call it.")
    weight: float = option(1.0, "The judge's weight in the sample's reward (reward = reward.rule_weight * rule + weight * judge).")
    url: str | None = option(
        None, "Base URL of a running judge server (noria serve, SGLang, vLLM or any OpenAI-compatible one); null with "
        "`engine` set: the run starts one."
    )
    engine: str | None = option(
        None, "A model (catalog name or HF folder) that the run serves as the judge with `noria serve` (frozen weights; "
        "the engine.* keys of the run), beside the rollout engine; a sequence-classification folder for kind scalar. "
        "kind judge also takes `shared`: the judge's requests go to the rollout engines at `priority` (the judge is then "
        "the policy itself, at its current weights)."
    )
    in_process: bool = option(
        False, "kind scalar: load the `engine` reward model in the trainer's process (on engine_device, else model.device) "
        "and score there, without a server."
    )
    priority: int = option(
        -1, "engine shared: the judge's request priority on the rollout engines (SGLang's `priority`: larger is admitted "
        "first; rollout requests have 0), so judging never delays rollout admission."
    )
    scale: Literal["raw", "sigmoid"] = option(
        "raw", "kind scalar: the reward from the model's logit: raw (the logit, as TRL, verl and OpenRLHF use it; GRPO "
        "standardizes it within each group) or sigmoid (in (0, 1): mixes with a 0/1 rule and agreement_threshold 0.5)."
    )
    engine_device: str | None = option(None, "Torch device of the judge's `noria serve` (e.g. cuda:1); null uses model.device.")
    engine_threads: int | None = option(
        None, "Torch threads of the judge's `noria serve` on a CPU (OMP_NUM_THREADS, which wins when set); null: as many as "
        "the run's own process. On a small CPU the judge's engine shares the cores with rollout and training: fewer threads "
        "oversubscribe them less (docs/rewards.md, costs)."
    )
    api: Literal["sglang", "openai"] = option(
        "sglang",
        "kind judge: sglang: POST /generate with the chat prompt rendered by the judge's tokenizer and a request id (rid) the answer "
        "must echo (a mismatch is refused); openai: POST /v1/chat/completions (an X-Request-Id header; refused when the "
        "server echoes another). kind scalar always speaks SGLang's POST /classify (input_ids, rid; the reward is "
        "embedding[0]).",
    )
    api_key_env: str | None = option(
        None, "Name of the environment variable holding the judge server's API key (never the key itself); null: none, "
        "or the run's own key for a judge it starts."
    )
    served_model: str | None = option(None, "api openai: the `model` field of each request; null: the server's first model.")
    tokenizer: str | None = option(
        None, "api sglang (and kind scalar): the judge's tokenizer (catalog name or folder) whose chat template renders "
        "the prompt; null: the `engine` model, else the tokenizer_path the server reports (/model_info)."
    )
    template: str = option(
        "",
        "Jinja template of the judge's user message, given prompt (text, or a chat's last user message), messages, "
        "response, label, metadata and criterion (a rubric item, else empty); empty: a built-in 0-10 grading prompt.",
    )
    system_prompt: str | None = option(None, "A system message before the judge's prompt.")
    parser: Literal["number", "label", "boxed", "answer"] = option(
        "number",
        "How the verdict becomes a score: number (the number captured by `pattern`, default `Score: N`, else the last "
        "number; mapped from score_range to [0, 1]), label (the first key of `labels` found, whole word, case-insensitive; "
        "its value), boxed (the number in the last \\boxed{}, from score_range), answer (the judge states the response's "
        "final answer, captured by `pattern`, else its last \\boxed{}, else its last number: 1 when it equals the sample's "
        "label as a number, else 0; a reference-guided grader). No verdict: the sample fails (unparseable).",
    )
    pattern: str = option(
        "", "A regex whose first group captures the verdict (number and answer parsers: a number; label parser: a label); empty: "
        "`Score:\\s*(-?\\d+(?:\\.\\d+)?)` for number, the labels themselves for label."
    )
    labels: dict[str, float] = option(factory=dict, help="parser label: each label's reward, e.g. {correct: 1.0, incorrect: 0.0}.")
    score_range: list[float] = option(
        factory=lambda: [0.0, 10.0], help="parser number or boxed: [low, high] of the judge's scale, mapped to [0, 1] "
        "(a score outside it fails the sample)."
    )
    rubric: list[dict[str, Any]] = option(
        factory=list,
        help="Criteria, each {criterion: text, weight: w}: the judge scores each (the template's `criterion`); the "
        "sample's judge reward is their weighted mean. Empty: one verdict per sample.",
    )
    rubric_mode: Literal["each", "all"] = option(
        "each", "each: one request per criterion (sent together); all: one request listing every criterion, its reply "
        "holding one verdict per criterion, in order."
    )
    max_new_tokens: int = option(64, "Tokens the judge may write per verdict.")
    temperature: float = option(0.0, "The judge's sampling temperature (0: greedy).")
    timeout_s: float = option(60.0, "Seconds one judge request may take before it is retried (then the sample fails: timeout).")
    retries: int = option(1, "Further tries of a request that timed out or could not connect, before the sample fails.")
    max_concurrency: int = option(64, "Judge requests in flight at once (the judge engine batches them).")
    cache: bool = option(True, "Reuse a verdict for the same (judge, prompt, response) within the run.")
    agreement_threshold: float = option(
        0.5, "reward/agreement: judge and rule agree on a sample when both rewards are >= this, or both below it."
    )

    def validate(self) -> None:
        if self.kind == "none":
            return
        p = "reward.model"
        if (self.url is None) == (self.engine is None):
            raise ConfigError(f"{p}.kind {self.kind}: set exactly one of {p}.url (a running server) or {p}.engine (a model to serve)")
        if self.kind == "scalar" and self.engine == "shared":
            raise ConfigError(f"{p}.engine shared is for kind judge: a scalar reward model is its own model; give its folder")
        if self.in_process and (self.kind != "scalar" or self.engine is None):
            raise ConfigError(f"{p}.in_process needs kind scalar and {p}.engine (the reward model's folder)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{p}.url must be a base URL http://HOST:PORT, got {self.url!r}")
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ConfigError(f"{p}.engine_threads must be >= 1 (or null), got {self.engine_threads}")
        if self.timeout_s <= 0 or self.retries < 0 or self.max_concurrency < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"{p}: timeout_s must be > 0, retries >= 0, max_concurrency >= 1 and max_new_tokens >= 1")
        if self.temperature < 0:
            raise ConfigError(f"{p}.temperature must be >= 0, got {self.temperature}")
        if self.parser == "label" and not self.labels:
            raise ConfigError(f"{p}.parser label needs {p}.labels, e.g. {{correct: 1.0, incorrect: 0.0}}")
        if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
            raise ConfigError(f"{p}.score_range must be [low, high] with low < high, got {self.score_range}")
        if self.pattern:
            try:
                if re.compile(self.pattern).groups < 1:
                    raise ConfigError(f"{p}.pattern needs a capturing group (the verdict), got {self.pattern!r}")
            except re.error as e:
                raise ConfigError(f"{p}.pattern is not a valid regex ({e}): {self.pattern!r}") from e
        for i, item in enumerate(self.rubric):
            if set(item) - {"criterion", "weight"} or not isinstance(item.get("criterion"), str):
                raise ConfigError(f"{p}.rubric[{i}] must be {{criterion: text, weight: number}}, got {item!r}")
            if not isinstance(item.get("weight", 1.0), (int, float)) or isinstance(item.get("weight"), bool) or item.get("weight", 1.0) < 0:
                raise ConfigError(f"{p}.rubric[{i}].weight must be a number >= 0, got {item.get('weight')!r}")
        if self.rubric and sum(float(i.get("weight", 1.0)) for i in self.rubric) <= 0:
            raise ConfigError(f"{p}.rubric: the weights sum to 0")


@dataclass
class RewardConfig:
    """How a sample is scored. Owner: ``noria.rewards`` (the registry, the runner, the model rewards)."""

    name: str | None = option(
        None,
        "A registered reward (exact_match, numeric, math, format, countdown) or a user function: "
        "`pkg.module:fn`, or `path/to/file.py:fn` (imported from that file, its folder on sys.path); "
        "null uses the built-in task's own reward.",
    )
    kwargs: dict[str, Any] = option(factory=dict, help="Keyword arguments passed to the reward function.")
    timeout_s: float = option(10.0, "Seconds one reward call may take; past that the sample is marked failed.")
    max_concurrency: int = option(32, "Reward calls running at once (threads for sync functions).")
    rule_weight: float = option(
        1.0, "With reward.model: the rule reward's weight in the sample's reward; 0 keeps it measured only "
        "(reward/component/<name>, reward/agreement, and held-out accuracy) without training on it."
    )
    model: RewardModelConfig = option(factory=lambda: RewardModelConfig(), help="A reward served by a model (a generative judge).")
    score_each_sample: bool = option(
        True,
        "Score each sample as soon as it finishes, while its group's other samples still generate (the reward's time "
        "hides behind generation: time/reward_hidden_s); false: score a group once all its samples are done. A batched "
        "(TRL-style) reward function always gets whole groups.",
    )
    overlong_buffer_tokens: int = option(
        0,
        "Soft overlong punishment (DAPO): a response whose policy tokens run into the last this-many tokens of "
        "rollout.max_new_tokens gets a penalty falling linearly from 0 to -overlong_penalty at the limit, added to its "
        "reward (reward/component/overlong). 0: off. Single-turn rollouts only.",
    )
    overlong_penalty: float = option(1.0, "The overlong penalty at rollout.max_new_tokens (see overlong_buffer_tokens).")

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_concurrency < 1:
            raise ConfigError(f"reward.max_concurrency must be >= 1, got {self.max_concurrency}")
        self.model.validate()
        if self.overlong_buffer_tokens < 0 or self.overlong_penalty < 0:
            raise ConfigError(
                f"reward.overlong_buffer_tokens and reward.overlong_penalty must be >= 0, got "
                f"{self.overlong_buffer_tokens} and {self.overlong_penalty}"
            )
