"""What a fault probe is (`Probe`) and the shell pieces the probes of benchmarks/faults_probes.py
share: the slow-down and fault-injection prefixes, the checks, a user's scripts and model module."""

from __future__ import annotations

import dataclasses

ITEMS = tuple(str(i) for i in range(1, 10))
"""Issue 29's numbered items; `docs` tags a fault docs/fault-tolerance.md already promised."""


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    items: tuple[str, ...]
    fault: str
    command: str
    rc: tuple[int, ...] = (0,)
    """exit codes that meet the promise; () = any (the line and the check decide)"""
    line: str = ""
    """a regex that one line of stdout or stderr must match (re.search)"""
    not_line: str = ""
    """a regex that no line of stdout or stderr may match"""
    check: str = ""
    """shell run after the command: prints what it sees, exits 0 when that meets the promise"""
    expect: str = ""
    """what `check` decides, in words (the table's expected column adds the rest)"""
    setup: str = ""
    """shell run before, not part of what the operator types (copies of $BASE, a user's script)"""
    cleanup: str = ""
    traceback: bool = False
    timeout: int = 120


SLOW = "PLAIT_STEP_HOOK=plait.testing:slow_hook PLAIT_PS_SLOW=0:0.25"
FAULT = "PLAIT_STEP_HOOK=plait.testing:inject_fault PLAIT_FAIL_AT="
LONG = "$TINY --train.steps 60 --train.log_every 1 --train.run_dir run"
COPY = 'cp -r "$BASE" run'
PSCOPY = 'cp -r "$PSBASE" run'
SAME = '[ "$(latest_step run)" = "$(last_step run)" ]'
SHOW = 'echo "latest step $(latest_step run), last step $(last_step run)"'
NO_TMP = "! ls -d run/checkpoints/*.tmp 2>/dev/null | grep . && echo 'no .tmp left'"
EACH_ONCE = "unique_steps run"
SOCKETS = "cat sockets.txt | tr '\\n' ' '; grep -q . sockets.txt && ! grep -v '^127\\.0\\.0\\.1:' sockets.txt"
NO_MARKER = "! test -e marker && echo 'pickle not run'"

SLEEPER = """cat > sleeper.py <<'EOF'
import os, time, torch.distributed as dist
dist.init_process_group("gloo")
open(f"started.{dist.get_rank()}", "w").write("1")
time.sleep(60)
EOF"""

FACTORIES = """cat > mynet.py <<'EOF'
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))
def make_net(args):
    return Net(args.vocab_size, args.d_model)
def make_small(args):  # 16 token ids: the byte data has 256
    return Net(16, args.d_model)
EOF"""

QWEN = """cat > qwen_loop.py <<'EOF'
import sys, torch, plait
from transformers import Qwen2Config, Qwen2ForCausalLM
clip = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = Qwen2ForCausalLM(cfg)
def loss_fn(m, batch):
    return m(input_ids=batch, labels=batch).loss
engine = plait.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-3), {"zero_stage": 3},
                           loss_fn=loss_fn, blocks=list(model.model.layers), grad_clip=clip)
g = torch.Generator().manual_seed(1)
for step in range(4):
    batch = engine.shard(torch.randint(0, 256, (8, 32), generator=g))
    loss = engine.forward_backward(batch)
    norm = engine.step()
    if engine.is_main:
        print(f"step {step} loss {float(loss):.4f} norm {norm if norm is None else float(norm)}", flush=True)
engine.close()
EOF"""

CRAFT = """python - <<'EOF'
import torch
from plait.train.checkpoint import write_manifest
class Payload:
    def __reduce__(self):
        return exec, ("open('marker', 'w').write('ran')",)
step = "run/ps_checkpoints/step_4"
state = torch.load(f"{step}/server0.pt", weights_only=True)
state["optimizer"] = Payload()
torch.save(state, f"{step}/server0.pt")
write_manifest(__import__("pathlib").Path(step), ["server0.pt", "server1.pt"], step=4, servers=2)
EOF"""

POISON_PEAK = """python - <<'EOF'
import json, os, torch
from plait.train.peak import _cpu_model
os.makedirs("cache/plait", exist_ok=True)
keys = [f"{_cpu_model()}|threads={t}|{d}|torch={torch.__version__}" for t in range(1, 257)
        for d in (torch.float32, torch.bfloat16)]
json.dump({k: 1e6 for k in keys}, open("cache/plait/peak.json", "w"))  # a peak measured under load
EOF"""

LR_USED = (
    'echo "config lr $(grep -E "^lr *=" run/config.toml | head -1 | sed "s/.*= *//"), '
    'lr at step 6 $(record run 6 lr)"; python -c "'
    "import sys, tomllib; c = tomllib.load(open('run/config.toml', 'rb'))['train']; "
    "lr = float(sys.argv[1]) if sys.argv[1] != 'None' else -1; "
    'sys.exit(0 if (c[\'lr\'] > 0.05) == (lr > 0.01) else 1)" "$(record run 6 lr)"'
)
WARMUP_USED = (
    'echo "config warmup $(grep -E "^warmup_steps" run/config.toml | sed "s/.*= *//"), '
    'lr at step 6 $(record run 6 lr)"; python -c "'
    "import sys, tomllib; c = tomllib.load(open('run/config.toml', 'rb'))['train']; "
    "lr = float(sys.argv[1]) if sys.argv[1] != 'None' else -1; "
    'sys.exit(0 if (c[\'warmup_steps\'] >= 100) == (0 <= lr < 5e-4) else 1)" "$(record run 6 lr)"'
)
