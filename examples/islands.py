"""A pipeline over islands (MPMD): two stages on process meshes of their own, of different widths.

    python examples/islands.py                                  # 1F1B, stage 0 on 2 ranks, stage 1 on 1
    python examples/islands.py --runs gpipe:1,2 1f1b:2,2        # SCHEDULE:DP0,DP1 ...
    python examples/islands.py --width 512 --steps 20           # bigger stages: time per step
    python examples/islands.py --runs 1f1b:2,1:controller       # relay through the controller

This program is the controller. `plait.controller.islands` spawns one Monarch process mesh per
stage (an island), each rank building its stage module and wrapping it data-parallel over its
island; the controller walks plait's pipeline schedule (GPipe or 1F1B), and each micro-batch's
activations go forward and their gradients back from island to island over a gloo link between
them (or, with `:controller`, relayed through this program). At the end the stages' parameters
are gathered here and checked against the same training in plain PyTorch on one process (SGD
without clipping): islands of different widths train exactly like one device.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import plait.controller


def net(width: int) -> nn.Sequential:
    torch.manual_seed(0)  # every stage cuts its part of the same model
    return nn.Sequential(
        nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def stage(index: int, width: int) -> nn.Module:
    """Stage 0: the first layer; stage 1: the rest (nn.Sequential slices keep the layers' names)."""
    return net(width)[:2] if index == 0 else net(width)[2:]


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2)


def loss_fn(out, y):
    return F.cross_entropy(out, y)


def batches(steps: int, rows: int):
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=g)
    for _ in range(steps):
        x = torch.randn(rows, 16, generator=g)
        yield x, (torch.tanh(x) @ teacher).argmax(dim=1)


def reference(steps: int, rows: int, width: int):
    """One process, plain PyTorch: the losses, the final parameters by name, the median step time."""
    model = net(width)
    opt = optimizer(model.parameters())
    losses, times = [], []
    for x, y in batches(steps, rows):
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, {k: v.detach() for k, v in model.named_parameters()}, statistics.median(times[1:]) * 1e3


def run(
    schedule: str,
    dp: list[int],
    steps: int,
    rows: int,
    microbatches: int,
    width: int,
    transfer: str = "direct",
) -> dict:
    stages = [functools.partial(stage, 0, width), functools.partial(stage, 1, width)]
    with plait.controller.islands(
        stages,
        dp=dp,
        optimizer=optimizer,
        loss_fn=loss_fn,
        schedule=schedule,
        microbatches=microbatches,
        transfer=transfer,
    ) as p:
        losses, times, cpu = [], [], []
        for batch in batches(steps, rows):
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(p.step(batch))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # this program's (the controller's) CPU time
        params, relayed = p.state_dict(), p.relayed_bytes
        link_bytes, pending = p.link_bytes(), p.pending_sends()
    want_losses, want_params, one_ms = reference(steps, rows, width)
    # a stage's names are the model's own (nn.Sequential slices keep them): stage1.2.weight is 2.weight
    got = {k.split(".", 1)[1]: v for k, v in params.items()}
    assert set(got) == set(want_params), (sorted(got), sorted(want_params))
    return {
        "schedule": schedule,
        "dp": dp,
        "transfer": transfer,
        "link_bytes": link_bytes,
        "relayed_bytes": relayed,
        "controller_cpu_ms": statistics.median(cpu[1:]) * 1e3,
        "pending_sends": pending,
        "losses": losses,
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
        "param_err": max(((got[k] - v).norm() / v.norm()).item() for k, v in want_params.items()),
        "step_ms": statistics.median(times[1:]) * 1e3,
        "one_process_ms": one_ms,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--runs", nargs="+", default=["1f1b:2,1"], help="SCHEDULE:DP0,DP1[:controller] (gpipe or 1f1b)"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32, help="rows of each global batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--width", type=int, default=32, help="the hidden width (the stages' size)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line at the end")
    args = ap.parse_args(argv)
    out = []
    for spec in args.runs:
        schedule, dp, *transfer = spec.split(":")
        dp_ = [int(d) for d in dp.split(",")]
        r = run(schedule, dp_, args.steps, args.rows, args.microbatches, args.width, *transfer)
        print(
            f"{schedule} on islands of dp {r['dp']} ({r['transfer']}): {args.steps} steps, "
            f"median {r['step_ms']:.1f} ms/step; "
            f"largest relative difference from one process: losses {r['loss_err']:.1e}, "
            f"parameters {r['param_err']:.1e}",
            flush=True,
        )
        out.append(r)
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
