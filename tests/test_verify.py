"""`plait verify` and `plait.verify`: each layout against one process, on the user's model.

The Python API runs plait's tiny GPT under layouts of 2 and 4 ranks (they hold), and two planted
faults of the kind users meet: a tensor-parallel plan that leaves one LayerNorm of a
sequence-parallel model unmarked (its gradient is partial over tp and never summed: exactly that
norm's parameters differ), and a loss normalised by the global batch's tokens while plait expects
the mean over the rows it is given (every gradient is 4x too small under dp 2 x 2 micro-batches).
The command runs a `python:` factory's model and a Hugging Face Llama through `plait train`, the
same planted plan fault through a factory (exit 1, the norm named), and refuses bad input in one
line before any process starts.
"""

import json
import os
import textwrap

import pytest
from conftest import run_cli, side_by_side, tiny_gpt, token_batches

import plait
from plait.errors import ConfigError
from plait.parity.compare import Trace, compare

FAST = [  # a few-second tiny config (the verify keys set the optimizer, lr, steps, checkpoints)
    "--model.name", "tiny", "--train.global_batch", "8", "--train.progress", "false",
    "--comm.timeout_s", "60", "--data.held_out_fraction", "0.05",
]  # fmt: skip


def tiny_factory():
    return tiny_gpt(0)


def global_token_mean(model, batch):
    """A loss normalised by the global batch's token count (8 x 32), not the rows given."""
    x, y = batch
    return model(x, y, reduction="sum") / (8 * 32)


def _unmarked_norm_plan():
    """plait's GPT plan with block 1's ln_2 left out: under sequence parallelism it runs on
    sequence shards, so its gradient is partial over tp, and nothing sums it."""
    plan = tiny_gpt(0).tp_plan()
    style = plan.pop("blocks.*.ln_2")
    plan["blocks.0.ln_2"] = style
    return plan


@pytest.fixture(scope="module")
def api_reports(tmp_path_factory):
    batches = token_batches(1, 8, 32) * 3  # one batch, three times: the loss falls (a moving run)
    out = tmp_path_factory.mktemp("verify-api")
    holds = {"dp": 2, "zero_stage": 3}, {"tp": 2, "sequence_parallel": True}
    holds += {"dp": 2, "tp": 2, "zero_stage": 1}, {"pp": 2, "dp": 2}
    jobs = {
        "holds": lambda: plait.verify(tiny_factory, None, batches, holds, out=out / "holds", quiet=True),
        "rule": lambda: plait.verify(
            tiny_factory, None, batches[:2], [{"tp": 2, "sequence_parallel": True}],
            tp_plan=_unmarked_norm_plan(), out=out / "rule", quiet=True,
        ),
        "loss": lambda: plait.verify(
            tiny_factory, global_token_mean, batches[:2], [{"dp": 2, "micro_batches": 2}], quiet=True
        ),
    }  # fmt: skip
    return out, side_by_side(jobs, lanes=1)


def test_layouts_of_two_and_four_ranks_hold(api_reports):
    out, reports = api_reports
    report = reports["holds"]
    assert report.holds and len(report.layouts) == 4
    for lay in report.layouts:
        assert len(lay["steps"]) == 3
        for row in lay["steps"]:
            # the trajectory moves (SGD lr 0.5), and every layout follows it to 1e-5
            assert row["loss_rel"] < 1e-5 and row["grad_norm_rel"] < 1e-5 and row["param_rel_max"] < 1e-5
            assert row["grad_rel_max"] < 1e-3 and row["grads_differing"] == 0, (lay["name"], row)
        assert lay["steps"][0]["loss"] > lay["steps"][-1]["loss"]
    written = json.loads((out / "holds" / "report.json").read_text())
    assert written["holds"] and [w["name"] for w in written["layouts"]] == [x["name"] for x in report.layouts]
    assert (out / "holds" / "errors.png").stat().st_size > 0
    assert "| `pp=2+dp=2` | holds |" in (out / "holds" / "report.md").read_text()


