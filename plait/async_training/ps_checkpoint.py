"""The parameter servers' checkpoints: saved with a manifest, loaded as plain tensors, exported.

Layout under `<run_dir>/ps_checkpoints/`:

    step_N/
        server0.pt ... server{S-1}.pt   each server's key range, optimizer state and clock
        MANIFEST.json                   the step, S, and the size and SHA-256 of every shard file

Each server writes its shard under a temporary name and renames it; the last of the S servers to
save step N (a counter in the control-plane store) then writes the step's manifest in the format
of the trainer's checkpoints (`plait.train.checkpoint.write_manifest`, checked by
`verify_checkpoint`); the launcher writes the last step's again once every server has exited
(a step saved twice, at a checkpoint clock that is also the last, is then sealed from its final
shards). A step without a manifest was not saved by every server.

Nothing in a run directory is unpickled: a shard is read with `torch.load(weights_only=True)`,
which rebuilds tensors and plain containers and refuses any other object, so a crafted file runs
no code. `choose_checkpoint` picks what `plait train --resume` loads: the newest step whose
manifest verifies and whose shards load as plain tensors of the expected shape; a damaged newer
one (truncated, corrupted, crafted, without a manifest) is skipped with one line saying so.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path

import torch

from plait.errors import CheckpointError, ConfigError
from plait.train.checkpoint import MANIFEST, verify_checkpoint, write_manifest

ROOT = "ps_checkpoints"
_KEYS = {"clock", "updates", "servers", "params", "optimizer"}


def shard_name(index: int) -> str:
    return f"server{index}.pt"


def step_dir(run_dir: str | Path, clock: int) -> Path:
    return Path(run_dir) / ROOT / f"step_{clock}"


def save_shard(run_dir: Path, index: int, servers: int, state: dict, store, keep: int) -> Path:
    """Write server `index`'s `state` (of clock state["clock"]) to step_N/serverS.pt through a
    temporary name; the last server of the step writes its manifest. Keeps this server's `keep`
    newest shards (the last server out of a step directory removes it)."""
    clock = state["clock"]
    path = step_dir(run_dir, clock) / shard_name(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    # a step may be saved twice (a checkpoint clock that is also the last): every round of S
    # saves rewrites the manifest, after the round's last shard is in place; the launcher seals
    # the last step again once every server has exited (`seal`)
    if store is None or store.add(f"ps/saved/{clock}", 1) % servers == 0:
        seal(run_dir, clock, servers)
    _prune(run_dir, index, keep)
    return path


def seal(run_dir: Path, clock: int, servers: int) -> bool:
    """Write step `clock`'s manifest from the shards on disk, if every server's is there."""
    d = step_dir(run_dir, clock)
    names = [shard_name(s) for s in range(servers)]
    if not all((d / n).is_file() for n in names):  # an older step pruned meanwhile
        return False
    write_manifest(d, names, step=clock, servers=servers)
    return True


def steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(clock, directory) of every step_N under ps_checkpoints/, newest first."""
    root = Path(run_dir) / ROOT
    found = []
    for d in root.glob("step_*"):
        if d.is_dir() and (m := re.fullmatch(r"step_(\d+)", d.name)):
            found.append((int(m.group(1)), d))
    return sorted(found, reverse=True)


def _prune(run_dir: Path, index: int, keep: int) -> None:
    mine = [(c, d) for c, d in steps(run_dir) if (d / shard_name(index)).exists()]
    for _, d in mine[keep:]:
        (d / shard_name(index)).unlink(missing_ok=True)
        if not any(d.glob("server*.pt")):  # the last server out removes the step
            (d / MANIFEST).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                d.rmdir()


def load_shard(path: Path, numels: list[int] | None = None, mmap: bool = False) -> dict:
    """A shard as saved by `save_shard`, read as plain tensors and containers only; with `numels`,
    its parameters must have those sizes. Raises CheckpointError naming the file otherwise.
    `mmap`: map the tensors' bytes instead of reading them (a check that only looks)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:  # an object other than tensors and plain containers
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it names {found.group(1)}" if found else str(exc).strip().splitlines()[0][:160]
        raise CheckpointError(
            f"{path} holds more than tensors and plain containers ({what}); it was not run: "
            "a shard is read with torch.load(weights_only=True)"
        ) from None
    except Exception as exc:  # RuntimeError (a cut or corrupted zip), EOFError, OSError
        text = str(exc).strip()
        why = text.splitlines()[0].split(". ")[0][:160] if text else type(exc).__name__
        raise CheckpointError(f"{path} is unreadable ({why}): it is damaged") from None
    if (
        not isinstance(state, dict)
        or not _KEYS <= set(state)
        or not isinstance(state["params"], list)
        or not all(torch.is_tensor(t) for t in state["params"])
    ):
        raise CheckpointError(f"{path} is not a parameter-server shard (no {', '.join(sorted(_KEYS))})")
    if numels is not None and [t.numel() for t in state["params"]] != numels:
        raise CheckpointError(f"{path} holds other tensors than this server's key range: another model")
    return state


def verify_step(d: Path, servers: int | None, numels: list[list[int]] | None = None) -> dict:
    """Check step directory `d`: its manifest (sizes, checksums), its server count (None: the
    manifest's), and that each shard loads as plain tensors. Returns the manifest; CheckpointError
    (ConfigError for another server count) otherwise."""
    manifest = verify_checkpoint(d)
    saved = manifest.get("servers")
    if not isinstance(saved, int) or saved < 1:
        raise CheckpointError(f"{d / MANIFEST} names no server count: not a parameter-server checkpoint")
    servers = saved if servers is None else servers
    if saved != servers:
        raise ConfigError(
            f"--resume: {d} holds {saved} server shards (key ranges) and ps.servers = {servers}; "
            f"resume with --ps.servers {saved}"
        )
    for s in range(servers):
        load_shard(d / shard_name(s), numels[s] if numels else None, mmap=True)
    return manifest


def choose_checkpoint(run_dir: Path, servers: int | None, numels: list[list[int]] | None = None):
    """(clock, note) of the newest step every server saved that verifies; the note (None when it is
    the newest step) says which newer ones failed and why. CheckpointError when none verifies."""
    damaged = []
    for clock, d in steps(run_dir):
        try:
            verify_step(d, servers, numels)
        except CheckpointError as exc:
            damaged.append(str(exc))
            continue
        note = None
        if damaged:
            note = (
                f"plait: {'; '.join(damaged)}; resuming from {d.name}, the newest parameter-server "
                "checkpoint that verifies"
            )
        return clock, note
    root = Path(run_dir) / ROOT
    if not damaged:
        raise CheckpointError(f"{root} holds no complete parameter-server checkpoint")
    raise CheckpointError(f"no parameter-server checkpoint in {root} verifies: {'; '.join(damaged)}")


def read_params(run_dir: Path, clock: int, servers: int | None = None) -> list[torch.Tensor]:
    """The model's parameters (registration order, ties once) saved by the servers at `clock`,
    after the step's manifest is verified."""
    d = step_dir(run_dir, clock)
    servers = verify_step(d, servers)["servers"]
    return [v for s in range(servers) for v in load_shard(d / shard_name(s))["params"]]
