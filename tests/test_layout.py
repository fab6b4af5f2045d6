"""`plait.layout`: the Layout record, its derived axes, and the combination table it checks."""

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from plait.combinations import COMBINATIONS, FEATURES, REFUSED, SUPPORTED, describe_table, with_table
from plait.errors import ConfigError
from plait.layout import Job, Layout, check, features, message_values, refusal
from plait.models import gpt_config
from plait.planner.cluster import Cluster, Link
from plait.planner.search import as_layout, enumerate_layouts
from plait.train.config import Config, pipeline_shape, read_config, validate

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_FIELDS = {f.name for f in dataclasses.fields(Layout)}


def _example(rule):
    """The layout and job of a row's example (a config's overrides, or fields for an API row)."""
    if rule.api:
        fields = dict(rule.example)
        layout = Layout(**{k: v for k, v in fields.items() if k in LAYOUT_FIELDS})
        return None, layout, Job(api=True, **{k: v for k, v in fields.items() if k not in LAYOUT_FIELDS})
    cfg = read_config(None, rule.example)
    return cfg, Layout.from_config(cfg), Job.from_config(cfg)


@pytest.mark.parametrize("rule", REFUSED, ids=[r.id for r in REFUSED])
def test_refusal_is_raised_from_a_config(rule):
    cfg, layout, job = _example(rule)
    assert refusal(layout, job) is rule, (rule.id, refusal(layout, job))
    message = rule.message(message_values(layout, job))
    assert "\n" not in message and "{" not in message, message
    for key in rule.keys:
        assert key in message, (key, message)
    hf_only = job.source.startswith("hf:") and importlib.util.find_spec("transformers") is None
    if cfg is None or hf_only:  # plait.parallelize's own (or hf's, without transformers): check()
        with pytest.raises(ConfigError) as err:
            check(layout, job)
    else:  # plait train: the config is refused before any process starts
        with pytest.raises(ConfigError) as err:
            validate(cfg, data=False)
    assert str(err.value) == message


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


@pytest.mark.parametrize("rule", COMBINATIONS, ids=[r.id for r in COMBINATIONS])
def test_every_row_names_a_test_that_exists(rule):
    path, _, node = rule.test.partition("::")
    assert (ROOT / path).is_file(), rule.test
    if node:
        name, _, param = node.partition("[")
        assert _defines(ROOT / path, name), rule.test
        if path == "tests/test_layout.py" and param:
            assert param.rstrip("]") in {r.id for r in REFUSED}, rule.test
    assert (
        rule.reason and rule.all <= set(FEATURES) and rule.any <= set(FEATURES) and rule.none <= set(FEATURES)
    )


@pytest.mark.parametrize("rule", SUPPORTED, ids=[r.id for r in SUPPORTED])
def test_no_refused_row_covers_a_supported_one(rule):
    for extra in sorted(rule.any) or [None]:
        on = frozenset(rule.all | {extra} - {None})
        assert not [r.id for r in REFUSED if r.applies(on)], (rule.id, on)


def test_docs_matrix_is_the_table():
    page = ROOT / "docs" / "compose.md"
    text = page.read_text()
    assert text == with_table(text), (
        "docs/compose.md's combination matrix differs from plait.combinations: regenerate it with "
        "`python -m plait.combinations docs/compose.md`"
    )


def test_describe_table_lists_every_row():
    text = describe_table()
    for rule in COMBINATIONS:
        assert rule.combination() in text and rule.reason in text, rule.id
    assert all(name in text for name in FEATURES)


def test_derived_axes_and_pipeline_shape():
    lay = Layout(pp=2, dp=4, ep=2, tp=2, dp_shard=2, zero_stage=3, schedule="interleaved")
    assert lay.world == 32 and lay.sizes == {"pp": 2, "dp": 4, "ep": 2, "cp": 1, "tp": 2}
    assert lay.hybrid and lay.dp_replicate == 2 and lay.shard_axis == "dp_shard"
    assert lay.replicate_axis == "dp_replicate" and lay.data_axes == ("dp", "ep")
    assert lay.pipeline_microbatches == 4 and lay.stages_per_rank == 2 and lay.n_stages == 4
    assert lay.describe() == "pp=2 x dp=4 x ep=2 x cp=1 x tp=2"
    combined = lay.combined_axes()
    assert len(combined) == 2**4 - 4 - 1 and ("pp", "dp", "ep", "tp") in combined and ("dp", "tp") in combined
    assert Layout(dp=2, tp=2).combined_axes() == [("dp", "tp")] and Layout(dp=8).combined_axes() == []
    plain = Layout(dp=2)
    assert plain.data_axes == ("dp",) and plain.shard_axis == "dp" and plain.replicate_axis is None
    assert Layout(pp=2, microbatches=6, virtual_stages=3).n_stages == 6
    lay.check_degrees(32)
    with pytest.raises(ConfigError, match="make pp x dp x ep x cp x tp = 8"):
        plain.check_degrees(8)
    with pytest.raises(ConfigError, match="hybrid shard 3 must divide dp = 2"):
        Layout(dp=2, dp_shard=3).check_degrees()


