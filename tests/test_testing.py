"""The parity helpers themselves: they must fail on differences, shapes, missing keys and NaN."""

import pytest
import torch

from plait.testing import assert_close_losses, assert_close_params, compare_tensors


def test_parity_helpers_catch_every_kind_of_mismatch():
    ok = {"w": torch.tensor([1.0, 2.0])}
    assert compare_tensors({"w": torch.tensor([1.0, 2.0 + 1e-7])}, ok, atol=1e-6) == []
    assert compare_tensors({"w": torch.tensor([1.0, 2.1])}, ok, atol=1e-6)
    assert compare_tensors({"w": torch.tensor([float("nan"), 2.0])}, ok, atol=1e-6)
    assert compare_tensors({"w": torch.tensor([1.0, 2.0, 3.0])}, ok)
    assert compare_tensors({"v": torch.tensor([1.0, 2.0])}, ok)
    with pytest.raises(AssertionError, match="w"):
        assert_close_params({"w": torch.tensor([1.0, 3.0])}, ok)
    assert_close_losses([1.0, 2.0], [1.0, 2.0 + 1e-7], atol=1e-6)
    for bad in ([1.0, 2.1], [float("nan"), 2.0], [1.0]):
        with pytest.raises(AssertionError):
            assert_close_losses(bad, [1.0, 2.0], atol=1e-6)
