"""Disk offload of optimizer state (ZeRO-Infinity, Rajbhandari et al. 2021, §5.1 "infinity offload engine").

ZeRO-Infinity keeps the optimizer state of each partition on NVMe and pages it in only while that
partition is being updated, so the host holds the state of one partition at a time instead of all
of it. `DiskStateOptimizer` does that for any already-built ``torch.optim.Optimizer`` (AdamW,
fused or foreach, SGD with momentum, `plait.optim.LAMB` / `LARS` without a ``norm_reducer``):

    step():  for each chunk of `chunk_params` parameters (in param-group order)
                 read the chunk's state tensors from their files            (disk -> host)
                 run the inner optimizer's own step on just that chunk       (unchanged arithmetic)
                 write the new state back (tmp file + os.replace), drop it    (host -> disk)

Files: one directory per instance, ``<path>/rank<r>-<pid>-<random>/``, holding one raw little-endian
file per (parameter index, state key), e.g. ``p3.exp_avg.bin``: the tensor's bytes, nothing else;
shape, dtype and size are kept in memory and checked on every read. The parameter index is the
position in the inner optimizer's param groups, as in a torch optimizer state dict. 0-dim state
(AdamW's ``step`` counter) and non-tensor values stay in memory: a few bytes per parameter.

Why files rather than memory maps: a write to a memory-mapped sparse file on a full disk raises
SIGBUS and kills the process; ``write`` returns ENOSPC, which becomes an `OffloadError`. Every file
is written whole to ``<name>.tmp`` and renamed over the old one, so a failed write leaves either the
previous complete file or nothing, never a short file read as valid. After a failed write the
optimizer refuses to step (its state on disk no longer matches the parameters) until a checkpoint is
loaded with `load_state_dict`.

The arithmetic is the inner optimizer's own: element-wise optimizers (and LAMB/LARS, whose trust
ratios are per tensor) give bit-identical parameters to the plain optimizer. Optimizers with a
cross-parameter reduction (LAMB/LARS with a ``norm_reducer``) need every parameter in one step and
are refused. Pass ``.inner`` to LR schedulers (they require a torch Optimizer instance).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plait.combinations import refuse
from plait.errors import ConfigError, PlaitError

__all__ = ["DiskStateOptimizer", "OffloadError"]


class OffloadError(PlaitError):
    """Offloaded state that cannot be written or read: unwritable path, full disk, bad file."""


def _os_reason(err: OSError) -> str:
    return f"[Errno {err.errno}] {err.strerror}" if err.errno is not None else str(err)


def _write_file(path: Path, data: memoryview) -> None:
    """Write `data` to `path` completely, unbuffered, so that ENOSPC surfaces here and not later."""
    with open(path, "wb", buffering=0) as f:
        view, done = data.cast("B"), 0
        while done < len(view):
            done += f.write(view[done:])


def _tensor_bytes(t: Tensor) -> memoryview:
    """The raw bytes of `t` (any dtype, bf16 included), as a memoryview without a copy if contiguous."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class DiskStateOptimizer:
    """Wrap `optimizer` so that its state lives in files under `path` between steps.

    Args:
        optimizer: a constructed torch optimizer; any state it already holds is moved to disk.
        path: a directory (created if missing); each instance uses its own sub-directory in it.
        chunk_params: how many parameters are stepped (and their state held in memory) at once.
        rank: the process's rank, used in the sub-directory's name.
        fsync: fsync every state file before renaming it (survives power loss; slower).

    Memory between steps: the 0-dim state only. During a step: the state of one chunk. `state_dict`
    reads all of it into the returned dict (a checkpoint needs it); nothing else keeps it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        path: str | os.PathLike,
        chunk_params: int = 1,
        *,
        rank: int = 0,
        fsync: bool = False,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"DiskStateOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if getattr(optimizer, "norm_reducer", None) is not None:
            raise refuse("disk-lamb/lars", OffloadError, optimizer=type(optimizer).__name__.lower())
        if not isinstance(chunk_params, int) or chunk_params < 1:
            raise ConfigError(f"chunk_params must be an integer >= 1, got {chunk_params!r}")
        self.inner = optimizer
        self.chunk_params = chunk_params
        self.fsync = fsync
        self._meta: dict[int, dict[Any, tuple[str, torch.Size, torch.dtype, torch.device]]] = {}
        self._small: dict[int, dict[Any, Any]] = {}  # 0-dim tensors and non-tensor values
        self._failed: str | None = None
        self.dir = self._make_dir(Path(path), rank)
        # Removes the directory when closed, garbage-collected or at interpreter exit (atexit).
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        params = self._params()
        for idx, p in enumerate(params):
            if optimizer.state.get(p):
                self._offload(idx, p)

    @staticmethod
    def _make_dir(root: Path, rank: int) -> Path:
        """Create this instance's directory and prove it writable with a probe file."""
        target = None
        try:
            root.mkdir(parents=True, exist_ok=True)
            # mkdtemp adds a random suffix and creates the directory atomically: two instances in one
            # process, or a stale directory of an earlier run with this pid, never clash.
            target = Path(tempfile.mkdtemp(prefix=f"rank{rank}-{os.getpid()}-", dir=root))
            probe = target / ".probe"
            _write_file(probe, memoryview(b"plait"))
            probe.unlink()
        except OSError as err:
            if target is not None:
                shutil.rmtree(target, ignore_errors=True)
            raise OffloadError(
                f"offload path {root} is not writable: {_os_reason(err)}; "
                "set [offload] path to a writable directory"
            ) from err
        return target

    # -- pass-throughs -------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        name = type(self.inner).__name__
        return f"DiskStateOptimizer({name}, dir={str(self.dir)!r}, chunk_params={self.chunk_params})"

    # -- files ---------------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        """Parameters in state-dict order (group by group, each once), as torch numbers them."""
        seen: dict[int, Tensor] = {}
        for group in self.inner.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _file(self, idx: int, key: Any) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))
        return self.dir / f"p{idx}.{safe}.bin"

    def _offload(self, idx: int, p: Tensor) -> None:
        """Write the state of parameter `idx` to its files and drop it from memory."""
        state = self.inner.state.pop(p, None) or {}
        meta, small = {}, {}
        try:
            for key, value in state.items():
                if not isinstance(value, Tensor) or value.dim() == 0:
                    small[key] = value
                    continue
                path = self._file(idx, key)
                tmp = path.with_name(path.name + ".tmp")
                data = _tensor_bytes(value)
                try:
                    _write_file(tmp, data)
                    if self.fsync:
                        with open(tmp, "rb") as f:
                            os.fsync(f.fileno())
                    os.replace(tmp, path)
                except OSError as err:
                    tmp.unlink(missing_ok=True)
                    raise OffloadError(
                        f"could not write optimizer state to {path} ({data.nbytes} bytes needed): "
                        f"{_os_reason(err)}; free space or choose another [offload] path"
                    ) from err
                meta[key] = (path.name, value.shape, value.dtype, value.device)
        except OffloadError as err:
            self._failed = str(err)
            raise
        self._meta[idx], self._small[idx] = meta, small

    def _load(self, idx: int, p: Tensor) -> None:
        """Read the state of parameter `idx` from its files into the inner optimizer."""
        if idx not in self._meta:
            return
        state = dict(self._small[idx])
        for key, (name, shape, dtype, device) in self._meta[idx].items():
            path = self.dir / name
            t = torch.empty(shape, dtype=dtype)
            want = t.numel() * t.element_size()
            try:
                with open(path, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != want:
                        raise OffloadError(f"optimizer state file {path} has {size} bytes, expected {want}")
                    view, done = memoryview(t.reshape(-1).view(torch.uint8).numpy()), 0
                    while done < want:
                        n = f.readinto(view[done:])
                        if not n:
                            raise OffloadError(
                                f"optimizer state file {path} ended after {done} of {want} bytes"
                            )
                        done += n
            except OSError as err:
                raise OffloadError(f"could not read optimizer state from {path}: {_os_reason(err)}") from err
            state[key] = t if device.type == "cpu" else t.to(device)
        self.inner.state[p] = state

    def _check_usable(self) -> None:
        if not self._finalizer.alive:
            raise OffloadError(f"DiskStateOptimizer over {self.dir} is closed")
        if self._failed is not None:
            raise OffloadError(
                f"optimizer state was lost in an earlier step ({self._failed}); "
                "load a checkpoint with load_state_dict() before stepping again"
            )

    # -- step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the inner optimizer, streamed chunk by chunk through the state files.

        Parameters without a gradient are skipped (as every torch optimizer skips them). The closure,
        if any, is evaluated once, before the first chunk.
        """
        self._check_usable()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        indexed = [(i, p) for i, p in enumerate(self._params()) if p.grad is not None]
        for start in range(0, len(indexed), self.chunk_params):
            self._step_chunk(indexed[start : start + self.chunk_params])
        return loss

    def _step_chunk(self, chunk: list[tuple[int, Tensor]]) -> None:
        members = {id(p) for _, p in chunk}
        groups = self.inner.param_groups
        restricted = []
        for group in groups:
            keep = [k for k, p in enumerate(group["params"]) if id(p) in members]
            if not keep:
                continue
            # A copy of the group with its hyperparameters, restricted to the chunk's parameters.
            sub = dict(group)
            sub["params"] = [group["params"][k] for k in keep]
            if "param_names" in group:
                sub["param_names"] = [group["param_names"][k] for k in keep]
            restricted.append(sub)
        try:
            for idx, p in chunk:
                self._load(idx, p)
            self.inner.param_groups = restricted
            self.inner.step()
        except BaseException:
            for _, p in chunk:  # never leave a half-stepped chunk's state in memory
                self.inner.state.pop(p, None)
            raise
        finally:
            self.inner.param_groups = groups
        for n, (idx, p) in enumerate(chunk):
            try:
                self._offload(idx, p)
            except OffloadError:
                for _, q in chunk[n + 1 :]:
                    self.inner.state.pop(q, None)
                raise

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with every state tensor read back from disk."""
        self._check_usable()
        params = self._params()
        for idx, p in enumerate(params):
            self._load(idx, p)
        try:
            return self.inner.state_dict()
        finally:
            for p in params:
                self.inner.state.pop(p, None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-style optimizer state dict and write its state to the files.

        Also clears the error left by a failed write: the loaded state replaces whatever was lost.
        """
        if not self._finalizer.alive:
            raise OffloadError(f"DiskStateOptimizer over {self.dir} is closed")
        self.inner.load_state_dict(state_dict)
        for entry in os.scandir(self.dir):
            os.unlink(entry.path)
        self._meta.clear()
        self._small.clear()
        self._failed = None
        for idx, p in enumerate(self._params()):
            if self.inner.state.get(p):
                self._offload(idx, p)
            else:
                self.inner.state.pop(p, None)

    # -- accounting and cleanup ----------------------------------------------------------------------

    def resident_state_bytes(self) -> int:
        """Bytes of optimizer-state tensors held in memory, counted from their storages."""
        seen: dict[tuple[str, int], int] = {}
        values = [v for s in self.inner.state.values() for v in s.values()]
        values += [v for s in self._small.values() for v in s.values()]
        for v in values:
            if isinstance(v, Tensor):
                storage = v.untyped_storage()
                seen[(str(v.device), storage.data_ptr())] = storage.nbytes()
        return sum(seen.values())

    def disk_state_bytes(self) -> int:
        """Bytes of the state files in this instance's directory."""
        if not self._finalizer.alive:
            return 0
        return sum(e.stat().st_size for e in os.scandir(self.dir) if e.is_file())

    def close(self) -> None:
        """Remove the state directory and its files. Safe to call more than once."""
        self._finalizer()
        self._meta.clear()
        self._small.clear()

    def __enter__(self) -> DiskStateOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
