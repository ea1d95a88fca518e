"""Run untrusted Python (tool calls, code rewards) in a contained subprocess.

``run_python(code)`` runs ``code`` with the system ``python3 -I`` (standard library only) inside
bubblewrap (``bwrap``, Debian's ``bubblewrap`` package; ``scripts/setup.sh`` installs it). The
chain, each step exec'ing the next (``forks`` where it does not); every tool by its absolute path
on the caller's ``PATH``::

    the caller's child: arms its parent-death signal, exits if the caller is gone already
      └─ [root only: setpriv --pdeathsig KILL to a fresh uid]        one unprivileged uid per sandbox
           └─ unshare --user --map-root-user --mount --pid --fork --kill-child
                └─ forks sh, PID 1 of the new PID namespace: checks the caller is alive, mounts a
                   tmpfs (size=, nr_inodes=) on the folder, copies main.py in (mount and cp: forked)
                     └─ bwrap --unshare-all --disable-userns ...      the sandbox proper
                          └─ python3 -I main.py                       no capabilities, uid 1000 inside

Killing the caller kills the sandbox, at every stage of its set-up (``test_sandbox_dies_with_its_caller``
parks the chain at each tool, kills the caller, lets the tool go on, and finds nothing left;
``test_child_of_a_caller_that_is_gone_exits_before_exec``). The wall-clock timeout lives in the caller,
so a sandbox that outlived it would run with no time limit but RLIMIT_CPU. What kills it is the
kernel's parent-death signal (``PR_SET_PDEATHSIG``): kept across the exec of a program that is not
setuid and across ``unshare(CLONE_NEWUSER)`` by the same user, but cleared when the uid changes
(setpriv's switch) and never inherited by a forked child. So at each stage:

1. between fork and exec, the ``preexec_fn`` arms SIGKILL, then checks the caller is still its
   parent and exits if not (the caller died before the signal was armed);
2. setpriv's uid change clears the signal; ``--pdeathsig KILL`` arms it again after the change;
3. unshare keeps it; the sh it forks arms its own against unshare (``--kill-child``);
4. sh checks that its parent's parent is the caller: every signal above was armed before, so a
   caller alive now takes the whole chain with it when it dies, and a caller already dead died in
   a window where one was not armed yet (inside setpriv between its uid change and its prctl,
   inside unshare between its fork and its prctl): sh exits;
5. from then on sh, and the bwrap it becomes, is PID 1 of a PID namespace: when it dies the kernel
   kills every process of the namespace, nested namespaces included. That takes along mount and cp
   (forked, with no signal) and bwrap's first process inside the sandbox, which arms
   ``--die-with-parent`` only once it has made its mounts: killing the caller in those milliseconds
   left sandboxes running before this namespace was there.

The signal follows the *thread* that called ``run_python``; that thread waits for the sandbox, so it
outlives it.

What is protected, each claim with the test that attacks it (tests/agent/test_sandbox.py, run both as
root and as an unprivileged user):

- files: the program sees read-only ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links into
  it), a fresh ``/proc`` and a read-only minimal ``/dev``; its folder ``/sandbox`` is the only
  writable place. The host's ``/home``, ``/root``, ``/tmp``, ``/etc``, the checkout and the venv
  are not there at all (``test_host_files_are_not_visible``, ``test_cannot_write_outside_its_folder``).
  It has no capability and cannot make a user namespace to get one, so it cannot remount
  anything read-write (``test_remount_read_write_is_refused``, ``test_new_user_namespace_is_refused``).
- disk: the folder is a tmpfs of ``max_folder_mb`` bytes and ``max_files`` inodes
  (``test_folder_bytes_are_bounded``, ``test_number_of_files_is_bounded``); one file is also
  bounded by ``max_file_mb`` (RLIMIT_FSIZE). It lives in the sandbox's own mount namespace and
  vanishes with it.
- network: a network namespace with only a loopback device; nothing leaves, nothing on the host's
  loopback is reachable (``test_no_network_connection``).
- processes: a PID namespace (it sees and can signal only its own processes; when it exits or is
  killed, every process it started dies: ``test_grandchild_holding_the_pipes_dies_with_it``), a
  process limit (``test_fork_bomb_is_contained``), and the sandbox dies with its caller (above).
- other sandboxes: each has its own mount, PID, IPC, UTS, cgroup and network namespace and, when
  the caller is root, its own uid (so the process limit is per sandbox: each caller process holds
  a slot of 4,096 uids, claimed with a lock file under :data:`UID_SLOTS` for its life, so two
  callers never share one); none sees another's
  folder or processes (``test_concurrent_sandboxes_cannot_see_each_other``).
- time: a wall-clock timeout kills the whole process group (``test_infinite_loop_is_killed``), and
  RLIMIT_CPU bounds CPU seconds; memory: RLIMIT_AS (``test_memory_bomb_is_refused``); output:
  ``max_output_bytes`` (``test_two_mib_of_output_is_cut``); the environment is scrubbed
  (``test_parent_secret_environment_is_not_visible``).

The result has a ``status``: ``ok``, ``error`` (non-zero exit), ``timeout`` (wall clock or CPU
limit), ``memory`` (MemoryError / allocation refused), ``output_limit``, ``sandbox_error`` (the
sandbox itself could not start: the caller must treat it as a failure of the environment, never as
the program's output). Nothing here raises for what the code does; a machine without the tools
raises ``SandboxUnavailable`` naming the missing one (never a silent unisolated run).

Isolation is the default. ``run_python(..., UNSAFE_no_isolation=True)`` runs the code as a plain
child process with only the resource limits and the timeout: no namespaces, full network and file
system access as the caller. Use it only for code you wrote yourself.

What this does NOT protect against: kernel exploits (there is no seccomp filter beyond bwrap's own);
reading what ``/usr`` holds; CPU and memory use up to the limits, and many sandboxes at once
together exhausting the machine (limits are per process and per sandbox, not a cgroup); kernel
memory of its files up to ``max_files`` inodes; timing side channels. In non-root mode the process
limit counts in the sandbox's user namespace. Needs ``bwrap`` (bubblewrap >= 0.8), ``unshare``,
``mount`` and, when root, ``setpriv`` (util-linux >= 2.33), ``cp``, ``sh``, and unprivileged user
namespaces (``user.max_user_namespaces`` > 0).

This module imports only the standard library, so that it runs as any user with the system Python.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID_BASE = 0x5A000000
"""Root mode runs every sandbox as its own uid from here on (no /etc/passwd entry needed)."""
INSIDE_UID = 1000
"""The program's uid inside its user namespace."""
WORKDIR = "/sandbox"
"""The program's folder, as the program sees it."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""What the program sees of the host, read-only (a symlink stays a symlink)."""

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None  # resolved before any fork

