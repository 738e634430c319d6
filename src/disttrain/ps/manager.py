"""The server manager: one process that owns the server group's membership and ring version.

Document 003's "server manager maintains and assigns server resources"; the PS paper's
server manager (Li et al., OSDI'14, sec. 4) and ps-lite's scheduler are its models. It
holds a `Membership` (membership.py) and answers, on the job's authenticated wire
(transport.py: a hello signed with the job secret, then a session with a MAC and a
sequence number on every frame, every op checked against schema.py), these requests:

- `register` (a launched server: index, address, fingerprint of model and policy, its
  keys with their replica chains), `report` (a server's heartbeat: its parameter version
  and push count; `final` when its job ended; a joiner's `heads`, the moved keys it heads
  now with their chains: join_status.py), answered by `ring`;
- `lookup` (a worker: the current ring), `join` and `leave` (membership changes, asked
  on the ring version the asker holds: compare and set), answered by `ring`;
- `status` (`disttrain ps status`), answered by `state`: servers, keys, load, events.

Every answer to a request that names an older ring version than the current one says
`stale` and carries the whole current ring, so every party moves through the versions in
order. A refused request gets `error` naming why and the fix. A server silent for longer
than `timeout` is marked dead (a new version, an event naming it, printed at once).

The manager binds loopback unless told otherwise (`ipc://` in a private folder, as the
servers do). Its state is written atomically to a JSON file on every version change; a
manager started again on that file (after SIGKILL, too) binds the same address and
answers with the same version and members; parties whose session it forgot say hello
again (manager_link.py). Pure Python over zmq, no torch work: `start` forks it from a
process that has imported disttrain already, so it is serving within milliseconds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time

import zmq

from disttrain.ps.frame import DEFAULT_LIMITS, Message
from disttrain.ps.join_status import check_rows, record_heads
from disttrain.ps.keys import encrypt_setting, job_secret, mac_setting
from disttrain.ps.membership import MANAGER_INDEX, Membership, Refused
from disttrain.ps.membership_file import from_json, save
from disttrain.ps.transport import ServerEndpoint, bind, remove_folder

__all__ = ["ManagerEndpoint", "serve_manager", "start", "Running"]

_TICK_MS = 100  # how often the loop looks at heartbeats and its parent


class ManagerEndpoint(ServerEndpoint):
    """The manager's ROUTER: the transport's server end, receiving the manager's ops."""

    side = "manager"

    def __init__(self, sock: zmq.Socket, secret: bytes):
        super().__init__(sock, secret, MANAGER_INDEX, [], DEFAULT_LIMITS, encrypt_setting(),
                         mac_setting(), shm=False)
        self.workers = range(2**31)  # NOTE: any party id may greet; the job secret is the gate


def _bind(sock: zmq.Socket, host: str, address: str | None) -> tuple[str, str | None]:
    """Bind a fresh address on `host`, or `address` again (a restarted manager)."""
    if address is None:
        return bind(sock, host)
    if address.startswith("ipc://"):
        folder = os.path.dirname(address.removeprefix("ipc://"))
        os.makedirs(folder, mode=0o700, exist_ok=True)  # NOTE: this user only, as bind's
        sock.bind(address)
        return address, folder
    sock.bind(address)
    return address, None


def _load(state: str, now: float) -> tuple[Membership, str | None]:
    if not os.path.exists(state):
        return Membership(), None
    with open(state) as f:
        text = f.read()
    return from_json(text, now), json.loads(text).get("address")


def _answer(members: Membership, msg: Message, now: float, rejected: dict) -> Message:
    """The reply to one request (never blocks); Refused becomes an `error`. rejected: the
    frames refused so far, by reason (the status shows them)."""
    m, held = msg.meta, msg.meta.get("ring", members.version)
    try:
        if msg.op == "hello":
            return Message("welcome", {"version": members.version})
        if msg.op == "status":
            return Message("state", {
                "version": members.version, "expected": members.expected,
                "servers": [x.row(members.fingerprint, now)
                            for _, x in sorted(members.members.items())],
                "shard": [{"key": k, "bytes": n, "chain": c, "server": x.server}
                          for _, x in sorted(members.members.items()) for k, n, c in x.shard],
                "events": members.events[-50:], "rejected": dict(rejected)})
        if msg.op == "register":
            members.register(m["server"], m["address"], m["fingerprint"], m["expected"],
                             [[r["key"], r["bytes"], r["chain"]] for r in m["shard"]], now,
                             m["attempt"], m["pid"])
        elif msg.op == "report":
            members.beat(m["server"], m["version"], m["pushes"], bool(m["final"]), now,
                         m["accepting"], bool(m["drained"]))
            check_rows(members, m["server"], m.get("adopted") or [], m.get("copied") or [])
            members.adopt(m["server"], m.get("adopted") or [], now)
            members.recopied(m["server"], m.get("copied") or [])
            record_heads(members, m["server"], m.get("heads") or [])  # NOTE: after `adopted`
        elif msg.op == "join":
            members.join(m["server"], m["address"], m["fingerprint"], held, now)
        elif msg.op == "leave":
            members.leave(m["server"], held)
    except Refused as e:
        return Message("error", {"message": f"server manager refused {msg.op}: {e}"})
    return Message("ring", {"version": members.version, "expected": members.expected,
                            "complete": int(members.complete()), "stale": int(held < members.version),
                            "servers": members.ring_rows(), "takeovers": members.takeovers,
                            "accepting": members.accepting(), "copies": members.copies})


