"""What a checkpoint's file operations say when they fail: one line for a failed save (a full
disk named as such, with the space left), and the check that a run's checkpoint directory takes
files before any rank starts (`plait.train.checkpoint`, `plait.train.rundir`)."""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from plait.errors import CheckpointError


def _failures(exc: BaseException, seen: set | None = None):
    """`exc`, the per-rank failures DCP gathered into it, and their causes, depth first."""
    seen = set() if seen is None else seen
    if id(exc) in seen:
        return
    seen.add(id(exc))
    yield exc
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            yield from _failures(failure[0] if isinstance(failure, tuple) else failure, seen)
    for nested in (exc.__cause__, exc.__context__):
        if nested is not None:
            yield from _failures(nested, seen)


def save_failed(exc: BaseException, step: int, tmp: Path, latest: str | None) -> CheckpointError:
    """One line for a failed save into `tmp` (`latest`: the newest checkpoint): what failed (a
    full disk named as such, with what is free), and that the partial checkpoint was removed
    and the previous one is intact."""
    root = tmp.parent
    kept = f"the previous checkpoint is intact ({latest})" if latest else "no earlier checkpoint exists"
    found = list(_failures(exc))
    full = next((e for e in found if isinstance(e, OSError) and e.errno == errno.ENOSPC), None)
    if full is not None:
        try:
            free = f"{shutil.disk_usage(root).free / 2**20:,.1f} MiB free there"
        except OSError:
            free = "free space unknown"
        return CheckpointError(
            f"saving the checkpoint of step {step}: No space left on device writing "
            f"{full.filename or tmp} ({free}); {tmp.name} was removed and {kept}: free space on "
            f"{root}'s file system or lower train.keep_checkpoints, then continue with --resume"
        )
    first = next((e for e in found if not isinstance(e, CheckpointException)), exc)
    what = " ".join(str(first).split()) or type(first).__name__
    return CheckpointError(
        f"saving checkpoint of step {step} to {tmp} failed ({type(first).__name__}: {what[:300]}); "
        f"{tmp.name} was removed and {kept}"
    )


def check_writable(root: Path) -> None:
    """`root`, where a run saves its checkpoints, takes files: a one-line CheckpointError before
    any rank starts, rather than a failed save after the first interval of training."""
    try:
        with tempfile.NamedTemporaryFile(dir=root, prefix=".plait-probe-"):
            pass
    except OSError as exc:
        raise CheckpointError(
            f"the checkpoint directory {root} is not writable ({exc.strerror or exc}): the run could "
            "not save its checkpoints; make it writable, or copy the run to a writable place and "
            "resume the copy"
        ) from None
