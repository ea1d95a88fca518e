"""Elastic engine fleets: ``noria fleet add|remove`` on a running job, and how the job answers.

What this module owns: the control channel between ``noria fleet`` and a running fleet job
(``noria.launch.scaled.ScaledJob``), the job's record of its engines, and what the job does with a
request at its next safe point. The engines' states and their drain are ``noria.launch.fleet``'s.

The channel is a request file in the run folder, not a control API served by the job. The run
folder is already its owner's only (0700, files 0600: ``noria.run_folder``), so the file system
says who may ask, with no listening socket, port or key to guard (a key in a file of that folder
would protect nothing more); a request also waits on disk while the trainer is busy, which is
when the job could not act on it anyway. What a request file may hold is data: an action and
numbers, checked before use; nothing in it is run or imported. Files, under ``RUN_DIR/fleet/``::

    job.json          the running job (its pid); written when the fleet starts, removed when it stops
    requests/ID.json  a request, {"action": "add", "n": K} or {"action": "remove", "engine": I or null},
                      written by ``noria fleet`` (write, then rename); the job renames it ID.taken
                      when it acts on it, so a request withdrawn by then is never half-taken
    answers/ID.json   the job's answer: {"ok", "message", "engines": [...]}
    engines.json      every engine of the fleet: index, url, state, weight version, why it left
    events.jsonl      one line per change: unix time, event (started, serving, draining, removed,
                      lost, restarted), engine, url, note

When the job acts (``serve``, from ``between_waits``: while the trainer waits for groups, so the
trainer's weights are the version the engines serve; the rollout goes on meanwhile):

- add: each new engine starts (``joining``), gets the current weights pushed with checksums
  verified, and only then enters the router (``EngineFleet.rejoin``: the router is started the
  first time a second engine serves); the answer names each engine and its verified version;
- remove: the engine (default: the newest serving one) leaves the router at once and drains
  (``EngineFleet.begin_drain``); the answer comes when its process has ended. The last serving
  engine is never removed;
- an engine that got SIGTERM from elsewhere (preemption) leaves the same way, found by the fleet's
  watcher; the last one is replaced at this safe point (not counted as a restart).

Not guaranteed: a request left by a job that stopped is refused by the next job on that folder (it
may be stale); ``noria fleet`` does not see a job that runs on another machine's view of the folder.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from noria.errors import NoriaError

MAX_ADD = 64
"""Engines one ``noria fleet add`` may ask for."""


def control_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "fleet"


def write_json(path: Path, data: Any) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a file), owner-only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def parse_request(text: str, request_id: str) -> dict[str, Any]:
    """A request's fields, checked (``NoriaError`` naming what is wrong)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise NoriaError(f"request {request_id} is not JSON: {e}") from None
    action = data.get("action") if isinstance(data, dict) else None
    if action == "add":
        n = data.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_ADD:
            raise NoriaError(f"request {request_id}: n must be an integer from 1 to {MAX_ADD}, got {n!r}")
        return {"id": request_id, "action": "add", "n": n}
    if action == "remove":
        engine = data.get("engine")
        if engine is not None and (not isinstance(engine, int) or isinstance(engine, bool) or engine < 0):
            raise NoriaError(f"request {request_id}: engine must be an engine index (noria fleet status), got {engine!r}")
        return {"id": request_id, "action": "remove", "engine": engine}
    raise NoriaError(f"request {request_id}: action must be add or remove, got {action!r}")


def describe(slot: Any) -> dict[str, Any]:
    return {"engine": slot.index, "url": slot.proc.url, "state": slot.state, "version": slot.version,
            "restarts": slot.restarts, "left": slot.left_note}  # fmt: skip


class FleetControl:
    """The job's side of the channel: takes requests, answers them, records the fleet."""

    def __init__(self, folder: Path, fleet: Any) -> None:
        self.dir, self.fleet = control_dir(folder), fleet
        self.lock = threading.Lock()

    def open(self) -> FleetControl:
        """Create the folders, refuse requests left from before, announce this job, record every event."""
        (self.dir / "requests").mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.dir / "answers").mkdir(exist_ok=True, mode=0o700)
        for path in sorted((self.dir / "requests").glob("*.json")):
            self.answer(path.stem, False, "refused: written before this job started (the job it was meant for is gone)")
            path.unlink(missing_ok=True)
        write_json(self.dir / "job.json", {"pid": os.getpid(), "started": time.time()})
        self.fleet.on_event = self.event
        self.record()
        return self

    def take(self) -> list[dict[str, Any]]:
        """The requests waiting, oldest first, each renamed ``.taken`` (a bad one is answered at once)."""
        taken = []
        for path in sorted((self.dir / "requests").glob("*.json")):
            mine = path.with_suffix(".taken")
            try:
                os.rename(path, mine)
            except FileNotFoundError:  # withdrawn by its ``noria fleet`` meanwhile
                continue
            try:
                taken.append(parse_request(mine.read_text(), path.stem))
            except (NoriaError, OSError, UnicodeDecodeError) as e:
                self.answer(path.stem, False, f"refused: {e}")
        return taken

    def answer(self, request_id: str, ok: bool, message: str, **fields: Any) -> None:
        write_json(self.dir / "answers" / f"{request_id}.json", {"ok": ok, "message": message, **fields})

    def event(self, event: str, slot: Any, **fields: Any) -> None:
        """One line of events.jsonl, and engines.json as it is now (any thread)."""
        line = {"t": time.time(), "event": event, **fields}
        if slot is not None:
            line.update(engine=slot.index, url=slot.proc.url)
        with self.lock:
            with open(self.dir / "events.jsonl", "a", opener=lambda p, f: os.open(p, f, 0o600)) as f:
                f.write(json.dumps(line) + "\n")
            self.record()

    def record(self) -> None:
        write_json(self.dir / "engines.json", [describe(s) for s in self.fleet.slots])

    def close(self) -> None:
        (self.dir / "job.json").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------- the job acting


