"""Stage splitting (GPT and nn.Sequential, uniform and balanced) and the B/W split of the
backward, in one process; the header that tells a stage what its input is, over 2 ranks."""

import pytest
import torch
from conftest import tiny_gpt
from torch import nn

from plait.errors import PipelineError
from plait.models import GPT, gpt_config
from plait.models.gpt_parallel import split_gpt
from plait.pipeline.stage import balanced_bounds, split_sequential
from plait.pipeline.wgrad import DeferredLinears, WeightGradStore


def _gpt(n_layer=4):
    return tiny_gpt(n_layer=n_layer)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)


def test_balanced_bounds_minimise_the_largest_stage():
    assert balanced_bounds([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_bounds([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert balanced_bounds([1, 2, 3, 4, 5], 3) == [0, 3, 4, 5]  # max 6 (1+2+3), the optimum
    with pytest.raises(PipelineError, match="cannot cut 2 layers into 3"):
        balanced_bounds([1, 1], 3)


def test_gpt_stages_chain_to_the_whole_model():
    model = _gpt()
    x, y = _data()
    with torch.no_grad():
        want = float(model(x, y, reduction="sum"))
    for n in (1, 2, 4):
        stages = split_gpt(model, n)
        h = x
        for s in stages[:-1]:
            h = s(h)
        assert float(stages[-1](h, y).detach()) == pytest.approx(want, rel=1e-6)
        names = {name for s in stages for name, _ in s.named_parameters()}
        # the model's own names; the tied head appears as lm_head.weight only on a last stage
        # that does not also hold the embedding
        assert names - {"lm_head.weight"} == {name for name, _ in model.named_parameters()}


def test_balanced_split_puts_fewer_blocks_beside_the_embeddings():
    model = GPT(gpt_config("tiny", n_layer=6, vocab_size=4096, tie_weights=False))
    sizes = [s.hi - s.lo for s in split_gpt(model, 3, split="params")]
    assert sum(sizes) == 6 and sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes
    custom = split_gpt(model, 2, split=lambda name, module: 1.0)  # every piece costs the same
    assert [s.hi - s.lo for s in custom] == [3, 3]


def test_split_sequential():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    loss_fn = lambda out, t: nn.functional.cross_entropy(out, t, reduction="sum")  # noqa: E731
    x, t = torch.randn(5, 8), torch.randint(0, 4, (5,))
    stages = split_sequential(seq, 2, loss_fn)
    with torch.no_grad():
        assert float(stages[1](stages[0](x), t)) == pytest.approx(float(loss_fn(seq(x), t)), rel=1e-6)
    with pytest.raises(PipelineError, match="not divisible into 2 pipeline stages"):
        split_sequential(seq, 2, loss_fn, split="uniform")
    with pytest.raises(PipelineError, match="cannot cut an nn.Sequential of 5 layers into 6"):
        split_sequential(seq, 6, loss_fn)


def test_weight_gradients_deferred_to_w_equal_autograd():
    model = _gpt(2)
    x, y = _data()
    model(x, y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    store = WeightGradStore()
    with DeferredLinears(store):
        loss = model(x, y)
    with store.collect((0, 0)):
        loss.backward()
    deferred = {n for n, p in model.named_parameters() if p.grad is None}
    # B computed everything but the linear layers' weights and biases
    assert deferred == {
        f"blocks.{i}.{m}.{w}"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
        for w in ("weight", "bias")
    }
    assert len(store) == 1
    store.flush((0, 0))
    assert len(store) == 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=0)

    # outside collection the same nodes compute every gradient in one go (a BW action)
    model.zero_grad(set_to_none=True)
    with DeferredLinears(store):
        loss = model(x, y)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-6, rtol=0)


def test_held_stages_refuse_children_of_the_same_name():
    """A rank holding several given stages keeps them under their own child names: two stages
    both naming a child `net` would lose one's parameters, so it is an error."""
    from plait.errors import ConfigError
    from plait.pipeline.engine import HeldStages

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="both have a child named 'net'"):
        HeldStages([Stage(), Stage()])
    merged = HeldStages(split_sequential(torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)]), 2))
    assert len(list(merged.parameters())) == 8  # layer dicts merge: every parameter kept


def _exchange_headers():
    """Rank 0 sends stage outputs of every dtype the runtime knows (and 1 to 6 dims) through the
    runtime's header + tensor exchange; rank 1 returns what it received. A 7-dim output is refused."""
    from types import SimpleNamespace

    from plait.comm import send
    from plait.mesh import Mesh
    from plait.pipeline.runtime import PipelineRuntime

    mesh = Mesh(pp=2)
    me = SimpleNamespace(mesh=mesh, axis="pp", _DTYPES=PipelineRuntime._DTYPES)
    sent = [torch.arange(24, dtype=torch.float64).reshape(2, 3, 4).to(dt) for dt in PipelineRuntime._DTYPES]
    sent.append(torch.ones(1, 2, 1, 3, 1, 2, dtype=torch.bfloat16))  # 6 dims: the most a header holds
    got = []
    for x in sent:
        if mesh.rank("pp") == 0:
            PipelineRuntime._send_header(me, x, 1)
            send(x.contiguous(), mesh, "pp", 1)
        else:
            got.append(PipelineRuntime._recv_header_and_tensor(me, 0))
    refused = ""
    if mesh.rank("pp") == 0:
        try:
            PipelineRuntime._send_header(me, torch.ones([1] * 7), 1)
        except PipelineError as exc:
            refused = str(exc)
    mesh.close()
    return sent if mesh.rank("pp") == 0 else got, refused


def test_a_stage_input_arrives_with_its_dtype_and_shape():
    from plait.testing import run_ranks

    (sent, refused), (got, _) = run_ranks(_exchange_headers, 2)
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in sent]  # bf16 stays bf16
    assert all(torch.equal(a, b) for a, b in zip(got, sent))
    assert "more than 6 dims" in refused
