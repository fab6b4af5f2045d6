"""Disk offload of optimizer state (ZeRO-Infinity): same parameters as the plain optimizer, state on
disk between steps, clear errors for an unwritable path or a full disk, files removed at close."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from plait.errors import ConfigError
from plait.optim import LAMB, LARS
from plait.zero import offload_disk
from plait.zero.offload_disk import DiskStateOptimizer, OffloadError

SHAPES = [(37,), (5, 7), (64,), (3, 4, 5), (1,)]


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(step: int) -> list[torch.Tensor | None]:
    """The gradients of step `step`; parameter 3 has none every third step (both must skip it)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [None if (k == 3 and step % 3 == 0) else torch.randn(s, generator=g) for k, s in enumerate(SHAPES)]


def train(params, opt, steps: range) -> None:
    for step in steps:
        for p, grad in zip(params, grads(step)):
            p.grad = grad
        opt.step()
        opt.zero_grad()


def run(build, wrap: bool, tmp_path, steps: int = 20, chunk: int = 1, groups: bool = False):
    params = make_params()
    spec = [{"params": params[:2], "lr": 0.02}, {"params": params[2:]}] if groups else params
    opt = build(spec)
    if wrap:
        opt = DiskStateOptimizer(opt, tmp_path, chunk_params=chunk)
    train(params, opt, range(steps))
    return params, opt


OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "lamb": lambda ps: LAMB(ps, lr=1e-2),
    "lars": lambda ps: LARS(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_bit_identical_to_plain_optimizer(name, chunk, tmp_path):
    build = OPTIMIZERS[name]
    ref, plain = run(build, False, tmp_path, groups=chunk == 3)
    got, disk = run(build, True, tmp_path, chunk=chunk, groups=chunk == 3)
    for a, b in zip(ref, got):
        assert torch.equal(a, b), name
    # The state read back from disk is the plain optimizer's state, and it round-trips.
    sd_ref, sd = plain.state_dict(), disk.state_dict()
    assert sd["param_groups"] == sd_ref["param_groups"]
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        assert st.keys() == sd["state"][i].keys()
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sd["state"][i][key])), (i, key)
    assert disk.resident_state_bytes() <= 8 * len(SHAPES)  # 0-dim step counters at most
    disk.close()


def test_state_dict_round_trip_and_resume(tmp_path):
    build = OPTIMIZERS["adamw_fused"]
    ref, _ = run(build, False, tmp_path, steps=6)
    params, disk = run(build, True, tmp_path, steps=3)
    sd = disk.state_dict()
    disk.close()
    # A fresh optimizer over copies of the parameters, loaded from the state dict, continues identically.
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    disk2 = DiskStateOptimizer(build(resumed), tmp_path)
    disk2.load_state_dict(sd)
    assert disk2.resident_state_bytes() <= 8 * len(SHAPES)
    assert disk2.disk_state_bytes() == 2 * 4 * sum(p.numel() for p in params)
    train(resumed, disk2, range(3, 6))
    for a, b in zip(ref, resumed):
        assert torch.equal(a, b)
    disk2.close()


def test_existing_state_moves_to_disk_and_files_removed_at_close(tmp_path):
    params = make_params()
    inner = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    inner.step()
    opt = DiskStateOptimizer(inner, tmp_path / "nested" / "dir", rank=3)
    assert opt.dir.parent == tmp_path / "nested" / "dir" and opt.dir.name.startswith("rank3-")
    assert not inner.state and opt.resident_state_bytes() <= 4 * len(SHAPES)
    names = sorted(os.listdir(opt.dir))
    assert names[:2] == ["p0.exp_avg.bin", "p0.exp_avg_sq.bin"] and len(names) == 2 * len(SHAPES)
    assert opt.disk_state_bytes() == 2 * 4 * sum(p.numel() for p in params)
    opt.close()
    with pytest.raises(OffloadError, match="closed"):
        opt.step()
    assert not opt.dir.exists()
    opt.close()  # idempotent
    assert opt.disk_state_bytes() == 0


def test_finalizer_removes_directory_when_collected(tmp_path):
    opt = DiskStateOptimizer(torch.optim.SGD(make_params(), lr=0.1, momentum=0.9), tmp_path)
    d = opt.dir
    assert d.is_dir()
    del opt
    assert not d.exists()