def test_an_unmarked_sequence_parallel_norm_is_named(api_reports):
    out, reports = api_reports
    lay = reports["rule"].layouts[0]
    assert not reports["rule"].holds and not lay["holds"]
    first = lay["differing"]
    # the norm's two parameters differ at step 1, and nothing else does: the step's loss holds
    assert {d["name"] for d in first} == {"blocks.1.ln_2.weight", "blocks.1.ln_2.bias"}
    assert all(d["step"] == 1 and d["rel"] > 0.3 and d["placement"] == "replicated" for d in first)
    assert lay["steps"][0]["loss_rel"] < 1e-6 and lay["where"] in {d["name"] for d in first}
    assert "differs at `blocks.1.ln_2." in (out / "rule" / "report.md").read_text()


def test_a_loss_normalised_per_global_batch_is_caught(api_reports):
    lay = api_reports[1]["loss"].layouts[0]
    assert not lay["holds"]
    # dp 2 x 2 micro-batches: each part's loss is a quarter of its mean, so every gradient is 4x small
    assert all(abs(d["rel"] - 0.75) < 1e-3 for d in lay["differing"])
    assert abs(lay["steps"][0]["loss"] / lay["steps"][0]["loss_ref"] - 0.25) < 1e-6


def test_compare_sees_a_gradient_twice_too_large():
    """The comparison alone, from hand-made traces: one parameter's update 2x too large."""
    import torch

    p0 = {"a": torch.ones(4), "b": torch.ones(3)}
    step = {"a": torch.full((4,), 0.9), "b": torch.full((3,), 0.8)}
    wrong = {"a": step["a"], "b": torch.full((3,), 0.6)}  # b moved 0.4 instead of 0.2
    ref = Trace("ref", [2.0], [1.0], [p0, step])
    got = compare(ref, Trace("x", [2.0], [1.0], [p0, wrong]), tol=1e-5)
    assert not got["holds"] and got["where"] == "b" and got["differing"][0]["rel"] == pytest.approx(1.0)
    assert compare(ref, Trace("y", [2.0], [1.0], [p0, dict(step)]), tol=1e-5)["holds"]


def test_bad_layouts_are_refused_before_any_process():
    batches = token_batches(1, 8, 32)
    for layouts, message in [
        ([{"dp": 2, "zero": 3}], "unknown layout key 'zero'"),
        ([{"zero_stage": 3}], "runs on 1 process"),
    ]:
        with pytest.raises(ConfigError, match=message):
            plait.verify(tiny_factory, None, batches, layouts)
    with pytest.raises(ConfigError, match="batches is empty"):
        plait.verify(tiny_factory, None, [], [{"dp": 2}])


# --- the command ----------------------------------------------------------------------------------

FACTORIES = textwrap.dedent(
    '''
    """A user's factories for tests/test_verify.py."""
    import torch.nn.functional as F
    from torch import nn

    from plait.models import GPT, gpt_config
    from plait.tensor_parallel import Colwise, LocalWidths, Rowwise


    def _gpt(args):
        return GPT(gpt_config("tiny", seq_len=args.seq_len, vocab_size=args.vocab_size))


    def make_gpt(args):
        return _gpt(args)


    def make_gpt_unmarked_norm(args):  # the plan leaves block 1's ln_2 out
        net = _gpt(args)
        plan = net.tp_plan()
        plan["blocks.0.ln_2"] = plan.pop("blocks.*.ln_2")
        return net, {"tp_plan": plan}


    def make_gpt_wrong_fused(args):  # [q | k | v] split as one block: fused=3 forgotten
        net = _gpt(args)
        plan = net.tp_plan()
        plan["blocks.*.attn.qkv"] = Colwise(dim="heads")
        return net, {"tp_plan": plan}


    class Attention(nn.Module):  # nanoGPT's: its head size from the whole width it is given
        def __init__(self, d, n_head):
            super().__init__()
            self.n_head, self.n_embd = n_head, d
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


    def make_config_widths(args):
        emb, head = nn.Embedding(args.vocab_size, 32), nn.Linear(32, args.vocab_size)
        net = nn.Sequential(emb, Attention(32, 4), head)
        plan = {"1": LocalWidths("n_head", "n_embd"), "1.c_attn": Colwise(fused=3), "1.c_proj": Rowwise()}
        return net, {"tp_plan": plan}
    '''
)


