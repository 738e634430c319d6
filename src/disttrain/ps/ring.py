"""Placement of parameter keys on servers: a consistent-hash ring with virtual nodes.

Follows Karger et al. 1997 (consistent hashing) as ps-lite and Mu Li et al. 2014 use it
for the server group: each server owns `vnodes` points on a 64-bit ring; a key belongs to
the first point clockwise from the key's hash. Adding or removing one of S servers moves
only the keys of the ring arcs that change hands, about 1/S of them, instead of
rehashing everything as `hash(key) % S` would.

Keys are parameter names. A tensor larger than `chunk_bytes` is cut (flattened) into
chunks named `name#0`, `name#1`, ... so a big layer spreads over several servers.

Pure: no processes, no sockets. Workers and servers each build the same ring from the
same server list and agree on every owner without talking.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

__all__ = ["HashRing", "Chunk", "chunk_tensor", "plan_keys", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 4 << 20


def _hash64(text: str) -> int:
    # NOTE: a cryptographic hash, not Python's hash(): it must be the same in every
    # process (PYTHONHASHSEED randomizes str hashes per process).
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Chunk:
    """One key: elements [start, stop) of the flattened parameter `name`."""

    key: str
    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def chunk_tensor(name: str, numel: int, element_size: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """Cut a parameter of `numel` elements into keys of at most `chunk_bytes` bytes.

    A parameter that fits keeps its own name as key; a bigger one becomes `name#0..n-1`.
    """
    if chunk_bytes < element_size:
        raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element "
                         f"({element_size} bytes); use at least 1 MB, e.g. 4 << 20")
    if "#" in name:
        raise ValueError(f"parameter name {name!r} contains '#', which marks chunks; rename it")
    per = max(1, chunk_bytes // element_size)
    if numel <= per:
        return [Chunk(name, name, 0, numel)]
    return [Chunk(f"{name}#{i}", name, s, min(s + per, numel))
            for i, s in enumerate(range(0, numel, per))]


class HashRing:
    """Consistent-hash ring: `owner(key)` names the server that holds `key`.

    `servers` are any strings (disttrain uses "server0", "server1", ...). Every server
    gets `vnodes` points; more points give a more even split (about 1/sqrt(vnodes)
    relative spread of load).
    """

    def __init__(self, servers: list[str] | tuple[str, ...] = (), vnodes: int = 128):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}; 64..256 is typical")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._servers: list[str] = []
        for s in servers:
            self.add(s)

    @property
    def servers(self) -> list[str]:
        return list(self._servers)

    def add(self, server: str) -> None:
        """Put `server` on the ring (its `vnodes` points)."""
        if server in self._servers:
            raise ValueError(f"server {server!r} is already on the ring")
        self._servers.append(server)
        for v in range(self.vnodes):
            point = _hash64(f"{server}/vnode{v}")
            i = bisect.bisect(self._points, point)
            self._points.insert(i, point)
            self._owners.insert(i, server)

    def remove(self, server: str) -> None:
        """Take `server` off the ring; its keys go to the next points clockwise."""
        if server not in self._servers:
            raise KeyError(f"server {server!r} is not on the ring (servers: {self._servers})")
        self._servers.remove(server)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != server]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def owner(self, key: str) -> str:
        """The server holding `key`: first ring point clockwise from hash(key)."""
        if not self._points:
            raise RuntimeError("the ring has no servers; add one with ring.add('server0')")
        i = bisect.bisect(self._points, _hash64(key)) % len(self._points)
        return self._owners[i]

    # ---- replica chains (replicas=r, replica.py) -----------------------------------
    def chain(self, key: str, r: int) -> list[str]:
        """The owner of `key` followed by the next r-1 distinct servers clockwise: the
        servers that hold `key` when it is replicated r times (head first, tail last)."""
        if not 1 <= r <= len(self._servers):
            raise ValueError(f"replicas={r} needs 1 <= r <= servers, and the ring has "
                             f"{len(self._servers)} servers; use --servers {max(r, 1)} or more, "
                             f"or replicas <= {len(self._servers)}")
        out: list[str] = []
        i = bisect.bisect(self._points, _hash64(key))
        while len(out) < r:
            s = self._owners[i % len(self._points)]
            if s not in out:
                out.append(s)
            i += 1
        return out

    def assign(self, keys: list[str]) -> dict[str, list[str]]:
        """server -> its keys (in the given order); every server appears, maybe empty."""
        out: dict[str, list[str]] = {s: [] for s in self._servers}
        for k in keys:
            out[self.owner(k)].append(k)
        return out

    def load(self, key_bytes: dict[str, int]) -> dict[str, int]:
        """Bytes per server for keys of the given sizes (the per-server load report)."""
        out = {s: 0 for s in self._servers}
        for k, n in key_bytes.items():
            out[self.owner(k)] += n
        return out


def plan_keys(params: list[tuple[str, int, int]], servers: int, *,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, vnodes: int = 128) -> list[list[Chunk]]:
    """Keys of each server (index 0..S-1) for parameters given as (name, numel, elem size).

    Every process computes the same plan from the same model, so no one sends it.
    """
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}; launch with --servers S")
    ring = HashRing([f"server{i}" for i in range(servers)], vnodes=vnodes)
    out: list[list[Chunk]] = [[] for _ in range(servers)]
    for name, numel, size in params:
        for c in chunk_tensor(name, numel, size, chunk_bytes):
            out[int(ring.owner(c.key).removeprefix("server"))].append(c)
    return out
