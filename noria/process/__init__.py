"""The process owner: the one place a Noria process starts, watches and stops other processes.

Modules::

    child.py      Child (a child process from start to reap: environment, readiness, signals, stop),
                  run (a command to completion), start_process / spawn (Python functions in fresh
                  interpreters: trainer ranks)
    lifecycle.py  dying with the parent (PR_SET_PDEATHSIG), SIGTERM handled as Ctrl-C, signals that
                  cancel the RL loop's task, exit codes
    env.py        the environment every child gets (NVLink multicast off)
    usage.py      a process tree and its peak memory (memory/peak_rss_gb), read from /proc; the C
                  heap's free pages handed back (release_free_memory)

A bottom layer: it imports nothing of Noria but ``noria.errors``. Nothing outside this package
calls ``subprocess.Popen``, ``subprocess.run``, ``asyncio.create_subprocess_*`` or a
``multiprocessing`` start method (``tests/test_structure.py`` checks it; the code sandbox,
``noria.agent.sandbox``, is the one named exception: it runs with the system Python as other
users and imports only the standard library).
"""

from noria.process.child import Child, ChildFailed, run, spawn, spawn_context, start_process
from noria.process.env import child_env, multicast_off
from noria.process.lifecycle import Terminated, die_with_parent, exit_code, sigterm_as_interrupt, signals_cancel_task

__all__ = [
    "Child", "ChildFailed", "Terminated", "child_env", "die_with_parent", "exit_code", "multicast_off", "run",
    "sigterm_as_interrupt", "signals_cancel_task", "spawn", "spawn_context", "start_process",
]  # fmt: skip
