"""plait.parallelize, the custom-loop API: the example's own model (examples/custom_loop.py) at 2
ranks follows one process within 1e-5 (losses, gradient norms, parameters) under dp, ZeRO-1 with
gradient accumulation, ZeRO-3 and tp; a checkpoint saved at 2 ranks loads at 1 (parameters and
optimizer state) and continues as the uninterrupted run; bad input is one clear error; and the
example runs end to end under `plait launch` and as a plain process."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plait
from plait.errors import ConfigError
from plait.testing import (
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    grad_norm,
    run_ranks,
    state_of,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_loop.py"
_spec = importlib.util.spec_from_file_location("custom_loop_example", EXAMPLE)
ex = importlib.util.module_from_spec(_spec)
sys.modules["custom_loop_example"] = ex  # so the ranks (forked from a server) can unpickle what refers to it
_spec.loader.exec_module(ex)

STEPS, ROWS = 8, 32
# SGD with momentum and no clipping: a gradient of the wrong scale moves the parameters by the
# wrong amount from the first step; AdamW with clipping: the gradient norm and the clip are global.
OPTIMIZERS = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), 0.0),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=3e-3), 0.5),
}
# name: (ranks, mesh_or_config, optimizer, micro-batches, tensor parallel)
CASES = {
    "dp2": (2, {"dp": 2}, "sgd", 1, False),
    "dp2_zero1_accum": (2, {"zero_stage": 1}, "sgd", 2, False),
    "dp2_zero3": (2, {"zero_stage": 3}, "adamw", 1, False),
    "tp2_zero1": (2, {"tp": 2, "zero_stage": 1}, "sgd", 1, True),
    # a Mesh built by the user, the training options beside it; recomputing the blocks
    "mesh_dp2_zero2_recompute": (
        2,
        {"mesh": True, "zero_stage": 2, "activation_checkpointing": True},
        "sgd",
        1,
        False,
    ),
    "dp2_tp2_zero2": (4, {"dp": 2, "tp": 2, "zero_stage": 2}, "sgd", 1, True),
    "dp4_hybrid2_zero3": (4, {"zero_stage": 3, "hybrid_shard": 2}, "adamw", 2, False),
}
SAVED = "dp2_zero3"  # also steps a scheduler, saved with the checkpoint
SAVED_TP = "tp2_zero1"  # ZeRO over a dp axis of 1 beside tp: replicated tensors saved once


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def _reference(opt: str, steps: int, snapshot_at: int | None = None, scheduler: bool = False):
    """One process, plain PyTorch: losses, gradient norms, final parameters, and the optimizer
    state by parameter name at step `snapshot_at`."""
    make, clip = OPTIMIZERS[opt]
    torch.manual_seed(0)
    model = ex.Net()
    optimizer = make(model.parameters())
    sched = _scheduler(optimizer) if scheduler else None
    data = ex.make_data()
    losses, norms, snap = [], [], None
    for step in range(steps):
        loss = ex.loss_fn(model, ex.global_batch(data, step, ROWS))
        loss.backward()
        norms.append(grad_norm(model.parameters()))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if sched is not None:
            sched.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if step + 1 == snapshot_at:
            snap = _optim_state(model, optimizer)
    return losses, norms, state_of(model), snap


def _optim_state(model, optimizer) -> dict:
    return {
        f"{n}.{k}": v.detach().clone().float()
        for n, p in model.named_parameters()
        for k, v in optimizer.state[p].items()
    }


def _train(engine, data, start: int, steps: int, micro_batches: int = 1):
    losses, norms = [], []
    for step in range(start, start + steps):
        losses.append(
            engine.forward_backward(
                engine.shard(ex.global_batch(data, step, ROWS)), micro_batches=micro_batches
            )
        )
        norms.append(engine.grad_norm())
        engine.step()
    return losses, norms


def _cases(ckpt: str) -> dict:
    import torch.distributed as dist

    out = {}
    data = ex.make_data()
    for name, (world, config, opt, mb, tp) in CASES.items():
        if world != dist.get_world_size():
            continue
        make, clip = OPTIMIZERS[opt]
        torch.manual_seed(0)
        model = ex.Net()
        options = None
        if config.get("mesh"):
            options = {k: v for k, v in config.items() if k != "mesh"}
            config = plait.Mesh(dp=world)
        engine = plait.parallelize(
            model,
            make,
            config,
            options=options,
            loss_fn=ex.loss_fn,
            tp_plan=ex.TP_PLAN if tp else None,
            blocks=list(model.blocks),
            grad_clip=clip,
            scheduler=_scheduler if name == SAVED else None,
        )
        losses, norms = _train(engine, data, 0, STEPS, mb)
        out[name] = {"losses": losses, "norms": norms, "params": engine.full_parameters()}
        out[name]["info"] = (engine.rank, engine.world, engine.dp_rank, engine.dp, engine.steps)
        out[name]["recomputed"] = sum(bool(getattr(b, "_plait_recompute", False)) for b in model.blocks)
        if name == SAVED:
            engine.save(ckpt)
        if name == SAVED_TP:
            engine.save(ckpt + "-tp")
        engine.close()
        if options is not None:
            config.close()  # the Mesh is the caller's to close
    if dist.get_world_size() != 2:
        return out
    errors = {}
    try:  # tp without layout rules
        plait.parallelize(ex.Net(), OPTIMIZERS["sgd"][0], {"tp": 2})
    except ConfigError as exc:
        errors["tp_no_rules"] = str(exc)
    try:  # more ranks than the world has
        plait.parallelize(ex.Net(), OPTIMIZERS["sgd"][0], {"dp": 4})
    except ConfigError as exc:
        errors["dp4"] = str(exc)
    mesh = plait.Mesh(dp=2)
    try:  # a Mesh fixes dp
        plait.parallelize(ex.Net(), OPTIMIZERS["sgd"][0], mesh, options={"dp": 2})
    except ConfigError as exc:
        errors["mesh_dp"] = str(exc)
    mesh.close()
    out["errors"] = errors
    return out


def _load_at_one(ckpt: str) -> dict:
    torch.manual_seed(123)  # another initialisation: every value must come from the checkpoint
    model = ex.Net()
    make, clip = OPTIMIZERS["adamw"]
    engine = plait.parallelize(model, make, None, loss_fn=ex.loss_fn, grad_clip=clip, scheduler=_scheduler)
    step = engine.load(ckpt)
    out = {
        "step": step,
        "lr": engine.optimizer.param_groups[0]["lr"],
        "sched_epoch": engine.scheduler.last_epoch,
        "world": engine.world,
        "params": engine.full_parameters(),
        "optim": _optim_state(engine.unwrapped, engine.optimizer),
    }
    out["losses"], _ = _train(engine, ex.make_data(), step, 4)
    out["final"] = engine.full_parameters()
    engine.close()
    model = ex.Net()
    engine = plait.parallelize(model, OPTIMIZERS["sgd"][0], None, loss_fn=ex.loss_fn)
    out["tp_step"] = engine.load(ckpt + "-tp")
    out["tp_params"] = engine.full_parameters()
    out["tp_optim"] = _optim_state(engine.unwrapped, engine.optimizer)
    engine.close()
    # no loss_fn: the model's own output is the loss, called as model(*batch)
    torch.manual_seed(0)
    engine = plait.parallelize(_WithLoss(ex.Net()), OPTIMIZERS["sgd"][0], {})
    out["own_loss"] = engine.forward_backward(ex.global_batch(ex.make_data(), 0, ROWS))
    engine.close()
    engine = plait.parallelize(ex.Net(), OPTIMIZERS["sgd"][0], {})
    try:  # logits are not a loss
        engine.forward_backward(ex.global_batch(ex.make_data(), 0, ROWS)[0])
    except ConfigError as exc:
        out["not_scalar"] = str(exc)
    engine.close()
    return out


class _WithLoss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return ex.loss_fn(self.net, (x, y))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("custom-loop") / "ckpt")
    two = run_ranks(_cases, 2, args=(ckpt,), timeout=300)
    one = run_ranks(_load_at_one, 1, args=(ckpt,), timeout=120)[0]
    four = run_ranks(_cases, 4, args=(ckpt,), timeout=300)
    return two, one, four


@pytest.mark.parametrize("name", list(CASES))
def test_parallel_ranks_follow_one_process(runs, name):
    two, _, four = runs
    world, config, opt, _, _ = CASES[name]
    losses, norms, params, _ = _reference(opt, STEPS, scheduler=name == SAVED)
    for rank, got in enumerate(two if world == 2 else four):
        r = got[name]
        assert_close_losses(r["losses"], losses, atol=1e-5, what=f"{name} rank {rank}")
        assert_close_grad_norms(r["norms"], norms, rtol=1e-5, what=f"{name} rank {rank}")
        assert_close_params(r["params"], params, atol=1e-5, what=f"{name} rank {rank}")
        assert r["recomputed"] == (2 if config.get("activation_checkpointing") else 0)
        dp = config.get("dp", world // (2 if CASES[name][4] else 1))
        tp = world // dp
        assert r["info"] == (rank, world, rank // tp, dp, STEPS)


def test_saved_at_two_ranks_loads_at_one(runs):
    two, one, _ = runs
    losses, _, params, snap = _reference("adamw", STEPS + 4, snapshot_at=STEPS, scheduler=True)
    assert one["world"] == 1 and one["step"] == STEPS
    # the scheduler's position and the learning rate it set: 3e-3 halved every 3 steps
    assert one["sched_epoch"] == STEPS and one["lr"] == pytest.approx(3e-3 * 0.5 ** (STEPS // 3))
    # the parameters are the ones the 2-rank run saved, exactly
    assert_close_params(one["params"], two[0][SAVED]["params"], atol=0.0, what="loaded")
    # the optimizer state is the one process's at that step (AdamW's moments and step)
    assert set(one["optim"]) == set(snap)
    assert_close_params(one["optim"], snap, atol=1e-5, what="optimizer state")
    # and training continues as the uninterrupted run
    assert_close_losses(one["losses"], losses[STEPS:], atol=1e-5, what="resumed at 1")
    assert_close_params(one["final"], params, atol=1e-5, what="resumed at 1")


def test_saved_at_tp2_loads_at_one(runs):
    two, one, _ = runs
    _, _, _, snap = _reference("sgd", STEPS, snapshot_at=STEPS)
    assert one["tp_step"] == STEPS
    assert_close_params(one["tp_params"], two[0][SAVED_TP]["params"], atol=0.0, what="loaded from tp2")
    assert set(one["tp_optim"]) == set(snap)  # SGD's momentum buffers, whole again
    assert_close_params(one["tp_optim"], snap, atol=1e-5, what="momentum from tp2")


def test_model_returning_its_loss(runs):
    _, one, _ = runs
    losses, _, _, _ = _reference("sgd", 1)
    assert one["own_loss"] == pytest.approx(losses[0], abs=1e-6)
    assert "forward_backward needs a scalar loss, got (32, 4)" in one["not_scalar"]


def test_bad_input_is_one_clear_error(runs):
    two, _, _ = runs
    errors = two[0]["errors"]
    assert (
        "tp = 2 needs layout rules for Net" in errors["tp_no_rules"] and "tp_plan=" in errors["tp_no_rules"]
    )
    assert "pp = 1 x dp = 4 x ep = 1 x cp = 1 x tp = 1 is 4 ranks but the world size is 2" in errors["dp4"]
    assert "options key 'dp' is fixed by the Mesh given" in errors["mesh_dp"]
    make = OPTIMIZERS["sgd"][0]
    # refused before any process group exists
    with pytest.raises(ConfigError, match=r"unknown key 'dq' in mesh_or_config \(did you mean 'dp'\?\)"):
        plait.parallelize(ex.Net(), make, {"dq": 2})
    with pytest.raises(ConfigError, match="pp must be an integer >= 1, got 0"):
        plait.parallelize(ex.Net(), make, {"pp": 0})
    from plait.train.config import ParallelConfig

    with pytest.raises(ConfigError, match="ep must be an integer >= 1, got 0"):  # plait train's section
        plait.parallelize(ex.Net(), make, ParallelConfig(ep=0))
    with pytest.raises(ConfigError, match="zero_stage = 4"):
        plait.parallelize(ex.Net(), make, {"zero_stage": 4})
    model = ex.Net()
    with pytest.raises(ConfigError, match="optimizer_factory must be a callable"):
        plait.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    with pytest.raises(ConfigError, match="mesh_or_config must be a plait Mesh, a dict"):
        plait.parallelize(model, make, 2)


def _printed_losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss ([0-9.]+)", text)}


def test_example_end_to_end_under_plait_launch_then_one_process(tmp_path):
    """`plait launch --nproc 2` (torch's elastic launcher, as torchrun) trains the example under
    ZeRO-3 and saves; a plain `python` process (no launcher: a group of one) resumes it; the
    printed losses are one process's."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ckpt = tmp_path / "ckpt"
    common = ["--batch", "32", "--log-every", "5"]
    first = subprocess.run(
        [sys.executable, "-m", "plait.cli", "launch", "--nproc", "2", str(EXAMPLE), "--steps", "10"]
        + ["--zero-stage", "3", "--save", str(ckpt), *common],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "ranks 2 (dp 2, tp 1), zero_stage 3" in first.stdout
    second = subprocess.run(
        [sys.executable, str(EXAMPLE), "--resume", str(ckpt), "--steps", "15", *common],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")},
    )
    assert second.returncode == 0, second.stdout + second.stderr
    got = {**_printed_losses(first.stdout), **_printed_losses(second.stdout)}
    assert sorted(got) == [5, 10, 15]
    torch.manual_seed(0)
    model = ex.Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = ex.make_data()
    for step in range(15):
        loss = ex.loss_fn(model, ex.global_batch(data, step, 32))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 in got:  # printed with 6 decimals
            want = float(loss.detach())
            assert abs(got[step + 1] - want) <= 2e-6, (step + 1, got[step + 1], want)
