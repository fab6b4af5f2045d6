"""1-bit SGD with error feedback (Seide et al. 2014) written independently from the paper, and
compared with plait's compressor message for message on the default GPT's real gradients.

The paper (§3), per worker w and step t, with G the worker's gradient matrix:

    G_quant = Q(G(t) + Δ(t-1)),   Δ(t) = G(t) + Δ(t-1) − Q⁻¹(G_quant)

Q keeps one bit per entry (threshold 0) and, per column, the two reconstruction values: the mean
of the column's entries >= 0 and the mean of its entries < 0. Every worker receives every
worker's message and the update uses the sum of the decoded messages. plait states two
departures, both reproduced here from their description, not from plait's code: the error is in
units of the step (G is ``scale·g`` with ``scale = lr_t / peak_lr`` and the decoded sum is
divided by ``scale``), and adjacent whole columns are grouped until a group holds at least
``min_group`` entries (``min_group=1`` is the paper's rule). plait gathers the messages and
decodes them exactly; it does not quantise the reduced result a second time, so there is no
server-side residual: the test checks that the gradient handed to the optimizer is exactly the
decoded sum.
"""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from plait.comm.compress import OneBitCompressor
from plait.data.corpus import load_corpus
from plait.data.sampler import DistributedBatchSampler
from plait.data_parallel import DataParallel
from plait.mesh import Mesh
from plait.models import GPT, gpt_config
from plait.testing import run_ranks

SCALES = (0.25, 1.0, 0.5)  # lr_t / peak_lr of the recorded steps: warm-up, peak, decay


# --- the reference: a few lines from the paper's equations --------------------------------------


def seide_quantise(m: torch.Tensor, k: int):
    """Q and Q⁻¹ on a (rows, cols) matrix, columns taken k at a time (k=1: the paper). Returns
    (bits, the mean of each group's entries >= 0, the mean of its entries < 0, the reconstruction)."""
    bits = m >= 0
    group = torch.arange(m.shape[1]) // k  # each column's group
    n_groups = int(group[-1]) + 1

    def mean(side):  # per group, the mean of the entries on one side of the threshold (0 if none)
        total = torch.zeros(n_groups, dtype=m.dtype).index_add_(0, group, (m * side).sum(0))
        count = torch.zeros(n_groups, dtype=m.dtype).index_add_(0, group, side.sum(0).to(m.dtype))
        return torch.where(count > 0, total / count.clamp(min=1), 0.0)

    hi, lo = mean(bits), mean(~bits)
    return bits, hi, lo, torch.where(bits, hi[group], lo[group])


def as_matrix(shape: torch.Size) -> tuple[int, int]:
    """A parameter as (rows, cols): dim 0 is the row, a vector is one column."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) > 1 else n
    return rows, n // rows


# --- plait's run: DataParallel over 2 gloo ranks, recording every message ------------------------


class Recorder(OneBitCompressor):
    """plait's compressor, unchanged, with what each exchange received, sent and returned."""

    def __init__(self, min_group: int):
        super().__init__(True, min_group)
        self.log: list[dict] = []

    def _all_gather(self, message, bucket, mesh, axis):
        gathered, handle = super()._all_gather(message, bucket, mesh, axis)
        self.log[-1]["gathered"] = gathered
        return gathered, handle

    def __call__(self, bucket, mesh, axis):
        entry = {"bucket": bucket.index, "scale": self.lr_scale, "sent": bucket.buffer.clone()}
        self.log.append(entry)
        handle = super().__call__(bucket, mesh, axis)
        finish = handle.finish

        def recorded():
            out = finish()
            entry.update(gathered=entry["gathered"].clone(), out=out.clone())
            entry["residual"] = self.residuals[bucket.index].clone()
            return out

        handle.finish = recorded
        return handle


def _gpt_run(min_group: int) -> dict:
    """3 steps of the default GPT under plait's 1-bit DataParallel at the scales of SCALES."""
    mesh = Mesh(dp=2, timeout_s=60)
    cfg = gpt_config("small")
    torch.manual_seed(0)
    model = GPT(cfg)
    hook = Recorder(min_group)
    ddp = DataParallel(model, mesh, bucket_mb=1.0, comm_hook=hook)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    corpus = load_corpus("pydoc", 0.05)
    sampler = DistributedBatchSampler(corpus.train, cfg.seq_len, 16, dist.get_rank(), 2, seed=0)
    for scale in SCALES:
        hook.set_lr_scale(scale)
        opt.param_groups[0]["lr"] = 0.1 * scale
        ((x, y),) = sampler.next_batch()
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
    layouts = {b.index: [(off, s) for off, s in zip(b.offsets, b.layout.shapes)] for b in ddp.buckets}
    mesh.close()
    return {"log": hook.log, "layouts": layouts}


