"""Start DiLoCo's replica groups, each a world of its own, and watch them (`plait train` with
diloco.inner_steps > 0).

The job's parallel.dp ranks of data parallelism are cut into diloco.replicas groups of
dp / replicas ranks each; inside a group every other axis is as configured (pp, ep, tp, ZeRO).
Each group is one process of this launcher, which runs plait's own launcher for the group's
ranks (one rank: in that process), in the group's run directory `RUN_DIR/replica{g}`. The
groups meet only over the replica axis (`plait.train.diloco_replicas`), through a store this
process hosts on 127.0.0.1 for the job's life.

* A group that fails: without diloco.fault_tolerant the others are stopped at once and the job
  ends with the failing group's own traceback (its ranks print it) and one line naming it. With
  it, the group is marked dead in the store (the others drop it at their next synchronisation),
  started again (at most diloco.max_rejoins times), and the new start heals from a live group
  at the synchronisation after it is ready (`plait.train.diloco_quorum`). The job succeeds when
  the groups still alive finish.
* `--resume`: every group continues from the newest step all of them have a verified
  checkpoint of (the groups save at the same steps).
* The group processes die with this launcher, however it ends (their ranks with them).
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

from plait.comm.ports import loopback_store
from plait.errors import CheckpointError, ConfigError
from plait.train.checkpoint import set_latest, step_checkpoints, verify_checkpoint
from plait.train.config import Config, config_from_dict
from plait.train.diloco_replicas import ENV_GENERATION, ENV_GROUP, ENV_GROUPS, ENV_STORE
from plait.train.preflight import check_before_start
from plait.train.rundir import check_fresh_run_dir, create_run_dir, hold_run_dir

POLL_S = 0.1


def groups_of(cfg: Config) -> tuple[int, int]:
    """(replica groups M, dp ranks per group)."""
    m = cfg.diloco.replicas or cfg.parallel.dp
    return m, cfg.parallel.dp // m


def group_config(cfg: Config, g: int) -> Config:
    """Group g's own config: dp / M ranks of data parallelism, its run directory, no restarts of
    its own (the DiLoCo launcher restarts a group)."""
    _, dp_in = groups_of(cfg)
    run_dir = str(Path(cfg.train.run_dir) / f"replica{g}")
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, dp=dp_in),
        train=dataclasses.replace(
            cfg.train, run_dir=run_dir, max_restarts=0, progress=cfg.train.progress and g == 0
        ),
        diloco=dataclasses.replace(cfg.diloco, replicas=1),
    )


def common_checkpoint(run_dir: Path, groups: int) -> int:
    """The newest step every group holds a verified checkpoint of."""
    steps = None
    for g in range(groups):
        root = run_dir / f"replica{g}" / "checkpoints"
        mine = set()
        for path in step_checkpoints(root):
            try:
                verify_checkpoint(path)
            except CheckpointError:
                continue
            mine.add(int(path.name.split("_")[1]))
        steps = mine if steps is None else steps & mine
    if not steps:
        raise CheckpointError(
            f"--resume {run_dir}: no step has a verified checkpoint in every replica group "
            f"(replica0 .. replica{groups - 1}/checkpoints)"
        )
    return max(steps)


def _group_main(cfg_dict: dict, g: int, groups: int, port: int, resume: bool, generation: int, launcher: int):
    """One replica group: plait's launcher for its ranks, in this process."""
    launch = importlib.import_module("plait.train.launch")  # (plait.train's `launch` is its function)

    os.environ.update(
        {ENV_GROUP: str(g), ENV_GROUPS: str(groups), ENV_STORE: str(port), ENV_GENERATION: str(generation)}
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the DiLoCo launcher stops the groups
    launch._die_with_launcher(launcher)
    cfg = config_from_dict(cfg_dict, check_data=False)
    if g:  # group 0 speaks for the job; the others' lines go to their run directories
        log = open(Path(cfg.train.run_dir) / "stdout.log", "a", buffering=1)  # noqa: SIM115
        os.dup2(log.fileno(), 1)
        sys.stdout = log
    world = cfg.world_size
    use_cuda = launch._uses_cuda(cfg, world)
    code = launch._launch_here(cfg, world, resume and generation == 0, use_cuda)
    sys.stdout.flush()
    sys.exit(code)


def launch_diloco(cfg: Config, resume: bool = False) -> int:
    """Run the DiLoCo job of `cfg`; returns the exit code (0: the groups alive at the end finished)."""
    from plait.train.launch import _uses_cuda

    groups, _ = groups_of(cfg)
    use_cuda = _uses_cuda(cfg, cfg.world_size)
    # the machine's cores shared by every rank of every group (each group's own launcher would
    # give its ranks the whole machine: M times too many threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.world_size)))
    check_before_start(cfg, use_cuda=use_cuda, ranks=cfg.world_size)
    if not cfg.train.run_dir:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(create_run_dir())))
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with hold_run_dir(run_dir):
        if resume:
            step = common_checkpoint(run_dir, groups)
            for g in range(groups):
                root = run_dir / f"replica{g}" / "checkpoints"
                set_latest(root, root / f"step_{step:08d}")
            print(f"plait: diloco: resuming {groups} replica groups from step {step}", flush=True)
        else:
            for g in range(groups):
                check_fresh_run_dir(run_dir / f"replica{g}")
        (run_dir / "config.toml").write_text(cfg.to_toml())
        for g in range(groups):
            (run_dir / f"replica{g}").mkdir(exist_ok=True)
        store = loopback_store(0, max(1800.0, cfg.diloco.quorum_timeout_s))
        return _watch(cfg, groups, store, resume)


