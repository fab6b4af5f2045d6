"""How the trainer saves its checkpoints: synchronously, or asynchronously with the step going on
while the state is written (`train.checkpoint_async`).

Both run the phases of `plait.train.checkpoint`: `prepare_save` (every rank, on the training
groups: the pending step finished, the parameters checked finite, an empty `.tmp`), then
`write_state` (DCP writes each rank's shards), then `commit_save` (rank 0: fsync, manifest,
rename of the directory, replacement of `latest`, pruning). The synchronous `Checkpointer` runs
them in a row while every rank waits. The `AsyncCheckpointer`:

1. copies the rank's state (model, optimizer, sampler, RNG, schedule, compression residuals:
   what the synchronous save writes) into host buffers that are reused from save to save
   (`HostSnapshot`), and returns: that copy is all the step waits for;
2. on a writer thread of its own, writes the copy with DCP over a gloo process group of its own
   (never one of the training groups, so a slow writer cannot time out a training collective),
   then posts "written" (or the failure) under the checkpoint's step in the run's store;
3. rank 0's writer waits in the store until every rank has posted, and only then commits; it
   posts the verdict, which every rank reads before its next save (`wait`). A failed write on any
   rank removes the `.tmp` and leaves `latest` on the previous checkpoint, and the next save (or
   the end of the run) raises it as a CheckpointError on every rank.

At most one save is in flight: a save that finds the previous one unfinished waits for it (the
log says how long). A crash, SIGKILL or SIGTERM of any process before the commit leaves `latest`
on the previous checkpoint, intact: the commit is the last thing that happens, after every
rank's files are written. The figures of each save (blocking time, time waited for the previous
one, write time, host snapshot bytes, the process's resident memory and open files) go into the
metrics record of its step and into the run summary.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import threading
import time
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor

from plait import comm
from plait.errors import CheckpointError
from plait.mesh import Mesh
from plait.train.checkpoint import commit_save, prepare_save, save_checkpoint, write_state
from plait.train.hooks import named_hook

WRITE_HOOK = "PLAIT_CHECKPOINT_HOOK"  # "module:function", called on the writer before it writes
OK = "ok"


def _process_figures() -> dict:
    """This process's resident memory (bytes), open file descriptors (from /proc: Linux) and
    Python threads: what a leak across saves would grow."""
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        files = len(os.listdir("/proc/self/fd"))
    except (OSError, ValueError, IndexError):
        return {}
    return {"rss_bytes": rss, "open_files": files, "threads": threading.active_count()}


class HostSnapshot:
    """Host copies of a state dict's tensors, in buffers allocated at the first `take` and
    reused by every later one with the same structure (pinned when the state is on a GPU).
    Strings and other values are taken as they are (the state's JSON is new at every save)."""

    def __init__(self) -> None:
        self._signature: tuple | None = None
        self._buffers: dict | None = None

    def take(self, state: dict) -> dict:
        """The state with every tensor replaced by its host copy (the reused buffers)."""
        signature = tuple(_signature(state))
        if signature != self._signature:  # the first save, or the state's layout changed
            self._buffers, self._signature = _host_like(state), signature
        staged = _copy_into(state, self._buffers)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies are complete before the write
        return staged

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(t.numel() * t.element_size() for t in _tensors(self._buffers or {}))


def _local(v: ShardedTensor) -> list[torch.Tensor]:
    return [s.tensor for s in v.local_shards()]


def _tensors(v):
    if isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)
    elif isinstance(v, ShardedTensor):
        yield from _local(v)
    elif torch.is_tensor(v):
        yield v


def _signature(v, path: str = ""):
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _signature(x, f"{path}/{k}")
    elif isinstance(v, ShardedTensor):
        yield path, "sharded", tuple(v.size()), tuple((tuple(t.shape), t.dtype) for t in _local(v))
    elif torch.is_tensor(v):
        yield path, "tensor", tuple(v.shape), v.dtype


def _host_like(v):
    if isinstance(v, dict):
        return {k: _host_like(x) for k, x in v.items()}
    if isinstance(v, ShardedTensor):
        on_device = any(t.device.type != "cpu" for t in _local(v))
        return v.to("cpu") if on_device else copy.deepcopy(v)  # new storage, the same boxes
    if torch.is_tensor(v):
        return torch.empty(v.shape, dtype=v.dtype, pin_memory=v.device.type == "cuda")
    return v


