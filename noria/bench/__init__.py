"""Benchmarks: ``noria bench NAME`` measures Noria and its peers side by side in one run.

Each benchmark prints one table and, with ``--json PATH``, writes its figures in the shape of
DESIGN.md section 8 (``benchmark``, ``command``, ``date``, ``machine``, ``results`` with ``noria``,
``peers`` and ``bound`` per case). Ratios between columns are what to read: these machines are
noisy, so only figures taken in the same run are compared. Nothing in Noria imports this package.
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Any


def machine_name() -> str:
    """Where the figures were taken: the GPU, or the CPU with the instruction set its paths used."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except Exception:  # a broken CUDA install still leaves the CPU to describe
        pass
    from noria.hardware import cpu_info

    return cpu_info().summary()


def write_json(path: str | Path, benchmark: str, results: list[dict[str, Any]]) -> Path:
    """Write the DESIGN.md section 8 JSON document for ``results``."""
    doc = {
        "benchmark": benchmark,
        "command": "noria " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(),
        "cpu": _cpu(),
        "results": results,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _cpu() -> dict[str, Any]:
    from noria.hardware import cpu_info

    return cpu_info().as_dict()


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """A fixed-width table on stdout."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(title)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    sys.stdout.flush()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3f}"
    return str(value)
