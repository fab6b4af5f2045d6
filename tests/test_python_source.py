"""`[model] source = "python:PKG.MODULE:FUNC"`: the user's own factory, trained by `plait train`.

The factories live in a module written into a temporary directory and found through PYTHONPATH
(a subprocess) or sys.path (in this process), as a user's own file would be.
"""

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import SGD, TINY, assert_runs_match, losses, plait_train_all

from plait.errors import ConfigError
from plait.models.python_source import PythonModel, build_python_model, model_args
from plait.train.config import load_config, parse_overrides

MODULE = "plait_test_factories"
SOURCE = textwrap.dedent(
    '''
    """Factories for tests/test_python_source.py: a byte model of the user's own."""
    import torch
    from torch import nn

    from plait.models import GPT, gpt_config
    from plait.tensor_parallel import Colwise, Rowwise


    class Block(nn.Module):
        def __init__(self, d, f):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, f)
            self.down = nn.Linear(f, d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))


    class ByteNet(nn.Module):
        """Embeddings, a causal running mean (the context matters), residual MLP blocks, a head."""

        def __init__(self, vocab, d, f, n):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, f) for _ in range(n))
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            x = x.cumsum(1) / torch.arange(1, idx.shape[1] + 1, device=idx.device).view(1, -1, 1)
            for block in self.blocks:
                x = block(x)
            return self.head(x)


    PLAN = {"blocks.*.up": Colwise(dim="hidden"), "blocks.*.down": Rowwise(dim="hidden")}


    def make_net(args):
        net = ByteNet(args.vocab_size, args.d_model, args.d_ff, args.n_layer)
        return net, {"blocks": list(net.blocks), "tp_plan": PLAN}


    def make_net_whole(args):  # layout rules that keep the MLP's hidden dim whole: nothing splits
        net, extras = make_net(args)
        return net, {**extras, "layout_rules": {"hidden": None}}


    def make_plain(args):
        return ByteNet(args.vocab_size, args.d_model, args.d_ff, args.n_layer)


    def make_gpt(args):  # meets plait's contract: trained as it is
        return GPT(gpt_config("tiny", seq_len=args.seq_len, vocab_size=args.vocab_size))


    def make_sequential(args):
        d = args.d_model
        layers = [nn.Embedding(args.vocab_size, d), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, args.vocab_size)]
        return nn.Sequential(*layers)


    def returns_none(args):
        return None


    def returns_small_logits(args):
        return nn.Embedding(args.vocab_size, 8)


    def raises(args):
        raise RuntimeError("no such size")


    not_a_function = 3
    '''
)


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    """The factory module's directory, on sys.path for this process while the tests run."""
    path = tmp_path_factory.mktemp("factories")
    (path / f"{MODULE}.py").write_text(SOURCE)
    sys.path.insert(0, str(path))
    yield path
    sys.path.remove(str(path))
    sys.modules.pop(MODULE, None)


