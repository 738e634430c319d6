"""disttrain: distributed training of PyTorch models, every strategy behind one API.

This module only re-exports the public API; see docs/design/index.md for the layers.
"""

from disttrain import comm, data, memory, ps, testing, trace
from disttrain.checkpoint import Checkpointer
from disttrain.comm.ops import CollectiveError
from disttrain.finite import FiniteGradCheck, NonFiniteGradError
from disttrain.mesh import Mesh, MeshShape
from disttrain.parallel import DataParallel
from disttrain.parallel.config import Parallelism
from disttrain.parallel.parallelize import ParallelModel, parallelize, token_loss
from disttrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from disttrain.parallel.zero import LossScaler, Zero
from disttrain.preempt import preempted
from disttrain.runtime import (
    backend,
    device,
    init,
    is_initialized,
    local_rank,
    local_world_size,
    print0,
    rank,
    role,
    shutdown,
    world_size,
)
from disttrain.trace.events import log

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "CollectiveError",
    "DataParallel",
    "FiniteGradCheck",
    "LossScaler",
    "Mesh",
    "MeshShape",
    "NonFiniteGradError",
    "ParallelModel",
    "Parallelism",
    "SyncBatchNorm",
    "Zero",
    "backend",
    "comm",
    "convert_sync_batchnorm",
    "data",
    "ps",
    "device",
    "init",
    "is_initialized",
    "log",
    "local_rank",
    "local_world_size",
    "memory",
    "parallelize",
    "preempted",
    "print0",
    "rank",
    "role",
    "shutdown",
    "testing",
    "token_loss",
    "trace",
    "world_size",
]
