"""plait.engine: the global gradient norm against the norm of the whole tensors computed by hand
(each gradient counted once: a replica once, a shard's squares summed over its axes), the
accumulating forward-backward against one big batch's gradient, and `model_blocks`."""

import contextlib
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.engine import AccumulatingEngine, global_grad_norm, model_blocks
from plait.testing import run_ranks


def _whole(name: str, shape) -> torch.Tensor:
    seed = sum(map(ord, name))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _norm(*tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def test_norm_of_unsplit_parts_is_the_norm_of_every_gradient():
    cpu = types.SimpleNamespace(device=torch.device("cpu"))  # no axis named: no collective
    a, b, c = _whole("a", (3, 4)), _whole("b", (5,)), _whole("c", (2, 2))
    got = global_grad_norm(cpu, [([a, b], ()), ([c], ())])
    assert got == pytest.approx(_norm(a, b, c), rel=1e-12)
    assert global_grad_norm(cpu, [([], ())]) == 0.0
    # float64 accumulation: 2^24 + 1 squares of 1.0 in float32 would stop at 2^24
    ones = torch.ones(2**24 + 1)
    assert global_grad_norm(cpu, [([ones], ())]) ** 2 == pytest.approx(2**24 + 1, abs=1e-3)


# --- dp2 x tp2: shards and replicas ------------------------------------------------------------

# whole gradients: R replicated everywhere, W split over tp (rows), Z split over dp (ZeRO's
# flat shard), X split over dp and tp (a ZeRO shard of a tp-split tensor), E replicated over tp
# and split over dp as an expert bank would be over ep
WHOLE = {"R": (3, 5), "W": (8, 3), "Z": (10,), "X": (4, 6), "E": (2, 7)}


def _pieces(dp: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's pieces of the whole gradients, cut by hand."""
    return {
        "R": _whole("R", WHOLE["R"]),
        "W": _whole("W", WHOLE["W"])[4 * tp : 4 * tp + 4],
        "Z": _whole("Z", WHOLE["Z"])[5 * dp : 5 * dp + 5],
        "X": _whole("X", WHOLE["X"])[2 * dp : 2 * dp + 2, 3 * tp : 3 * tp + 3],
        "E": _whole("E", WHOLE["E"])[dp : dp + 1],
    }


def _norms() -> dict:
    from plait.mesh import Mesh
    from plait.placement import REPLICATED, Placement, Shard, norm_parts

    out = {}
    with Mesh(dp=2, tp=2, watchdog=False) as mesh:
        g = _pieces(mesh.rank("dp"), mesh.rank("tp"))
        parts = [([g["R"]], ()), ([g["W"]], ("tp",)), ([g["Z"], g["E"]], ("dp",)), ([g["X"]], ("dp", "tp"))]
        out["all"] = global_grad_norm(mesh, parts)
        out["replicated+tp"] = global_grad_norm(mesh, [([g["R"]], ()), ([g["W"]], ("tp",))])
        out["one part over every axis"] = global_grad_norm(mesh, [([g["X"]], ("dp", "tp"))])
        # the same through the placements, as an engine asks: the replica once, W's shards summed
        tp_split = Placement(sharded=(("tp", Shard(0)),))
        pairs = [(REPLICATED, g["R"]), (tp_split, g["W"])]
        out["placements"] = global_grad_norm(mesh, norm_parts(pairs, mesh))
        # a ZeRO shard axis as a data axis: every part is also summed over dp
        shards = [(REPLICATED, g["Z"]), (tp_split, g["X"])]
        out["placements+dp"] = global_grad_norm(mesh, norm_parts(shards, mesh, ("dp",)))
    return out


@pytest.fixture(scope="module")
def norms_4():
    return run_ranks(_norms, 4, timeout=240)


def test_global_norm_counts_each_gradient_once(norms_4):
    w = {k: _whole(k, s) for k, s in WHOLE.items()}
    want = {
        "all": _norm(*w.values()),
        "replicated+tp": _norm(w["R"], w["W"]),
        "one part over every axis": _norm(w["X"]),
        "placements": _norm(w["R"], w["W"]),
        "placements+dp": _norm(w["Z"], w["X"]),
    }
    for r, got in enumerate(norms_4):
        for what, value in want.items():
            assert got[what] == pytest.approx(value, rel=1e-6), (what, r, got[what] / value)


# --- micro-batches accumulate to one batch's gradient ------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x, y, reduction="mean"):
        return F.cross_entropy(self.body(x), y, reduction=reduction)


class _Accumulating(AccumulatingEngine):
    """The mixin on a plain module, recording which micro-batches ran inside no_sync."""

    def __init__(self, module):
        self.module, self.deferred = module, 0

    @contextlib.contextmanager
    def no_sync(self):
        self.deferred += 1
        yield


def _batch(rows=12):
    g = torch.Generator().manual_seed(5)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 4, (rows,), generator=g)


@pytest.mark.parametrize("micro", [1, 3, 4])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(micro):
    x, y = _batch()
    whole = _Net()
    loss = whole(x, y)  # the mean over the 12 rows
    loss.backward()
    engine = _Accumulating(_Net())
    entered = []

    def autocast():
        entered.append(1)
        return contextlib.nullcontext()

    total = engine.forward_backward(list(zip(x.chunk(micro), y.chunk(micro))), 1.0 / 12, autocast)
    assert total.dtype == torch.float64
    assert float(total) == pytest.approx(12 * float(loss.detach()), rel=1e-6)  # the unscaled loss sum
    assert engine.deferred == micro - 1 and len(entered) == micro  # the last one synchronises
    for (name, p), q in zip(engine.module.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        want = F.cross_entropy(whole.body(x), y, reduction="sum")
    assert float(engine.eval_loss_sum(x, y)) == pytest.approx(float(want), rel=1e-6)


# --- the blocks a model declares ---------------------------------------------------------------


class _Declares(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16)
        self.inner = nn.Sequential(nn.TransformerDecoderLayer(8, 2, 16), nn.TransformerEncoderLayer(8, 2, 16))

    def plait_blocks(self):
        return [self.b, self.enc]


def test_model_blocks_are_the_declared_ones_then_torch_layers_once():
    m = _Declares()
    assert model_blocks(m) == [m.b, m.enc, m.inner[0], m.inner[1]]
    plain = nn.Sequential(nn.Linear(8, 8), m.inner)
    assert model_blocks(plain) == [m.inner[0], m.inner[1]]
    plain.plait_blocks = [plain[0]]  # not a method: declares nothing
    assert model_blocks(plain) == [m.inner[0], m.inner[1]]
    assert model_blocks(nn.Linear(2, 2)) == []
