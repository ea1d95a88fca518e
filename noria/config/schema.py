"""The machinery of Noria's configs: closed, typed dataclasses built from YAML plus dotted overrides.

The modules beside this one declare the sections (one per component) and ``RunConfig``; this one turns
plain data into them and back, and documents them. How a config is built: the YAML file is read
into a plain dict, each ``--a.b value`` override is parsed as a YAML scalar and written into that
dict, and only then is the dict turned into typed dataclasses (``from_dict``). That order means
overrides get exactly the same checks as the file:

- closed: an unknown key raises ``ConfigError`` naming its full dotted path and the closest valid
  key (``rollout.n_sample`` -> did you mean ``rollout.n_samples``?);
- typed: every value is checked against its field's annotation (int, float, bool, str, Literal,
  Optional, list, dict, nested section); a bool is never an int, NaN and Inf are refused;
- then ``load`` runs the config's ``validate()`` (checks only, every section and across sections),
  then its ``resolve()`` if it has one (the named steps that fill in derived values, e.g.
  ``noria.config.resolve_batch``), and marks every section validated, so that components built
  from it do not check it again (``ensure_valid``), while one built from code is checked once.

Hand-written rather than pydantic: the hard dependencies must exist on the GPU machine too (it has
no pydantic), and the errors here carry what pydantic's do not: the closest valid key, strict
bool/int separation, and the config file's name for a file that cannot be read.

A leaf: imports only ``noria.errors`` (and, for the run folder's header, torch and
``noria.hardware`` when called).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml

from noria.errors import NoriaError


class ConfigError(NoriaError):
    """A config file or override is invalid; the message names the key path."""


def option(default: Any = dataclasses.MISSING, help: str = "", **kwargs: Any) -> Any:
    """A config field with its documentation; ``default`` may be a callable via ``factory``."""
    factory = kwargs.pop("factory", dataclasses.MISSING)
    if kwargs:
        raise TypeError(f"unknown option() arguments {sorted(kwargs)}")
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def check_sampling(prefix: str, temperature: float, top_p: float, top_k: int, min_p: float, max_new: int) -> None:
    """The sampling fields of a section (``prefix``: rollout, eval) in range; ConfigError naming the key."""
    if temperature < 0:
        raise ConfigError(f"{prefix}.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"{prefix}.top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ConfigError(f"{prefix}.top_k must be -1 (off) or >= 1, got {top_k}")
    if not 0 <= min_p < 1:
        raise ConfigError(f"{prefix}.min_p must be in [0, 1), got {min_p}")
    if max_new < 1:
        raise ConfigError(f"{prefix}.max_new_tokens must be >= 1, got {max_new}")


# ---------------------------------------------------------------------------------------- loading


def load(cls: type, path: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Read YAML ``path`` (optional, with the files it includes), apply ``--a.b value`` overrides,
    type-check, validate, resolve."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(Path(path))
    for key, value in parse_overrides(overrides or [], cls):
        set_dotted(raw, key, value)
    config = from_dict(cls, raw)
    config.validate()
    if hasattr(config, "resolve"):
        config.resolve()
    mark_validated(config)
    return config


_VALIDATED = "_noria_validated"


def mark_validated(config: Any) -> None:
    """Record that ``config`` and its nested sections passed validation (not a field: never saved)."""
    object.__setattr__(config, _VALIDATED, True)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            mark_validated(value)


def ensure_valid(section: Any) -> None:
    """Validate a section built in code; one that came from ``load`` was validated there, once.
    (A copy made with ``dataclasses.replace`` is a new, unvalidated section.)"""
    if not getattr(section, _VALIDATED, False):
        section.validate()


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


INCLUDE_KEYS = ("defaults", "extends")
"""Top-level keys of a config file that name other files it builds on (Hydra's and prime-rl's words)."""


def read_config_file(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file with the files it includes (``defaults: [base.yaml]`` or ``extends: base.yaml``,
    paths relative to the including file) deep-merged under it: later includes win over earlier
    ones, the including file wins over all. A file that includes itself (directly or not) is refused."""
    path = Path(path).resolve() if Path(path).is_file() else Path(path)
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"{seen[-1]}: config includes form a cycle: {chain}")
    data = read_yaml(path)
    merged: dict[str, Any] = {}
    for key in INCLUDE_KEYS:
        for name in _include_list(data.pop(key, None), path, key):
            if not (path.parent / name).is_file():
                raise ConfigError(f"{path}: {key} names {name}, not found (looked in {path.parent})")
            merged = deep_merge(merged, read_config_file(path.parent / name, (*seen, path)))
    return deep_merge(merged, data)


