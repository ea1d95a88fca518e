"""Run untrusted Python (tool calls, code rewards) in a contained subprocess.

``run_python(code)`` writes ``code`` to a fresh temporary folder and runs it with the system
``python3 -I`` (standard library only) in:

- new network, PID, mount (and, when not root, user) namespaces (``unshare``): only a down
  loopback exists, so no connection leaves; the program is PID 1 of its own PID namespace, so when
  it exits or is killed every process it started dies with it (a grandchild that keeps the pipes
  open, or one that calls ``setsid``, cannot outlive it); ``/proc`` shows only its own processes;
- a read-only view of every file system except its own folder (bind-mounted read-write), so it
  cannot write outside that folder;
- as user ``nobody`` when the caller is root (``setpriv``; root would ignore the process limit);
- resource limits: CPU seconds, address space (memory), processes, file size, no core files;
- a scrubbed environment (PATH, HOME and TMPDIR pointing at its folder, LANG) and its own folder
  as working directory; the folder is deleted afterwards;
- a wall-clock timeout after which the whole process group is killed (SIGKILL), and an output cap:
  past ``max_output_bytes`` on stdout + stderr it is killed and the output truncated.

The result has a ``status``: ``ok``, ``error`` (non-zero exit), ``timeout`` (wall clock or CPU
limit), ``memory`` (MemoryError / allocation refused), ``output_limit``, ``sandbox_error`` (the
sandbox itself could not start). Nothing here raises for what the code does.

Isolation is the default. ``run_python(..., UNSAFE_no_isolation=True)`` runs the code as a plain
child process with only the resource limits and the timeout: no namespaces, full network and file
system access as the caller. Use it only for code you wrote yourself.

What this does NOT protect against: kernel exploits and anything else that escapes namespaces
(there is no seccomp filter); reading world-readable files (the file system is visible, read-only);
using CPU and memory up to the limits, and several sandboxes at once together exhausting the
machine (limits are per process, not a cgroup); timing side channels; a process limit that counts
every process of user ``nobody`` (or, when not root, of the calling user) on the machine, so
concurrent sandboxes share it. It needs ``unshare`` and ``setpriv`` (util-linux) and unprivileged
user namespaces when not run as root; without them the status is ``sandbox_error``, never a
silent unisolated run.
"""

from __future__ import annotations

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

NOBODY = 65534

# Runs as root inside the new mount namespace: keep the sandbox folder writable, make every other
# mount read-only, then drop to the target user and exec the program.
_INNER = r"""
set -e
dir="$1"; shift
ip link set lo up 2>/dev/null || true
mount --bind "$dir" "$dir"
awk '{print $2}' /proc/self/mounts | while read -r mp; do
  case "$mp" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/pts|/dev/mqueue|"$dir") continue;; esac
  mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
cd "$dir"  # the working directory taken before the bind mount still points at the read-only one
exec "$@"
"""


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
    """Processes of the sandbox user at once (RLIMIT_NPROC)."""
    max_file_mb: int = 16
    """Largest file it may write, MiB (RLIMIT_FSIZE)."""
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
        root = os.geteuid() == 0
        if root and not UNSAFE_no_isolation:
            os.chown(folder, NOBODY, NOBODY)
            os.chown(folder / "main.py", NOBODY, NOBODY)
        os.chmod(folder, 0o700)
        program = [_interpreter(), "-I", "main.py"]
        if UNSAFE_no_isolation:
            cmd = program
        else:
            missing = [t for t in ("unshare", "setpriv") if shutil.which(t) is None]
            if missing:
                return SandboxResult("sandbox_error", None, "", f"missing tools: {', '.join(missing)}", 0.0)
            cmd = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
            if not root:
                cmd.append("--map-root-user")
            cmd += ["--", "/bin/sh", "-c", _INNER, "sandbox", str(folder)]
            if root:
                cmd += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs",
                        "--inh-caps=-all", "--bounding-set=-all", "--"]  # fmt: skip
            cmd += program
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8"}
        return _run(cmd, folder, env, limits, root and not UNSAFE_no_isolation)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _interpreter() -> str:
    """A system Python the sandbox user can execute (a venv under /root may not be reachable)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


def _limiter(limits: SandboxLimits, as_nobody: bool):
    procs = limits.max_procs if as_nobody or os.geteuid() == 0 else _user_processes() + limits.max_procs

    def apply() -> None:
        mem = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb << 20, limits.max_file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _user_processes() -> int:
    uid = os.getuid()
    return sum(1 for p in Path("/proc").iterdir() if p.name.isdigit() and _owner(p) == uid)


def _owner(p: Path) -> int:
    try:
        return p.stat().st_uid
    except OSError:
        return -1


def _run(cmd: list[str], folder: Path, env: dict[str, str], limits: SandboxLimits, as_nobody: bool) -> SandboxResult:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_limiter(limits, as_nobody), start_new_session=True,
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
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL) and seconds >= min(limits.cpu_s, limits.timeout_s) * 0.9:
        return "timeout"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    return "error"
