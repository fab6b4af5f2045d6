"""The gradient synchroniser's records on one process: a bucket's flat buffer (its dtype and device,
padding, views, release) and how parameters are cut into buckets. The collectives are in
test_gradsync.py (2 and 4 ranks); these run first in `make mutate MODULE=plait/gradsync.py`, so a
mutant of the plumbing is caught in a second, not after the ranks' fixtures."""

from __future__ import annotations

import pytest
import torch

from plait.errors import DataParallelError
from plait.gradsync import GradBucket, GradSync, bucket_chunks, build_buckets


def _p(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))


def test_a_bucket_takes_its_params_dtype_unless_told_and_pads_to_n():
    a, b = _p(2, 3, dtype=torch.float64), _p(5, dtype=torch.float64)
    bucket = GradBucket(3, [a, b], ["a", "b"], n=4)
    assert (bucket.index, bucket.names, bucket.axis) == (3, ["a", "b"], None)
    assert bucket.offsets == [0, 6] and bucket.numel == 12  # 11 elements padded to a multiple of 4
    assert bucket.dtype == torch.float64 and bucket.device == a.device
    assert bucket.nbytes == 12 * 8
    assert not bucket.allocated and bucket.ready == set() and bucket.handle is None and bucket.out is None
    buf = bucket.buffer
    assert bucket.allocated and buf.dtype == torch.float64 and buf.shape == (12,) and not buf.any()
    bucket.view(1).fill_(2.0)
    bucket.view(0)[1, 2] = 1.0
    assert buf.tolist() == [0.0] * 5 + [1.0] + [2.0] * 5 + [0.0]
    assert bucket.view(0).shape == (2, 3) and bucket.buffer is buf
    bucket.release()
    assert not bucket.allocated and not bucket.buffer.any()
    told = GradBucket(0, [a], ["a"], dtype=torch.float32, device=torch.device("cpu"), axis="tp")
    assert told.dtype == torch.float32 and told.nbytes == 6 * 4 and told.axis == "tp"
    assert told.buffer.dtype == torch.float32 and told.numel == 6
    bucket.buffer = torch.ones(12, dtype=torch.float64)
    assert bucket.allocated and bucket.buffer.sum() == 12


def test_buckets_are_runs_under_the_capacity_of_one_dtype_and_key():
    f = [_p(4), _p(4), _p(4), _p(10), _p(2)]  # 16, 16, 16, 40, 8 bytes
    d = _p(2, dtype=torch.float64)
    assert bucket_chunks(f, 32) == [[f[0], f[1]], [f[2]], [f[3]], [f[4]]]
    assert bucket_chunks(f, 48) == [[f[0], f[1], f[2]], [f[3], f[4]]]
    assert bucket_chunks([f[0], d, f[1]], 1000) == [[f[0]], [d], [f[1]]]
    keys = {id(f[0]): "x", id(f[1]): "x", id(f[2]): "y"}
    assert bucket_chunks(f[:3], 1000, key=lambda p: keys[id(p)]) == [[f[0], f[1]], [f[2]]]
    assert bucket_chunks(f[:3], 1000, nbytes=lambda p: 600) == [[f[0]], [f[1]], [f[2]]]
    assert bucket_chunks([], 10) == []
    index = {id(p): i for i, p in enumerate(f)}
    named = build_buckets(f, 32, name=lambda p: f"w{index[id(p)]}")
    assert [b.index for b in named] == [0, 1, 2, 3]
    assert [b.names for b in named] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert named[0].numel == 8  # unpadded
    assert build_buckets(f[:1], 32)[0].names == [f"param{id(f[0])}"]


@pytest.mark.parametrize(
    "kw, err, says",
    [
        ({"reduce": "gather"}, ValueError, "reduce 'gather' is not valid; valid: all_reduce, reduce_scatter"),
        ({"trigger": "auto"}, DataParallelError, "trigger 'auto' is not valid; valid: hook, manual"),
        ({"missing": "drop"}, ValueError, "missing 'drop' is not valid; valid: error, zeros, skip"),
    ],
)
def test_a_bad_choice_is_refused_naming_the_valid_ones(kw, err, says):
    with pytest.raises(err) as e:
        GradSync([], None, "dp", **kw)
    assert str(e.value) == says
