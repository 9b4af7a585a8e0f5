"""Exception types. Every error galvatron_fx raises on bad input names the problem and a fix."""


class GalvatronError(Exception):
    """Base class of all galvatron_fx errors."""


class ConfigError(GalvatronError, ValueError):
    """A user-supplied setting (budget, preset, plan file, option) is malformed."""


class CaptureError(GalvatronError, RuntimeError):
    """A model could not be captured into an fx graph by the requested method."""


class InfeasibleError(GalvatronError):
    """No parallel plan fits the memory budget."""


class PlanMismatchError(GalvatronError, ValueError):
    """A plan does not match the model, the world size or the other ranks."""


class TrainingError(GalvatronError, RuntimeError):
    """A training run cannot go on: a non-finite loss, a lost or silent peer. ``every_rank``: every
    rank raises the same one (the command line prints it on rank 0 only)."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank
