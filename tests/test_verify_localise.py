"""`plait verify` names the module whose rule is wrong (plait.parity.localise), and reports a
layout whose run fails with the module that raised.

Planted on plait's GPT, on transformers' GPT-NeoX and on a user's own model, each through
`plait.verify` (the command's path, through `plait train`, is in test_verify.py):

* forward: a fused qkv split as one block ([q | k | v] needs ``fused=3``), and GPT-NeoX's per-head
  fused qkv split the GPT-2 way (``fused=3``: its rows are [q k v] per head): the projection's
  output is right as a whole, but the code after it reads the shards wrongly;
* backward only: a column-parallel layer whose backward never sums its input gradient over tp
  (forward values unchanged);
* a crash: a row-parallel layer marked column-parallel; and a user's attention that takes its
  widths from its config (nanoGPT does), which fails under tp until its plan says LocalWidths.

Each verdict names the planted module and its rule, and its error is far beyond the tolerance.
The layouts that hold are surveyed too: every module tensor of step 1 reassembles (dp, tp with
sequence parallelism, pp x tp) and agrees, so a broken reassembly cannot pass by comparing nothing.
"""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import side_by_side, tiny_gpt, token_batches
from torch import nn

import plait
from plait.comm.spawn import run_ranks
from plait.parity.compare import compare, verdict_line
from plait.parity.localise import _unfuse, survey
from plait.parity.pyapi import _rank, layout_name, reference_trace, trace_of
from plait.parity.report import cell
from plait.tensor_parallel.apply import _colwise
from plait.tp_plan import Colwise, LocalWidths, Rowwise

TOL = 1e-5


def tiny_factory():
    return tiny_gpt(0)


@dataclasses.dataclass
class ColwiseUnreduced:
    """Planted: a column-parallel layer whose forward skips the f operator, so its input gradient
    stays partial over tp (Megatron-LM's f: identity forward, all-reduce backward)."""

    dim: str | None = "d_ff"

    def apply(self, name, m, ctx):
        new = _colwise(Colwise(dim=self.dim), name, m, ctx)
        new.forward = lambda x: F.linear(x, new.weight, new.bias)
        return new


# --- a user's own model: attention written against its own sizes --------------------------------


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int, widths_from_config: bool):
        super().__init__()
        self.n_head, self.n_embd, self.from_config = n_head, d, widths_from_config
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        # nanoGPT's `C // self.n_head` is the whole model's head size, whatever tp holds
        hs = C // self.n_head if self.from_config else self.n_embd // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_embd))


class Block(nn.Module):
    def __init__(self, d, n_head, from_config):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attention(d, n_head, from_config)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class UserLM(nn.Module):
    def __init__(self, from_config: bool, vocab=64, d=32, n_head=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, n_head, from_config) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def user_lm_from_config():
    return UserLM(from_config=True)


def user_lm():
    return UserLM(from_config=False)


USER_PLAN = {
    "blocks.*.attn": LocalWidths("n_head", "n_embd"),
    "blocks.*.attn.qkv": Colwise(fused=3, dim="heads"),
    "blocks.*.attn.proj": Rowwise(dim="heads"),
}


# --- transformers' GPT-NeoX: q, k and v fused per head -------------------------------------------


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return GPTNeoXForCausalLM(cfg)


def neox_loss(model, batch):
    x, y = batch
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _neox_plan(qkv):
    return {
        "gpt_neox.layers.*.attention.query_key_value": qkv,
        "gpt_neox.layers.*.attention.dense": Rowwise(dim="heads"),
        "gpt_neox.layers.*.mlp.dense_h_to_4h": Colwise(dim="d_ff"),
        "gpt_neox.layers.*.mlp.dense_4h_to_h": Rowwise(dim="d_ff"),
    }


# name: (model factory, loss_fn, the plan, batches: "gpt" or "small"); each runs as dp 2 x tp 2
CASES = {
    "fused": (tiny_factory, None, {"blocks.*.attn.qkv": Colwise(dim="heads")}, "gpt"),
    "unreduced": (tiny_factory, None, {"blocks.*.mlp.fc": ColwiseUnreduced()}, "gpt"),
    "neox": (gpt_neox, neox_loss, _neox_plan(Colwise(fused=3, dim="heads")), "small"),
    "neox_per_head": (gpt_neox, neox_loss, _neox_plan(Colwise(dim="heads")), "small"),
    "user": (user_lm, None, USER_PLAN, "small"),
}
HOLDS = ({"dp": 2, "tp": 2, "sequence_parallel": True}, {"pp": 2, "tp": 2})  # plait's GPT, its own plan


def _batches():
    return {"gpt": token_batches(1, 8, 32) * 2, "small": token_batches(1, 4, 16, vocab=64) * 2}