def test_memory_drop_against_plain_adamw(tmp_path, capsys):
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(8)]  # 8M fp32 parameters
    for p in params:
        p.grad = torch.randn_like(p)
    rss0 = rss()
    disk = DiskStateOptimizer(torch.optim.AdamW(params, lr=1e-3, fused=True), tmp_path, chunk_params=1)
    disk.step()
    disk.step()
    rss1 = rss()
    resident = disk.resident_state_bytes()
    on_disk = disk.disk_state_bytes()
    plain = torch.optim.AdamW(params, lr=1e-3, fused=True)
    plain.step()
    rss2 = rss()
    plain_bytes = sum(
        v.untyped_storage().nbytes() for s in plain.state.values() for v in s.values() if torch.is_tensor(v)
    )
    drop = 1 - resident / plain_bytes
    with capsys.disabled():
        print(
            f"\n[disk offload] plain AdamW state {plain_bytes / 2**20:.1f} MiB; offloaded resident "
            f"{resident} B ({drop:.4%} drop), on disk {on_disk / 2**20:.1f} MiB; process RSS growth "
            f"over the first steps: offloaded {(rss1 - rss0) / 2**20:+.1f} MiB, "
            f"plain {(rss2 - rss1) / 2**20:+.1f} MiB"
        )
    assert plain_bytes == 2 * 4 * (8 << 20) + 8 * 4  # exp_avg, exp_avg_sq and a 0-dim fp32 step each
    assert on_disk == 2 * 4 * (8 << 20) and resident == 8 * 4
    assert drop >= 0.8
    disk.close()


def test_unwritable_path_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afile" / "sub"
    with pytest.raises(OffloadError, match=r"offload path .*afile/sub is not writable: \[Errno 20\]") as e:
        DiskStateOptimizer(torch.optim.SGD(make_params(), lr=0.1), bad)
    assert "set [offload] path to a writable directory" in str(e.value)


def test_full_disk_is_an_error_and_no_partial_file_is_read(tmp_path, monkeypatch):
    params = make_params()
    opt = DiskStateOptimizer(torch.optim.AdamW(params, lr=1e-3), tmp_path)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = {n: (opt.dir / n).read_bytes() for n in os.listdir(opt.dir)}
    real = offload_disk._write_file

    def full_disk(path, data):
        with open(path, "wb") as f:  # half of the bytes land, then the disk is full
            f.write(bytes(data.cast("B"))[: len(data.cast("B")) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(offload_disk, "_write_file", full_disk)
    with pytest.raises(OffloadError) as e:
        opt.step()
    msg = str(e.value)
    assert "p0.exp_avg.bin" in msg and f"({4 * 37} bytes needed)" in msg
    assert (
        "[Errno 28] No space left on device" in msg and "free space or choose another [offload] path" in msg
    )
    # No temporary left behind; the files on disk are the last complete ones.
    assert {n: (opt.dir / n).read_bytes() for n in os.listdir(opt.dir)} == before
    assert opt.resident_state_bytes() <= 4 * len(SHAPES)
    # The state no longer matches the parameters: stepping again is refused until a checkpoint loads.
    monkeypatch.setattr(offload_disk, "_write_file", real)
    with pytest.raises(OffloadError, match="load a checkpoint"):
        opt.step()
    opt.load_state_dict(torch.optim.AdamW(make_params(), lr=1e-3).state_dict())
    opt.step()
    assert opt.disk_state_bytes() == 2 * 4 * sum(p.numel() for p in params)
    opt.close()


def test_truncated_file_is_an_error(tmp_path):
    params = make_params()
    opt = DiskStateOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), tmp_path)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    (opt.dir / "p0.momentum_buffer.bin").write_bytes(b"\0" * 8)
    with pytest.raises(OffloadError, match=r"p0.momentum_buffer.bin has 8 bytes, expected 148"):
        opt.step()
    opt.close()


def test_bad_arguments(tmp_path):
    reducer = lambda t: t
    with pytest.raises(OffloadError, match="'disk' with optim.name = 'lamb' is not available: the norms"):
        DiskStateOptimizer(LAMB(make_params(), norm_reducer=reducer), tmp_path)
    with pytest.raises(OffloadError, match="'disk' with optim.name = 'lars' is not available"):
        DiskStateOptimizer(LARS(make_params(), lr=0.1, norm_reducer=reducer), tmp_path)
    with pytest.raises(ConfigError, match="chunk_params"):
        DiskStateOptimizer(torch.optim.SGD(make_params(), lr=0.1), tmp_path, chunk_params=0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DiskStateOptimizer(object(), tmp_path)
    assert not list(tmp_path.iterdir())


def test_lr_scheduler_on_inner_and_pass_throughs(tmp_path):
    params = make_params()
    opt = DiskStateOptimizer(torch.optim.SGD(params, lr=1.0, momentum=0.9), tmp_path)
    sched = torch.optim.lr_scheduler.StepLR(opt.inner, step_size=1, gamma=0.5)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.25 and opt.defaults["momentum"] == 0.9
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    assert opt.step(closure=lambda: 3.0) == 3.0  # no gradients: nothing to step, closure still runs
    opt.close()
