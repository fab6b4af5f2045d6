"""Krizhevsky's hybrid (conv data-parallel, FC model-parallel) on the real digits: parity with one
process, the ledger against the formula, held-out accuracy, bad input; the model and the dataset."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.data.digits import load_digits_dataset
from plait.engine import global_grad_norm
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.models import DigitsCNN
from plait.tensor_parallel.hybrid import apply_krizhevsky, check_krizhevsky, krizhevsky_comm
from plait.testing import (
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    run_ranks,
    single_process_reference,
)

STEPS = 20
GLOBAL_BATCH = 32
OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def _model(**kw) -> DigitsCNN:
    torch.manual_seed(0)
    return DigitsCNN(**kw)


def _optimizer(params, kind: str):
    # Adam divides by sqrt(v) + eps. A first-FC weight of a barely active unit gets a gradient of
    # ~1e-9 that is summation-order noise; with the default eps=1e-8 Adam turns it into a step of
    # ~0.1 lr, so any regrouping of the sums (one process or two) moves that weight by ~3e-5 after
    # 20 steps. eps=1e-6 keeps such noise below 1e-6 and the test about the split itself.
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, eps=1e-6)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches(split, steps: int = STEPS, batch: int = GLOBAL_BATCH, seed: int = 0) -> list:
    """`steps` global batches drawn from the training images, reshuffled every epoch."""
    g = torch.Generator().manual_seed(seed)
    n, out, order = len(split.train_labels), [], []
    for _ in range(steps):
        if len(order) < batch:
            order = torch.randperm(n, generator=g).tolist()
        idx, order = order[:batch], order[batch:]
        out.append((split.train_images[idx], split.train_labels[idx]))
    return out


def _reference(batches, kind: str):
    def build():
        model = _model()
        return model, _optimizer(model.parameters(), kind), lambda m, b: F.cross_entropy(m(b[0]), b[1])

    return single_process_reference(build, batches, len(batches))


# --- what each rank runs ----------------------------------------------------------------------


def _train_hybrid(mesh, batches, kind: str, scheme: str, first_step: int):
    """Train the hybrid on this rank's slice of each global batch; check the ledger every step."""
    k, r = mesh.size("dp"), mesh.rank("dp")
    hybrid = apply_krizhevsky(_model(), mesh, "dp", scheme=scheme)
    opt = _optimizer(hybrid.parameters(), kind)
    formula = hybrid.comm_per_step(GLOBAL_BATCH)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        mesh.ledger.set_step(first_step + i)
        b = len(y) // k
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(hybrid(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b])
        loss.backward()
        mesh.ledger.set_step(-1)  # the check's own all-reduce is not part of the step's traffic
        norms.append(_grad_norm(hybrid, mesh))
        mesh.ledger.set_step(first_step + i)
        opt.step()
        losses.append(float(loss.detach()))
        rows = mesh.ledger.rows()
        measured = {op: (rows[(op, "dp")].count, rows[(op, "dp")].payload_bytes) for op in OPS}
        assert measured == formula, f"step {i}, scheme {scheme}: ledger {measured} != formula {formula}"
        assert set(rows) == {(op, "dp") for op in OPS}, f"unexpected collectives: {sorted(rows)}"
        for op in OPS:
            factor = 2 * (k - 1) / k if op == "all_reduce" else (k - 1) / k
            assert rows[(op, "dp")].bus_bytes == pytest.approx(factor * formula[op][1])
    mesh.ledger.set_step(first_step + len(batches))
    return losses, hybrid.gather_parameters(), formula, norms


def _grad_norm(hybrid, mesh) -> float:
    """The whole model's gradient norm by plait's one rule: the classifier's neuron shards split
    over the workers, the replicated (already averaged) conv gradients counted once."""
    sharded = {id(p) for stage in hybrid.stages for p in stage[0].parameters()}
    grads = [(p.grad, id(p) in sharded) for p in hybrid.parameters()]
    parts = [([g for g, s in grads if s], ("dp",)), ([g for g, s in grads if not s], ())]
    return global_grad_norm(mesh, parts)


