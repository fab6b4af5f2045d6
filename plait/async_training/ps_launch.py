"""Start the parameter servers and workers of `plait train` with `ps.servers > 0`, and watch them.

Transport (docs/parameter-server.md): gradients and parameters travel over
`torch.distributed.rpc` (TensorPipe): a push or pull is one message to one server, answered when
the server has it, and a server answers pulls while it applies pushes, from a thread pool. The
control plane is a c10d `TCPStore` hosted by this (launching) process: commit records of pushes,
workers marked dead or done, the servers' partial gradient norms. It lives as long as the job,
whoever dies.

This process watches its children itself (a `torch.multiprocessing` spawn context), not with
torch's elastic agent, which stops every process when one fails: here a worker killed under
ssp or async is marked dead in the store and the others finish. Under bsp a dead worker stops the
job with one line naming it (every clock needs every worker), as does a dead server (it holds
the only copy of its key range; `--resume` continues from the last server checkpoint).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from plait.async_training.ps_checkpoint import choose_checkpoint
from plait.async_training.ps_report import finish_run, truncate_logs


def _child_env() -> None:
    import warnings

    warnings.filterwarnings("ignore", message=".*Backend.*as a ProcessGroup.*")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _filter_stderr()


# TensorPipe logs a warning in every process whose peer leaves (a finished worker, a server at
# the end, a dead worker or server that the launcher reports itself): noise in every run, and
# before the launcher's line when a server dies. Its C++ log level is read when torch loads,
# before this process existed, so the lines are filtered instead.
_PEER_LEFT = (b"tensorpipe_agent.cpp", b"encountered error when reading incoming re")  # request, response
_STDERR: dict = {}


def _filter_stderr() -> None:
    """Route this process's fd 2 (C++ and Python alike) through a thread that drops TensorPipe's
    peer-left warnings and passes every other line on."""
    import threading

    original = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        with os.fdopen(read, "rb", buffering=0) as src:
            for line in iter(src.readline, b""):
                if not all(mark in line for mark in _PEER_LEFT):
                    os.write(original, line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    _STDERR.update(original=original, thread=thread)


def _restore_stderr() -> None:
    """Give fd 2 back and let the filter pass on what it holds (before os._exit)."""
    if not _STDERR:
        return
    sys.stderr.flush()
    os.dup2(_STDERR["original"], 2)  # closes the pipe's last write end: the pump sees EOF
    _STDERR["thread"].join(timeout=2.0)


def _rpc_init(name: str, rank: int, world: int, rpc_port: int, timeout_s: float) -> None:
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{rpc_port}",
        rpc_timeout=timeout_s,
        num_worker_threads=max(16, 4 * world),  # pulls may wait (bsp/ssp) on a handler thread
        _transports=["uv"],
        _channels=["basic"],  # tensors travel on the CPU: the servers hold them there
    )
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)


def _store(port: int, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _unfiltered_on_error(entry):
    """A child that raises prints its traceback (multiprocessing does) on the real stderr: the
    filter's thread could not pass it on before the process exits.

    A connection lost to a peer (a worker's pull or push to a server that died) first waits for
    the launcher, which sees the dead server, stops the job with its one line and kills this
    process: the traceback would only come before that line and say less. It is printed if the
    launcher has not done so within _LOST_PEER_GRACE_S (or is gone itself)."""

    @functools.wraps(entry)
    def run(*args):
        try:
            entry(*args)
        except BaseException as exc:
            if _lost_peer(exc):
                _await_launcher(_LOST_PEER_GRACE_S)
            _restore_stderr()
            raise

    return run


_LOST_PEER_GRACE_S = 10.0


def _lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is TensorPipe's report of a connection the peer closed or reset."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("ECONNRESET", "EPIPE", "EOF: end of file", "ECONNREFUSED")
    )


def _await_launcher(limit_s: float) -> None:
    parent, deadline = os.getppid(), time.monotonic() + limit_s
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.05)


@_unfiltered_on_error
def _server_entry(cfg_dict: dict, index: int, store_port: int, rpc_port: int, run_dir: str, start: int):
    from plait.async_training import param_server as ps
    from plait.models import GPT
    from plait.train.config import model_config

    _child_env()
    cfg = _config(cfg_dict)
    store = _store(store_port, cfg.comm.timeout_s)
    torch.manual_seed(cfg.train.seed)  # the workers' initialisation: this range of it
    params = list(GPT(model_config(cfg)).parameters())
    lo, hi = ps.key_ranges([p.numel() for p in params], cfg.ps.servers)[index]
    shard = ps.Shard(cfg, index, params[lo:hi], store, Path(run_dir), start)
    if start:
        shard.load(Path(run_dir) / "ps_checkpoints" / f"step_{start}" / f"server{index}.pt")
    world = cfg.ps.servers + cfg.parallel.dp
    last = min(cfg.train.steps, cfg.train.stop_at) if cfg.train.stop_at else cfg.train.steps
    with ps.serving(shard):
        _rpc_init(f"server{index}", index, world, rpc_port, cfg.comm.timeout_s)
        ps.serve(shard, last)
        _leave()


@_unfiltered_on_error
def _worker_entry(cfg_dict: dict, w: int, store_port: int, rpc_port: int, run_dir: str, start: int):
    from plait.async_training.ps_worker import work

    _child_env()
    cfg = _config(cfg_dict)
    store = _store(store_port, cfg.comm.timeout_s)
    world = cfg.ps.servers + cfg.parallel.dp
    _rpc_init(f"worker{w}", cfg.ps.servers + w, world, rpc_port, cfg.comm.timeout_s)
    device = torch.device("cuda", w % torch.cuda.device_count()) if _uses_cuda(cfg) else torch.device("cpu")
    work(cfg, w, store, Path(run_dir), start, device)
    _leave()


def _uses_cuda(cfg) -> bool:
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def _config(cfg_dict: dict):
    """The launcher's configuration (its corpus check made there: not again in every process)."""
    from plait.train.config import config_from_dict

    return config_from_dict(cfg_dict, check_data=False)


def _leave() -> None:
    """Leave without the RPC barrier of a graceful shutdown: a dead peer would hold it forever."""
    import torch.distributed.rpc as rpc

    rpc.shutdown(graceful=False)
    sys.stdout.flush()
    _restore_stderr()
    os._exit(0)


def resume_clock(cfg, run_dir: Path) -> tuple[int, str | None]:
    """The newest clock for which every server saved a shard that verifies (`ps_checkpoint`), and
    a line naming the newer ones skipped as damaged (None when none was)."""
    from plait.async_training.param_server import key_ranges
    from plait.models import GPT
    from plait.train.config import model_config

    with torch.device("meta"):  # the sizes of each server's tensors: no memory, no initialisation
        numels = [p.numel() for p in GPT(model_config(cfg)).parameters()]
    ranges = key_ranges(numels, cfg.ps.servers)
    return choose_checkpoint(run_dir, cfg.ps.servers, [numels[lo:hi] for lo, hi in ranges])


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def launch_ps(cfg, resume: bool = False) -> int:
    """Claim the run directory, start cfg.ps.servers servers and cfg.parallel.dp workers, and
    watch them until they finish; returns the exit code."""
    from plait.comm.ports import free_port, listen_on_loopback, loopback_store
    from plait.train.rundir import claim_run, hold_run_dir

    if resume:
        run_dir = Path(cfg.train.run_dir)
        held = hold_run_dir(run_dir)
    else:
        if cfg.train.run_dir:
            from plait.train.preflight import check_run_dir

            check_run_dir(cfg.train.run_dir)
        cfg, held = claim_run(cfg, False)
        run_dir = Path(cfg.train.run_dir)
    with held:
        start, note = resume_clock(cfg, run_dir) if resume else (0, None)
        if note:
            print(note, flush=True)
        (run_dir / "ps").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
        truncate_logs(run_dir, start)
        port, rpc_port = free_port(), free_port()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # one machine: the stores (this process hosts both, the RPC's too: every child joins it as
        # a client) and TensorPipe's sockets on 127.0.0.1 only (plait.comm.ports)
        listen_on_loopback()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(True)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # TensorPipe's notes on closed peers
        # On the CPU the children are forked from this process, which has imported torch and
        # plait and started no thread yet (the store comes after): a spawn would import torch
        # again in each, seconds apiece. CUDA cannot be forked into: spawn there.
        ctx = torch.multiprocessing.get_context("spawn" if _uses_cuda(cfg) else "fork")
        args = (cfg.to_dict(), port, rpc_port, str(run_dir), start)
        procs = {}
        for s in range(cfg.ps.servers):
            procs[("server", s)] = ctx.Process(
                target=_server_entry, args=(args[0], s, *args[1:]), daemon=True
            )
        for w in range(cfg.parallel.dp):
            procs[("worker", w)] = ctx.Process(
                target=_worker_entry, args=(args[0], w, *args[1:]), daemon=True
            )
        print(
            f"plait: parameter server: {cfg.ps.servers} server(s), {cfg.parallel.dp} worker(s), "
            f"{cfg.ps.consistency}"
            + (f" (staleness {cfg.ps.staleness})" if cfg.ps.consistency == "ssp" else "")
            + f", server optimizer {cfg.ps.server_optimizer} | run dir {run_dir}"
            + (f" | resumed at step {start}" if start else ""),
            flush=True,
        )
        t0 = time.time()
        for p in procs.values():
            p.start()
        store = loopback_store(port, wait_for_workers=False)
        rpc_store = loopback_store(rpc_port, multi_tenant=True, wait_for_workers=False)  # noqa: F841 (held)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            code, dead = _watch(cfg, procs, store)
        except KeyboardInterrupt:
            _stop_all(procs)
            sys.stderr.write("plait: interrupted\n")
            return 130
        except _Terminated:
            _stop_all(procs)
            sys.stderr.write(
                "plait: stopped by SIGTERM; continue from the servers' last checkpoint with: "
                f"plait train --resume {run_dir}\n"
            )
            return 143
        finally:
            signal.signal(signal.SIGTERM, previous)
        finish_run(cfg, run_dir, start, dead, time.time() - t0, ok=code == 0)
        return code


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    """A scheduler's SIGTERM: stop the servers and workers (they would outlive this process) and
    leave; the servers' checkpoints of every checkpoint_every clocks are what a resume takes."""
    raise _Terminated


def _watch(cfg, procs: dict, store) -> tuple[int, list[int]]:
    """Poll the children every 0.1 s until all have exited; handle a failure as the module
    docstring says. Returns (exit code, the workers that died)."""
    dead: list[int] = []
    reported: set = set()
    while True:
        running = False
        for (role, i), p in procs.items():
            code = p.exitcode
            if code is None:
                running = True
                continue
            if code == 0 or (role, i) in reported:
                continue
            reported.add((role, i))
            if role == "server":
                _stop_all(procs)
                sys.stderr.write(
                    f"plait: parameter server {i} (pid {p.pid}) died ({_how(code)}): it held the only copy "
                    f"of its key range, so the job was stopped; continue from the last server checkpoint "
                    f"with: plait train --resume {cfg.train.run_dir}\n"
                )
                return 1, dead
            if cfg.ps.consistency == "bsp":
                _stop_all(procs)
                sys.stderr.write(
                    f"plait: worker {i} (pid {p.pid}) died ({_how(code)}); under ps.consistency = 'bsp' "
                    "every clock needs every worker, so the job was stopped (ssp or async go on without it)\n"
                )
                return 1, dead + [i]
            dead.append(i)
            store.set(f"ps/dead/{i}", "1")  # the servers drop it from the clocks and the bound
            left = cfg.parallel.dp - len(dead)
            sys.stderr.write(
                f"plait: worker {i} (pid {p.pid}) died ({_how(code)}); its uncommitted push is discarded "
                f"and the other {left} worker(s) go on ({cfg.ps.consistency})\n"
            )
            if not left:
                _stop_all(procs)
                sys.stderr.write("plait: every worker died; the job was stopped\n")
                return 1, dead
        if not running:
            return 0, dead
        time.sleep(0.1)


def _stop_all(procs: dict) -> None:
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
    for p in procs.values():
        p.join(timeout=10)


def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
