"""The Python API: ``noria.train``, ``noria.Engine`` and the reward registry, for scripts and notebooks.

``train(model=, dataset=, reward_funcs=, config=, **overrides)`` builds the same typed ``RunConfig``
as ``noria train`` (the YAML file or dict of ``config`` first, then the overrides, then ``model``,
``dataset`` and ``reward_funcs``; validated and resolved by ``noria.config``), refuses what ``noria
train`` refuses (``noria.preflight.check_references``), runs the same job (``run``: RL or SFT) and
returns the run folder, whose ``config.yaml`` is the resolved config, as for the CLI.

How the arguments become config keys:

- ``model``: ``model.path`` (catalog name, HF folder or hub id ``Org/Name[@revision]``).
- ``dataset``: a file or folder path or hub id -> ``data.path``; a list of dicts or a
  ``datasets.Dataset`` -> written once as JSON Lines under ``$NORIA_HOME/datasets/<sha256>.jsonl``
  (named by content: the same rows give the same file, so the saved config can resume the run) ->
  ``data.path``; it replaces a built-in task (``data.task``, ``data.task_args``) of the config.
  ``eval_dataset``, in the same forms, is ``data.test_path`` (what ``eval.every`` evaluates on). For
  in-memory rows, unless the config sets them, ``data.label_key`` is ``label`` when every row has one
  (else null) and ``data.metadata_keys`` are the other columns, so that every column reaches a reward
  function by name, as in TRL. With ``train.algorithm: sft`` the rows are chat rows
  (``{"messages": [...]}``), and with ``reward_model`` preference pairs (``{"prompt", "chosen",
  "rejected"}``), written as they are and checked by their job.
- ``resume``: a run folder to continue; without ``config``, its own saved config is the base (as
  ``noria train --resume RUN_DIR``).
- ``reward_funcs``: names or import paths (strings), or functions. A function that is importable by
  its module and name (a module on ``sys.path``, not ``__main__``) is saved as that import path, so
  the saved config runs again from the CLI. Any other function (defined in a script's ``__main__``, a
  notebook cell, a closure) is registered in this process's reward registry under its ``__name__``:
  rewards are scored in the process that calls ``train`` (the rollout runs there for every job kind;
  engines and trainer ranks never call rewards), so it is found there; the saved config names it,
  and resuming needs the same function passed again (``train(resume=..., reward_funcs=[fn])``).
  They replace the config's reward, and its ``reward.kwargs`` unless the name stays the same or the
  overrides set them.
  Several functions are summed, weighted by ``reward_weights`` (TRL's rule); each must take TRL's
  batched form ``fn(completions, **kwargs) -> list[float]``.
- ``overrides``: dotted keys as keyword arguments (``**{"train.max_steps": 5}``), or a section as a
  dict (``rollout={"n_samples": 4}``), or a top-level key (``name="x"``).

``Engine`` wraps the built-in engine (``noria.engine.in_process_engine``: the native engine, or the
transformers one for other families) for generating text from Python.

Not guaranteed: image models (a config with a ``diffusion`` section) run only with ``noria train``;
``train`` changes the process's umask to 077 while it runs (the run folder holds
trajectories and the model, readable by its owner only, as ``noria train`` makes it) and restores it;
a reward registered in process is not seen by other processes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from noria.errors import NoriaError

DATASETS_FOLDER = "datasets"
"""Folder under ``$NORIA_HOME`` that holds the in-memory datasets ``train`` was given, as JSON Lines."""
_API_REWARDS: dict[str, Any] = {}
"""Rewards registered by ``train`` (name -> function): a later call may replace them (a notebook cell run again)."""


# ------------------------------------------------------------------------------------------- train


def train(
    model: str | os.PathLike | None = None,
    dataset: Any = None,
    reward_funcs: Any = None,
    *,
    config: str | os.PathLike | dict | None = None,
    eval_dataset: Any = None,
    reward_weights: Sequence[float] | None = None,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    progress: bool | None = None,
    **overrides: Any,
) -> Path:
    """Train as ``noria train`` does and return the run folder (see the module docstring)."""
    if resume is not None and config is None:  # as `noria train --resume RUN`: the run's own resolved config
        from noria.run_folder import saved_config

        config = saved_config(str(resume))
    run_config = build_config(
        model, dataset, reward_funcs, config=config, eval_dataset=eval_dataset, reward_weights=reward_weights, **overrides
    )
    from noria.preflight import check_references
    from noria.train.memory import bound_onednn_cache

    bound_onednn_cache(run_config.train.onednn_cache_capacity)  # as noria train; no effect once this process ran a CPU matmul
    check_references(run_config)
    old_umask = os.umask(0o077)  # as noria train: the run folder's files are its owner's only
    try:
        return run(run_config, str(run_dir) if run_dir else None, str(resume) if resume else None, progress)
    finally:
        os.umask(old_umask)


def build_config(
    model: Any = None, dataset: Any = None, reward_funcs: Any = None, *, config: Any = None, eval_dataset: Any = None,
    reward_weights: Sequence[float] | None = None, **overrides: Any,
) -> Any:
    """The validated, resolved ``RunConfig`` that ``train`` runs with these arguments."""
    from noria.config import RunConfig, from_dict
    from noria.config.schema import deep_merge, mark_validated, read_config_file, set_dotted

    raw: dict[str, Any] = _base(config, read_config_file)
    for key, value in overrides.items():  # first, so that the in-memory data sees the column keys they set
        if "." in key or not isinstance(value, dict):
            set_dotted(raw, key, value)
        else:
            raw = deep_merge(raw, {key: value})
    if model is not None:
        set_dotted(raw, "model.path", str(model))
    if dataset is not None:
        _set_dataset(raw, dataset, "path")
    if eval_dataset is not None:
        _set_dataset(raw, eval_dataset, "test_path")
    if reward_funcs is not None:
        name, before = reward_name(reward_funcs, reward_weights), (raw.get("reward") or {}).get("name")
        if name != before and not _given(overrides, "reward", "kwargs"):  # the config's kwargs were its own reward's
            set_dotted(raw, "reward.kwargs", {})
        set_dotted(raw, "reward.name", name)
    elif reward_weights is not None:
        raise NoriaError("reward_weights: given without reward_funcs")
    run_config = from_dict(RunConfig, raw)  # the steps of noria.config.schema.load, from a dict
    run_config.validate()
    run_config.resolve()
    mark_validated(run_config)
    return run_config


def run(config: Any, run_dir: str | None = None, resume: str | None = None, progress: bool | None = None) -> Path:
    """Run a loaded config as ``noria train`` does (RL, SFT or a reward model); returns the run folder."""
    if config.diffusion is not None:  # noria.diffusion imports this package: it cannot be run from here
        raise NoriaError("noria.train runs language models; a config with a diffusion section runs with `noria train CONFIG`")
    if config.train.algorithm == "rl":
        from noria.launch.rl import run_rl

        return Path(run_rl(config, run_dir=run_dir, resume=resume, progress=progress))
    from noria.launch.sft import run_sft

    return Path(run_sft(config, run_dir=run_dir, resume=resume, progress=progress))


def _base(config: Any, read_config_file: Callable[[Path], dict]) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy of plain data; the caller's dict is left as it was
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(Path(config))
    raise NoriaError(f"config: expected a YAML file path or a dict, got {type(config).__name__}")


# ----------------------------------------------------------------------------------------- dataset


def _given(overrides: dict[str, Any], section: str, key: str) -> bool:
    """Whether the overrides set ``section.key`` (dotted, or inside a section dict)."""
    return f"{section}.{key}" in overrides or key in (overrides.get(section) or {})


def _set_dataset(raw: dict[str, Any], dataset: Any, key: str) -> None:
    """``data.<key>`` (``path`` or ``test_path``) for ``dataset``; in-memory rows also set the column keys."""
    data = raw.setdefault("data", {})
    if not isinstance(data, dict):
        raise NoriaError("config: data must be a section (a mapping)")
    if key == "path":  # the dataset replaces a built-in task of the config
        data["task"], data["task_args"] = None, {}
    if isinstance(dataset, (str, os.PathLike)):
        data[key] = str(dataset)
        return
    what = "dataset" if key == "path" else "eval_dataset"
    rows = dataset_rows(dataset, what)
    if (raw.get("train") or {}).get("algorithm") in ("sft", "reward_model"):  # chat rows or preference pairs, checked by their job
        data[key] = str(write_rows(rows, what))
        return
    columns = _common_columns(rows)
    prompt_key = data.get("prompt_key", "prompt")
    if prompt_key not in columns:
        raise NoriaError(f"{what}: row 0 has no {prompt_key!r} column (data.prompt_key); its columns: {sorted(rows[0])}")
    if "label_key" not in data:
        data["label_key"] = "label" if "label" in columns else None
    if "metadata_keys" not in data:
        data["metadata_keys"] = [c for c in columns if c not in (prompt_key, data["label_key"])]
    data[key] = str(write_rows(rows, what))
    data["format"] = "auto"  # the file's .jsonl extension; a path given for the other split keeps its own


def dataset_rows(dataset: Any, what: str = "dataset") -> list[dict[str, Any]]:
    """The rows of a list of dicts or a ``datasets.Dataset``; ``NoriaError`` naming ``what`` and the first bad row."""
    kind = type(dataset).__name__
    if kind in ("DatasetDict", "IterableDatasetDict"):
        raise NoriaError(f"{what}: a {kind} holds several splits ({', '.join(dataset)}); pass one, e.g. dataset['train']")
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, Iterable) and not isinstance(dataset, (str, bytes, dict)):
        rows = list(dataset)
    else:
        raise NoriaError(f"{what}: expected a file path, a list of dicts or a datasets.Dataset, got {kind}")
    if not rows:
        raise NoriaError(f"{what}: it has no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise NoriaError(f"{what}: row {i} is a {type(row).__name__}, not a dict of columns")
    return rows


def _common_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns every row has, in the first row's order."""
    shared = set(rows[0]).intersection(*rows[1:])
    return [c for c in rows[0] if c in shared]