def _include_list(value: Any, path: Path, key: str) -> list[str]:
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{path}: {key} must be a file name or a list of file names, got {value!r}")
    return names


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_overrides(args: list[str], cls: type | None = None) -> list[tuple[str, Any]]:
    """``["--a.b", "1", "--c=x"]`` -> ``[("a.b", 1), ("c", "x")]``; values are parsed as YAML.

    With the config class ``cls``, the field's type shapes the command line as users expect: a
    boolean field may stand alone (``--sync.verify``) or be negated (``--no-sync.verify``), and a
    single value where a list is expected becomes a one-item list (``--log.loggers tensorboard``)."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --section.key VALUE, got {arg!r}")
        key, text, i = _split_override(args, i, cls)
        if text is None:
            pairs.append(key)
            continue
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text  # not YAML: take the string as given
        if cls is not None and typing.get_origin(_strip_optional(field_type(cls, key))) is list and not isinstance(value, list):
            value = [value]
        pairs.append((key, value))
    return pairs


def _split_override(args: list[str], i: int, cls: type | None) -> tuple[Any, str | None, int]:
    """(key, value text, next index); for a bare boolean flag ((key, value), None, next index)."""
    arg = args[i]
    if "=" in arg:
        key, text = arg[2:].split("=", 1)
        return key.replace("-", "_"), text, i + 1
    key = arg[2:].replace("-", "_")
    negated = key.startswith("no_") and cls is not None and is_bool_key(cls, key[3:])
    if negated:
        return (key[3:], False), None, i + 1
    if cls is not None and is_bool_key(cls, key) and not takes_value(args, i):
        return (key, True), None, i + 1
    if i + 1 >= len(args):
        raise ConfigError(f"override {arg} has no value")
    return key, args[i + 1], i + 2


def takes_value(args: list[str], i: int) -> bool:
    """Whether the boolean option at ``args[i]`` is followed by its value: a next token that is not
    another option (a wrong value such as ``3`` is then refused by the type check, naming the key)."""
    return i + 1 < len(args) and not args[i + 1].startswith("--")


def field_type(cls: type, key: str) -> Any:
    """The annotation of dotted ``key`` in config class ``cls`` (None if no such field)."""
    tp: Any = cls
    for part in key.split("."):
        section = optional_section(tp)
        if section is None:
            return None
        fields = {f.name for f in dataclasses.fields(section)}
        if part not in fields:
            return None
        tp = typing.get_type_hints(section)[part]
    return tp


def is_bool_key(cls: type, key: str) -> bool:
    """Whether dotted ``key`` is a boolean field (``bool`` or ``bool | None``) of ``cls``."""
    return _strip_optional(field_type(cls, key)) is bool


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types."""
    where = path or "config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(str(key), path, list(fields)))
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(hints[key], value, f"{path}.{key}" if path else key)
    return cls(**kwargs)


def _unknown_key_message(key: str, path: str, valid: list[str]) -> str:
    full = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{path + '.' if path else ''}{close[0]}'?" if close else ""
    return f"unknown config key '{full}'{hint} (valid keys{' of ' + path if path else ''}: {', '.join(valid)})"


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option_tp in options:
            if option_tp is type(None):
                continue
            try:
                return _coerce(option_tp, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {tp}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads `1e-6` (no dot) as a string; it is a number here
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: {value!r} is not a finite number (YAML's .nan and .inf are refused)")
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # a YAML-parsed override like `--name 123` is still a name
    if tp in (int, float, bool, str) and (type(value) is not tp):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def to_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain data (every default filled in)."""
    return dataclasses.asdict(config)


def save_config(config: Any, path: str | Path) -> Path:
    """Write the resolved config as YAML (into a run folder), under a comment naming the machine it
    was resolved on (``dtype: auto`` depends on it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(machine_header() + yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


def machine_header() -> str:
    """YAML comment lines: Noria and torch versions, and the CPU (``noria.hardware``)."""
    import torch

    from noria import __version__
    from noria.hardware import cpu_info

    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"# noria {__version__}, torch {torch.__version__}\n# machine: {cpu_info().summary()}{gpu}\n"


def field_docs(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, help) for every leaf field: the configuration reference."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        section = optional_section(tp)
        if section is not None:
            if section is not tp:  # an optional section: documented as present, then its fields
                rows.append((key, f"{section.__name__} | None", None, f.metadata.get("help", "")))
            rows.extend(field_docs(section, key + "."))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        rows.append((key, _type_name(tp), default, f.metadata.get("help", "")))
    return rows


def reference_text(cls: type, width: int = 100) -> str:
    """``noria config --reference``: every key of ``cls``, section by section, each section opened by
    what it is (the first paragraph of its docstring); no line wider than ``width`` (a word longer
    than that excepted)."""
    import inspect
    import textwrap

    rows = {key: (type_name, default, help_text) for key, type_name, default, help_text in field_docs(cls)}
    out: list[str] = []

    def wrap(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent, break_long_words=False,
                             break_on_hyphens=False)  # fmt: skip

    def section(c: type, prefix: str) -> None:
        title = prefix.rstrip(".") or "top level"
        doc = " ".join((inspect.getdoc(c) or "").split("\n\n")[0].split())
        out.extend(["", f"[{title}]", *wrap(doc, "  ")])
        hints, nested = typing.get_type_hints(c), []
        for f in dataclasses.fields(c):
            sub = optional_section(hints[f.name])
            if sub is not None:
                nested.append((sub, f"{prefix}{f.name}."))
            key = f"{prefix}{f.name}"
            if key in rows and (sub is None or sub is not hints[f.name]):  # a leaf, or an optional section's own row
                type_name, default, help_text = rows[key]
                head = wrap(f"{key:<28} {type_name:<32} default={default!r}", "")
                out.extend([head[0], *(" " * 8 + line for line in _rewrap(head[1:], width - 8))])
                out.extend(wrap(help_text, "    "))
        for sub, sub_prefix in nested:
            section(sub, sub_prefix)

    section(cls, "")
    return "\n".join(out[1:]) + "\n"


def _rewrap(lines: list[str], width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(" ".join(lines), width, break_long_words=False, break_on_hyphens=False) if lines else []


def optional_section(tp: Any) -> type | None:
    """The section class of a ``Section`` or ``Section | None`` annotation, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return sections[0] if len(sections) == 1 and type(None) in typing.get_args(tp) else None
    return None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(c) for c in typing.get_args(tp))
    return str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__
