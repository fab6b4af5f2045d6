"""Context parallelism: activation memory per rank against cp, and the step beside data parallelism.

    .venv/bin/python benchmarks/context_parallel.py [--seq 1024] [--rows 2] [--steps 8]

1. Activations. plait's "small" GPT (4 layers, d 128) with `--seq` tokens per sequence, `--rows`
   sequences per rank, fp32, through `plait.apply.parallelize` at cp = 1, 2 and 4 (world = cp;
   4 ranks share the 2 cores, which changes no byte). The activation memory of one forward is
   measured as the bytes of every distinct storage autograd saves for backward
   (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded; beside it the planner's
   and `plait estimate`'s formula (Korthikanti et al. 2022, fused attention: s·b·h·(10 + 24) per
   layer in 16-bit, doubled in fp32, for the s / cp tokens a rank holds) and both ratios to cp 1.
2. The step. cp = 2 (ring, Ulysses) against dp = 2 on the same global batch (2 ranks, the same
   tokens per rank): median step time over `--steps` steps after one warm-up, their ratio, and
   the cp axis's bytes per step from the ledger beside the formula (ring: K and V over cp − 1
   hops per layer forward, again with their gradients backward; Ulysses: 8 all-to-alls per
   layer of (cp − 1)/cp of the rank's q, k, v or output; plus, at dp = 1, the gradients'
   all-reduce over cp).

No peer runs here: torch's context parallelism (`torch.distributed.tensor.experimental.
context_parallel`) replaces the CUDA attention kernels only and has no CPU path. Writes
benchmarks/results/context_parallel.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import machine_info, markdown_table, text_table, write_report  # noqa: E402

from plait.testing import run_ranks  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "context_parallel.md"


def _model(seq: int):
    from plait.models import GPT, gpt_config

    torch.manual_seed(0)
    return GPT(gpt_config("small", seq_len=seq))


def _saved_bytes(engine, x, y, params: set[int]) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward_backward([(x, y)], 1.0 / y.numel())
    engine.zero_grad()
    return sum(seen.values())


def _activations(seq: int, rows: int) -> dict:
    from plait.apply import parallelize
    from plait.layout import Layout
    from plait.mesh import Mesh

    torch.set_num_threads(1)
    import torch.distributed as dist

    cp = dist.get_world_size()
    mesh = Mesh(cp=cp, timeout_s=600)
    model = _model(seq)
    engine = parallelize(model, Layout(**mesh.sizes), mesh, lambda g: torch.optim.SGD(g, lr=0.1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (rows, seq), generator=g)
    out = {"cp": cp, "saved": _saved_bytes(engine, x, x, params)}
    engine.close()
    mesh.close()
    return out


def _steps(seq: int, rows: int, steps: int) -> dict:
    from plait import comm
    from plait.apply import parallelize
    from plait.layout import Layout
    from plait.mesh import Mesh

    torch.set_num_threads(1)
    out = {}
    for name, sizes, style in (
        ("dp2", {"dp": 2}, "ring"),
        ("cp2-ring", {"cp": 2}, "ring"),
        ("cp2-ulysses", {"cp": 2}, "ulysses"),
    ):
        mesh = Mesh(**sizes, timeout_s=600)
        engine = parallelize(
            _model(seq), Layout(**mesh.sizes, cp_style=style), mesh, lambda g: torch.optim.SGD(g, lr=0.1)
        )
        dp, r = mesh.size("dp"), mesh.rank("dp")
        g = torch.Generator().manual_seed(1)
        times = []
        for step in range(steps + 1):
            x = torch.randint(0, 256, (2 * rows, seq), generator=g)
            x = x[r * (2 * rows // dp) : (r + 1) * (2 * rows // dp)]
            comm.barrier(mesh)
            mesh.ledger.set_step(step)
            t0 = time.perf_counter()
            engine.forward_backward([(x, x)], dp / x.numel())
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
            mesh.ledger.set_step(-1)
        cp_rows = mesh.ledger.rows(steps)
        out[name] = {
            "median_s": statistics.median(times[1:]),
            "cp_bus": sum(row.bus_bytes for (op, axis), row in cp_rows.items() if axis == "cp"),
            "psi": sum(p.numel() for p in engine.module.parameters()),
        }
        engine.close()
        mesh.close()
    return out


def _predicted_activations(seq: int, rows: int, cp: int) -> int:
    from plait.models import gpt_config
    from plait.zero.estimate import activation_bytes

    return activation_bytes(
        gpt_config("small", seq_len=seq), rows, -(-seq // cp), precision="fp32", stored_scores=False
    )


def _cp_formula(seq: int, rows: int, style: str, psi: int) -> float:
    """The cp axis's bus bytes per step at cp = 2, dp = 1 (fp32; send and receive both counted,
    as the ledger counts them)."""
    cp, layers, d, b = 2, 4, 128, 4
    local = rows * 2 * (seq // cp) * d * b  # one (B, L, h·d) tensor of a rank; B = the dp rank's rows
    attn = (2 * 3 * 2 * (cp - 1) if style == "ring" else 8 * (cp - 1) / cp) * local * layers
    grads = 2 * (cp - 1) / cp * psi * b  # the gradients' all-reduce over cp (dp = 1)
    return attn + grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    t0 = time.perf_counter()
    acts = {cp: run_ranks(_activations, cp, args=(args.seq, args.rows), timeout=900)[0] for cp in (1, 2, 4)}
    base_m, base_p = acts[1]["saved"], _predicted_activations(args.seq, args.rows, 1)
    act_rows = []
    for cp, res in acts.items():
        pred = _predicted_activations(args.seq, args.rows, cp)
        act_rows.append(
            [str(cp), f"{res['saved'] / 2**20:.2f}", f"{pred / 2**20:.2f}", f"{res['saved'] / pred:.3f}",
             f"{res['saved'] / base_m:.3f}", f"{pred / base_p:.3f}"]
        )  # fmt: skip
    steps = run_ranks(_steps, 2, args=(args.seq, args.rows, args.steps), timeout=1800)[0]
    step_rows = []
    for name, res in steps.items():
        want = _cp_formula(args.seq, args.rows, name.split("-")[1], res["psi"]) if name != "dp2" else 0.0
        step_rows.append(
            [name, f"{1e3 * res['median_s']:.0f}", f"{res['median_s'] / steps['dp2']['median_s']:.3f}",
             f"{res['cp_bus'] / 1e6:.3f}", f"{want / 1e6:.3f}"]
        )  # fmt: skip
    act_head = [
        "cp",
        "measured MiB",
        "predicted MiB",
        "measured / predicted",
        "measured vs cp 1",
        "predicted vs cp 1",
    ]
    step_head = ["layout", "step ms (median)", "vs dp2", "cp bytes/step (MB, ledger)", "formula (MB)"]
    print(text_table(act_head, act_rows))
    print(text_table(step_head, step_rows))
    lines = [
        "",
        f"## Activation memory per rank (small GPT, seq {args.seq}, {args.rows} sequences per rank, fp32)",
        "",
        markdown_table(act_head, act_rows),
        "",
        f"## The step at cp = 2 beside dp = 2 (2 ranks, {2 * args.rows} sequences of {args.seq} per step)",
        "",
        markdown_table(step_head, step_rows),
        "",
        "No peer: torch's context parallelism has no CPU path (it replaces the CUDA attention kernels).",
    ]
    write_report(RESULTS, "Context parallelism", machine_info(), time.perf_counter() - t0, lines)


if __name__ == "__main__":
    main()
