"""The code sandbox, one attack per test; each is contained, reported, and leaves no process behind.

Every attack runs in both modes: ``caller`` (``run_python`` in this process: as root in CI) and
``unprivileged`` (the same module run by the system Python under ``setpriv`` as uid 4242, the
non-root mode; it needs this test process to be root, as in CI, and is skipped otherwise).
CPU only; needs bubblewrap and util-linux (scripts/setup.sh installs them); loopback only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import noria.agent.sandbox as sandbox_module
from noria.agent.sandbox import SANDBOX_UID_BASE, SandboxLimits, SandboxResult, SandboxUnavailable, run_python

FAST = SandboxLimits(timeout_s=6, cpu_s=4, memory_mb=256, max_procs=16)
UNPRIVILEGED_UID = 4242
MODES = ("caller", "unprivileged")

DRIVER = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from sandbox import SandboxLimits, run_python
job = json.load(sys.stdin)
print(json.dumps(dataclasses.asdict(run_python(job["code"], SandboxLimits(**job["limits"])))))
"""


@pytest.fixture(scope="module")
def module_copy():
    """The sandbox module in a folder every user can read (the checkout may be under /root)."""
    folder = Path(tempfile.mkdtemp(prefix="noria-sandbox-test-", dir="/tmp"))
    shutil.copy(sandbox_module.__file__, folder / "sandbox.py")
    os.chmod(folder, 0o755)
    os.chmod(folder / "sandbox.py", 0o644)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(params=MODES)
def sandbox(request, module_copy):
    """``run(code, limits) -> SandboxResult`` in the mode of the parameter."""
    if request.param == "caller":
        return run_python
    if os.geteuid() != 0:
        pytest.skip("switching to an unprivileged user needs root (CI runs as root)")

    def run(code: str, limits: SandboxLimits = FAST) -> SandboxResult:
        cmd = ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}", "--clear-groups",
               "/usr/bin/python3", "-c", DRIVER, str(module_copy)]  # fmt: skip
        job = json.dumps({"code": code, "limits": dataclasses.asdict(limits)})
        out = subprocess.run(cmd, input=job, capture_output=True, text=True, timeout=120, cwd="/", check=True)
        return SandboxResult(**json.loads(out.stdout))

    return run


def sandbox_processes() -> set[str]:
    """Processes of a sandbox uid (root mode) or of the unprivileged test user."""
    found = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            uid = _uid(p)
            if uid == UNPRIVILEGED_UID or SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + (1 << 28):
                found.add(p.name)
    return found


def _uid(p: Path) -> int:
    try:
        return p.stat().st_uid
    except OSError:
        return -1


@pytest.fixture(autouse=True)
def no_leftovers():
    before = sandbox_processes()
    yield
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if not (sandbox_processes() - before):
            return
        time.sleep(0.1)
    pytest.fail(f"sandbox processes left behind: {sorted(sandbox_processes() - before)}")


