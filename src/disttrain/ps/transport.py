"""The parameter-server wire: ZeroMQ sockets that speak authenticated, sequenced sessions.

Servers own a ROUTER socket (`ServerEndpoint`), bound to 127.0.0.1 unless a host is
given; a server bound to loopback listens on a Unix socket (ZeroMQ `ipc://`, in a fresh
0700 folder) instead, faster than TCP loopback here (docs/benchmarks.md). Each worker
owns one DEALER per server (`WorkerLink`). Frames and sessions are session.py, message
layout is frame.py.

Handshake: the worker sends `hello` (fresh nonce_w, signed under the job secret), the
server answers `welcome` as frame 0 of a new session, which replaces the worker's old
session only once a frame that needs the new key arrives on it: a replayed hello never
takes a worker over. A frame that fails any check is dropped and counted by reason
(`rejected`), so one bad peer never stops a server. An authenticated frame is then
checked against its op's schema (schema.py) before anyone reads it; a server answers a
frame that fails with an `error` naming op and field (a hello of another protocol
version or a malformed hello: a refusal signed like a hello, the one frame every
version can read). Sockets are used from one thread only (the server loop or the
worker's communication thread).

Same-user Unix sockets: a frame's buffers (the tensors) go without a MAC when the
connection is `ipc://` and the peer process runs as this user, read from the kernel
(SO_PEERCRED, which ZeroMQ reports in every message's "Peer-Address" as
`host:uid:gid:pid`), both ends allow it (`DISTTRAIN_PS_MAC=always` or
DISTTRAIN_PS_ENCRYPT=1 forbid it) and the peer said so in its hello or welcome. The
receiver checks the uid again on every such frame. The envelope, the part lengths and
the header (op, worker, clock, version, keys, shapes) stay authenticated and sequenced.
Why that protects as much as a MAC would there: docs/design/parameter-server.md,
"Threat model".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter, OrderedDict

import zmq

from disttrain import settings
from disttrain.ps.frame import DEFAULT_LIMITS, PROTOCOL, FrameError, Limits, Message
from disttrain.ps.schema import SchemaError, VersionError, check, check_protocol
from disttrain.ps.session import (
    HELLO,
    PLAIN,
    Session,
    hello_key,
    new_nonce,
    open_hello,
    read_envelope,
    seal_hello,
)

__all__ = ["ServerEndpoint", "WorkerLink", "job_secret", "encrypt_setting", "mac_setting",
           "peer_uid", "bind", "remove_folder"]

_COPY_BELOW = 64 << 10  # smaller buffers are copied: cheaper than zero-copy bookkeeping
_MAX_PENDING = 64  # sessions greeted but not yet used; older ones are forgotten
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def job_secret() -> bytes:
    """The per-job key from DISTTRAIN_SECRET (hex), which `disttrain run` generates."""
    raw = settings.current().secret
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


def encrypt_setting() -> bool:
    """DISTTRAIN_PS_ENCRYPT=1: AES-GCM over the buffers too (authentication is always on)."""
    return settings.current().ps_encrypt


def mac_setting() -> bool:
    """True when DISTTRAIN_PS_MAC=always: authenticate every byte even between processes of
    one user on a Unix socket (default `auto`: tensor buffers go without a MAC there)."""
    return settings.current().ps_mac_always


def peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process at the other end of the ipc:// connection `frame` came on:
    the kernel's SO_PEERCRED, which ZeroMQ appends to the message's Peer-Address
    (`host:uid:gid:pid`). None when there is none (call it for ipc:// connections only:
    an IPv6 TCP address has colons too)."""
    try:
        fields = frame.get("Peer-Address").rsplit(":", 3)
    except (zmq.ZMQError, AttributeError):
        return None
    return int(fields[1]) if len(fields) == 4 and fields[1].isdigit() else None


def bind(sock: zmq.Socket, host: str) -> tuple[str, str | None]:
    """Bind `sock`; returns (address to publish, folder to remove at close or None).

    Loopback hosts get `ipc://` in a new private folder (unless DISTTRAIN_PS_IPC=0 or
    ZeroMQ lacks ipc); any other host gets TCP on a random port.
    """
    if host in _LOOPBACK and settings.current().ps_ipc and zmq.has("ipc"):
        folder = tempfile.mkdtemp(prefix="disttrain-ps-")  # NOTE: mode 0700: this user only
        address = f"ipc://{folder}/server.sock"
        sock.bind(address)
        return address, folder
    port = sock.bind_to_random_port(f"tcp://{host}")
    if host in ("0.0.0.0", "*"):
        import socket
        host = socket.gethostname()
    return f"tcp://{host}:{port}", None


