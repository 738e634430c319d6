"""What each parameter-server op's header holds: one declared table, checked in one place.

`SCHEMA` declares every op: who receives it, each meta field (name, type, range,
required or optional) and how many tensors (and keys) it carries; nothing else is
allowed. The MAC proves who sent a frame, not that its contents are sane, so both ends
call `check` at their receive point (transport.py), after the frame is authenticated
and before any handler runs. A frame that breaks its op's schema raises `SchemaError`;
the receiver counts it under "schema:<op>.<field>" and the handlers only ever see values
of the declared types (no int(...) on a peer's input).

The hello's `protocol` (frame.PROTOCOL) is checked first and apart (`check_protocol`):
a peer of another version gets "speaks wire protocol X, this is Y", not a complaint
about fields its version never meant to send. `check_keys` is the part that needs the
receiver's shard (a push's or a params frame's keys, dtypes and sizes); the handlers call
it. Pure: no sockets, no tensor's data read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disttrain.ps.frame import OPS, PROTOCOL, FrameError, Message

__all__ = ["Field", "Op", "SCHEMA", "SchemaError", "VersionError", "check", "check_protocol",
           "check_keys", "check_shm"]

MAX = 2**63 - 1


@dataclass(frozen=True)
class Field:
    """One meta entry of an op's header."""

    kind: str
    """"int" (a msgpack integer, never a bool), "float" (a msgpack float, finite), "num"
    (an int or a finite float), "str", "strs" (a list of str), "ints" (a list of int),
    "pairs" (a list of [int, int]), "map" (str keys, any plain values) or "rows" (a list
    of maps, each checked against `row`)."""
    lo: int = 0
    """smallest value allowed (kinds "int" and "float")."""
    hi: int = MAX
    """largest value allowed (kinds "int" and "float")."""
    required: bool = True
    """False: the field may be absent; `check` then fills in `default` (if not None)."""
    default: int | None = None
    """the value an absent optional field reads as."""
    row: dict | None = None
    """kind "rows": each row's fields (name -> Field, all required, no others)."""


@dataclass(frozen=True)
class Op:
    """What one op's frame may hold."""

    to: str
    """who receives it: "server" or "worker"."""
    meta: dict[str, Field] = field(default_factory=dict)
    """every meta field, in the order they are checked; any other field is refused."""
    tensors: tuple[int, int] = (0, 0)
    """least and most tensors (one key each) it carries."""


WORKER = Field("int", 0, 2**31 - 1)  # the sender's worker id: every frame a worker sends
FLAG = Field("int", 0, 1, required=False, default=0)
VERSION = Field("int", 0)  # a server's parameter version
KNOWN = Field("int", -1)  # a version a worker holds; -1: none yet
SHM = Field("int", required=False)  # where the tensors are in the session's segment (shm.py)
SERVER = Field("int", 0, 2**31 - 1)  # a server's index
# rows of the server manager's messages (manager.py, membership.py)
SHARD_ROW = {"key": Field("str"), "bytes": Field("int"), "chain": Field("ints")}
RING_ROW = {"server": SERVER, "address": Field("str"), "state": Field("str"),
            "attempt": Field("int")}
# a dead server's keys that a copy serves now (takeover.py): who, where, how many, from what
TAKEOVER_ROW = {"server": SERVER, "by": SERVER, "address": Field("str"), "keys": Field("int"),
                "bytes": Field("int"), "version": VERSION, "after": Field("num")}
# a range copied again after a takeover (recopy.py): whose keys, from where, to where
COPY_ROW = {"server": SERVER, "by": SERVER, "to": SERVER, "keys": Field("int"),
            "bytes": Field("int"), "version": VERSION}
# a worker's latest push a key range's copy holds (transfer.py): its clock, the keys stepped
CLOCK_ROW = {"worker": WORKER, "clock": Field("int"), "keys": Field("strs")}
# a key a joiner heads now (join_status.py): its chain, the joiner first; the old owner
HEAD_ROW = dict(SHARD_ROW, owner=SERVER)
STATE_ROW = dict(RING_ROW, fingerprint=Field("str"), keys=Field("int"), bytes=Field("int"),
                 version=Field("int"), pushes=Field("int"), rate=Field("num"),
                 silent=Field("num"))

