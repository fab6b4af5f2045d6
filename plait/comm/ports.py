"""Ports and stores that this machine's processes host for one another: a free port, and a c10d
`TCPStore` that listens on the loopback interface only.

c10d's TCPStore server binds every interface (`*:port`, `[::]:port`) whatever host name it is
given; handed a socket that is already listening (`master_listen_fd`), it serves on that socket
instead. A run on one machine hosts its stores that way, on 127.0.0.1, so that nothing it
serves is reachable from the network. Gloo (and TensorPipe, for the parameter server's RPC)
listen on the address of the interface named by `GLOO_SOCKET_IFNAME` (`TP_SOCKET_IFNAME`), by
default the one the host name resolves to: a single-node run names the loopback one.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

LOOPBACK = "127.0.0.1"
# Gloo's and TensorPipe's listening sockets follow these (NCCL's bootstrap follows NCCL_SOCKET_IFNAME,
# left to the user: its transport is chosen by the same variable).
_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def free_port() -> int:
    """A port the operating system has just found free on 127.0.0.1 (another process may still
    take it before the caller binds it; the launchers that use it bind at once)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_store(port: int = 0, timeout_s: float = 300.0, **kwargs):
    """A TCPStore server listening on 127.0.0.1:`port` only (0: a free port, read back from
    `.port`). `kwargs` go to TCPStore (world_size, wait_for_workers, multi_tenant)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    # The store owns the descriptor from here (libuv closes it with the server), so the
    # socket object must not close it when it is garbage-collected.
    return TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        master_listen_fd=sock.detach(),
        use_libuv=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def listen_on_loopback(env: dict | os._Environ = os.environ) -> None:
    """Make gloo and TensorPipe, in this process and the ranks it starts, listen on the loopback
    interface (unless the user named an interface): for runs on one machine only."""
    name = loopback_interface()
    for key in _IFNAME_ENV:
        env.setdefault(key, name)


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 ('lo' on Linux)."""
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"
