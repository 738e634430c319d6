"""What a parameter-server message is on the wire, before authentication: header + buffers.

A `Message` (op, meta, keys, tensors) becomes one msgpack header and one raw buffer per
tensor: header = {"op": str, "meta": {str: int|str|...}, "keys": [str]*n, "dtypes":
[str]*n, "shapes": [[int]]*n}; buffer_i is tensor i's bytes in C order, a view of the
tensor's memory (no copy); a frame flagged SHM has no buffers, its tensors are in the
session's shared-memory segment (shm.py: `read_header`, then `build` over them).
`unpack` checks the header against hard `Limits` and the buffers, and builds tensors as
views of the received memory; anything wrong raises
`FrameError`, never another exception. No pickle. session.py authenticates these parts,
transport.py moves them, schema.py checks each op's meta once they are authenticated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import torch

__all__ = ["Message", "FrameError", "Limits", "DEFAULT_LIMITS", "OPS", "PROTOCOL", "pack",
           "unpack", "read_header", "build", "header_sizes", "check_sizes", "group_keys"]

PROTOCOL = 10
"""The wire protocol version a hello carries; a peer of another one is refused, naming
both (docs/design/parameter-server.md, "Header schema and protocol version"). Bump it
whenever what a frame means changes: ops, meta fields (schema.py), envelope, keys."""
OPS = ("hello", "welcome", "push", "held", "ack", "pull", "params", "cancel", "beat", "done",
       "bye", "error", "pong",
       # between servers of a replica chain (replica.py)
       "replicate", "commit",
       # chain extension (transfer.py): a key range's state to its new tail
       "transfer",
       # a drained server to its workers: its keys moved, ask the manager (move.py)
       "moved",
       # the server manager's (manager.py): requests to it, its two answers
       "register", "report", "lookup", "join", "leave", "status", "ring", "state")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int8, torch.uint8)}


@dataclass(frozen=True)
class Limits:
    """Hard bounds on what a peer may send."""

    max_header_bytes: int = 256 << 10
    """header (msgpack) size; names and shapes of a few thousand tensors fit."""
    max_tensors: int = 8192
    """tensors per message."""
    max_tensor_bytes: int = 1 << 30
    """bytes of any one tensor; big parameters are chunked (ring.py) well below this."""

    @property
    def max_frame_bytes(self) -> int:
        """The largest message part a peer may send (a header or one tensor, plus an AEAD
        tag's room): ZeroMQ's MAXMSGSIZE on every PS socket, so a bigger part drops the
        connection as its length arrives, before any of it is buffered."""
        return max(self.max_header_bytes, self.max_tensor_bytes) + 4096

    def __post_init__(self):
        for name in ("max_header_bytes", "max_tensors", "max_tensor_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


class FrameError(ValueError):
    """A received frame is malformed, too big, not authenticated or out of sequence.

    The text before the first ':' is the reason the receiver counts it under."""

    @property
    def reason(self) -> str:
        """What the receiver counts this frame under (`rejected`)."""
        return str(self).split(":")[0][:40]


@dataclass
class Message:
    op: str
    meta: dict = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def pack(msg: Message) -> tuple[bytes, list[memoryview]]:
    """Message -> (header, buffers); buffers are views of the tensors' memory."""
    if msg.op not in OPS:
        raise ValueError(f"unknown op {msg.op!r}; one of {OPS}")
    if len(msg.keys) != len(msg.tensors):
        raise ValueError(f"{len(msg.keys)} keys but {len(msg.tensors)} tensors")
    header = msgpack.packb({
        "op": msg.op, "meta": msg.meta, "keys": list(msg.keys),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in msg.tensors],
        "shapes": [list(t.shape) for t in msg.tensors]}, use_bin_type=True)
    return header, [_raw(t) for t in msg.tensors]


