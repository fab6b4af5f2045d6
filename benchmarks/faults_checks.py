"""Small observers the fault probes of benchmarks/faults.py call from their shell commands.

Standard library only (no torch: each call is a fraction of a second). The probes' shell prelude
wraps each as a function of the same name, e.g. `wait_step run 12`:

* `wait_step RUN STEP [SECONDS]`: wait until RUN/metrics.jsonl holds a record of STEP or later
  (the run logs every step: `--train.log_every 1`); exit 1 after SECONDS (default 90).
* `wait_file PATH [SECONDS]`: wait until PATH exists and is not empty.
* `last_step RUN`: the highest step in RUN/metrics.jsonl (0 when none).
* `latest_step RUN`: the step of the checkpoint RUN/checkpoints/latest names (-1 when unreadable).
* `unique_steps RUN`: exit 1 when a step appears twice in RUN/metrics.jsonl (two runs wrote it).
* `record RUN STEP KEY`: the value of KEY in the record of STEP.
* `listening`: the TCP sockets listening in the processes of this probe (those whose environment
  holds its PLAIT_PROBE token), one `ADDRESS:PORT` a line, as `ss -ltnp` would list them.
* `probe_pids TOKEN`: the processes whose environment holds PLAIT_PROBE=TOKEN (used by faults.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import sys
import time
from pathlib import Path


def _records(run: str) -> list[dict]:
    out = []
    try:
        text = (Path(run) / "metrics.jsonl").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def last_step(run: str) -> int:
    return max((r["step"] for r in _records(run)), default=0)


def latest_step(run: str) -> int:
    try:
        name = (Path(run) / "checkpoints" / "latest").read_text().strip()
        return int(re.fullmatch(r"step_(\d+)", name).group(1))
    except (OSError, ValueError, AttributeError):
        return -1


def wait_step(run: str, step: str, seconds: str = "90") -> int:
    deadline = time.monotonic() + float(seconds)
    while last_step(run) < int(step):
        if time.monotonic() > deadline:
            print(f"wait_step: {run} did not reach step {step} in {seconds} s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


def wait_file(path: str, seconds: str = "90") -> int:
    deadline = time.monotonic() + float(seconds)
    while not (os.path.isfile(path) and os.path.getsize(path) > 0):
        if time.monotonic() > deadline:
            print(f"wait_file: no {path} after {seconds} s", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


def unique_steps(run: str) -> int:
    steps = [r["step"] for r in _records(run)]
    twice = sorted({s for s in steps if steps.count(s) > 1})
    print(
        f"steps {min(steps, default=0)}-{max(steps, default=0)}"
        + (f", twice: {twice}" if twice else ", each once")
    )
    return 1 if twice else 0


def record(run: str, step: str, key: str) -> int:
    for r in _records(run):
        if r["step"] == int(step):
            print(r.get(key))
            return 0
    print("none")
    return 1


def probe_pids(token: str) -> list[int]:
    """Processes (other than this one) whose environment holds PLAIT_PROBE=token."""
    needle = f"PLAIT_PROBE={token}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read() + b"\0"
            with open(f"/proc/{entry}/stat", "rb") as fh:
                zombie = fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if needle in env and not zombie:
            out.append(int(entry))
    return out


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:  # four little-endian 32-bit words
        ip = (
            "["
            + socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            + "]"
        )
    return f"{ip}:{int(port, 16)}"


def listening() -> int:
    """The listening TCP sockets of this probe's processes, by the socket inodes of their fds."""
    inodes = set()
    for pid in probe_pids(os.environ["PLAIT_PROBE"]):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                found.add(_address(fields[1]))
    for addr in sorted(found):
        print(addr)
    return 0


def main(argv: list[str]) -> int:
    name, *args = argv
    if name in ("last_step", "latest_step"):
        print(globals()[name](*args))
        return 0
    if name == "probe_pids":
        print(" ".join(map(str, probe_pids(*args))))
        return 0
    return globals()[name](*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
