"""The model layer's exceptions: configs, weights and the files they come from."""

from __future__ import annotations

from ..common.errors import PyggmlDkvError


class ConfigError(PyggmlDkvError, ValueError):
    """A DraftConfig whose values are inconsistent or out of range (the message names the field)."""


class WeightsError(PyggmlDkvError, ValueError):
    """Weights that do not fit their DraftConfig (missing, unexpected, wrong shape, not finite)."""


class CheckpointError(PyggmlDkvError, ValueError):
    """A checkpoint this package cannot load or write exactly (the message names what and where)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory or one of its files does not exist."""