# Runs as root of the outer user namespace and as PID 1 of its PID namespace, in its private mount
# namespace. First it checks that its parent (unshare) is still the child of the caller: every
# parent-death signal of the chain was armed before this point, so the caller alive now means the
# whole chain dies with it; the caller dead already (it died in a window where no signal was armed)
# means stop here. Then the folder becomes a bounded tmpfs that no other process can see, and bwrap
# starts the program. /proc is the host's, so /proc/self/stat names the real parent's host pid
# (getppid() is 0 for a PID namespace's first process).
_MOUNT_AND_EXEC = r"""
set -e
caller="$1"; folder="$2"; bytes="$3"; inodes="$4"; mount="$5"; cp="$6"; shift 6
parent_of() { read -r stat < "/proc/$1/stat"; set -- ${stat##*)}; parent="$2"; }
parent_of self; parent_of "$parent"
if [ "$parent" != "$caller" ]; then echo "sh: the caller (pid $caller) is gone" >&2; exit 1; fi
"$mount" -t tmpfs -o "size=$bytes,nr_inodes=$inodes,mode=0755" noria-sandbox "$folder/work"
"$cp" "$folder/main.py" "$folder/work/main.py"
exec "$@"
"""

SETUP_TOOLS = ("bwrap", "unshare", "setpriv", "mount", "cp", "sh")
"""The chain's tools: a failure before the program starts writes ``TOOL:`` (or ``/path/to/TOOL:``) first on stderr."""

