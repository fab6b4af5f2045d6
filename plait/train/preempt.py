"""Pre-emption: SIGTERM (a scheduler's, or the launcher passing it on) stops a run at the next
step boundary, after a checkpoint, with exit code PREEMPTED_EXIT.

The request is the state of one run (`StopRequest`, owned by `plait.train.loop.run`), not of the
module: the handler sets it, every rank reads it at each step boundary, and `run` removes the
handler and resets the request when it returns, so a second run in the same process starts clean.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from plait import comm
from plait.mesh import Mesh

PREEMPTED_EXIT = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended
PREEMPT_GRACE_S = 30.0  # as torch's elastic agent, which kills its workers this long after SIGTERM


class Preempted(SystemExit):
    """The run stopped at a step boundary on SIGTERM, after saving a checkpoint."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT)
        self.step = step


class StopRequest:
    """SIGTERM's request to stop one run: `signal` is set by the handler and read at the next step
    boundary (`requested`); `timer` forces the exit when the rank cannot get there."""

    def __init__(self) -> None:
        self.signal = 0
        self.others = 0  # SIGTERMs from anyone but the launcher (`route_sigterm`)
        self.timer: threading.Timer | None = None

    def install(self):
        """Handle SIGTERM with this request; returns the previous handler, for `uninstall`."""
        return signal.signal(signal.SIGTERM, self.on_sigterm)

    def uninstall(self, previous) -> None:
        """Give SIGTERM back to `previous`; a run that stopped in time is not forced to exit."""
        signal.signal(signal.SIGTERM, previous)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.signal = self.others = 0

    def on_sigterm(self, signum, frame, from_launcher: bool = False) -> None:
        """Finish the step in flight, save a checkpoint and exit with PREEMPTED_EXIT
        (`plait.train.loop`). A rank that cannot get there (blocked on a dead peer) exits anyway
        after PREEMPT_GRACE_S, or at a second SIGTERM, so that nothing waits on it forever; the
        previous checkpoint is then the newest. When a peer rank has already failed, the SIGTERM
        is the launcher tearing the job down, not a pre-emption: no checkpoint can be saved
        without that peer, so the rank exits at once.

        `from_launcher` (known only where `route_sigterm` reads the sender): the launcher passes
        on the SIGTERM it got, and when the whole process group got it too (what Slurm, Kubernetes
        and systemd send) the rank has it twice; the launcher's is then the same request, never
        the second SIGTERM that forces the exit."""
        if _peer_failed():
            os._exit(PREEMPTED_EXIT)
        if not from_launcher:
            self.others += 1
            if self.others > 1:
                os._exit(PREEMPTED_EXIT)
        if self.signal:
            return
        self.signal = signum
        self.timer = timer = threading.Timer(PREEMPT_GRACE_S, os._exit, args=(PREEMPTED_EXIT,))
        timer.daemon = True
        timer.start()

    def requested(self, mesh: Mesh) -> bool:
        """Whether any rank got SIGTERM (one small all-reduce over every rank, each step)."""
        return comm.all_reduce_scalar(float(self.signal != 0), mesh, ("world",), op="max") > 0


def _peer_failed() -> bool:
    """Whether another rank of this job on this machine has failed: torch's elastic agent gives
    each rank an error file in one directory per attempt, written by a rank that raises (and
    by the watchdog) before it exits."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    mine = Path(path)
    try:
        return any(f != mine for f in mine.parent.parent.glob("*/error.json"))
    except OSError:
        return False


def route_sigterm(launcher: int) -> None:
    """Take SIGTERM in a thread of its own that knows who sent it, for a rank started by
    plait's launcher (PID `launcher`); call before any other thread starts.

    A Python signal handler is not told the sender, and a rank needs it: a SIGTERM to the
    whole process group reaches it twice, from the group and from the launcher passing it on,
    and only a second one from elsewhere forces the exit (`StopRequest.on_sigterm`). SIGTERM is
    blocked in this thread, and so in every thread started after it (they inherit the mask), and
    the waiting thread takes it with `sigwaitinfo`, then calls the handler installed for it: the
    run's StopRequest while one is installed; the default (exit 143) or ignore otherwise."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            handler = signal.getsignal(signal.SIGTERM)
            method = getattr(handler, "__self__", None)
            if isinstance(method, StopRequest):
                method.on_sigterm(signal.SIGTERM, None, from_launcher=info.si_pid == launcher)
            elif callable(handler):
                handler(signal.SIGTERM, None)
            elif handler != signal.SIG_IGN:  # the default action: end the process
                os._exit(PREEMPTED_EXIT)

    threading.Thread(target=wait, name="plait-sigterm", daemon=True).start()
