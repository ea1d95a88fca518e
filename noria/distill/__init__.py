"""On-policy distillation (OPD): a teacher scores the student's own samples.

The student samples as in RL; a teacher gives the log-probability of every sampled token; the
per-token reverse KL ``log pi_s(y_t) - log pi_t(y_t)`` is subtracted from any estimator's
advantages (``train.loss.opd_coef``), or is the only learning signal (``opd.pure``).

- ``noria.config.opd``: the ``opd`` config section;
- ``noria.distill.teacher``: teachers served by engines (a ``noria serve`` the run starts, or any
  SGLang-API URL; several by a metadata key) scoring samples during rollout by prefill, and the
  start-up check that teacher and student share one tokenizer;
- ``noria.train.opd``: the trainer's side: the in-trainer teacher (a frozen copy beside the
  reference model), the advantage shaping and the ``opd/*`` metrics.

This ``__init__`` imports nothing: import the module you need.
"""
