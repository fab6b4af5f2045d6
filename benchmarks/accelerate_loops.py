"""The two training loops benchmarks/accelerate_peer.py compares: Hugging Face Accelerate with its FSDP
plugin, and plait.parallelize with ZeRO-3, on the same transformers Llama.

Each rank runs this file (`accelerate_peer.py` launches it: torchrun from the Accelerate venv, `plait
launch` from plait's). The loops get the same things: the model's config and initial weights and
the global batches (files written by accelerate_peer.py), AdamW's settings. Each takes its rows of every
global batch (rank r: rows [r B/2, (r+1) B/2)), so both see the same data in the same order.
Between the `user code` markers is what a user writes for each library; accelerate_peer.py quotes it.

    python benchmarks/accelerate_loops.py accelerate|plait WORK_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def build_model(work: Path):
    """The same LlamaForCausalLM on every rank and both sides: config and weights from accelerate_peer.py."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**json.loads((work / "config.json").read_text()))
    model = LlamaForCausalLM(config)
    model.load_state_dict(torch.load(work / "init.pt"), strict=True)
    return model


def loss_of(model, x, y):
    """The mean token cross-entropy of (B, T) ids against the next bytes `y`."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def run_accelerate(model, batches, lr, timer):
    # --- user code: accelerate ---
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,  # torch's fully_shard (FSDP1 refuses the CPU)
        reshard_after_forward=True,  # full shard: ZeRO-3
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    # Accelerate turns the FSDP plugin on for accelerators only; on the CPU it silently falls back
    # to DDP (MULTI_CPU). Switch its state to FSDP by hand so that its FSDP path runs (gloo).
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type, accelerator.state.fsdp_plugin = DistributedType.FSDP, plugin
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    rank, world = accelerator.process_index, accelerator.num_processes
    for x, y in batches:  # the global batch; this rank's rows
        rows = x.shape[0] // world
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        with timer():
            loss = loss_of(model, x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            loss = accelerator.reduce(loss.detach(), "mean").item()  # the global batch's mean loss
        timer.loss(loss)
    # --- end ---
    from torch.distributed.fsdp import FSDPModule  # that FSDP really ran, and over what units

    units = [name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    timer.what = f"{type(model).__name__}; fully_shard units: {', '.join(units)}"
    return rank, accelerator.end_training


def run_plait(model, batches, lr, timer):
    # --- user code: plait ---
    import plait

    engine = plait.parallelize(
        model,
        lambda params: torch.optim.AdamW(params, lr=lr),
        {"zero_stage": 3, "device": "cpu"},
        loss_fn=lambda m, batch: loss_of(m, *batch),
        blocks=list(model.model.layers),  # the LlamaDecoderLayers: ZeRO-3's units
    )
    for batch in batches:  # the global batch; this rank's rows
        batch = engine.shard(batch)
        with timer():
            loss = engine.forward_backward(batch)  # the global batch's mean loss
            engine.step()
        timer.loss(loss)
    # --- end ---
    timer.what = (
        f"{type(engine.engine).__name__}; units: model.layers.0-{len(model.model.layers) - 1}, the rest"
    )
    return engine.rank, engine.close


class Timer:
    """Times each step from a barrier (every rank starts together; `_common.timed_step`'s rule)
    and keeps the losses."""

    def __init__(self):
        self.times, self.losses, self.what = [], [], ""

    def __call__(self):
        return self

    def __enter__(self):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.times.append(time.perf_counter() - self.t0)

    def loss(self, value: float) -> None:
        self.losses.append(float(value))


def main() -> None:
    side, work = sys.argv[1], Path(sys.argv[2])
    settings = json.loads((work / "settings.json").read_text())
    torch.manual_seed(0)
    model = build_model(work)
    batches = torch.load(work / "batches.pt")
    timer = Timer()
    t0 = time.perf_counter()
    run = run_accelerate if side == "accelerate" else run_plait
    rank, close = run(model, batches, settings["lr"], timer)
    import torch.distributed as dist

    # the slowest rank's time per step: a synchronous step ends when its slowest rank does
    t = torch.tensor(timer.times, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out = {
            "times": t.tolist(),
            "losses": timer.losses,
            "wall_s": time.perf_counter() - t0,
            "threads": torch.get_num_threads(),
            "world": int(os.environ.get("WORLD_SIZE", "1")),
            "what": timer.what,
        }
        (work / f"{side}.json").write_text(json.dumps(out))
    close()


if __name__ == "__main__":
    main()
