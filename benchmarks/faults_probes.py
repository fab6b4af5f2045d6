"""The fault probes of benchmarks/faults.py, as data: each is a fault, the shell command an operator
runs to meet it, and what plait promises then.

A probe's `command` runs under bash in a directory of its own, after a prelude that defines:

* `plait` (the CLI of this checkout) and `python` on PATH; that directory first on PYTHONPATH (a
  user's model module or script sits there);
* `$TINY`: the few-second config of the test suite (`TINY` in tests/conftest.py: tiny model, 8
  steps, checkpoints at 4 and 8, dp 2 by default); `$PS`: $TINY as a 2-server bsp parameter-server
  run checkpointing every 2 clocks;
* `$BASE` / `$PSBASE`: a finished run of $TINY / $PS stopped at step 4 (trained once per session of
  the script; `setup` copies it to `run`);
* `wait_step RUN N`, `wait_file PATH`, `last_step RUN`, `latest_step RUN`, `unique_steps RUN`,
  `record RUN STEP KEY`, `listening` (benchmarks/faults_checks.py).

`SLOW` (benchmarks/faults_spec.py, with the other shell pieces) makes rank 0 sleep 0.25 s a
step, so a signal lands mid-run. The exit code checked is the command's (the last one in it).
Every probe also expects no process of the run left 10 s after the command ends (found by a
token in their environment), and no `Traceback` on stderr unless `traceback` is set (a failing
rank's own traceback is the promise there).
"""

from __future__ import annotations

from faults_probes_docs import DOCS_PROBES
from faults_spec import (  # noqa: F401  (ITEMS, Probe: faults.py and the test take them from here)
    COPY,
    CRAFT,
    EACH_ONCE,
    FACTORIES,
    FAULT,
    ITEMS,
    LONG,
    LR_USED,
    NO_MARKER,
    NO_TMP,
    POISON_PEAK,
    PSCOPY,
    QWEN,
    SAME,
    SHOW,
    SLEEPER,
    SLOW,
    SOCKETS,
    WARMUP_USED,
    Probe,
)