def _plan_of(case):
    factory, _, plan, _ = CASES[case]
    return {**tiny_gpt(0).tp_plan(), **plan} if factory is tiny_factory else plan


def _all_cases():
    """Every case on this rank, one after another (one spawn of 4 ranks for them all)."""
    batches = _batches()
    out = {}
    for lay in HOLDS:
        out[layout_name(lay)] = _rank(tiny_factory, None, batches["gpt"][:1], lay, 0.2, 0, None, None)
    for case, (factory, loss_fn, _, which) in CASES.items():
        out[case] = _rank(factory, loss_fn, batches[which], {"dp": 2, "tp": 2}, 0.2, 0, _plan_of(case), None)
    return out


@pytest.fixture(scope="module")
def results():
    """{case: (its Trace, the reference's)}: the cases in one spawn; the references here."""
    ranks = run_ranks(_all_cases, 4, timeout=600)
    batches, refs = _batches(), {}
    for name in (*[layout_name(lay) for lay in HOLDS], *CASES):
        factory, loss_fn, _, which = CASES.get(name, (tiny_factory, None, None, "gpt"))
        data = batches[which] if name in CASES else batches["gpt"][:1]
        key = (factory, which, len(data))
        if key not in refs:
            refs[key] = reference_trace(factory, loss_fn, data, 0.2, 0)
        refs[name] = refs[key]
    return {name: (trace_of(name, [r[name] for r in ranks]), refs[name]) for name in ranks[0]}


def _verdict(results, case):
    trace, ref = results[case]
    result = compare(ref, trace, TOL)
    return result, verdict_line("dp=2+tp=2", result)


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """The two planted crashes, each through plait.verify (a failing rank ends its spawn)."""
    out = tmp_path_factory.mktemp("localise")
    crash = {**tiny_gpt(0).tp_plan(), "blocks.*.mlp.proj": Colwise(dim="d_ff")}
    gpt, small = token_batches(1, 8, 32), token_batches(1, 4, 16, vocab=64)
    jobs = {
        "crash": lambda: plait.verify(tiny_factory, None, gpt, [{"tp": 2}], tp_plan=crash, out=out / "crash",
                                      quiet=True),
        "user_config": lambda: plait.verify(user_lm_from_config, None, small, [{"tp": 2}], tp_plan=USER_PLAN,
                                            quiet=True),
    }  # fmt: skip
    return out, side_by_side(jobs, lanes=2)


def test_a_fused_projection_split_as_one_block_is_named(results):
    result, line = _verdict(results, "fused")
    assert line.startswith("dp=2+tp=2: differs at blocks.0.attn.qkv (forward: its split output is read")
    assert "rule: Colwise() from the tp_plan passed in" in line
    assert result["localised"]["error"] > 3 * TOL
    # the worst gradients stay below the verdict: the bystanders a gradient-only verdict named
    assert result["differing"] and result["differing"][0]["name"] != "blocks.0.attn.qkv.weight"


def test_gpt_neox_split_the_gpt2_way_is_named_and_per_head_holds(results):
    _, line = _verdict(results, "neox")
    assert line.startswith("dp=2+tp=2: differs at gpt_neox.layers.0.attention.query_key_value (forward: ")
    assert "rule: Colwise(fused=3) from the tp_plan passed in" in line
    assert _verdict(results, "neox_per_head")[0]["holds"]  # GPT-NeoX's rows are [q k v] per head: one block


def test_a_gradient_not_reduced_in_backward_is_named(results):
    result, line = _verdict(results, "unreduced")
    assert result["steps"][0]["loss_rel"] < 1e-6  # the forward is untouched
    assert line.startswith(
        "dp=2+tp=2: differs at blocks.1.mlp.fc (backward: its input gradient, step 1; rule: ColwiseUnreduced("
    )
    assert result["localised"]["error"] > 3 * TOL


def test_a_users_attention_with_local_widths_holds(results):
    assert _verdict(results, "user")[0]["holds"]


