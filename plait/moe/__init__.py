"""plait.moe: mixture of experts (GShard top-2, Switch top-1) with expert parallelism over `ep`.

`MoE` is the layer (router + expert bank + the all-to-all dispatch and combine); `Router`,
`Experts` and the routing functions are its parts, usable on their own. See docs/moe.md.
"""

from plait.moe.experts import Experts, is_expert_param
from plait.moe.layer import MoE, MoEStats, attach_loss
from plait.moe.router import (
    Choices,
    Router,
    Routing,
    assign,
    choose,
    expert_capacity,
    load_balancing_loss,
    route,
    router_z_loss,
)

__all__ = [
    "Choices",
    "Experts",
    "MoE",
    "MoEStats",
    "Router",
    "Routing",
    "assign",
    "attach_loss",
    "choose",
    "expert_capacity",
    "is_expert_param",
    "load_balancing_loss",
    "route",
    "router_z_loss",
]