def _verify(tmp_path, name, *args, env=None):
    out = tmp_path / name
    return out, run_cli("verify", *FAST, "--steps", "2", "--out", str(out), *args, env=env, timeout=600)


def test_the_command_on_a_factory_and_a_llama(tmp_path, monkeypatch):
    (tmp_path / "verify_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))  # the command's process (forked) checks the factory
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    src = "--model.source"
    llama = (src, "hf:llama", "--model.n_head", "4", "--model.n_kv_head", "2")
    jobs = {
        "python": lambda: _verify(tmp_path, "python", src, "python:verify_factories:make_gpt", "--layouts",
                                  "dp=2+zero_stage=2,dp=2+tp=2+sequence_parallel=true", env=env),
        "llama": lambda: _verify(tmp_path, "llama", *llama, "--layouts",
                                 "dp=2+zero_stage=3,cp=2+tp=2+sequence_parallel=true"),
        "wrong": lambda: _verify(tmp_path, "wrong", src, "python:verify_factories:make_gpt_unmarked_norm",
                                 "--layouts", "tp=2+sequence_parallel=true", env=env),
        "fused": lambda: _verify(tmp_path, "fused", src, "python:verify_factories:make_gpt_wrong_fused",
                                 "--layouts", "tp=2", env=env),
        "widths": lambda: _verify(tmp_path, "widths", src, "python:verify_factories:make_config_widths",
                                  "--layouts", "tp=2", env=env),
    }  # fmt: skip
    done = side_by_side(jobs, lanes=2)
    for name in ("python", "llama"):
        out, proc = done[name]
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 2 and all(": holds (" in line for line in lines), proc.stdout
        report = json.loads((out / "report.json").read_text())
        assert report["holds"] and all(len(lay["steps"]) == 2 for lay in report["layouts"])
        assert "[3/3]" in proc.stderr  # progress: the reference and each layout
        measured = {r["what"]: r for lay in report["layouts"] for r in lay["measured"]["rows"]}
        assert measured["bus bytes on dp per step"]["ratio"] == pytest.approx(1.0, abs=0.01)
        if name == "llama":  # ring attention's K/V hops (grouped-query: 2 of 4 heads) under tp + SP
            assert measured["bus bytes on cp per step"]["ratio"] == pytest.approx(1.0, abs=1e-9)
    out, proc = done["wrong"]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tp=2+sequence_parallel=true: differs at blocks.1.ln_2." in proc.stdout
    assert "placement: replicated; module blocks.1.ln_2: rule none, replicated over tp)" in proc.stdout
    # a forward-path fault: the layer its rule splits wrongly, not the worst gradient downstream
    out, proc = done["fused"]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.startswith(
        "tp=2: differs at blocks.0.attn.qkv (forward: its split output is read wrongly on the way to "
        "blocks.0.attn.core, step 1; rule: Colwise() from the factory's tp_plan)"
    ), proc.stdout
    assert "the first difference is in `blocks.0.attn.qkv`" in (out / "report.md").read_text()
    # a crash at the first forward: the module and what to change, in the verdict and the report
    out, proc = done["widths"]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tp=2: fails: rank " in proc.stdout
    assert "failed in the forward of net.1 (Attention; rule: LocalWidths(" in proc.stdout
    report = json.loads((out / "report.json").read_text())["layouts"][0]["failed"]
    assert report["module"] == "net.1" and "LocalWidths('n_head', 'n_embd')" in report["traceback"]
    md = (out / "report.md").read_text()
    assert "| `tp=2` | fails: " in md and md.count("\n| `tp=2` |") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (("--layouts", "dp=2+zero=3"), "'zero=3' is not key=value with a layout key"),
        (("--layouts", "zero_stage=3"), "runs on one process, which is the reference"),
        (("--layouts", "dp=3"), "global_batch"),
        (("--model.source", "python:no_such_module_here:make", "--layouts", "dp=2"), "no_such_module_here"),
        (("--layouts", "dp=2", "--top", "2"), "give --layouts or --top"),
        (("--model.source", "hf:llama", "--top", "2"), "plans plait's own GPT"),
    ],
)
def test_bad_input_is_one_line_before_any_process(tmp_path, args, message):
    out, proc = _verify(tmp_path, "bad", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "runs").exists()
