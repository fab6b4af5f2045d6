"""DiLoCo's traffic for the planner (Douillard et al. 2023; Streaming DiLoCo, Douillard et al. 2025).

M replica groups (``diloco.replicas``; a group is dp / M consecutive dp ranks, the replica axis
dp's outer factor, as hybrid sharding puts its replicas outside its shards) each take H inner
steps (``diloco.inner_steps``) alone, then all-reduce the pseudo-gradient (the change of the
parameters) between the M ranks at the same coordinates of their groups and take an outer step.
Inner steps send nothing over the replica axis: inside a group the usual terms are priced on the
group's own degrees (`Setting.n_data` is its dp x ep). The outer exchange, per rank:

* payload ``X = held x b``: ``held`` the parameters this rank holds (`stage_params`, divided by
  tp, pp and ep; under ZeRO-3 by the group's shard as well), ``b`` 4 bytes for fp32
  (``diloco.compression = "none"``), 2 for fp16 or bf16;
* ring all-reduce over the M groups: ``2(M-1)/M x X`` bus bytes every H steps, so per step
  ``2(M-1)/M x X / H``;
* Streaming DiLoCo with F fragments: each exchange moves ``X / F`` (the peak is 1/F: ``2(M-1)/M x
  X / F``), F exchanges per H steps (the same average per step);
* its time is one ring all-reduce of ``X / F`` on the replica axis's link (across islands where
  the cluster has them), α once per 25 MB bucket and ring step; with ``diloco.overlap_steps``
  tau > 0 each exchange runs under the next tau inner steps, so up to ``min(tau, H/F)`` inner
  steps' time is hidden (an exchange cannot hide behind more than the steps before the next one);
  on a CPU node nothing hides (gloo's copies run on the cores that compute). Per step:
  ``F x (exchange - hidden) / H``.

Memory: the outer copy of the parameters and the outer momentum (fp32 each, 8 bytes per held
parameter) and the exchange's buffer (``X / F``). The outer step itself (every H steps, over
the held parameters) is left out: it is at most 1/H of the inner optimizer step.

The planner prices time, not convergence: more groups and longer H always send less, and what
they cost in loss is the paper's question (H = 500 with M = 8 matched data parallel there), so
H and M are the user's (``--diloco H`` or ``diloco.*``), never chosen by the search.
"""

from __future__ import annotations

import dataclasses
import math

from plait.comm.ledger import bus_bytes
from plait.errors import ConfigError
from plait.planner.candidate import Candidate
from plait.planner.cluster import Cluster
from plait.planner.cost_terms import BUCKET_BYTES, Setting

OUTER_BYTES = {"none": 4, "fp16": 2, "bf16": 2}
"""Bytes per parameter of the outer exchange, by ``diloco.compression``."""
OUTER_STATE_BYTES = 8
"""The outer copy of the parameters and the outer momentum, fp32 each."""


@dataclasses.dataclass(frozen=True)
class DilocoSpec:
    """What `plait plan` prices DiLoCo with: the H values, and the config's other keys."""

    inner_steps: tuple[int, ...]
    replicas: int = 0
    """0: one group per island of the cluster (when it has islands and the devices fill them),
    else ``diloco.replicas``'s own meaning, one group per dp rank."""
    fragments: int = 1
    overlap_steps: int = 0
    compression: str = "none"


def spec_from_config(section, inner_steps=()) -> DilocoSpec | None:
    """The `DilocoSpec` of a config's ``[diloco]`` section: ``inner_steps`` (from ``--diloco``) or
    else the section's own H; None when neither turns DiLoCo on."""
    hs = tuple(inner_steps) or ((section.inner_steps,) if section.inner_steps > 0 else ())
    if not hs:
        return None
    if any(h < 1 for h in hs):
        raise ConfigError(f"--diloco takes inner steps H >= 1, got {', '.join(map(str, hs))}")
    if section.compression not in OUTER_BYTES:
        raise ConfigError(
            f"plait plan prices the outer exchange for diloco.compression {', '.join(OUTER_BYTES)}; "
            f"{section.compression!r} is not priced (its bytes depend on the compressor's state)"
        )
    if section.replicas < 0 or section.fragments < 1 or section.overlap_steps < 0:
        raise ConfigError(
            "diloco.replicas must be >= 0, diloco.fragments >= 1 and diloco.overlap_steps >= 0; got "
            f"{section.replicas}, {section.fragments}, {section.overlap_steps}"
        )
    return DilocoSpec(
        inner_steps=tuple(sorted(set(hs))),
        replicas=section.replicas,
        fragments=section.fragments,
        overlap_steps=section.overlap_steps,
        compression=section.compression,
    )


