"""The table of combinations: the refused rows in check order, then the supported ones."""

from __future__ import annotations

from plait.combinations.rule import LAYOUT_TEST, SWITCHES, Rule

# What each kind of model.source cannot take: (feature, key, the value the source takes). The
# source's rows of the table are made from this record; plait.models.source builds the models.
SOURCE_LIMITS = {
    "hf": {
        "what": "{key} = {value!r} does not apply to model.source = {source!r}",
        "reason": "hf models are dense, trained without dropout, outside the parameter server",
        "fix": "set {key} = {default!r}",
        "limits": (
            ("moe", "model.experts", 0),
            ("dropout", "model.dropout", 0.0),
            ("ep", "parallel.ep", 1),
            ("ps", "ps.servers", 0),
        ),
    },
    "python": {
        "what": "model.source = {source!r} with {key} = {value!r} is not available",
        "reason": "it is a feature of plait's own GPT, which a factory's model is not",
        "fix": "set {key} = {default!r}, or model.source = 'plait'",
        "limits": (("moe", "model.experts", 0), ("ep", "parallel.ep", 1), ("ps", "ps.servers", 0)),
    },
}


def _no(id_, all_, what, reason, fix, keys, example, **kw) -> Rule:
    kw.setdefault("test", f"{LAYOUT_TEST}[{id_}]")
    return Rule(id_, frozenset(all_), False, reason, keys, what=what, fix=fix, example=example, **kw)


def _yes(id_, all_, reason, keys, python, test, any_=()) -> Rule:
    return Rule(id_, frozenset(all_), True, reason, keys, test, python=python, any=frozenset(any_))


def _source_rows() -> list[Rule]:
    """What an hf: or python: source cannot take, from plait.models' own record of it."""
    rows = []
    for kind, spec in SOURCE_LIMITS.items():
        source = "hf:llama" if kind == "hf" else "python:mymodels:make_net"
        for feature, key, default in spec["limits"]:
            _, name, _, on = SWITCHES[feature]
            fill = {"{key}": key, "{default!r}": repr(default), "{value!r}": "{" + name + "!r}"}
            what, fix = spec["what"], spec["fix"]
            for old, new in fill.items():
                what, fix = what.replace(old, new), fix.replace(old, new)
            example, keys = (("model.source", source), (key, on)), ("model.source", key)
            rows.append(_no(f"{kind}-{feature}", {kind, feature}, what, spec["reason"], fix, keys, example))
    return rows


def _ps_rows() -> list[Rule]:
    """The parameter server stands apart from the mesh: it takes none of its techniques."""
    rows = []
    for feature in ("tp", "pp", "ep", "cp", "zero", "hybrid", "compression", "offload", "moe", "tokenizer"):
        key, name, off, on = SWITCHES[feature]
        what = f"ps.servers = {{servers}} with {key} = {{{name}!r}} is not available"
        why = "parameter-server workers each hold the whole model and push whole gradients"
        example = (("ps.servers", "1"), (key, on)) + ((("model.experts", "4"),) if feature == "ep" else ())
        fix = f"set {key} = {off!r}, or ps.servers = 0"
        rows.append(_no(f"ps-{feature}", {"ps", feature}, what, why, fix, ("ps.servers", key), example))
    return rows


