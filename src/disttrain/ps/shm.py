"""Shared memory between a worker and a server on one host: tensors bypass the socket.

A worker whose link to a server is a same-user `ipc://` connection (transport.py) makes
one anonymous memory file (`memfd_create`: no name in any folder, so nothing to leak or
remove; the kernel frees it when the last process holding it exits) and names it in its
hello by file descriptor number. The server opens it as `/proc/<pid>/fd/<n>`, with the
pid the kernel reported for that connection (SO_PEERCRED): only a process of this user
(or root) may open another process's descriptors, and it is the connected peer's own.

Layout: a 4 KB control page, then one ring of `ring_bytes` per direction (worker to
server, then server to worker). The control page holds, per direction, how far the
receiver has consumed (a u64 the receiver writes and the sender reads). A sender places
a frame's tensors at the ring's next position (each buffer 64-byte aligned; a frame that
would cross the ring's end starts at its beginning instead), copies them in, and sends
only the authenticated header, which names the position (`meta.shm`); a frame that finds
no room goes over the socket as before. The receiver computes the same position from
its own count and the header's shapes and dtypes and refuses any other (schema.check_shm),
copies or reads the bytes out, then marks them consumed. Who may write the segment and
why nothing is acted on before it is copied out: docs/design/parameter-server.md, "Shared
memory on one host".
"""

from __future__ import annotations

import mmap
import os
import stat
import struct

import torch

__all__ = ["Segment", "Ring", "ring_bytes", "CONTROL_BYTES", "ALIGN"]

CONTROL_BYTES = 4096
ALIGN = 64
_NAME = "disttrain-ps"
_CONSUMED = struct.Struct("<Q")
W2S, S2W = 0, 1


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def ring_bytes(shard_bytes: int, keys: int, chunk_bytes: int, cap: int = 128 << 20) -> int:
    """Ring size per direction for a server's shard: a whole push or pull of it (each key
    aligned) plus a chunk, at most `cap`; a frame that finds no room takes the socket."""
    return _aligned(min(shard_bytes + keys * ALIGN + chunk_bytes, cap))


class Segment:
    """One worker<->server memory file, mapped; `out`/`into` are this side's rings."""

    def __init__(self, fd: int, ring_bytes: int, side: str):
        self.ring_bytes, self.fd = ring_bytes, fd  # fd: what a worker names in its hello
        try:
            self._map = mmap.mmap(fd, CONTROL_BYTES + 2 * ring_bytes)
        except BaseException:
            os.close(fd)
            raise
        self._open = True
        if side == "server":
            self.forget_fd()
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        mine, theirs = (W2S, S2W) if side == "worker" else (S2W, W2S)
        self.out, self.into = Ring(self, mine), Ring(self, theirs)

    @classmethod
    def create(cls, ring_bytes: int) -> Segment | None:
        """A new memory file with two rings of `ring_bytes` (the worker's side); None
        where the system has no memfd_create or refuses one (the socket path is used)."""
        if ring_bytes < ALIGN or ring_bytes % ALIGN:
            raise ValueError(f"ring_bytes={ring_bytes} must be a positive multiple of {ALIGN}")
        try:
            fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        except (AttributeError, OSError):  # NOTE: not Linux, or out of descriptors
            return None
        try:
            os.ftruncate(fd, CONTROL_BYTES + 2 * ring_bytes)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, ring_bytes, "worker")

    @classmethod
    def attach(cls, pid: int, fd: int, ring_bytes: int) -> Segment:
        """Map process `pid`'s memory file `fd` (the server's side); raises OSError or
        ValueError when it is not a disttrain memory file of this user of that size."""
        if ring_bytes < ALIGN or ring_bytes % ALIGN:
            raise ValueError(f"ring_bytes={ring_bytes} must be a positive multiple of {ALIGN}")
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(own)
            name = os.readlink(f"/proc/self/fd/{own}")
            if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()
                    and st.st_size == CONTROL_BYTES + 2 * ring_bytes
                    and name.startswith(f"/memfd:{_NAME} ")):
                raise ValueError(f"{name} is not a disttrain segment of {ring_bytes} bytes "
                                 f"per direction of this user")
        except BaseException:
            os.close(own)
            raise
        return cls(own, ring_bytes, "server")

    @property
    def data(self) -> torch.Tensor:
        """The whole segment as a uint8 tensor over the map (what rings copy in and out)."""
        return self._bytes

    @property
    def buffer(self) -> mmap.mmap:
        """The map itself (for the control page's counters)."""
        return self._map

    def forget_fd(self) -> None:
        """Close the descriptor (the map keeps its own): once both sides mapped the file,
        only the two maps hold it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap and close (the memory goes once the peer closed it too)."""
        if not self._open:
            return
        self._open = False
        self.forget_fd()
        self._bytes = None
        self.out = self.into = None
        try:
            self._map.close()
        except BufferError:  # NOTE: a tensor still views it: unmapped (and closed) with it
            pass