SCHEMA: dict[str, Op] = {
    # worker -> server
    "hello": Op("server", {"worker": WORKER, "server": Field("int", 0, 2**31 - 1),
                           "protocol": Field("int"), "keys": Field("strs"),
                           "policy": Field("str"), "plain": FLAG,
                           # the worker's shared-memory file (shm.py): descriptor, ring bytes
                           "shm_fd": Field("int", -1, 2**31 - 1, required=False, default=-1),
                           "shm_bytes": Field("int", 0, 1 << 40, required=False, default=0),
                           # copies of each key range (replica.py); the same on every rank
                           "replicas": Field("int", 1, 2**31 - 1, required=False, default=1)}),
    "push": Op("server", {"worker": WORKER, "clock": Field("int"), "version": KNOWN,
                          "sparse": FLAG, "ack": FLAG, "shm": SHM,
                          # a sparse push's keys of which top-k selected nothing (zeros)
                          "zero": Field("strs", required=False),
                          # a pull riding on a push's last frame: its `have` (worker.fuse)
                          "pull": Field("int", -1, required=False)}, tensors=(1, MAX)),
    "pull": Op("server", {"worker": WORKER, "have": KNOWN}),
    "beat": Op("server", {"worker": WORKER}),
    "done": Op("server", {"worker": WORKER}),
    # server -> its successor in a replica chain (replica.py): one applied update of keys
    # whose head is `origin`, stepped with lr x `lr` and momentum lowered by `momentum`
    # (absent: the optimizer's own); no tensors and `final`: origin sends nothing more
    "replicate": Op("server", {"worker": WORKER, "origin": Field("int", 0, 2**31 - 1),
                               "version": VERSION, "lr": Field("float", 0, 1),
                               "momentum": Field("float", 0, 1, required=False),
                               "final": FLAG, "shm": SHM,
                               # [worker, clock] of each push the update holds (takeover.py)
                               "pushes": Field("pairs", required=False),
                               # no tensors: origin hands these keys over (join_head.py)
                               "handed": Field("strs", required=False)}, tensors=(0, MAX)),
    # the tail of a chain -> its new tail (transfer.py): part `part` of `parts` of the
    # state of keys headed by `origin`, cut at its `version`; per key its value, then one
    # tensor per optimizer field in `fields` (named key|field); the last part: `clocks`
    "transfer": Op("server", {"worker": WORKER, "origin": Field("int", 0, 2**31 - 1),
                              "version": VERSION, "part": Field("int", 0, 1 << 20),
                              "parts": Field("int", 1, 1 << 20), "fields": Field("strs"),
                              "shm": SHM, "clocks": Field("rows", row=CLOCK_ROW,
                                                          required=False)}, tensors=(1, MAX)),
    # server -> worker, and a successor -> its predecessor's link
    "welcome": Op("worker", {"version": VERSION, "plain": FLAG, "mapped": FLAG}),
    # a push received, not yet on every copy (replicas >= 2, Policy.runs_ahead); its ack follows
    "held": Op("worker"),
    "ack": Op("worker"),
    "params": Op("worker", {"version": VERSION, "last": Field("int", 0, 1), "shm": SHM,
                            "ack": FLAG},  # 1: also the ack of the push a pull rode on
                 tensors=(0, MAX)),
    "cancel": Op("worker", {"version": VERSION}),
    # a server's open round (Policy.open_round), named by a worker waiting too long on it
    "pong": Op("worker", {"version": Field("int", 0, MAX, required=False),
                          "pushes": Field("pairs", required=False),
                          "need": Field("int", 0, 1 << 16, required=False),
                          "live": Field("ints", required=False)}),
    # a drained server whose keys moved (move.py): the ring version of the drain
    "moved": Op("worker", {"ring": VERSION}),
    # replicate frame number `frame` (1, 2, ...) of this session is on every later replica
    "commit": Op("worker", {"frame": Field("int", 1)}),
    "bye": Op("worker", {"stats": Field("map"), "staleness": Field("pairs")}),
    "error": Op("worker", {"message": Field("str"),
                           "protocol": Field("int", required=False)}),
    # server, worker or `disttrain ps` -> the server manager (manager.py)
    "register": Op("manager", {"worker": WORKER, "server": SERVER, "address": Field("str"),
                               "fingerprint": Field("str"), "expected": Field("int", 1, 1 << 16),
                               "ring": KNOWN, "attempt": Field("int"),
                               "shard": Field("rows", row=SHARD_ROW),
                               # its process id: a server of this host gone is dead at once
                               "pid": Field("int", 0, 2**31 - 1, required=False, default=0)}),
    "report": Op("manager", {"worker": WORKER, "server": SERVER, "ring": KNOWN,
                             "version": VERSION, "pushes": Field("int"), "final": FLAG,
                             # dead servers' keys it serves now (takeover.py)
                             "adopted": Field("rows", row=TAKEOVER_ROW, required=False),
                             # ranges it holds a copy of again (recopy.py)
                             "copied": Field("rows", row=COPY_ROW, required=False),
                             # a joiner: the moved keys its routes head (join_route.py)
                             "heads": Field("rows", row=HEAD_ROW, required=False),
                             # a drain (move.py): the leaving server whose keys it is
                             # ready to take (a joiner, join_moves.py: its own index); a
                             # leaving server handed all its keys over
                             "accepting": Field("int", -1, required=False, default=-1),
                             "drained": FLAG}),
    "lookup": Op("manager", {"worker": WORKER, "ring": KNOWN}),
    "join": Op("manager", {"worker": WORKER, "server": SERVER, "address": Field("str"),
                           "fingerprint": Field("str"), "ring": KNOWN}),
    "leave": Op("manager", {"worker": WORKER, "server": SERVER, "ring": KNOWN}),
    "status": Op("manager", {"worker": WORKER}),
    # the server manager -> its parties
    "ring": Op("worker", {"version": VERSION, "expected": Field("int", 0, 1 << 16),
                          "complete": FLAG, "stale": FLAG,
                          "servers": Field("rows", row=RING_ROW),
                          "takeovers": Field("rows", row=TAKEOVER_ROW, required=False),
                          # [server, leaving server]: ready to take its keys (move.py)
                          "accepting": Field("pairs", required=False),
                          # ranges copied again (recopy.py) or to a joiner (join_tails.py)
                          "copies": Field("rows", row=COPY_ROW, required=False)}),
    "state": Op("worker", {"version": VERSION, "expected": Field("int", 0, 1 << 16),
                           "servers": Field("rows", row=STATE_ROW),
                           "shard": Field("rows", row=dict(SHARD_ROW, server=SERVER)),
                           "events": Field("strs"), "rejected": Field("map")}),
}
assert set(SCHEMA) == set(OPS), "every op on the wire has a schema"

