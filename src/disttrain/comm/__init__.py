"""Communication: torch.distributed's collectives, recorded (ops.py), and wire compression.

`disttrain.comm.all_reduce(t)` and its siblings do what torch.distributed's do, and also
number each call in its group and watch it for hangs (flight.py), so a stuck job names
the collective, its rank and its line. Compression objects (compression.py) shrink the
gradients DataParallel all-reduces. Buckets (buckets.py) and group helpers
(collectives.py) are the strategies' own plumbing: import them from their modules.
"""

from disttrain.comm.compression import BF16Compression, Compression, FP16Compression, NoCompression
from disttrain.comm.ops import (
    CollectiveError,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    irecv,
    isend,
    recorder,
    recv,
    reduce_scatter_tensor,
    send,
)

__all__ = [
    # recorded collectives (comm/ops.py): numbered, placed, watched for hangs
    "CollectiveError",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "irecv",
    "isend",
    "recorder",
    "recv",
    "reduce_scatter_tensor",
    "send",
    # gradient compression for DataParallel (comm/compression.py)
    "BF16Compression",
    "Compression",
    "FP16Compression",
    "NoCompression",
]
