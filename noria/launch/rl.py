"""``noria train`` for ``train.algorithm: rl``: pick the job kind a config asks for, build it, run
``noria.loop.rl_loop`` on it, and clean up.

Beside it, ``noria.launch.sft.run_sft`` is the SFT job. The job kinds (``noria.launch.job.LocalJob``
and those that extend it through its hooks) build the parts; this module only chooses and runs one.
A run that fails before its first step leaves no run folder behind (``noria.run_folder``); Ctrl-C
and SIGTERM print where the run stands and how to resume it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from noria.config import RunConfig
from noria.launch.job import LocalJob


def run_rl(
    config: RunConfig, run_dir: str | None = None, resume: str | None = None, progress: bool | None = None,
    job_class: type[LocalJob] | None = None,
) -> Path:
    """``noria train`` for ``train.algorithm: rl``: build the job, run the loop, clean up.
    ``job_class``: a ``LocalJob`` of another model family (``noria.diffusion.job.DiffusionJob``)."""
    from noria.loop import rl_loop
    from noria.run_folder import discard_unstarted, resolve_run_dir

    folder = resolve_run_dir(config, run_dir, resume)  # once: the default name holds the time
    with discard_unstarted(folder, resume is not None):  # a run that fails before step 1 leaves no folder
        job = (job_class or job_class_for(config)).build(config, None if resume else str(folder), resume, progress)
        try:
            asyncio.run(job.run(rl_loop))
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (noria.process.lifecycle): say where the run stands
            why = str(e) or "interrupted (Ctrl-C)"
            print(f"noria train: {why} after step {job.step}; {job.resume_hint()}", file=sys.stderr, flush=True)
            raise
        finally:
            job.close()
    return job.folder


def job_class_for(config: RunConfig) -> type[LocalJob]:
    """The job a config asks for: ``launch: ray`` (``noria.launch.ray.RayJob``), an engine fleet
    (``rollout.engines`` > 1 or ``rollout.elastic``) or several trainer ranks on this machine
    (``noria.launch.scaled.ScaledJob``), else ``LocalJob``."""
    if config.launch == "ray":
        from noria.launch.ray import RayJob

        return RayJob
    if config.rollout.engines > 1 or config.rollout.elastic or config.train.world_size > 1:
        from noria.launch.scaled import ScaledJob

        return ScaledJob
    return LocalJob
