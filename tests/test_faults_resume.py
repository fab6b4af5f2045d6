"""What `plait train --resume RUN_DIR --section.key value` does with each key (plait.train.resume):
a key the checkpoint fixes is refused in one line when its value changes; the lr schedule and the
optimizer's options are honoured from the step reached, and said; config.toml records only
values the run uses. A diverged run resumed with a lower train.lr, as DivergedError says to do,
trains to its end."""

import copy
import json

import pytest
from conftest import TINY, metrics, plait_train

from plait.cli import main
from plait.errors import ConfigError
from plait.train.loop import lr_factor
from plait.train.resume import FIXED, REAPPLIED, all_keys, check_resume_changes, resume_rule
from plait.train.sections import Config


def _changed(value):
    """Another value of the same type (1 for an unset optional key)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    return 1


def test_every_key_has_a_rule_on_resume_and_fixed_ones_are_refused_in_one_line(tmp_path):
    old = Config()
    old.train.run_dir = str(tmp_path)  # what config.toml records: the run's directory
    rules = {}
    for key in all_keys():
        section, _, name = key.partition(".")
        new = copy.deepcopy(old)
        setattr(getattr(new, section), name, _changed(getattr(getattr(old, section), name)))
        rules[key] = resume_rule(key)
        if rules[key] == FIXED:
            with pytest.raises(ConfigError) as info:
                check_resume_changes(old, new, [key], tmp_path)
            msg = str(info.value)
            assert key in msg and "cannot change on resume" in msg and "\n" not in msg, msg
        else:
            check_resume_changes(old, new, [key], tmp_path)  # honoured: the run uses the new value
        check_resume_changes(old, copy.deepcopy(old), [key], tmp_path)  # the run's own value passes
    # the keys whose values a checkpoint restores are reapplied from the configuration
    for key in ("train.lr", "train.min_lr", "train.warmup_steps", "train.steps", "train.weight_decay"):
        assert rules[key] == REAPPLIED, key
    for key in ("model.n_layer", "data.corpus", "train.seed", "train.global_batch", "optim.name"):
        assert rules[key] == FIXED, key
    # a parameter server restores its optimizer's options itself: those are refused there
    ps_old, ps_new = Config(), Config()
    ps_old.ps.servers = ps_new.ps.servers = 1
    ps_new.train.weight_decay = 0.0
    with pytest.raises(ConfigError, match="train.weight_decay"):
        check_resume_changes(ps_old, ps_new, ["train.weight_decay"], tmp_path)


DIVERGING = [
    *TINY,
    "--parallel.dp",
    "1",
    "--train.steps",
    "12",
    "--train.lr",
    "1000",
    "--train.warmup_steps",
    "100",
    "--train.grad_clip",
    "0",
    "--train.nonfinite",
    "stop",
    "--train.peak_tflops",
    "1",
]
NEW = {  # what the resume changes: the schedule and every optimizer option AdamW reads
    "train.lr": 1e-3,
    "train.min_lr": 1e-4,
    "train.warmup_steps": 2,
    "train.steps": 14,
    "train.weight_decay": 0.0,
    "train.beta1": 0.8,
    "train.beta2": 0.9,
}


def test_a_diverged_run_resumed_with_a_lower_lr_takes_the_new_schedule(tmp_path, capsys):
    run = tmp_path / "run"
    r = plait_train(*DIVERGING, "--train.run_dir", str(run))
    assert r.returncode == 1 and "training diverged at step" in r.stderr, r.stderr
    assert f"plait train --resume {run} --train.lr" in r.stderr, r.stderr  # the remedy it names
    reached = json.loads((run / "checkpoints" / "step_00000008" / "MANIFEST.json").read_text())["step"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000008"
    config = (run / "config.toml").read_text()

    # keys the checkpoint fixes: one line, nothing started, config.toml untouched
    for argv, key in (
        (["--train.seed", "1"], "train.seed"),
        (["--train.run_dir", str(tmp_path / "other")], "train.run_dir"),
        (["--optim.name", "sgd"], "optim.name"),
    ):
        assert main(["train", "--resume", str(run), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("plait: config error:") and key in err and "\n" not in err, err
        assert (run / "config.toml").read_text() == config
    record = tmp_path / "groups.json"
    args = [x for k, v in NEW.items() for x in (f"--{k}", str(v))]
    env = {"PLAIT_STEP_HOOK": "plait.testing:record_optimizer", "PLAIT_RECORD_TO": str(record)}
    r = plait_train("--resume", str(run), *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    # the new schedule from the step reached: each step's lr is the configured schedule's
    m = metrics(run)
    want = {
        s: NEW["train.lr"]
        * lr_factor(
            s - 1, NEW["train.warmup_steps"], NEW["train.steps"], NEW["train.min_lr"] / NEW["train.lr"]
        )
        for s in range(reached + 1, NEW["train.steps"] + 1)
    }
    got = {s: m[s]["lr"] for s in want}
    assert got == pytest.approx(want, rel=1e-9), (got, want)
    assert not any(m[s].get("skipped") for s in want), "the resumed run skipped steps"
    assert max(m) == NEW["train.steps"]
    old_lr = 1000 * lr_factor(reached, 100, 12, 3e-4 / 1000)
    assert f"plait: resume: lr {old_lr:.4g} -> {want[reached + 1]:.4g} from step {reached}" in r.stdout, (
        r.stdout
    )
    assert f"weight_decay 0.1 -> 0 from step {reached}" in r.stdout, r.stdout
    # what the optimizer used at the first resumed step is what config.toml records
    used = json.loads(record.read_text())
    assert used["step"] == reached + 1
    decay, no_decay = used["groups"]
    assert decay["weight_decay"] == no_decay["weight_decay"] == NEW["train.weight_decay"]
    assert decay["betas"] == no_decay["betas"] == [NEW["train.beta1"], NEW["train.beta2"]]
    assert decay["lr"] == pytest.approx(want[reached + 1], rel=1e-9)
    recorded = (run / "config.toml").read_text()
    for key, value in NEW.items():
        assert f"\n{key.split('.')[1]} = {json.dumps(value)}\n" in recorded, (key, recorded)
    assert not (run / ".plait-diverged").exists()  # resumed on purpose: a restart may train it again