def _cp_rows() -> list[Rule]:
    """What context parallelism (a sequence split over cp) does not take, and why."""
    cp = ("parallel.cp", "2")
    return [
        _no("cp-moe", {"cp", "moe"},
            "parallel.cp = {cp} with model.experts = {experts} is not available",
            "a mixture-of-experts layer's capacity and load-balancing loss are computed over the "
            "tokens a rank holds, which under cp are part of each sequence: not one process's function",
            "set parallel.cp = 1, or model.experts = 0", ("parallel.cp", "model.experts"),
            (cp, ("model.experts", "4"))),
        _no("cp-ring-dropout", {"cp-ring", "dropout"},
            "parallel.cp_style = 'ring' with model.dropout = {dropout!r} is not available",
            "ring attention merges blocks of exact probabilities and has no attention dropout",
            "set model.dropout = 0, or parallel.cp_style = 'ulysses' (whole-sequence attention per "
            "head, with its dropout)", ("parallel.cp_style", "model.dropout"),
            (cp, ("model.dropout", "0.1"))),
        _no("cp-hybrid", {"cp", "hybrid"},
            "parallel.cp = {cp} with parallel.hybrid_shard = {hybrid_shard} is not available",
            "hybrid sharding's shard and replicate groups are built over dp alone, while under cp the "
            "gradients are reduced over dp x cp", "set parallel.hybrid_shard = 0 (ZeRO then shards "
            "over dp x cp), or parallel.cp = 1", ("parallel.cp", "parallel.hybrid_shard"),
            (cp, ("parallel.zero_stage", "1"), ("parallel.hybrid_shard", "2"))),
        _no("cp-controller", {"cp", "controller"},
            "parallel.cp = {cp} with runtime.kind = 'controller' is not available",
            "the single controller's actors and peer recovery know the model coordinates pp, ep and tp, "
            "not cp", "use runtime.kind = 'spmd', or parallel.cp = 1", ("parallel.cp", "runtime.kind"),
            (cp, ("runtime.kind", "controller"))),
        _no("cp-diloco", {"cp", "diloco"},
            "parallel.cp = {cp} with diloco.inner_steps = {inner_steps} is not available",
            "DiLoCo's replica groups are cut from dp by its launcher, which does not lay out a cp axis "
            "inside a group yet", "set diloco.inner_steps = 0, or parallel.cp = 1",
            ("parallel.cp", "diloco.inner_steps"), (cp, ("diloco.inner_steps", "4"))),
    ]  # fmt: skip


