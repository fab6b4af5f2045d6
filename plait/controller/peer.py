"""Recovery from a healthy data-parallel peer's memory instead of the disk checkpoint (torchft's
way), for `plait train --runtime.kind controller --train.max_restarts N`.

When a rank fails, the controller asks the ranks still alive for the step their state is at
(`taken`: the last step whose update they applied) and their RNG state at the end of it. Under
plain data parallelism (ZeRO stage 0) the ranks that share a rank's model coordinates (pp, ep,
tp) hold the same parameters and optimizer state. So for each group of such ranks the controller
takes one survivor's state: its model and optimizer state dicts, the LR schedule and the guard's
count of skipped steps. It then stops the mesh and spawns a fresh one. Every fresh rank loads its
group's state from the controller, with the sampler position the controller had after that step.
No checkpoint is read, and no step the controller had taken is trained again. A survivor keeps
its own RNG stream. A lost rank takes the stream of a survivor of its data rank (its tp peers
share its dropout stream), or else restarts its own from the seed. Without dropout nothing draws
from it, so the run continues exactly like an uninterrupted one (tested); with dropout only such
a rank's masks differ.

The controller falls back to the newest disk checkpoint, saying why, when:
- the layout shards the state (ZeRO 1-3), holds per-rank state (compression residuals), or
  splits the model over pipeline stages or experts (not built);
- the run diverged, or the failure is the evaluation island's;
- some group has no survivor that answers within PEER_TIMEOUT_S. A survivor answers only once its
  own failed collective has returned: gloo raises at once when a peer's process dies, but a rank
  that raised and stayed alive holds its peers until gloo's timeout, and NCCL's watchdog aborts
  the process instead;
- the survivors are at different steps, or at a step whose records the controller has not taken
  (a rank failed after its update, in a replica check or a log line; or a rank killed at the very
  start of a step took its previous step's result with it).

The controller holds one copy of each group's state on the CPU and sends it to every rank of the
group: for a large model, host memory of a few times the model and optimizer state.
"""

from __future__ import annotations

import copy
import itertools

import torch

from plait.data_parallel.engine import DataParallelEngine
from plait.train import report
from plait.train.checkpoint import _residuals, _set_rng_state
from plait.train.config import Config
from plait.train.nonfinite import DIVERGED

PEER_TIMEOUT_S = 10.0  # for the survivors' steps: a rank still waiting in a collective does not answer
STATE_TIMEOUT_S = 300.0  # for their model and optimizer state, copied to the CPU and sent here


def ineligible(cfg: Config) -> str | None:
    """Why a lost rank of this layout cannot be recovered from a peer's memory (None: it can)."""
    p = cfg.parallel
    if p.dp < 2:
        return "dp = 1: no rank holds a copy of another's state"
    if p.zero_stage > 0:
        return f"ZeRO stage {p.zero_stage} shards the state over dp: a lost shard has no copy"
    if cfg.comm.compression != "none":
        return f"comm.compression = {cfg.comm.compression}: its error-feedback residuals are per rank"
    if p.pp > 1 or p.ep > 1:
        return "pipeline stages and experts are not built for it"
    return None


def groups(dims: dict[str, int]) -> list[tuple[int, ...]]:
    """Each rank's model coordinates (pp, ep, tp), in rank order (the mesh is row-major over
    `dims`): ranks with equal coordinates hold the same state under plain data parallelism."""
    names = list(dims)
    return [
        tuple(c[names.index(k)] for k in ("pp", "ep", "tp"))
        for c in itertools.product(*(range(n) for n in dims.values()))
    ]


def snapshot(run, taken: int, rng: torch.Tensor, full: bool) -> dict:
    """This rank's step and its RNG state at the end of that step and, with `full`, its model
    and optimizer state (on the CPU): what a fresh rank of its group loads."""
    out = {"taken": taken, "rng": rng}
    if full:
        engine = run.engine
        if not isinstance(engine, DataParallelEngine) or _residuals(engine) is not None:
            what = type(engine).__name__
            raise RuntimeError(f"{what} holds state that its peers do not have (shards or residuals)")
        out.update(
            model={k: v.detach().cpu().clone() for k, v in engine.raw.state_dict().items()},
            optim=_to_cpu(engine.optimizer.state_dict()),
            scheduler=run.scheduler.state_dict(),
            skipped_in_a_row=run.skipped_in_a_row,
        )
    return out


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return copy.deepcopy(obj)


