"""The parameter-server wire: ZeroMQ multipart frames, authenticated, no pickle.

A message is one ZeroMQ multipart frame:

    [mac (32 B), header (msgpack), buffer_0, ..., buffer_{n-1}]

header = {"op": str, "meta": {str: int|str|...}, "keys": [str]*n, "dtypes": [str]*n,
"shapes": [[int]]*n}; buffer_i holds tensor i's raw bytes (C order), sent without a
copy for big tensors and received as a view of ZeroMQ's buffer (zero-copy both ways).
mac = HMAC-SHA256(job secret, len|header|len|sha256 of each 256 KB piece of buffer_0|...),
checked before anything is parsed. Hard limits bound the header, the number of tensors and each tensor's size;
a frame that breaks a limit, fails the MAC or does not parse raises `FrameError`, which
`Endpoint.recv` counts and drops, so one bad peer never stops a server.

Servers own a ROUTER socket (bound to 127.0.0.1 unless a host is given); each worker
owns one DEALER per server. Sockets are used from one thread only (the server loop or
the worker's communication thread).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import torch
import zmq

__all__ = ["Message", "FrameError", "Limits", "encode", "decode", "Endpoint", "job_secret"]

OPS = ("hello", "welcome", "push", "ack", "pull", "params", "cancel", "beat", "done",
       "bye", "error", "ping", "pong")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int8, torch.uint8)}
_COPY_BELOW = 64 << 10  # smaller buffers are copied: cheaper than zero-copy bookkeeping


@dataclass(frozen=True)
class Limits:
    """Hard bounds on what a peer may send."""

    max_header_bytes: int = 256 << 10
    """header (msgpack) size; names and shapes of a few thousand tensors fit."""
    max_tensors: int = 8192
    """tensors per message."""
    max_tensor_bytes: int = 1 << 30
    """bytes of any one tensor; big parameters are chunked (ring.py) well below this."""

    def __post_init__(self):
        for name in ("max_header_bytes", "max_tensors", "max_tensor_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


class FrameError(ValueError):
    """A received frame is malformed, too big or not authenticated."""


@dataclass
class Message:
    op: str
    meta: dict = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)


def job_secret() -> bytes:
    """The per-job key from DISTTRAIN_SECRET (hex), which `disttrain run` generates."""
    raw = os.environ.get("DISTTRAIN_SECRET")
    if not raw:
        raise RuntimeError(
            "DISTTRAIN_SECRET is not set; launch with `disttrain run --workers W --servers S`, "
            "or export the same random hex key on every rank: "
            "DISTTRAIN_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')")
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise RuntimeError("DISTTRAIN_SECRET must be hex (e.g. secrets.token_hex(32))") from None
    if len(key) < 16:
        raise RuntimeError(f"DISTTRAIN_SECRET has {len(key)} bytes; use at least 16 (32 hex digits)")
    return key


_PIECE = 256 << 10  # hashing unit (fixed: part of the MAC format, not of the machine)
_PARALLEL_FROM = 1 << 20  # frames at least this big hash on several threads
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()  # a server and a worker thread may sign at the same time


def _hash_run(pieces) -> list[bytes]:
    # NOTE: hashlib drops the GIL on big inputs, so runs on pool threads hash in parallel
    return [hashlib.sha256(p).digest() for p in pieces]


def _digests(pieces: list) -> list[bytes]:
    """SHA-256 of each piece, in order; big frames are cut into one run of consecutive
    pieces per core (one task each, the calling thread hashing the last run itself)."""
    global _pool
    cores = min(8, os.cpu_count() or 1)
    total = sum(len(p) for p in pieces)
    if cores < 2 or total < _PARALLEL_FROM or len(pieces) < 2:
        return _hash_run(pieces)
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(cores - 1, "ps-hmac")
    n = min(cores, len(pieces))
    bounds = [len(pieces) * i // n for i in range(n + 1)]
    runs = [pieces[a:b] for a, b in zip(bounds, bounds[1:])]
    futures = [_pool.submit(_hash_run, r) for r in runs[:-1]]
    last = _hash_run(runs[-1])
    return [d for f in futures for d in f.result()] + last


def _mac(secret: bytes, header, buffers) -> bytes:
    """HMAC-SHA256(secret, len|header|{len|sha256(piece)...} per buffer).

    Hash-then-MAC over 256 KB pieces: as strong as HMAC over the raw bytes (SHA-256 is
    collision resistant) but the pieces of a big frame hash on several cores. Each
    byte is read once, from the memory it lives in (memoryview slices, no copy).
    """
    pieces = [b[i:i + _PIECE] for b in buffers for i in range(0, len(b), _PIECE)]
    digests = iter(_digests(pieces))
    h = hmac.new(secret, digestmod=hashlib.sha256)
    # NOTE: length prefixes make the split between parts part of what is authenticated.
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    for b in buffers:
        h.update(len(b).to_bytes(8, "little"))
        for _ in range(0, len(b), _PIECE):
            h.update(next(digests))
    return h.digest()


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def encode(msg: Message, secret: bytes) -> list:
    """Message -> multipart parts (buffers are views of the tensors' memory)."""
    if msg.op not in OPS:
        raise ValueError(f"unknown op {msg.op!r}; one of {OPS}")
    if len(msg.keys) != len(msg.tensors):
        raise ValueError(f"{len(msg.keys)} keys but {len(msg.tensors)} tensors")
    buffers = [_raw(t) for t in msg.tensors]
    header = msgpack.packb({
        "op": msg.op, "meta": msg.meta, "keys": list(msg.keys),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in msg.tensors],
        "shapes": [list(t.shape) for t in msg.tensors]}, use_bin_type=True)
    return [_mac(secret, header, buffers), header, *buffers]


