"""One end of a parameter-server connection: what a server's ROUTER and a worker's DEALER
do alike (transport.py builds both on this).

Sealing a frame puts its tensors into the session's shared-memory segment (shm.py) when
it has one with room, else into the frame; opening one checks its tag, sequence number
and schema (session.py, schema.py), and takes a segment frame's tensors from where its
authenticated header says, checked against the ring first (schema.check_shm). Which
frames may leave the tensors out of the MAC: the peer's uid from the kernel
(`peer_uid`), see transport.py and docs/design/parameter-server.md, "Threat model".
"""

from __future__ import annotations

import os
from collections import Counter

import zmq

from disttrain.ps.frame import FrameError, Limits, Message, header_sizes, pack
from disttrain.ps.schema import check, check_shm
from disttrain.ps.session import PLAIN, SHM, Session

__all__ = ["Endpoint", "peer_uid", "peer_pid", "SHM_FROM"]

_COPY_BELOW = 64 << 10  # smaller buffers are copied: cheaper than zero-copy bookkeeping
SHM_FROM = 64 << 10  # smaller frames keep their tensors in the frame (no ring bookkeeping)


def peer_uid(frame: zmq.Frame, field: int = 1) -> int | None:
    """The uid of the process at the other end of the ipc:// connection `frame` came on:
    the kernel's SO_PEERCRED, which ZeroMQ appends to the message's Peer-Address
    (`host:uid:gid:pid`). None when there is none (call it for ipc:// connections only:
    an IPv6 TCP address has colons too)."""
    try:
        fields = frame.get("Peer-Address").rsplit(":", 3)
    except (zmq.ZMQError, AttributeError):
        return None
    return int(fields[field]) if len(fields) == 4 and fields[field].isdigit() else None


def peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of that process (SO_PEERCRED, as `peer_uid`); None when there is none."""
    return peer_uid(frame, 3)


class Endpoint:
    """What both ends of a connection do alike: seal, open and check frames (through the
    session's segment where it has one), count bytes and frames per op (plain dicts:
    another thread may copy them), count refused frames by reason."""

    def __init__(self, sock: zmq.Socket, secret: bytes, limits: Limits, encrypt: bool,
                 always_mac: bool):
        self.sock, self.secret, self.limits, self.encrypt = sock, secret, limits, encrypt
        ipc = sock.getsockopt(zmq.LAST_ENDPOINT).startswith(b"ipc://")
        self.plain_ok = ipc and not (encrypt or always_mac)  # buffers may skip the MAC
        self.rejected: Counter[str] = Counter()
        self.shm_frames: dict[str, int] = {}  # per op: sent with the tensors in shared memory
        self.sent_bytes: dict[str, int] = {}
        self.sent_frames: dict[str, int] = {}
        self.recv_bytes: dict[str, int] = {}
        self.recv_frames: dict[str, int] = {}
        self._shm_bytes = 0  # tensor bytes of the frame being opened that were in the segment
        self.shm_from = SHM_FROM  # frames with fewer tensor bytes stay on the socket

    def _count(self, what: str, op: str, parts, extra: int = 0) -> None:
        nbytes, frames = getattr(self, what + "_bytes"), getattr(self, what + "_frames")
        nbytes[op] = nbytes.get(op, 0) + sum(len(p) for p in parts) + extra
        frames[op] = frames.get(op, 0) + 1

    def _seal(self, s: Session, msg: Message) -> tuple[list, int]:
        """(parts of `msg` on session `s`, tensor bytes written to s's segment): the
        tensors go through the segment when it has one with room (blocks for the copy)."""
        sizes = [t.numel() * t.element_size() for t in msg.tensors]
        big = msg.tensors and sum(sizes) >= self.shm_from
        ring = s.shm.out if s.shm is not None and s.plain_out and big else None
        pos = ring.reserve(sizes) if ring is not None else None
        if pos is None:
            return s.seal(msg), 0
        header, _ = pack(Message(msg.op, dict(msg.meta, shm=pos), msg.keys, msg.tensors))
        ring.write(pos, msg.tensors)  # NOTE: before the header that names it is sent
        self.shm_frames[msg.op] = self.shm_frames.get(msg.op, 0) + 1
        return s.seal_parts(header, [], shm=True), sum(sizes)

    def _taker(self, s: Session, copy: bool):
        """What `Session.open` calls for a frame whose tensors are in s's segment: checks
        the header's position and sizes (schema.check_shm), returns the buffers (copies,
        or views valid until `release`). None when s has no segment."""
        if s.shm is None:
            return None
        ring = s.shm.into

        def take(h: dict) -> list:
            sizes = header_sizes(h)
            check_shm(h["op"], h["meta"], sizes, ring.expect(sizes), ring.size,
                      self.limits.max_tensors)
            self._shm_bytes = sum(sizes)
            return ring.accept(h["meta"]["shm"], sizes, copy)
        return take

    def _open(self, s: Session, env, parts: list, frame: zmq.Frame, copy: bool) -> Message:
        """Authenticate and parse a session frame of `s`; raises FrameError."""
        self._shm_bytes = 0
        return s.open(env, parts, bool(env.flags & PLAIN) and self._local(frame),
                      self._taker(s, copy))

    @staticmethod
    def _check(env, msg: Message, side: str) -> None:
        """The schema, at both receive points (raises SchemaError)."""
        check(msg, side)
        if not env.flags & SHM:
            check_shm(msg.op, msg.meta, [], None)

    def _local(self, frame: zmq.Frame) -> bool:
        """May this received frame's buffers go without a MAC: this user on a Unix socket?"""
        return self.plain_ok and peer_uid(frame) == os.getuid()

    def _reject(self, e: FrameError) -> None:
        self.rejected[e.reason] += 1

    def _put(self, prefix: list, parts: list, op: str, track: bool = False, extra: int = 0):
        """Queue one frame; big ones go without a copy (leave their memory alone until
        sent: with `track`, the returned tracker's `done` says when)."""
        self._count("sent", op, parts, extra)
        size = sum(len(p) for p in parts)
        if not (track and size >= _COPY_BELOW):
            return self.sock.send_multipart(prefix + parts, copy=size < _COPY_BELOW)
        # NOTE: send_multipart would track only the last part; track every part
        parts = prefix + parts
        last = len(parts) - 1
        return zmq.MessageTracker(*[self.sock.send(p, zmq.SNDMORE if i < last else 0,
                                                   copy=False, track=True)
                                    for i, p in enumerate(parts)])
