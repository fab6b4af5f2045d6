"""One exception type per family; each message says what to change."""


class PlaitError(Exception):
    """Base class of every error plait raises on purpose."""


def error_names() -> set[str]:
    """The class names of PlaitError and every subclass defined so far (in any module): a rank's
    error that starts with one of them says what to change, and is shown as its line alone."""
    names, todo = set(), [PlaitError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


class ConfigError(PlaitError):
    """An invalid configuration: unknown key, wrong type, inconsistent sizes."""


class TopologyError(PlaitError):
    """A mesh that does not fit the world size or the process group."""


class CommError(PlaitError):
    """A collective that failed or did not complete in time (watchdog)."""


class CheckpointError(PlaitError):
    """A checkpoint that is missing, truncated, corrupted or does not fit the run."""


class DataParallelError(PlaitError):
    """Misuse of data parallelism, e.g. parameters that received no gradient."""


class ScheduleError(PlaitError):
    """An invalid pipeline schedule: an action out of order, an unmatched send, a deadlock."""


class PipelineError(PlaitError):
    """A model that cannot be split into the pipeline stages asked for, or misuse of the runtime."""


class ExportError(PlaitError):
    """An exported model file that cannot be written or read back."""


class DivergedError(PlaitError):
    """Training produced non-finite losses or gradients and stopped (train.nonfinite)."""


class ReplicaMismatchError(PlaitError):
    """Tensors that must be identical on several ranks differ (train.replica_check_every)."""


class RunInUseError(PlaitError):
    """A run directory that another `plait train` holds (a second run, or a second resume, on it)."""
