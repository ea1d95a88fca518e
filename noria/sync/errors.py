"""The weight sync's error type (a leaf: every ``noria.sync`` module raises it)."""

from noria.errors import NoriaError


class WeightSyncError(NoriaError):
    """A weight push failed or did not verify; the message names the engine and the tensor or folder.

    A push that raises has committed nothing on the engines that report the failure: they keep
    their old weights and version (see ``noria.sync`` for the cases across several engines)."""