def serve(job: Any, requests: list[dict[str, Any]]) -> None:
    """Act on ``requests`` at a safe point of ``job`` (a ``ScaledJob``; blocking): replace the last
    engine if it left, then each request in order, answered (remove: once its engine is gone)."""
    if job.fleet.needs_engine:
        if not job.grows:
            raise NoriaError(f"the last engine left the fleet and {type(job).__name__} cannot start another here")
        added, error = add_engines(job, 1)
        if error is not None:
            raise error
    for request in requests:
        try:
            if not job.grows:
                raise NoriaError(f"{type(job).__name__} places its engines once (launch: ray: a fixed placement group)")
            if request["action"] == "add":
                answer_add(job, request)
            else:
                remove_engine(job, request)
        except NoriaError as e:
            job.control.answer(request["id"], False, str(e))


def add_engines(job: Any, n: int) -> tuple[list[Any], NoriaError | None]:
    """Start ``n`` engines, push them the current weights with checksums verified, route them
    (blocking). Returns those that serve now and the error that stopped the rest, if any."""
    from noria.sync import WeightSyncError

    fleet, added, error = job.fleet, [], None
    try:
        for _ in range(n):
            added.append(fleet.add_engine())
    except NoriaError as e:  # it did not start (memory, ...): the run goes on with what it has
        error = e
    if added:
        try:
            job.push_to_fleet(job.weight_version, only_restarted=True)
        except WeightSyncError as e:  # every engine alive and the push failed: the new ones leave again
            for slot in added:
                fleet.begin_drain(slot, f"its first weight push failed: {e}", stop=True)
            return [], NoriaError(f"the weight push to the new engine(s) failed: {e}")
    return [s for s in added if s.state == "serving"], error


def answer_add(job: Any, request: dict[str, Any]) -> None:
    added, error = add_engines(job, request["n"])
    names = ", ".join(f"{s.name} (weight version {s.version}, checksums verified)" for s in added)
    message = f"added {len(added)} of {request['n']}: {names or 'none'}" + (f"; {error}" if error else "")
    job.control.answer(request["id"], error is None, message, engines=[describe(s) for s in added])


def remove_engine(job: Any, request: dict[str, Any]) -> None:
    """Drain and stop one serving engine (the newest unless named); answered once it is gone."""
    fleet, index = job.fleet, request["engine"]
    serving = fleet.serving()
    if index is None:
        slot = serving[-1] if serving else None
    else:
        slot = next((s for s in fleet.slots if s.index == index), None)
    if slot is None or slot.state != "serving":
        states = ", ".join(f"{s.index}: {s.state}" for s in fleet.slots)
        raise NoriaError(f"engine {index} is not serving (engines: {states})")
    if len(serving) == 1:
        raise NoriaError(f"{slot.name} is the last engine serving; add one first (noria fleet add)")

    def gone(s: Any) -> None:
        job.control.answer(request["id"], True, f"{s.name} drained and stopped ({s.proc.exit_note()})", engines=[describe(s)])

    fleet.begin_drain(slot, "removed by noria fleet remove", on_gone=gone, stop=True)


# ---------------------------------------------------------------------------------- noria fleet


def running_job(run_dir: str | Path) -> int:
    """The pid of the fleet job running in ``run_dir``; ``NoriaError`` saying why there is none."""
    path = control_dir(run_dir) / "job.json"
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except FileNotFoundError:
        raise NoriaError(f"{run_dir}: no engine fleet is running there (no {path}): noria fleet acts on a running "
                         "`noria train` with an engine fleet (rollout.engines > 1 or rollout.elastic: true)") from None  # fmt: skip
    if not alive(pid):
        raise NoriaError(f"{run_dir}: the job that ran its fleet (pid {pid}) is gone")
    return pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ask(run_dir: str | Path, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Hand ``request`` to the job running in ``run_dir`` and wait for its answer. At the timeout a
    request not taken yet is withdrawn; one taken is carried out anyway (``NoriaError`` says which)."""
    pid = running_job(run_dir)
    request_id = f"{time.time_ns()}-{os.getpid()}"
    folder = control_dir(run_dir)
    path = folder / "requests" / f"{request_id}.json"
    write_json(path, request)
    answer = folder / "answers" / f"{request_id}.json"
    deadline = time.monotonic() + timeout_s
    while not answer.exists():
        if not alive(pid):
            raise NoriaError(f"the job (pid {pid}) stopped before it answered request {request_id}")
        if time.monotonic() > deadline:
            try:
                path.unlink()
                raise NoriaError(f"no answer within {timeout_s:g} s; request withdrawn (the job reaches a safe point "
                                 "each time the trainer waits for groups)")  # fmt: skip
            except FileNotFoundError:
                raise NoriaError(f"no answer within {timeout_s:g} s; the job is carrying it out (see {folder / 'events.jsonl'})") from None
        time.sleep(0.1)
    return json.loads(answer.read_text())


def status(run_dir: str | Path) -> list[dict[str, Any]]:
    """The fleet's engines as the job last recorded them."""
    path = control_dir(run_dir) / "engines.json"
    if not path.exists():
        raise NoriaError(f"{run_dir}: no engine fleet recorded there (no {path})")
    return json.loads(path.read_text())
