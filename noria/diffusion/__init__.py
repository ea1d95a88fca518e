"""Image models in the same RL architecture: a flow-matching DiT, its rollout engine and its trainer.

This package is a model family beside ``noria.models`` (text), with the engine and trainer parts
that a denoising model needs; the loop, buffer, scheduler, weight sync, checkpoints, metrics and
report are the text system's own, carrying image trajectories as ``Sample`` records whose "tokens"
are denoising steps (``noria.types``).

The ``diffusion:`` config section (present = an image run) is ``noria.config.diffusion``. Modules::

    model.py     diffusers' DiT as a velocity model: folders, exact (batch-invariant) numerics
    sde.py       flow-matching schedule, ODE step, Flow-GRPO's SDE step and its log-probability
    objectives.py  the RL objectives (Flow-GRPO, DiffusionNFT), a registry by diffusion.objective
    protocol.py  ImageRequest / ImageOutput (and their JSON)
    engine.py    DiffusionEngine: batched sampling on a thread, seeds per image, weight updates
    server.py    ``noria serve`` of a DiT folder (HTTP), and DiffusionHttpClient
    rollout.py   the generate function: condition -> image trajectory Sample
    trainer.py   DiffusionTrainer: flow-matching SFT, the RL step, sync, checkpoints
    data.py      scikit-learn's digits: splits and class-condition prompts
    rewards.py   image rewards by import path: digit classifier, JPEG compressibility
    job.py       the RL job (``noria.loop.Job``) and the SFT run of ``noria train``

Who imports whom: like ``noria.models`` it is shared by the engine side (engine.py, server.py) and
the trainer side (trainer.py), which never import each other; it imports ``noria.engine`` and
``noria.train``, never the other way (so the objectives, which need sde.py, live here). diffusers and scikit-learn are optional
dependencies (``pip install noria[diffusion]``), imported when an image run or test needs them.
"""
