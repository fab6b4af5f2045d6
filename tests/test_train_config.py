"""Configuration: strict loading, overrides, and one clear line for each bad config."""

import pytest

from plait.cli import main
from plait.errors import ConfigError
from plait.train.config import Config, config_from_dict, load_config, parse_overrides


def _toml(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_file_and_overrides(tmp_path):
    path = _toml(tmp_path, "[train]\nsteps = 7\nlr = 1\n[parallel]\ndp = 4\n")
    cfg = load_config(
        path, parse_overrides(["--train.steps", "9", "--model.dropout=0.1", "--train.bf16", "true"])
    )
    assert cfg.train.steps == 9 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert (
        cfg.parallel.dp == 4 and cfg.world_size == 4 and cfg.model.dropout == 0.1 and cfg.train.bf16 is True
    )
    assert config_from_dict(cfg.to_dict()) == cfg
    assert load_config(_toml(tmp_path, cfg.to_toml(), "round.toml")) == cfg
    assert Config().train.steps == 300


def test_default_config_file_is_valid():
    cfg = load_config("configs/default.toml")
    assert cfg.world_size == 2 and cfg.parallel.dp == 2


@pytest.mark.parametrize("stage", ["0", "1", "2"])
def test_onebit_adam_is_accepted_with_zero_stages_0_to_2(stage):
    """1-bit Adam (comm.target = 'momentum') composes with ZeRO-1/2 (tests/test_optim_onebit_adam.py)."""
    args = ["--comm.target", "momentum", "--comm.compression", "onebit", "--parallel.zero_stage", stage]
    cfg = load_config(None, parse_overrides(args))
    assert cfg.comm.target == "momentum" and cfg.parallel.zero_stage == int(stage)


BAD = [
    # (file text or None, CLI args, words the one-line message must contain)
    ("[train]\nstep = 5\n", [], ["train.step", "did you mean 'train.steps'"]),
    ("[trian]\nsteps = 5\n", [], ["[trian]", "did you mean 'train'"]),
    ('[train]\nsteps = "ten"\n', [], ["train.steps", "expected int"]),
    (None, ["--train.steps", "abc"], ["train.steps", "expected int"]),
    ("[train]\nsteps = 1.5\n", [], ["train.steps", "expected int"]),
    ("[train]\nsteps = -3\n", [], ["train.steps must be >= 1"]),
    (None, ["--train.global_batch", "15"], ["global_batch = 15", "parallel.dp = 2", "multiple of 2"]),
    (
        None,
        ["--train.global_batch", "16", "--train.micro_batches", "3"],
        ["micro_batches = 3", "multiple of 6"],
    ),
    (None, ["--model.n_head", "3"], ["d_model = 128", "n_head = 3"]),
    (None, ["--parallel.ep", "2"], ["parallel.ep", "the model is dense", "model.experts"]),
    (None, ["--parallel.pp", "2", "--parallel.schedule", "zb"], ["parallel.schedule", "valid: gpipe, 1f1b"]),
    (
        None,
        ["--parallel.tp", "2", "--parallel.dp", "1", "--optim.name", "lamb"],
        ["optim.name = 'lamb' with parallel.tp = 2", "trust ratio"],
    ),
    (None, ["--parallel.sequence_parallel", "true"], ["sequence_parallel needs parallel.tp > 1"]),
    (
        None,
        ["--parallel.tp", "2", "--parallel.dp", "1", "--comm.target", "momentum"]
        + ["--comm.compression", "onebit"],
        ["comm.target = 'momentum' (1-bit Adam) with parallel.tp > 1"],
    ),
    (None, ["--parallel.dp", "0"], ["parallel.dp must be >= 1"]),
    (None, ["--model.name", "gpt5"], ["gpt5", "tiny"]),
    (None, ["--train.lr", "-1"], ["train.lr"]),
    (None, ["--model.dropout", "1.5"], ["model.dropout"]),
    (None, ["--data.held_out_fraction", "0.9"], ["data.held_out_fraction"]),
    (None, ["--train.device", "tpu"], ["train.device", "auto, cpu or cuda"]),
    ("[train\nsteps = 5\n", [], ["not valid TOML"]),
    ("steps = 5\n", [], ["top-level key 'steps'"]),
    (None, ["--train.steps"], ["--train.steps needs a value"]),
    (None, ["--train.steps", "5", "extra"], ["unexpected argument 'extra'"]),
    (None, ["--comm.compression", "twobit"], ["comm.compression", "none, fp16, onebit, topk, powersgd"]),
    (None, ["--comm.powersgd_rank", "0"], ["comm.powersgd_rank must be >= 1"]),
    (None, ["--comm.topk_ratio", "0"], ["comm.topk_ratio must be in (0, 1]"]),
    (None, ["--comm.topk_ratio", "1.5"], ["comm.topk_ratio must be in (0, 1]"]),
    (None, ["--optim.name", "adam"], ["optim.name", "adamw, lamb, lars, sgd"]),
    (None, ["--comm.target", "weights"], ["comm.target", "gradient, momentum"]),
    (
        None,
        ["--comm.target", "momentum", "--comm.compression", "onebit", "--comm.freeze_step", "600"],
        ["comm.freeze_step = 600 >= train.steps = 300", "never compress"],
    ),
    (
        None,
        [
            "--comm.compression",
            "fp16",
            "--parallel.zero_stage",
            "3",
            "--parallel.tp",
            "2",
            "--model.n_head",
            "4",
        ],
        ["zero_stage = 3 and parallel.tp = 2", "tp replicas drift apart"],
    ),
    (
        None,
        ["--comm.compression", "onebit", "--parallel.zero_stage", "2", "--train.bf16", "true"],
        ["needs fp32", "train.bf16 = false"],
    ),
    (
        None,
        ["--comm.compression", "onebit", "--comm.target", "momentum", "--parallel.zero_stage", "3"],
        ["comm.target = 'momentum' (1-bit Adam)", "zero_stage = 0, 1 or 2, got 3", "zero_stage = 2"],
    ),
    (
        None,
        ["--comm.compression", "onebit", "--comm.target", "momentum", "--parallel.zero_stage", "2"]
        + ["--parallel.dp", "4", "--parallel.hybrid_shard", "2", "--train.global_batch", "8"],
        ["1-bit Adam", "parallel.hybrid_shard", "parallel.hybrid_shard = 0"],
    ),
    (
        None,
        ["--comm.compression", "topk", "--comm.target", "momentum", "--parallel.zero_stage", "1"]
        + ["--offload.optimizer", "cpu"],
        ["1-bit Adam", "offload.optimizer = 'cpu'", "offload.optimizer = 'none'"],
    ),
    (
        None,
        ["--parallel.pp", "2", "--parallel.dp", "1", "--comm.target", "momentum"]
        + ["--comm.compression", "onebit"],
        ["comm.target = 'momentum' (1-bit Adam) with parallel.tp > 1 or parallel.pp > 1", "pipeline"],
    ),
    (
        None,
        ["--comm.target", "momentum"],
        ["comm.target = 'momentum'", "'onebit', 'topk' or 'powersgd'", "'none'"],
    ),
    (
        None,
        ["--comm.target", "momentum", "--comm.compression", "onebit", "--optim.name", "lamb"],
        ["optim.name = 'adamw' or 'sgd'", "'lamb'"],
    ),
    (
        None,
        ["--comm.target", "momentum", "--comm.compression", "topk", "--comm.freeze_step", "0"],
        ["comm.freeze_step must be >= 1", "got 0"],
    ),
    (None, ["--parallel.bucket_mb", "inf"], ["parallel.bucket_mb", "expected float"]),
    ("[comm]\ntimeout_s = inf\n", [], ["comm.timeout_s", "finite"]),
    (None, ["--data.corpus", "file:/nonexistent/x.txt"], ["/nonexistent/x.txt"]),
    (
        None,
        ["--model.name", "tiny", "--train.global_batch", "1024"],
        ["held-out", "train.global_batch = 1024"],
    ),
    (None, ["--diloco.replicas", "3"], ["diloco.replicas = 3 does not divide parallel.dp = 2"]),
    (None, ["--diloco.outer_optimizer", "adam"], ["diloco.outer_optimizer = 'adam'", "nesterov, sgd"]),
    (
        None,
        ["--diloco.inner_steps", "4", "--diloco.overlap_steps", "4"],
        ["diloco.overlap_steps = 4 must be below diloco.inner_steps = 4"],
    ),
    (
        None,
        ["--diloco.inner_steps", "8", "--train.max_restarts", "2"],
        ["train.max_restarts = 2 does not apply to DiLoCo", "diloco.fault_tolerant"],
    ),
    # a fault-tolerant outer exchange takes no error-feedback compressor: refused before any group starts
    (
        None,
        ["--diloco.inner_steps", "8", "--diloco.compression", "topk", "--diloco.fault_tolerant", "true"],
        ["diloco.compression = 'topk' with diloco.fault_tolerant = true", "diloco.fault_tolerant = false"],
    ),
    (
        None,
        ["--diloco.inner_steps", "8", "--diloco.fault_tolerant", "true", "--diloco.overlap_steps", "2"],
        ["diloco.fault_tolerant = true with diloco.overlap_steps = 2", "diloco.overlap_steps = 0"],
    ),
]


@pytest.mark.parametrize("text,args,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_gives_one_clear_line(tmp_path, capsys, text, args, words):
    argv = ["train"] + ([_toml(tmp_path, text)] if text is not None else []) + args
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("plait: config error: ")
    for w in words:
        assert w in err, (w, err)


def test_missing_file_and_bad_resume(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no config.toml" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="did you mean 'parallel.bucket_mb'"):
        load_config(None, [("parallel.bucket", "2")])


def test_help_lists_every_key_with_its_doc(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in (
        "--train.steps",
        "--train.log_every",
        "--train.run_dir",
        "--train.seed",
        "--model.dropout",
        "--parallel.dp",
        "--parallel.tp",
        "--parallel.pp",
        "--parallel.ep",
    ):
        assert key in out, key
