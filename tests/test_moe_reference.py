"""plait.moe against a mixture-of-experts layer written here from the papers' equations, not from
plait: one process, GPT's MoE block (where the loss coefficients are applied), and expert
parallelism (ep 2).

The reference (`reference_moe`, float64, a loop over groups and claims) is GShard's layer
(Lepikhin et al. 2020, §2.2 and Algorithm 1) and Switch's (Fedus et al. 2021, §2.1-2.2):

    p = softmax(x W_g^T)                                   router probabilities, per token
    top-1: e1 = argmax p, gate p[e1]                       (Switch)
    top-2: e2 = argmax of p without e1, gates p[e1], p[e2] over their sum      (GShard)
    C = ceil(k · capacity_factor · S / E)                  slots per expert and group of S tokens
    claims in order (every first choice in token order, then every second choice); a claim
    whose expert already has C earlier claims is dropped (gate 0); dropless: none is dropped
    y = Σ over kept claims of gate · FFN_e(x),  FFN_e(v) = gelu_tanh(v W1_e + b1_e) W2_e + b2_e
    aux = E · Σ_e f_e · P_e    f_e = share of the group's first choices on e, P_e = mean p_e
                               (Switch eq. 4-6), averaged over groups
    z = mean over tokens of (logsumexp of the token's logits)²      (ST-MoE, Zoph et al. 2022, eq. 5)

and the objective (y · w).sum() + AUX · aux + Z · z with two distinct, non-zero coefficients.

Every comparison goes through `_close`, which reports how far a value is from the reference in
units of its tolerance (rel. to the reference's largest entry), so a planted bug's margin can be
read off the failure. Measured with planted bugs (each reverted), the smallest margin of the
failing checks: the aux coefficient 2x in GPT's block 461x, the z coefficient 2x 931x, aux with
E/2 for E 230x, aux without E 346x, f_e from the second choice 1229x, the z-loss not squared
667x, a capacity one slot larger (drop counts differ, outputs 26342x), the second gate not
renormalised 12971x; at ep 2, the combine all-to-all's dimensions swapped 36211x, every rank
keeping experts 0-1 of the bank 69881x.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from plait.comm import ops
from plait.mesh import Mesh
from plait.models import GPTConfig
from plait.models.gpt import MoEFeedForward
from plait.moe import MoE
from plait.testing import run_ranks

D, FF, E, S = 8, 12, 4, 12  # d_model, d_ff, experts, tokens per routing group
AUX, Z = 0.3, 0.07  # the objective's coefficients: distinct and non-zero
RTOL = 2e-5  # float32 (plait) against float64 (the reference), relative to the largest entry
CASES = [  # name, top_k, capacity_factor (0: dropless)
    ("top1-capacity", 1, 1.0),
    ("top2-capacity", 2, 0.75),
    ("top2-dropless", 2, 0.0),
]


def reference_moe(x, wg, w1, b1, w2, b2, top_k, capacity_factor):
    """The layer above on tokens x [T, d] in groups of S (float64 tensors): (y, aux, z, drops)."""
    ys, aux, zs, drops = [], 0.0, [], 0
    for g0 in range(0, x.shape[0], S):
        xs = x[g0 : g0 + S]
        logits = xs @ wg.T
        p = torch.softmax(logits, -1)
        e1 = p.argmax(-1)
        picks = [(e1, p.gather(1, e1[:, None])[:, 0])]
        if top_k == 2:
            e2 = p.scatter(1, e1[:, None], -1.0).argmax(-1)
            p1, p2 = picks[0][1], p.gather(1, e2[:, None])[:, 0]
            picks = [(e1, p1 / (p1 + p2)), (e2, p2 / (p1 + p2))]
        cap = math.ceil(top_k * capacity_factor * S / E - 1e-9) if capacity_factor else S * top_k
        taken = [0] * E
        rows = [torch.zeros(x.shape[1], dtype=x.dtype) for _ in range(S)]
        for experts, gates in picks:  # every first choice, then every second choice
            for s in range(S):
                e = int(experts[s])
                taken[e] += 1
                if taken[e] > cap:
                    drops += 1
                    continue
                h = F.gelu(xs[s] @ w1[e] + b1[e], approximate="tanh")
                rows[s] = rows[s] + gates[s] * (h @ w2[e] + b2[e])
        ys.append(torch.stack(rows))
        f = torch.stack([(e1 == e).double().mean() for e in range(E)])
        aux = aux + E * (f * p.mean(0)).sum()
        zs.append(torch.logsumexp(logits, -1) ** 2)
    return torch.cat(ys), aux / (x.shape[0] // S), torch.cat(zs).mean(), drops


def _params64(moe: MoE):
    """The router and the whole bank of `moe` (one process) as float64 leaves."""
    b = moe.experts
    return [t.detach().double().requires_grad_() for t in (moe.router.weight, b.w1, b.b1, b.w2, b.b2)]


def _reference(moe: MoE, x, w, top_k, cf):
    """The reference's outputs and the gradients of its objective: params, x."""
    params = _params64(moe)
    x64 = x.detach().double().requires_grad_()
    y, aux, z, drops = reference_moe(x64, *params, top_k, cf)
    ((y * w.double()).sum() + AUX * aux + Z * z).backward()
    grads = dict(zip(("router", "w1", "b1", "w2", "b2"), (p.grad for p in params)))
    return {"y": y.detach(), "aux": aux.detach(), "z": z.detach(), "drops": drops, "x": x64.grad, **grads}