def _env(path):
    return {"PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}


SMALL = ("--model.n_layer", "2", "--model.d_model", "32", "--model.d_ff", "64")


def test_python_factory_trains_in_parallel_as_in_one_process(factories, tmp_path):
    """SGD with momentum and no clipping: dp2, ZeRO-3 (the factory's blocks as units) and tp2
    (the factory's plan) follow one process at every step, in loss and gradient norm, as does an
    nn.Sequential cut into a 2-stage pipeline (1F1B) by its layers; the one
    process's first loss is the factory's own model's cross-entropy on the first batch; and a
    module meeting plait's contract (plait's GPT from a factory) trains exactly as source = plait."""
    src = ("--model.source", f"python:{MODULE}:make_net")
    seq = ("--model.source", f"python:{MODULE}:make_sequential")
    gpt = ("--model.source", f"python:{MODULE}:make_gpt", "--parallel.dp", "1")
    layouts = {
        "one": (*src, "--parallel.dp", "1"),
        "dp2": (*src, "--parallel.dp", "2"),
        "zero3": (*src, "--parallel.dp", "2", "--parallel.zero_stage", "3"),
        "tp2": (*src, "--parallel.dp", "1", "--parallel.tp", "2"),
        "seq one": (*seq, "--parallel.dp", "1"),
        "seq pp2": (*seq, "--parallel.dp", "1", "--parallel.pp", "2", "--parallel.microbatches", "4"),
        "gpt as is": gpt,
        "plait gpt": ("--parallel.dp", "1"),
    }
    dirs = {what: tmp_path / what.replace(" ", "_") for what in layouts}
    done = plait_train_all(
        {
            what: (
                *TINY,
                *SGD,
                *(SMALL if "gpt" not in what else ()),
                *layout,
                "--train.run_dir",
                str(dirs[what]),
            )
            for what, layout in layouts.items()
        },
        env=_env(factories),
    )
    for what, r in done.items():
        assert r.returncode == 0, f"{what}: {r.stderr[-3000:]}"
    one = losses(dirs["one"])
    assert one[8] < one[1] - 0.3, one  # it trains
    for what in ("dp2", "zero3", "tp2"):
        assert_runs_match(dirs[what], dirs["one"], what=what)
    assert_runs_match(dirs["seq pp2"], dirs["seq one"], what="nn.Sequential cut into 2 pipeline stages")
    assert_runs_match(dirs["gpt as is"], dirs["plait gpt"], rtol=0, what="contract module as is")
    assert "sample:" in done["one"].stdout  # the adapter's generate

    # the first step's loss, from the factory's model outside plait
    from plait.data import DistributedBatchSampler, load_corpus

    cfg = load_config(None, parse_overrides([*TINY, *SMALL, *src, "--parallel.dp", "1"]))
    torch.manual_seed(cfg.train.seed)
    net = sys.modules[MODULE].make_net(model_args(cfg))[0]
    corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
    args = model_args(cfg)
    sampler = DistributedBatchSampler(
        corpus.train, args.seq_len, cfg.train.global_batch, 0, 1, cfg.train.seed
    )
    (x, y), *_ = sampler.next_batch()
    with torch.no_grad():
        want = F.cross_entropy(net(x).reshape(-1, args.vocab_size), y.reshape(-1)).item()
    assert abs(one[1] - want) <= 1e-5 * want, (one[1], want)

    # plait export of a python: run: the factory's module's own state dict (its own names), which
    # the user's module loads and which gives the run's final held-out loss
    import json

    from safetensors.torch import load_file

    from plait.data import eval_batches
    from plait.train.export import export

    out = export(dirs["one"])
    net.load_state_dict(load_file(str(out)), strict=True)
    batches = eval_batches(corpus.val, args.seq_len, cfg.train.global_batch, cfg.train.eval_batches)
    with torch.no_grad():
        val = sum(
            F.cross_entropy(net(x).reshape(-1, args.vocab_size), y.reshape(-1)).item() for x, y in batches
        ) / len(batches)
    assert val == pytest.approx(json.loads((dirs["one"] / "summary.json").read_text())["val_loss"], rel=1e-5)


def test_adapter_gives_the_contract(factories):
    """The adapted module: mean and summed loss, logits, blocks, the plan under its `net.` prefix."""
    cfg = load_config(None, parse_overrides([*SMALL, "--model.source", f"python:{MODULE}:make_net"]))
    torch.manual_seed(0)
    model = build_python_model(cfg.model.source, model_args(cfg))
    assert isinstance(model, PythonModel) and model.cfg.vocab_size == 256
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    mean = model(idx[:, :-1], idx[:, 1:])
    total = model(idx[:, :-1], idx[:, 1:], reduction="sum")
    assert torch.allclose(total, mean * idx[:, 1:].numel())
    assert model.plait_blocks() == list(model.net.blocks)
    assert set(model.tp_plan()) == {"net.blocks.*.up", "net.blocks.*.down"}
    assert model.generate(idx[:1, :4], 5, temperature=0).shape == (1, 9)
    gpt = build_python_model(f"python:{MODULE}:make_gpt", model_args(cfg))
    assert not isinstance(gpt, PythonModel)  # meets the contract: used as it is
    # MFU's model FLOPs: 6 x parameters for any model, a GPT's own count for a GPT
    from plait.models import gpt_train_flops_per_token
    from plait.train.report import flops_per_token as _flops_per_token

    assert _flops_per_token(model) == 6 * sum(p.numel() for p in model.parameters())
    assert _flops_per_token(gpt) == gpt_train_flops_per_token(gpt.cfg)


def _layers_under_tp2(path):
    """On each of 2 ranks: the class of the first block's up projection after plait train's
    engine building, with the factory's default layout rules and with {"hidden": None}."""
    sys.path.insert(0, path)
    from plait.mesh import Mesh
    from plait.train.build import build_engine

    mesh = Mesh(tp=2, timeout_s=120)
    out = {}
    for func in ("make_net", "make_net_whole"):
        args = [
            *SMALL,
            "--model.source",
            f"python:{MODULE}:{func}",
            "--parallel.dp",
            "1",
            "--parallel.tp",
            "2",
        ]
        cfg = load_config(None, parse_overrides(args))
        torch.manual_seed(0)
        raw = build_python_model(cfg.model.source, model_args(cfg))
        engine = build_engine(raw, cfg, mesh, Path(path))
        out[func] = type(raw.net.blocks[0].up).__name__
        engine.close()
    mesh.close()
    return out


def test_layout_rules_of_a_factory_reach_tensor_parallelism(factories):
    from plait.testing import run_ranks

    for got in run_ranks(_layers_under_tp2, 2, args=(str(factories),)):
        assert got == {"make_net": "ColumnParallelLinear", "make_net_whole": "Linear"}, got


BAD = {
    "malformed": (("--model.source", "python:no_colon"), "is malformed"),
    "bad chars": (("--model.source", "python:a-b:c"), "is malformed"),
    "unknown source": (("--model.source", "torchvision:resnet"), "is unknown; valid: plait"),
    "no module": (("--model.source", "python:no_such_module_xyz:f"), "not found in the current directory"),
    "no function": (("--model.source", f"python:{MODULE}:make_nothing"), "'make_nothing' not found"),
    "not callable": (("--model.source", f"python:{MODULE}:not_a_function"), "is not callable"),
    "no module returned": (("--model.source", f"python:{MODULE}:returns_none"), "returned NoneType"),
    "factory raises": (("--model.source", f"python:{MODULE}:raises"), "raised RuntimeError: no such size"),
    "wrong output": (("--model.source", f"python:{MODULE}:returns_small_logits"), "with V >= model.vocab"),
    "tp without plan": (
        ("--model.source", f"python:{MODULE}:make_plain", "--parallel.dp", "1", "--parallel.tp", "2"),
        "needs a tensor-parallel plan",
    ),
    "pp without split": (
        ("--model.source", f"python:{MODULE}:make_net", "--parallel.dp", "1", "--parallel.pp", "2"),
        "needs a way to cut the model into stages",
    ),
    "sequential not divisible": (
        (
            "--model.source",
            f"python:{MODULE}:make_sequential",
            "--parallel.dp",
            "1",
            "--parallel.pp",
            "3",
            "--parallel.microbatches",
            "4",
        ),
        "not divisible into parallel.pp x virtual_stages = 3",
    ),
    "experts": (("--model.source", f"python:{MODULE}:make_net", "--model.experts", "4"), "model.experts = 4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_python_source_is_one_clear_line(factories, case):
    args, words = BAD[case]
    with pytest.raises(ConfigError) as err:
        load_config(None, parse_overrides([*SMALL, *args]))
    message = str(err.value)
    assert words in message and "model.source" in message and "\n" not in message, message