class _Counted:
    """Per-op byte and frame counters (plain dicts: another thread may copy them)."""

    def __init__(self, sock: zmq.Socket, secret: bytes, limits: Limits, encrypt: bool,
                 always_mac: bool):
        self.sock, self.secret, self.limits, self.encrypt = sock, secret, limits, encrypt
        ipc = sock.getsockopt(zmq.LAST_ENDPOINT).startswith(b"ipc://")
        self.plain_ok = ipc and not (encrypt or always_mac)  # buffers may skip the MAC
        self.rejected: Counter[str] = Counter()
        self.sent_bytes: dict[str, int] = {}
        self.sent_frames: dict[str, int] = {}
        self.recv_bytes: dict[str, int] = {}
        self.recv_frames: dict[str, int] = {}

    def _count(self, what: str, op: str, parts) -> None:
        nbytes, frames = getattr(self, what + "_bytes"), getattr(self, what + "_frames")
        nbytes[op] = nbytes.get(op, 0) + sum(len(p) for p in parts)
        frames[op] = frames.get(op, 0) + 1

    def _local(self, frame: zmq.Frame) -> bool:
        """May this received frame's buffers go without a MAC: this user on a Unix socket?"""
        return self.plain_ok and peer_uid(frame) == os.getuid()

    def _reject(self, e: FrameError) -> None:
        self.rejected[e.reason] += 1

    def _put(self, prefix: list, parts: list, op: str, track: bool = False):
        """Queue one frame; big ones go without a copy (leave their memory alone until
        sent: with `track`, the returned tracker's `done` says when)."""
        self._count("sent", op, parts)
        size = sum(len(p) for p in parts)
        if not (track and size >= _COPY_BELOW):
            return self.sock.send_multipart(prefix + parts, copy=size < _COPY_BELOW)
        # NOTE: send_multipart would track only the last part; track every part
        parts = prefix + parts
        last = len(parts) - 1
        return zmq.MessageTracker(*[self.sock.send(p, zmq.SNDMORE if i < last else 0,
                                                   copy=False, track=True)
                                    for i, p in enumerate(parts)])


class ServerEndpoint(_Counted):
    """A server's ROUTER: greets workers, keeps one live session per worker."""

    def __init__(self, sock: zmq.Socket, secret: bytes, index: int, workers: list[int],
                 limits: Limits = DEFAULT_LIMITS, encrypt: bool = False, always_mac: bool = False):
        super().__init__(sock, secret, limits, encrypt, always_mac)
        self.index, self.workers = index, set(workers)
        self._hello_key = hello_key(secret)
        self.active: dict[int, Session] = {}  # worker -> its live session
        self._by_ident: dict[bytes, Session] = {}
        self._pending: OrderedDict[bytes, Session] = OrderedDict()
        self._seen: set[bytes] = set()  # every nonce_w greeted

    def send(self, to: Session, msg: Message, track: bool = False):
        """Queue `msg` on session `to` (does not block); a tracker if `track` and big."""
        if msg.op == "welcome":  # NOTE: tells the worker whether it may skip the buffers' MAC
            msg.meta["plain"] = int(to.peer_local)
        return self._put([to.ident], to.seal(msg), msg.op, track)

    def recv(self) -> tuple[Session, Message] | None:
        """One ready frame (blocks until one arrives) -> (its session, message); None when
        it was dropped (counted in `rejected`)."""
        frames = self.sock.recv_multipart(copy=False)
        ident, parts = frames[0].bytes, [f.buffer for f in frames[1:]]
        s = env = None
        try:
            env = read_envelope(parts, self.limits)
            if env.kind == HELLO:
                s, msg = self._greet(ident, env, parts, self._local(frames[-1]))
            else:
                s = self._session(ident, env)
                msg = s.open(env, parts, bool(env.flags & PLAIN) and self._local(frames[-1]))
                check(msg, "server")
                if msg.meta["worker"] != s.worker:
                    raise FrameError(f"worker of another session: frame says "
                                     f"{msg.meta['worker']}, session is {s.worker}")
                if self._pending.get(ident) is s:
                    self._promote(s)
        except FrameError as e:
            self._reject(e)
            if isinstance(e, SchemaError):
                self._refuse(ident, env, s, e)
            return None
        self._count("recv", msg.op, parts)
        return s, msg

    def _greet(self, ident: bytes, env, parts, local: bool) -> tuple[Session, Message]:
        msg = open_hello(self._hello_key, env, parts)
        check_protocol(msg)
        check(msg, "server")
        w, index = msg.meta["worker"], msg.meta["server"]
        if index != self.index:
            raise FrameError(f"hello for another server: {index!r}, this is {self.index}")
        if w not in self.workers:
            raise FrameError(f"unknown worker: {w!r}")
        if env.nonce_w in self._seen:
            raise FrameError("replayed hello: its nonce was used before")
        self._seen.add(env.nonce_w)
        s = Session(self.secret, env.nonce_w, new_nonce(), w, self.index, "server", self.encrypt)
        s.ident, s.peer_local = ident, local
        s.plain_out = local and msg.meta["plain"] == 1
        self._pending[ident] = s
        while len(self._pending) > _MAX_PENDING:
            self._pending.popitem(last=False)
        return s, msg

    def _refuse(self, ident: bytes, env, s: Session | None, e: SchemaError) -> None:
        """Tell the sender of an authenticated frame `e` refused why (does not block): on
        its session, or for a hello (no session yet) in a frame signed like a hello."""
        text = e.answer(self.index) if isinstance(e, VersionError) else (
            f"server {self.index} refused a {e.op} frame from worker "
            f"{'?' if s is None else s.worker}: {e}")
        msg = Message("error", {"message": text, "protocol": PROTOCOL})
        if s is None:
            self._put([ident], seal_hello(self._hello_key, env.nonce_w, msg), "error")
        else:
            self.send(s, msg)

    def _session(self, ident: bytes, env) -> Session:
        have = [s for s in (self._by_ident.get(ident), self._pending.get(ident)) if s]
        for s in have:
            if (s.nonce_w, s.nonce_s) == (env.nonce_w, env.nonce_s):
                return s
        if have:
            raise FrameError("other session: frame's nonces belong to no session of this "
                             "connection")
        raise FrameError("no session: no hello on this connection")

    def _promote(self, s: Session) -> None:
        """`s` proved its key: it becomes its worker's session, the old one is closed."""
        del self._pending[s.ident]
        old = self.active.get(s.worker)
        if old is not None:
            self._by_ident.pop(old.ident, None)
        self.active[s.worker] = s
        self._by_ident[s.ident] = s


