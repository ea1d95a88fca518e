"""The `noria` command: help for every subcommand, one-line errors for bad input."""

import re
import subprocess
import sys

import pytest

from noria.cli import build_parser, main


def _subcommands(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from _subcommands(sub, prefix + (name,))


@pytest.mark.parametrize("command", list(_subcommands(build_parser())), ids=" ".join)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: noria" in out and len(out.splitlines()) > 3


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "noria.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for name in ("eval", "models", "config"):
        assert name in out


def test_the_command_freezes_the_heap_at_its_end_and_a_caller_of_main_keeps_its_own():
    """``noria`` as the process's command leaves the heap frozen for the exit (noria.cli's docstring);
    ``main(argv)`` from a test or a script does not (its caller goes on and must collect)."""
    code = (
        "import gc, sys; from noria.cli import main\n"
        "main(['config', '--reference']); given = gc.get_freeze_count()\n"
        "sys.argv = ['noria', 'config', '--reference']; main()\n"
        "print(given, gc.get_freeze_count() > 0, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.split()[-2:] == ["0", "True"], done.stderr[-2000:]


def test_config_error_is_one_line(capsys):
    code = main(["config", "--model.path", "m", "--data.task", "arithmetic", "--rollout.n_sampels", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown config key 'rollout.n_sampels'" in err and "rollout.n_samples" in err
    assert "Traceback" not in err


def test_config_prints_resolved(capsys):
    assert main(["config", "--model.path", "m", "--data.task", "arithmetic", "--rollout.n_samples", "3"]) == 0
    assert "n_samples: 3" in capsys.readouterr().out


def test_config_reference_lists_every_key(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "rollout.n_samples" in out and "data.max_prompt_tokens" in out


def test_overrides_refused_where_not_taken(capsys):
    with pytest.raises(SystemExit):
        main(["models", "list", "--x", "1"])


def test_boolean_flag_before_the_config_path(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {task: arithmetic}\n")
    assert main(["config", "--sync.verify", str(path), "--log.loggers", "jsonl"]) == 0
    out = capsys.readouterr().out
    assert "verify: true" in out and "- jsonl" in out


def test_one_dash_override_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", "--model.path", "m", "-train.max_steps", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "-train.max_steps" in err and "--train.max_steps" in err and "two dashes" in err


def test_reference_into_a_closed_pipe_is_quiet():
    # `true` exits before Python has started, so every write meets a closed pipe (as with `| head`
    # on a long output); the command must end quietly with status 0.
    cmd = f"{sys.executable} -m noria.cli config --reference | true; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stdout.strip() == "0"


def test_a_phase_whose_caller_said_the_start_only_beats(capsys):
    """``phase(start_line=False, end_line=False)`` (around ``noria train``'s config check) adds only
    the heartbeats to the caller's own line: a slow check is not silent, a quick one prints nothing."""
    import time

    from noria.console import phase

    with phase("checking", every_s=0.05, start_line=False, end_line=False):
        time.sleep(0.3)
    beats = capsys.readouterr().err.splitlines()
    assert beats and all(re.fullmatch(r"noria: checking: \d+ s", line) for line in beats), beats
    with phase("checking", every_s=5, start_line=False, end_line=False):
        pass
    assert capsys.readouterr().err == ""


def test_a_nested_phase_replaces_its_parents_heartbeat(capsys):
    """A model import inside "reading the prompts and the tokenizer" beat twice a line before: only
    the innermost running phase beats; the parent beats again once the inner one is done."""
    import time

    from noria.console import phase

    with phase("outer", every_s=0.05):
        with phase("inner", every_s=0.05):
            time.sleep(0.4)
        inner_done = len(capsys.readouterr().err.splitlines())
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert inner_done >= 4
    assert any(re.fullmatch(r"noria: outer: \d+ s", line) for line in lines), lines  # the parent beats again
    assert lines[-1].startswith("noria: outer: done in")


def test_only_the_inner_phase_beats_while_it_runs(capsys):
    import time

    from noria.console import phase

    with phase("outer", every_s=0.05), phase("inner", every_s=0.05):
        time.sleep(0.4)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["noria: outer ...", "noria: inner ..."]
    # until the inner phase is done: after it, the outer may beat before it ends too (it is running)
    inner = lines[: next(i for i, line in enumerate(lines) if line.startswith("noria: inner: done in"))]
    beats = [line for line in inner if re.fullmatch(r"noria: \w+: \d+ s", line)]
    assert beats and all(line.startswith("noria: inner:") for line in beats), lines


def _parsers(parser, prefix=("noria",)):
    """(command words, parser) of the command and of every subcommand under it, benchmarks included
    (each benchmark builds its own parser: ``noria.bench.bench_parser``)."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, __import__("argparse")._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.get_default("parses_rest"):
                    yield (*prefix, name), _bench_parser(name)
                else:
                    yield from _parsers(sub, (*prefix, name))


def _bench_parser(name):
    from noria.bench import bench_parser

    return bench_parser(name)[1]


def test_every_subcommand_and_option_has_a_help_text():
    """A walk of the whole parser, the benchmarks' own parsers included: every subcommand is listed
    with a help line and has a description, every option and argument says what it is."""
    import argparse

    missing, seen = [], 0
    for words, parser in _parsers(build_parser()):
        seen += 1
        if not parser.description:
            missing.append(f"{' '.join(words)}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{' '.join(words)} {c.dest}: no help line" for c in action._choices_actions if not c.help]
            elif not action.help and action.help is not argparse.SUPPRESS:
                missing.append(f"{' '.join(words)} {'/'.join(action.option_strings) or action.dest}: no help")
    assert seen >= 30 and missing == [], missing


def test_benchmark_help_shows_each_default_and_the_sync_transports(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sync", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 3)" in out and "(default: ipc,ipc_shm,broadcast,disk,disk_delta)" in out
    for case in ("ipc (", "ipc_shm (", "broadcast (", "disk (", "disk_delta ("):
        assert case in out, case


@pytest.mark.parametrize("command", ["train", "eval", "config"])
def test_job_helps_point_to_the_config_reference(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "noria config --reference" in " ".join(capsys.readouterr().out.split())


def test_config_reference_opens_each_section_with_what_it_is_and_fits_160_columns(capsys):
    from noria.config import field_docs

    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line for line in lines if len(line) > 160] == []
    for section in ("[top level]", "[rollout]", "[rollout.buffer]", "[train.loss]", "[log]", "[diffusion]"):
        i = lines.index(section)
        assert lines[i + 1].startswith("  ") and len(lines[i + 1].strip()) > 20, section  # its description
    assert all(any(line.startswith(key + " ") for line in lines) for key, *_ in field_docs())
