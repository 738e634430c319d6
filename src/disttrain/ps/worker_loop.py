"""A parameter-server worker's communication thread: the loop that owns its sockets.

`Worker` (worker.py) is the compute thread's API; it inherits this loop, which runs on
its own thread from `Worker.__init__` on. Each pass sends the commands the compute thread
queued (`fuse` merges a pull into the push frame it follows), reads every server's
replies into the model and the waiting handles, sends heartbeats, and fails the job
when a server stays silent, or beats but sends no awaited reply for `wait_limit` s. The state both halves share (versions, floors, the handles
waiting per server, the model's shard map) is set by `Worker.__init__`; reroute.py drives
the route methods when a server dies or drains. How both behave:
docs/design/parameter-server.md ("Notes from ps/worker.py").
"""

from __future__ import annotations

import queue
import time
from collections import Counter, defaultdict

import torch
import zmq

from disttrain.ps.frame import PROTOCOL, Message
from disttrain.ps.handle import Handle
from disttrain.ps.schema import SchemaError, check_keys
from disttrain.ps.server import PSError
from disttrain.ps.transport import WorkerLink

__all__ = ["WorkerLoop", "fuse", "WAIT"]

WAIT = 600.0
"""Seconds after which a reply a live server does not send fails the worker (unless
`wait` or DISTTRAIN_PS_WAIT says otherwise): torch's default collective timeout, beyond
every wait the servers' own fault handling may cause and above a worker's pause for a
checkpoint or an evaluation, which stalls the others' Sync pulls (docs/design/
parameter-server.md, "Faults")."""


def fuse(cmds: list) -> list:
    """Queued commands (server, message, handle or None, reply op) -> frames to send, in
    order, as (server, message, [(handle, reply op)]): a pull right behind a push's last
    frame to the same server rides on that frame (`meta.pull` = the pull's `have`; the
    server acts on it as on the pull frame that would have followed, and when it answers
    at once its first params frame carries the push's ack). Two frames less, and no
    small frame queued behind a big one: over TCP ZeroMQ delivered such a pull up to
    milliseconds after the push (docs/benchmarks.md). Never blocks."""
    out: list = []
    latest: dict[int, int] = {}  # server -> index in out of its latest frame
    for s, msg, handle, reply in cmds:
        prev = out[latest[s]] if s in latest else None
        if (msg.op == "pull" and prev is not None and prev[1].op == "push"
                and prev[1].meta.get("ack") and "pull" not in prev[1].meta):
            prev[1].meta["pull"] = msg.meta["have"]
            prev[2].append((handle, reply))
            continue
        latest[s] = len(out)
        out.append((s, msg, [] if handle is None else [(handle, reply)]))
    return out


_REPLIES = ("params", "ack", "held", "welcome", "bye")  # what a worker waits for


