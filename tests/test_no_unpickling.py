"""Nothing from a run directory is unpickled: every `torch.load` in plait passes
`weights_only=True` (tensors and plain containers only; a crafted file runs no code), whatever
the installed torch's default (False before torch 2.6, which pyproject.toml allows)."""

import re
from pathlib import Path

import plait

ROOT = Path(plait.__file__).parent


def _calls(text: str, name: str):
    """The argument text of every call of `name` in `text` (to its closing parenthesis)."""
    for m in re.finditer(re.escape(name) + r"\s*\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield text[m.end() : i - 1]


def test_every_torch_load_in_plait_passes_weights_only_true():
    found, bad = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if "weights_only=False" in text.replace(" ", ""):
            bad.append(f"{path.relative_to(ROOT)}: weights_only=False")
        for args in _calls(text, "torch.load"):
            found += 1
            if not re.search(r"weights_only\s*=\s*True", args):
                bad.append(f"{path.relative_to(ROOT)}: torch.load({args})")
    assert found >= 2, "the scan found no torch.load: it no longer sees plait's sources"
    assert not bad, bad