class Ring:
    """One direction of a segment: a byte ring and its consumed counter.

    The sender calls `reserve` then `write`; the receiver `expect`, `views`, `release`.
    Positions count bytes since the session began (never wrap); offset = position %
    size. Used from one thread per side (the server loop, the worker's comm thread).
    """

    def __init__(self, seg: Segment, direction: int):
        self._seg, self.size = seg, seg.ring_bytes
        self._offset = CONTROL_BYTES + direction * seg.ring_bytes
        self._counter = direction * ALIGN  # where its consumed count lives
        self.next = 0  # position after the last frame placed (sender) or accepted (receiver)
        self._held = 0  # receiver: accepted up to here, not yet released

    def _start(self, sizes: list[int]) -> tuple[int, int]:
        """(position, bytes) the next frame of `sizes` occupies; the same rule both sides."""
        total = sum(_aligned(n) for n in sizes)
        pos = self.next
        if pos % self.size + total > self.size:
            pos = -(-pos // self.size) * self.size  # NOTE: a frame never wraps
        return pos, total

    # ---- sender ----
    def reserve(self, sizes: list[int]) -> int | None:
        """The position for a frame of `sizes` bytes, or None when the ring has no room
        (the receiver has not consumed enough: send it over the socket instead)."""
        pos, total = self._start(sizes)
        consumed = self.consumed()
        if total > self.size or not self.next - self.size <= consumed <= self.next:
            return None  # NOTE: a consumed count out of range: never write where it says
        if pos + total - consumed > self.size:
            return None
        self.next = pos + total
        return pos

    def write(self, pos: int, tensors: list[torch.Tensor]) -> None:
        """Copy `tensors` to `pos` (reserved for their sizes). Blocks for the copy."""
        at = self._offset + pos % self.size
        for t in tensors:
            flat = t.detach().reshape(-1).view(torch.uint8)
            self._seg.data[at:at + flat.numel()].copy_(flat)
            at += _aligned(flat.numel())

    def consumed(self) -> int:
        return _CONSUMED.unpack_from(self._seg.buffer, self._counter)[0]

    # ---- receiver ----
    def expect(self, sizes: list[int]) -> tuple[int, int]:
        """(position, bytes) the sender must have put the next frame of `sizes` at."""
        return self._start(sizes)

    def accept(self, pos: int, sizes: list[int], copy: bool) -> list:
        """The frame's buffers at `pos` (checked by schema.check_shm): fresh copies
        (`copy`, then released at once) or views of the ring, valid until `release`."""
        at, out = self._offset + pos % self.size, []
        for n in sizes:
            view = self._seg.data[at:at + n]
            out.append(memoryview((view.clone() if copy else view).numpy()))
            at += _aligned(n)
        self.next = self._held = pos + sum(_aligned(n) for n in sizes)
        if copy:
            self.release()
        return out

    def release(self) -> None:
        """Tell the sender every accepted frame's bytes may be reused (never blocks)."""
        if self._held:
            _CONSUMED.pack_into(self._seg.buffer, self._counter, self._held)