MOE = (("model.experts", "4"), ("parallel.ep", "2"))
ADAM1 = (("comm.target", "momentum"), ("comm.compression", "onebit"))
ADAM1_ = "comm.target = 'momentum' (1-bit Adam)"
NO_ZERO, NO_OFFLOAD = frozenset({"zero"}), frozenset({"offload"})
REFUSED = [
    *_source_rows(),
    _no("auto-source", {"auto"},
        "parallel.plan = 'auto' plans plait's own GPT, not model.source = {source!r}",
        "the cost model's FLOPs and memory are its formulas",
        "set the layout by hand (parallel.dp, tp, pp, zero_stage) or use plait plan on an equivalent GPT",
        ("parallel.plan", "model.source"), (("parallel.plan", "auto"), ("model.source", "hf:llama")),
        any=frozenset({"hf", "python"})),
    *_ps_rows(),
    _no("ps-controller", {"ps", "controller"},
        "ps.servers = {servers} with runtime.kind = 'controller' is not available",
        "the parameter server is a runtime of its own", "use runtime.kind = 'spmd', or ps.servers = 0",
        ("ps.servers", "runtime.kind"), (("ps.servers", "1"), ("runtime.kind", "controller"))),
    _no("diloco-ps", {"diloco", "ps"},
        "diloco.inner_steps = {inner_steps} with ps.servers = {servers} is not available",
        "a parameter-server worker is not a replica group: the servers hold the only parameters",
        "set diloco.inner_steps = 0, or ps.servers = 0",
        ("diloco.inner_steps", "ps.servers"), (("diloco.inner_steps", "4"), ("ps.servers", "1"))),
    _no("diloco-controller", {"diloco", "controller"},
        "diloco.inner_steps = {inner_steps} with runtime.kind = 'controller' is not available",
        "DiLoCo's replica groups are worlds of their own, started by its launcher",
        "use runtime.kind = 'spmd', or diloco.inner_steps = 0",
        ("diloco.inner_steps", "runtime.kind"),
        (("diloco.inner_steps", "4"), ("runtime.kind", "controller"))),
    _no("diloco-ft-ef", {"diloco-ef", "diloco-ft"},
        "diloco.compression = {outer_compression!r} with diloco.fault_tolerant = true is not available",
        "an error-feedback compressor's residual is each group's own state: a group that heals from "
        "a live one has no residual of its own, and the quorum's exchange is an all-reduce of its "
        "own, not the compressor's gather",
        "use diloco.compression = 'fp16' or 'bf16' (or 'none'), or diloco.fault_tolerant = false",
        ("diloco.compression", "diloco.fault_tolerant"),
        (("diloco.inner_steps", "4"), ("diloco.compression", "topk"), ("diloco.fault_tolerant", "true"))),
    _no("diloco-ft-overlap", {"diloco-ft", "diloco-overlap"},
        "diloco.fault_tolerant = true with diloco.overlap_steps = {overlap_steps} is not available",
        "the quorum of live groups is formed at each exchange, which must then complete before "
        "the next inner step",
        "set diloco.overlap_steps = 0, or diloco.fault_tolerant = false",
        ("diloco.fault_tolerant", "diloco.overlap_steps"),
        (("diloco.inner_steps", "4"), ("diloco.fault_tolerant", "true"), ("diloco.overlap_steps", "1"))),
    _no("eval-island-spmd", {"eval-island"}, "runtime.eval_island = true needs runtime.kind = 'controller'",
        "the island is a process mesh that the single controller drives",
        "set runtime.kind = 'controller', or runtime.eval_island = false",
        ("runtime.eval_island", "runtime.kind"), (("runtime.eval_island", "true"),),
        none=frozenset({"controller"})),
    _no("ep-dense", {"ep"}, "parallel.ep = {ep} needs a mixture-of-experts model",
        "it splits the experts of mixture-of-experts layers, and the model is dense",
        "set model.experts (e.g. 4) or parallel.ep = 1", ("parallel.ep", "model.experts"),
        (("parallel.ep", "2"),), none=frozenset({"moe"}), then=": "),
    _no("ep-hybrid", {"ep", "hybrid"},
        "parallel.ep = {ep} with parallel.hybrid_shard = {hybrid_shard} is not available",
        "ZeRO shards experts over their replica group (dp) and dense parameters over dp x ep",
        "set parallel.hybrid_shard = 0", ("parallel.ep", "parallel.hybrid_shard"),
        MOE + (("parallel.zero_stage", "1"), ("parallel.hybrid_shard", "1"))),
    _no("ep-lamb/lars", {"ep", "lamb/lars"},
        "optim.name = {optimizer!r} with parallel.ep = {ep} is not available",
        "its per-layer trust ratio needs the norm of each whole expert tensor, which is split over ep",
        "use optim.name = 'adamw' or 'sgd'", ("optim.name", "parallel.ep"), MOE + (("optim.name", "lamb"),)),
    _no("ep-1-bit-adam", {"ep", "1-bit-adam", "compression"},
        "parallel.ep = {ep} with " + ADAM1_ + " is not available",
        "its momentum is exchanged over dp alone, and dense layers need dp x ep",
        "set comm.target = 'gradient' (compressed gradients work with ep)", ("parallel.ep", "comm.target"),
        MOE + ADAM1),
    _no("1-bit-adam-compressor", {"1-bit-adam"},
        ADAM1_ + " needs comm.compression = 'onebit', 'topk' or 'powersgd', got {compression!r}",
        "it compresses the momentum with an error-feedback compressor",
        "set comm.compression, or comm.target = 'gradient'", ("comm.target", "comm.compression"),
        (("comm.target", "momentum"),), none=frozenset({"ef-compressor"})),
    _no("1-bit-adam-optimizer", {"1-bit-adam", "lamb/lars"},
        ADAM1_ + " with optim.name = {optimizer!r} is not available",
        "it compresses the momentum of AdamW or SGD",
        "set optim.name = 'adamw' or 'sgd', or comm.target = 'gradient'",
        ("comm.target", "optim.name"), ADAM1 + (("optim.name", "lamb"),)),
    _no("hybrid-zero0", {"hybrid"}, "parallel.hybrid_shard = {hybrid_shard} needs parallel.zero_stage >= 1",
        "there is nothing to shard at stage 0", "set parallel.zero_stage, or parallel.hybrid_shard = 0",
        ("parallel.hybrid_shard", "parallel.zero_stage"), (("parallel.hybrid_shard", "2"),), none=NO_ZERO),
    _no("offload-zero0", {"offload"},
        "offload.optimizer = {offload!r} needs parallel.zero_stage >= 1",
        "offload moves the shards of the optimizer state",
        "set parallel.zero_stage, or offload.optimizer = 'none'",
        ("offload.optimizer", "parallel.zero_stage"),
        (("offload.optimizer", "cpu"),), none=NO_ZERO),
    _no("delayed-no-offload", {"delayed"}, "offload.delayed_update needs offload.optimizer = 'cpu' or 'disk'",
        "the delayed update is the offloaded step overlapping the next iteration",
        "set offload.optimizer, or offload.delayed_update = false",
        ("offload.delayed_update", "offload.optimizer"),
        (("offload.delayed_update", "true"), ("parallel.zero_stage", "2")), none=NO_OFFLOAD),
    _no("delayed-lamb/lars", {"delayed", "lamb/lars", "dp", "zero"},
        "offload.delayed_update with optim.name = {optimizer!r} is not available",
        "the per-layer norms of LAMB/LARS need a collective inside the step, which runs in a "
        "background thread", "use adamw or sgd", ("offload.delayed_update", "optim.name"),
        (("offload.delayed_update", "true"), ("offload.optimizer", "cpu"), ("parallel.zero_stage", "1"),
         ("optim.name", "lars"))),
    _no("disk-lamb/lars", {"offload-disk", "lamb/lars", "dp"},
        "offload.optimizer = 'disk' with optim.name = {optimizer!r} is not available",
        "the norms of LAMB/LARS need all of a layer at once, and disk offload steps the shards in chunks",
        "use cpu offload or adamw/sgd", ("offload.optimizer", "optim.name"),
        (("offload.optimizer", "disk"), ("parallel.zero_stage", "1"), ("optim.name", "lamb"))),
    _no("1-bit-adam-zero3", {"1-bit-adam", "zero3"},
        ADAM1_ + " runs with parallel.zero_stage = 0, 1 or 2, got 3",
        "its ZeRO path forms each rank's momentum over ZeRO-1/2's buckets of whole parameters, and is "
        "not built over ZeRO-3's units (gradient compression itself works under ZeRO-3)",
        "use zero_stage = 2", ("comm.target", "parallel.zero_stage"),
        ADAM1 + (("parallel.zero_stage", "3"),)),
    _no("1-bit-adam-hybrid", {"1-bit-adam", "hybrid"},
        ADAM1_ + " with parallel.hybrid_shard = {hybrid_shard} is not available",
        "the momentum is exchanged over the whole dp axis, which hybrid sharding splits into shard and "
        "replica groups", "set parallel.hybrid_shard = 0", ("comm.target", "parallel.hybrid_shard"),
        ADAM1 + (("parallel.zero_stage", "2"), ("parallel.dp", "4"), ("parallel.hybrid_shard", "2"))),
    _no("1-bit-adam-offload", {"1-bit-adam", "offload"},
        ADAM1_ + " with offload.optimizer = {offload!r} is not available",
        "the compressed momentum exchange runs inside the optimizer step on the compute device, which "
        "offload moves to the host (or, delayed, to a background thread)", "set offload.optimizer = 'none'",
        ("comm.target", "offload.optimizer"),
        ADAM1 + (("parallel.zero_stage", "1"), ("offload.optimizer", "cpu"))),
    _no("zero3-compression-tp", {"zero3", "compression", "tp"},
        "comm.compression = {compression!r} with parallel.zero_stage = 3 and parallel.tp = {tp} is not "
        "available", "a ZeRO-3 unit's gradient mixes tp-sharded, replicated and partial parameters, and a "
        "lossy compressor over it would let tp replicas drift apart",
        "use zero_stage = 1 or 2 (one placement per bucket) or comm.compression = 'none'",
        ("comm.compression", "parallel.zero_stage", "parallel.tp"),
        (("comm.compression", "fp16"), ("parallel.zero_stage", "3"), ("parallel.tp", "2")),
        none=frozenset({"pp"})),
    _no("compression-bf16", {"zero", "compression", "bf16"},
        "comm.compression = {compression!r} with parallel.zero_stage = {zero_stage} needs fp32 gradients",
        "ZeRO's bf16 mixed precision keeps the gradients in bf16",
        "set train.bf16 = false, or comm.compression = 'none'",
        ("comm.compression", "parallel.zero_stage", "train.bf16"),
        (("comm.compression", "onebit"), ("parallel.zero_stage", "2"), ("train.bf16", "true"))),
    _no("sp-no-tp", {"sp"}, "parallel.sequence_parallel needs parallel.tp > 1",
        "it splits the neighbours of tensor-parallel regions along the sequence",
        "set parallel.tp, or parallel.sequence_parallel = false",
        ("parallel.sequence_parallel", "parallel.tp"), (("parallel.sequence_parallel", "true"),),
        none=frozenset({"tp"})),
    _no("tp-lamb/lars", {"tp", "lamb/lars"},
        "optim.name = {optimizer!r} with parallel.tp = {tp} is not available",
        "its per-layer trust ratio needs the norm of each whole layer, and tensor-parallel layers are "
        "split over tp", "use optim.name = 'adamw' or 'sgd' with tp", ("optim.name", "parallel.tp"),
        (("parallel.tp", "2"), ("parallel.dp", "1"), ("optim.name", "lamb"))),
    _no("tp-dropout-recompute", {"tp", "dropout", "recompute"},
        "tensor parallelism (parallel.tp = {tp}) with model.dropout = {dropout} and "
        "train.activation_checkpointing is not available",
        "recomputation would replay per-rank dropout masks from the wrong stream", "drop one of the two",
        ("parallel.tp", "model.dropout", "train.activation_checkpointing"),
        (("parallel.tp", "2"), ("model.dropout", "0.1"), ("train.activation_checkpointing", "true"))),
    _no("1-bit-adam-tp-pp", {"1-bit-adam"},
        ADAM1_ + " with parallel.tp > 1 or parallel.pp > 1 is not available",
        "its momentum exchange is built over dp alone (data parallel and ZeRO-1/2), not over "
        "tensor-parallel placements or a pipeline's stages", "use comm.target = 'gradient'",
        ("comm.target", "parallel.tp", "parallel.pp"), ADAM1 + (("parallel.pp", "2"),),
        any=frozenset({"tp", "pp"})),
    _no("pp-grad-accum", {"pp", "grad-accum"},
        "train.micro_batches = {micro_batches} with parallel.pp = {pp} is not available",
        "the pipeline splits each step's batch itself",
        "set train.micro_batches = 1 and parallel.microbatches instead",
        ("train.micro_batches", "parallel.pp"),
        (("parallel.pp", "2"), ("train.micro_batches", "2"))),
    _no("pp-zero3-delayed", {"pp", "zero3", "delayed"},
        "parallel.pp = {pp} with parallel.zero_stage = 3 and offload.delayed_update is not available",
        "ZeRO-3 within pipeline stages frees the parameters after each step and gathers them at the next "
        "one's start, while the delayed update would still be writing them in the background",
        "use parallel.zero_stage = 2 with the delayed update, or offload.delayed_update = false",
        ("parallel.pp", "parallel.zero_stage", "offload.delayed_update"),
        (("parallel.pp", "2"), ("parallel.zero_stage", "3"), ("offload.optimizer", "cpu"),
         ("offload.delayed_update", "true"))),
    *_cp_rows(),
    _no("bf16-zero0", {"bf16"}, "mixed_precision = 'bf16' needs zero_stage >= 1",
        "stage 0 (plain data parallelism) keeps no fp32 master copy to step",
        "use zero_stage >= 1 or mixed_precision = None", ("mixed_precision", "zero_stage"),
        (("mixed_precision", "bf16"),), none=NO_ZERO, api=True),
]  # fmt: skip