_RECEIVES = {side: [op for op, o in SCHEMA.items() if o.to == side]
             for side in ("server", "worker", "manager")}


class SchemaError(FrameError):
    """An authenticated frame whose header breaks its op's schema (op and field named)."""

    def __init__(self, op: str, name: str | None, text: str):
        self.op, self.field = op, name
        super().__init__(f"{self.reason}: {text}")

    @property
    def reason(self) -> str:
        return f"schema:{self.op}.{self.field}" if self.field else f"schema:{self.op}"


class VersionError(SchemaError):
    """A hello of another wire protocol version (or of none)."""

    def __init__(self, theirs):
        self.theirs = (str(theirs) if _is_int(theirs) else "an older one (none given)"
                       if theirs is None else f"an unknown one ({_show(theirs)})")
        super().__init__("hello", "protocol", f"peer speaks wire protocol {self.theirs}, "
                                              f"this is {PROTOCOL}")

    @property
    def reason(self) -> str:
        return "protocol"

    def answer(self, server: int) -> str:
        """What server `server` tells the peer: both versions, and the fix."""
        return (f"server {server} speaks wire protocol {PROTOCOL}, this worker {self.theirs}: "
                "install the same disttrain version on every rank")


def check_protocol(msg: Message) -> None:
    """Raise VersionError unless the hello `msg` speaks this PROTOCOL (never blocks)."""
    theirs = msg.meta.get("protocol")
    if not _is_int(theirs) or theirs != PROTOCOL:
        raise VersionError(theirs)


def check(msg: Message, side: str) -> None:
    """Raise SchemaError naming the first field of `msg` that breaks its op's schema, for
    `side` ("server", "worker" or "manager") receiving it; fills in absent optional fields' defaults.

    Never blocks, never raises anything else (`msg` came from frame.unpack: its op is one
    of OPS, its keys and tensors agree, its meta is a map).
    """
    op = SCHEMA[msg.op]
    if op.to != side:
        raise SchemaError(msg.op, None, f"a {side} does not receive {msg.op} frames (it "
                                        f"receives {', '.join(_RECEIVES[side])})")
    unknown = [k for k in msg.meta if k not in op.meta]
    if unknown:
        raise SchemaError(msg.op, "unknown-field", f"{_show(unknown[0])} is not a {msg.op} "
                                                   f"field (fields: {', '.join(op.meta)})")
    for name, f in op.meta.items():
        if name not in msg.meta:
            if f.required:
                raise SchemaError(msg.op, name, "missing")
            if f.default is not None:
                msg.meta[name] = f.default
            continue
        problem = _problem(f, msg.meta[name])
        if problem:
            raise SchemaError(msg.op, name, problem)
    lo, hi = op.tensors
    if not lo <= len(msg.tensors) <= hi:
        raise SchemaError(msg.op, "tensors", f"{len(msg.tensors)} tensors; a {msg.op} carries "
                                             + (f"{lo}" if lo == hi else f"at least {lo}"))


