"""The code sandbox, one attack per test; each is contained, reported, and leaves no process behind
(CPU; needs util-linux ``unshare``/``setpriv``; loopback only)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from noria.agent.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(timeout_s=4, cpu_s=3, memory_mb=256, max_procs=16)


def marker_processes(marker: str) -> list[str]:
    """Processes whose command line holds ``marker`` (the attack code writes it into argv via a file)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(p.name)
            except OSError:
                pass
    return found


@pytest.fixture(autouse=True)
def no_leftovers():
    before = {p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == 65534}
    yield
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        after = {p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == 65534}
        if not (after - before):
            return
        time.sleep(0.1)
    pytest.fail(f"sandbox processes left behind: {sorted(after - before)}")


def _uid(p: Path) -> int:
    try:
        return p.stat().st_uid
    except OSError:
        return -1


def test_plain_code_runs():
    r = run_python("print(sum(range(10)))", FAST)
    assert (r.status, r.stdout) == ("ok", "45\n")


def test_infinite_loop_is_killed():
    start = time.monotonic()
    r = run_python("while True:\n    pass\n", FAST)
    assert r.status == "timeout" and time.monotonic() - start < FAST.timeout_s + 3


def test_memory_bomb_is_refused():
    r = run_python("x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n", FAST)
    assert r.status == "memory", r


def test_fork_bomb_is_contained():
    code = "import os, time\nfor _ in range(10000):\n    try:\n        os.fork() or time.sleep(30)\n    except OSError:\n        print('limit'); break\n"
    start = time.monotonic()
    r = run_python(code, FAST)
    assert "limit" in r.stdout or r.status == "timeout", r
    assert time.monotonic() - start < FAST.timeout_s + 3  # the children sleeping 30 s died with it


def test_two_mib_of_output_is_cut():
    r = run_python("import sys\nsys.stdout.write('x' * (2 << 20))\n", FAST)
    assert r.status == "output_limit" and len(r.stdout) <= FAST.max_output_bytes


def test_no_network_connection():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = (
        "import socket\nfor host in ('127.0.0.1', '1.1.1.1'):\n    try:\n"
        f"        socket.create_connection((host, {port}), timeout=2); print('connected', host)\n"
        "    except OSError as e:\n        print('refused', host, type(e).__name__)\n"
    )
    r = run_python(code, FAST)
    server.close()
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2, r
    assert not accepted


def test_parent_secret_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("NORIA_TEST_SECRET", "hunter2")
    code = "import os, glob\nprint(os.environ.get('NORIA_TEST_SECRET'))\nfor f in glob.glob('/proc/*/environ'):\n    try:\n        print(open(f, 'rb').read().count(b'hunter2'))\n    except OSError:\n        pass\n"
    r = run_python(code, FAST)
    assert r.status == "ok" and "hunter2" not in r.stdout
    assert r.stdout.splitlines()[0] == "None" and set(r.stdout.splitlines()[1:]) <= {"0"}


def test_cannot_write_outside_its_folder():
    folder = Path(tempfile.mkdtemp(prefix="noria-escape-", dir="/tmp"))
    os.chmod(folder, 0o777)  # even a world-writable folder is read-only from inside
    target = folder / "escaped"
    code = f"open('inside.txt', 'w').write('ok')\nprint('inside ok')\nopen({str(target)!r}, 'w').write('x')\n"
    r = run_python(code, FAST)
    assert "inside ok" in r.stdout and r.status == "error" and "Read-only file system" in r.stderr
    assert not target.exists()
    shutil.rmtree(folder)


def test_grandchild_holding_the_pipes_dies_with_it():
    marker = f"noria-grandchild-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(60)', {marker!r}], start_new_session=True)\n"
        "print('parent done')\n"
    )
    start = time.monotonic()
    r = run_python(code, FAST)
    assert r.status == "ok" and "parent done" in r.stdout
    assert time.monotonic() - start < 3  # did not wait for the grandchild's pipes
    time.sleep(0.2)
    assert marker_processes(marker) == []


def test_unisolated_executor_is_explicit():
    r = run_python("import os; print(os.getuid())", FAST, UNSAFE_no_isolation=True)
    assert r.status == "ok" and r.stdout.strip() == str(os.getuid())
