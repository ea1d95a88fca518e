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
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import noria.agent.sandbox as sandbox_module
from noria.agent.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, caller_uids, run_python

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
    """Processes of this test process's sandboxes (root mode: the uids ``noria.agent.sandbox`` gives
    the sandboxes of a caller with this pid) or of the unprivileged test user. Not every sandbox uid:
    the agent tests of another worker run sandboxes of their own beside this file."""
    ours = caller_uids(os.getpid())
    found = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            uid = _uid(p)
            if uid == UNPRIVILEGED_UID or uid in ours:
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


# ------------------------------------------------------------------------------ the caller killed during set-up

STAGES = ("setpriv", "unshare", "unshare-unarmed", "sh", "sh-unarmed", "mount", "cp", "bwrap", "bwrap-child", "running")
"""Where the caller is killed: parked at the start of that tool of the chain (``-unarmed``: with the
parent-death signal cleared first, as it is inside setpriv after its uid change or inside unshare
between its fork and its prctl; ``bwrap-child``: in a child that bwrap forks, which has no signal,
as bwrap's first process in the sandbox has none until its mounts are made), or once the program runs."""
CALLER_UID = 4243
"""The unprivileged caller of the test below (not ``UNPRIVILEGED_UID``: its processes are counted alone)."""
CALLER = """
import sys
sys.path.insert(0, sys.argv[1])
from sandbox import SandboxLimits, run_python
run_python('import time\\ntime.sleep(60)', SandboxLimits(timeout_s=60, cpu_s=60))
"""


def _shim(stage: str, folder: Path) -> None:
    """``folder/TOOL``, first on the caller's PATH: waits on the FIFO ``folder/park`` until the test
    opens and closes it, then runs the real tool (see ``STAGES`` for the variants)."""
    tool, _, variant = stage.partition("-")
    real, real_sh, real_setpriv = shutil.which(tool), shutil.which("sh"), shutil.which("setpriv")
    park = f"read -r _ < {folder / 'park'}; exec {real} \"$@\""
    if variant == "unarmed":
        park = f"exec {real_setpriv} --pdeathsig clear -- {real_sh} -c '{park}' {tool} \"$@\""
    if variant == "child":
        park = f"({park}) &\nwait"
    (folder / tool).write_text(f"#!{real_sh}\n{park}\n")
    os.chmod(folder / tool, 0o755)
    os.mkfifo(folder / "park", 0o666)
    os.chmod(folder / "park", 0o666)


