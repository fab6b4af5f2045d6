"""DistributedBatchSampler and eval_batches of plait.data."""

import pytest
import torch

from plait.data import DistributedBatchSampler, eval_batches
from plait.errors import CheckpointError, ConfigError

SEQ = 8


def _stream(n: int = 2000) -> torch.Tensor:
    # Distinct values make every window identifiable by its first token.
    return torch.arange(n, dtype=torch.long)


def _global(sampler_kwargs, dp_size, micro_batches=1, steps=1):
    """The global batches as seen by concatenating every rank's micro-batches in rank order."""
    samplers = [
        DistributedBatchSampler(dp_rank=r, dp_size=dp_size, micro_batches=micro_batches, **sampler_kwargs)
        for r in range(dp_size)
    ]
    out = []
    for _ in range(steps):
        parts = [mb for s in samplers for mb in s.next_batch()]
        out.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    return out, samplers


def test_windows_are_next_token_pairs():
    s = DistributedBatchSampler(_stream(), SEQ, global_batch=4, dp_rank=0, dp_size=1, seed=0)
    [(x, y)] = s.next_batch()
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, x + 1)
    assert torch.all(x[:, 0] % (SEQ + 1) == 0)  # epoch 0 windows start on the unshifted grid


@pytest.mark.parametrize("dp_size, micro_batches", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_ranks_partition_the_dp1_global_batch(dp_size, micro_batches):
    kwargs = dict(tokens=_stream(), seq_len=SEQ, global_batch=8, seed=5)
    reference, _ = _global(kwargs, dp_size=1, steps=3)
    split, samplers = _global(kwargs, dp_size=dp_size, micro_batches=micro_batches, steps=3)
    for (rx, ry), (sx, sy) in zip(reference, split):
        assert torch.equal(rx, sx) and torch.equal(ry, sy)
    # Each rank gets its own contiguous, disjoint rows, in micro-batches of the right size.
    fresh = [DistributedBatchSampler(**kwargs, dp_rank=r, dp_size=dp_size, micro_batches=micro_batches)
             for r in range(dp_size)]  # fmt: skip
    firsts = []
    for s in fresh:
        mbs = s.next_batch()
        assert len(mbs) == micro_batches
        assert all(x.shape == (8 // dp_size // micro_batches, SEQ) for x, _ in mbs)
        firsts.append(set(torch.cat([x[:, 0] for x, _ in mbs]).tolist()))
    assert sum(len(f) for f in firsts) == len(set().union(*firsts)) == 8


def test_deterministic_from_seed_and_independent_of_global_rng():
    kwargs = dict(tokens=_stream(), seq_len=SEQ, global_batch=4, dp_rank=0, dp_size=1)
    torch.manual_seed(0)
    a = DistributedBatchSampler(**kwargs, seed=1).next_batch()[0][0]
    torch.manual_seed(123)
    torch.rand(10)
    b = DistributedBatchSampler(**kwargs, seed=1).next_batch()[0][0]
    c = DistributedBatchSampler(**kwargs, seed=2).next_batch()[0][0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_epoch_rollover_covers_every_window_then_reshuffles_and_shifts():
    tokens = _stream(10 * (SEQ + 1) + 3)  # 10 windows; global batch 3 -> 3 batches, 1 dropped
    s = DistributedBatchSampler(tokens, SEQ, global_batch=3, dp_rank=0, dp_size=1, seed=0)
    assert s.batches_per_epoch() == 3
    epoch0 = [s.next_batch()[0][0] for _ in range(3)]
    starts0 = torch.cat([x[:, 0] for x in epoch0])
    assert len(set(starts0.tolist())) == 9  # distinct windows, one window of ten dropped
    assert s.state_dict() == {"epoch": 1, "index": 0, "seed": 0}
    epochs = [torch.cat([s.next_batch()[0][0][:, 0] for _ in range(s.batches_per_epoch())]) for _ in range(4)]
    assert s.epoch == 5
    # Later epochs start windows off the epoch-0 grid at least once, and in a different order.
    offsets = {int(e[0]) % (SEQ + 1) for e in epochs}
    assert offsets != {0}
    assert all(len(set((e % (SEQ + 1)).tolist())) == 1 for e in epochs)  # one offset per epoch
    assert not torch.equal(starts0, epochs[0])


def test_no_shift_keeps_the_grid():
    s = DistributedBatchSampler(_stream(200), SEQ, 4, 0, 1, seed=3, shift_windows=False)
    for _ in range(20):
        assert torch.all(s.next_batch()[0][0][:, 0] % (SEQ + 1) == 0)


def test_state_dict_resumes_exactly():
    kwargs = dict(tokens=_stream(300), seq_len=SEQ, global_batch=4, dp_rank=1, dp_size=2, seed=9)
    a = DistributedBatchSampler(**kwargs, micro_batches=2)
    for _ in range(11):  # crosses an epoch boundary (7 batches per epoch)
        a.next_batch()
    state = a.state_dict()
    assert state["epoch"] == 1 and all(type(v) is int for v in state.values())
    expected = [a.next_batch() for _ in range(10)]
    b = DistributedBatchSampler(**{**kwargs, "seed": 0}, micro_batches=2)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch()
        assert all(torch.equal(gx, wx) and torch.equal(gy, wy) for (gx, gy), (wx, wy) in zip(got, want))
    with pytest.raises(CheckpointError, match="index"):
        b.load_state_dict({"epoch": 0, "index": 10_000, "seed": 9})
    with pytest.raises(CheckpointError, match="lacks"):
        b.load_state_dict({"epoch": 0})
    assert b.state_dict() == a.state_dict()  # failed loads left the position alone


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_batch=6, dp_size=4), "divisible"),
        (dict(global_batch=8, dp_size=2, micro_batches=3), "micro_batches"),
        (dict(global_batch=8, dp_size=2, dp_rank=2), "dp_rank"),
        (dict(global_batch=8, dp_size=0), "dp_size"),
        (dict(global_batch=300, dp_size=1), "windows"),
    ],
)
def test_bad_sizes_raise_config_error(kwargs, match):
    args = dict(tokens=_stream(2000), seq_len=SEQ, dp_rank=0, seed=0) | kwargs
    with pytest.raises(ConfigError, match=match):
        DistributedBatchSampler(**args)


def test_divisibility_error_suggests_a_valid_batch():
    with pytest.raises(ConfigError, match="global_batch=8 or 12"):
        DistributedBatchSampler(
            _stream(), SEQ, global_batch=10, dp_rank=0, dp_size=2, seed=0, micro_batches=2
        )


def test_eval_batches_are_contiguous_and_deterministic():
    tokens = _stream(5 * 3 * (SEQ + 1) + 4)  # room for 5 full batches of 3
    batches = eval_batches(tokens, SEQ, batch_size=3, n_batches=4)
    assert len(batches) == 4
    x0, y0 = batches[0]
    assert x0.shape == (3, SEQ) and torch.equal(y0, x0 + 1)
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert torch.equal(starts, torch.arange(12) * (SEQ + 1))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, eval_batches(tokens, SEQ, 3, 4)))
    assert len(eval_batches(tokens, SEQ, 3, n_batches=100)) == 5
    assert len(eval_batches(tokens, SEQ, 3, None)) == 5
    with pytest.raises(ConfigError, match="eval batch"):
        eval_batches(tokens[:20], SEQ, 3, 1)
