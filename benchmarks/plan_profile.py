"""What each synchronous collective costs inside a `plait train` step, against the calibration.

The planner prices a collective by the α-β that `plait plan --calibrate` fits to collectives
timed right after a barrier (`plait.planner.calibrate`). In a training step a collective comes
after compute instead: this script measures what it costs there. For each layout it runs a short
`plait train` whose ranks time every synchronous collective they issue through `plait.comm`
(a `sitecustomize` hook this script writes into a temporary directory on the ranks' PYTHONPATH;
asynchronous ones, dp's overlapped gradient buckets, are left out: their time is not the
caller's). Per (op, axis, payload): the calls per step, the median time of one call in the steps
after the first two, and the calibrated α-β time of the same collective (the cached `this`, as
`plait plan --cluster this` would price it).

    PYTHONPATH=. .venv/bin/python benchmarks/plan_profile.py [--layouts small:2:dp1-tp2-pp1-z0-b16x1,...]
        -> benchmarks/results/plan_profile.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import command_line, machine_info, markdown_table
from plan_validate import RESULTS, base_config, layouts

from plait.comm.ledger import bus_bytes
from plait.planner.calibrate import load_this
from plait.planner.search import layout_config

DEFAULT = (
    "small:2:dp2-tp1-pp1-z1-b8x1,small:2:dp1-tp2-pp1-z0-b16x1,small:2:dp1-tp2-pp1-z0-sp-b16x1,"
    "small:4:dp2-tp2-pp1-z0-b8x1,20m:2:dp2-tp1-pp1-z1-b2x1,20m:4:dp4-tp1-pp1-z1-b1x1"
)
STEPS, WARMUP = 8, 2

HOOK = """
import json, os, time, collections
if os.environ.get("PLAIT_PROFILE_DIR"):
    import plait.comm.ops as _ops
    import plait.train.loop as _loop
    _calls = collections.defaultdict(lambda: [0, 0.0])
    _issue = _ops._issue
    def _timed(mesh, op, axis, payload, launch, async_op, result, *a, **k):
        t0 = time.perf_counter()
        handle = _issue(mesh, op, axis, payload, launch, async_op, result, *a, **k)
        if not async_op:
            c = _calls[f"{op}|{axis}|{mesh.size(axis)}|{payload}"]
            c[0] += 1
            c[1] += time.perf_counter() - t0
        return handle
    _ops._issue = _timed
    _step, _steps = _loop._train_step, []
    def _train_step(run, step):
        _calls.clear()
        record = _step(run, step)
        _steps.append({"step": step, "s": record["step_time_s"], "calls": dict(_calls)})
        path = os.path.join(os.environ["PLAIT_PROFILE_DIR"], f"rank{os.environ.get('RANK', '0')}.json")
        with open(path, "w") as fh:
            json.dump(_steps, fh)
        return record
    _loop._train_step = _train_step
"""


def profile(spec: str, tmp: Path) -> tuple[float, dict]:
    """(median step seconds of rank 0, {(op, axis, n, payload): (calls per step, median s per call)})."""
    model, world, name = spec.split(":")
    base = base_config(model, STEPS)
    lay = next((x for x in layouts(int(world), base.train.global_batch) if x.name() == name), None)
    if lay is None:
        raise SystemExit(f"{spec}: not one of plan_validate's layouts for {model} at {world} ranks")
    work = tmp / spec.replace(":", "_")
    work.mkdir()
    cfg = layout_config(base, lay, bf16=False)
    cfg.train.run_dir = str(work / "run")
    (work / "config.toml").write_text(cfg.to_toml())
    (tmp / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ, PLAIT_PROFILE_DIR=str(work))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), *filter(None, [env.get("PYTHONPATH", "")])])
    cmd = [sys.executable, "-c", "import sys; from plait.cli import main; sys.exit(main())", "train"]
    proc = subprocess.run([*cmd, str(work / "config.toml")], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{spec} failed:\n{proc.stderr[-3000:]}")
    steps = json.loads((work / "rank0.json").read_text())[WARMUP:]
    calls = {}
    for key in steps[-1]["calls"]:
        op, axis, n, payload = key.split("|")
        per_call = [s["calls"][key][1] / s["calls"][key][0] for s in steps if key in s["calls"]]
        calls[(op, axis, int(n), int(payload))] = (steps[-1]["calls"][key][0], statistics.median(per_call))
    return statistics.median(s["s"] for s in steps), calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=DEFAULT, help="MODEL:RANKS:LAYOUT,... (plan_validate's layouts)")
    args = ap.parse_args()
    cluster = load_this()
    rows, info = [], machine_info()
    with tempfile.TemporaryDirectory(prefix="plan-profile-") as tmp:
        for spec in args.layouts.split(","):
            step_s, calls = profile(spec, Path(tmp))
            world = int(spec.split(":")[1])
            in_coll = sum(k * s for k, s in calls.values())
            print(f"{spec}: step {step_s * 1e3:.1f} ms, {in_coll * 1e3:.1f} ms in synchronous collectives")
            by_total = sorted(calls.items(), key=lambda kv: -kv[1][1] * kv[1][0])
            for (op, axis, n, payload), (count, per) in by_total:
                link = cluster.collective_link(op, n, world)
                calib = link.alpha_s + bus_bytes(op, payload, n) / link.beta_bps if link else float("nan")
                rows.append(
                    [spec, f"{step_s * 1e3:.1f}", f"{op} over {axis} ({n})", f"{payload:,}", str(count)]
                    + [f"{per * 1e3:.2f}", f"{calib * 1e3:.2f}", f"{per / calib:.2f}"]
                )
                print(f"   {rows[-1][2]:<28} {payload:>12,} B x{count:<3} {rows[-1][5]:>7} ms", end="")
                print(f", calibrated {rows[-1][6]} ms")
    headers = ["layout", "step ms", "collective", "payload B", "calls/step", "ms per call", "calibrated ms"]
    headers.append("ratio")
    text = [
        "# Synchronous collectives inside a plait train step, against the calibration",
        "",
        f"Command: `{command_line()}`; the cluster `this` from the cache ({cluster.note}).",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()),
        "",
        f"Rank 0, steps {WARMUP + 1}-{STEPS}: median time of one call; calibrated: the α-β fit of the",
        "same op over the same group size and world, timed after a barrier.",
        "",
        markdown_table(headers, rows),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan_profile.md").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