def write_rows(rows: list[dict[str, Any]], what: str = "dataset") -> Path:
    """Write ``rows`` as JSON Lines named by their content under ``$NORIA_HOME/datasets``; returns the file."""
    from noria.models.catalog import noria_home

    lines = []
    for i, row in enumerate(rows):
        try:
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as e:
            bad = next((k for k, v in row.items() if not _json_ok(v)), "?")
            raise NoriaError(f"{what}: row {i}, column {bad!r}: not JSON data ({e})") from e
    text = "\n".join(lines) + "\n"
    target = noria_home() / DATASETS_FOLDER / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.jsonl"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)  # atomic: a file at the target path is always complete
    return target


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------------------- rewards


def reward_name(reward_funcs: Any, reward_weights: Sequence[float] | None = None) -> str:
    """The ``reward.name`` for ``reward_funcs``: a name or import path as given, a function's import
    path, or the name it is registered under in this process (module docstring)."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise NoriaError("reward_funcs: the list is empty")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise NoriaError(f"reward_weights: {len(reward_weights)} weights for {len(funcs)} reward functions")
    if len(funcs) == 1 and reward_weights is None:
        return _one_reward(funcs[0])
    from noria.rewards.registry import get_reward

    resolved = [get_reward(_one_reward(f)) for f in funcs]
    total = RewardSum(resolved, list(reward_weights) if reward_weights is not None else [1.0] * len(funcs))
    return register_in_process(total.__name__, total)


def _one_reward(fn: Any) -> str:
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise NoriaError(f"reward_funcs: {fn!r} is neither a function nor a reward name / import path")
    path = import_path_of(fn)
    return path if path is not None else register_in_process(getattr(fn, "__name__", type(fn).__name__), fn)


def import_path_of(fn: Any) -> str | None:
    """``module:qualname`` when importing that gives back ``fn`` itself (not for ``__main__``), else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    from noria.plugins import PluginError, import_path

    path = f"{module}:{qualname}"
    try:
        return path if import_path(path, "reward_funcs") is fn else None
    except PluginError:
        return None


