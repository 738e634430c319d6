"""Sessions of the parameter-server wire: handshake, per-session keys, a MAC per frame,
sequence numbers. The cryptography is OpenSSL's, through the `cryptography` package.

A frame is `[envelope, header, buffer_0, ...]` (header and buffers: frame.py); the
64-byte envelope holds kind, flags, the worker's and the server's nonces, the sequence
number and the tag. A `hello` is signed HMAC-SHA256 under a key derived from the job
secret; every later frame gets an AES-GCM tag (GMAC: all parts as associated data; with
DISTTRAIN_PS_ENCRYPT=1 the buffers encrypted) under its session's key for its direction,
HKDF-SHA256(secret, both nonces, worker, server), with the GCM nonce = direction | seq.
A receiver accepts frame n of a direction only after n-1. Between two processes of one
user on a Unix socket the buffers may be left out of the tag (flag PLAIN; who may do it
and why: transport.py), never the envelope, the part lengths or the header.

Who talks to whom: transport.py seals and opens every frame through a `Session` (one per
worker and server). The exact layout, what is authenticated, how keys and nonces are made
and why a GCM nonce never repeats under one key: docs/design/parameter-server.md, "Wire
and security".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from disttrain.ps.frame import (
    DEFAULT_LIMITS,
    PROTOCOL,
    FrameError,
    Limits,
    Message,
    build,
    check_sizes,
    pack,
    read_header,
    unpack,
)

__all__ = ["Session", "Envelope", "read_envelope", "seal_hello", "seal_hello_parts",
           "open_hello", "hello_key", "new_nonce", "ENVELOPE_BYTES"]

_HEAD = struct.Struct("<BB6x16s16sQ")  # kind, flags, nonce_w, nonce_s, seq: 48 bytes
TAG_BYTES = 16
ENVELOPE_BYTES = _HEAD.size + TAG_BYTES
HELLO, SESSION = 0, 1
ENCRYPTED = 1
PLAIN = 2  # the buffers are not authenticated (same-user Unix socket: transport.py)
SHM = 4  # with PLAIN: the tensors are in the session's shared-memory segment (shm.py)
W2S, S2W = 0, 1
_ZERO_NONCE = bytes(16)
_JOIN_BELOW = 64 << 10  # frames this small are tagged in one call (_gmac)


def new_nonce() -> bytes:
    """16 random bytes from the OS (never a counter, never reused)."""
    return os.urandom(16)


def hello_key(secret: bytes) -> bytes:
    """The key that signs hello frames (and a server's refusal of one), from the job secret.

    NOTE: frozen, as is the hello's layout: it is what every protocol version shares, so
    a peer of another version is heard and told so (its label keeps the "/2" of the
    version that introduced it); the session keys carry frame.PROTOCOL instead."""
    return HKDF(hashes.SHA256(), 32, None, b"disttrain-ps/2 hello").derive(secret)


class Envelope:
    """The parsed first part of a frame (not yet authenticated)."""

    __slots__ = ("kind", "flags", "nonce_w", "nonce_s", "seq", "tag")

    def __init__(self, kind, flags, nonce_w, nonce_s, seq, tag=b""):
        self.kind, self.flags, self.nonce_w, self.nonce_s = kind, flags, nonce_w, nonce_s
        self.seq, self.tag = seq, tag


def read_envelope(parts: list, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """Size checks (frame.check_sizes) and the envelope's fields; raises FrameError."""
    check_sizes(parts, limits, ENVELOPE_BYTES)
    raw = bytes(parts[0])
    kind, flags, nw, ns, seq = _HEAD.unpack_from(raw)
    if (kind not in (HELLO, SESSION) or flags & ~(ENCRYPTED | PLAIN | SHM)
            or flags & ENCRYPTED and flags & (PLAIN | SHM) or flags & SHM and not flags & PLAIN):
        raise FrameError(f"bad envelope: kind {kind}, flags {flags}")
    return Envelope(kind, flags, nw, ns, seq, raw[_HEAD.size:])


def _lengths(parts: list) -> bytes:
    return struct.pack(f"<I{len(parts)}Q", len(parts), *(len(p) for p in parts))


def seal_hello(key: bytes, nonce_w: bytes, msg: Message) -> list:
    """A hello frame signed with hello_key(secret)."""
    return seal_hello_parts(key, nonce_w, *pack(msg))


def seal_hello_parts(key: bytes, nonce_w: bytes, header: bytes, buffers: list) -> list:
    """A hello frame of a packed header and buffers, signed with hello_key(secret)."""
    head = _HEAD.pack(HELLO, 0, nonce_w, _ZERO_NONCE, 0)
    return [head + _hello_tag(key, head, header, buffers), header, *buffers]


def _hello_tag(key: bytes, head: bytes, header, buffers) -> bytes:
    h = hmac.new(key, head, hashlib.sha256)
    h.update(_lengths([header, *buffers]))
    h.update(header)
    for b in buffers:
        h.update(b)
    return h.digest()[:TAG_BYTES]


def open_hello(key: bytes, env: Envelope, parts: list, op: str = "hello") -> Message:
    """Check a hello's tag and parse it (op "error": a server's refusal of a hello, signed
    the same way); raises FrameError."""
    if env.kind != HELLO or env.nonce_s != _ZERO_NONCE or env.seq != 0 or env.flags:
        raise FrameError("bad envelope: not a hello")
    head = bytes(parts[0])[:_HEAD.size]
    if not hmac.compare_digest(env.tag, _hello_tag(key, head, parts[1], parts[2:])):
        raise FrameError("bad MAC: hello not signed with this job's DISTTRAIN_SECRET")
    msg = unpack(parts[1], parts[2:])
    if msg.op != op:
        raise FrameError(f"bad header: {msg.op!r} frame signed as a {op}")
    return msg


class Session:
    """One worker<->server session: its keys and both directions' sequence numbers.

    `side` is "worker" or "server"; `seal` numbers and authenticates outgoing frames,
    `open` accepts only the next frame of the other direction. With `plain_out` set
    (transport.py decides: a same-user Unix socket whose peer accepts it) the buffers of
    outgoing frames are left out of the tag and the PLAIN flag says so; the envelope, the
    part lengths and the header stay authenticated. Not thread-safe: one session is used
    from one thread (the server loop, the worker's comm thread).
    """

    def __init__(self, secret: bytes, nonce_w: bytes, nonce_s: bytes, worker: int,
                 server: int, side: str, encrypt: bool = False):
        info = b"disttrain-ps/%d session" % PROTOCOL + struct.pack("<QQ", worker, server)
        keys = HKDF(hashes.SHA256(), 64, nonce_w + nonce_s, info).derive(secret)
        mine, theirs = (W2S, S2W) if side == "worker" else (S2W, W2S)
        self._key = {W2S: keys[:32], S2W: keys[32:]}
        self._aead = {d: AESGCM(k) for d, k in self._key.items()}
        self._out, self._in = mine, theirs
        self.nonce_w, self.nonce_s, self.worker, self.server = nonce_w, nonce_s, worker, server
        self.flags = ENCRYPTED if encrypt else 0
        self.send_seq = self.recv_seq = 0
        self.plain_out = False  # send buffers without a MAC (never with encrypt)
        self.peer_local = False  # the peer is this user on a Unix socket (server side)
        self.ident: bytes | None = None  # the server's ROUTER identity of this connection
        self.shm = None  # shm.Segment: tensors of both directions go through it (transport.py)
        self.gone = None  # the answer to its every frame once its keys moved (join_head.py)

    def _cipher(self, direction: int, seq: int, tag: bytes | None = None):
        iv = struct.pack("<IQ", direction, seq)
        mode = modes.GCM(iv) if tag is None else modes.GCM(iv, tag)
        c = Cipher(algorithms.AES(self._key[direction]), mode)
        return c.encryptor() if tag is None else c.decryptor()

    def seal(self, msg: Message) -> list:
        """Message -> parts of this session's next outgoing frame (seq advances)."""
        return self.seal_parts(*pack(msg))

    def seal_parts(self, header: bytes, buffers: list, shm: bool = False) -> list:
        """Authenticate (and maybe encrypt) a packed header and buffers as the next frame;
        `shm`: the tensors the header declares were written to the segment (no buffers)."""
        if shm and not (self.plain_out and not buffers and not self.flags & ENCRYPTED):
            raise ValueError("a segment frame needs plain_out, no buffers, no encryption")
        seq, self.send_seq = self.send_seq, self.send_seq + 1
        plain = bool(self.plain_out and buffers and not self.flags & ENCRYPTED)
        flags = self.flags | (PLAIN if plain else 0) | (PLAIN | SHM if shm else 0)
        head = _HEAD.pack(SESSION, flags, self.nonce_w, self.nonce_s, seq)
        covered = [head + _lengths([header, *buffers]), header]
        if not self.flags & ENCRYPTED:  # NOTE: PLAIN: buffers out of the tag, lengths in it
            tag = self._gmac(self._out, seq, covered if plain else covered + list(buffers))
            return [head + tag, header, *buffers]
        enc = self._cipher(self._out, seq)
        for part in covered:
            enc.authenticate_additional_data(part)
        out = [bytearray(len(b)) for b in buffers]
        for b, o in zip(buffers, out):
            enc.update_into(b, o)
        enc.finalize()
        return [head + enc.tag, header, *out]

    def _gmac(self, direction: int, seq: int, parts: list) -> bytes:
        """AES-GCM's tag with `parts` as associated data and no plaintext (GMAC). Small
        frames are joined and tagged in one call (no per-frame cipher set-up); big
        buffers are fed in place, never joined. Both give the same tag."""
        iv = struct.pack("<IQ", direction, seq)
        if sum(len(p) for p in parts) <= _JOIN_BELOW:
            return self._aead[direction].encrypt(iv, b"", b"".join(parts))
        enc = Cipher(algorithms.AES(self._key[direction]), modes.GCM(iv)).encryptor()
        for part in parts:
            enc.authenticate_additional_data(part)
        enc.finalize()
        return enc.tag

    def open(self, env: Envelope, parts: list, plain_ok: bool = False,
             take=None) -> Message:
        """Authenticate the next incoming frame and parse it; raises FrameError.

        The caller has matched env's nonces to this session. The tag is checked before
        the sequence number and before anything is parsed; plaintext (encrypted mode)
        is used only after the tag verified. A PLAIN frame (buffers not in the tag) is
        refused unless `plain_ok` (transport.py: this frame came from a process of this
        user over a Unix socket). A SHM frame's tensors are in the segment: `take(header)`
        (transport.py) checks where the header says they are and returns their buffers;
        without `take` (no segment) it is refused.
        """
        if env.kind != SESSION or env.flags & ENCRYPTED != self.flags:
            raise FrameError(f"encryption mismatch: frame flags {env.flags}, this job's "
                             f"{self.flags} (set DISTTRAIN_PS_ENCRYPT alike on every rank)")
        plain = bool(env.flags & PLAIN)
        if plain and not plain_ok:
            raise FrameError("unauthenticated payload: a frame without a MAC over its "
                             "buffers from a peer that is not this user on a Unix socket")
        header, buffers = parts[1], parts[2:]
        covered = [bytes(parts[0])[:_HEAD.size] + _lengths(parts[1:]), header]
        if not self.flags & ENCRYPTED:
            tag = self._gmac(self._in, env.seq, covered if plain else covered + list(buffers))
            if not hmac.compare_digest(tag, env.tag):
                raise FrameError("bad MAC: frame not signed with this session's key")
        else:
            buffers = self._decrypt(env, covered, buffers)
        if env.seq != self.recv_seq:
            raise FrameError(f"replayed or reordered: frame {env.seq}, expected "
                             f"{self.recv_seq}")
        self.recv_seq += 1
        if env.flags & SHM:
            if take is None or buffers:
                raise FrameError("no segment: a frame with its tensors in shared memory on "
                                 "a session that has none, or with buffers too")
            h = read_header(header)
            return build(h, take(h))
        return unpack(header, buffers)

    def _decrypt(self, env: Envelope, covered: list, buffers: list) -> list:
        """The plaintext of an encrypted frame's buffers once its tag verified."""
        dec = self._cipher(self._in, env.seq, env.tag)
        for part in covered:
            dec.authenticate_additional_data(part)
        out = [bytearray(len(b)) for b in buffers]
        for b, o in zip(buffers, out):
            dec.update_into(b, o)
        try:
            dec.finalize()
        except InvalidTag:
            raise FrameError("bad MAC: frame not signed with this session's key") from None
        return out
