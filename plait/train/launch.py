"""Start the configured number of ranks with torch's own launcher (torch.distributed.elastic).

* Under an outer `torchrun` (multi-node, or a cluster's launcher) `plait train` is one rank and
  runs the loop directly; WORLD_SIZE must match the configuration.
* One rank: the loop runs in this process (a gloo group of one), so a debugger just works.
* Several ranks on this machine (or one, with restarts): `elastic_launch` starts them with the
  c10d rendezvous and a 0.1 s monitor: when a rank fails, the agent stops the others at once
  and either restarts them all (`train.max_restarts` times; each restart resumes from the
  newest checkpoint) or prints the failing rank's own traceback (or the watchdog's report) as
  the root cause.
* Signals: SIGTERM (a scheduler's pre-emption) makes every rank finish its step, save a
  checkpoint and exit with 143, whether it reaches the launcher alone or the whole process
  group (the launcher passing it on is then the same request, not a second one: see
  `plait.train.preempt.route_sigterm`); Ctrl-C (SIGINT) stops with 130, one line, no traceback.
* The ranks die with the launcher, however it ends (SIGKILL included), and hold the run's lock
  with it: `_die_with_launcher`, `SharedLock`.
* Every store and gloo socket of a run on one machine listens on 127.0.0.1 only
  (`plait.comm.ports`).

Before any rank trains, the run's owner claims its directory (`plait.train.rundir`): this
process, or global rank 0's under an outer launcher.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import select
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher import api as elastic_api

from plait.comm.ports import LOOPBACK, free_port, listen_on_loopback, loopback_store
from plait.comm.recorder import WATCHDOG_PREFIX
from plait.errors import ConfigError, error_names
from plait.train import loop
from plait.train.config import Config, config_from_dict
from plait.train.console import survive_closed_output
from plait.train.diloco_checks import check_trainable
from plait.train.peak import peak_flops_per_rank
from plait.train.preempt import PREEMPTED_EXIT, route_sigterm
from plait.train.preflight import check_before_start
from plait.train.rundir import claim_run, hold_run_dir

# `loop.run` and `elastic_api.elastic_launch` are looked up when called, not bound here: the
# launch tests replace them to see what would start without starting it.


def under_launcher() -> bool:
    """Whether this process is one rank of an outer launcher's job (torchrun, a cluster's)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _threads_per_rank(world: int) -> int:
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // world)


def _restart_count() -> int:
    """How many times the launcher (plait's, or an outer torchrun with --max-restarts) has
    restarted this job's ranks."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _worker(cfg_dict: dict, resume: bool, peak: float | None, env: dict[str, str], lock=None) -> dict:
    """Entry point of each rank (elastic_launch records its exception in the error file). A
    rank is forked from a server process started at the first launch, so it gets the launching
    process's environment of now (`env`) on top of the agent's per-rank variables, and the run
    lock's open file (`lock`, a `SharedLock`: held until this rank exits)."""
    os.environ.update(env)  # the launcher runs unlaunched: no rank variables of its own to clash
    launcher = int(os.environ[LAUNCHER_PID_ENV])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server's ignores it (see above)
    route_sigterm(launcher)  # before any other thread starts: they inherit SIGTERM blocked
    _die_with_launcher(launcher)
    signal.signal(signal.SIGINT, _interrupt_once)
    survive_closed_output()  # rank 0 writes to the launcher's stdout, which may be a closed pipe
    try:
        return loop.run(config_from_dict(cfg_dict), resume=resume, peak_flops=peak, restart=_restart_count())
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says it once
        raise SystemExit(INTERRUPTED_EXIT) from None