def _copy_into(v, buf):
    if isinstance(v, dict):
        return {k: _copy_into(x, buf[k]) for k, x in v.items()}
    if isinstance(v, ShardedTensor):
        for src, dst in zip(_local(v), _local(buf), strict=True):
            dst.copy_(src, non_blocking=src.is_cuda)
        return buf
    if torch.is_tensor(v):
        return buf.copy_(v, non_blocking=v.is_cuda)
    return v


class Checkpointer:
    """Synchronous saves: every rank waits until the checkpoint is committed."""

    asynchronous = False

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.saves: list[dict] = []  # the figures of each save, in order

    def save(self, root: Path, step: int, engine, scheduler, sampler, keep: int) -> dict:
        """Save the checkpoint of `step`; returns its figures (for the step's metrics record)."""
        t0 = time.perf_counter()
        save_checkpoint(root, step, self.mesh, engine, scheduler, sampler, keep)
        blocked = time.perf_counter() - t0
        return self._record(step=step, blocking_s=blocked, waited_s=0.0, write_s=blocked, host_bytes=0)

    def _record(self, process: dict | None = None, **figures) -> dict:
        figures = {"async": self.asynchronous, **figures, **(process or _process_figures())}
        self.saves.append(figures)
        return figures

    def wait(self) -> float:
        """Wait until no save is in flight; the seconds waited (none for synchronous saves)."""
        return 0.0

    def close(self) -> None:
        """Give back what the checkpointer holds (its process group)."""

    def summary(self) -> dict:
        """The saves' figures for the run summary: how many, median and largest blocking time,
        median write time, time waited for a previous save, host snapshot bytes."""
        if not self.saves:
            return {"saves": 0, "async": self.asynchronous}
        blocking = [s["blocking_s"] for s in self.saves]
        writes = [s["write_s"] for s in self.saves if s.get("write_s") is not None]
        return {
            "saves": len(self.saves),
            "async": self.asynchronous,
            "blocking_s_median": statistics.median(blocking),
            "blocking_s_max": max(blocking),
            "write_s_median": statistics.median(writes) if writes else None,
            "waited_s_total": sum(s["waited_s"] for s in self.saves),
            "host_bytes": max(s["host_bytes"] for s in self.saves),
        }


class _Save:
    """One asynchronous save in flight."""

    def __init__(self, root: Path, step: int, tmp: Path, staged: dict, keep: int, hook) -> None:
        self.root, self.step, self.tmp, self.staged, self.keep = root, step, tmp, staged, keep
        self.hook = hook  # PLAIT_CHECKPOINT_HOOK's function (or None), called before the write
        self.thread: threading.Thread | None = None
        self.write_s: float | None = None  # to its files written, its post, and on rank 0 the commit


