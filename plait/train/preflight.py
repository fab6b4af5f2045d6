"""Checks that need this machine, run by the launcher before any rank starts.

`plait.train.config.validate` checks the configuration alone; what depends on the machine is
here: the run directory must be writable, and the job must fit in memory. Each refusal is a
`ConfigError` (one line, exit code 2) naming the key and what to change.

The memory check is the ZeRO estimator's accounting (`plait.zero.estimate`: Rajbhandari et al.
2019 for the model states, Korthikanti et al. 2022 for the activations) applied to the configured
model and layout, counted as plait stores them (fp32 parameters, gradients and optimizer state;
`train.bf16` is autocast). Every term is taken at its low end (tp and pp divide all parameters,
fused attention stores no scores, logits are counted once, the fp32 master shards of ZeRO are
left out), so a refusal means the job cannot fit, not that it might not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from plait.errors import ConfigError
from plait.train.config import Config, model_config, pipeline_shape
from plait.zero.estimate import GB, activation_bytes, model_state_bytes_formula

RANK_RUNTIME_BYTES = 2**28
"""What a rank holds besides its tensors, at least: a CPU rank with torch, gloo and plait imported
measured about 275 MB; a CUDA context is larger."""

MEMORY_CHECK_ENV = "PLAIT_MEMORY_CHECK"
"""Set to 0 to start a job the memory check refuses."""

# fp32 optimizer state bytes per parameter: AdamW and LAMB keep two moments, SGD (with momentum)
# and LARS one (plait.optim).
_STATE_BYTES = {"adamw": 8, "lamb": 8, "lars": 4, "sgd": 4}


def check_before_start(cfg: Config, *, use_cuda: bool, ranks: int) -> None:
    """The run directory is writable and `ranks` ranks of `cfg` fit this machine's memory."""
    check_run_dir(cfg.train.run_dir)
    check_memory(cfg, use_cuda=use_cuda, ranks=ranks)


def check_run_dir(path: str, key: str = "train.run_dir") -> None:
    """`path` is a directory this process can write into, or can be created: nothing is left
    behind (a probe file or directory is removed), so the launcher still creates it itself."""
    p = Path(path)
    probe_in = p  # where the probe is made: the directory, or its nearest existing parent
    try:
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{key} = {path!r} is a file, not a directory; choose another {key}")
            with tempfile.NamedTemporaryFile(dir=p, prefix=".plait-probe-"):
                pass
            return
        probe_in = p.absolute().parent
        while not probe_in.exists():
            probe_in = probe_in.parent
        if not probe_in.is_dir():
            raise ConfigError(
                f"{key} = {path!r} cannot be created: {str(probe_in)!r} is a file; choose another {key}"
            )
        os.rmdir(tempfile.mkdtemp(dir=probe_in, prefix=".plait-probe-"))
    except OSError as exc:
        where = "" if probe_in == p else f" in {str(probe_in)!r}"
        raise ConfigError(
            f"{key} = {path!r} is not writable ({exc.strerror or exc}{where}); choose another {key}"
        ) from None


