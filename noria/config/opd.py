"""The ``opd`` config section: where the teacher of on-policy distillation lives and how its
scores are used. Owner: ``noria.distill``.

Distillation is on when ``train.loss.opd_coef`` > 0 (the weight lambda lives with the other loss
weights); this section says which teacher and how. Cross-tokenizer distillation is out of scope:
teacher and student must share one tokenizer (checked at start, ``noria.distill.teacher``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from noria.config.schema import ConfigError, option


@dataclass
class OpdConfig:
    """On-policy distillation's teacher. Owners: ``noria.distill.teacher`` (engine teachers, the
    tokenizer check) and ``noria.train.opd`` (the in-trainer teacher, advantages, metrics)."""

    teacher: str | None = option(
        None,
        "The teacher model (catalog name or HF folder), same tokenizer as model.path. placement trainer: loaded frozen "
        "in the trainer; placement engine: served by a `noria serve` the run starts (unless teacher_url or teachers).",
    )
    placement: Literal["trainer", "engine"] = option(
        "trainer",
        "trainer: a frozen copy beside the reference model, scoring each step's batch (off the accelerator between "
        "uses); engine: a second engine scores every sample by prefill during rollout (overlapping training).",
    )
    teacher_url: str | None = option(
        None, "placement engine: base URL of a running teacher server (noria serve or SGLang); null starts `noria serve` "
        "on opd.teacher."
    )
    teachers: dict[str, str] = option(
        factory=dict,
        help="placement engine, several teachers: {value of the prompt's metadata[teacher_key]: base URL}; a sample whose "
        "value is missing here fails (never silently scored by another teacher).",
    )
    teacher_key: str = option("teacher", "Prompt metadata key that selects a teacher from `teachers`.")
    teacher_device: str | None = option(
        None, "placement engine: torch device of the teacher's `noria serve` (e.g. cuda:1); null uses model.device."
    )
    pure: bool = option(
        False,
        "Pure distillation: the reverse KL is the only signal (per token A_t = -opd_coef * (log pi_s - log pi_t)); the "
        "estimator's advantages are dropped and the task reward is only measured.",
    )
    top_k: int = option(
        0,
        "0: the sampled-token estimate log pi_s(y_t) - log pi_t(y_t). k > 0: per position, the KL of the student's and "
        "the teacher's top-k distributions (placement engine; the rollout engine reports the student's top-k).",
    )

    def validate(self) -> None:
        if self.top_k < 0:
            raise ConfigError(f"opd.top_k must be >= 0, got {self.top_k}")
        if self.placement == "trainer" and (self.teacher_url or self.teachers):
            raise ConfigError("opd.teacher_url and opd.teachers name teacher servers: they need opd.placement: engine")
        if self.teacher_url and self.teachers:
            raise ConfigError("opd: set opd.teacher_url (one teacher) or opd.teachers (several), not both")
        if self.top_k and self.placement != "engine":
            raise ConfigError("opd.top_k compares the engines' top-k logprobs: it needs opd.placement: engine")
        for value, url in self.teachers.items():
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"opd.teachers[{value!r}] must be a base URL http://HOST:PORT, got {url!r}")

    def check_enabled(self, coef: float) -> None:
        """Across sections: with ``train.loss.opd_coef`` > 0 a teacher must be named."""
        if coef > 0 and not (self.teacher or self.teacher_url or self.teachers):
            raise ConfigError("train.loss.opd_coef > 0 needs a teacher: opd.teacher (a model), opd.teacher_url or opd.teachers")
        if coef == 0 and (self.pure or self.teacher or self.teacher_url or self.teachers):
            raise ConfigError("the opd section names a teacher, but train.loss.opd_coef is 0: set it > 0 to distill")
