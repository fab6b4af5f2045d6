"""plait: distributed training of PyTorch models, composable, verified and measured."""

from plait import comm
from plait.api import ParallelModel, parallelize
from plait.data_parallel import DataParallel
from plait.errors import CheckpointError, CommError, ConfigError, DataParallelError, PlaitError, TopologyError
from plait.mesh import Mesh, init_distributed

__version__ = "0.1.0"

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
]
