"""Named hooks: a function given as "package.module:function" in an environment variable, called
by the trainer at a fixed point (the start of a step; the writing of a checkpoint). Extension
points for instrumentation and for the failure tests (`plait.testing`)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from plait.errors import ConfigError


def named_hook(var: str) -> Callable | None:
    """The function the environment variable `var` names ("package.module:function"), or None."""
    spec = os.environ.get(var)
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not name:
        raise ConfigError(f"{var} = {spec!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)
