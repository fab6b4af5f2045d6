"""The single-controller runtime (Pathways, Barham et al. MLSys 2022) on Monarch actors.

One driver program owns the loop: it spawns a Monarch process mesh with the layout's named dims
(pp, dp_replicate, dp_shard, ep, tp), one `RankActor` per rank, reads the data and sends each rank
its micro-batches, dispatches up to `runtime.run_ahead` steps ahead as futures, and decides
logging, evaluation and checkpoints; the actors build their part of the model with the same
`plait.apply.parallelize` as `plait train`'s ranks and only compute. `plait train CONFIG
--runtime.kind controller`; docs/controller.md. `mesh(layout)` is the same for a program of the
user's own (the driver API, plait.controller.program): it owns the loop, the ranks run
`plait.parallelize`'s engine.

Monarch (`torchmonarch`) is optional: `plait[controller]` (pyproject) plus
`pip install --no-deps torchmonarch==0.7.0`, as `make test` installs it.
"""

from __future__ import annotations

from plait.errors import ConfigError

INSTALL = "pip install 'plait[controller]' && pip install --no-deps torchmonarch==0.7.0"


def require_monarch() -> None:
    """Monarch and a cloudpickle it can use are importable, else one line saying how to get them."""
    try:
        import cloudpickle
        import monarch.actor  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"runtime.kind = 'controller' needs Monarch (torchmonarch), which is not installed ({exc}): "
            f"{INSTALL}"
        ) from None
    if int(cloudpickle.__version__.split(".")[0]) < 3:  # 2.x makes Monarch's first spawn panic
        raise ConfigError(
            f"runtime.kind = 'controller' needs cloudpickle >= 3 (Monarch's spawn), found "
            f"{cloudpickle.__version__}: pip install 'cloudpickle>=3'"
        )


def mesh(layout=None):
    """A mesh of processes for `layout` (the keys of `plait.parallelize`: dp, tp, pp, ep,
    zero_stage, ...) driven from this program, one Python program for the whole job:

        with plait.controller.mesh({"dp": 2, "zero_stage": 3}) as m:
            m.parallelize(make_model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn)
            loss = m.step(batch).get()

    An invalid layout is refused here, before any process starts (plait.controller.program)."""
    require_monarch()
    from plait.controller.program import DriverMesh

    return DriverMesh(layout or {})


def islands(stages, dp, optimizer, loss_fn, schedule="1f1b", microbatches=4, seed=0, transfer="direct"):
    """A pipeline whose stages run on process meshes of their own ("islands", MPMD), each with its
    own data-parallel degree, driven from this program (plait.controller.mpmd):

        with plait.controller.islands([stage0, stage1], dp=[2, 1], optimizer=opt, loss_fn=loss_fn) as p:
            loss = p.step((x, y))

    `stages`: one factory per stage returning its module (called after torch.manual_seed(seed));
    `loss_fn(output, targets)`: the mean loss over the rows; schedule: gpipe or 1f1b; transfer:
    "direct" (island to island over gloo, plait.controller.links) or "controller" (relayed here)."""
    require_monarch()
    from plait.controller.mpmd import IslandPipeline

    return IslandPipeline(stages, dp, optimizer, loss_fn, schedule, microbatches, seed, transfer)


def launch_controller(cfg, resume: bool = False, checkpoint=None) -> int:
    """`plait train` with runtime.kind = controller; returns the exit code (plait.controller.driver)."""
    require_monarch()
    from plait.controller.driver import launch

    return launch(cfg, resume, checkpoint)