def register_in_process(name: str, fn: Any) -> str:
    """Register ``fn`` as reward ``name`` in this process, replacing an earlier ``train`` registration
    of that name; a name registered otherwise (a built-in, ``register_reward``) is refused."""
    from noria.plugins import PLUG_POINTS, check_contract
    from noria.rewards.registry import REWARDS, register_reward

    check_contract(fn, PLUG_POINTS["reward.name"], name, "reward_funcs")
    if name in REWARDS and _API_REWARDS.get(name) is not REWARDS[name]:
        raise NoriaError(
            f"reward_funcs: a reward named {name!r} is already registered (built in or by register_reward); "
            f"rename your function"
        )
    REWARDS.pop(name, None)
    register_reward(name, fn)
    _API_REWARDS[name] = fn
    return name


class RewardSum:
    """Several batched (TRL-form) rewards as one: the weighted sum of their values per completion."""

    def __init__(self, funcs: list[Callable[..., Any]], weights: list[float]) -> None:
        from noria.plugins import PLUG_POINTS, is_batched

        for fn in funcs:
            if not is_batched(fn, PLUG_POINTS["reward.name"]):
                raise NoriaError(
                    f"reward_funcs: {getattr(fn, '__name__', fn)} takes the per-sample form; several reward functions are "
                    "summed only in TRL's form fn(completions, **kwargs) -> list[float]"
                )
        self.funcs, self.weights = funcs, weights
        self.__name__ = "sum(" + ",".join(f"{w:g}*{getattr(f, '__name__', 'fn')}" for f, w in zip(funcs, weights)) + ")"

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float]:
        totals = [0.0] * len(completions)
        for fn, weight in zip(self.funcs, self.weights):
            values = fn(completions=completions, **kwargs)
            if len(values) != len(completions):
                raise ValueError(f"{getattr(fn, '__name__', fn)} returned {len(values)} values for {len(completions)} completions")
            totals = [t + weight * float(v) for t, v in zip(totals, values)]
        return totals