def _chain_processes(caller_pid: int, mode: str, shims: Path) -> dict[int, str]:
    """The set-up chain and sandbox of that caller, zombies aside: processes of its sandbox uid (root
    mode) or of ``CALLER_UID``, and the shim, whatever its uid; by pid, with their command lines."""
    uids = caller_uids(caller_pid)
    found = {}
    for p in Path("/proc").iterdir():
        try:
            status = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
            cmdline = (p / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        except (OSError, ValueError):
            continue
        uid = int(status["Uid"].split()[0])
        ours = uid == CALLER_UID if mode == "unprivileged" else uid in uids
        if p.name.isdigit() and not status["State"].strip().startswith("Z") and (ours or str(shims) in cmdline):
            found[int(p.name)] = cmdline[:120]
    return found


def _dying(pid: int) -> bool:
    """SIGKILL pending or already exiting (PF_EXITING); a process gone is not dying."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
    except (OSError, ValueError, IndexError):
        return False
    return bool((int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & (1 << 8) or flags & 0x4)


def _deaths_done(caller_pid: int, mode: str, shims: Path) -> None:
    """Wait until the caller's death has gone down the chain: no process of it is still dying."""
    deadline, calm = time.monotonic() + 10, 0
    while calm < 2 and time.monotonic() < deadline:
        calm = calm + 1 if not any(_dying(pid) for pid in _chain_processes(caller_pid, mode, shims)) else 0
        time.sleep(0.02)


def _park_reached(caller: subprocess.Popen, fifo: Path) -> int:
    """Open the shim's FIFO once the shim waits on it; the shim stays parked until it is closed."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and caller.poll() is None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody reads it yet
            time.sleep(0.01)
    _never_started(caller)


def _program_runs(caller: subprocess.Popen, mode: str, shims: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and caller.poll() is None:
        if any("main.py" in c for c in _chain_processes(caller.pid, mode, shims).values()):
            return
        time.sleep(0.01)
    _never_started(caller)


def _never_started(caller: subprocess.Popen) -> None:
    caller.kill()
    pytest.fail(f"the sandbox never got there: {caller.communicate()}")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", MODES)
def test_sandbox_dies_with_its_caller(mode, stage, module_copy):
    """SIGKILL of the process that runs a sandbox (a trainer, say) at any stage of the set-up, or
    once its program runs, takes every process of the chain along. A shim stands for one tool of the
    chain on the caller's PATH and parks; the caller is killed while it is parked, then the shim goes
    on (if it is still alive) into the real tool: nothing of the chain may be left within seconds."""
    import signal

    if os.geteuid() != 0:
        pytest.skip("finds the sandbox by its uid, which only root can give it")
    if mode == "unprivileged" and stage == "setpriv":
        pytest.skip("only root mode runs setpriv")
    folder = Path(tempfile.mkdtemp(prefix="noria-sandbox-kill-", dir="/tmp"))
    shims, tmp = folder / "shims", folder / "tmp"
    shims.mkdir()
    tmp.mkdir()
    for path, permissions in ((folder, 0o755), (shims, 0o755), (tmp, 0o777)):
        os.chmod(path, permissions)
    if stage != "running":
        _shim(stage, shims)
    launcher = [] if mode == "caller" else [shutil.which("setpriv"), f"--reuid={CALLER_UID}", f"--regid={CALLER_UID}", "--clear-groups"]
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", TMPDIR=str(tmp))
    caller = subprocess.Popen(launcher + ["/usr/bin/python3", "-c", CALLER, str(module_copy)], env=env, cwd="/",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        parked = None if stage == "running" else _park_reached(caller, shims / "park")
        if stage == "running":
            _program_runs(caller, mode, shims)
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        _deaths_done(caller.pid, mode, shims)
        spared = [c for c in _chain_processes(caller.pid, mode, shims).values() if str(shims) in c]
        if parked is not None:
            os.close(parked)  # a shim still alive goes on into the real tool, the rest of the chain dead
        deadline = time.monotonic() + 10
        while (left := _chain_processes(caller.pid, mode, shims)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"left behind after the caller was killed at {stage}: {left}"
        # where a death signal is armed, the caller's death itself kills the chain, not a later check
        assert not spared or stage.endswith("-unarmed"), f"the caller's death spared the chain parked at {stage}: {spared}"
    finally:
        caller.kill()
        caller.communicate()
        for pid in _chain_processes(caller.pid, mode, shims):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(folder, ignore_errors=True)


CHILD_SETUP = """
import ctypes, os, resource, sys
sys.path.insert(0, sys.argv[1])
import sandbox
setup = sandbox._child_setup(sandbox.SandboxLimits(max_procs=resource.getrlimit(resource.RLIMIT_NPROC)[1]))
child = os.fork()
if child == 0:  # a child of the caller: armed, goes on
    try:
        setup()
        armed = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(armed), 0, 0, 0)  # PR_GET_PDEATHSIG
        grandchild = os.fork()
        if grandchild == 0:  # not a child of the caller, as if the caller had died: exits in setup()
            setup()
            os._exit(0)
        print(armed.value, os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1]), flush=True)
    finally:
        os._exit(0)
os.waitpid(child, 0)
"""


def test_child_of_a_caller_that_is_gone_exits_before_exec(module_copy):
    """The first window: the caller dies between the fork and the child's arming of its parent-death
    signal. The child's set-up arms SIGKILL, then finds its parent is not the caller and exits."""
    out = subprocess.run(["/usr/bin/python3", "-c", CHILD_SETUP, str(module_copy)], capture_output=True, text=True, timeout=30, check=False)
    assert out.stdout.split() == ["9", "1"], out  # SIGKILL armed; the orphan exited 1 before any exec


# ------------------------------------------------------------------------------ failing loudly


def test_missing_bubblewrap_is_a_clear_error(monkeypatch, tmp_path):
    for tool in ("unshare", "setpriv", "mount", "cp", "sh"):
        (tmp_path / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="bwrap.*bubblewrap"):
        run_python("print(1)", FAST)


def test_unisolated_executor_is_explicit():
    r = run_python("import os; print(os.getuid())", FAST, UNSAFE_no_isolation=True)
    assert r.status == "ok" and r.stdout.strip() == str(os.getuid())



HOLDER = """
import fcntl, os, sys
from pathlib import Path
import noria.agent.sandbox as s
s.UID_SLOTS = Path(sys.argv[1])  # this test's, not the machine's
s.UID_SLOTS.mkdir(parents=True)
mine = os.getpid() & 0xFFFF
other = open(s.UID_SLOTS / str(mine), "a+")  # another caller whose pid agrees with ours modulo 65,536 holds it
fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
other.write("1")
other.flush()
uid = s.sandbox_uid()
print(mine, (uid - s.SANDBOX_UID_BASE) >> 12, s.caller_uids(os.getpid()).start == s.SANDBOX_UID_BASE + (((mine + 1) & 0xFFFF) << 12))
"""


def test_two_callers_never_share_a_uid_slot(tmp_path):
    """Root mode gives each caller process a slot of 4,096 uids by a lock file held for its life: a
    caller whose first slot (pid & 0xFFFF) another live caller holds takes the next free one, and
    its slot's file names it."""
    slots = tmp_path / "slots"
    out = subprocess.run([sys.executable, "-c", HOLDER, str(slots)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mine, got, found = out.stdout.split()
    assert int(got) == (int(mine) + 1) & 0xFFFF and found == "True", out.stdout
    assert (slots / got).read_text().isdigit() and (slots / got).read_text() != "1"
