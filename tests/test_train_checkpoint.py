"""Checkpoints: round trip, and a crash mid-save leaves the previous checkpoint usable."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait import comm
from plait.data import DistributedBatchSampler, load_corpus
from plait.errors import CheckpointError
from plait.mesh import Mesh
from plait.models import GPT, gpt_config
from plait.testing import assert_close_params, run_ranks, state_of
from plait.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def _state(seed):
    torch.manual_seed(seed)
    model = GPT(gpt_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    corpus = load_corpus()
    # replicas stay identical as under data parallelism: DCP saves one copy of replicated tensors
    sampler = DistributedBatchSampler(corpus.train, 32, 4, 0, 1, seed=seed)
    return model, opt, sched, sampler


def _step(model, opt, sched, sampler):
    ((x, y),) = sampler.next_batch()
    model(x, y).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _crash_mid_save(root):
    mesh = Mesh(dp=2, timeout_s=60)
    model, opt, sched, sampler = _state(0)
    _step(model, opt, sched, sampler)
    saved_params = state_of(model)
    saved_sampler = sampler.state_dict()
    path = save_checkpoint(root, 1, mesh, model, opt, sched, sampler)
    assert latest_checkpoint(root) == path
    _step(model, opt, sched, sampler)

    real_save = dcp.save

    def dying_save(state, checkpoint_id):  # writes part of the files, then the machine "dies"
        with open(f"{checkpoint_id}/__{dist.get_rank()}_0.distcp", "wb") as fh:
            fh.write(b"partial")
        raise OSError("No space left on device")

    dcp.save = dying_save
    try:
        save_checkpoint(root, 2, mesh, model, opt, sched, sampler)
        raise AssertionError("the failed save did not raise")
    except CheckpointError as exc:
        assert "No space left on device" in str(exc) and "previous checkpoint is intact" in str(exc)
    finally:
        dcp.save = real_save
    comm.barrier(mesh)
    assert latest_checkpoint(root) == path  # `latest` still names step 1

    fresh, opt2, sched2, sampler2 = _state(99)  # different init, different data position
    step = load_checkpoint(latest_checkpoint(root), mesh, fresh, opt2, sched2, sampler2)
    assert step == 1 and sampler2.state_dict() == saved_sampler
    assert_close_params(state_of(fresh), saved_params, atol=0.0, what="restored")
    assert sched2.last_epoch == sched.last_epoch - 1
    assert opt2.state_dict()["state"][0]["step"] == 1
    # and training continues from it exactly as the original did
    _step(fresh, opt2, sched2, sampler2)
    assert_close_params(state_of(fresh), state_of(model), atol=0.0, what="continued")
    mesh.close()
    try:
        load_checkpoint(root / "nope", Mesh(dp=2, watchdog=False), fresh, opt2, sched2, sampler2)
        raise AssertionError("loading a missing checkpoint did not raise")
    except CheckpointError as exc:
        assert "did not complete" in str(exc)
    return True


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path):
    assert all(run_ranks(_crash_mid_save, 2, args=(tmp_path / "ckpt",), timeout=120))
