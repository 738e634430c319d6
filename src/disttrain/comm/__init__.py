"""Communication: torch.distributed's collectives, recorded (ops.py), and wire compression.

`disttrain.comm.all_reduce(t)` and its siblings do what torch.distributed's do, and also
number each call in its group and watch it for hangs (flight.py), so a stuck job names
the collective, its rank and its line. `all_reduce(t, algorithm="ring")` picks one of
the allreduce algorithms (algorithms.py; "auto" asks the cost model, cost.py).
Compression objects (compression.py) shrink the gradients DataParallel all-reduces.
Buckets (buckets.py), the bucket reducer (reducer.py), group helpers (collectives.py)
and the flight recorder (`ops.recorder()`) are the strategies' own plumbing: import
them from their modules.
"""

from disttrain.comm.algorithms import all_reduce
from disttrain.comm.compression import BF16Compression, Compression, FP16Compression, NoCompression
from disttrain.comm.ops import (
    CollectiveError,
    all_gather,
    all_gather_into_tensor,
    barrier,
    broadcast,
    irecv,
    isend,
    recv,
    reduce_scatter_tensor,
    send,
)
from disttrain.deprecation import moved

__getattr__ = moved(__name__, {"recorder": "disttrain.comm.ops:recorder"})

__all__ = [
    # recorded collectives (comm/ops.py; all_reduce's algorithms: comm/algorithms.py)
    "CollectiveError",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter_tensor",
    "send",
    # gradient compression for DataParallel (comm/compression.py)
    "BF16Compression",
    "Compression",
    "FP16Compression",
    "NoCompression",
]
