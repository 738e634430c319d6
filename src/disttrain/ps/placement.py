"""Which server holds which key, balanced in bytes: consistent hashing with bounded loads.

Follows Mirrokni, Thorup & Zadimoghaddam 2018 ("Consistent Hashing with Bounded Loads"),
with keys weighted by their bytes: every server may hold at most BALANCE (1.25) times the
mean bytes; keys are taken largest first, and each goes to the first server clockwise from
the key's hash on the ring (ring.py) that still has room for it. Tensors are first cut
(ring.chunk_tensor) into keys of at most 1/16 of a server's share (<= BALANCE - 1 of it),
so a server with room always exists and the cap is a guarantee, not a hope. The cut depends on the
model alone for 2 up to BALANCED_SERVERS servers, so adding or removing a server changes
owners, never key names; each membership change moves at most 2/S of the bytes
(tests/unit/test_ps_placement.py measures both bounds for S = 2..16).

Pure: a placement is a function of (parameter sizes, server names). Every rank computes
the same one from the same model, so nobody sends it. docs/design/parameter-server.md,
"Placement", has the reasons and the measured distributions.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from disttrain.ps.ring import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    HashRing,
    _check_chain,
    _hash64,
    chunk_tensor,
)

__all__ = ["Placement", "place", "plan_keys", "key_bytes_limit", "BALANCE"]

BALANCE = 1.25
"""No server holds more than BALANCE times the mean bytes (the bounded-load cap)."""
BALANCED_SERVERS = 16
"""Up to this many servers the model is cut the same way whatever the server count."""
SHARE_KEYS = 16
"""A server's share (total bytes / G, G = max(BALANCED_SERVERS, servers rounded up to a
power of two)) is cut into at least this many keys. 1/16 <= BALANCE - 1, so a server with
room always exists; and 4x finer than that, so that hashing alone is nearly even, the cap
seldom binds and a membership change cascades little (docs/design: measured)."""
MIN_KEY_BYTES = 256
"""Balancing never cuts keys below this (each key costs a header entry and optimizer
bookkeeping); a model under G * MIN_KEY_BYTES / (BALANCE - 1) bytes (16 KB at G = 16)
may then miss the cap at the largest server counts."""


def key_bytes_limit(total: int, servers: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Largest key, in bytes, for a model of `total` bytes on `servers` servers:
    1/SHARE_KEYS of a server's share at G servers, at least MIN_KEY_BYTES, never more than
    `chunk_bytes` (the stream chunk). One server has nothing to balance: `chunk_bytes`
    (so a one-server job keeps whole tensors, and adding a second server re-cuts)."""
    if servers <= 1:
        return chunk_bytes
    g = max(BALANCED_SERVERS, 1 << max(0, servers - 1).bit_length())
    return min(chunk_bytes, max(MIN_KEY_BYTES, total // (g * SHARE_KEYS)))


class Placement:
    """Owners of keys on `servers`, at most BALANCE times the mean bytes per server.

    chunks: the keys (ring.Chunk) with the element size of each parameter name, as
    `place` makes them; `Placement.of_sizes` takes plain {key: bytes}. Blocks for
    O(keys * servers) pure work; no I/O.
    """

    def __init__(self, chunks: Sequence[Chunk], element_size: dict[str, int],
                 servers: Sequence[str], *, vnodes: int = 256, balance: float = BALANCE):
        servers = list(servers)
        if not servers:
            raise ValueError("a placement needs at least one server; launch with --servers S")
        if len(set(servers)) != len(servers):
            raise ValueError(f"server names must be distinct, got {servers}")
        self.servers, self.chunks = servers, {c.key: c for c in chunks}
        self.element_size = dict(element_size)
        self.sizes = {c.key: c.numel * self.element_size[c.name] for c in chunks}
        self.ring = HashRing(servers, vnodes=vnodes)
        self.cap = balance * sum(self.sizes.values()) / len(servers)
        self._owner: dict[str, str] = {}
        self._at: dict[str, int] = {}  # ring point where the owner took the key
        load = dict.fromkeys(servers, 0)
        # NOTE: largest first, ties by hash: the same order on every rank, and the big
        # keys are placed while every server still has room
        for key in sorted(self.sizes, key=lambda k: (-self.sizes[k], _hash64(k), k)):
            at, s = self._first_with_room(key, load)
            self._owner[key], self._at[key] = s, at
            load[s] += self.sizes[key]

    @classmethod
    def of_sizes(cls, sizes: dict[str, int], servers: Sequence[str], **kw) -> Placement:
        """A placement of keys given as {key: bytes}, each its own one-byte-element tensor."""
        return cls([Chunk(k, k, 0, n) for k, n in sizes.items()], dict.fromkeys(sizes, 1),
                   servers, **kw)

    def _first_with_room(self, key: str, load: dict[str, int]) -> tuple[int, str]:
        walk = []
        for at, s in self.ring.walk_from(self.ring.point(key)):
            if load[s] + self.sizes[key] <= self.cap:
                return at, s
            walk.append((at, s))
        # NOTE: only when a key exceeds (BALANCE - 1) of a share (a model of a few
        # elements per server): the least loaded server, first in ring order on ties
        return min(walk, key=lambda p: load[p[1]])

    def owner(self, key: str) -> str:
        """The server holding `key` (KeyError naming the fix for an unknown key)."""
        try:
            return self._owner[key]
        except KeyError:
            raise KeyError(f"key {key!r} is not in this placement ({len(self._owner)} keys, "
                           "e.g. " + ", ".join(list(self._owner)[:3]) + "); build it from "
                           "the same model") from None

    def chain(self, key: str, r: int) -> list[str]:
        """The owner of `key` followed by the next r-1 distinct servers clockwise from the
        owner's ring point: the key's replica chain. r <= number of servers, else
        ValueError naming both."""
        _check_chain(r, len(self.servers))
        self.owner(key)
        return [s for _, s in itertools.islice(self.ring.walk_from(self._at[key]), r)]

    def keys(self, server: str) -> list[str]:
        """The keys `server` holds, in model order."""
        return [k for k in self.chunks if self._owner[k] == server]

    def load(self) -> dict[str, int]:
        """Bytes per server, every server present (the per-server load report)."""
        out = dict.fromkeys(self.servers, 0)
        for k, n in self.sizes.items():
            out[self._owner[k]] += n
        return out

    def plan(self) -> list[list[Chunk]]:
        """Chunks of each server, in `servers` order, each list in model order."""
        index = {s: i for i, s in enumerate(self.servers)}
        out: list[list[Chunk]] = [[] for _ in self.servers]
        for k, c in self.chunks.items():
            out[index[self._owner[k]]].append(c)
        return out

    def moved_bytes(self, other: Placement) -> int:
        """Bytes whose server differs in `other` (of the same model): what a change from
        this placement to `other` moves, counted per element, so it holds when the two
        cut the model differently."""
        moved = 0
        for name, size in self.element_size.items():
            a, b = self.ranges(name), other.ranges(name)
            i = j = pos = 0
            while i < len(a) and j < len(b):
                stop = min(a[i][1], b[j][1])
                moved += (stop - pos) * size if a[i][2] != b[j][2] else 0
                pos = stop
                i, j = i + (a[i][1] == stop), j + (b[j][1] == stop)
        return moved

    def ranges(self, name: str) -> list[tuple[int, int, str]]:
        """(start, stop, server) of each key of parameter `name`, in element order."""
        return sorted((c.start, c.stop, self._owner[c.key])
                      for c in self.chunks.values() if c.name == name)

    def describe(self) -> list[str]:
        """One line per server: keys, bytes, load against the mean."""
        load, mean = self.load(), sum(self.sizes.values()) / len(self.servers)
        return [f"{s}: {len(self.keys(s))} keys, {load[s]} bytes "
                f"({load[s] / mean if mean else 0:.2f}x the mean)" for s in self.servers]


def place(params: list[tuple[str, int, int]], servers: Sequence[str], *,
          chunk_bytes: int = DEFAULT_CHUNK_BYTES, vnodes: int = 256) -> Placement:
    """Cut parameters given as (name, numel, element size) into keys (key_bytes_limit)
    and place them on the named servers. Pure; the same on every rank."""
    total = sum(n * e for _, n, e in params)
    limit = key_bytes_limit(total, len(servers), chunk_bytes)
    chunks = [c for name, numel, size in params
              for c in chunk_tensor(name, numel, size, max(limit, size))]
    return Placement(chunks, {name: size for name, _, size in params}, servers, vnodes=vnodes)


class Plan(list):
    """Each server's keys (index 0..S-1: a list of lists of Chunks, as `Placement.plan`)
    that also answers `chain(key, r)`, the placement's replica chain of a key."""

    def __init__(self, placement: Placement):
        super().__init__(placement.plan())
        self.chain = placement.chain

    def indices(self, key: str, r: int) -> list[int]:
        """`chain(key, r)` as server indices ("server3" -> 3), head first."""
        return [int(s.removeprefix("server")) for s in self.chain(key, r)]


def plan_keys(params: list[tuple[str, int, int]], servers: int, *,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES, vnodes: int = 256) -> Plan:
    """Keys of each server (index 0..S-1, named server0..) for parameters given as
    (name, numel, element size). Every process computes the same plan from the same
    model, so no one sends it."""
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}; launch with --servers S")
    return Plan(place(params, [f"server{i}" for i in range(servers)], chunk_bytes=chunk_bytes,
                      vnodes=vnodes))
