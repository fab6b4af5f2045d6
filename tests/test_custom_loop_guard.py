"""A script that starts ranks (`plait.verify`, `plait.testing.run_ranks`) from its module level
without `if __name__ == "__main__":` (issue 39, item 4). Every rank process re-imports the main
script before running its function and would run the call again, so both ranks died with
"exited with code 1 and left no traceback". Now the call is refused before any rank starts, with
the fix named; and a rank that still dies before reaching its function says so."""

from __future__ import annotations

import os
import sys
import types

import pytest

from plait.comm import spawn
from plait.errors import ConfigError
from plait.testing import run_ranks

VERIFY_SCRIPT = """
import torch
import plait

def make_model():
    return torch.nn.Linear(4, 2)

def loss_fn(model, batch):
    return model(batch).square().mean()

report = plait.verify(make_model, loss_fn, [torch.ones(4, 4)], [{"dp": 2}])
print("verified:", report.holds)
"""


def test_a_verify_script_without_a_main_guard_is_refused_naming_the_fix(monkeypatch, tmp_path, capsys):
    """The script run as the main module (in this process: the check runs before any rank)."""
    with pytest.raises(ConfigError) as info:
        _run_as_main(monkeypatch, tmp_path, VERIFY_SCRIPT)
    text = str(info.value)
    assert "plait.verify was called from the module level of" in text and "main_script.py" in text, text
    assert 'without `if __name__ == "__main__":`' in text and "(line 11)" in text, text
    assert "verified" not in capsys.readouterr().out  # refused before the reference or any rank ran


def _run_as_main(monkeypatch, tmp_path, source: str) -> None:
    """Execute `source` as the main script would run (its own module `__main__`, a file)."""
    path = tmp_path / "main_script.py"
    path.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = str(path), None
    main.check = spawn.check_main_guard
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(source, str(path), "exec"), vars(main))


@pytest.mark.parametrize(
    "source, refused",
    [
        ("check()\n", True),
        ("def main():\n    check()\n\nmain()\n", True),  # a main() called unguarded
        ("x = 1\nif __name__ == '__main__':\n    check()\n", False),
        ('def main():\n    check()\n\nif "__main__" == __name__:\n    main()\n', False),
        ("if __name__ != '__main__':\n    pass\nelse:\n    check()\n", True),  # not the idiom: named
    ],
)
def test_the_guard_is_found_where_the_call_is(monkeypatch, tmp_path, source, refused):
    if refused:
        with pytest.raises(ConfigError, match=r"without `if __name__ == \"__main__\":`"):
            _run_as_main(monkeypatch, tmp_path, source)
    else:
        _run_as_main(monkeypatch, tmp_path, source)


def test_no_main_script_no_check(monkeypatch):
    """`python -c`, an interactive session or `python -m pkg` re-import no script."""
    for spec_name, file in ((None, None), ("pkg.__main__", "/x/pkg/__main__.py"), ("__main__", "/x/m.py")):
        main = types.ModuleType("__main__")
        main.__file__ = file
        main.__spec__ = types.SimpleNamespace(name=spec_name) if spec_name else None
        monkeypatch.setitem(sys.modules, "__main__", main)
        assert spawn.reimported_main() is None
        spawn.check_main_guard()


def _explode(parent: int):
    if os.getpid() != parent:  # unpickled in the rank: it dies before its function runs
        raise RuntimeError("cannot rebuild this argument here")
    return None


class DiesInTheRank:
    def __reduce__(self):
        return _explode, (os.getpid(),)


def _nothing(arg):
    return arg


def test_a_rank_that_dies_before_its_function_says_so():
    with pytest.raises(AssertionError) as info:
        run_ranks(_nothing, 2, args=(DiesInTheRank(),), timeout=60)
    text = str(info.value)
    assert "exited with code 1 before running _nothing" in text, text
    assert 'under `if __name__ == "__main__":`' in text and "left no traceback" not in text, text