def _close(got, want, what):
    """|got - want| <= RTOL · max|want|, the failure naming the error in units of the tolerance."""
    got, want = torch.as_tensor(got).detach().double(), torch.as_tensor(want).detach().double()
    tol = RTOL * float(want.abs().max()) + 1e-12
    err = float((got - want).abs().max())
    assert err <= tol, f"{what}: off by {err:.3g}, {err / tol:.1f}x the tolerance {tol:.3g}"


def _moe(top_k, cf, mesh=None):
    torch.manual_seed(7)  # the router, then the whole bank: the same experts whatever ep is
    return MoE(D, FF, E, top_k=top_k, capacity_factor=cf, mesh=mesh, group_size=S)


def _data(groups, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(groups * S, D, generator=gen), torch.randn(groups * S, D, generator=gen)


def _plait_grads(moe):
    b = moe.experts
    return {"router": moe.router.weight.grad, **{k: getattr(b, k).grad for k in ("w1", "b1", "w2", "b2")}}


@pytest.mark.parametrize("name, top_k, cf", CASES, ids=[c[0] for c in CASES])
def test_moe_layer_follows_the_papers_equations(name, top_k, cf):
    """One process, 3 groups: output, both auxiliary losses, and the gradients of the objective
    for the input, the router and every expert parameter."""
    moe = _moe(top_k, cf)
    x, w = _data(3)
    ref = _reference(moe, x, w, top_k, cf)
    x = x.clone().requires_grad_()
    y, st = moe(x)
    ((y * w).sum() + AUX * st.aux_loss + Z * st.z_loss).backward()
    assert int(st.dropped) == ref["drops"], (name, int(st.dropped), ref["drops"])
    assert (ref["drops"] > 0) == (cf > 0), f"{name}: the capacity case must drop claims, dropless none"
    _close(y, ref["y"], f"{name} output")
    _close(st.aux_loss, ref["aux"], f"{name} load-balancing loss")
    _close(st.z_loss, ref["z"], f"{name} z-loss")
    _close(x.grad, ref["x"], f"{name} input gradient")
    for key, grad in _plait_grads(moe).items():
        _close(grad, ref[key], f"{name} gradient of {key}")


def test_gpt_moe_block_applies_its_coefficients():
    """GPT's MoE block with aux_loss_coef = AUX and z_loss_coef = Z, trained on (y · w).sum()
    alone, gives the router the gradient of the reference's whole objective: the block adds the
    coefficients' losses itself (one group per sequence, 2 sequences of S tokens)."""
    sizes = dict(d_model=D, d_ff=FF, n_head=2, experts=E, capacity_factor=0.75)
    cfg = GPTConfig(**sizes, aux_loss_coef=AUX, z_loss_coef=Z)
    torch.manual_seed(7)
    block = MoEFeedForward(cfg).train()
    x, w = _data(2)
    ref = _reference(block.moe, x, w, 2, 0.75)
    assert ref["drops"] > 0
    y = block(x.view(2, S, D))
    (y.reshape(-1, D) * w).sum().backward()
    _close(y.reshape(-1, D), ref["y"], "GPT block output")
    for key, grad in _plait_grads(block.moe).items():
        _close(grad, ref[key], f"GPT block gradient of {key}")


def _ep2():
    """Each ep rank routes its own 2 groups with half the experts; the reference routes all 4
    groups with every expert (objective summed over them)."""
    mesh = Mesh(ep=2, timeout_s=60)
    r, out = mesh.rank("ep"), {}
    for name, top_k, cf in CASES:
        x, w = _data(4)
        ref = _reference(_moe(top_k, cf), x, w, top_k, cf)
        moe = _moe(top_k, cf, mesh)
        mine = slice(r * 2 * S, (r + 1) * 2 * S)
        xr = x[mine].clone().requires_grad_()
        y, st = moe(xr)
        # each rank's losses are means over its 2 of the 4 groups: half of the objective's share
        ((y * w[mine]).sum() + (AUX * st.aux_loss + Z * st.z_loss) / 2).backward()
        _close(y, ref["y"][mine], f"ep2 {name} output")
        _close(xr.grad, ref["x"][mine], f"ep2 {name} input gradient")
        losses = torch.stack([st.aux_loss.detach(), st.z_loss.detach()]).double()
        ops.all_reduce(losses, mesh, "ep")  # each rank's mean over its groups; the mean of means
        _close(losses[0] / 2, ref["aux"], f"ep2 {name} load-balancing loss")
        _close(losses[1] / 2, ref["z"], f"ep2 {name} z-loss")
        grads = _plait_grads(moe)
        router = grads.pop("router").clone()
        ops.all_reduce(router, mesh, "ep")  # replicated: the objective's gradient is the sum
        _close(router, ref["router"], f"ep2 {name} router gradient")
        own = slice(moe.experts.first, moe.experts.first + moe.experts.local)
        for key, grad in grads.items():  # this rank's experts: complete after the combine
            _close(grad, ref[key][own], f"ep2 {name} gradient of {key} (experts {own})")
        dropped = torch.tensor([int(st.dropped)])
        ops.all_reduce(dropped, mesh, "ep")
        out[name] = (int(dropped), ref["drops"])
    mesh.close()
    return out


def test_expert_parallel_ep2_follows_the_papers_equations():
    for name, (got, want) in run_ranks(_ep2, 2, timeout=180)[0].items():
        assert got == want and (want > 0) == ("capacity" in name), (name, got, want)