def restore(run, state: dict) -> None:
    """Load a peer's state into this fresh rank's run (built by the loop's `_setup` without a
    checkpoint): parameters, optimizer, LR schedule, sampler position, step; this rank's own RNG
    state where it survived. Metrics written after the step go (they will be written again)."""
    engine = run.engine
    engine.raw.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optim"])  # moves the state to the parameters' device
    run.scheduler.load_state_dict(state["scheduler"])
    run.skipped_in_a_row = state["skipped_in_a_row"]
    run.sampler.load_state_dict(state["sampler"])
    if state.get("rng") is not None:
        _set_rng_state(state["rng"])
    run.start = state["taken"]
    run.timeline_step = min(run.start + 3, run.last)
    if run.mesh.is_rank0:
        report.truncate_metrics(run.run_dir, run.start)
    report.say(run.mesh, f"recovered at step {run.start} from rank {state['source']}'s memory (a dp peer)")


def choose(answers: dict[int, dict], dims: dict[str, int], lost: int) -> tuple[dict | None, str]:
    """From the survivors' answers (rank -> snapshot without the state), the rank whose full
    state each group loads: ({group: rank}, "") or (None, why not)."""
    coords = groups(dims)
    steps = {a["taken"] for a in answers.values()}
    if len(steps) > 1:
        return None, f"the surviving ranks are at different steps ({sorted(steps)})"
    sources = {}
    for g in sorted(set(coords)):
        alive = [r for r, c in enumerate(coords) if c == g and r in answers and r != lost]
        if not alive:
            return None, f"no surviving rank holds the state of model coordinates (pp, ep, tp) = {g}"
        sources[g] = alive[0]
    return sources, ""


def recover(cfg: Config, dims, lost, done, position, data_rank, run_dir, ask) -> tuple[list | None, str]:
    """Each fresh rank's state after rank `lost` failed (a rank, or the name of an island), with
    `done` the last step the controller took the records of and `position` the samplers' position
    after it; `ask(ranks, full, timeout_s)` -> (answers, errors) asks ranks for `snapshot`.
    Returns (states, "") or (None, why the newest checkpoint must do)."""
    try:
        return _recover(cfg, dims, lost, done, position, data_rank, run_dir, ask)
    except Exception as err:  # a recovery that cannot be made must not hide the failure
        return None, f"{type(err).__name__}: {err}"


def _recover(cfg, dims, lost, done, position, data_rank, run_dir, ask) -> tuple[list | None, str]:
    why = ineligible(cfg)
    if not why and not isinstance(lost, int):
        why = "the evaluation island failed, not a training rank"
    if not why and done < 0:
        why = "the mesh failed before its first step"
    if not why and (run_dir / DIVERGED).exists():
        why = "training diverged"
    if why:
        return None, why
    world = len(groups(dims))
    answers, errors = ask([r for r in range(world) if r != lost], False, PEER_TIMEOUT_S)
    sources, why = choose(answers, dims, lost)
    if why:
        return None, why + _errors(errors)
    taken = next(iter(answers.values()))["taken"]
    if taken != done or position is None:  # a step's records not all taken by the controller
        return None, f"the survivors finished step {taken}, the controller took step {done} last"
    full, errors = ask(sorted(set(sources.values())), True, STATE_TIMEOUT_S)
    if len(full) < len(set(sources.values())):
        return None, "a surviving rank did not hand over its state" + _errors(errors)
    states = []
    for r, g in enumerate(groups(dims)):
        # the rank's own RNG state; a lost rank takes a survivor's of its data rank (its tp peers
        # share its dropout stream), else restarts its own from the seed
        same = [q for q in answers if data_rank[q] == data_rank[r]]
        rng = answers[r]["rng"] if r in answers else answers[same[0]]["rng"] if same else None
        states.append({**full[sources[g]], "rng": rng, "sampler": position, "source": sources[g]})
    return states, ""


def _errors(errors: dict[int, str]) -> str:
    """The first ranks' errors, for a line saying why something was not done."""
    return "".join(f"; rank {r}: {e[:150]}" for r, e in list(errors.items())[:2])