# ------------------------------------------------------------------------------------------ engine


class Engine:
    """The built-in engine from Python: load a model once, generate text for prompts.

    ``Engine(model, **engine_options)``: ``model`` as ``model.path``; ``engine_options`` are keys of
    the ``engine`` config section (``kv_cache_tokens=...``). ``generate(prompts, ...)`` takes strings or
    chat-message lists, rendered as a run renders them (``noria.data.chat``: the tokenizer's chat
    template unless ``chat_template=False``), and returns one completion text per prompt; from a running
    event loop (a notebook's, an async program's) await ``agenerate``. ``engine`` is the underlying
    engine (``noria.engine.Engine``, or ``HFEngine`` for families without a native model: what
    ``noria.engine.in_process_engine`` picks), for token-level use (requests of token ids, logprobs,
    weight updates). Close it (or use ``with``) to stop its thread."""

    def __init__(self, model: str | os.PathLike, *, dtype: str = "auto", device: str = "cpu", impl: str = "auto",
                 seed: int = 0, **engine_options: Any) -> None:  # fmt: skip
        from noria.config import EngineConfig, from_dict
        from noria.engine import in_process_engine
        from noria.models.catalog import model_path

        config = from_dict(EngineConfig, engine_options, "engine")
        config.validate()
        self.path = model_path(model)
        self.engine = in_process_engine(self.path, config, impl, dtype, device, seed)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise NoriaError(f"Engine: {model} has no tokenizer files; send token ids to Engine.engine instead")

    def generate(self, prompts: Sequence[Any], **sampling: Any) -> list[str]:
        """One completion per prompt (a string, or a list of ``{"role", "content"}`` messages); ``sampling``:
        ``noria.engine.SamplingParams`` fields (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ...)
        and ``chat_template`` (default True)."""
        import asyncio

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(prompts, **sampling))
        raise RuntimeError("Engine.generate() was called inside a running event loop; use await engine.agenerate(...)")

    async def agenerate(self, prompts: Sequence[Any], chat_template: bool | str = True, **sampling: Any) -> list[str]:
        """``generate`` for async code."""
        import asyncio

        from noria.data.chat import render_prompt
        from noria.engine import GenerateRequest, SamplingParams
        from noria.types import Prompt

        if isinstance(prompts, str):
            raise NoriaError("Engine.generate: prompts is a list of prompts; wrap a single prompt in a list")
        requests = [
            GenerateRequest(
                input_ids=render_prompt(Prompt(prompt=p if isinstance(p, str) else tuple(p), index=i, source="Engine.generate"),
                                        self.tokenizer, chat_template),
                sampling=SamplingParams(**sampling),
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]
        outputs = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        return [self.tokenizer.decode(out.output_ids, skip_special_tokens=True) for out in outputs]

    def close(self) -> None:
        """Stop the engine's thread (pending requests end as aborted)."""
        self.engine.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