def rank_memory(cfg: Config, use_cuda: bool) -> dict[str, int]:
    """Bytes one rank of `cfg` needs at least: params, grads, optimizer, activations, runtime, total.

    The rank that holds the most: parameters are split over tp x pp (experts also over ep) and
    sharded by ZeRO over the data axes they are replicated on (dense: dp x ep x cp or the hybrid
    shard group; experts: dp); under context parallelism a rank holds 1/cp of each sequence.
    Optimizer state offloaded to disk, or to the host on a CUDA run, is not in the device's figure.
    """
    m, p = model_config(cfg), cfg.parallel
    d, f, b = m.d_model, m.ff_dim, int(m.bias)
    experts = m.n_moe_layers * m.experts * (d * f + b * f + f * d + b * d)
    dense = m.n_params() - experts
    k = _STATE_BYTES[cfg.optim.name] if (cfg.optim.name != "sgd" or cfg.optim.momentum) else 0
    states = {"params": 0, "grads": 0, "optimizer": 0}
    # (parameters, the ranks that split them, the ranks that ZeRO shards them over)
    for n, split, shard in (
        (dense, p.tp * p.pp, p.hybrid_shard or p.dp * p.ep * p.cp),
        (experts, p.tp * p.pp * p.ep, p.dp),
    ):
        per_rank = -(-n // split)
        if per_rank:
            part = model_state_bytes_formula(
                per_rank, shard, p.zero_stage, param_bytes=4, grad_bytes=4, optimizer_k=k, shard=shard
            )
            for key in states:
                states[key] += part[key]
    if cfg.offload.optimizer == "disk" or (cfg.offload.optimizer == "cpu" and use_cuda):
        states["optimizer"] = 0
    out = dict(states, activations=_activations(cfg, m), runtime=RANK_RUNTIME_BYTES)
    out["total"] = sum(out.values())
    return out


def _activations(cfg: Config, m) -> int:
    p, t = cfg.parallel, cfg.train
    rows = t.global_batch // (p.dp * p.ep)  # the batch is split over dp x ep
    seq = -(-m.seq_len // p.cp)  # and each sequence over cp

    def per_micro_batch(batch: int) -> tuple[int, int]:
        layers = activation_bytes(
            m,
            batch,
            seq,
            precision="bf16" if t.bf16 else "fp32",
            recompute=t.activation_checkpointing,
            tp=p.tp,
            sequence_parallel=p.sequence_parallel,
            stored_scores=False,
        )
        return layers, batch * seq * m.vocab_size * 4 // p.tp  # the fp32 logits, once

    if p.pp == 1:
        layers, logits = per_micro_batch(rows // t.micro_batches)
        return layers + logits
    micro, _ = pipeline_shape(cfg)
    layers, logits = per_micro_batch(rows // micro)
    stage = layers // p.pp  # one micro-batch through one rank's share of the layers
    in_flight = micro if p.schedule == "gpipe" else min(micro, p.pp)  # the first stage's, 1F1B-like
    return max(in_flight * stage, stage + logits)  # the first stage, or the last with the logits


def available_memory(use_cuda: bool, ranks: int) -> tuple[int, str] | None:
    """(bytes free, where) that each rank (CUDA) or all `ranks` together (CPU) can use, or None
    when it cannot be found out (then nothing is refused)."""
    if use_cuda:
        free = _cuda_free(ranks)
        return None if not free else (min(free), f"free on the GPU{'s' if ranks > 1 else ''}")
    host = _host_available()
    return None if host is None else (host, "available host RAM")


def _host_available() -> int | None:
    found = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            pass
    # A container's memory limit (cgroup v2, then v1) is what the ranks can really take.
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                found.append(max(int(limit) - int(usage), 0))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _cuda_free(ranks: int) -> list[int] | None:
    """Free bytes of devices 0..ranks-1. One rank runs in this process, so this process's CUDA
    context is the run's; for more, a short subprocess asks, so that the launcher holds no
    context on every GPU for the whole run."""
    try:
        if ranks == 1:
            return [torch.cuda.mem_get_info(0)[0]]
        code = (
            f"import json, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range({ranks})]))"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return [int(x) for x in json.loads(r.stdout.strip().splitlines()[-1])] if r.returncode == 0 else None
    except Exception:  # no answer: the check is skipped, never a reason to refuse
        return None


def check_memory(cfg: Config, *, use_cuda: bool, ranks: int) -> None:
    """Refuse `cfg` when `rank_memory` does not fit what `available_memory` reports: per device on
    CUDA, all `ranks` together on the host (CPU ranks share its RAM)."""
    if os.environ.get(MEMORY_CHECK_ENV, "1") == "0":
        return
    found = available_memory(use_cuda, ranks)
    if found is None:
        return
    free, where = found
    share = 1 if use_cuda else ranks  # on the CPU every rank takes the same host's memory

    def need(c: Config) -> int:
        return share * rank_memory(c, use_cuda)["total"]

    if need(cfg) <= free:
        return
    mem = rank_memory(cfg, use_cuda)
    parts = ", ".join(
        f"{label} {mem[key] / GB:.2f}"
        for key, label in (
            ("params", "parameters"),
            ("grads", "gradients"),
            ("optimizer", "optimizer state"),
            ("activations", "activations"),
            ("runtime", "runtime"),
        )
    )
    each = "the rank needs" if ranks == 1 else f"each of the {ranks} ranks needs"
    together = "" if share == 1 else f", {need(cfg) / GB:.2f} GB in all"
    fits, kinds = [], set()
    for kind, label, alt in _alternatives(cfg, use_cuda):
        if kind not in kinds and need(alt) <= free:  # the first that fits of each kind
            kinds.add(kind)
            fits.append(f"{label} ({need(alt) / GB:.2f} GB)")
    advice = (
        f"it fits with {' or '.join(fits)}"
        if fits
        else "a smaller model (model.name, model.n_layer, model.d_model) or batch is needed"
        + (", or more GPUs (parallel.tp, parallel.pp)" if use_cuda else "")
    )
    raise ConfigError(
        f"the job does not fit in memory: {each} at least {mem['total'] / GB:.2f} GB ({parts}){together}, "
        f"and this machine has {free / GB:.2f} GB {where}; {advice} "
        f"(figures from plait.zero.estimate, in GB = 1e9 bytes; {MEMORY_CHECK_ENV}=0 starts anyway)"
    )


def _alternatives(cfg: Config, use_cuda: bool) -> list[tuple[str, str, Config]]:
    """(kind, label, config) of changes that lower the figure, mildest first within a kind. They
    are checked only as far as the figure needs: the launcher validates what the user then picks."""
    p, t, m = cfg.parallel, cfg.train, model_config(cfg)

    def changed(**sections) -> Config:
        return dataclasses.replace(
            cfg, **{name: dataclasses.replace(getattr(cfg, name), **kw) for name, kw in sections.items()}
        )

    out = []
    zero3 = p.zero_stage < 3 and p.dp * p.ep * p.cp > 1  # sharding needs data-parallel ranks
    if zero3:
        out.append(("zero", "parallel.zero_stage = 3", changed(parallel={"zero_stage": 3})))
    if not t.activation_checkpointing:
        recompute = {"activation_checkpointing": True}
        out.append(("recompute", "train.activation_checkpointing = true", changed(train=recompute)))
        if zero3:
            both = changed(parallel={"zero_stage": 3}, train=recompute)
            out.append(("both", "parallel.zero_stage = 3 and train.activation_checkpointing = true", both))
    if p.pp == 1:
        rows = t.global_batch // (p.dp * p.ep)
        for k in (2, 4, 8, 16):
            if rows % (t.micro_batches * k) == 0:
                n = t.micro_batches * k
                out.append(("micro", f"train.micro_batches = {n}", changed(train={"micro_batches": n})))
    if use_cuda:
        for k in (2, 4, 8):
            tp = p.tp * k
            if m.n_head % tp == 0 and m.ff_dim % tp == 0:
                out.append(("tp", f"parallel.tp = {tp} (more GPUs)", changed(parallel={"tp": tp})))
        if p.zero_stage >= 1 and cfg.offload.optimizer == "none" and p.pp == 1:
            out.append(("offload", "offload.optimizer = 'cpu'", changed(offload={"optimizer": "cpu"})))
    return out
