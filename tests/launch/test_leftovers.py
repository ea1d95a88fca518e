"""Nothing left behind: a real ``noria train`` (asynchronous RL, an evaluation fleet, agent sessions)
leaves no process, listening socket, /dev/shm segment, lock file or temporary file, whether it ends
normally or is SIGKILLed while its engines and evaluation fleet are up.

What is listed, while the run is up and again after it ended (every pid of the run is remembered
with its start time, so a reused pid is not mistaken for it):

- processes: the descendants of ``noria train`` (walked under /proc), and every process whose
  environment carries this test's mark (a child that was reparented or made its own session
  carries it too, since children inherit the environment);
- listening sockets: the TCP sockets those processes listen on (/proc/net/tcp and tcp6, by socket
  inode); after the end none of them may be in LISTEN state, whoever would hold it (a port number
  that another program on the machine binds afterwards is another socket, and not counted);
- /dev/shm: entries made since the test began that are named with one of the run's pids, or were
  mapped or held open by one of its processes;
- lock files: files with "lock" in their name made since the run began, in its run folder and in
  the folders of the lock files its processes held open (torch's build baton is a file whose mere
  existence blocks the next build); a file locked through the kernel (flock or POSIX, listed in
  /proc/locks: the kernel C++ build lock) is released when its holder dies, so its file may stay;
- temporary files: anything left in the run's own TMPDIR (a folder of this test).

Both runs start together (they share the machine's start-up time). CPU, tiny random model, loopback
only; marked ``chaos``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from proc_util import alive, descendants, listening_sockets, socket_inodes
from repo_util import TESTS
from rl_util import async_args

pytestmark = [pytest.mark.chaos, pytest.mark.alone, pytest.mark.timeout(300)]  # alone: it lists new lock files of shared folders

SHM = Path("/dev/shm")
MARK = "NORIA_TEST_LEFTOVER_MARK"
GONE_WITHIN_S = 15.0
"""How long the run's processes may take to go after it ended: children die by their parent-death
signal at once; a helper that notices its parent's death by polling takes up to a few seconds."""


class Run:
    """A marked process (its environment carries ``MARK``) with a run folder and a TMPDIR of its own."""

    def __init__(self, tmp_path: Path, cmd: list[str]) -> None:
        self.dir, self.run, self.tmp = tmp_path, tmp_path / "run", tmp_path / "tmp"
        self.tmp.mkdir(parents=True)
        self.mark = uuid.uuid4().hex
        env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", MARK: self.mark,
               "TMPDIR": str(self.tmp)}  # fmt: skip
        self.err = tmp_path / "stderr"
        self.seen = Seen()  # first: what /dev/shm held before
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.err, "wb"), env=env)  # noqa: SIM115

    @classmethod
    def train(cls, tmp_path: Path, model: Path, steps: int) -> Run:
        """``python -m noria train`` of an asynchronous run with an eval fleet and agent sessions."""
        tmp_path.mkdir(parents=True)
        config = tmp_path / "run.yaml"
        config.write_text("name: leftovers\n")
        args = async_args(model, **{
            "train.max_steps": steps, "rollout.agent_fn": "agent_plugins:two_turn_agent", "reward.name": "agent_plugins:digits_of_final",
            "rollout.max_new_tokens": 6, "eval.mode": "fleet", "eval.engines": 1, "eval.every": 1, "eval.limit": 4,
            "eval.max_new_tokens": 6, "train.save_every": 1, "sync.transport": "ipc",
        })  # fmt: skip
        return cls(tmp_path, [sys.executable, "-m", "noria", "train", str(config), *args, "--run-dir", str(tmp_path / "run"), "--no-progress"])

    def steps(self) -> int:
        path = self.run / "metrics.jsonl"
        return sum(1 for line in path.read_text().splitlines() if line.endswith("}")) if path.exists() else 0

    def look(self) -> None:
        if self.proc.poll() is None:
            self.seen.look(self)

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")[-3000:]