def replicas_for(spec: DilocoSpec, cluster: Cluster, devices: int, dp: int) -> int:
    """M for a layout of `dp` over `devices`: the spec's, else one group per island, else dp."""
    if spec.replicas:
        return spec.replicas
    islands = cluster.islands(devices)
    if islands > 1 and devices % cluster.island_devices == 0:
        return islands
    return dp


def variants(lay: Candidate, spec: DilocoSpec, cluster: Cluster):
    """The DiLoCo candidates of a plain layout, one per H: none when M does not divide its dp
    into at least 2 groups, or when its ZeRO group or hybrid shard does not fit inside a group."""
    M = replicas_for(spec, cluster, lay.devices, lay.dp)
    if M < 2 or lay.dp % M:
        return
    inner = lay.dp // M
    if lay.zero_stage and inner * lay.ep == 1:  # ZeRO over a group of one rank: its z0 twin
        return
    if lay.hybrid_shard and (inner % lay.hybrid_shard or lay.hybrid_shard >= inner):
        return
    for h in spec.inner_steps:
        yield dataclasses.replace(
            lay,
            diloco_inner_steps=h,
            diloco_replicas=M,
            diloco_fragments=spec.fragments,
            diloco_overlap_steps=spec.overlap_steps,
            diloco_compression=spec.compression,
        )


@dataclasses.dataclass(frozen=True)
class OuterSync:
    """The outer exchange of one rank (all zero without DiLoCo)."""

    payload: float = 0.0
    """Bytes of the pseudo-gradient this rank holds (all F fragments)."""
    bus_per_exchange: float = 0.0
    """Ring bus bytes of one exchange (one fragment): the peak."""
    bus_per_step: float = 0.0
    """Ring bus bytes per inner step, averaged over the H steps."""
    exchange_s: float = 0.0
    """Seconds of one exchange on the replica axis's link."""
    hidden_s: float = 0.0
    """Of an exchange, the seconds hidden behind the overlapped inner steps."""
    exposed_s: float = 0.0
    """Seconds per inner step the exchanges add, averaged over the H steps."""
    state_bytes: int = 0
    """Memory: the outer parameters and momentum, and the exchange's buffer."""


def held_params(st: Setting, psi: int) -> float:
    """The parameters a rank holds between steps: `stage_params`'s, a ZeRO-3 shard of them."""
    return psi / st.shard if st.lo.zero_stage == 3 else float(psi)


def outer_sync_term(st: Setting, psi: int, inner_step_s: float) -> OuterSync:
    """The outer exchange per rank and inner step (module docstring)."""
    lo = st.lo
    if not lo.diloco:
        return OuterSync()
    M, H, F, tau = lo.diloco_replicas, lo.diloco_inner_steps, lo.diloco_fragments, lo.diloco_overlap_steps
    held = held_params(st, psi)
    payload = held * OUTER_BYTES[lo.diloco_compression]
    fragment = payload / F
    per_exchange = bus_bytes("all_reduce", fragment, M)
    messages = max(1, math.ceil(fragment / BUCKET_BYTES))
    exchange = st.ring(st.links["replica"], "all_reduce", fragment, M, messages)
    window = 0.0 if st.cluster.cores else min(tau, H / F) * inner_step_s
    hidden = min(exchange, window)
    return OuterSync(
        payload=payload,
        bus_per_exchange=per_exchange,
        bus_per_step=F * per_exchange / H,
        exchange_s=exchange,
        hidden_s=hidden,
        exposed_s=F * (exchange - hidden) / H,
        state_bytes=math.ceil(held * OUTER_STATE_BYTES + fragment),
    )