def marker_processes(marker: str) -> list[str]:
    """Processes whose command line holds ``marker``."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(p.name)
            except OSError:
                pass
    return found


# ------------------------------------------------------------------------------ time, memory, processes


def test_plain_code_runs(sandbox):
    r = sandbox("print(sum(range(10)))", FAST)
    assert (r.status, r.stdout) == ("ok", "45\n"), r


def test_infinite_loop_is_killed(sandbox):
    start = time.monotonic()
    r = sandbox("while True:\n    pass\n", FAST)
    assert r.status == "timeout" and time.monotonic() - start < FAST.timeout_s + 3


def test_memory_bomb_is_refused(sandbox):
    r = sandbox("x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n", FAST)
    assert r.status == "memory", r


def test_fork_bomb_is_contained(sandbox):
    code = "import os, time\nfor _ in range(10000):\n    try:\n        os.fork() or time.sleep(30)\n    except OSError:\n        print('limit'); break\n"
    start = time.monotonic()
    r = sandbox(code, FAST)
    assert "limit" in r.stdout or r.status == "timeout", r
    assert time.monotonic() - start < FAST.timeout_s + 3  # the children sleeping 30 s died with it


def test_two_mib_of_output_is_cut(sandbox):
    r = sandbox("import sys\nsys.stdout.write('x' * (2 << 20))\n", FAST)
    assert r.status == "output_limit" and len(r.stdout) <= FAST.max_output_bytes


def test_grandchild_holding_the_pipes_dies_with_it(sandbox):
    marker = f"noria-grandchild-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(60)', {marker!r}], start_new_session=True)\n"
        "print('parent done')\n"
    )
    start = time.monotonic()
    r = sandbox(code, FAST)
    assert r.status == "ok" and "parent done" in r.stdout, r
    assert time.monotonic() - start < 4  # did not wait for the grandchild's pipes
    time.sleep(0.2)
    assert marker_processes(marker) == []


# ------------------------------------------------------------------------------ network, environment


def test_no_network_connection(sandbox):
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
    r = sandbox(code, FAST)
    server.close()
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2, r
    assert not accepted


def test_parent_secret_environment_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("NORIA_TEST_SECRET", "hunter2")
    code = "import os, glob\nprint(os.environ.get('NORIA_TEST_SECRET'))\nfor f in glob.glob('/proc/*/environ'):\n    try:\n        print(open(f, 'rb').read().count(b'hunter2'))\n    except OSError:\n        pass\n"
    r = sandbox(code, FAST)
    assert r.status == "ok" and "hunter2" not in r.stdout, r
    assert r.stdout.splitlines()[0] == "None" and set(r.stdout.splitlines()[1:]) <= {"0"}


def test_every_namespace_is_its_own(sandbox):
    """Mount, PID, network, IPC, UTS, cgroup and user namespaces all differ from the host's."""
    kinds = ("mnt", "pid", "net", "ipc", "uts", "cgroup", "user")
    code = f"import os\nfor k in {kinds!r}:\n    print(k, os.readlink('/proc/self/ns/' + k))\n"
    r = sandbox(code, FAST)
    inside = dict(line.split() for line in r.stdout.splitlines())
    shared = [k for k in kinds if inside.get(k) == os.readlink(f"/proc/self/ns/{k}")]
    assert r.status == "ok" and set(inside) == set(kinds) and shared == [], (r, shared)


# ------------------------------------------------------------------------------ files


def test_cannot_write_outside_its_folder(sandbox):
    folder = Path(tempfile.mkdtemp(prefix="noria-escape-", dir="/tmp"))
    os.chmod(folder, 0o777)  # even a world-writable host folder is out of reach
    target = folder / "escaped"
    code = (
        "open('inside.txt', 'w').write('ok')\nprint('inside ok')\n"
        f"for path in ({str(target)!r}, '/usr/escaped', '/escaped', '/dev/escaped'):\n"
        "    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
        "    except OSError as e:\n        print('refused', path, e.strerror)\n"
    )
    r = sandbox(code, FAST)
    assert "inside ok" in r.stdout and "wrote" not in r.stdout and r.stdout.count("refused") == 4, r
    assert not target.exists() and not Path("/usr/escaped").exists()
    shutil.rmtree(folder)


def test_remount_read_write_is_refused(sandbox):
    """The escape of the old non-root mode: remount the read-only view read-write, then write."""
    code = (
        "import subprocess\n"
        "for mp in ('/usr', '/', '/sandbox'):\n"
        "    r = subprocess.run(['mount', '-o', 'remount,bind,rw', mp], capture_output=True, text=True)\n"
        "    print('remount', mp, r.returncode)\n"
        "try:\n    open('/usr/escaped', 'w').write('x'); print('wrote /usr')\n"
        "except OSError as e:\n    print('refused', e.strerror)\n"
    )
    r = sandbox(code, FAST)
    assert r.status == "ok" and "wrote" not in r.stdout and "refused" in r.stdout, r
    assert all(line.split()[-1] != "0" for line in r.stdout.splitlines() if line.startswith("remount")), r
    assert not Path("/usr/escaped").exists()


def test_new_user_namespace_is_refused(sandbox):
    """Root of a fresh user namespace could remount; the sandbox may not make one."""
    code = "import subprocess\nr = subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'], capture_output=True, text=True)\nprint(r.returncode, r.stdout.strip())\n"
    r = sandbox(code, FAST)
    assert r.status == "ok" and not r.stdout.startswith("0 "), r


