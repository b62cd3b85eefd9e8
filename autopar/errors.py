"""Exception types raised by autopar: each message is one sentence naming the cause and the fix."""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class TraceError(AutoparError):
    """Neither tracer could turn the model into a graph."""


class PlanError(AutoparError):
    """A plan is malformed, or cannot be realised on the model or world it is applied to."""


class WorldError(AutoparError):
    """The world (devices, process group, hardware profile) is not what the request needs."""


class RankStoppedError(AutoparError, RuntimeError):
    """Another rank stopped (died, left, or stopped calling train_step) and this one would
    have waited for it: raised after parallelize's timeout, naming the rank and where."""


class CheckpointError(AutoparError):
    """A checkpoint could not be written or read (the file system or a rank failed)."""


class WeightsError(AutoparError):
    """A weight source (safetensors files, a checkpoint, a mapping) does not match the model,
    or an export could not be written."""


class BatchError(AutoparError, ValueError):
    """A batch given to train_step or forward is not what the engine was built for, or
    differs across ranks that must all see the same global batch."""


class TokenIdError(BatchError, IndexError):
    """A token id (or a class target) lies outside the table it indexes; an IndexError, as
    one device raises it."""
