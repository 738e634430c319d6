"""Parameter-server training: sharded servers, push/pull, consistency policies.

`connect(model, policy=..., optimizer=...)` is the whole user surface; see worker.py and
server.py. Placement is `HashRing`, consistency is a policy object (policy.py), the wire
is transport.py (ZeroMQ, msgpack headers, raw tensor buffers, HMAC-SHA256); top-k push
sparsification with error feedback is compress.py, snapshots bound to their job snapshot.py.
"""

from disttrain.ps.compress import TopK, parse_compression
from disttrain.ps.policy import (
    SSP,
    Async,
    Decision,
    KAsync,
    KBatchAsync,
    KBatchSync,
    KSync,
    Policy,
    Sync,
    backup_workers,
)
from disttrain.ps.ring import HashRing, chunk_tensor
from disttrain.ps.straggler import Straggler, parse_straggler

__all__ = [
    "SSP",
    "Async",
    "Decision",
    "HashRing",
    "KAsync",
    "KBatchAsync",
    "KBatchSync",
    "KSync",
    "Policy",
    "Straggler",
    "Sync",
    "TopK",
    "backup_workers",
    "chunk_tensor",
    "parse_compression",
    "parse_straggler",
]

from disttrain.ps.connect import connect, format_stats  # noqa: E402
from disttrain.ps.server import PSError, Server  # noqa: E402
from disttrain.ps.worker import Cancelled, Handle, Worker  # noqa: E402

__all__ += ["Cancelled", "Handle", "PSError", "Server", "Worker", "connect", "format_stats"]
