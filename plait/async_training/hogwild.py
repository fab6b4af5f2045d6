"""Hogwild: lock-free SGD from several processes on one shared weight vector.

Niu, Recht, Ré and Wright 2011, "HOGWILD!: A Lock-Free Approach to Parallelizing Stochastic
Gradient Descent" (Algorithm 1): every processor repeatedly samples an example e, reads the
coordinates x_e of the weights that e touches, computes the gradient of f_e there, and writes
x_v <- x_v - gamma * b_v^T G_e(x) for each v in e, with no lock: when updates are sparse, two
processors rarely write the same coordinate, and the few overwrites cost little accuracy (the
paper's analysis: a near-linear speed-up when the example-coordinate conflict graph is sparse).
The comparison point is locking, which serialises the processors: plait's locked variant holds
one lock around each read-compute-write.

plait runs Algorithm 1 on the sparse logistic regression of `sparse_data` (binary labels, each
example a list of hashed n-gram feature indices, all of value 1):

* the weights (and Adagrad's accumulator) are ``share_memory_()`` tensors; N worker processes
  started with ``torch.multiprocessing`` (a fork server: spawn's clean start, paid once) map
  them, and update them in place with ``index_select`` (read) and ``index_add_`` (write) on the
  update's coordinates only; an update is a mini-batch of ``batch`` examples (1: Algorithm 1);
* worker r takes batches r, r + N, r + 2N, ... of one shuffled stream, so N workers together
  perform exactly the updates one process would (equal updates, a different interleaving);
* the update count is exact: each worker increments only its own slot of a shared int64 tensor
  and the total is their sum. (One shared counter incremented with ``+=`` by all workers is a
  read-modify-write race like the weights' and loses increments.)
* ``lock=True`` wraps each read-compute-write in one ``multiprocessing.Lock``: the paper's
  locked baseline; ``workers=1`` is the one-process baseline, the same code.

Hogwild is a shared-memory, multi-core CPU technique (the paper's setting): the workers run on
the host's cores whatever accelerator the machine has.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import signal
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from plait.async_training.sparse_data import SparseProblem, build_problem, logistic_loss
from plait.errors import ConfigError, PlaitError

OPTIMIZERS = ("sgd", "adagrad")
MAX_WORKERS = 256
MAX_UPDATES = 10**9
ADAGRAD_EPS = 1e-10
"""Adagrad's accumulator starts here rather than at 0, so 1/sqrt of it is always finite."""
_REPORT_EVERY = 256
"""Updates between a worker's writes of its running training-loss sum to shared memory."""