def check_sizes(parts: list, limits: Limits, envelope_bytes: int) -> None:
    """Reject by size alone, before any MAC is computed: parts = [envelope, header, *buffers]."""
    if not 2 <= len(parts) <= limits.max_tensors + 2:
        raise FrameError(f"bad part count: {len(parts)} parts; expected 2.."
                         f"{limits.max_tensors + 2}")
    if len(parts[0]) != envelope_bytes:
        raise FrameError(f"bad envelope: {len(parts[0])} bytes, expected {envelope_bytes}")
    if len(parts[1]) > limits.max_header_bytes:
        raise FrameError(f"over limit: header of {len(parts[1])} bytes > "
                         f"{limits.max_header_bytes}")
    big = [len(b) for b in parts[2:] if len(b) > limits.max_tensor_bytes]
    if big:
        raise FrameError(f"over limit: tensor of {big[0]} bytes > {limits.max_tensor_bytes}")


def _check_header(h, n_buffers: int) -> None:
    if not isinstance(h, dict) or set(h) != {"op", "meta", "keys", "dtypes", "shapes"}:
        raise FrameError("bad header: must be a map with op, meta, keys, dtypes, shapes")
    if h["op"] not in OPS or not isinstance(h["meta"], dict):
        raise FrameError(f"bad header: op {h['op']!r} or meta")
    keys, dtypes, shapes = h["keys"], h["dtypes"], h["shapes"]
    if not all(isinstance(x, list) and len(x) == n_buffers for x in (keys, dtypes, shapes)):
        raise FrameError("bad header: keys/dtypes/shapes must be lists of "
                         + ("equal length" if n_buffers is None else f"{n_buffers} entries"))
    if not all(isinstance(k, str) for k in keys) or not all(d in DTYPES for d in dtypes):
        raise FrameError("bad header: keys must be strings and dtypes one of " + ", ".join(DTYPES))
    for s in shapes:
        if not isinstance(s, list) or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in s):
            raise FrameError(f"bad header: shape {s!r}")


def unpack(header, buffers: list) -> Message:
    """(header, buffers) -> Message, tensors viewing `buffers`; raises FrameError only.

    Call it on authenticated parts only (session.py): the header is parsed here."""
    return build(read_header(header, len(buffers)), buffers)


def read_header(header, n_buffers: int | None = None) -> dict:
    """Parse and check a header (msgpack) declaring `n_buffers` tensors (None: as many
    as it lists: their bytes are elsewhere, shm.py); raises FrameError only."""
    try:
        h = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise FrameError(f"bad header: not msgpack ({type(e).__name__})") from None
    if n_buffers is None and isinstance(h, dict) and isinstance(h.get("keys"), list):
        n_buffers = len(h["keys"])
    _check_header(h, n_buffers)
    return h


def header_sizes(h: dict) -> list[int]:
    """Bytes of each tensor a checked header (read_header) declares."""
    return [math.prod(s) * DTYPES[d].itemsize for d, s in zip(h["dtypes"], h["shapes"])]


def build(h: dict, buffers: list) -> Message:
    """A checked header (read_header) and its buffers -> Message, tensors viewing
    `buffers`; raises FrameError when a buffer's length is not its tensor's."""
    tensors = []
    for buf, dtype, shape in zip(buffers, h["dtypes"], h["shapes"]):
        dt = DTYPES[dtype]
        numel = math.prod(shape)
        if numel * dt.itemsize != len(buf):
            raise FrameError(f"bad header: shape {shape} of {dtype} needs "
                             f"{numel * dt.itemsize} bytes, got {len(buf)}")
        # NOTE: torch wants writable memory; zmq frames are, plain bytes (tests) get a copy.
        view = memoryview(buf)
        view = view if not view.readonly else memoryview(bytearray(view))
        t = torch.frombuffer(view, dtype=dt) if numel else torch.empty(0, dtype=dt)
        tensors.append(t.view(shape))
    return Message(h["op"], h["meta"], h["keys"], tensors)


def group_keys(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Indices of consecutive keys of `sizes` bytes packed into messages of at most
    `chunk_bytes` (a key bigger than that travels alone): a big push or pull becomes a
    stream of chunk messages that the receiver handles one by one as they arrive."""
    groups: list[list[int]] = []
    room = 0
    for i, n in enumerate(sizes):
        if not groups or n > room:
            groups.append([])
            room = chunk_bytes
        groups[-1].append(i)
        room -= n
    return groups
