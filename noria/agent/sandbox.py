"""Run untrusted Python (tool calls, code rewards) in a contained subprocess.

``run_python(code)`` runs ``code`` with the system ``python3 -I`` (standard library only) inside
bubblewrap (``bwrap``, Debian's ``bubblewrap`` package; ``scripts/setup.sh`` installs it). The
chain, each step exec'ing the next::

    [root only: setpriv to a fresh unprivileged uid]            one uid per sandbox
      └─ unshare --user --map-root-user --mount                 a private mount namespace
           └─ sh: mount a tmpfs (size=, nr_inodes=) on the folder, copy main.py in
                └─ bwrap --unshare-all --disable-userns ...      the sandbox proper
                     └─ python3 -I main.py                       no capabilities, uid 1000 inside

What is protected, each claim with the test that attacks it (tests/test_sandbox.py, run both as
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
  process limit (``test_fork_bomb_is_contained``), bwrap's ``--die-with-parent`` (killing the
  caller kills the sandbox).
- other sandboxes: each has its own mount, PID, IPC, UTS, cgroup and network namespace and, when
  the caller is root, its own uid (so the process limit is per sandbox); none sees another's
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
limit counts in the sandbox's user namespace. Needs ``bwrap`` (bubblewrap >= 0.8), ``unshare`` and
``mount`` (util-linux), ``setpriv`` when root, and unprivileged user namespaces
(``user.max_user_namespaces`` > 0).

This module imports only the standard library, so that it runs as any user with the system Python.
"""

from __future__ import annotations

import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
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

# Runs as root of the outer user namespace, in its private mount namespace: the folder becomes a
# bounded tmpfs that no other process on the host can see, then bwrap starts the program.
_MOUNT_AND_EXEC = r"""
set -e
folder="$1"; bytes="$2"; inodes="$3"; shift 3
mount -t tmpfs -o "size=$bytes,nr_inodes=$inodes,mode=0755" noria-sandbox "$folder/work"
cp "$folder/main.py" "$folder/work/main.py"
exec "$@"
"""

SETUP_TOOLS = ("bwrap:", "unshare:", "setpriv:", "mount:", "cp:", "sh:")
"""What a failure of the chain before the program starts writes first on stderr."""

_ids = itertools.count()


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
    """The command line that runs ``folder/main.py`` isolated (see the chain in the module docstring)."""
    check_tools()
    (folder / "work").mkdir()
    cmd: list[str] = []
    if os.geteuid() == 0:
        uid = sandbox_uid()
        os.chown(folder, uid, uid)
        os.chown(folder / "work", uid, uid)
        os.chmod(folder / "main.py", 0o644)
        cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    os.chmod(folder, 0o700)
    cmd += ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--"]
    cmd += ["/bin/sh", "-c", _MOUNT_AND_EXEC, "sandbox", str(folder), str(limits.max_folder_mb << 20), str(limits.max_files)]
    return cmd + bwrap_args(folder / "work") + [_system_python(), "-I", "main.py"]


def bwrap_args(work: Path) -> list[str]:
    """bwrap's arguments: every namespace new, no further user namespace, only ``SYSTEM_DIRS``
    (read-only), ``/proc``, a read-only ``/dev`` and the writable ``work`` folder at ``WORKDIR``."""
    args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox"]  # fmt: skip
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--bind", str(work), WORKDIR, "--remount-ro", "/"]
    args += ["--chdir", WORKDIR, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR]
    return args + ["--setenv", "TMPDIR", WORKDIR, "--setenv", "LANG", "C.UTF-8", "--"]


def check_tools() -> None:
    """``SandboxUnavailable`` naming what is missing: bwrap, unshare, setpriv (root), user namespaces."""
    wanted = {"bwrap": "bubblewrap", "unshare": "util-linux", "mount": "mount"}
    if os.geteuid() == 0:
        wanted["setpriv"] = "util-linux"
    missing = [f"{tool} (Debian package {package})" for tool, package in wanted.items() if shutil.which(tool) is None]
    if missing:
        raise SandboxUnavailable(
            f"the code sandbox needs {', '.join(missing)}: apt-get install bubblewrap util-linux (scripts/setup.sh "
            "does it); code is never run unisolated instead"
        )
    limit = Path("/proc/sys/user/max_user_namespaces")
    if limit.exists() and limit.read_text().strip() == "0":
        raise SandboxUnavailable("the code sandbox needs user namespaces, but user.max_user_namespaces is 0")


def sandbox_uid() -> int:
    """A uid no other sandbox of this machine is using now (by pid and a per-process counter)."""
    return SANDBOX_UID_BASE + ((os.getpid() & 0xFFFF) << 12) + (next(_ids) & 0xFFF)


def _system_python() -> str:
    """The interpreter inside the sandbox: the system Python under /usr."""
    return "/usr/bin/python3"


def _interpreter() -> str:
    """A system Python for the unisolated mode (a venv under /root may not be reachable)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def _limiter(limits: SandboxLimits):
    def apply() -> None:
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
            preexec_fn=_limiter(limits), start_new_session=True,
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
    if stderr.startswith(SETUP_TOOLS):  # the chain failed before the program ran
        return "sandbox_error"
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL) and seconds >= min(limits.cpu_s, limits.timeout_s) * 0.9:
        return "timeout"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    return "error"