@dataclass
class HogwildConfig:
    """One Hogwild (or locked, or one-process) run on the corpus's whitespace-prediction problem."""

    workers: int = 2
    """Worker processes N; 1 is the one-process baseline."""
    updates: int = 30_000
    """Total updates over all workers."""
    batch: int = 8
    """Examples per update (1: Algorithm 1 of Niu et al. exactly). A few examples still touch a
    tiny fraction of the weights, cost about what one does in Python, and make the final iterate
    far less dependent on the order of the updates."""
    lock: bool = False
    """Wrap each read-compute-write in one shared lock (the locked baseline) instead of Hogwild."""
    optimizer: str = "adagrad"
    """"adagrad" (Duchi et al. 2011: per-coordinate steps lr / sqrt(sum of squared gradients), the
    accumulator shared like the weights) or "sgd" (constant steps, Niu et al.'s setting). Adagrad
    is the default because its final iterate hardly depends on the order of the updates (docs/hogwild.md)."""
    lr: float = 0.2
    """Step size gamma (SGD) or the base step size (Adagrad)."""
    lr_decay: float = 2e-4
    """torch.optim.Adagrad's ``lr_decay``: the step size at update t (counted over all workers,
    from the shared count) is lr / (1 + (t - 1) lr_decay)."""
    n_features: int = 2**18
    """Length of the hashed feature vector (the weights)."""
    context: int = 6
    """Bytes before a position whose n-grams (n = 1..3) are its features."""
    seed: int = 0
    """Seed of the example order."""
    eval_points: int = 40
    """Held-out evaluations the parent makes while the workers run (the loss curve); 0: none."""
    progress: bool = True
    """A tqdm progress bar of the shared update count in the parent."""

    def validate(self) -> None:
        """Refuse values that cannot run, naming the field and its range."""
        checks = [
            (
                1 <= self.workers <= MAX_WORKERS,
                f"workers must be from 1 to {MAX_WORKERS}, got {self.workers}",
            ),
            (
                1 <= self.updates <= MAX_UPDATES,
                f"updates must be from 1 to {MAX_UPDATES:.0e}, got {self.updates}",
            ),
            (
                self.updates >= self.workers,
                f"updates ({self.updates}) must be at least workers ({self.workers})",
            ),
            (math.isfinite(self.lr) and 0 < self.lr <= 100, f"lr must be in (0, 100], got {self.lr}"),
            (
                math.isfinite(self.lr_decay) and 0 <= self.lr_decay <= 1,
                f"lr_decay must be in [0, 1], got {self.lr_decay}",
            ),
            (
                self.optimizer in OPTIMIZERS,
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}",
            ),
            (
                2**8 <= self.n_features <= 2**26,
                f"n_features must be from 256 to {2**26:,}, got {self.n_features}",
            ),
            (1 <= self.context <= 16, f"context must be from 1 to 16, got {self.context}"),
            (0 <= self.eval_points <= 10_000, f"eval_points must be from 0 to 10000, got {self.eval_points}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class HogwildResult:
    """What a run measured. `seconds` spans the first worker's start to the last one's end."""

    config: dict
    updates: int
    """The shared count: the sum of the per-worker slots."""
    per_worker: list[int]
    seconds: float
    updates_per_s: float
    final_loss: float
    """Held-out mean logistic loss (nats) of the final weights."""
    initial_loss: float
    curve: list[dict] = field(default_factory=list)
    """{"updates", "seconds", "val_loss", "train_loss"}: held-out loss of the live weights and the
    workers' progressive training loss (each example's loss before its own update) since the
    previous point."""
    weights: torch.Tensor | None = None

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("weights")
        return out


def worker_batches(
    n_examples: int, updates: int, batch: int, seed: int, rank: int, workers: int, chunk: int = 4096
):
    """Yield worker `rank`'s mini-batches of example indices, `chunk` of them at a time ([k, batch]).

    The global stream is one fresh permutation of the examples per epoch (seeded by `seed` and the
    epoch), cut into `updates` consecutive batches; worker r of N takes batches r, r + N, r + 2N, ...
    So the workers' batches partition the one-process stream exactly (equal updates on the same
    examples), interleaved as a round-robin would.
    """
    perms: dict[int, torch.Tensor] = {}
    offsets = torch.arange(batch)
    for lo in range(rank, updates, workers * chunk):
        ids = torch.arange(lo, min(updates, lo + workers * chunk), workers)
        pos = (ids[:, None] * batch + offsets).reshape(-1)  # positions in the global stream
        epoch, within = pos // n_examples, pos % n_examples
        needed = range(int(epoch[0]), int(epoch[-1]) + 1)
        perms = {e: perms[e] if e in perms else _epoch_perm(n_examples, seed, e) for e in needed}
        out = torch.empty_like(pos)
        for e in needed:
            sel = epoch == e
            out[sel] = perms[e][within[sel]]
        yield out.view(-1, batch)


def _epoch_perm(n_examples: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def _worker(rank: int, cfg: HogwildConfig, problem: SparseProblem, state: dict, start, lock) -> None:
    """Algorithm 1 of Niu et al. on this worker's share of the example stream.

    An update reads the weights of the batch's coordinates (``index_select``), computes the
    gradient of the mean logistic loss there, and adds the step to those coordinates only
    (``index_add_``, which also sums the repeats of a coordinate within the batch). Adagrad adds
    each (example, coordinate) entry's squared gradient to the accumulator: for one example per
    update exactly Duchi et al.'s rule; for several, the sum of squares stands for the square of
    the sum (equal in expectation when the examples' gradients are uncorrelated).
    """
    torch.set_num_threads(1)  # one core per worker: the parallelism is the processes
    w, acc = state["w"], state.get("acc")
    x, y = problem.train_x, problem.train_y
    counts = state["counts"]
    mine = counts[rank : rank + 1]  # this worker's slot: only it writes there
    loss_slot, loss_n = state["loss_sums"][rank : rank + 1], state["loss_counts"][rank : rank + 1]
    loss_sum = torch.zeros((), dtype=torch.float64)
    b, nnz = cfg.batch, problem.nnz
    lr, adagrad = cfg.lr, cfg.optimizer == "adagrad"
    parent = multiprocessing.parent_process()  # the launching process (not the fork server)
    # Batches are made a chunk at a time (a long run's stream would not fit in memory); the first
    # one before the start, so that the timed part starts with updates.
    stream = worker_batches(x.shape[0], cfg.updates, b, cfg.seed, rank, cfg.workers)
    chunks = itertools.chain([next(stream)], stream)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    state["ready"][rank] = 1
    start.wait()
    state["begin"][rank] = time.monotonic()
    done = 0
    for chunk in chunks:
        ids = chunk.reshape(-1)
        rows = x.index_select(0, ids).view(len(chunk), b * nnz)  # the coordinates each update touches
        labels = y.index_select(0, ids).view(len(chunk), b)
        for idx, yb in zip(rows, labels):
            if lock is not None:
                lock.acquire()
            z = w.index_select(0, idx).view(b, nnz).sum(dim=1)  # read them (no lock: may be mid-write)
            grad = torch.sigmoid(z).sub_(yb).repeat_interleave(nnz)  # d(loss)/dz per (example, coordinate)
            if cfg.lr_decay:
                # Step t is global, the sum of every worker's slot: a per-process count (torch's
                # per-optimizer state["step"]) would decay N times too slowly.
                lr = cfg.lr / (1.0 + float(counts.sum()) * cfg.lr_decay)
            if adagrad:  # scale-free in the gradient, so the batch's 1/b is left out
                acc.index_add_(0, idx, grad * grad)
                w.index_add_(0, idx, grad.mul_(acc.index_select(0, idx).rsqrt_()), alpha=-lr)
            else:
                w.index_add_(0, idx, grad, alpha=-lr / b)  # write back only those coordinates
            if lock is not None:
                lock.release()
            mine.add_(1)
            loss_sum += F.binary_cross_entropy_with_logits(z, yb, reduction="sum")  # before the update
            done += 1
            if done % _REPORT_EVERY == 0:
                loss_slot.copy_(loss_sum)
                loss_n.fill_(done * b)
                if parent is not None and not parent.is_alive():  # it died without stopping us
                    return
    loss_slot.copy_(loss_sum)
    loss_n.fill_(done * b)
    state["end"][rank] = time.monotonic()


def _shared_state(cfg: HogwildConfig) -> dict:
    n = cfg.workers
    state = {
        "w": torch.zeros(cfg.n_features),
        # Each worker's slots lie on a cache line of their own (column 0 of rows of 64 bytes), so
        # that one worker's per-update increment does not invalidate the line another one writes.
        "counts": torch.zeros(n, 8, dtype=torch.int64)[:, 0],
        "loss_sums": torch.zeros(n, 8, dtype=torch.float64)[:, 0],
        "loss_counts": torch.zeros(n, 8, dtype=torch.int64)[:, 0],
        "ready": torch.zeros(n, dtype=torch.int64),
        "begin": torch.zeros(n, dtype=torch.float64),
        "end": torch.zeros(n, dtype=torch.float64),
    }
    if cfg.optimizer == "adagrad":
        # Shared like the weights: a per-process accumulator would see 1/N of the gradients.
        # It starts at ADAGRAD_EPS, never 0, so 1/sqrt needs no epsilon added on every update.
        state["acc"] = torch.full((cfg.n_features,), ADAGRAD_EPS)
    for t in state.values():
        t.share_memory_()
    return state


def train_hogwild(cfg: HogwildConfig, problem: SparseProblem | None = None, on_point=None) -> HogwildResult:
    """Run `cfg.workers` processes on the shared weights until `cfg.updates` updates are done.

    The parent starts the workers, releases them together once all are ready, and meanwhile
    shows the shared count and evaluates the live weights on the held-out examples
    (`cfg.eval_points` times). `on_point(record)` is called with each curve point. A worker that
    fails stops the run with a `PlaitError` naming it.
    """
    cfg.validate()
    if problem is None:
        problem = build_problem(n_features=cfg.n_features, context=cfg.context)
    if problem.n_features != cfg.n_features:
        raise ConfigError(f"the problem has {problem.n_features} features, the config {cfg.n_features}")
    problem.share_memory_()
    state = _shared_state(cfg)
    ctx = _context()
    start = ctx.Event()
    lock = ctx.Lock() if cfg.lock else None
    procs = [
        ctx.Process(target=_worker, args=(r, cfg, problem, state, start, lock), daemon=True)
        for r in range(cfg.workers)
    ]
    try:
        for p in procs:
            p.start()
        while int(state["ready"].sum()) < cfg.workers:
            _check_workers(procs)
            time.sleep(0.01)
        curve, last = _watch(cfg, problem, state, procs, start, on_point)
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.terminate()
            p.join()
    return _result(cfg, problem, state, curve, last, on_point)


def _watch(cfg: HogwildConfig, problem: SparseProblem, state: dict, procs, start, on_point):
    """Release the ready workers and, until they are done, show the shared count and add a curve
    point every `cfg.updates / cfg.eval_points` updates. Returns (the curve, the workers' last
    published (examples, loss sum))."""
    initial = logistic_loss(state["w"], problem.val_x, problem.val_y)
    curve = [{"updates": 0, "seconds": 0.0, "val_loss": initial, "train_loss": None}]
    if on_point:
        on_point(curve[0])
    bar = tqdm(total=cfg.updates, unit="upd", unit_scale=True, desc=describe(cfg)) if cfg.progress else None
    try:
        t0 = time.monotonic()
        start.set()
        step = cfg.updates / cfg.eval_points if cfg.eval_points else math.inf
        next_eval, last = step, (0, 0.0)  # (examples, loss sum) of the workers' last published sums
        while any(p.is_alive() for p in procs):
            time.sleep(0.02)
            _check_workers(procs)
            count = int(state["counts"].sum())
            if bar is not None:
                bar.update(count - bar.n)
            if count >= next_eval and count < cfg.updates:
                point, last = _point(state, problem, count, time.monotonic() - t0, last)
                curve.append(point)
                if on_point:
                    on_point(point)
                next_eval = (math.floor(count / step) + 1) * step
        _check_workers(procs)
        if bar is not None:
            bar.update(int(state["counts"].sum()) - bar.n)  # the last updates, made after the last poll
    finally:
        if bar is not None:
            bar.close()
    return curve, last


def _result(cfg: HogwildConfig, problem: SparseProblem, state: dict, curve: list, last, on_point):
    """The run's result once every worker has ended: the final curve point and the timings."""
    counts = state["counts"].tolist()
    total = sum(counts)
    seconds = float(state["end"].max() - state["begin"].min())
    point, _ = _point(state, problem, total, seconds, last)
    curve.append(point)
    if on_point:
        on_point(point)
    return HogwildResult(
        config=asdict(cfg),
        updates=total,
        per_worker=counts,
        seconds=seconds,
        updates_per_s=total / seconds if seconds > 0 else math.inf,
        final_loss=point["val_loss"],
        initial_loss=curve[0]["val_loss"],
        curve=curve,
        weights=state["w"].clone(),
    )


def _context():
    """Processes that start clean like spawn's (no inherited threads, CUDA-safe) but fast: a fork
    server, started once per parent with this module imported, forks every worker; spawn where
    there is no fork server (Windows, macOS's default set)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _point(state: dict, problem: SparseProblem, count: int, seconds: float, last: tuple[int, float]):
    """A curve point: the held-out loss of the live weights and the mean progressive training loss
    over the examples the workers published since `last` (they publish every _REPORT_EVERY)."""
    n, loss_sum = int(state["loss_counts"].sum()), float(state["loss_sums"].sum())
    point = {
        "updates": count,
        "seconds": seconds,
        "val_loss": logistic_loss(state["w"], problem.val_x, problem.val_y),
        "train_loss": (loss_sum - last[1]) / (n - last[0]) if n > last[0] else None,
    }
    return point, (n, loss_sum)


def _check_workers(procs) -> None:
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0):
            raise PlaitError(
                f"hogwild worker {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                "its error, if it printed one, is above"
            )


def describe(cfg: HogwildConfig) -> str:
    """ "one process", "2 workers, Hogwild (lock-free)", "2 workers, locked", ..."""
    if cfg.workers == 1:
        return "one process" + (", locked" if cfg.lock else "")
    return f"{cfg.workers} workers, " + ("locked" if cfg.lock else "Hogwild (lock-free)")
