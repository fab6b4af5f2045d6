"""One Python program drives a mesh of processes: plait's driver API on the single controller.

    python examples/controller.py                          # dp 2, ZeRO-3: 2 processes, this one drives
    python examples/controller.py --layout '{"dp": 2}'     # any plait.parallelize layout
    python examples/controller.py --layout '{"tp": 2}'     # tensor parallel (the TP_PLAN below)

This program is the controller (Pathways' design, on PyTorch's Monarch): it builds no model and
computes nothing. `plait.controller.mesh(layout)` spawns one process per rank; `m.parallelize`
builds the model on each of them and wraps it with `plait.parallelize`; `m.step(batch)` sends
each data rank its rows of the global batch and returns a future at once, so the program
dispatches every step before the first loss is back. At the end it gathers the parameters here
and checks them against the same training in plain PyTorch on this process: SGD without clipping,
so a gradient off by any factor would show.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

import plait.controller
from plait.tensor_parallel import Colwise, Rowwise


class Net(nn.Module):
    """A two-layer MLP classifier with a LayerNorm: the user's model, not plait's."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.up = nn.Linear(features, hidden)
        self.down = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


TP_PLAN = {"up": Colwise(), "down": Rowwise()}  # Megatron's MLP split (used when tp > 1)


def make_model() -> nn.Module:
    return Net()  # called on every rank after torch.manual_seed(seed): the same model everywhere


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def batches(steps: int, rows: int, seed: int = 1):
    """`steps` global batches labelled by a random teacher (the same in the reference)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=g)
    for _ in range(steps):
        x = torch.randn(rows, 16, generator=g)
        yield x, (torch.tanh(x) @ teacher).argmax(dim=1)


def reference(steps: int, rows: int, seed: int = 0):
    """The same training on this process in plain PyTorch: the losses and the final parameters."""
    torch.manual_seed(seed)
    model = make_model()
    opt = optimizer(model.parameters())
    losses = []
    for batch in batches(steps, rows):
        loss = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def train(layout: dict, steps: int, rows: int) -> dict:
    """Train on a mesh of `layout` from this program, then check against plain PyTorch."""
    options = {"tp_plan": TP_PLAN} if layout.get("tp", 1) > 1 else {}
    with plait.controller.mesh(layout) as m:
        t0 = time.perf_counter()
        m.parallelize(make_model, optimizer, loss_fn=loss_fn, **options)
        print(f"mesh {m.shape}: {m.world} process(es) built in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        futures = [m.step(batch) for batch in batches(steps, rows)]  # all in flight
        sent = time.perf_counter() - t0
        losses = [f.get() for f in futures]
        took = time.perf_counter() - t0
        print(f"{steps} steps dispatched in {sent * 1e3:.1f} ms, done in {took:.2f} s", flush=True)
        params = m.state_dict()

    want_losses, want_params = reference(steps, rows)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    param_err = max(((params[k] - v).norm() / v.norm()).item() for k, v in want_params.items())
    for i in (0, steps // 2, steps - 1):
        print(f"step {i + 1:3d}  loss {losses[i]:.6f}  (one process, plain PyTorch: {want_losses[i]:.6f})")
    print(f"largest relative difference from plain PyTorch: losses {loss_err:.1e}, params {param_err:.1e}")
    return {"layout": layout, "losses": losses, "loss_err": loss_err, "param_err": param_err}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--layout",
        action="append",
        help='plait.parallelize\'s keys, JSON (repeat for more; default {"dp": 2, "zero_stage": 3})',
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=64, help="rows of each global batch")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line at the end")
    args = ap.parse_args(argv)
    layouts = args.layout or ['{"dp": 2, "zero_stage": 3}']
    out = [train(json.loads(layout), args.steps, args.rows) for layout in layouts]
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