def _two_ranks():
    return {g: _gpt_run(g) for g in (2048, 1)}


@pytest.fixture(scope="module")
def gpt_ranks():
    return run_ranks(_two_ranks, 2, timeout=300)


# --- the comparison ------------------------------------------------------------------------------


def _parse(message: torch.Tensor, n_scales: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A plait message as (its fp32 scales, its n bits): scales first, then the bits packed 8 to a
    byte, most significant first (plait's documented wire format)."""
    raw = message.numpy()
    scales = raw[: 4 * n_scales].view(np.float32)
    bits = np.unpackbits(raw[4 * n_scales :], bitorder="big")[:n].astype(bool)
    return scales, bits


def _expected_scales(hi: torch.Tensor, lo: torch.Tensor, k: int, cols: int) -> list[torch.Tensor]:
    """plait's order of a parameter's scales: the full groups' positive means, their negative
    means, then the (positive, negative) pair of a shorter last group."""
    full = cols // k
    return [hi[:full], lo[:full], torch.stack([hi[full:], lo[full:]], 1).reshape(-1)]


def _reference_worker(acc: torch.Tensor, layout, min_group: int):
    """One worker's message and reconstruction for G + Δ = `acc` (one bucket): (bits in plait's
    column-major order, |acc| in that order, the scales in plait's order, Q⁻¹(Q(acc)))."""
    rec, scales, bits, values = torch.empty_like(acc), [], [], []
    for off, shape in layout:
        rows, cols = as_matrix(shape)
        k = max(1, math.ceil(min_group / rows))
        m = acc[off : off + rows * cols].view(rows, cols)
        b, hi, lo, r = seide_quantise(m, k)
        rec[off : off + rows * cols] = r.reshape(-1)
        scales += _expected_scales(hi, lo, k, cols)
        bits.append(b.t().reshape(-1))
        values.append(m.t().reshape(-1).abs())
    return torch.cat(bits).numpy(), torch.cat(values).numpy(), torch.cat(scales), rec


@pytest.mark.parametrize("min_group", [2048, 1])
def test_onebit_matches_seide_et_al_message_for_message_on_the_gpt(gpt_ranks, min_group):
    runs = [r[min_group] for r in gpt_ranks]
    layouts = runs[0]["layouts"]
    residual = {(w, b): torch.zeros(1) for w in range(2) for b in layouts}  # Δ(t-1) per worker, bucket
    worst = {"bits": 0.0, "scales": 0.0, "residual": 0.0, "out": 0.0}
    for i, entries in enumerate(zip(*(r["log"] for r in runs), strict=True)):
        b, scale = entries[0]["bucket"], entries[0]["scale"]
        assert all(e["bucket"] == b and e["scale"] == scale for e in entries)
        assert scale == SCALES[i // len(layouts)]
        total = torch.zeros_like(entries[0]["sent"], dtype=torch.float64)
        for w, e in enumerate(entries):
            acc = scale * e["sent"].double() + residual[w, b]  # G(t) + Δ(t-1), in units of the step
            want_bits, values, want_scales, rec = _reference_worker(acc, layouts[b], min_group)
            residual[w, b] = acc - rec  # Δ(t)
            total += rec / scale
            decided = values > 1e-6 * values.max()  # signs that float rounding cannot flip
            for got in runs:  # this worker's message as each rank received it
                scales, bits = _parse(got["log"][i]["gathered"][w], want_scales.numel(), acc.numel())
                worst["bits"] = max(worst["bits"], float((bits != want_bits)[decided].mean()))
                gap = (torch.from_numpy(scales.copy()).double() - want_scales).abs().max()
                worst["scales"] = max(worst["scales"], float(gap))
            worst["residual"] = max(worst["residual"], float((e["residual"] - residual[w, b]).abs().max()))
        for e in entries:  # the optimizer's gradient: the decoded sum, with no second quantisation
            worst["out"] = max(worst["out"], float((e["out"] - total).abs().max()))
    assert len(runs[0]["log"]) == len(SCALES) * len(layouts) and len(layouts) > 1
    size = max(float(e["sent"].abs().max()) for r in runs for e in r["log"])  # the gradients' scale
    assert worst["bits"] == 0.0, worst
    assert worst["scales"] < 1e-5 * size and worst["residual"] < 1e-5 * size, (worst, size)
    assert worst["out"] < 1e-5 * size, (worst, size)
