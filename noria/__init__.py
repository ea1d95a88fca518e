"""Noria: reinforcement-learning post-training of large language models.

Top-level packages are runtime roles: ``models`` (native model definitions shared by engine and
trainer), ``data`` (prompt sources and synthetic tasks), ``rewards`` (scoring), ``eval``
(accuracy on a task's test split). ``types`` and ``config`` are leaves that every role imports;
``hardware`` knows the CPU.
"""

from noria.hardware import apply_isa_override

# NORIA_CPU_ISA=avx2 must reach torch, oneDNN and MKL before their first CPU op (see noria.hardware).
apply_isa_override()

__version__ = "0.1.0"