def _start_forkserver_deaf_to_sigterm() -> None:
    """Start the fork server the ranks come from with SIGTERM ignored (a disposition a child
    inherits), so that a SIGTERM to the whole process group (Slurm, Kubernetes, systemd) does
    not kill it. The agent waits for a rank through the fork server's pipe: had it died, the
    agent would take every rank for exited, the launcher would return at once and its ranks
    die with it (`_die_with_launcher`) in the middle of the checkpoint SIGTERM asks them for:
    a save longer than a few hundred milliseconds (a large model, an asynchronous save's write
    in flight) never finished. Each rank gives SIGTERM back its default first thing (`_worker`)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt_once(signum, frame):
    """A rank's Ctrl-C: stop; the agent's SIGINT that follows while the rank winds down is
    ignored (it would interrupt the clean-up itself and print a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


INTERRUPTED_EXIT = 130  # 128 + SIGINT
LAUNCHER_PID_ENV = "PLAIT_LAUNCHER_PID"  # the process that started the ranks (and got their signals)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_launcher(launcher: int) -> None:
    """Make this rank die (SIGKILL) as soon as the launcher has exited, however it ended.

    A rank's parent is multiprocessing's fork server, not the launcher, and the fork server
    outlives the launcher while any rank lives (each rank holds the end of the pipe whose EOF
    tells it to exit), so a parent-death signal (prctl PR_SET_PDEATHSIG) would not fire. A
    thread waits instead on a pidfd of the launcher, which becomes readable when the launcher
    exits: no polling, no PID reuse. SIGKILL, not SIGTERM: without the launcher nobody reports
    a failure, restarts the job or frees a rank stuck in a collective, so a save started now
    might never end; the newest checkpoint is where `--resume` starts.

    torch's process wrapper asks for SIGINT when the parent (the fork server) dies; the fork
    server dies of a SIGTERM to the process group (it has no handler), which would interrupt
    the ranks while they save. That request is cleared: the launcher's exit is what counts."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:  # gone already (it died while this rank was being started)
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3, not Linux): poll its PID
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while _alive(launcher):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="plait-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class SharedLock:
    """The run lock's open file, handed to each rank: multiprocessing's fork server passes
    descriptors over a socket (SCM_RIGHTS), so every rank holds the same open file, and the
    flock on it (`plait.train.rundir`) lasts until the launcher and the last rank have closed it.
    A `plait train --resume` is thus refused while any rank of the run lives."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def __reduce__(self):
        if self.fd is None:  # a file system without locks
            return (SharedLock, (None,))
        return (_lock_in_rank, (multiprocessing.reduction.DupFd(self.fd),))


def _lock_in_rank(dup) -> SharedLock:
    fd = dup.detach()
    os.set_inheritable(fd, False)  # a program the rank runs does not hold the run
    return SharedLock(fd)


def launch(cfg: Config, resume: bool = False, checkpoint: str | Path | None = None) -> int:
    """Run the configured job; returns the process exit code (0 on success). `checkpoint`: the
    one to resume from (default: `latest`, or the newest that verifies)."""
    check_trainable(cfg)
    if cfg.ps.servers:  # a runtime of its own, above this one: `plait train` starts it
        raise ConfigError(
            f"ps.servers = {cfg.ps.servers}: the parameter server is started by "
            "plait.async_training.ps_launch.launch_ps (as plait train does), not by plait.train.launch"
        )
    world = cfg.world_size
    if under_launcher():
        actual = int(os.environ["WORLD_SIZE"])
        if actual != world:
            raise ConfigError(
                f"the launcher started {actual} ranks but the config needs {world} "
                f"(pp x dp x ep x cp x tp = {cfg.parallel.pp} x {cfg.parallel.dp} x {cfg.parallel.ep} x "
                f"{cfg.parallel.cp} x {cfg.parallel.tp}): change parallel.dp or the launcher's "
                "--nproc-per-node/--nnodes"
            )
        restart = _restart_count()
        if os.environ.get("RANK", "0") != "0":  # rank 0 owns the run; the others take its directory
            loop.run(cfg, resume=resume, restart=restart)
            return 0
        if restart and cfg.train.run_dir:  # torchrun restarted the job: the run is ours again
            held = hold_run_dir(cfg.train.run_dir)
        else:
            cfg, held = claim_run(cfg, resume, checkpoint)
        with held:
            loop.run(cfg, resume=resume, restart=restart)
        return 0

    # the devices, the run directory and the memory, then the directory's lock and (on resume)
    # its checkpoint, before any rank starts: a job refused here writes nothing
    use_cuda = _uses_cuda(cfg, world)
    check_before_start(cfg, use_cuda=use_cuda, ranks=world)  # run directory writable, memory
    cfg, held = claim_run(cfg, resume, checkpoint)
    with held:
        return _launch_here(cfg, world, resume, use_cuda, SharedLock(held.fd))


def _uses_cuda(cfg: Config, world: int) -> bool:
    """Whether the ranks run on GPUs (and this machine has `world` of them)."""
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if use_cuda and world > torch.cuda.device_count():
        raise ConfigError(
            f"{world} ranks need {world} GPUs on this machine, found {torch.cuda.device_count()}"
        )
    return use_cuda


def _launch_here(
    cfg: Config, world: int, resume: bool, use_cuda: bool, lock: SharedLock | None = None
) -> int:
    """Start the ranks on this machine (one: in this process) and wait for them."""
    threads = _threads_per_rank(world)
    peak = None
    if not use_cuda:
        peak = peak_flops_per_rank(torch.device("cpu"), cfg.train.bf16, threads, cfg.train.peak_tflops)
    listen_on_loopback()  # one machine: gloo's sockets on 127.0.0.1, in this process and the ranks
    if world == 1 and cfg.train.max_restarts == 0:
        return _run_in_this_process(cfg, resume, peak)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    t0 = time.time()
    store = loopback_store()  # the agent's rendezvous store, hosted here for the launch's life
    try:
        elastic_api.elastic_launch(_launch_config(cfg, world, store.port), entrypoint=_worker)(
            cfg.to_dict(), resume, peak, dict(os.environ), lock
        )
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        if codes == {PREEMPTED_EXIT}:  # the ranks themselves got SIGTERM and saved
            return PREEMPTED_EXIT
        if codes == {INTERRUPTED_EXIT}:
            sys.stderr.write("plait: interrupted\n")
            return INTERRUPTED_EXIT
        sys.stderr.write(format_child_failure(exc, time.time() - t0))
        return 1
    except SignalException as exc:  # the launcher got it; the agent has stopped the ranks
        if exc.sigval == signal.SIGINT:
            sys.stderr.write("plait: interrupted\n")
            return INTERRUPTED_EXIT
        name = signal.Signals(exc.sigval).name
        if exc.sigval == signal.SIGTERM:  # passed on to the ranks, which saved a checkpoint
            sys.stderr.write(
                f"plait: stopped by {name}; continue with: plait train --resume {cfg.train.run_dir}\n"
            )
        else:
            sys.stderr.write(f"plait: stopped by {name}\n")
        return 128 + int(exc.sigval)
    return 0


_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _run_in_this_process(cfg: Config, resume: bool, peak: float | None) -> int:
    """The only rank, in this process (a gloo group of one): a debugger just works."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    try:
        loop.run(cfg, resume=resume, peak_flops=peak)
    finally:
        for k in _RANK_ENV:
            os.environ.pop(k, None)
    return 0


def _launch_config(cfg: Config, world: int, store_port: int | None = None) -> elastic_api.LaunchConfig:
    """The elastic agent's configuration for `world` ranks on this machine, and the process
    settings its ranks inherit (set here, in the launching process). `store_port`: the
    rendezvous store this process hosts on 127.0.0.1 (`loopback_store`); the agent joins it as a
    client (c10d would host one on every interface), and rank 0's group store is on
    127.0.0.1 too (`local_addr`, then `plait.mesh.init_distributed`)."""
    # A restarted group must not share the agent's store with the failed one: its ranks would
    # read the old group's addresses and fail to connect (pytorch/pytorch#135712). Each
    # attempt's rank 0 then hosts a store of its own on a fresh port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # a rank's parent is the fork server
    # Ranks are forked from one server process that imported torch and the trainer once,
    # instead of each rank importing them again (spawn): seconds per launch and restart. The
    # server is a fresh interpreter that never touched CUDA, so forking from it is safe on GPUs.
    preload = ["torch", "plait.train.loop"]
    if cfg.model.source.startswith("hf:"):  # seconds of import, paid once in the server
        preload += ["transformers", "plait.models.hf"]
    multiprocessing.set_forkserver_preload(preload)
    _start_forkserver_deaf_to_sigterm()
    # The agent logs every rank's traceback at ERROR level, and its shutdowns and restarts at
    # WARNING, each module's logger at its own level; plait prints the root cause once.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    return elastic_api.LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{LOOPBACK}:{store_port or free_port()}",
        rdzv_configs={"is_host": store_port is None},
        local_addr=LOOPBACK,
        max_restarts=cfg.train.max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
    )


_STILL_RUNNING = -1  # the exit code given to a rank that had written its error but not yet exited


def _with_reports_on_disk(failures: dict) -> dict:
    """The agent reports the first rank to exit; a rank that raised first may still be winding
    down while a peer, dying in a collective with it, exits before it. Every rank of the
    attempt that wrote an error file is a candidate for the root cause (local rank = rank: one
    machine)."""
    found = dict(failures)
    for failure in failures.values():
        if not getattr(failure, "error_file", None):
            continue
        for path in Path(failure.error_file).parent.parent.glob("*/error.json"):
            rank = int(path.parent.name) if path.parent.name.isdigit() else None
            if rank is not None and rank not in found:
                try:
                    found[rank] = ProcessFailure(rank, 0, _STILL_RUNNING, str(path))
                except (ValueError, OSError):  # still being written, or empty (a full disk)
                    pass
    return found


def _written_at(failure) -> tuple[int, int]:
    """When a rank wrote its error file: the file's time in ns (the timestamp inside it has
    whole seconds, and a peer dying in a collective often fails within the same second)."""
    try:
        return failure.timestamp, os.stat(failure.error_file).st_mtime_ns
    except (OSError, TypeError, AttributeError):
        return failure.timestamp, 0


def format_child_failure(exc, elapsed: float) -> str:
    """The first failing rank's own traceback, then one line for each other rank."""
    # The root cause is the earliest failure that left a traceback; ranks stopped by the agent
    # after it (or dying in a collective with it) come after.
    failures = _with_reports_on_disk(exc.failures)
    reported = {r: f for r, f in failures.items() if isinstance(f.message, dict)}
    root = min(reported, key=lambda r: _written_at(reported[r])) if reported else exc.get_first_failure()[0]
    failure = failures[root]
    code = f" (exit code {failure.exitcode})" if failure.exitcode != _STILL_RUNNING else ""
    lines = [f"\nplait: rank {root} failed after {elapsed:.1f}s{code}; the job was stopped. Its error:\n"]
    msg = failure.message
    if isinstance(msg, dict) and msg.get("message", "").startswith(WATCHDOG_PREFIX):
        # The rank printed its watchdog report itself: say where it is rather than print it twice.
        lines = [
            f"\nplait: rank {root} failed after {elapsed:.1f}s{code}: the watchdog report above; "
            "the job was stopped."
        ]
    elif isinstance(msg, dict):
        text = msg.get("message", "")
        if text.split(":", 1)[0] in error_names():  # plait's own errors say what to change
            lines.append(text)
        else:
            lines.append(msg.get("extraInfo", {}).get("py_callstack") or text)
    else:
        lines.append(str(msg or "(no traceback: the process was killed or crashed)"))
    for rank, other in sorted(exc.failures.items()):
        if rank != root:
            lines.append(f"\n  rank {rank}: exit code {other.exitcode}")
    return "\n".join(lines) + "\n"