def check_keys(msg: Message, shard: dict) -> None:
    """Raise SchemaError(op, "keys") unless every key of `msg` is one of `shard`'s (key ->
    (numel, dtype)), unrepeated, with a 1-D tensor of that numel and dtype: a tensor is
    never silently dropped, cut or cast. Never blocks."""
    if msg.meta.get("zero"):
        raise SchemaError(msg.op, "zero", "names zero keys, which only a sparse push does")
    seen = set()
    for key, t in zip(msg.keys, msg.tensors):
        if key not in shard or key in seen:
            raise SchemaError(msg.op, "keys", f"key {key[:80]!r} is "
                              + ("repeated" if key in seen else "not one of this shard's"))
        seen.add(key)
        numel, dtype = shard[key]
        if t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
            raise SchemaError(msg.op, "keys", f"{key!r} must be 1-D {dtype} of {numel} "
                                              f"entries, got {t.dtype} of shape {list(t.shape)}")


def check_shm(op: str, meta: dict, sizes: list[int], expected: tuple[int, int] | None,
              ring_bytes: int = 0, max_tensors: int = 0) -> None:
    """Raise SchemaError(op, "shm") unless a frame's `meta.shm` fits how it came. Never blocks.

    `expected`: None for a frame whose tensors came in the frame (it must not name a
    segment position); for one whose tensors are in the session's segment (shm.py), the
    (position, bytes) the receiver's own ring computed for tensors of `sizes` bytes (the
    header's dtypes and shapes): `meta.shm` must be exactly that position, the frame at
    most `ring_bytes` and `max_tensors` tensors. So a wrong, stale, overlapping or
    out-of-range position or length is refused before a byte of the segment is read.
    """
    pos = meta.get("shm")
    if expected is None:
        if pos is not None:
            raise SchemaError(op, "shm", "names a segment position, but the frame is not "
                                         "marked as carrying its tensors in the segment")
        return
    if op not in ("push", "params", "replicate", "transfer"):
        raise SchemaError(op, "shm", f"a {op} frame never carries tensors in the segment")
    if len(sizes) > max_tensors or expected[1] > ring_bytes:
        raise SchemaError(op, "shm", f"{len(sizes)} tensors of {expected[1]} bytes do not fit "
                                     f"a ring of {ring_bytes} bytes (at most {max_tensors})")
    if not _is_int(pos) or pos != expected[0]:
        raise SchemaError(op, "shm", f"position {_show(pos)}; the next frame of the ring is at "
                                     f"{expected[0]}")


def _problem(f: Field, v) -> str | None:
    if f.kind == "float":
        if not isinstance(v, float) or not f.lo <= v <= f.hi:  # NOTE: NaN fails both
            return f"must be a float in [{f.lo}, {f.hi}], got {_show(v)}"
        return None
    if f.kind == "int":
        if not _is_int(v):
            return f"must be an integer, got {_show(v)}"
        if not f.lo <= v <= f.hi:
            return f"must be in [{f.lo}, {f.hi}], got {v}"
        return None
    if f.kind == "rows":
        if not isinstance(v, list):
            return f"must be a list of maps, got {_show(v)}"
        for i, r in enumerate(v):
            if not isinstance(r, dict) or set(r) != set(f.row):
                return f"row {i} must be a map of exactly {', '.join(f.row)}, got {_show(r)}"
            bad = next(((n, p) for n, g in f.row.items() if (p := _problem(g, r[n]))), None)
            if bad:
                return f"row {i} field {bad[0]}: {bad[1]}"
        return None
    ok = {"str": lambda: isinstance(v, str),
          "num": lambda: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
          "ints": lambda: isinstance(v, list) and all(_is_int(x) for x in v),
          "strs": lambda: isinstance(v, list) and all(isinstance(x, str) for x in v),
          "pairs": lambda: isinstance(v, list) and all(
              isinstance(p, list) and len(p) == 2 and all(_is_int(x) for x in p) for p in v),
          "map": lambda: isinstance(v, dict) and all(isinstance(k, str) for k in v)}[f.kind]
    return None if ok() else f"must be {_KINDS[f.kind]}, got {_show(v)}"


_KINDS = {"str": "a string", "num": "a finite number", "ints": "a list of integers", "strs": "a list of strings", "pairs": "a list of [int, int]",
          "map": "a map with string keys"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v) -> str:
    return f"{type(v).__name__} {repr(v)[:40]}"
