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
"Threat model". On such a connection the tensors skip the socket too (unless
DISTTRAIN_PS_SHM=0): the worker offers a shared-memory segment in its hello (shm.py),
the server maps it by the pid the kernel reports for the connection and says so in its
welcome, and from then on both directions write tensors there and send only the
authenticated header. What both ends do alike (seal, open, count): endpoint.py.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter, OrderedDict

import zmq

from disttrain import settings
from disttrain.ps.endpoint import Endpoint, peer_pid, peer_uid
from disttrain.ps.frame import DEFAULT_LIMITS, PROTOCOL, FrameError, Limits, Message
from disttrain.ps.keys import encrypt_setting, job_secret, mac_setting, shm_setting
from disttrain.ps.schema import SchemaError, VersionError, check, check_protocol
from disttrain.ps.session import (
    HELLO,
    Session,
    hello_key,
    new_nonce,
    open_hello,
    read_envelope,
    seal_hello,
)
from disttrain.ps.shm import Segment

__all__ = ["ServerEndpoint", "WorkerLink", "job_secret", "encrypt_setting", "mac_setting",
           "shm_setting", "peer_uid", "peer_pid", "bind", "remove_folder"]

_MAX_PENDING = 64  # sessions greeted but not yet used; older ones are forgotten
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind(sock: zmq.Socket, host: str) -> tuple[str, str | None]:
    """Bind `sock`; returns (address to publish, folder to remove at close or None).

    Loopback hosts get `ipc://` in a new private folder (unless DISTTRAIN_PS_IPC=0 or
    ZeroMQ lacks ipc); any other host gets TCP on a random port.
    """
    if host in _LOOPBACK and settings.current().ps_ipc and zmq.has("ipc"):
        # NOTE: mode 0700: this user only; under `disttrain run` in its scratch folder, which
        # the launcher removes even when this process is killed before remove_folder
        folder = tempfile.mkdtemp(prefix="disttrain-ps-", dir=settings.current().scratch)
        address = f"ipc://{folder}/server.sock"
        sock.bind(address)
        return address, folder
    port = sock.bind_to_random_port(f"tcp://{host}")
    if host in ("0.0.0.0", "*"):
        import socket
        host = socket.gethostname()
    return f"tcp://{host}:{port}", None


class ServerEndpoint(Endpoint):
    """A server's ROUTER: greets workers, keeps one live session per worker."""

    side = "server"  # whose ops it receives (schema.py); the server manager's: "manager"

    def __init__(self, sock: zmq.Socket, secret: bytes, index: int, workers: list[int],
                 limits: Limits = DEFAULT_LIMITS, encrypt: bool = False, always_mac: bool = False,
                 shm: bool = True):
        super().__init__(sock, secret, limits, encrypt, always_mac)
        self.index, self.workers = index, set(workers)
        self.shm_ok = shm and self.plain_ok  # map a worker's segment when it offers one
        self.unmapped: Counter[str] = Counter()  # segments offered but not mapped, by reason
        self._hello_key = hello_key(secret)
        self.active: dict[int, Session] = {}  # worker -> its live session
        self._by_ident: dict[bytes, Session] = {}
        self._pending: OrderedDict[bytes, Session] = OrderedDict()
        self._seen: set[bytes] = set()  # every nonce_w greeted

    def send(self, to: Session, msg: Message, track: bool = False):
        """Queue `msg` on session `to` (does not block); a tracker if `track` and big."""
        if msg.op == "welcome":  # NOTE: tells the worker whether it may skip the buffers' MAC
            msg.meta.update(plain=int(to.peer_local), mapped=int(to.shm is not None))
        parts, in_shm = self._seal(to, msg)
        return self._put([to.ident], parts, msg.op, track, in_shm)

    def sessions(self) -> list[Session]:
        """Every session this endpoint knows: live, greeted but unused, by identity; once each."""
        every = [*self.active.values(), *self._by_ident.values(), *self._pending.values()]
        return list({id(s): s for s in every}.values())

    def close(self) -> None:
        """Close the socket and unmap every session's segment (never blocks)."""
        for s in [*self.active.values(), *self._by_ident.values(), *self._pending.values()]:
            if s.shm is not None:
                s.shm.close()
        self.sock.close()

    def recv(self) -> tuple[Session, Message] | None:
        """One ready frame (blocks until one arrives) -> (its session, message); None when
        it was dropped (counted in `rejected`)."""
        frames = self.sock.recv_multipart(copy=False)
        ident, parts = frames[0].bytes, [f.buffer for f in frames[1:]]
        s = env = None
        try:
            env = read_envelope(parts, self.limits)
            if env.kind == HELLO:
                s, msg = self._greet(ident, env, parts, frames[-1])
            else:
                s = self._session(ident, env)
                msg = self._open(s, env, parts, frames[-1], copy=True)
                self._check(env, msg, self.side)
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
        self._count("recv", msg.op, parts, self._shm_bytes if env.kind != HELLO else 0)
        return s, msg

    def _greet(self, ident: bytes, env, parts, frame: zmq.Frame) -> tuple[Session, Message]:
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
        local = self._local(frame)
        s.ident, s.peer_local = ident, local
        s.plain_out = local and msg.meta["plain"] == 1
        if s.plain_out and self.shm_ok and msg.meta["shm_fd"] >= 0:
            s.shm = self._attach(frame, msg.meta["shm_fd"], msg.meta["shm_bytes"])
        self._forget(self._pending.pop(ident, None))
        self._pending[ident] = s
        while len(self._pending) > _MAX_PENDING:
            self._forget(self._pending.popitem(last=False)[1])
        return s, msg

    def _attach(self, frame: zmq.Frame, fd: int, ring_bytes: int) -> Segment | None:
        """Map the segment the worker at the other end of `frame`'s connection offered
        (its pid from the kernel: SO_PEERCRED); None (counted in `unmapped`) when that
        fails: the session then carries its tensors on the socket."""
        pid = peer_pid(frame)
        try:
            if not pid or ring_bytes > self.limits.max_tensor_bytes:
                raise ValueError(f"no peer pid ({pid}) or a ring of {ring_bytes} bytes")
            return Segment.attach(pid, fd, ring_bytes)
        except (OSError, ValueError) as e:
            self.unmapped[type(e).__name__] += 1
            return None

    @staticmethod
    def _forget(s: Session | None) -> None:
        if s is not None and s.shm is not None:
            s.shm.close()

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
            self._forget(old)
        self.active[s.worker] = s
        self._by_ident[s.ident] = s


