"""Fault points (``noria.faults``): parsing ``NORIA_FAULTS``, firing on the N-th time, refusing what is unknown."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest

from noria import faults


def test_a_point_fires_its_action_on_the_nth_time(monkeypatch):
    monkeypatch.setattr(faults, "_armed", faults.parse("checkpoint.committed=raise:ENOSPC@2"))
    monkeypatch.setattr(faults, "_reached", faults.Counter())
    faults.point("checkpoint.committed")  # first time: nothing
    with pytest.raises(OSError) as caught:
        faults.point("checkpoint.committed")
    assert caught.value.errno == errno.ENOSPC and "checkpoint.committed" in str(caught.value)
    faults.point("checkpoint.committed")  # third time: nothing
    faults.point("checkpoint.partial_written")  # not armed


@pytest.mark.parametrize(("spec", "said"), [
    ("nowhere=stop", "unknown fault point 'nowhere'"),
    ("checkpoint.committed=explode", "must be stop, kill or raise:ERRNO"),
    ("checkpoint.committed=raise:ENOTANERROR", "must be stop, kill or raise:ERRNO"),
    ("checkpoint.committed=stop@0", "@N must be a whole number from 1"),
])  # fmt: skip
def test_a_bad_spec_is_refused_naming_it(spec, said):
    with pytest.raises(faults.FaultSpecError, match=said):
        faults.parse(spec)


def test_an_unlisted_point_in_the_code_is_a_bug():
    with pytest.raises(KeyError, match="not in noria.faults.POINTS"):
        faults.point("no.such.point")


def test_stop_and_kill_act_on_the_process_itself():
    code = "from noria import faults; faults.point('checkpoint.committed'); print('went on')"
    env = {**os.environ, "NORIA_FAULTS": "checkpoint.committed=kill"}
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL and "went on" not in killed.stdout
    env["NORIA_FAULTS"] = "checkpoint.committed=stop"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns when the child stops itself
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        proc.send_signal(signal.SIGCONT)
        assert proc.communicate(timeout=60)[0].strip() == "went on"
    finally:
        proc.kill()
        proc.wait()
