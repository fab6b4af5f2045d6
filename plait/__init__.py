"""plait: distributed training of PyTorch models, composable, verified and measured."""

from plait import comm
from plait.data_parallel import DataParallel
from plait.errors import CheckpointError, CommError, ConfigError, DataParallelError, PlaitError, TopologyError
from plait.mesh import Mesh, init_distributed

__version__ = "0.1.0"


def __getattr__(name: str):
    # `plait.parallelize` and `plait.ParallelModel` (the custom-loop API, the top layer) load on
    # first use, so that importing one layer of plait (plait.pipeline, plait.mesh) does not
    # import every layer above it. (The engine-building function behind them is
    # plait.apply.parallelize.)
    if name in ("parallelize", "ParallelModel"):
        from plait import api

        return getattr(api, name)
    if name == "verify":  # the parity check of a custom loop's layouts (plait.parity)
        from plait.parity import verify

        return verify
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "DataParallel",
    "DataParallelError",
    "Mesh",
    "ParallelModel",
    "PlaitError",
    "TopologyError",
    "comm",
    "init_distributed",
    "parallelize",
    "verify",
]
