"""Parameter-server training: sharded servers, push/pull, consistency policies.

Entry points (connect.py), one per role: `serve(model, policy, optimizer=...)` on a
server rank serves its shard and returns the stats; `attach(model, policy, ...)` on a
worker returns a `Worker` whose `push()`/`pull()` return `Handle`s; `connect(...)` is the
one-script helper that calls the rank's entry point and ends a server's process after.
Consistency is a policy object the servers apply (policy.py; write your own from
`Policy` and `Decision`; how the asynchronous ones step stale gradients, `step=` and
`momentum=`, is staleness.py); placement is consistent hashing with bounded
loads over the `HashRing` (placement.py, ring.py); the wire is transport.py (sockets), session.py (authenticated, sequenced
sessions) and frame.py (message layout); top-k pushes with error feedback are compress.py;
`Straggler` delays make stragglers reproducible on one machine. The server manager
(manager.py, membership.py, manager_link.py) owns the server group's membership and ring
version; `disttrain ps status` (cli.py) shows it; `drain(i)` moves a server's keys to
the others while workers train, then it leaves (move.py; with replicas >= 2 its copies take
them over: handover.py); `join(...)` (or `disttrain ps add-server`) adds a server that
takes its share of the keys while workers train (join_moves.py, joiner.py); `joining()`
says whether this process was started to join, `joined()` waits for a server to join.
"""

from disttrain.deprecation import moved
from disttrain.ps.compress import TopK
from disttrain.ps.connect import attach, connect, serve
from disttrain.ps.handle import Cancelled, Handle
from disttrain.ps.joiner import join, joined, joining
from disttrain.ps.move import drain
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
from disttrain.ps.ring import HashRing
from disttrain.ps.server import PSError
from disttrain.ps.straggler import Straggler
from disttrain.ps.worker import Worker

__all__ = [
    "serve",
    "attach",
    "connect",
    "drain",
    "join",
    "joined",
    "joining",
    "Worker",
    "Handle",
    "Cancelled",
    "PSError",
    # consistency policies (the servers' rule)
    "Policy",
    "Decision",
    "Sync",
    "KSync",
    "KBatchSync",
    "Async",
    "KAsync",
    "KBatchAsync",
    "SSP",
    "backup_workers",
    "HashRing",
    "TopK",
    "Straggler",
]

# NOTE: deprecated for one release.
__getattr__ = moved(__name__, {"parse_straggler": "disttrain.ps:Straggler.parse"})