class Seen:
    """Everything of one run seen while it was up (module docstring)."""

    def __init__(self) -> None:
        self.pids: dict[int, str] = {}  # pid -> its start time
        self.names: dict[int, str] = {}
        self.ports: dict[str, int] = {}  # socket inode -> port, of every socket the run listened on
        self.shm: set[str] = set()
        self.locks: set[str] = set()
        self.kernel_locked: set[str] = set()
        self.start = time.time()
        self.shm_before = set(os.listdir(SHM))

    def look(self, run: Run) -> None:
        pids = [run.proc.pid, *descendants(run.proc.pid), *marked(run.mark)]
        for pid in dict.fromkeys(pids):
            start = start_time(pid)
            if start is None:
                continue
            self.pids.setdefault(pid, start)
            self.names.setdefault(pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:160].decode(errors="replace"))
            try:
                inodes = socket_inodes(pid)
                self.ports.update({inode: port for _, port, inode in listening_sockets() if inode in inodes})
                self.shm |= shm_of(pid)
                self.locks |= open_locks(pid)
            except OSError:  # gone meanwhile
                continue
        self.kernel_locked |= held_locks(set(self.pids))
        ours = {str(p) for p in self.pids}
        self.shm |= {n for n in set(os.listdir(SHM)) - self.shm_before if ours & set(digit_runs(n))}


def marked(mark: str) -> list[int]:
    """Processes whose environment carries ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "environ").read_bytes().split(b"\0"):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z" and not _threads_alive(pid):
        return None  # exited: its files, listening sockets included, are closed; only the parent's reap is left
    return fields[19]


def _threads_alive(pid: int) -> bool:
    """Whether a thread of ``pid`` is still running or exiting. A killed multi-threaded process shows
    its leader as a zombie while its other threads still exit and its files are still open."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except OSError:
            continue
    return False


def digit_runs(name: str) -> list[str]:
    import re

    return re.findall(r"\d+", name)


