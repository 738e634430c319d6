"""Communication building blocks: gradient buckets, wire compression, group helpers."""

from disttrain.comm.buckets import BucketSizeTuner, BucketSpec, FlatBucket, assign_buckets
from disttrain.comm.collectives import broadcast_tensors, global_rank
from disttrain.comm.compression import (
    BF16Compression,
    Compression,
    FP16Compression,
    NoCompression,
    resolve_compression,
)
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
    "BF16Compression",
    "BucketSizeTuner",
    "BucketSpec",
    "Compression",
    "FP16Compression",
    "FlatBucket",
    "NoCompression",
    "assign_buckets",
    "broadcast_tensors",
    "global_rank",
    "resolve_compression",
]
