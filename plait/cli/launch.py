"""`plait launch [--nproc N] SCRIPT.py [ARGS ...]`: run a user's script on N local ranks with torch's
elastic launcher (what `torchrun --standalone --nproc-per-node N` does): each rank gets RANK,
WORLD_SIZE, LOCAL_RANK and the rendezvous address in its environment, which `plait.parallelize`
reads.

Unlike `torchrun --standalone`, nothing listens off the loopback interface: the rendezvous store
is hosted here on 127.0.0.1 (the agent joins it as a client), the store the agent shares with the
ranks is too, and gloo's sockets follow GLOO_SOCKET_IFNAME (`plait.comm.ports`). Ctrl-C and
SIGTERM stop the ranks and end in one line, with exit code 130 or 143.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.run import get_args_parser, run

from plait.cli.args import parse_or_help
from plait.comm.ports import LOOPBACK, listen_on_loopback, loopback_store
from plait.errors import ConfigError

NPROC_PER_CPU = 4  # ranks per CPU core at most: more only time-share the cores


def max_nproc() -> int:
    """The most ranks `plait launch` starts on this machine: NPROC_PER_CPU per CPU core."""
    return NPROC_PER_CPU * (os.cpu_count() or 1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait launch",
        description="Run SCRIPT on N local processes (ranks), as torchrun --standalone does; a script "
        "written with plait.parallelize trains on all of them (docs/your-model.md).",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help=f"processes (ranks) on this machine (default 1; at most {NPROC_PER_CPU} per CPU core)",
    )
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


@contextlib.contextmanager
def _agent_store_on_loopback():
    """The store that the agent hosts and shares with the ranks (torch creates it on every
    interface) is created on 127.0.0.1 instead, for the length of the launch."""
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    original = getattr(handler, "_create_tcp_store_server", None)
    if original is None:  # another torch: the ranks' rank 0 hosts a store of its own instead
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        yield
        return
    handler._create_tcp_store_server = lambda self, addr, port: loopback_store(port, multi_tenant=True)
    try:
        yield
    finally:
        handler._create_tcp_store_server = original


def main(argv: list[str]) -> int:
    args = parse_or_help(_parser(), argv)
    if isinstance(args, int):  # --help, or argparse's own usage error (exit code 2)
        return args
    if not 1 <= args.nproc <= max_nproc():
        raise ConfigError(
            f"--nproc must be between 1 and {max_nproc()} ({NPROC_PER_CPU} per CPU core of this "
            f"machine), got {args.nproc}"
        )
    if not Path(args.script).is_file():
        raise ConfigError(f"plait launch: no script {args.script!r}")
    listen_on_loopback()  # gloo's sockets, in the ranks this starts
    store = loopback_store()  # the rendezvous store; the agent joins it as a client
    torchrun = get_args_parser().parse_args(
        [
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(args.nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{LOOPBACK}:{store.port}",
            "--rdzv-id",
            f"plait-{uuid.uuid4().hex[:8]}",
            "--rdzv-conf",
            "is_host=0",
            "--local-addr",
            LOOPBACK,
            args.script,
            *args.args,
        ]
    )
    # the agent logs its shutdown on a signal at WARNING; plait says it in one line
    # (each module's logger has a level of its own)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with _agent_store_on_loopback():
            run(torchrun)
    except ChildFailedError as exc:  # the ranks' tracebacks were printed as they failed
        codes = {f.exitcode for f in exc.failures.values()}
        for sig in (signal.SIGINT, signal.SIGTERM):  # the ranks got it too (a process group's)
            if codes <= {-int(sig), 128 + int(sig)}:
                return _stopped(sig)
        ranks = ", ".join(str(r) for r in sorted(exc.failures))
        print(f"plait launch: {args.script} failed on rank(s) {ranks}", file=sys.stderr)
        return 1
    except SignalException as exc:  # the agent got it, and stopped the ranks
        return _stopped(signal.Signals(exc.sigval))
    return 0


def _stopped(sig: signal.Signals) -> int:
    what = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    print(f"plait launch: {what}; the ranks were stopped", file=sys.stderr)
    return 128 + int(sig)
