"""`plait.parity.compare.compare` on hand-made traces (issue 39, item 6b): a run whose loss,
gradient norm or gradient is *below* the reference's differs as surely as one above it (a
one-sided check, `got - want > tol`, let planted bugs through), and a run within the tolerance
either way holds. Pure Python: no ranks."""

from __future__ import annotations

import pytest
import torch

from plait.parity.compare import Trace, compare, relative

TOL = 1e-5
LR = 0.1
OFF = 10 * TOL  # every planted difference is 10x the tolerance


def _trace(name: str, losses, norms, grad_scale: float = 1.0) -> Trace:
    """Two steps of SGD on two parameters, with gradients `grad_scale` x the reference's."""
    p = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}
    g = {"w": torch.tensor([0.3, 0.1, -0.2]), "b": torch.tensor([0.4])}
    params = [dict(p)]
    for _ in losses:
        p = {n: v - LR * grad_scale * g[n] for n, v in p.items()}
        params.append(dict(p))
    return Trace(name, list(losses), list(norms), params)


REF_LOSSES, REF_NORMS = [2.0, 1.5], [0.6, 0.55]


def _ref() -> Trace:
    return _trace("one process", REF_LOSSES, REF_NORMS)


@pytest.mark.parametrize("sign", [-1.0, 1.0], ids=["below", "above"])
@pytest.mark.parametrize("what", ["loss", "grad_norm"])
def test_a_loss_or_gradient_norm_off_either_way_differs(what, sign):
    losses, norms = list(REF_LOSSES), list(REF_NORMS)
    values = losses if what == "loss" else norms
    values[1] *= 1 + sign * OFF  # step 2 only: the first step agrees
    result = compare(_ref(), _trace("run", losses, norms), TOL)
    assert not result["holds"], f"{what} {sign * OFF:+.0e} relative held"
    label = "the loss" if what == "loss" else "the gradient norm"
    assert result["where"] == f"{label} of step 2", result["where"]
    rel = result["steps"][1][f"{what}_rel"]
    assert rel == pytest.approx(OFF, rel=1e-6) and result["steps"][0][f"{what}_rel"] == 0.0


@pytest.mark.parametrize("ref_loss", [2.0, -3.0, 1e-3], ids=["positive", "negative", "small"])
def test_a_lower_loss_of_any_sign_differs(ref_loss):
    ref = _trace("one process", [ref_loss, ref_loss], REF_NORMS)
    low = ref_loss - abs(ref_loss) * OFF
    result = compare(ref, _trace("run", [ref_loss, low], REF_NORMS), TOL)
    assert not result["holds"] and result["where"] == "the loss of step 2"
    assert relative(low, ref_loss) == pytest.approx(OFF, rel=1e-6)
    assert relative(ref_loss, low) == pytest.approx(OFF, rel=1e-3)  # symmetric up to the denominator


@pytest.mark.parametrize("scale", [1 - 1e3 * OFF, 1 + 1e3 * OFF], ids=["smaller", "larger"])
def test_a_gradient_smaller_or_larger_than_the_reference_differs(scale):
    run = _trace("run", REF_LOSSES, REF_NORMS, grad_scale=scale)
    result = compare(_ref(), run, TOL)
    assert not result["holds"] and result["differing"], result["where"]
    first = result["differing"][0]
    assert first["step"] == 1 and first["rel"] == pytest.approx(abs(1 - scale), rel=1e-3)


@pytest.mark.parametrize("sign", [-1.0, 1.0], ids=["below", "above"])
def test_within_the_tolerance_either_way_holds(sign):
    """The check is not simply strict: a tenth of the tolerance either way holds."""
    losses = [v * (1 + sign * TOL / 10) for v in REF_LOSSES]
    norms = [v * (1 - sign * TOL / 10) for v in REF_NORMS]
    result = compare(_ref(), _trace("run", losses, norms), TOL)
    assert result["holds"], result["where"]


def test_a_non_finite_loss_or_norm_differs():
    for losses, norms in (([2.0, float("nan")], REF_NORMS), (REF_LOSSES, [0.6, float("-inf")])):
        assert not compare(_ref(), _trace("run", losses, norms), TOL)["holds"]