PROBES = [
    # ---- 1. a killed launcher: its ranks die with it, and the lock is held until they have
    Probe(
        "launcher-sigkill",
        ("1",),
        "`kill -9` of the launcher of a dp 2 run at step 3",
        f"{SLOW} plait train {LONG} & wait_step run 3; kill -9 $!; wait $!",
        rc=(137,),
        check=SHOW,
        expect="the ranks end with the launcher",
    ),
    Probe(
        "launcher-sigkill-resume",
        ("1",),
        "`kill -9` of the launcher, then at once `--resume` of its run",
        "PLAIT_STEP_HOOK=plait.testing:slow_hook PLAIT_PS_SLOW=0:1 plait train $TINY --train.steps 30"
        " --train.log_every 1 --train.checkpoint_every 2 --train.run_dir run & wait_step run 3; kill -9 $!;"
        " plait train --resume run",
        rc=(0, 1),
        line=r"in use by another plait train|resumed from .*step_",
        check=EACH_ONCE,
        expect="refused while a rank lives, or resumed once they are gone: no step written twice",
        timeout=180,
    ),
    # ---- 2. SIGTERM: to the process group (a scheduler) and to the launcher
    Probe(
        "group-sigterm",
        ("2",),
        "SIGTERM to the whole process group (Slurm, Kubernetes, systemd) at step 12, checkpoints every 5",
        f"{SLOW} setsid plait train {LONG} --train.checkpoint_every 5 & wait_step run 12;"
        " kill -TERM -- -$!; wait $!",
        rc=(143,),
        line=r"stopped by SIGTERM after step \d+; checkpoint saved",
        check=f"{SHOW}; {SAME}",
        expect="`latest` is the last step trained",
    ),
    Probe(
        "launcher-sigterm",
        ("2", "docs"),
        "SIGTERM to the launcher only at step 5",
        f"{SLOW} plait train {LONG} & wait_step run 5; kill -TERM $!; wait $!",
        rc=(143,),
        line=r"stopped by SIGTERM after step \d+; checkpoint saved",
        check=f"{SHOW}; {SAME}",
        expect="`latest` is the last step trained",
    ),
    Probe(
        "ctrl-c-group",
        ("docs",),
        "Ctrl-C (SIGINT to the process group) at step 3",
        f"{SLOW} setsid plait train {LONG} & wait_step run 3; kill -INT -- -$!; wait $!",
        rc=(130,),
        line=r"^plait: interrupted$",
    ),
    # ---- 3. overrides on --resume: honoured or refused, never recorded and ignored
    Probe(
        "resume-lr",
        ("3",),
        "`--resume` with another `--train.lr` (the remedy DivergedError names)",
        "plait train --resume run --train.lr 0.3",
        setup=COPY,
        rc=(0, 2),
        line=r"^plait: resume: .*lr",
        check=LR_USED,
        expect="config.toml's lr is the lr trained with (or the override refused)",
    ),
    Probe(
        "resume-warmup",
        ("3",),
        "`--resume` with another schedule key (`--train.warmup_steps`)",
        "plait train --resume run --train.warmup_steps 100",
        setup=COPY,
        rc=(0, 2),
        line=r"^plait: resume: ",
        check=WARMUP_USED,
        expect="config.toml's warm-up is the schedule trained with (or the override refused)",
    ),
    # ---- 4. parameter-server checkpoints: never unpickled, a damaged one skipped
    Probe(
        "ps-crafted-resume",
        ("4",),
        "a crafted `server0.pt` (pickle runs code; manifest rewritten to match), then `--resume`",
        "plait train --resume run",
        setup=f"{PSCOPY}\n{CRAFT}",
        line=r"server0\.pt holds more than tensors.*step_2",
        check=NO_MARKER,
        expect="the pickle's code never runs",
    ),
    Probe(
        "ps-crafted-export",
        ("4", "7"),
        "the same crafted `server0.pt`, then `plait export`",
        "plait export run --out m.safetensors",
        setup=f"{PSCOPY}\n{CRAFT}",
        line=r"server0\.pt holds more than tensors",
        check=f"{NO_MARKER}; test -s m.safetensors",
        expect="the pickle's code never runs; step 2 exported",
    ),
    Probe(
        "ps-truncated-resume",
        ("4",),
        "a truncated parameter-server shard, then `--resume`",
        "truncate -s 1000 run/ps_checkpoints/step_4/server1.pt; plait train --resume run",
        setup=PSCOPY,
        line=r"truncated.*step_2|step_2.*truncated",
        check="test $(last_step run) = 8 && echo 'trained to step 8'",
        expect="resumed from step 2 and trained to the end",
    ),
    # ---- 5. stores on loopback
    Probe(
        "sockets-train",
        ("5",),
        "listening sockets of a single-node dp 2 run (agent store, rank 0's TCPStore)",
        f"{SLOW} plait train {LONG} & wait_step run 3; listening > sockets.txt; kill -INT $!; wait $!",
        rc=(),
        check=SOCKETS,
        expect="every listening socket on 127.0.0.1",
    ),
    Probe(
        "sockets-ps",
        ("5",),
        "listening sockets of a parameter-server run (servers' stores, RPC)",
        "PLAIT_STEP_HOOK=plait.testing:slow_hook PLAIT_PS_SLOW=1:0.25 plait train $PS --train.steps 60"
        " --train.log_every 1 --train.run_dir run & wait_step run 3; listening > sockets.txt;"
        " kill -INT $!; wait $!",
        rc=(),
        check=SOCKETS,
        expect="every listening socket on 127.0.0.1",
    ),
    Probe(
        "sockets-launch",
        ("5",),
        "listening sockets of `plait launch --nproc 2` (a user's script that initialises gloo)",
        "plait launch --nproc 2 sleeper.py & wait_file started.1; listening > sockets.txt;"
        " kill -TERM $!; wait $!",
        setup=SLEEPER,
        rc=(),
        check=SOCKETS,
        expect="every listening socket on 127.0.0.1",
    ),
    # ---- 6. one line, not a traceback
    Probe(
        "disk-full-save",
        ("6",),
        "disk full (ENOSPC) on rank 0 from step 3: the checkpoint save at step 4 fails",
        f"{FAULT}0:3:enospc plait train $TINY --train.run_dir run",
        rc=(1,),
        line=r"No space left on device",
        check=NO_TMP,
        expect="no `.tmp` checkpoint left holding the space",
    ),
    Probe(
        "disk-full-offload",
        ("6", "docs"),
        "disk full on rank 0 at step 3 with the optimizer state offloaded to disk (ZeRO-1)",
        f"{FAULT}0:3:enospc plait train $TINY --parallel.zero_stage 1 --offload.optimizer disk"
        " --train.run_dir run",
        rc=(1,),
        line=r"No space left on device",
        check=NO_TMP,
        expect="no `.tmp` checkpoint left",
    ),
    Probe(
        "checkpoint-dir-unwritable",
        ("6",),
        "the run's `checkpoints/` cannot be written (`chattr +i`: the probes run as root, for whom "
        "`chmod a-w` is no barrier), then `--resume`",
        "chattr +i run/checkpoints; plait train --resume run",
        setup=COPY,
        cleanup="chattr -i run/checkpoints",
        rc=(1, 2),
        line=r"^plait: .*checkpoints",
        check=f"{SHOW}; test $(latest_step run) = 4",
        expect="the step-4 checkpoint still `latest`",
    ),
    Probe(
        "latest-not-utf8-resume",
        ("6",),
        "`checkpoints/latest` holds bytes that are not UTF-8, then `--resume`",
        r"printf '\xff\xfe\n' > run/checkpoints/latest; plait train --resume run",
        setup=COPY,
        line=r"latest.*resuming from step_00000004",
        check="test $(last_step run) = 8 && echo 'trained to step 8'",
        expect="falls back to the newest checkpoint that verifies",
    ),
    Probe(
        "latest-not-utf8-export",
        ("6", "7"),
        "`checkpoints/latest` not UTF-8, then `plait export`",
        r"printf '\xff\xfe\n' > run/checkpoints/latest; plait export run --out m.safetensors",
        setup=COPY,
        rc=(1,),
        line=r"latest is damaged \(not UTF-8 text\); choose a checkpoint with --step \(4\)",
        expect="as for a missing `latest`: one line naming the damage and the steps to choose with --step",
    ),
    Probe(
        "ps-server-killed",
        ("6",),
        "a parameter server killed (SIGKILL) at clock 5",
        "PLAIT_PS_KILL_SERVER=1:5 plait train $PS --ps.consistency ssp --train.run_dir run",
        rc=(1,),
        line=r"^plait: parameter server 1 .*SIGKILL.*--resume",
        check='echo "$(grep -c . stderr.txt) line(s) on stderr"; test $(grep -c . stderr.txt) = 1',
        expect="that line is all of stderr",
    ),
    Probe(
        "launch-ctrl-c",
        ("6",),
        "Ctrl-C (SIGINT to the group) during `plait launch --nproc 2`",
        "setsid plait launch --nproc 2 sleeper.py & wait_file started.1; kill -INT -- -$!; wait $!",
        setup=SLEEPER,
        rc=(130,),
        line=r"^plait( launch)?: interrupted",
        traceback=True,  # the user's own script's KeyboardInterrupt (the terminal's SIGINT reaches it too)
        expect="plait launch's one line, exit 130; the script's ranks show their own KeyboardInterrupt",
    ),
    Probe(
        "launch-sigterm",
        ("6",),
        "SIGTERM to `plait launch --nproc 2`",
        "plait launch --nproc 2 sleeper.py & wait_file started.1; kill -TERM $!; wait $!",
        setup=SLEEPER,
        rc=(143,),
        line=r"^plait( launch)?: .*SIGTERM",
    ),
    Probe(
        "train-stdout-closed",
        ("6",),
        "`plait train ... | head -1`: stdout closed after the first line",
        "plait train $TINY --train.log_every 1 --train.run_dir run | head -1; exit ${PIPESTATUS[0]}",
        check=f"{SHOW}; test $(last_step run) = 8 && test $(latest_step run) = 8",
        expect="the run trains to its end and saves",
    ),
    Probe(
        "launch-nproc-huge",
        ("6",),
        "`plait launch --nproc 100000`",
        "plait launch --nproc 100000 sleeper.py",
        setup=SLEEPER,
        rc=(2,),
        line=r"--nproc",
        check="! ls started.* 2>/dev/null | grep . && echo 'no rank started'",
        expect="refused at once, no rank started",
        timeout=30,
    ),
    # ---- 7. smaller defects
    Probe(
        "export-python-run",
        ("7",),
        "`plait export` of a `python:` model-source run",
        "plait export run --out m.safetensors",
        setup=f"{FACTORIES}\nplait train $TINY --parallel.dp 1 --model.source python:mynet:make_net"
        " --train.run_dir run >/dev/null",
        check='echo "mode $(stat -c %a m.safetensors)"; test "$(stat -c %a m.safetensors)" = 644',
        expect="the file written with the umask's mode (644)",
    ),
    Probe(
        "export-ps-run",
        ("7",),
        "`plait export` of a parameter-server run",
        "plait export run --out m.safetensors",
        setup=PSCOPY,
        line=r"exported step 4",
        check="test -s m.safetensors && echo exported",
    ),
    Probe(
        "ps-tensorboard",
        ("7",),
        "`--log.tensorboard true` on a parameter-server run",
        "plait train $PS --train.stop_at 2 --log.tensorboard true --train.run_dir run",
        check="ls run/tensorboard | grep -c events",
        expect="event files in run/tensorboard",
    ),
    Probe(
        "binary-corpus",
        ("7",),
        "a binary file as the corpus with the byte tokenizer",
        "head -c 200000 /dev/urandom > data.bin;"
        " plait train $TINY --data.corpus data.bin --train.run_dir run",
        rc=(0, 2),
        line=r"(?i)binary|not (utf-8 )?text|not look like text",
    ),
    Probe(
        "memory-refusal",
        ("7", "docs"),
        "a job that does not fit in memory (gpt2-xl at dp 2)",
        "plait train --model.name gpt2-xl",
        rc=(2,),
        line=r"^plait: config error: the job does not fit in memory",
        check="! find runs -name run.lock 2>/dev/null | grep . && echo 'nothing written'",
        expect="nothing written (no `runs/<stamp>/run.lock`)",
    ),
    Probe(
        "hogwild-sigterm",
        ("7",),
        "SIGTERM to the process group of `plait hogwild`",
        "setsid plait hogwild --workers 2 --updates 1000000000 --features 4096 --eval-points 0 --out hw &"
        " wait_file hw/loss.jsonl; sleep 0.5; kill -TERM -- -$!; wait $!",
        rc=(143,),
        line=r"^plait: hogwild stopped by SIGTERM",
    ),
    Probe(
        "factory-mismatch",
        ("7",),
        "a `python:` factory whose model has 16 token ids for 256-byte data",
        "plait train $TINY --model.source python:mynet:make_small --train.run_dir run",
        setup=FACTORIES,
        rc=(2,),
        line=r"^plait: config error",
        check="! ls run/metrics.jsonl 2>/dev/null | grep . && echo 'refused before training'",
        expect="refused before any rank trains",
    ),
    Probe(
        "diverged-wording",
        ("7",),
        "learning rate 1000 without clipping: huge but finite losses, NaN gradient norms",
        "plait train $TINY --parallel.dp 1 --train.steps 12 --train.lr 1000 --train.grad_clip 0"
        " --train.log_every 1 --train.run_dir run",
        rc=(),
        not_line=r"non-finite loss [-+]?\d",
        expect="no finite loss called non-finite",
    ),
    Probe(
        "diverged-exit",
        ("7",),
        "a run that ends while skipping steps (the issue's command)",
        "plait train $TINY --parallel.dp 1 --train.steps 12 --train.lr 1000 --train.grad_clip 0"
        " --train.run_dir run",
        rc=(1,),
        line=r"(?i)skipp",
    ),
    Probe(
        "mfu-over-100",
        ("7",),
        "a cached CPU peak measured under load (1 MFLOP/s in ~/.cache/plait/peak.json)",
        "XDG_CACHE_HOME=$PWD/cache plait train $TINY --parallel.dp 1 --train.run_dir run",
        setup=POISON_PEAK,
        line=r"MFU",
        not_line=r"MFU\s+(?!100\.00%)\d{3,}\.\d+%",  # 100.00% is the cap, not over it
        expect="no MFU over 100% printed",
    ),
    Probe(
        "progress-to-file",
        ("7",),
        "the progress bar with stdout redirected to a file (`make train > log`)",
        "plait train $TINY --train.progress true --train.run_dir run > log.txt",
        check="echo \"$(grep -c $'\\r' log.txt) line(s) with a carriage return\"; ! grep -q $'\\r' log.txt",
        expect="plain lines in the file, no carriage-return frames",
    ),
    # ---- 8. one rank's loss non-finite
    Probe(
        "nonfinite-one-rank-dp2",
        ("8",),
        "rank 1's loss NaN at step 3 while rank 0's is finite (dp 2; fault mode `nanloss`)",
        f"{FAULT}1:3:nanloss plait train $TINY --train.log_every 1 --train.run_dir run",
        line=r"step 3 skipped",
        check='echo "step 3 skipped: $(record run 3 skipped)"; test "$(record run 3 skipped)" = True',
        expect="every rank skips step 3 and the run ends",
    ),
    Probe(
        "nonfinite-one-rank-pp2",
        ("8",),
        "the first stage's loss NaN at step 3 (pp 2; fault mode `nanloss`)",
        f"{FAULT}0:3:nanloss plait train $TINY --parallel.dp 1 --parallel.pp 2 --train.log_every 1"
        " --train.run_dir run",
        line=r"step 3 skipped",
        check='echo "step 3 skipped: $(record run 3 skipped)"; test "$(record run 3 skipped)" = True',
        expect="every rank skips step 3 and the run ends",
    ),
    # ---- 9. a ZeRO-3 custom loop with a Hugging Face model
    Probe(
        "zero3-custom-loop-exit",
        ("9",),
        "a user's ZeRO-3 loop of transformers' Qwen2 (2 layers, d 64), 3 launches at 2 ranks",
        "for i in 1 2 3; do plait launch --nproc 2 qwen_loop.py || exit $?; done",
        setup=QWEN,
        not_line=r"terminate called",
        expect="every launch exits 0",
        timeout=300,
    ),
    Probe(
        "step-norm-without-clip",
        ("9",),
        "`engine.step()` with `grad_clip = 0` in the same loop",
        "plait launch --nproc 2 qwen_loop.py 0",
        setup=QWEN,
        line=r"^step 0 loss \S+ norm \d",
        expect="the gradient norm returned (not None)",
    ),
    *DOCS_PROBES,
]