class WorkerLoop:
    """The communication thread of a `Worker` (worker.py), which subclasses it; it is not
    built alone. Runs `_run` on the worker's thread; the route methods are reroute.py's,
    called on that thread only."""

    def _open(self, s: int, addr: str, ring: int) -> WorkerLink:
        """A new link to server s at `addr` (or to a route of dead server s's keys)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_frame_bytes)
        sock.connect(addr)
        link = WorkerLink(sock, self._secret, self.rank, s, self._limits, self._encrypt,
                          self._always_mac, ring)
        self._eps.append(link)
        return link

    # ---- routes (reroute.py; communication thread only) -------------------------------
    def transmit(self, s: int, msg: Message, replies: list) -> None:
        """Send `msg` on route s; each (handle, reply op) waits for that reply from it."""
        self._eps[s].send(msg)
        if replies and not any(self._waiting[s].values()):
            self._answered[s] = time.monotonic()  # NOTE: a wait on s starts now
        if msg.op == "push" and msg.meta.get("ack"):
            self._asks[s]["push"] += 1  # NOTE: each asks for one held (if any), one ack
        for handle, reply in replies:
            self._waiting[s][reply].append(handle)

    def open_route(self, server: int, address: str, keys: list[str], replicas: int) -> int:
        """A new route to `address`, serving dead server `server`'s `keys`; says hello (the
        welcome is awaited like a reply); returns its index. Never blocks."""
        n = len(self._eps)
        self.addresses.append(address)
        self._version.append(-1)
        self._floor.append(-1)
        self._shards.append({k: self._shards[server][k] for k in keys})
        link = self._open(server, address, 0)  # NOTE: the route answers as server `server`
        self._poller.register(link.sock, zmq.POLLIN)
        self._waiting.append(defaultdict(list))
        self._heard.append(time.monotonic())
        self._answered.append(time.monotonic())
        hello = Handle(self._raise_if_failed, "takeover")
        hello.add()
        self.transmit(n, Message("hello", {"keys": keys, "policy": self.policy_repr,
                                           "replicas": replicas}), [(hello, "welcome")])
        return n

    def owed(self, s: int) -> dict[str, list[Handle]]:
        """Take every reply route s still owes (op -> the handles waiting for it, oldest
        first): a dead server's, to be asked of its routes again."""
        out, self._waiting[s] = dict(self._waiting[s]), defaultdict(list)
        return out

    def set_version(self, s: int, version: int) -> None:
        """The parameter version this worker holds from server s (a dead one: its routes')."""
        self._version[s] = version

    def held(self, s: int) -> int:
        """The parameter version this worker holds from route s (-1: none yet)."""
        return self._version[s]

    def _run(self) -> None:
        self._eps = []
        for s, addr in enumerate(self.addresses):
            self._open(s, addr, self._ring[s])
        eps = self._eps  # NOTE: grows when a dead server's keys get routes (reroute.py)
        poller = self._poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        for ep in eps:
            poller.register(ep.sock, zmq.POLLIN)
        waiting = self._waiting = [defaultdict(list) for _ in eps]
        self._asks: dict[int, Counter] = defaultdict(Counter)  # link -> push, held, ack
        heard = self._heard = [time.monotonic()] * len(eps)
        self._answered = [time.monotonic()] * len(eps)  # the last awaited reply of each
        self._said: dict[int, dict] = {}  # server -> its last pong (its open round)
        beat_every, next_beat = min(1.0, self.timeout / 4), 0.0
        self._beat_every = beat_every
        try:
            while self._loop_once(eps, poller, waiting, heard):
                if time.monotonic() >= next_beat:
                    for s, ep in enumerate(eps):
                        if ep.session is not None and s not in self.routes.routes:  # live
                            ep.send(Message("beat", {}))
                    next_beat = time.monotonic() + beat_every
        except Exception as e:  # noqa: BLE001 - surfaced to the compute thread
            self._error = self._error or PSError(f"communication thread failed: {e!r}")
        finally:
            for ep in eps:
                ep.close()
            self.routes.close()
            self._wake_in.close(linger=0)

    def _loop_once(self, eps, poller, waiting, heard) -> bool:
        events = dict(poller.poll(timeout=100))
        if self._wake_in in events:
            while self._wake_in.poll(0):
                self._wake_in.recv()
        cmds, stop = [], False
        while not stop:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            stop = cmd is None
            cmds += [] if stop else [cmd]
        for s, msg, replies in fuse(cmds):
            self.routes.send(s, msg, replies)
        if stop:
            return False
        for s, ep in enumerate(eps):
            while ep.sock in events and ep.sock.poll(0):
                try:
                    got = ep.recv()
                except SchemaError as e:  # counted in wire_stats()["rejected"]
                    self._fail(f"server {s} at {self.addresses[s]} sent a malformed reply, "
                               f"refused: {e} (a bug or another disttrain version there)")
                    continue
                if got is not None:
                    heard[s] = time.monotonic()
                    if got.op in _REPLIES:
                        self._answered[s] = heard[s]
                    self._on_reply(s, got, waiting[s])
                    ep.release()  # NOTE: after the params are copied into the model
        now = time.monotonic()
        for s, w in enumerate(waiting):
            # NOTE: a dead server's keys move on; a link it beats is looked up idle too: a
            # route counts a worker silent past its grace lost (Server.grace)
            if self._error is None and (any(w.values()) or eps[s].session is not None):
                text = self.routes.silent(s, now - heard[s], self._beat_every)
                if text:
                    self._fail(text)
                w = waiting[s]  # NOTE: a re-route took what s owed (`owed`): not waited on s
            if (any(w.values()) and not self._error and now - heard[s] < self.timeout
                    and now - self._answered[s] > self.wait_limit):
                self._fail(self._unanswered(s, w, now - self._answered[s]))
            patience = 2 if self.routes.on else 1  # NOTE: the manager's verdict comes first
            if any(w.values()) and now - heard[s] > self.timeout * patience and not self._error:
                # NOTE: a bad MAC before any session: the answer to our hello (same secret)
                unread = eps[s].session is None and eps[s].rejected.get("bad MAC")
                self._error = PSError(self._silence(s, now - heard[s], unread))
        return True

    def _silence(self, s: int, quiet: float, unread: bool) -> str:
        """The error of a worker that waited `quiet` s on server (or route) s and heard
        nothing: a route names whose keys it serves and why a live host's route is silent."""
        d, host = self.routes.hosts.get(s, (s, s))
        name = f"server {s}" if s == d else f"the route of server {d}'s keys on server {host}"
        return (f"{name} at {self.addresses[s]} silent for {quiet:.1f}s (timeout "
                f"{self.timeout}s)" + (
                    f"; its answer to the hello does not verify: it speaks another wire "
                    f"protocol (this worker {PROTOCOL}; older than 3 if it does not say)"
                    if unread else "") + (
                    "; a route ends once every worker is done or lost (silent past its "
                    "timeout; one timeout more before a worker's first frame): it may have "
                    "ended before this worker reached it" if s != d else ""))

    def _unanswered(self, s: int, waiting: dict[str, list[Handle]], quiet: float) -> str:
        """The error of a worker whose server s keeps answering beats but has sent none of
        the replies it waits for in `quiet` s: what it waits for, and what s last said
        about its open round (its pong)."""
        what = []
        for reply, handles in waiting.items():
            for h in handles[:1]:
                op = h.what if h is not None else "push sent again"
                what.append(f"the params of a version after {self._version[s]} (pull)"
                            if reply == "params" else
                            f"the {reply} of {op}" + (f" {h.detail}" if h and h.detail else ""))
        return (f"server {s} at {self.addresses[s]} answers beats but has not sent what "
                f"worker {self.rank} waits for in {quiet:.1f}s: {'; '.join(what)} (under "
                f"{self.policy_repr}){self._round_text(s)}: a round waiting for workers that "
                f"wait for this one (e.g. at a barrier before they close), or a bug; limit "
                f"{self.wait_limit:g}s (DISTTRAIN_PS_WAIT): raise it if a worker's step, checkpoint "
                "or evaluation takes longer")

    def _round_text(self, s: int) -> str:
        """What server s said of its open round in its last pong ("" if nothing)."""
        said = self._said.get(s, {})
        if "need" not in said:
            return ""
        have = said.get("pushes", [])
        return (f"; its open round (version {said.get('version')}) holds {len(have)} of the "
                f"{said['need']} pushes that close it (from workers "
                f"{sorted({w for w, _ in have})}), live workers {said.get('live')}")

    def _fail(self, text: str) -> None:
        """The job cannot go on: the next wait() (or push/pull) raises PSError(text)."""
        self._error = self._error or PSError(text)

    def _on_reply(self, s: int, msg: Message, waiting: dict[str, list[Handle]]) -> None:
        """Act on one reply of server s (meta already checked by schema.py)."""
        if msg.op == "cancel":
            self._floor[s] = max(self._floor[s], msg.meta["version"])
            self._cancel_event.set()
            return
        if msg.op == "pong":  # NOTE: its open round, for _unanswered
            self._said[s] = msg.meta
            return
        if msg.op == "moved":  # NOTE: drained: its keys moved; the manager says where
            self.routes.told(s, msg.meta["ring"])
            return
        if msg.op == "commit":  # NOTE: only a server's replica link receives these
            self._fail(f"server {s} at {self.addresses[s]} sent a commit frame to a worker")
            return
        if msg.op in ("held", "ack") or msg.op == "params" and msg.meta["ack"]:
            if self._unasked(s, "held" if msg.op == "held" else "ack"):
                return
        if msg.op == "error":
            p = msg.meta.get("protocol", PROTOCOL)
            versions = f" speaks wire protocol {p}, this worker {PROTOCOL}" if p != PROTOCOL else ""
            self._fail(f"server {s} at {self.addresses[s]}{versions}: {msg.meta['message']}")
            return
        if msg.op == "params":
            if msg.meta["ack"]:  # NOTE: the push this pull rode on (fuse)
                if waiting["ack"]:
                    waiting["ack"].pop(0).finish_one()
                self.routes.acked(s)
            if not self._write_params(s, msg):
                return
            self._version[s] = msg.meta["version"]
            self.routes.version(s, self._version)
            if not msg.meta["last"]:
                return  # NOTE: more chunks of this pull follow
        if msg.op == "welcome":
            self._version[s] = -1
            self.routes.welcome(s)
        if msg.op == "held":  # NOTE: the frames may be sent again: copied before wait() ends
            self.routes.received(s)
        if msg.op == "ack":
            self.routes.acked(s)
        if msg.op == "bye":
            stats = dict(msg.meta["stats"], staleness=dict(msg.meta["staleness"]))
            self.server_stats.append(stats)
        pending = waiting.get({"held": "held", "ack": "ack", "params": "params",
                               "welcome": "welcome", "bye": "bye"}.get(msg.op, ""), [])
        if pending and (handle := pending.pop(0)) is not None:  # None: a push sent again
            handle.finish_one()  # whose handle `held` completed already (reroute.py)

    def _unasked(self, s: int, op: str) -> bool:
        """Count a `held` or an ack of link s; True (the job fails, naming the server) when
        it answers no push frame sent there: more than the push frames that asked, a held
        this worker's policy and replicas never get, an ack before its push's held.

        NOTE: a link is FIFO, so the n-th held (ack) answers the n-th push frame that asked;
        a `held` names no push, so a repeated one while a later push awaits its own is
        taken for that push's (docs/design/parameter-server.md, "A push `held` on receipt")."""
        n = self._asks[s]
        n[op] += 1
        why = ("its policy and replicas get no held (Server.says_held)"
               if op == "held" and not self.held_acks else
               f"{n['push']} push frames asked for one, this is {op} {n[op]}" if n[op] > n["push"]
               else f"ack {n['ack']} came before that push's held" if op == "ack" and
               self.held_acks and n["ack"] > n["held"] else None)
        if why is not None:
            self._eps[s].rejected[f"unasked {op}"] += 1
            self._fail(f"server {s} at {self.addresses[s]} answered {op} for a push this "
                       f"worker did not send it, refused ({why}): a bug or another disttrain "
                       "version there")
        return why is not None

    def _write_params(self, s: int, msg: Message) -> bool:
        """Copy a params chunk of server s into the model; False (the job fails, naming the
        server and key) when a key is not one of s's or its tensor does not fit it."""
        try:
            check_keys(msg, self._shards[s])
        except SchemaError as e:
            self._eps[s].rejected[e.reason] += 1
            self._fail(f"server {s} at {self.addresses[s]} sent params that do not fit: {e}")
            return False
        with torch.no_grad():
            for k, t in zip(msg.keys, msg.tensors):
                c = self._by_key[k]
                self.params[c.name].data.view(-1)[c.start:c.stop].copy_(t)
        return True
