"""The error type for bad user input.

Every error raised because of what a user gave Noria (a config key, a data row, a model folder, a
checkpoint) derives from ``NoriaError`` and names the file, row or field at fault. The CLI prints
these as one line without a traceback; anything else is a bug and keeps its traceback.
``EngineFailure`` (an engine died, stopped answering or failed to start) and ``DiskError`` (a run's
file could not be written) live here too, so that every layer raises the same types. This module is
a leaf.
"""

from __future__ import annotations



class NoriaError(ValueError):
    """Bad user input; the message names what is wrong and where."""


class EngineFailure(NoriaError):
    """An engine died, stopped answering, or took longer than allowed; the message names it."""


class DiskError(NoriaError):
    """A file of the run could not be written (disk full, read-only, I/O error); the message names the
    file, the error and the space left on its file system."""

    @classmethod
    def writing(cls, path: object, error: OSError, what: str) -> DiskError:
        """The error for ``what`` failing to write ``path`` with ``error``."""
        import shutil
        from pathlib import Path

        folder = Path(str(path))
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            usage = shutil.disk_usage(folder)
            space = f"{usage.free / 2**20:.0f} MiB free of {usage.total / 2**30:.1f} GiB on its file system"
        except OSError:
            space = "free space unknown"
        return cls(f"{what}: could not write {path}: {error.strerror or error} ({space})")