def _start(cfg: Config, g: int, groups: int, store, resume: bool, generation: int):
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_group_main,
        args=(group_config(cfg, g).to_dict(), g, groups, store.port, resume, generation, os.getpid()),
        name=f"plait-diloco-group{g}",
    )
    proc.start()
    store.set(f"state/{g}", f"live:{generation}" if generation == 0 else f"starting:{generation}")
    return proc


def _watch(cfg: Config, groups: int, store, resume: bool) -> int:
    """Start the groups and wait for them; a failure stops the job or, fault tolerant, restarts
    the group."""
    ft = cfg.diloco.fault_tolerant
    previous = signal.signal(signal.SIGTERM, _terminate)
    procs: dict = {}
    generation = dict.fromkeys(range(groups), 0)
    lost: list[int] = []
    t0 = time.time()
    try:
        for g in range(groups):
            procs[g] = _start(cfg, g, groups, store, resume, 0)
        while procs:
            for g, proc in list(procs.items()):
                if proc.exitcode is None:
                    continue
                del procs[g]
                if proc.exitcode == 0:
                    store.set(f"state/{g}", f"done:{generation[g]}")
                    continue
                store.set(f"state/{g}", f"dead:{generation[g]}")
                code = proc.exitcode
                if not ft:
                    _stop(procs)
                    sys.stderr.write(
                        f"\nplait: diloco: replica group {g} failed after {time.time() - t0:.1f}s "
                        f"(exit code {code}); the other groups were stopped "
                        "(diloco.fault_tolerant = true keeps them going)\n"
                    )
                    return 1
                if generation[g] < cfg.diloco.max_rejoins:
                    generation[g] += 1
                    print(
                        f"plait: diloco: replica group {g} failed (exit code {code}); the others go on "
                        f"without it; restarting it (rejoin {generation[g]} of "
                        f"diloco.max_rejoins = {cfg.diloco.max_rejoins})",
                        flush=True,
                    )
                    procs[g] = _start(cfg, g, groups, store, False, generation[g])
                else:
                    lost.append(g)
                    print(
                        f"plait: diloco: replica group {g} failed (exit code {code}) after "
                        f"{generation[g]} rejoins; going on without it",
                        flush=True,
                    )
            if ft and len(lost) == groups:
                sys.stderr.write("plait: diloco: every replica group failed\n")
                return 1
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        _stop(procs)
        sys.stderr.write("plait: interrupted\n")
        return 130
    except _Terminated:
        _stop(procs)
        sys.stderr.write(
            f"plait: stopped by SIGTERM; continue with: plait train --resume {cfg.train.run_dir} "
            "(from the newest step every replica group saved)\n"
        )
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    if lost:
        print(f"plait: diloco: finished without replica groups {lost}", flush=True)
    return 0


class _Terminated(Exception):
    """SIGTERM reached the DiLoCo launcher."""


def _terminate(signum, frame):
    raise _Terminated


def _stop(procs: dict) -> None:
    for proc in procs.values():
        proc.kill()
    for proc in procs.values():
        proc.join(timeout=10)


def check_launchable(cfg: Config) -> None:
    """What the DiLoCo launcher cannot start (before any process starts)."""
    if cfg.ps.servers:
        raise ConfigError("diloco.inner_steps > 0 with ps.servers: a parameter server is not a replica group")