def test_from_config_and_features():
    cfg = read_config(
        None, [("parallel.pp", "2"), ("parallel.schedule", "zb-v"), ("parallel.zero_stage", "1")]
    )
    cfg.train.bf16, cfg.comm.compression, cfg.optim.name = True, "topk", "lamb"
    lay, job = Layout.from_config(cfg), Job.from_config(cfg)
    assert (lay.pp, lay.dp, lay.zero_stage, lay.mixed_precision) == (2, 2, 1, "bf16")
    assert pipeline_shape(cfg) == (4, 2) == (lay.pipeline_microbatches, lay.stages_per_rank)
    assert features(lay, job) == {"pp", "dp", "zero", "bf16", "compression", "ef-compressor", "lamb/lars"}
    assert Layout.from_config(Config()) == Layout(dp=2) and Job.from_config(Config()) == Job()
    assert features(Layout(), Job(source="hf:gpt2", plan="auto")) == {"hf", "auto", "adamw"}
    with pytest.raises(ConfigError, match="zero_stage = 0, 1 or 2, got 3"):
        check(Layout(dp=2, zero_stage=3, compression="onebit", comm_target="momentum"))
    check(Layout(pp=2, dp=2, tp=2, zero_stage=3, sequence_parallel=True, compression="topk"))


def test_planner_enumeration_reads_the_table():
    cpu = Cluster("t", gpus_per_node=8, peak_tflops=1.0, memory_gb=1.0, intra=Link(1e-6, 1e9),
                  inter=Link(1e-6, 1e9), cores=0)  # fmt: skip
    model = gpt_config("tiny")
    every = list(enumerate_layouts(model, 16, 4, cpu, dropout=0.1))
    assert every and all(refusal(as_layout(lay), Job(dropout=0.1)) is None for lay in every)
    assert not [lay for lay in every if lay.tp > 1 and lay.recompute]  # tp x dropout x recompute
    assert [lay for lay in every if lay.pp > 1 and lay.offload != "none"]  # pp x offload: supported
    assert [lay for lay in every if lay.offload == "cpu"] and [lay for lay in every if lay.tp > 1]


def test_plait_layouts_prints_the_table():
    """`plait layouts` is the same table as text and as JSON (one row per combination)."""
    import contextlib
    import io
    import json

    from plait.cli import main
    from plait.combinations import COMBINATIONS, describe_table

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["layouts"]) == 0
    assert out.getvalue().strip() == describe_table().strip()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["layouts", "--json"]) == 0
    rows = json.loads(out.getvalue())["rows"]
    assert [r["id"] for r in rows] == [r.id for r in COMBINATIONS]
    assert {r["id"] for r in rows} >= {"pp-offload", "api-pp", "api-ep", "pp-zero3-delayed"}


# --- run-time guards: a technique used directly raises the table's row, never its own text ---

GUARDED = {  # row: where a technique used directly refuses it (the rest are refused before start only)
    "bf16-zero0": "plait/zero/__init__.py",
    "offload-zero0": "plait/zero/__init__.py",
    "delayed-no-offload": "plait/zero/sharded.py",
    "compression-bf16": "plait/zero/engine.py",
    "ep-hybrid": "plait/zero/engine.py",
    "1-bit-adam-zero3": "plait/zero/shard.py",
    "zero3-compression-tp": "plait/zero/shard.py",
    "1-bit-adam-hybrid": "plait/optim/onebit_adam.py",
    "ep-dense": "plait/moe/parallel.py",
    "disk-lamb/lars": "plait/zero/offload_disk.py",
    "auto-source": "plait/parity/config_path.py",  # plait verify --top on an hf/python model
}
ELSEWHERE = {  # guards met by other tests (one process, or a command)
    "disk-lamb/lars": "tests/test_zero_offload_disk.py::test_bad_arguments",
    "auto-source": "tests/test_verify.py::test_bad_input_is_one_line_before_any_process",
}


