"""The probes of benchmarks/faults_probes.py for the faults docs/fault-tolerance.md promised before
issue 29 (a rank raising, hanging or killed, a corrupted replica, damaged checkpoints, a second
owner of a run, bad input), tagged `docs`."""

from __future__ import annotations

from faults_spec import COPY, FAULT, LONG, SAME, SHOW, SLOW, Probe

# rank 1's background write of step 4 starts this many seconds late (append them), after it wrote
# ./writing-4-1 (plait.testing.slow_checkpoint_write)
ASYNC_WRITE = (
    "PLAIT_CHECKPOINT_HOOK=plait.testing:slow_checkpoint_write PLAIT_SLOW_WRITE_FLAG=$PWD"
    " PLAIT_SLOW_WRITE=1:4:"
)

DOCS_PROBES = [
    Probe(
        "rank-raises",
        ("docs",),
        "rank 1 raises at step 3",
        f"{FAULT}1:3 plait train $TINY --train.run_dir run",
        rc=(1,),
        line=r"injected fault on rank 1 at step 3",
        traceback=True,
        expect="the rank's traceback, and the job down",
    ),
    Probe(
        "rank-hangs",
        ("docs",),
        "rank 1 hangs at step 3 (`comm.timeout_s` 5)",
        f"{FAULT}1:3:hang plait train $TINY --comm.timeout_s 5 --train.run_dir run",
        rc=(1, 3),
        line=r"^plait: rank \d failed .*watchdog",
    ),
    Probe(
        "rank-killed-restarts",
        ("docs",),
        "rank 1 killed (SIGKILL) at step 6 with `train.max_restarts` 1",
        f"{FAULT}1:6:kill plait train $TINY --train.max_restarts 1 --train.run_dir run",
        line=r"restart 1 of train\.max_restarts = 1 .*resuming from .*step_00000004",
        check=f"{SHOW}; test $(last_step run) = 8",
        expect="the run ends at step 8",
    ),
    Probe(
        "replica-perturbed",
        ("docs",),
        "one value of rank 1's replica changed at step 3",
        f"{FAULT}1:3:perturb plait train $TINY --train.run_dir run",
        rc=(1,),
        line=r"ReplicaMismatchError: step 4: replicas over dp differ: .* rank\(s\) \[1\]",
    ),
    Probe(
        "latest-missing",
        ("docs",),
        "`checkpoints/latest` deleted, then `--resume`",
        "rm run/checkpoints/latest; plait train --resume run",
        setup=COPY,
        line=r"latest is missing; resuming from step_00000004",
        check="test $(last_step run) = 8 && echo 'trained to step 8'",
    ),
    Probe(
        "checkpoint-corrupted",
        ("docs",),
        "a byte of the checkpoint asked for changed, then `--resume` of it",
        "printf X | dd of=run/checkpoints/step_00000004/__0_0.distcp bs=1 seek=100 conv=notrunc 2>/dev/null;"
        " plait train --resume run/checkpoints/step_00000004",
        setup=COPY,
        rc=(1,),
        line=r"^plait: error: .*fails its SHA-256 check",
    ),
    Probe(
        "second-resume-refused",
        ("docs",),
        "a second `plait train --resume` of a run that is running",
        f"{SLOW} plait train {LONG} & wait_step run 2; plait train --resume run; r=$?; kill -INT $!;"
        " wait $!; exit $r",
        rc=(1,),
        line=r"^plait: error: run is in use by another plait train \(PID \d+",
    ),
    Probe(
        "run-dir-unwritable",
        ("docs",),
        "`train.run_dir` under /proc",
        "plait train $TINY --train.run_dir /proc/plait-run",
        rc=(2,),
        line=r"^plait: config error: train\.run_dir = '/proc/plait-run' is not writable",
    ),
    Probe(
        "steps-out-of-range",
        ("docs",),
        "`--train.steps 9999999999999999999999`",
        "plait train $TINY --train.steps 9999999999999999999999",
        rc=(2,),
        line=r"^plait: config error: train\.steps = 9999999999999999999999 is out of range",
    ),
    Probe(
        "nonfinite-stop",
        ("docs",),
        "learning rate 1e6 with `train.nonfinite = 'stop'`",
        "plait train $TINY --train.lr 1e6 --train.nonfinite stop --train.run_dir run",
        rc=(1,),
        line=r"DivergedError: training diverged at step \d+",
        check=f"{SHOW}; test $(latest_step run) -lt $(last_step run)",
        expect="no checkpoint of the non-finite step",
    ),
    # ---- asynchronous checkpoints (issue 41): a fault while rank 1's write of step 4 is slowed
    Probe(
        "async-write-sigkill",
        ("docs",),
        "`kill -9` of the launcher while a background checkpoint write is under way "
        "(`train.checkpoint_async`, rank 1 writes step 4 late)",
        f"{ASYNC_WRITE}60 plait train $TINY --train.checkpoint_async true --train.checkpoint_every 2"
        " --train.run_dir run & wait_file writing-4-1; kill -9 $!; wait $!",
        rc=(137,),
        check=f'{SHOW}; test "$(latest_step run)" = 2',
        expect="`latest` still names step 2: the unfinished checkpoint is never named",
    ),
    Probe(
        "async-write-group-sigterm",
        ("docs",),
        "SIGTERM to the process group while a background checkpoint write is under way (3 s late)",
        f"{ASYNC_WRITE}3 setsid plait train $TINY --train.checkpoint_async true --train.checkpoint_every 2"
        " --train.steps 60 --train.log_every 1 --train.run_dir run & wait_file writing-4-1;"
        " kill -TERM -- -$!; wait $!",
        rc=(143,),
        line=r"stopped by SIGTERM after step \d+; checkpoint saved",
        check=f"{SHOW}; {SAME}",
        expect="the write in flight finishes, and `latest` is the last step trained",
    ),
]
