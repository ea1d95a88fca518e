"""The error type for bad user input.

Every error raised because of what a user gave Noria (a config key, a data row, a model folder, a
checkpoint) derives from ``NoriaError`` and names the file, row or field at fault. The CLI prints
these as one line without a traceback; anything else is a bug and keeps its traceback.
``EngineFailure`` (an engine died, stopped answering or failed to start) lives here too, so that
every layer that starts or calls engines raises the same type. This module is a leaf.
"""


class NoriaError(ValueError):
    """Bad user input; the message names what is wrong and where."""


class EngineFailure(NoriaError):
    """An engine died, stopped answering, or took longer than allowed; the message names it."""