def serve_manager(state: str, *, host: str = "127.0.0.1", timeout: float = 10.0,
                  ready=None, stop: threading.Event | None = None, parent: int | None = None,
                  secret: bytes | None = None) -> Membership:
    """Serve the manager on `state` (a JSON file, created or reloaded) until `stop` is set,
    SIGTERM (main thread only) or the process `parent` is gone; blocks; returns the state.

    ready: called with the bound address once requests are answered. timeout: seconds
    without a heartbeat after which a server is marked dead. Prints each event.
    """
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    members, address = _load(state, time.monotonic())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, DEFAULT_LIMITS.max_frame_bytes)
    address, folder = _bind(sock, host, address)
    ep = ManagerEndpoint(sock, secret or job_secret())
    save(members, state, {"address": address})
    _say(f"ring version {members.version} ({len(members.members)} servers) at {address}, "
         f"state in {state}; `disttrain ps status {address}` shows it")
    if ready is not None:
        ready(address)
    try:
        while not stop.is_set() and (parent is None or os.getppid() == parent):
            if sock.poll(_TICK_MS):
                _take(members, ep, sock, state, address)
            for event in members.expire(time.monotonic(), timeout, _gone, min(timeout, 2.0)):
                _say(event)
                save(members, state, {"address": address})
    finally:
        save(members, state, {"address": address})
        _say(f"stopped at ring version {members.version}: " + (", ".join(
            f"server {i} {m.state}" for i, m in sorted(members.members.items())) or "no servers"))
        ep.close()
        ctx.term()
        remove_folder(folder)  # NOTE: a clean stop only; after SIGKILL a restart binds it again
    return members


def _take(members: Membership, ep: ManagerEndpoint, sock, state: str, address: str) -> None:
    """Answer every frame that is ready (does not block); save the state on a change."""
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        got = ep.recv()
        if got is None:
            continue
        session, msg = got
        before, events = members.version, len(members.events)
        reply = _answer(members, msg, time.monotonic(), ep.rejected)
        for event in members.events[events:]:
            _say(event)
        if reply.op == "error":
            _say(reply.meta["message"])
        if members.version != before or len(members.events) != events:
            save(members, state, {"address": address})
        ep.send(session, reply)


def _gone(m) -> bool:
    """Is server `m`'s process gone? Known only for one on this host (an ipc address)."""
    if not m.pid or not m.address.startswith("ipc://"):
        return False
    try:
        with open(f"/proc/{m.pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")  # NOTE: a zombie is gone
    except (OSError, IndexError):
        return True


def _say(text: str) -> None:
    print(f"[ps manager] {text}", file=sys.stderr, flush=True)


class Running:
    """A manager process `start` forked: its `address`, `pid`, `stop()`."""

    def __init__(self, process, address: str, state: str):
        self.process, self.address, self.state = process, address, state

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, wait: float = 5.0) -> None:
        """SIGTERM it and wait up to `wait` seconds (then SIGKILL)."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(wait)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _child(conn, state: str, host: str, timeout: float, parent: int, secret) -> None:
    # NOTE: Ctrl-C reaches the whole process group; the parent stops this process itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready = []
    try:
        serve_manager(state, host=host, timeout=timeout, parent=parent, secret=secret,
                      ready=lambda address: (ready.append(address), conn.send(address)))
    except Exception as e:
        if ready:
            raise
        conn.send(f"error: {type(e).__name__}: {e}")  # NOTE: the parent raises it


def start(state: str, *, host: str = "127.0.0.1", timeout: float = 10.0,
          wait: float = 30.0, secret: bytes | None = None) -> Running:
    """Fork a manager process serving `state`; blocks until it answers (at most `wait` s).

    NOTE: fork, not spawn: the child reuses this process's imports and starts at once. Call
    it before this process starts threads that hold locks (e.g. before the launcher's agent).
    The child exits when this process is gone.
    """
    recv, send = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=(send, state, host, timeout, os.getpid(), secret), daemon=False)
    proc.start()
    send.close()
    if not recv.poll(wait):
        proc.kill()
        raise RuntimeError(f"the parameter-server manager did not start within {wait:g} s "
                           f"(state {state})")
    got = recv.recv()
    if got.startswith("error:"):
        proc.join(5)
        raise RuntimeError(f"the parameter-server manager failed to start: {got[7:]}")
    return Running(proc, got, state)