def _evaluate(mesh, hybrid, images, labels) -> tuple[int, int]:
    """(correct, seen) on this rank's share of the held-out images (every rank the same count)."""
    k, r = mesh.size("dp"), mesh.rank("dp")
    b = len(labels) // k
    hybrid.eval()
    with torch.no_grad():
        pred = hybrid(images[r * b : (r + 1) * b]).argmax(dim=1)
    hybrid.train()
    return int((pred == labels[r * b : (r + 1) * b]).sum()), b


def _two_workers(batches, split):
    mesh = Mesh(dp=2)
    results = {
        ("c", "adamw"): _train_hybrid(mesh, batches, "adamw", "c", first_step=100),
        ("a", "sgd"): _train_hybrid(mesh, batches, "sgd", "a", first_step=200),
    }
    # End-to-end sanity: a short training of the hybrid reaches high held-out accuracy.
    hybrid = apply_krizhevsky(_model(), mesh, "dp")
    opt = _optimizer(hybrid.parameters(), "adamw")
    k, r = mesh.size("dp"), mesh.rank("dp")
    for x, y in _batches(split, steps=150, seed=1):
        b = len(y) // k
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(hybrid(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]).backward()
        opt.step()
    correct = _evaluate(mesh, hybrid, split.val_images, split.val_labels)
    mesh.close()
    return results, correct


def _four_workers(batches):
    mesh = Mesh(dp=4)
    results = {
        ("c", "adamw"): _train_hybrid(mesh, batches, "adamw", "c", first_step=100),
        ("a", "sgd"): _train_hybrid(mesh, batches, "sgd", "a", first_step=200),
    }
    try:
        apply_krizhevsky(_model(hidden=(126, 64)), mesh, "dp")
        error = None
    except ConfigError as exc:
        error = str(exc)
    mesh.close()
    return results, error


def _check_parity(results, references, k: int) -> None:
    for (scheme, kind), per_rank in results.items():
        ref = references[kind]
        # Each rank's loss is the mean over its own examples: their average is the global loss.
        losses = [sum(r[0][i] for r in per_rank) / k for i in range(STEPS)]
        what = f"hybrid K={k} scheme ({scheme}) {kind}:"
        for rank, (_, _, _, norms) in enumerate(per_rank):  # norms first: the clearest
            assert_close_grad_norms(norms, ref.grad_norms, rtol=1e-5, what=f"{what} rank {rank}")
        assert_close_losses(losses, ref.losses, atol=1e-5, what=what)
        for rank, (_, params, _, _) in enumerate(per_rank):
            assert_close_params(params, ref.params, atol=1e-5, what=f"{what} rank {rank}")


# --- tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split():
    return load_digits_dataset()


@pytest.fixture(scope="module")
def references(split):
    batches = _batches(split)
    return batches, {kind: _reference(batches, kind) for kind in ("adamw", "sgd")}


def test_hybrid_two_workers_parity_ledger_accuracy(split, references):
    batches, refs = references
    out = run_ranks(_two_workers, 2, args=(batches, split))
    _check_parity({key: [o[0][key] for o in out] for key in out[0][0]}, refs, k=2)
    # The formula, by hand: B=32, d=512, hidden 128, 64, 10 classes, 4,800 conv parameters, fp32.
    formula_c = out[0][0][("c", "adamw")][2]
    assert formula_c == {
        "all_gather": (6, 32 * (512 + 128 + 64) * 4),
        "reduce_scatter": (6, 32 * (512 + 128 + 64) * 4),
        "all_to_all": (2, 2 * 32 * 5 * 4),
        "all_reduce": (1, 4800 * 4),
    }
    assert out[0][0][("a", "sgd")][2]["all_gather"] == (3, 32 * (512 + 128 + 64) * 4)
    accuracy = sum(o[1][0] for o in out) / sum(o[1][1] for o in out)
    assert accuracy > 0.9, f"held-out accuracy {accuracy:.3f} after 150 hybrid steps"