def test_host_files_are_not_visible(sandbox):
    paths = [str(Path(__file__).resolve()), "/root", "/home", "/etc/passwd", "/tmp", "/work"]
    code = f"import os\nfor p in {paths!r}:\n    print(p, os.path.exists(p))\n"
    r = sandbox(code, FAST)
    assert r.status == "ok" and r.stdout.count(" False") == len(paths), r


def test_folder_bytes_are_bounded(sandbox):
    """Many files each under the per-file limit cannot fill the disk: the folder has a size."""
    limits = dataclasses.replace(FAST, max_folder_mb=16, max_file_mb=8)
    code = (
        "total = 0\ntry:\n    for i in range(40):\n        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (4 << 20))\n        total += 4 << 20\nexcept OSError as e:\n    print('stopped', e.strerror)\nprint(total)\n"
    )
    r = sandbox(code, limits)
    assert "stopped" in r.stdout and int(r.stdout.split()[-1]) <= 16 << 20, r


def test_number_of_files_is_bounded(sandbox):
    limits = dataclasses.replace(FAST, max_files=500)
    code = "n = 0\ntry:\n    for i in range(20000):\n        open(f'f{i}', 'w').close(); n += 1\nexcept OSError as e:\n    print('stopped', e.strerror)\nprint(n)\n"
    r = sandbox(code, limits)
    assert "stopped" in r.stdout and int(r.stdout.split()[-1]) <= 500, r


def test_concurrent_sandboxes_cannot_see_each_other(sandbox):
    """A writes a secret into its folder and waits; B looks for it everywhere it could be."""
    secret = f"noria-secret-{time.monotonic_ns()}"
    keeper = f"open('secret.txt', 'w').write({secret!r})\nimport time\ntime.sleep(3)\nprint('kept')\n"
    seeker = (
        "import glob, os, time\ntime.sleep(1)\nfound = []\n"
        "for pattern in ('/tmp/noria-sandbox-*/*', '/tmp/noria-sandbox-*/*/*', '/sandbox/*', '/proc/*/cwd/*',\n"
        "                '/proc/*/root/sandbox/*', '/proc/*/root/tmp/noria-sandbox-*/*/*'):\n"
        "    for p in glob.glob(pattern):\n        try:\n"
        "            found += [(p, open(p).read())] if p.endswith('/secret.txt') else []\n"
        "        except OSError:\n            pass\n"
        "print('pids', len([p for p in os.listdir('/proc') if p.isdigit()]))\nprint('found', found)\n"
    )
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(sandbox, keeper, FAST)
        time.sleep(0.3)
        b = pool.submit(sandbox, seeker, FAST)
        ra, rb = a.result(), b.result()
    assert ra.status == "ok" and "kept" in ra.stdout, ra
    assert rb.status == "ok" and "found []" in rb.stdout, rb
    assert int(rb.stdout.split("pids ")[1].split()[0]) <= 3, rb  # its own processes only


def test_sandbox_dies_with_its_caller():
    """SIGKILL of the process that started a sandbox (a trainer, say) takes the sandbox along."""
    import signal
    import sys

    if os.geteuid() != 0:
        pytest.skip("finds the sandbox by its own uid, which only root mode gives it")
    code = "from noria.agent.sandbox import run_python\nrun_python('import time\\ntime.sleep(60)')\n"
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[1])
    try:
        deadline = time.monotonic() + 20
        while not sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        started = sandbox_processes()
        assert started, "the sandbox never started"
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 5
    while sandbox_processes() & started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes() & started


# ------------------------------------------------------------------------------ failing loudly


def test_missing_bubblewrap_is_a_clear_error(monkeypatch, tmp_path):
    for tool in ("unshare", "setpriv", "mount", "sh"):
        (tmp_path / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="bwrap.*bubblewrap"):
        run_python("print(1)", FAST)


def test_unisolated_executor_is_explicit():
    r = run_python("import os; print(os.getuid())", FAST, UNSAFE_no_isolation=True)
    assert r.status == "ok" and r.stdout.strip() == str(os.getuid())
