"""The ``rollout`` section (and ``rollout.buffer``): sampling, placement, staleness, the group buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.model import check_device
from noria.config.schema import ConfigError, check_sampling, option


@dataclass
class BufferConfig:
    """The group buffer between rollout and trainer. Owner: ``noria.rollout.buffer`` (``build_buffer``,
    the ``Buffer`` protocol)."""

    impl: str = option(
        "",
        "Empty for the built-in GroupBuffer, or an import path `pkg.module:Class` of a class meeting the buffer protocol "
        "(noria.rollout.buffer.Buffer; checked when the run starts): built with capacity, max_staleness, filters and "
        "on_drop keywords; async put(group) (may wait while full; False if dropped), take(n, version) (never waits; "
        "drops groups staler than max_staleness), metrics(version), __len__, state_dict, load_state_dict.",
    )
    capacity_batches: int = option(
        2,
        "Capacity in training batches: the buffer holds at most this many times rollout.prompts_per_step groups; a put "
        "on a full buffer waits (the rollout scheduler stops starting groups).",
    )
    filters: list[str] = option(
        factory=list,
        help="Group filters applied on put, in order: zero_reward_variance (dynamic sampling: every reward equal), "
        "over_length (a sample hit rollout.max_new_tokens), or an import path `pkg.module:fn` with fn(group) -> None "
        "(keep) or a drop reason (str).",
    )
    on_drop: Literal["discard", "return"] = option(
        "discard",
        "What happens to the prompt of a dropped group: discarded, or returned to the data source (it is drawn again "
        "before any new prompt).",
    )
    max_consecutive_drops: int = option(
        64,
        "Groups dropped in a row (none trained in between) after which the run stops with an error naming the drop "
        "reasons and an example failure (a reward that always fails, a filter that keeps nothing, staleness).",
    )

    def validate(self) -> None:
        if self.capacity_batches < 1:
            raise ConfigError(f"rollout.buffer.capacity_batches must be >= 1, got {self.capacity_batches}")
        if self.max_consecutive_drops < 1:
            raise ConfigError(f"rollout.buffer.max_consecutive_drops must be >= 1, got {self.max_consecutive_drops}")
        if self.impl and ":" not in self.impl:
            raise ConfigError(f"rollout.buffer.impl must be an import path pkg.module:Class, got {self.impl!r}")
        for name in self.filters:
            if name not in ("zero_reward_variance", "over_length") and ":" not in name:
                raise ConfigError(
                    f"rollout.buffer.filters: unknown filter {name!r}; use zero_reward_variance, over_length "
                    "or an import path pkg.module:fn"
                )


@dataclass
class RolloutConfig:
    """Sampling of training trajectories. Owner: ``noria.rollout`` (``RolloutContext`` and the
    scheduler); its placement fields are read by the RL job (``noria.launch.job``)."""

    n_samples: int = option(8, "Samples per prompt (the group size).")
    max_new_tokens: int = option(256, "Maximum generated tokens per sample.")
    temperature: float = option(1.0, "Sampling temperature; 0 is greedy.")
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest token set with this much probability.")
    top_k: int = option(-1, "Keep only the k most likely tokens; -1 keeps all.")
    min_p: float = option(0.0, "Drop tokens whose probability is below min_p times the top token's.")
    stop: list[str] = option(factory=list, help="Stop strings; generation ends after the first one produced.")
    prompts_per_step: int | None = option(
        None,
        "Prompts sampled per rollout step. Batch invariant: prompts_per_step * n_samples = "
        "train.global_batch * train.steps_per_rollout; set three, the fourth is derived.",
    )
    rollout_fn: str = option(
        "", "Import path `pkg.module:fn` of a rollout function `async (ctx, prompts) -> list[Group]` that replaces "
        "the whole rollout (noria.agent.plugins); empty for the built-in one."
    )
    generate_fn: str = option(
        "", "Import path `pkg.module:fn` of a generate function `async (ctx, sample) -> Sample` (one trajectory; "
        "it records its own tokens); empty for the built-in single-turn one."
    )
    agent_fn: str = option(
        "", "Import path `pkg.module:fn` of an agent function `async (ctx, prompt, base_url) -> dict` that talks "
        "OpenAI chat completions to the session server, which records the tokens (multi-turn, tools)."
    )
    agent_timeout_s: float = option(600.0, "Seconds one agent function may run; past it the sample is FAILED.")
    session_on_mismatch: Literal["error", "rerender"] = option(
        "error", "When an agent re-sends a history that differs from the session's record: error (HTTP 409, the "
        "sample fails) or rerender (the record restarts from the re-rendered history; earlier policy tokens leave it)."
    )
    session_max_open: int | None = option(
        None, "Agent sessions holding a place at once over the whole run (a session takes one at its first request "
        "and frees it when closed): a first request past it is answered HTTP 429 with Retry-After (OpenAI clients "
        "retry it); a session never let in is FAILED naming this option. null: no cap beyond rollout.max_in_flight "
        "(one session per trajectory)."
    )
    session_max_tokens: int | None = option(
        None, "Tokens one agent session may hold, prompt and response together: a request that leaves no room for one "
        "generated token is answered HTTP 413 and the trajectory ends TRUNCATED (FAILED without a turn); generation "
        "is cut to the room left. null: no cap but the engine's context."
    )
    session_idle_timeout_s: float | None = option(
        None, "Seconds an agent session may go without a request in flight before the server closes it (its place "
        "freed; later requests answered HTTP 410); the trajectory ends TRUNCATED (FAILED without a turn). null: none "
        "(rollout.agent_timeout_s still bounds the whole agent)."
    )
    placement: Literal["colocated", "disaggregated"] = option(
        "colocated",
        "colocated: the engine runs in the trainer's process and pauses (KV memory released) while it trains; "
        "disaggregated: the engine is its own `noria serve` process (or the server at engine_url).",
    )
    engine_url: str | None = option(None, "disaggregated: base URL of a running engine server (of rollout.engine's API); null starts one.")
    engine: Literal["noria", "sglang", "vllm"] = option(
        "noria", "disaggregated: the engine server's API: noria (`noria serve`, started by the run or at engine_url), sglang (an "
        "SGLang server at engine_url), vllm (a vLLM server at engine_url, or started by the run); see docs/engines.md.")
    engine_args: list[str] = option(
        factory=list, help="rollout.engine vllm, started by the run: extra arguments of its command line (`vllm serve` "
        "flags, e.g. ['--enforce-eager'] to skip its compilation at start-up); Noria's own flags win where both set one."
    )
    engine_device: str | None = option(
        None,
        "disaggregated: torch device of the `noria serve` engine the run starts (its --device), e.g. cuda:0 while "
        "train.device is cuda:1; null uses model.device. The trainer stays on train.device.",
    )
    engines: int = option(
        1, "disaggregated: rollout engines (`noria serve` processes, or Ray actors under launch: ray); more than one "
        "sit behind the real sglang-router (load-based for single turns, session-key affinity for sessions)."
    )
    engine_restarts: int = option(
        2, "An engine fleet (rollout.engines > 1, rollout.elastic or train.world_size > 1): times one engine is "
        "restarted after it died (its in-flight groups are regenerated, it is re-synced to the current weights); past "
        "that, or with no engine left alive, the run stops naming the engine. The run's one engine without a fleet is "
        "never restarted: its death stops the run (docs/guarantees.md)."
    )
    elastic: bool = option(
        False, "disaggregated noria engines: run the engine fleet (sglang-router once a second engine serves) even with "
        "rollout.engines 1, so that `noria fleet add RUN_DIR` can grow it while it runs (a fleet of 2 or more always "
        "can); see docs/scale.md."
    )
    engine_drain_s: float = option(
        30.0, "Seconds an engine of a fleet leaving it (noria fleet remove, or SIGTERM: preemption) may take to finish "
        "its admitted requests (noria serve --drain-timeout); those it has not finished are aborted and their groups "
        "generated again on the other engines. Under preemption, keep it below the grace period before SIGKILL."
    )
    max_staleness: int = option(
        0, "Largest allowed trainer version minus the oldest weight version in a group; 0 is synchronous RL."
    )
    engine_timeout_s: float = option(
        600.0, "Seconds one rollout request may take before the engine is declared dead and the run stops."
    )
    max_in_flight: int | None = option(
        None,
        "Trajectories generating at once at most (the rollout scheduler's places); null is prompts_per_step * n_samples "
        "(one step's worth).",
    )
    granularity: Literal["auto", "group", "sample"] = option(
        "auto",
        "When places free up: group (when every trajectory of a group has finished) or sample (each finished trajectory "
        "frees its place; a new group starts once n_samples places are free). auto: sample when max_staleness > 0, else group.",
    )
    pause_mode: Literal["retract", "in_place", "drain"] = option(
        "retract",
        "How a disaggregated engine takes a weight update during generation: retract (in-flight requests are aborted and "
        "resumed from their partial tokens under the new weights), in_place (generation pauses, the weights change, it continues "
        "with its KV cache) or drain (no request starts; the update waits for the running ones: the mode of vLLM, which reports no versions).",
    )
    resume_in_flight: Literal["auto", "continue", "retract"] = option(
        "auto",
        "What a checkpoint keeps of the trajectories still generating, and what --resume does with them: continue (each "
        "request is stopped with its tokens and recorded with their logprobs and weight versions, its group's finished "
        "samples and id; it then goes on from them, and a resumed run continues it from them, re-prefilled, unless its "
        "oldest token is already staler than max_staleness at the checkpoint's weights: then it is retracted, the reason "
        "logged and counted in resume/in_flight_retracted), retract (their prompts go back to the data source, their tokens "
        "are dropped) or auto: continue under asynchronous RL (max_staleness > 0), retract under synchronous RL (a resumed "
        "run then repeats an uninterrupted one bitwise) and where continue cannot work (rollout_fn or agent_fn, several "
        "engines, an SGLang or vLLM engine). See docs/guarantees.md.",
    )
    routing_replay: bool = option(
        False,
        "MoE models: the engine records the experts each policy token was routed to (per MoE layer) and the trainer's "
        "MoE layers use them, with gate weights from its own router (rollout routing replay, R3). Implies record_routes.",
    )
    record_routes: bool = option(
        False,
        "MoE models: record the engine's routes and log moe/route_mismatch without replaying them (the trainer routes "
        "by itself); routing_replay records them anyway.",
    )
    buffer: BufferConfig = option(factory=lambda: BufferConfig(), help="The group buffer between rollout and trainer.")

    @property
    def wants_routes(self) -> bool:
        """Whether rollout asks the engine for routes (``routing_replay`` or ``record_routes``)."""
        return self.routing_replay or self.record_routes

    def validate(self) -> None:
        check_sampling("rollout", self.temperature, self.top_p, self.top_k, self.min_p, self.max_new_tokens)
        plugins = [k for k in ("rollout_fn", "generate_fn", "agent_fn") if getattr(self, k)]
        if len(plugins) > 1:
            raise ConfigError(f"rollout: set at most one of rollout_fn, generate_fn, agent_fn (got {', '.join(plugins)})")
        for k in plugins:
            if ":" not in getattr(self, k):
                raise ConfigError(f"rollout.{k} must be an import path pkg.module:fn, got {getattr(self, k)!r}")
        if self.agent_timeout_s <= 0:
            raise ConfigError(f"rollout.agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        for key in ("session_max_open", "session_max_tokens"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key} must be >= 1 or null, got {getattr(self, key)}")
        if self.session_idle_timeout_s is not None and not self.session_idle_timeout_s > 0:
            raise ConfigError(f"rollout.session_idle_timeout_s must be > 0 or null, got {self.session_idle_timeout_s}")
        if self.n_samples < 1:
            raise ConfigError(f"rollout.n_samples must be >= 1, got {self.n_samples}")
        if self.prompts_per_step is not None and self.prompts_per_step < 1:
            raise ConfigError(f"rollout.prompts_per_step must be >= 1 or null, got {self.prompts_per_step}")
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.engines < 1 or self.engine_restarts < 0:
            raise ConfigError(f"rollout.engines must be >= 1 and rollout.engine_restarts >= 0, got {self.engines}, {self.engine_restarts}")
        if self.engines > 1 and (self.placement != "disaggregated" or self.engine_url is not None):
            raise ConfigError("rollout.engines > 1 starts a fleet of `noria serve` engines: it needs rollout.placement: "
                              "disaggregated and no rollout.engine_url")
        if self.elastic and (self.placement != "disaggregated" or self.engine_url is not None or self.engine != "noria"):
            raise ConfigError("rollout.elastic runs a fleet of `noria serve` engines: it needs rollout.placement: "
                              "disaggregated, rollout.engine: noria and no rollout.engine_url")
        if self.engine_drain_s < 0:
            raise ConfigError(f"rollout.engine_drain_s must be >= 0, got {self.engine_drain_s}")
        if self.engine_timeout_s <= 0:
            raise ConfigError(f"rollout.engine_timeout_s must be > 0, got {self.engine_timeout_s}")
        if self.engine != "noria" and (self.placement != "disaggregated" or self.engines > 1 or (self.engine == "sglang" and not self.engine_url)):
            raise ConfigError(f"rollout.engine {self.engine} is one engine server: it needs rollout.placement: disaggregated, rollout.engines: 1"
                              + (" and rollout.engine_url (Noria does not start SGLang)" if self.engine == "sglang" else ""))
        if self.engine_args and (self.engine != "vllm" or self.engine_url is not None):
            raise ConfigError("rollout.engine_args are the command line of a vLLM server the run starts: they need "
                              "rollout.engine: vllm and no rollout.engine_url (the built-in engine takes engine.* keys)")
        if self.engine_url is not None and self.placement != "disaggregated":
            raise ConfigError("rollout.engine_url names an external engine: it needs rollout.placement: disaggregated")
        if self.engine_device is not None:
            if self.placement != "disaggregated" or self.engine_url is not None:
                raise ConfigError(
                    "rollout.engine_device places the `noria serve` engine the run starts: it needs rollout.placement: "
                    "disaggregated and no rollout.engine_url (a colocated engine uses model.device)"
                )
            check_device("rollout.engine_device", self.engine_device)
        if self.max_staleness > 0 and self.placement == "colocated":
            raise ConfigError(
                "rollout.max_staleness > 0 (asynchronous RL) needs rollout.placement: disaggregated; a colocated engine "
                "pauses while the trainer runs, so it cannot generate ahead"
            )
        if self.max_in_flight is not None and self.max_in_flight < self.n_samples:
            raise ConfigError(
                f"rollout.max_in_flight must be >= rollout.n_samples ({self.n_samples}) or null, got {self.max_in_flight}"
            )
        blockers = resume_in_flight_blockers(self)
        if self.resume_in_flight == "continue" and blockers:
            raise ConfigError(f"rollout.resume_in_flight: continue cannot work here: {blockers[0]}; use auto or retract")
        self.buffer.validate()


def resume_in_flight_blockers(rollout: RolloutConfig) -> list[str]:
    """Why the requests in flight at a checkpoint cannot be continued under this config (empty: they can)."""
    why = [f"rollout.{k} produces whole groups: no request's tokens to keep" for k in ("rollout_fn", "agent_fn") if getattr(rollout, k)]
    if rollout.engines > 1:
        why.append("an engine fleet (rollout.engines > 1) is not stopped request by request")
    if rollout.engine != "noria":
        why.append(f"rollout.engine {rollout.engine}: only a noria engine answers an abort with the tokens so far")
    return why