def test_hybrid_four_workers_parity_ledger_bad_width(references):
    batches, refs = references
    out = run_ranks(_four_workers, 4, args=(batches,))
    _check_parity({key: [o[0][key] for o in out] for key in out[0][0]}, refs, k=4)
    formula_c = out[0][0][("c", "adamw")][2]
    # 10 classes padded to 12: each worker sends 3 logit columns of all 32 examples.
    assert formula_c["all_to_all"] == (2, 2 * 32 * 3 * 4)
    assert formula_c["all_gather"] == (12, 32 * (512 + 128 + 64) * 4)
    error = out[0][1]
    assert error is not None and "classifier.0" in error and "126" in error and "4 workers" in error


def test_plan_rejects_bad_models():
    with pytest.raises(ConfigError, match=r"classifier\.2 \(Linear 128->63\).*63 output neurons.*2 workers"):
        check_krizhevsky(_model(hidden=(128, 63)), 2)
    plan = check_krizhevsky(_model(hidden=(129, 63)), 3)  # hidden widths divide by 3; classes are padded
    assert (plan.feature_dim, plan.widths, plan.padded_classes, plan.conv_params) == (
        512,
        [129, 63, 10],
        12,
        4800,
    )
    model = _model()
    model.classifier.insert(2, nn.Dropout(0.5))
    with pytest.raises(ConfigError, match=r"classifier\.2 \(Dropout\) cannot be split"):
        check_krizhevsky(model, 2)
    with pytest.raises(ConfigError, match="features"):
        check_krizhevsky(nn.Sequential(nn.Linear(4, 4)), 2)
    with pytest.raises(ConfigError, match="does not split"):
        krizhevsky_comm(check_krizhevsky(_model(), 4), global_batch=30)


def test_formula_matches_pure_data_parallel_crossover():
    """The paper's argument in numbers: the exchange grows with the batch, DP's all-reduce with Psi."""
    plan = check_krizhevsky(_model(), 2)
    psi = sum(p.numel() for p in _model().parameters())
    for batch, hybrid_wins in ((32, True), (512, False)):
        c = krizhevsky_comm(plan, batch)
        hybrid_bus = (
            0.5 * (c["all_gather"][1] + c["reduce_scatter"][1] + c["all_to_all"][1]) + c["all_reduce"][1]
        )
        assert (hybrid_bus < psi * 4) == hybrid_wins  # DP bus bytes at K=2: 2(K-1)/K Psi s = Psi s


def test_digits_dataset(split):
    assert split.train_images.shape == (1438, 1, 8, 8) and split.val_images.shape == (359, 1, 8, 8)
    assert split.train_images.dtype == torch.float32 and split.train_labels.dtype == torch.int64
    assert float(split.train_images.min()) == 0.0 and float(split.train_images.max()) == 1.0
    assert sorted(split.val_labels.unique().tolist()) == list(range(10))
    again = load_digits_dataset()
    assert torch.equal(again.val_images, split.val_images)
    other = load_digits_dataset(held_out_fraction=0.5, seed=1)
    assert len(other.val_labels) == 898 and not torch.equal(other.val_labels[:359], split.val_labels)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        load_digits_dataset(held_out_fraction=1.0)


def test_digits_without_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ConfigError, match=r"pip install 'plait\[digits\]'"):
        load_digits_dataset()


def test_digits_cnn():
    model = _model()
    x = torch.rand(5, 1, 8, 8)
    assert model(x).shape == (5, 10)
    assert torch.equal(model(x), model.classifier(model.features(x)))
    conv = sum(p.numel() for p in model.features.parameters())
    fc = sum(p.numel() for p in model.classifier.parameters())
    assert (conv, fc) == (4800, 74570)
    assert DigitsCNN(n_classes=3, channels=(4,), hidden=()).classifier[0].in_features == 64
    for bad in ({"channels": ()}, {"hidden": (0,)}, {"n_classes": 0}, {"image_size": 7}):
        with pytest.raises(ConfigError):
            DigitsCNN(**bad)