def _check_header(h, n_buffers: int) -> None:
    if not isinstance(h, dict) or set(h) != {"op", "meta", "keys", "dtypes", "shapes"}:
        raise FrameError("header must be a map with op, meta, keys, dtypes, shapes")
    if h["op"] not in OPS or not isinstance(h["meta"], dict):
        raise FrameError(f"bad op {h['op']!r} or meta")
    keys, dtypes, shapes = h["keys"], h["dtypes"], h["shapes"]
    if not all(isinstance(x, list) and len(x) == n_buffers for x in (keys, dtypes, shapes)):
        raise FrameError(f"keys/dtypes/shapes must be lists of {n_buffers} entries")
    if not all(isinstance(k, str) for k in keys) or not all(d in DTYPES for d in dtypes):
        raise FrameError("keys must be strings and dtypes one of " + ", ".join(DTYPES))
    for s in shapes:
        if not isinstance(s, list) or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in s):
            raise FrameError(f"bad shape {s!r}")


def decode(parts, secret: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Multipart parts -> Message; raises FrameError on anything wrong (never crashes)."""
    if not 2 <= len(parts) <= limits.max_tensors + 2:
        raise FrameError(f"{len(parts)} parts; expected 2..{limits.max_tensors + 2}")
    views = [p.buffer if isinstance(p, zmq.Frame) else memoryview(p) for p in parts]
    # NOTE: torch wants writable memory; zmq frames are, plain bytes (tests) get a copy.
    views = [v if not v.readonly else memoryview(bytearray(v)) for v in views]
    mac, header, buffers = views[0], views[1], views[2:]
    if len(header) > limits.max_header_bytes:
        raise FrameError(f"header of {len(header)} bytes > limit {limits.max_header_bytes}")
    big = [len(b) for b in buffers if len(b) > limits.max_tensor_bytes]
    if big:
        raise FrameError(f"tensor of {big[0]} bytes > limit {limits.max_tensor_bytes}")
    if len(mac) != 32 or not hmac.compare_digest(bytes(mac), _mac(secret, header, buffers)):
        raise FrameError("HMAC mismatch: not signed with this job's DISTTRAIN_SECRET")
    try:
        h = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise FrameError(f"header is not msgpack: {type(e).__name__}") from None
    _check_header(h, len(buffers))
    tensors = []
    for buf, dtype, shape in zip(buffers, h["dtypes"], h["shapes"]):
        dt = DTYPES[dtype]
        numel = math.prod(shape)
        if numel * dt.itemsize != len(buf):
            raise FrameError(f"shape {shape} of {dtype} needs {numel * dt.itemsize} bytes, "
                             f"got {len(buf)}")
        t = torch.frombuffer(buf, dtype=dt) if numel else torch.empty(0, dtype=dt)
        tensors.append(t.view(shape))
    return Message(h["op"], h["meta"], h["keys"], tensors)


class Endpoint:
    """A ZeroMQ socket that speaks authenticated Messages and counts what it drops."""

    def __init__(self, sock: zmq.Socket, secret: bytes, limits: Limits = DEFAULT_LIMITS):
        self.sock, self.secret, self.limits = sock, secret, limits
        self.rejected: Counter[str] = Counter()
        self.router = sock.type == zmq.ROUTER
        # bytes (mac + header + buffers, without ZeroMQ's own framing) and frames per op;
        # plain dicts: another thread may copy them with dict() while this one counts
        self.sent_bytes: dict[str, int] = {}
        self.sent_frames: dict[str, int] = {}
        self.recv_bytes: dict[str, int] = {}
        self.recv_frames: dict[str, int] = {}

    def send(self, msg: Message, to: bytes | None = None) -> None:
        """Queue `msg` (to peer identity `to` on a ROUTER); does not block on the peer."""
        self.send_parts(encode(msg, self.secret), to, msg.op)

    def send_parts(self, parts: list, to: bytes | None = None, op: str = "params") -> None:
        """Queue parts made by `encode` (e.g. one frame signed once, sent to many peers);
        big buffers go without a copy, so leave their memory alone afterwards."""
        size = sum(len(p) for p in parts)
        self.sent_bytes[op] = self.sent_bytes.get(op, 0) + size
        self.sent_frames[op] = self.sent_frames.get(op, 0) + 1
        if self.router:
            parts = [to, *parts]
        self.sock.send_multipart(parts, copy=size < _COPY_BELOW)

    def recv(self) -> tuple[bytes | None, Message] | None:
        """One message that is ready (blocks until one arrives); None if it was dropped."""
        parts = self.sock.recv_multipart(copy=False)
        ident = None
        if self.router:
            ident, parts = parts[0].bytes, parts[1:]
        try:
            msg = decode(parts, self.secret, self.limits)
        except FrameError as e:
            self.rejected[str(e).split(":")[0][:40]] += 1
            return None
        self.recv_bytes[msg.op] = self.recv_bytes.get(msg.op, 0) + sum(len(p) for p in parts)
        self.recv_frames[msg.op] = self.recv_frames.get(msg.op, 0) + 1
        return ident, msg