class AsyncCheckpointer(Checkpointer):
    """Saves that block only for a copy of the state to host memory; the writing, the
    agreement and the commit run on a background thread (see the module's docstring).

    Every rank constructs it at the same point (it creates a process group)."""

    asynchronous = True

    def __init__(self, mesh: Mesh, timeout_s: float) -> None:
        super().__init__(mesh)
        self.timeout = timedelta(seconds=timeout_s)
        # DCP's own collectives (the plan, the write results) run here, off the training groups
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        token = torch.zeros(16, dtype=torch.uint8, device=mesh.device)  # one prefix per run: the
        if mesh.is_rank0:  # store may outlive it
            token.copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
        comm.broadcast(token, mesh, "world")
        prefix = f"plait-checkpoint/{bytes(token.cpu().tolist()).hex()}/"
        # the run's store (the one torch.distributed rendezvoused through): a rank's "written"
        # is a key there, so agreeing needs no collective
        self.store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        self.snapshot = HostSnapshot()
        self.pending: _Save | None = None
        # ShardedTensor's deprecation (docs/zero.md), which DCP's planner would also print from
        # the writer thread: `warnings.catch_warnings` is not thread-safe, so a filter for the run
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        self.hook = named_hook(WRITE_HOOK)

    def save(self, root: Path, step: int, engine, scheduler, sampler, keep: int) -> dict:
        t0 = time.perf_counter()
        previous = self.pending.step if self.pending is not None else None
        waited = self.wait()
        if previous is not None and waited >= 0.05 and self.mesh.is_rank0:
            print(
                f"plait: the checkpoint of step {previous} was still being written: waited "
                f"{waited:.2f} s for it before saving step {step}",
                flush=True,
            )
        last_write = self.saves[-1].get("write_s") if self.saves else None
        process = _process_figures()  # with no writer running: what the process keeps between saves
        t1 = time.perf_counter()
        state, tmp, _ = prepare_save(Path(root), step, self.mesh, engine, scheduler, sampler)
        t2 = time.perf_counter()
        save = _Save(Path(root), step, tmp, self.snapshot.take(state), keep, self.hook)
        del state
        t3 = time.perf_counter()
        save.thread = threading.Thread(target=self._write, args=(save,), name=f"plait-ckpt-{step}")
        save.thread.daemon = True  # a failing rank exits at once; its unfinished save never commits
        self.pending = save
        save.thread.start()
        blocked = time.perf_counter() - t0
        figures = self._record(
            process,
            step=step,
            blocking_s=blocked,
            waited_s=waited,
            write_s=None,
            host_bytes=self.snapshot.nbytes,
        )
        figures.update(prepare_s=t2 - t1, snapshot_s=t3 - t2, previous_write_s=last_write)
        return figures

    def _key(self, step: int, who: str) -> str:
        return f"{step}/{who}"

    def _write(self, save: _Save) -> None:
        """The writer thread: this rank's files, its "written" in the store; on rank 0 the wait
        for every rank's and the commit, and the verdict in the store."""
        rank, t0 = dist.get_rank(), time.perf_counter()
        try:
            if save.hook is not None:
                save.hook(step=save.step, rank=rank, path=save.tmp)
            write_state(save.staged, save.tmp, self.group)
            status = OK
        except BaseException as exc:  # noqa: BLE001 - any failure is reported, never lost in the thread
            status = f"rank {rank}: {exc}"
        save.staged = None
        self.store.set(self._key(save.step, f"rank{rank}"), status)
        if rank == 0:
            self.store.set(self._key(save.step, "commit"), self._commit(save))
        save.write_s = time.perf_counter() - t0

    def _commit(self, save: _Save) -> str:
        """Rank 0: once every rank has posted, commit (or clean up); the verdict."""
        world = dist.get_world_size()
        keys = [self._key(save.step, f"rank{r}") for r in range(world)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception:  # noqa: BLE001 - a rank died or hangs in its write
            missing = [k for k in keys if not self.store.check([k])]
            shutil.rmtree(save.tmp, ignore_errors=True)
            never = ", ".join(missing)
            return f"the checkpoint of step {save.step} was abandoned: {never} never finished writing"
        failed = [s for s in (self.store.get(k).decode() for k in keys) if s != OK]
        if failed:
            shutil.rmtree(save.tmp, ignore_errors=True)  # every rank has stopped writing into it
            return failed[0]
        try:
            commit_save(save.root, save.step, world, save.keep)
        except CheckpointError as exc:
            return str(exc)
        return OK

    def wait(self) -> float:
        """Wait for the save in flight to be committed (every rank reads the verdict); raises
        its failure as a CheckpointError. Returns the seconds waited."""
        save = self.pending
        if save is None:
            return 0.0
        t0 = time.perf_counter()
        save.thread.join()
        key = self._key(save.step, "commit")
        self.store.wait([key], self.timeout)
        verdict = self.store.get(key).decode()
        self.pending = None
        self.saves[-1]["write_s"] = save.write_s
        if verdict != OK:
            raise CheckpointError(f"the asynchronous save of step {save.step} failed: {verdict}")
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.group is not None:  # dropped too: a group still referenced outlives its destruction
            dist.destroy_process_group(self.group)
            self.group = None


def make_checkpointer(mesh: Mesh, asynchronous: bool, timeout_s: float) -> Checkpointer:
    """The run's checkpointer: `AsyncCheckpointer` when `asynchronous`, else `Checkpointer`."""
    return AsyncCheckpointer(mesh, timeout_s) if asynchronous else Checkpointer(mesh)
