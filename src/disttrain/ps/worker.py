"""The worker side of a parameter server: ps-lite's push / pull / wait on a torch model.

`Worker.pull()` asks every server for its shard and writes the answer into the model's
parameters; `Worker.push()` sends the model's gradients; both return a `Handle`
(handle.py) at once and `Handle.wait()` blocks. All sockets live on one background
thread (compute and upload on separate threads, as the user's documents describe): with
`overlap=True` a parameter's gradient is pushed from its post-accumulate-grad hook while
backward still runs for the layers below it.

Who talks to whom: the compute thread queues commands, the communication thread owns
one `WorkerLink` (transport.py) per server. Cancellation (KSync, KBatchSync) raises
`Cancelled` from the next hook, `push()` or `sleep()`; top-k pushes go through
compress.py. How both behave: docs/design/parameter-server.md ("Notes from
ps/worker.py").
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

import torch
import zmq

from disttrain.ps.compress import ErrorFeedback, TopK
from disttrain.ps.frame import DEFAULT_LIMITS, PROTOCOL, Limits, Message, group_keys
from disttrain.ps.handle import Cancelled, Handle  # re-exported: disttrain.ps.worker.Handle
from disttrain.ps.reroute import Routes
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES, Chunk
from disttrain.ps.schema import SchemaError, check_keys
from disttrain.ps.server import PSError
from disttrain.ps.shm import ring_bytes
from disttrain.ps.transport import WorkerLink, encrypt_setting, mac_setting, shm_setting
from disttrain.trace import events as trace_events

__all__ = ["Worker", "Handle", "Cancelled"]


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


class Worker:
    """One worker's connection to all servers; built by `disttrain.ps.connect`."""

    def __init__(self, model: torch.nn.Module, rank: int, addresses: list[str],
                 plan: list[list[Chunk]], secret: bytes, policy_repr: str, *,
                 timeout: float = 10.0, overlap: bool = True, limits: Limits = DEFAULT_LIMITS,
                 compression: TopK | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 encrypt: bool | None = None, always_mac: bool | None = None,
                 shm: bool | None = None, replicas: int = 1, manager: str | None = None):
        self.rank, self.addresses, self.timeout, self.overlap = rank, addresses, timeout, overlap
        self.chunk_bytes, self.policy_repr, self._servers = chunk_bytes, policy_repr, len(addresses)
        self.routes = Routes(self, plan, replicas, manager)  # a dead server's keys (reroute.py)
        self._encrypt = encrypt_setting() if encrypt is None else encrypt
        self._always_mac = mac_setting() if always_mac is None else always_mac
        self.params = dict(model.named_parameters())
        self._ring = [ring_bytes(sum((c.stop - c.start) * self.params[c.name].element_size()
                                     for c in chunks), len(chunks), chunk_bytes)
                      if (shm_setting() if shm is None else shm) else 0 for chunks in plan]
        self._chunks: dict[str, list[tuple[int, Chunk]]] = defaultdict(list)
        for s, chunks in enumerate(plan):
            for c in chunks:
                self._chunks[c.name].append((s, c))
        bad = [n for n, p in self.params.items() if not p.is_contiguous()]
        if bad:
            raise ValueError(f"parameters {bad} are not contiguous; call .contiguous() on them")
        self._secret, self._limits = secret, limits
        self._by_key = {c.key: c for chunks in plan for c in chunks}
        self._shards = [{c.key: (c.stop - c.start, self.params[c.name].dtype) for c in chunks}
                        for chunks in plan]  # what server s may send: schema.check_keys
        self.feedback = ErrorFeedback(compression) if compression is not None else None
        self._eps: list[WorkerLink] = []
        self._version = [-1] * len(addresses)
        self._floor = [-1] * len(addresses)
        self._clock, self._sent = 0, set()
        self._attempt: Handle | None = None
        self._error: PSError | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel_event = threading.Event()
        self.cancelled_steps = self.cancelled_in_backward = self.pushes = self.pulls = 0
        self.server_stats: list[dict] = []
        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://ps-wake-{id(self)}"
        self._wake_in = self._ctx.socket(zmq.PULL)
        self._wake_in.bind(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._wake_out = self._ctx.socket(zmq.PUSH)
        self._wake_out.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._run, name=f"ps-worker{rank}", daemon=True)
        self._thread.start()
        self._hooks: list = []
        hello = Handle(self._raise_if_failed, "hello")
        for s in range(self._servers):
            self._send(s, Message("hello", {"keys": [c.key for c in plan[s]],
                                            "policy": policy_repr, "replicas": replicas}),
                       hello, "welcome")
        try:
            hello.seal().wait()
        except PSError:  # NOTE: no Worker is returned: its thread must not outlive this
            self.close()
            raise
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(n))
                       for n, p in self.params.items() if p.requires_grad]

    # ---- public API -----------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        """True when a server closed the round this worker is computing for (no blocking)."""
        return any(v < f for v, f in zip(self._version, self._floor))

    @property
    def versions(self) -> list[int]:
        """The parameter version this worker holds from each server, -1 before the first
        pull or while one is half-written (no blocking)."""
        return list(self._version[:self._servers])

    def pull(self) -> Handle:
        """Ask every server for its parameters; returns at once (does not block).

        When the handle completes the model holds the servers' parameters. The server's
        policy may hold the answer back (Sync waits for the round, SSP for slow workers).
        """
        if self._sent:
            self._abandon()
        self._cancel_event.clear()
        h = Handle(self._raise_if_failed, "pull")
        trace_events.ps_pulling(h, self._version)
        for s in range(self._servers):
            self._send(s, Message("pull", {"have": self._version[s]}), h, "params")
        self.pulls += 1
        return h.seal()

    def push(self) -> Handle:
        """Send the gradients not yet sent by the hooks; returns at once (does not block).

        The handle completes when every server received them; until then the frames read
        `.grad` without a copy, so wait() before changing gradients in place
        (`zero_grad()`'s default, set_to_none, is safe at any time). Raises Cancelled if
        the round closed without this worker (the step is dropped; pull() next).
        """
        self.check()
        h = self._attempt_handle()
        names = [n for n in self.params if n not in self._sent]
        if names:
            self._send_grads(names)
        self._attempt, self._sent = None, set()
        self._clock += 1
        self.pushes += 1
        trace_events.ps_pushed(h, self.rank, self._clock - 1, self._version)  # ends the step
        return h.seal()

    def wire_stats(self) -> dict:
        """Bytes and frames this worker sent and received, per op, summed over servers:
        {"sent_bytes": {op: n}, "sent_frames": ..., "recv_bytes": ..., "recv_frames": ...}.
        Bytes are mac + header + buffers (not ZeroMQ's own framing); "rejected" counts the
        servers' frames this worker dropped, by reason. Does not block."""
        out: dict[str, dict[str, int]] = {}
        for what in ("sent_bytes", "sent_frames", "recv_bytes", "recv_frames", "rejected"):
            total: dict[str, int] = {}
            for ep in list(self._eps):
                for op, n in dict(getattr(ep, what)).items():  # NOTE: dict() copies atomically
                    total[op] = total.get(op, 0) + n
            out[what] = total
        return out

    def check(self) -> None:
        """Raise Cancelled if this worker's round closed (does not block)."""
        if self.cancelled:
            trace_events.ps_cancelled(self.rank)
            self._abandon()
            raise Cancelled(f"worker {self.rank}: round closed on a server; pull() again")

    def sleep(self, seconds: float) -> None:
        """Block `seconds` (an injected straggler delay), raising Cancelled at once if the
        round closes meanwhile, as abandoned real compute would."""
        with trace_events.span("sleep (injected delay)", "injected", seconds=seconds):
            self._sleep_until(time.monotonic() + seconds)

    def _sleep_until(self, end: float) -> None:
        while True:
            self.check()
            left = end - time.monotonic()
            if left <= 0:
                return
            self._cancel_event.wait(left)
            self._cancel_event.clear()

    def close(self) -> list[dict]:
        """Tell every server this worker is done; blocks for their goodbye (bounded by the
        timeout) and returns their stats (staleness histograms, drops, lost workers)."""
        if self._thread.is_alive():
            try:
                if self._error is None:
                    bye = Handle(self._raise_if_failed, "close")
                    for s in range(self._servers):
                        self._send(s, Message("done", {}), bye, "bye")
                    bye.seal().wait()
            finally:  # NOTE: after a failure too: the thread must end, not idle on
                self._stop()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not self._thread.is_alive():
            self._wake_out.close(linger=0)
            self._ctx.term()
        return self.server_stats

    # ---- compute-thread helpers -------------------------------------------------------
    def _make_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if self.cancelled:
                self._abandon()
                self.cancelled_in_backward += 1
                raise Cancelled(f"worker {self.rank}: round closed during backward")
            if self.overlap:
                self._send_grads([name])
        return hook

    def _abandon(self) -> None:
        self.cancelled_steps += 1
        self._attempt, self._sent = None, set()
        self._clock += 1

    def _attempt_handle(self) -> Handle:
        if self._attempt is None:
            self._attempt = Handle(self._raise_if_failed, "push")
        return self._attempt

    def _send_grads(self, names: list[str]) -> None:
        h = self._attempt_handle()
        per_server: dict[int, list[tuple[str, list]]] = defaultdict(list)  # (key, tensors)
        for name in names:
            p = self.params[name]
            # NOTE: no copy: the frames reference .grad until the servers ack; the push
            # handle completes only then, so wait() before changing .grad in place.
            g = p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(
                p.numel(), dtype=p.dtype)
            # (k,) indices and (k,) values, a pair per key, selected over the whole
            # parameter whatever its keys (compress.py); else each key's slice
            parts = (self.feedback.compress_parts(name, g, [(c.start, c.stop) for _, c in
                                                            self._chunks[name]])
                     if self.feedback is not None else [None] * len(self._chunks[name]))
            for (s, c), pair in zip(self._chunks[name], parts):
                per_server[s].append((c.key, [g[c.start:c.stop]] if pair is None else list(pair)))
            self._sent.add(name)
        for s, entries in per_server.items():
            sizes = [sum(t.numel() * t.element_size() for t in ts) for _, ts in entries]
            groups = group_keys(sizes, self.chunk_bytes)
            for n, g in enumerate(groups):  # NOTE: a stream of chunk messages, one ack
                meta = {"clock": self._clock, "version": self._version[s]}
                sent, zero = self._frame([entries[i] for i in g])
                if self.feedback is not None:
                    meta["sparse"] = 1
                if zero:
                    meta["zero"] = zero
                last = n == len(groups) - 1
                if last:
                    meta["ack"] = 1
                self._send(s, Message("push", meta, [k for k, ts in sent for _ in ts],
                                      [t for _, ts in sent for t in ts]), h if last else None,
                           "ack")

    @staticmethod
    def _frame(entries: list[tuple[str, list]]) -> tuple[list, list[str]]:
        """A push frame's (key, tensors) to send and the keys it names as zero: a sparse
        key where top-k selected nothing travels by name (schema "zero"), in the frame its
        empty pair would have been in, so the server steps it with the same frame; a
        frame still carries one tensor (an empty pair when all its keys are empty)."""
        empty = [len(ts) == 2 and not len(ts[0]) for _, ts in entries]  # (idx, val) pairs
        sent = [e for e, no in zip(entries, empty) if not no] or entries[:1]
        named = {k for k, _ in sent}
        return sent, [k for (k, _), no in zip(entries, empty) if no and k not in named]

    def _send(self, s: int, msg: Message, handle: Handle | None, reply: str) -> None:
        if handle is not None:
            handle.add()
        self._cmds.put((s, msg, handle, reply))
        self._wake()

    def _stop(self) -> None:
        """End the communication thread (blocks up to the timeout for it)."""
        self._cmds.put(None)
        self._wake()
        self._thread.join(self.timeout)

    def _wake(self) -> None:
        with self._wake_lock:
            self._wake_out.send(b"")

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            raise PSError(f"worker {self.rank} {what}: {self._error}")

    # ---- communication thread --------------------------------------------------------
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
        heard = self._heard = [time.monotonic()] * len(eps)
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
                    self._on_reply(s, got, waiting[s])
                    ep.release()  # NOTE: after the params are copied into the model
        now = time.monotonic()
        for s, w in enumerate(waiting):
            if any(w.values()) and self._error is None:  # NOTE: a dead server's keys move on
                text = self.routes.silent(s, now - heard[s], self._beat_every)
                if text:
                    self._fail(text)
            patience = 2 if self.routes.on else 1  # NOTE: the manager's verdict comes first
            if any(w.values()) and now - heard[s] > self.timeout * patience and not self._error:
                # NOTE: a bad MAC before any session: the answer to our hello (same secret)
                unread = eps[s].session is None and eps[s].rejected.get("bad MAC")
                self._error = PSError(f"server {s} at {self.addresses[s]} silent for "
                                      f"{now - heard[s]:.1f}s (timeout {self.timeout}s)" + (
                    f"; its answer to the hello does not verify: it speaks another wire "
                    f"protocol (this worker {PROTOCOL}; older than 3 if it does not say)"
                    if unread else ""))
        return True

    def _fail(self, text: str) -> None:
        """The job cannot go on: the next wait() (or push/pull) raises PSError(text)."""
        self._error = self._error or PSError(text)

    def _on_reply(self, s: int, msg: Message, waiting: dict[str, list[Handle]]) -> None:
        """Act on one reply of server s (meta already checked by schema.py)."""
        if msg.op == "cancel":
            self._floor[s] = max(self._floor[s], msg.meta["version"])
            self._cancel_event.set()
            return
        if msg.op == "moved":  # NOTE: drained: its keys moved; the manager says where
            self.routes.told(s, msg.meta["ring"])
            return
        if msg.op == "commit":  # NOTE: only a server's replica link receives these
            self._fail(f"server {s} at {self.addresses[s]} sent a commit frame to a worker")
            return
        if msg.op == "error":
            p = msg.meta.get("protocol", PROTOCOL)
            versions = f" speaks wire protocol {p}, this worker {PROTOCOL}" if p != PROTOCOL else ""
            self._fail(f"server {s} at {self.addresses[s]}{versions}: {msg.meta['message']}")
            return
        if msg.op == "params":
            if msg.meta["ack"] and waiting["ack"]:  # NOTE: the push this pull rode on (fuse)
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
        if msg.op == "ack":
            self.routes.acked(s)
        if msg.op == "bye":
            stats = dict(msg.meta["stats"], staleness=dict(msg.meta["staleness"]))
            self.server_stats.append(stats)
        pending = waiting.get({"ack": "ack", "params": "params", "welcome": "welcome",
                               "bye": "bye"}.get(msg.op, ""), [])
        if pending:
            pending.pop(0).finish_one()

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