def shm_of(pid: int) -> set[str]:
    """/dev/shm names ``pid`` maps or holds open."""
    names = {line.split("/dev/shm/", 1)[1].split(" ")[0] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            names.add(target.removeprefix("/dev/shm/").split(" ")[0])
    return names


def open_locks(pid: int) -> set[str]:
    """Files ``pid`` holds open with "lock" in their name."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/") and "lock" in Path(target).name.lower():
            out.add(target.removesuffix(" (deleted)"))
    return out


def held_locks(pids: set[int]) -> set[str]:
    """Paths of the files ``pids`` hold a lock on (/proc/locks gives the inode; found through their fds)."""
    inodes = set()
    for line in Path("/proc/locks").read_text().splitlines():
        cols = line.split()
        if len(cols) > 5 and cols[4].isdigit() and int(cols[4]) in pids:
            inodes.add(int(cols[5].rsplit(":", 1)[1]))
    out = set()
    for pid in pids & {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.stat(fd).st_ino in inodes:
                    out.add(os.readlink(fd))
            except OSError:
                continue
    return out


def still_listening(seen: Seen) -> list[int]:
    """Ports of the sockets the run listened on that still listen, whichever process holds them now
    (matched by socket inode: a port that another program on the machine binds afterwards is not the run's)."""
    live = {inode for _, _, inode in listening_sockets()}
    return sorted(port for inode, port in seen.ports.items() if inode in live)


def left_behind(run: Run, wait_s: float = GONE_WITHIN_S) -> dict[str, list]:
    """What of ``run`` is still there, after waiting up to ``wait_s`` for its processes."""
    seen = run.seen
    seen.pids.update({p: start_time(p) or "" for p in marked(run.mark) if p not in seen.pids})
    deadline = time.monotonic() + wait_s
    while (procs := [p for p, t in seen.pids.items() if start_time(p) == t]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "processes": [f"{p} {seen.names.get(p, '')}" for p in procs],
        "listening": still_listening(seen),
        "shm": sorted(n for n in seen.shm if (SHM / n).exists()),
        "locks": lock_files(run) - seen.kernel_locked,
        "files": sorted(str(p) for p in run.tmp.rglob("*")),
    }


def lock_files(run: Run) -> set[str]:
    """Lock files made since the run began, in its run folder and in the folders of the lock files
    its processes held open (two levels down: torch's build baton is ``<build folder>/lock``)."""
    roots = {run.run} | {Path(p).parent for p in run.seen.locks}
    found = set()
    for root in roots:
        for path in [*root.glob("*"), *root.glob("*/*")]:
            try:
                made = path.stat().st_ctime >= run.seen.start
            except OSError:
                continue
            if made and "lock" in path.name.lower():
                found.add(str(path))
    return found


def test_nothing_is_left_after_a_normal_end_or_a_sigkill(tiny_model_dir, tmp_path):
    """One run ends by itself (2 steps), the other is SIGKILLed once its first step is logged (its
    engines, evaluation engine and session server are up then); both start together and are
    watched until then."""
    normal = Run.train(tmp_path / "normal", tiny_model_dir, steps=2)
    killed = Run.train(tmp_path / "killed", tiny_model_dir, steps=50)
    wait_until(lambda: killed.steps() >= 1, [normal, killed], killed)
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    after_kill = left_behind(killed)
    wait_until(lambda: normal.proc.poll() is not None, [normal], None)
    assert normal.proc.returncode == 0, normal.stderr()
    assert normal.steps() == 2 and json.loads((normal.run / "eval.jsonl").read_text().splitlines()[-1])["mode"] == "fleet"
    after_end = left_behind(normal)
    for run in (normal, killed):  # what was listed while up: the run, its engine, its evaluation engine; their ports
        assert len(run.seen.pids) >= 3 and len(run.seen.ports) >= 2, f"the run was not seen up: {run.seen.names}, ports {run.seen.ports}"
    assert not any(after_kill.values()), f"left behind after a SIGKILL: {after_kill}"
    assert not any(after_end.values()), f"left behind after a normal end: {after_end}"
    assert not alive(killed.proc.pid)


def wait_until(done, watched: list[Run], must_live: Run | None, timeout_s: float = 240) -> None:
    """Look at the ``watched`` runs every 0.2 s until ``done()``; ``must_live`` may not exit meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert must_live is None or must_live.proc.poll() is None, f"the run exited early ({must_live.proc.returncode}): {must_live.stderr()}"
        assert time.monotonic() < deadline, f"not done within {timeout_s} s: {[r.stderr() for r in watched]}"
        for run in watched:
            run.look()
        time.sleep(0.2)
    for run in watched:
        run.look()


LEAKER = """
import os, socket, subprocess, sys, time
from pathlib import Path
run = Path(sys.argv[1])
(run / "build").mkdir(parents=True)
Path(f"/dev/shm/noria_test_leftover_{os.getpid()}").write_bytes(b"x")
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
(run / "build" / "lock").touch()  # a baton: its existence is the lock
held = open(run / "x.lock", "w")
open(os.path.join(os.environ["TMPDIR"], "scratch"), "w").close()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True, pass_fds=(server.fileno(),))
print("ready", file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_the_listing_finds_what_a_killed_process_leaves(tmp_path):
    """The check above cannot pass vacuously: a process that leaves a grandchild of its own session
    (holding its listening socket), a /dev/shm file, a baton lock file, a held lock file and a
    temporary file is SIGKILLed; every one of them is reported."""
    leaker = Run(tmp_path, [sys.executable, "-c", LEAKER, str(tmp_path / "run")])
    wait_until(lambda: "ready" in leaker.err.read_text(), [leaker], leaker, timeout_s=30)
    leaker.proc.send_signal(signal.SIGKILL)
    leaker.proc.wait()
    left = left_behind(leaker, wait_s=0.5)
    try:
        assert len(left["processes"]) == 1 and "time.sleep(60)" in left["processes"][0], left
        assert len(left["listening"]) == 1, left
        assert left["shm"] == [f"noria_test_leftover_{leaker.proc.pid}"], left
        assert left["locks"] == {str(tmp_path / "run" / "build" / "lock"), str(tmp_path / "run" / "x.lock")}, left
        assert left["files"] == [str(tmp_path / "tmp" / "scratch")], left
    finally:
        for pid in marked(leaker.mark):
            os.kill(pid, signal.SIGKILL)
        (SHM / f"noria_test_leftover_{leaker.proc.pid}").unlink(missing_ok=True)