def _refuse_calls() -> dict[str, list[str]]:
    """Each `refuse("<row>", ...)` call in plait, by row: the files that raise it."""
    calls: dict[str, list[str]] = {}
    for path in sorted((ROOT / "plait").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "refuse" and node.args:
                calls.setdefault(node.args[0].value, []).append(str(path.relative_to(ROOT)))
    return calls


def test_run_time_guards_name_rows_of_the_table():
    calls = _refuse_calls()
    assert {row: files[0] for row, files in calls.items()} == GUARDED
    assert all(len(files) == 1 for files in calls.values()), calls  # each refusal is written once
    refused = {r.id: r for r in REFUSED}
    assert set(GUARDED) <= set(refused)
    # no technique module words a refused row's reason itself
    for path in sorted((ROOT / "plait").rglob("*.py")):
        if "combinations" in path.parts:
            continue
        text = " ".join(path.read_text().split())
        for rule in REFUSED:
            assert rule.reason not in text, (rule.id, path)


def _guards():
    """Meet each guarded row with a technique called directly; (row, error type, message) each."""
    import torch

    from plait import zero
    from plait.comm.compress import FP16Compressor, OneBitCompressor
    from plait.mesh import Mesh
    from plait.moe.parallel import apply_ep
    from plait.optim.onebit_adam import MomentumHook, OneBitAdam
    from tests.conftest import tiny_gpt

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=1e-3)

    dp4, dp_tp = Mesh(dp=4, watchdog=False), Mesh(dp=2, tp=2, watchdog=False)
    hybrid, dp_ep = Mesh(dp=4, dp_shard=2, watchdog=False), Mesh(dp=2, ep=2, dp_shard=1, watchdog=False)
    hook = MomentumHook(OneBitCompressor(), 10)
    attempts = {
        "bf16-zero0": lambda: zero.wrap(tiny_gpt(), dp4, 0, adamw, mixed_precision="bf16"),
        "offload-zero0": lambda: zero.wrap(tiny_gpt(), dp4, 0, adamw, offload="cpu"),
        "delayed-no-offload": lambda: zero.wrap(tiny_gpt(), dp4, 2, adamw, delayed_update=True),
        "compression-bf16": lambda: zero.wrap(
            tiny_gpt(), dp4, 2, adamw, mixed_precision="bf16", comm_hook=FP16Compressor()
        ),
        "1-bit-adam-zero3": lambda: zero.wrap(tiny_gpt(), dp4, 3, adamw, comm_hook=hook),
        "zero3-compression-tp": lambda: zero.wrap(tiny_gpt(), dp_tp, 3, adamw, comm_hook=FP16Compressor()),
        "1-bit-adam-hybrid": lambda: zero.wrap(
            tiny_gpt(), hybrid, 2, lambda g: OneBitAdam(g, hook, hybrid), hybrid_shard=2, comm_hook=hook
        ),
        "ep-hybrid": lambda: zero.wrap(
            tiny_gpt(experts=4), dp_ep, 1, adamw, hybrid_shard=1, data_axes=("dp", "ep")
        ),
        "ep-dense": lambda: apply_ep(tiny_gpt(), dp_ep),
    }
    out = []
    for row, attempt in attempts.items():
        try:
            attempt()
            out.append((row, None, "no error"))
        except Exception as exc:  # noqa: BLE001 - the test reads which error and its text
            out.append((row, type(exc).__name__, str(exc)))
    return out


def test_techniques_used_directly_raise_the_rows_message():
    from plait.comm.spawn import run_ranks

    refused = {r.id: r for r in REFUSED}
    results = run_ranks(_guards, 4, timeout=180)
    for rank_result in results:
        assert sorted(row for row, _, _ in rank_result) == sorted(set(GUARDED) - set(ELSEWHERE))
        for row, kind, message in rank_result:
            rule = refused[row]
            assert kind == "ConfigError", (row, kind, message)
            assert rule.reason in message and rule.fix.split("{")[0] in message, (row, message)
            assert "\n" not in message and "{" not in message, (row, message)


def test_the_architecture_pages_layers_are_the_import_contracts():
    """docs/ARCHITECTURE.md's layer diagram is the `[tool.importlinter]` layers contract that
    `make test` checks, row for row: the picture cannot drift from the code's structure."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```\ntesting", 1)[1].split("```", 1)[0]
    drawn = ["testing"] + [line.split("  ", 1)[0].strip() for line in block.splitlines()[1:] if line.strip()]
    assert drawn == [layer.replace("(", "").replace(")", "") for layer in layers], drawn