COMPOSE = "tests/test_compose.py::test_composition_follows_one_process"
SUPPORTED = [
    _yes("dp-tp", {"dp", "tp"}, "dp x tp, +/- sequence parallelism (SP)",
         ("parallel.dp", "parallel.tp", "parallel.sequence_parallel"),
         "`Layout(dp=, tp=, sequence_parallel=)`",
         "tests/test_tensor_parallel_gpt.py::test_gpt_parity_with_one_process"),
    _yes("zero-tp", {"zero", "tp"}, "ZeRO-1/2/3 over dp x tp (ZeRO-3: 2-D FSDP + TP), +/- SP",
         ("parallel.zero_stage", "parallel.tp"), "`Layout(dp=, tp=, zero_stage=)`", COMPOSE),
    _yes("hybrid-tp", {"hybrid", "zero", "tp"}, "hybrid sharding x tp (8 ranks)",
         ("parallel.hybrid_shard", "parallel.tp"),
         "`Layout(dp=, tp=, dp_shard=, zero_stage=)`", COMPOSE),
    _yes("pp-dp", {"pp", "dp"}, "pp x dp, data parallel within the stages, every schedule",
         ("parallel.pp", "parallel.dp", "parallel.schedule"), "`Layout(pp=, dp=, schedule=)`",
         "tests/test_pipeline_parity.py::test_every_schedule_matches_one_process"),
    _yes("pp-zero", {"pp", "zero"}, "pp x dp, ZeRO-1, 2 or 3 within the stages",
         ("parallel.pp", "parallel.zero_stage"), "`Layout(pp=, dp=, zero_stage=1)`", COMPOSE),
    _yes("pp-tp", {"pp", "tp"}, "pp x tp, +/- SP",
         ("parallel.pp", "parallel.tp", "parallel.sequence_parallel"), "`Layout(pp=, tp=, ...)`",
         "tests/test_pipeline_parity.py::test_pipeline_with_data_and_tensor_parallel"),
    _yes("pp-dp-tp", {"pp", "dp", "tp", "zero", "sp"}, "pp x dp x tp with ZeRO-1 or 3 and SP (8 ranks)",
         ("parallel.pp", "parallel.dp", "parallel.tp", "parallel.zero_stage", "parallel.sequence_parallel"),
         "the same", COMPOSE),
    _yes("compression-tp-pp", {"compression"},
         "gradient compression with tp, with pp: lossless top-k equals one process, 1-bit keeps "
         "replicas equal",
         ("comm.compression",), "`comm_hook=`",
         "tests/test_compose.py::test_lossy_compression_keeps_replicas_equal", any_={"tp", "pp"}),
    _yes("compression-zero", {"compression", "zero"},
         "gradient compression with ZeRO-1/2, with hybrid sharding: equal to data parallelism's",
         ("comm.compression", "parallel.zero_stage"), "`comm_hook=`", "tests/test_comm_compress.py"),
    _yes("1-bit-adam-zero", {"1-bit-adam", "ef-compressor", "adamw", "zero"}, "1-bit Adam with ZeRO-1/2",
         ("comm.target", "comm.compression", "parallel.zero_stage"),
         "`OneBitAdam`, its `MomentumHook` as `comm_hook=`",
         "tests/test_optim_onebit_adam.py::test_onebit_adam_under_zero_matches_the_papers_rule"),
    _yes("moe", {"moe", "ep"},
         "mixture of experts over ep with dp, tp (+ SP), ZeRO-1/2/3 and pp ([moe.md](moe.md))",
         ("model.experts", "parallel.ep"), "`Layout(dp=, ep=, ...)`",
         "tests/test_moe_train.py::test_every_layout_follows_one_process"),
    _yes("compression-ep", {"compression", "moe", "ep"}, "gradient compression with ep (stages 0, 2, 3)",
         ("comm.compression", "parallel.ep"), "`comm_hook=`",
         "tests/test_comm_compress.py::test_compressors_under_expert_parallelism_keep_replicas_identical"),
]  # fmt: skip
CUSTOM_LOOP = "tests/test_custom_loop_pp_ep.py::test_pipeline_and_experts_follow_one_process"
SUPPORTED += [
    _yes("pp-offload", {"pp", "zero", "offload"}, "ZeRO-1/2/3 with CPU or disk offload in pipeline stages",
         ("parallel.pp", "parallel.zero_stage", "offload.optimizer"),
         '`Layout(pp=, dp=, zero_stage=, offload="cpu")`', CUSTOM_LOOP),
    _yes("api-pp", {"api", "pp"}, "pipelines in a custom loop, with ZeRO and offload", ("pp", "zero_stage"),
         '`plait.parallelize(model, factory, {"pp": 2})`', CUSTOM_LOOP),
    _yes("api-ep", {"api", "ep", "moe"}, "expert parallelism in a custom loop, with ZeRO and pp",
         ("ep", "zero_stage"), '`plait.parallelize(model, factory, {"ep": 2})`', CUSTOM_LOOP),
    _yes("diloco-layouts", {"diloco"},
         "DiLoCo / Streaming DiLoCo with any layout inside a replica group (ZeRO, tp, pp)",
         ("diloco.inner_steps", "diloco.replicas"), "`plait train` only ([diloco.md](diloco.md))",
         "tests/test_diloco.py::test_groups_with_layouts_inside_follow_the_reference",
         any_={"zero", "tp", "pp"}),
]  # fmt: skip
SUPPORTED += [
    _yes("cp-layouts", {"cp"},
         "context parallelism, ring or Ulysses, with dp, ZeRO-1/2/3, tp + SP, pp, activation "
         "checkpointing and gradient accumulation ([context-parallel.md](context-parallel.md))",
         ("parallel.cp", "parallel.cp_style"), '`Layout(cp=2, cp_style="ulysses")`',
         "tests/test_context_parallel_train.py::test_context_parallel_training_follows_one_process",
         any_={"dp", "zero", "tp", "pp", "recompute", "grad-accum"}),
    _yes("cp-api", {"cp", "api"},
         "context parallelism in a custom loop: whole sequences in, each cp rank keeps its tokens, the "
         "user's attention opts in through plait.context_parallel.attention; with dp, ZeRO, tp + SP, pp",
         ("cp", "cp_style"), '`plait.parallelize(model, factory, {"cp": 2})`',
         "tests/test_context_parallel_train.py::test_a_custom_loop_under_cp_follows_one_process"),
]  # fmt: skip
COMBINATIONS: tuple[Rule, ...] = (*REFUSED, *SUPPORTED)  # the refused rows in check order, then the supported
assert len({r.id for r in COMBINATIONS}) == len(COMBINATIONS), "row ids name one row each"
