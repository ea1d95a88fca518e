"""Checks of the documentation against the code, shared by the tests of this folder.

Each check reads a Markdown text and returns its problems as ``"FILE:LINE: what"`` strings (an
empty list: nothing wrong), so a test can assert on the whole repository and, with a planted text,
that a wrong snippet is caught and named. Nothing here runs a job or loads a model: configs go
through the real loader (``noria.config.load_config``, what ``noria config`` uses) and command lines
through the real parser (``noria.cli.build_parser`` and the override splitting of ``noria.cli``).

What the pages may say to these checks (an HTML comment on the line just before a code block):

- ``<!-- fragment: examples/NAME.yaml -->`` before a ```yaml block: the block is part of a config,
  checked merged onto that example (the block wins, key by key, as ``defaults:`` merges);
- ``<!-- not-config -->`` before a ```yaml block: YAML that is not a Noria config (not checked);
- ``<!-- unchecked: SPAN; SPAN -->`` anywhere in a page: those inline code spans are not config keys
  or commands, or are wrong on purpose (an example of an error); every other span is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("model", "data", "reward", "rollout", "engine", "train", "sync", "eval", "log", "opd", "ray", "diffusion")
FENCE = re.compile(r"^\s*(```|~~~)(\S*)")
MARK = re.compile(r"^\s*<!--\s*(fragment:\s*(?P<base>\S+)|not-config)\s*-->\s*$")
SHELL = ("bash", "sh", "shell", "console", "")
# Placeholders the pages write in command lines, and a value of the right type for each.
PLACEHOLDERS = {"N": "1", "K": "1", "P": "30000", "ENGINE": "1", "SECONDS": "60"}


def pages() -> list[Path]:
    """Every page the checks read: the README and docs/*.md (generated pages included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def where(path: Path | str) -> str:
    path = Path(path)
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the first line inside the fence
    lines: list[str]
    mark: re.Match | None  # the comment just before the fence


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of ``text``."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].lstrip().startswith(m.group(1)):
            j += 1
        before = lines[i - 1] if i > 0 else ""
        out.append(Block(m.group(2).lower(), i + 2, lines[i + 1 : j], MARK.match(before)))
        i = j + 1
    return out


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        if fence is None:
            out.append((n, line))
    return out


def prose_spans(text: str) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside code blocks; a span may run over a line break
    (the break reads as a space), never over a blank line."""
    out, para, start = [], [], 0
    lines = prose(text) + [(0, "")]
    for k, (n, line) in enumerate(lines):
        if line.strip() and (not para or n == lines[k - 1][0] + 1):
            start = start if para else n
            para.append(line)
            continue
        joined = "\n".join(para)
        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
            out.append((start + joined.count("\n", 0, m.start()), m.group(1).replace("\n", " ")))
        para, start = ([line], n) if line.strip() else ([], 0)
    return out


def unchecked(text: str) -> set[str]:
    """The spans a page exempts with ``<!-- unchecked: SPAN; SPAN -->``."""
    return {s.strip() for m in re.findall(r"<!--\s*unchecked:(.*?)-->", text, flags=re.DOTALL) for s in m.split(";")}


# ---------------------------------------------------------------- YAML snippets


def check_yaml(path: Path | str, text: str) -> list[str]:
    """Every ```yaml block of ``text`` loads with ``load_config`` (a fragment: merged onto its example)."""
    from noria.config import load_config

    problems = []
    for block in blocks(text):
        if block.lang not in ("yaml", "yml") or (block.mark and block.mark.group(0).strip().endswith("not-config -->")):
            continue
        at = f"{where(path)}:{block.line}"
        body = "\n".join(block.lines) + "\n"
        base = block.mark.group("base") if block.mark else None
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / "snippet.yaml"
            if base is not None:
                if not (ROOT / base).is_file():
                    problems.append(f"{at}: the fragment's example {base} does not exist")
                    continue
                body = f"defaults: [{(ROOT / base).resolve()}]\n" + body
            file.write_text(body)
            try:
                config = load_config(file)
                _check_names(config)
            except Exception as e:  # noqa: BLE001 -- every refusal is a problem of the snippet
                problems.append(f"{at}: {type(e).__name__}: {e}")
    return problems


def _check_names(config) -> None:
    """What ``noria config`` checks beyond the schema and needs no file: the algorithm registry names."""
    if config.diffusion is None and config.train.algorithm == "rl":
        from noria.train.algorithms import get_policy_loss
        from noria.train.algorithms.advantages import check_advantage_name

        check_advantage_name(config.train.loss.advantage)
        get_policy_loss(config.train.loss.policy_loss)


# ---------------------------------------------------------------- command lines


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line, command) of every `noria ...` command: in shell blocks (a line continued with ``\\`` is
    joined; ``;``, ``&&``, ``|`` and ``&`` separate commands) and in inline code spans of the prose
    that name arguments (a synopsis with ``[...]`` or ``...`` is skipped, as is a bare command name)."""
    found = []
    for block in blocks(text):
        if block.lang not in SHELL:
            continue
        joined, start = "", None
        for k, line in enumerate(block.lines):
            start = block.line + k if start is None else start
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            found += [(start, c) for c in _commands(joined + line)]
            joined, start = "", None
    skip = unchecked(text)
    for n, span in prose_spans(text):
        if span.strip() in skip or "..." in span or re.search(r"\[-|\[[A-Z]|\\\|", span):
            continue
        found += [(n, c) for c in _commands(span) if not _is_a_name(c)]
    return found


def _is_a_name(command: str) -> bool:
    """``noria fleet add``: a command named in prose, no arguments given (nothing to parse)."""
    from noria.cli import build_parser

    parser = build_parser()
    for word in command.split()[1:]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            return False
        parser = subs[0].choices[word]
    return True


def _commands(line: str) -> list[str]:
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    out, current = [], []
    for tok in [*tokens, ";"]:
        if tok and set(tok) <= set(";&|<>"):
            if tok in (">", "<", ">>", "2>", ">&"):
                current.append(None)  # a redirection: the rest of this command is its target
                continue
            out.append(current)
            current = []
        else:
            current.append(tok)
    commands = []
    for words in out:
        words = words[: words.index(None)] if None in words else words
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value before it
            words = words[1:]
        if words and Path(words[0]).name == "noria":
            commands.append(shlex.join(["noria", *words[1:]]))
    return commands


def parse_command(command: str) -> tuple[argparse.Namespace, list[str], type | None]:
    """``noria ...`` parsed as ``noria.cli`` parses it, running nothing: (args, config overrides, the
    config class the overrides belong to). argparse's refusal raises ``SystemExit``."""
    from noria.cli import _override_flags, build_parser, split_overrides

    argv = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)[1:]]
    parser = build_parser()
    if _names_a_placeholder(parser, argv):  # `noria bench NAME ...`: a form, not a command
        return argparse.Namespace(), [], None
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subparsers.choices.get(argv[0]) if argv else None
    overrides: list[str] = []
    if sub is not None and sub.get_default("takes_overrides"):
        own = {s for action in sub._actions for s in action.option_strings}
        rest, overrides = split_overrides(argv[1:], own, _override_flags(argv[0]))
        argv = [argv[0], *rest]
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "parses_rest", False):
        from noria.bench import parse_bench_args

        parse_bench_args(args.bench_command, rest)
        return args, [], None
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "service":
        from noria.config import ServiceConfig as cls
    elif args.command == "serve":
        from noria.engine.server.app import ServeConfig as cls
    else:
        from noria.config import RunConfig as cls
    return args, overrides, (cls if sub.get_default("takes_overrides") else None)


def _names_a_placeholder(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """Whether a subcommand's place holds a placeholder (``NAME`` in ``noria bench NAME --json PATH``)."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            return bool(subs) and word.isupper()
        parser = subs[0].choices[word]
    return False


def check_command(command: str) -> str | None:
    """None when ``command`` parses; else why not. Overrides must name config keys of the right type;
    a config file that exists here is loaded with them (``noria config`` would print it)."""
    from noria.config import load_config
    from noria.config.schema import ConfigError, _coerce, field_type, parse_overrides

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args, overrides, cls = parse_command(command)
        if cls is None:
            return None
        pairs = parse_overrides(overrides, cls)
        for key, value in pairs:
            tp = field_type(cls, key)
            if tp is None and not _under_a_mapping(cls, key):
                raise ConfigError(f"unknown config key {key!r}")
            if tp is not None and not _placeholder(value):
                _coerce(tp, value, key)
        config = getattr(args, "config", None)
        if config and (ROOT / config).is_file() and config.endswith((".yaml", ".yml")):
            _check_names(load_config(ROOT / config, overrides))
    except SystemExit as e:
        return (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
    except Exception as e:  # noqa: BLE001 -- any refusal is the finding
        return f"{type(e).__name__}: {e}"
    return None


def _placeholder(value) -> bool:
    """A value the page leaves to the reader: ``DIR``, ``RUN_DIR/final``, ``my.jsonl`` is not one."""
    return isinstance(value, str) and bool(re.fullmatch(r"[a-z]|.*\b[A-Z][A-Z_]*\b.*", value))


def _under_a_mapping(cls: type, key: str) -> bool:
    """Whether ``key`` sits inside a free-form mapping field (``data.task_args.ops``)."""
    from noria.config.schema import field_type

    parts = key.split(".")
    for n in range(1, len(parts)):
        tp = field_type(cls, ".".join(parts[:n]))
        if tp is not None and (getattr(tp, "__origin__", None) is dict or "dict" in str(tp)):
            return True
    return False


def check_commands(path: Path | str, text: str) -> list[str]:
    return [f"{where(path)}:{n}: `{c}`: {why}" for n, c in command_lines(text) if (why := check_command(c))]


# ---------------------------------------------------------------- config keys named in prose

KEY = re.compile(r"^(?:--(?:no-)?)?((?:" + "|".join(SECTIONS) + r")(?:\.[a-z_][a-z0-9_]*)+)(?::?\s+(\S.*))?$")


def config_keys() -> set[str]:
    """Every dotted key of the schema and every section prefix (``train.loss``)."""
    from noria.config import field_docs

    keys = set()
    for key, *_ in field_docs():
        parts = key.split(".")
        keys.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return keys


def check_prose_keys(path: Path | str, text: str) -> list[str]:
    """Every inline code span of the prose that is a dotted config key (``rollout.engine_restarts``),
    alone or with a value (``model.dtype: auto``, ``--eval.every 5``), names a key of the schema, and
    a single value given with it has the key's type (as an override: ``--log.loggers tensorboard``
    is a one-item list)."""
    import typing

    import yaml

    from noria.config import RunConfig
    from noria.config.schema import ConfigError, _coerce, _strip_optional, field_type
    from noria.errors import NoriaError
    from noria.faults import POINTS

    keys, problems, skip = config_keys(), [], unchecked(text)
    for n, span in prose_spans(text):
        m = KEY.match(span.strip())
        if not m or span.strip() in skip or re.search(r"\.(py|md|yaml|yml|json|jsonl|txt|html|png)$", m.group(1)):
            continue
        key, value = m.group(1), m.group(2)
        if key in POINTS or _a_module(key):  # `sync.disk_write`: a fault point; `engine.weights`: noria/engine/weights.py
            continue
        if key not in keys and not _under_a_mapping(RunConfig, key):
            problems.append(f"{where(path)}:{n}: `{span}`: no config key {key!r}")
            continue
        tp = field_type(RunConfig, key)
        if value is None or tp is None or re.search(r"\s", value.strip()):
            continue
        try:
            parsed = yaml.safe_load(value)
            if span.strip().startswith("--") and typing.get_origin(_strip_optional(tp)) is list and not isinstance(parsed, list):
                parsed = [parsed]
            if not _placeholder(parsed):
                _coerce(tp, parsed, key)
                _check_registry_name(key, parsed)
        except (ConfigError, NoriaError, yaml.YAMLError) as e:
            problems.append(f"{where(path)}:{n}: `{span}`: {e}")
    return problems


def _check_registry_name(key: str, value) -> None:
    """``train.loss.advantage: grpo`` and ``train.loss.policy_loss: gspo`` name registered algorithms."""
    if key == "train.loss.advantage":
        from noria.train.algorithms.advantages import check_advantage_name

        check_advantage_name(value)
    elif key == "train.loss.policy_loss":
        from noria.train.algorithms import get_policy_loss

        get_policy_loss(value)


def _a_module(key: str) -> bool:
    """``engine.thread``: a module or package of noria named in prose, not a key."""
    path = ROOT / "noria" / Path(*key.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def check_page(path: Path | str, text: str | None = None) -> list[str]:
    """Every check above on one page."""
    text = Path(path).read_text() if text is None else text
    return check_yaml(path, text) + check_commands(path, text) + check_prose_keys(path, text)