_ids = itertools.count()
UID_SLOTS = Path("/run/lock/noria-sandbox-uids") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir(), "noria-sandbox-uids")
"""Root mode: one lock file per slot of 4,096 sandbox uids (65,536 slots), held (flock) by the caller
process using the slot and naming its pid; the lock goes with the process, whatever kills it."""
_slot: tuple[int, int, object] | None = None  # (pid, slot, the locked file) of this process
_slot_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """This machine lacks what the sandbox needs (a tool, or user namespaces); the message says what."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS)."""
    max_procs: int = 32
    """Processes at once (RLIMIT_NPROC)."""
    max_file_mb: int = 16
    """Largest file it may write, MiB (RLIMIT_FSIZE)."""
    max_folder_mb: int = 64
    """Bytes of its whole folder, MiB (the tmpfs size)."""
    max_files: int = 4096
    """Files and folders in its folder (the tmpfs inodes)."""
    max_output_bytes: int = 1 << 16
    """stdout + stderr kept; more kills the program (status ``output_limit``)."""


@dataclass(frozen=True)
class SandboxResult:
    status: str
    """ok | error | timeout | memory | output_limit | sandbox_error."""
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, UNSAFE_no_isolation: bool = False) -> SandboxResult:  # noqa: N803
    """Run ``code`` under ``limits``; isolated unless ``UNSAFE_no_isolation`` (see the module docstring)."""
    folder = Path(tempfile.mkdtemp(prefix="noria-sandbox-"))
    try:
        (folder / "main.py").write_text(code)
        if UNSAFE_no_isolation:
            cmd, cwd = [_interpreter(), "-I", "main.py"], folder
        else:
            cmd, cwd = isolated_command(folder, limits), folder
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8"}
        return _run(cmd, cwd, env, limits)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def isolated_command(folder: Path, limits: SandboxLimits) -> list[str]:
    """The command line that runs ``folder/main.py`` isolated (see the chain in the module docstring);
    every tool by its absolute path, as ``check_tools`` found it on the caller's ``PATH``."""
    tools = check_tools()
    (folder / "work").mkdir()
    cmd: list[str] = []
    if os.geteuid() == 0:
        uid = sandbox_uid()
        os.chown(folder, uid, uid)
        os.chown(folder / "work", uid, uid)
        os.chmod(folder / "main.py", 0o644)
        # the uid change clears the parent-death signal: --pdeathsig arms it again after it
        cmd += [tools["setpriv"], f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--pdeathsig", "KILL", "--"]
    os.chmod(folder, 0o700)
    cmd += [tools["unshare"], "--user", "--map-root-user", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child=KILL", "--"]
    cmd += [tools["sh"], "-c", _MOUNT_AND_EXEC, "sh", str(os.getpid()), str(folder), str(limits.max_folder_mb << 20), str(limits.max_files)]
    cmd += [tools["mount"], tools["cp"]]
    return cmd + bwrap_args(tools["bwrap"], folder / "work") + [_system_python(), "-I", "main.py"]


def bwrap_args(bwrap: str, work: Path) -> list[str]:
    """bwrap's arguments: every namespace new, no further user namespace, only ``SYSTEM_DIRS``
    (read-only), ``/proc``, a read-only ``/dev`` and the writable ``work`` folder at ``WORKDIR``."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox"]  # fmt: skip
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--bind", str(work), WORKDIR, "--remount-ro", "/"]
    args += ["--chdir", WORKDIR, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR]
    return args + ["--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8", "--"]


def check_tools() -> dict[str, str]:
    """Each tool of the chain by its absolute path on this process's ``PATH``; ``SandboxUnavailable``
    naming what is missing: bwrap, unshare, mount, cp, sh, setpriv (root), user namespaces."""
    wanted = {"bwrap": "bubblewrap", "unshare": "util-linux", "mount": "mount", "cp": "coreutils", "sh": "dash"}
    if os.geteuid() == 0:
        wanted["setpriv"] = "util-linux"
    found = {tool: shutil.which(tool) for tool in wanted}
    missing = [f"{tool} (Debian package {package})" for tool, package in wanted.items() if found[tool] is None]
    if missing:
        raise SandboxUnavailable(
            f"the code sandbox needs {', '.join(missing)}: apt-get install bubblewrap util-linux (scripts/setup.sh "
            "does it); code is never run unisolated instead"
        )
    limit = Path("/proc/sys/user/max_user_namespaces")
    if limit.exists() and limit.read_text().strip() == "0":
        raise SandboxUnavailable("the code sandbox needs user namespaces, but user.max_user_namespaces is 0")
    return {tool: os.path.abspath(path) for tool, path in found.items() if path is not None}


def caller_uids(pid: int) -> range:
    """The 4,096 uids the sandboxes of the caller with this pid are given (:func:`sandbox_uid`): its
    slot's, as its lock file under :data:`UID_SLOTS` names it; a caller that has not claimed one
    yet would first try slot ``pid & 0xFFFF``."""
    slot = pid & 0xFFFF
    try:
        held = {f.read_text().strip(): int(f.name) for f in UID_SLOTS.iterdir() if f.name.isdigit()}
        slot = held.get(str(pid), slot)
    except OSError:  # no slot was ever claimed on this machine
        pass
    return _slot_uids(slot)


def _slot_uids(slot: int) -> range:
    low = SANDBOX_UID_BASE + (slot << 12)
    return range(low, low + 4096)


def sandbox_uid() -> int:
    """A uid no other sandbox of this machine is using now: this process's slot (:func:`_claim_slot`)
    and a per-process counter."""
    return _slot_uids(_claim_slot())[next(_ids) & 0xFFF]


def _claim_slot() -> int:
    """This process's uid slot: the first from ``pid & 0xFFFF`` on whose lock file it gets (no other
    live process holds it), kept for the process's life. A forked child claims its own."""
    global _slot
    with _slot_lock:
        pid = os.getpid()
        if _slot is not None and _slot[0] == pid:
            return _slot[1]
        UID_SLOTS.mkdir(mode=0o755, parents=True, exist_ok=True)
        for i in range(0x10000):
            slot = (pid + i) & 0xFFFF
            f = open(UID_SLOTS / str(slot), "a+")  # noqa: SIM115 - held open, locked, for the process's life
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            f.seek(0)
            f.truncate()
            f.write(str(pid))
            f.flush()
            _slot = (pid, slot, f)
            return slot
        raise SandboxUnavailable(f"every sandbox uid slot under {UID_SLOTS} is held by a live process")


def _system_python() -> str:
    """The interpreter inside the sandbox: the system Python under /usr."""
    return "/usr/bin/python3"


def _interpreter() -> str:
    """A system Python for the unisolated mode (a venv under /root may not be reachable)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def _child_setup(limits: SandboxLimits):
    """The ``preexec_fn``: arm SIGKILL for when the caller dies, check it has not died already, set the limits."""
    caller = os.getpid()

    def apply() -> None:  # runs in the child between fork and exec: no imports, no locks
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != caller:  # the caller died before the signal was armed
            os._exit(1)
        mem = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb << 20, limits.max_file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _run(cmd: list[str], cwd: Path, env: dict[str, str], limits: SandboxLimits) -> SandboxResult:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_child_setup(limits), start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        return SandboxResult("sandbox_error", None, "", str(e), 0.0)
    out, err, status = _collect(proc, limits, start)
    _kill_group(proc)
    code = proc.wait()
    seconds = time.monotonic() - start
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if status is None:
        status = _classify(code, stderr, seconds, limits)
    return SandboxResult(status, code, stdout, stderr, seconds)


def _collect(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until the program exits, the time is up or the output is too long."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in bufs:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    status = None
    deadline = start + limits.timeout_s
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        if proc.poll() is not None and not any(sel.select(0)):
            break  # exited; whatever still holds the pipes dies with its namespace
        for key, _ in sel.select(min(0.05, deadline - now)):
            chunk = key.fileobj.read(65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            bufs[key.fileobj] += chunk
        if sum(len(b) for b in bufs.values()) > limits.max_output_bytes:
            status = "output_limit"
            break
    sel.close()
    cap = limits.max_output_bytes
    return bytes(bufs[proc.stdout][:cap]), bytes(bufs[proc.stderr][:cap]), status


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _classify(code: int, stderr: str, seconds: float, limits: SandboxLimits) -> str:
    if code == 0:
        return "ok"
    if os.path.basename(stderr.split(":", 1)[0]) in SETUP_TOOLS:  # the chain failed before the program ran
        return "sandbox_error"
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL) and seconds >= min(limits.cpu_s, limits.timeout_s) * 0.9:
        return "timeout"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    return "error"