class WorkerLink(_Counted):
    """A worker's DEALER to one server and its session (after `hello` got `welcome`)."""

    def __init__(self, sock: zmq.Socket, secret: bytes, worker: int, server: int,
                 limits: Limits = DEFAULT_LIMITS, encrypt: bool = False, always_mac: bool = False):
        super().__init__(sock, secret, limits, encrypt, always_mac)
        self.worker, self.server = worker, server
        self.session: Session | None = None
        self._nonce_w: bytes | None = None

    def send(self, msg: Message) -> list:
        """Queue `msg` (does not block); returns the parts sent. A hello starts a new
        session (a fresh nonce); every other op needs the session its welcome opened."""
        msg.meta["worker"] = self.worker
        if msg.op == "hello":
            self._nonce_w, self.session = new_nonce(), None
            # NOTE: plain is checked per frame on receipt
            msg.meta.update(server=self.server, protocol=PROTOCOL, plain=int(self.plain_ok))
            parts = seal_hello(hello_key(self.secret), self._nonce_w, msg)
        elif self.session is None:
            raise RuntimeError(f"worker {self.worker}: no session with server {self.server} "
                               "yet; send hello and wait for welcome first")
        else:
            parts = self.session.seal(msg)
        self._put([], parts, msg.op)
        return parts

    def recv(self) -> Message | None:
        """One ready message (blocks until one arrives); None if it was dropped (counted).

        Raises SchemaError (counted) for an authenticated reply that breaks its op's
        schema: the server is broken or of another version; the worker cannot go on."""
        frames = self.sock.recv_multipart(copy=False)
        parts = [f.buffer for f in frames]
        try:
            env = read_envelope(parts, self.limits)
            if env.kind == HELLO:  # the server refused our hello (e.g. another version)
                if self.session is not None or env.nonce_w != self._nonce_w:
                    raise FrameError("other session: a refusal of another hello")
                msg = open_hello(hello_key(self.secret), env, parts, op="error")
                check(msg, "worker")
                self._count("recv", msg.op, parts)
                return msg
            s = self.session
            if s is None and self._nonce_w is not None and env.nonce_w == self._nonce_w:
                s = Session(self.secret, env.nonce_w, env.nonce_s, self.worker, self.server,
                            "worker", self.encrypt)
            if s is None or (s.nonce_w, s.nonce_s) != (env.nonce_w, env.nonce_s):
                raise FrameError("other session: frame's nonces are not this session's")
            local = self._local(frames[-1])
            msg = s.open(env, parts, bool(env.flags & PLAIN) and local)
            # NOTE: a refused hello is answered with an error on the new session: the
            # server's explanation (e.g. other keys) must reach the user, not a timeout
            if self.session is None and msg.op not in ("welcome", "error"):
                raise FrameError(f"bad header: {msg.op!r} before welcome")
            check(msg, "worker")
            if msg.op == "welcome":
                s.plain_out = local and msg.meta["plain"] == 1
            self.session = s
        except FrameError as e:
            self._reject(e)
            if isinstance(e, SchemaError):
                raise
            return None
        self._count("recv", msg.op, parts)
        return msg


def remove_folder(folder: str | None) -> None:
    """Remove the ipc folder `bind` made (nothing if None)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
