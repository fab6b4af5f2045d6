"""Train your own model in your own loop with plait: `plait.parallelize`, then forward_backward / step.

    python examples/custom_loop.py                                    # one process
    torchrun --nproc-per-node 2 examples/custom_loop.py               # data parallel over 2
    plait launch --nproc 2 examples/custom_loop.py --zero-stage 3     # ZeRO-3 over 2
    plait launch --nproc 2 examples/custom_loop.py --tp 2             # tensor parallel (layout rules below)
    plait launch --nproc 2 examples/custom_loop.py --save ckpt        # then resume at any size:
    python examples/custom_loop.py --resume ckpt --steps 60

The model is not plait's: a residual MLP classifier of the user's, on synthetic data labelled by
a fixed random "teacher" network. Every rank builds the same model and data (one seed) and trains
on its share of each global batch (`engine.shard`), so any number of ranks follows the same
trajectory as one process (tests/test_custom_loop.py checks this to 1e-5).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.tensor_parallel import Colwise, Rowwise


class Block(nn.Module):
    """x + W2 gelu(W1 norm(x)): the user's repeated block."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(
        self, features: int = 16, width: int = 32, hidden: int = 64, classes: int = 4, depth: int = 2
    ):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


# Layout rules for tensor parallelism (Megatron-LM's MLP split): each block's `up` split by output
# columns, `down` by input rows, so a block needs one all-reduce forward and one backward. The
# named dim "hidden" lets layout_rules={"hidden": None} keep it whole instead.
TP_PLAN = {"blocks.*.up": Colwise(dim="hidden"), "blocks.*.down": Rowwise(dim="hidden")}


def make_data(n: int = 4096, features: int = 16, classes: int = 4, seed: int = 1):
    """n points with the labels of a random teacher network (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (torch.tanh(x) @ teacher + 0.1 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return x, y


def loss_fn(model, batch):
    """The mean loss over the rows of `batch`: what plait.parallelize asks of a loss."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def global_batch(data, step: int, rows: int):
    """The step's global batch: consecutive rows of the data, wrapping around."""
    x, y = data
    idx = torch.arange(step * rows, (step + 1) * rows) % x.shape[0]
    return x[idx], y[idx]


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows over all dp ranks)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--save", help="save a checkpoint here at the end")
    ap.add_argument("--resume", help="continue from a checkpoint saved with --save")
    ap.add_argument("--log-every", type=int, default=5)
    args = ap.parse_args(argv)

    torch.manual_seed(0)  # the same model on every rank
    model = Net()
    engine = plait.parallelize(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        {"tp": args.tp, "zero_stage": args.zero_stage},
        loss_fn=loss_fn,
        tp_plan=TP_PLAN if args.tp > 1 else None,
        blocks=list(model.blocks),  # ZeRO-3 gathers one block at a time
        grad_clip=1.0,
    )
    if args.resume:
        engine.load(args.resume)
    data = make_data()
    losses = []
    if engine.is_main:
        print(
            f"ranks {engine.world} (dp {engine.dp}, tp {args.tp}), zero_stage {args.zero_stage}", flush=True
        )
    while engine.steps < args.steps:
        batch = engine.shard(global_batch(data, engine.steps, args.batch))
        loss = engine.forward_backward(batch, micro_batches=args.micro_batches)
        norm = engine.step()
        losses.append(loss)
        if engine.is_main and (engine.steps % args.log_every == 0 or engine.steps == args.steps):
            print(f"step {engine.steps:4d}  loss {loss:.6f}  grad norm {norm:.4f}", flush=True)
    if args.save:
        path = engine.save(args.save)
        if engine.is_main:
            print(f"saved {path}", flush=True)
    engine.close()
    return losses


if __name__ == "__main__":
    main()