def test_a_rule_that_crashes_a_rank_is_a_failed_verdict_with_its_module(failures):
    out, done = failures
    report = done["crash"]
    lay = report.layouts[0]
    assert not report.holds and lay["failed"]["module"] == "blocks.0.mlp.proj"
    assert lay["failed"]["phase"] == "forward" and "shapes cannot be multiplied" in lay["failed"]["exception"]
    line = report.lines()[0]
    assert line.startswith("tp=2: fails: rank ") and (
        "failed in the forward of blocks.0.mlp.proj (ColumnParallelLinear; rule: Colwise() from the tp_plan "
        "passed in): RuntimeError: mat1 and mat2 shapes cannot be multiplied" in line
    )
    assert "plait: raised in the forward of blocks.0.mlp.proj" in lay["failed"]["traceback"]
    md = (out / "crash" / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| `tp=2` |"))
    assert row.endswith("| - | - | - | - |") and "0.0e+00" not in md
    assert "```" in md and "Traceback (most recent call last)" in md
    assert json.loads((out / "crash" / "report.json").read_text())["layouts"][0]["failed"]["rank"] in (0, 1)


def test_an_attention_reading_its_config_widths_says_what_to_change(failures):
    f = failures[1]["user_config"].layouts[0]["failed"]
    assert f["module"] == "blocks.0.attn" and f["phase"] == "forward"
    assert "LocalWidths('n_head', 'n_embd')" in f["traceback"] and "under tp = 2" in f["traceback"]


def test_table_cells_are_escaped():
    assert cell("a | b\nc") == "a \\| b c"
    assert cell("x" * 3) == "xxx"


def test_holding_layouts_reassemble_every_module_and_agree(results):
    for lay in HOLDS:
        trace, ref = results[layout_name(lay)]
        errors = survey(ref.modules, trace.modules)
        compared = {k: e for k, e in errors.items() if e is not None}
        # all but the model's own call (its output is the loss: a scalar)
        assert len(compared) >= len(errors) - 4 and len(compared) > 100, (lay, len(compared), len(errors))
        assert max(compared.values()) < TOL, (lay, max(compared.items(), key=lambda kv: kv[1]))
        # inputs, outputs and both gradients of split layers; under sequence parallelism the
        # position rows too, split over tp and alike on every data rank (no batch dim)
        wanted = [("out", "blocks.0.attn.qkv"), ("gin", "blocks.1.mlp.proj"), ("gout", "lm_head")]
        wanted += [("out", "wpe")] if lay.get("sequence_parallel") else []
        assert all(key in compared for key in wanted), (lay, [k for k in wanted if k not in compared])


def test_unfuse_inverts_the_split_of_a_fused_output():
    from plait.placement import _fused_order

    full = torch.arange(2 * 24.0).reshape(2, 24)
    for fused, tp in ((3, 2), (3, 4), (2, 2), (1, 4)):
        shards = full[:, _fused_order(24, fused, tp)].chunk(tp, dim=-1)
        assert torch.equal(_unfuse(torch.cat(shards, -1), fused, tp), full)


def test_relative_error_and_expert_modules_are_judged_exactly():
    """The pure rules under localisation: the relative error (an all-zero reference agrees only
    with zeros; a non-finite difference never agrees), and which modules are inside a
    mixture-of-experts layer (their outputs hold only the rows routed to this rank's experts, so
    an ep layout does not compare them)."""
    from plait.parity.localise import _inside_experts, _rel, localise

    want = torch.tensor([3.0, 4.0])
    assert _rel(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1, rel=1e-12)
    zero = torch.zeros(2)
    assert _rel(zero, zero) == 0.0
    assert _rel(torch.tensor([1e-30, 0.0]), zero) == math.inf
    assert _rel(torch.tensor([math.nan, 0.0]), want) == math.inf
    kinds = {"blocks.1.mlp": "MoELayer", "blocks.2.ff": "Experts", "blocks.0.mlp": "MLP"}
    assert _inside_experts("blocks.1.mlp.router", kinds)
    assert _inside_experts("blocks.2.ff", kinds)
    assert not _inside_experts("blocks.0.mlp.fc", kinds)
    assert not _inside_experts("blocks.1", kinds)
    assert _inside_experts("experts.w1", {"experts": "Experts"})  # a top-level module counts too
    assert localise([], [{"where": {}}], 1e-5, 0.0) is None
    assert localise([{"where": {}}], [], 1e-5, 0.0) is None


def test_the_recorder_keeps_tensors_up_to_its_byte_cap_and_says_it_truncated():
    """Spawn-free: a linear stack recorded forward and backward. Every kept tensor is a copy (a
    later in-place change of the model's output does not reach the record), the byte count is
    the sum of what was kept, and a cap below the whole step keeps a prefix and says so."""
    from plait.train.module_record import ModuleRecorder

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)

    def step(cap):
        rec = ModuleRecorder(model, {}, max_bytes=cap)
        out = model(x)
        out.sum().backward()
        rec.stop()
        return rec, out

    whole, out = step(2**30)
    kept = sum(t.numel() * t.element_size() for t in whole.tensors.values())
    assert not whole.truncated and whole.bytes == kept and kept > 0
    key = next(k for k in whole.tensors if k.startswith("out/1/"))
    saved = whole.tensors[key].clone()
    with torch.no_grad():
        out.add_(1.0)
    assert torch.equal(whole.tensors[key], saved)  # a copy, not a view of the live output
    part, _ = step(kept // 2)
    assert part.truncated and 0 < part.bytes <= kept // 2 and len(part.tensors) < len(whole.tensors)