class WorkerLink(Endpoint):
    """A worker's DEALER to one server and its session (after `hello` got `welcome`)."""

    def __init__(self, sock: zmq.Socket, secret: bytes, worker: int, server: int,
                 limits: Limits = DEFAULT_LIMITS, encrypt: bool = False, always_mac: bool = False,
                 shm_bytes: int = 0):
        super().__init__(sock, secret, limits, encrypt, always_mac)
        self.worker, self.server = worker, server
        self.session: Session | None = None
        self._nonce_w: bytes | None = None
        self.shm_bytes = shm_bytes if self.plain_ok else 0  # 0: no shared-memory segment
        self._segment: Segment | None = None  # offered in the last hello

    def close(self) -> None:
        """Close the socket and unmap the segment (never blocks)."""
        self._drop_segment()
        self.sock.close(linger=0)

    def release(self) -> None:
        """The last message's tensors (views of the segment) are no longer used: the
        server may write there again. Call it after acting on each message."""
        if self.session is not None and self.session.shm is not None:
            self.session.shm.into.release()

    def _drop_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def send(self, msg: Message) -> list:
        """Queue `msg` (does not block); returns the parts sent. A hello starts a new
        session (a fresh nonce); every other op needs the session its welcome opened."""
        msg.meta["worker"] = self.worker
        if msg.op == "hello":
            self._nonce_w, self.session = new_nonce(), None
            # NOTE: plain is checked per frame on receipt
            msg.meta.update(server=self.server, protocol=PROTOCOL, plain=int(self.plain_ok))
            self._drop_segment()  # NOTE: a segment serves one session
            self._segment = Segment.create(self.shm_bytes) if self.shm_bytes else None
            if self._segment is not None:
                msg.meta.update(shm_fd=self._segment.fd, shm_bytes=self.shm_bytes)
            parts, in_shm = seal_hello(hello_key(self.secret), self._nonce_w, msg), 0
        elif self.session is None:
            raise RuntimeError(f"worker {self.worker}: no session with server {self.server} "
                               "yet; send hello and wait for welcome first")
        else:
            parts, in_shm = self._seal(self.session, msg)
        self._put([], parts, msg.op, extra=in_shm)
        return parts

    def recv(self) -> Message | None:
        """One ready message (blocks until one arrives); None if it was dropped (counted).

        Raises SchemaError (counted) for an authenticated reply that breaks its op's
        schema: the server is broken or of another version; the worker cannot go on."""
        self.release()
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
            msg = self._open(s, env, parts, frames[-1], copy=False)
            # NOTE: a refused hello is answered with an error on the new session: the
            # server's explanation (e.g. other keys) must reach the user, not a timeout
            if self.session is None and msg.op not in ("welcome", "error"):
                raise FrameError(f"bad header: {msg.op!r} before welcome")
            self._check(env, msg, "worker")
            if msg.op == "welcome":
                s.plain_out = local and msg.meta["plain"] == 1
                if s.plain_out and msg.meta["mapped"] == 1 and self._segment is not None:
                    s.shm = self._segment  # NOTE: the server mapped it: both directions use it
                    s.shm.forget_fd()
                else:
                    self._drop_segment()
            self.session = s
        except FrameError as e:
            self._reject(e)
            if isinstance(e, SchemaError):
                raise
            return None
        self._count("recv", msg.op, parts, self._shm_bytes)
        return msg


def remove_folder(folder: str | None) -> None:
    """Remove the ipc folder `bind` made (nothing if None)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
