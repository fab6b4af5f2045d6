"""What a run writes to the terminal, made safe for what is not one.

* `progress`: rank 0's progress bar (tqdm) on a terminal; on anything else (a log file, a pipe,
  `plait train > log 2>&1`) plain periodic lines, because a bar's carriage-return frames would
  fill the file with thousands of redrawn lines.
* `survive_closed_output`: `plait train ... | head -1` closes the pipe after one line; a write
  to it then raises BrokenPipeError, which must not stop the training. The stream is pointed at
  /dev/null from then on: the run goes on, and metrics.jsonl, the checkpoints and the plots are
  written as usual.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

PLAIN_EVERY_S = 30.0  # a plain progress line at most this often (and one at the end)


class PlainProgress:
    """The progress bar's interface (update, set_postfix, close), written as whole lines."""

    def __init__(self, total: int, initial: int, desc: str, file, every_s: float = PLAIN_EVERY_S):
        self.total, self.n, self.desc, self.file, self.every_s = total, initial, desc, file, every_s
        self.t0 = self.last = time.monotonic()
        self.start, self.postfix, self.shown = initial, "", initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every_s:
            self._line()

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if self.n != self.shown:  # where the run ended, once
            self._line()

    def _line(self) -> None:
        now = time.monotonic()
        rate = (self.n - self.start) / max(now - self.t0, 1e-9)
        pct = 100.0 * self.n / max(self.total, 1)
        text = f"{self.desc}: step {self.n}/{self.total} ({pct:.0f}%) | {rate:.2f} step/s"
        self.file.write(text + (f" | {self.postfix}" if self.postfix else "") + "\n")
        self.file.flush()
        self.last, self.shown = now, self.n


def progress(total: int, initial: int, enabled: bool, file=None):
    """Rank 0's progress on `file` (stderr): a bar on a terminal, plain lines elsewhere, nothing
    when not `enabled`."""
    file = file if file is not None else sys.stderr
    if enabled and not _is_terminal(file):
        return PlainProgress(total, initial, "train", file)
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=file,
    )


def _is_terminal(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False


class _ClosedOutputSafe:
    """A text stream whose closed reader sends what follows to /dev/null instead of raising."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._divert()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._divert()

    def _divert(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # the buffered rest goes there too
        os.close(devnull)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_output() -> None:
    """From now on, a closed stdout or stderr (its reader gone) costs this process its output,
    not its run."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _ClosedOutputSafe) or not hasattr(stream, "fileno"):
            continue
        try:
            stream.fileno()
        except (OSError, ValueError):  # not a real file (a test's capture)
            continue
        setattr(sys, name, _ClosedOutputSafe(stream))
