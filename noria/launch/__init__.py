"""The jobs: what turns a config into running parts, and the entries of ``noria train``.

Modules::

    rl.py        run_rl: picks the job kind a config asks for and runs noria.loop.rl_loop on it
    sft.py       run_sft: the supervised fine-tuning job (one process or FSDP2 ranks)
    job.py       LocalJob: the base RL job (one machine, one trainer, one engine) and its hooks
                 (build_evals, build_engine, build_teacher, build_trainer, build_sync)
    scaled.py    ScaledJob: LocalJob with an engine fleet and trainer ranks in their own processes
    ray.py       RayJob: ScaledJob whose engines and ranks are Ray actors in placement groups
    fleet.py     EngineFleet: N noria serve engines behind sglang-router, restarts, versions, drains
    elastic.py   noria fleet add|remove on a running job: the request files and what the job does
    ranks.py     trainer ranks (in process, spawned processes) behind one backend facade
    external.py  engine servers other than the built-in one (SGLang, vLLM) and their capability check
    parts.py     what every job builds from a config (checks, backend options, weight sync, ...)

A new job kind (a new model family, a new placement) extends ``LocalJob`` through its hooks and
copies none of it; the loop (``noria.loop``) never imports this package.
"""
