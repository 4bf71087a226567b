"""User-facing errors.

Anything a user can get wrong (a config value, a CLI flag, a data path, a prompt, a checkpoint)
raises a subclass of `LatentloopError`. The CLI turns these into one line on stderr and exit code 2;
every other exception is a bug and keeps its traceback.
"""


class LatentloopError(Exception):
    """Base class for errors caused by the user's input rather than by a bug."""


class ConfigError(LatentloopError, ValueError):
    """An impossible or unknown configuration value."""


class DataError(LatentloopError):
    """Missing, empty or unreadable data."""


class CheckpointError(LatentloopError):
    """A missing, corrupt or incompatible checkpoint / run folder."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint this machine cannot read now (an I/O error, no memory): no sign that it is broken,
    so nothing is set aside for it."""


class SandboxUnavailable(LatentloopError):
    """Untrusted code cannot be run: the isolation it needs is missing on this machine."""


class OutputError(LatentloopError):
    """An output path that cannot be created or written (a file where a folder should be, ...)."""


class NonFiniteError(LatentloopError):
    """Training produced a NaN or infinite loss or gradient (the run diverged)."""


class InteropError(LatentloopError):
    """A model that cannot be imported or exported: an unsupported family or option, a folder that
    is not a Hugging Face checkpoint, an unreachable hub."""


class RankFailure(LatentloopError):
    """Another process of a distributed run failed (with an error of no known class); raised on
    every process, so that all stop together. Errors that every process raises this way carry
    `shared = True`, and the command line prints them on rank 0 only."""
