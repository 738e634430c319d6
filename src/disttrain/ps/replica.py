"""Replicated key ranges: chain replication of each server's updates, after aggregation.

With `replicas=r` every key lives on the r servers the placement's `chain(key, r)` names:
its owner, the head (workers push to it and pull from it), then the next r-1 distinct
servers of the ring, the last of them the tail. Chain replication (van Renesse &
Schneider 2004): the head applies an update and sends the *update* (the round's averaged
gradient, not the n pushes: Li et al., OSDI'14 sec. 4.3, replication after aggregation)
to the next server of each key's chain, chunk by chunk as it steps them; each server
takes the same optimizer step on its copy (so optimizer state is replicated too) and
forwards it; the tail commits it, and commits travel back hop by hop. A head
acknowledges a push, and answers a pull, only once every update it had applied by then
is committed: an acknowledged push is on every replica, and so is every update in a
version a worker pulled. A dead server is dropped from every chain (`drop`, takeover.py).

Who talks to whom: a server's `Replicas` owns one DEALER link per successor
(transport.WorkerLink), under worker id W + its server index; the successor's ROUTER
greets it as a worker and its server hands those frames here (`handle`). Frames:
`replicate` (to the successor) and `commit` (back); schema.py. A new tail's state comes
as `transfer` frames on the same links (transfer.py, chain extension). Design, costs and what
each policy sends: docs/design/parameter-server.md, "Replication".
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import torch
import zmq

from disttrain.ps.chain import Layout, role
from disttrain.ps.frame import DEFAULT_LIMITS, Message, group_keys
from disttrain.ps.placement import Plan
from disttrain.ps.policy import Policy
from disttrain.ps.schema import SchemaError, check_keys
from disttrain.ps.server import PSError
from disttrain.ps.shm import ring_bytes
from disttrain.ps.staleness import StaleStep
from disttrain.ps.transport import WorkerLink, encrypt_setting, mac_setting, shm_setting

__all__ = ["Replicas"]


class Replicas:
    """The replication side of server `index`: its copies of other heads' keys (values and
    optimizer state), its links to its successors and what waits for their commits."""

    def __init__(self, index: int, workers: int, plan: Plan, replicas: int, init: dict,
                 optimizer, policy: Policy, ep, secret: bytes, *, timeout: float = 10.0,
                 chunk_bytes: int = 4 << 20):
        self.index, self.r, self.base, self.ep = index, replicas, workers, ep
        self.policy_repr, self.timeout, self.chunk_bytes = repr(policy), timeout, chunk_bytes
        self._secret = secret
        lay = Layout(index, plan, replicas)
        self.chains, self.hop, self.paths = lay.chains, lay.hop, lay.paths
        self.origin_hops, self.ranges, self.feeds = lay.origin_hops, lay.ranges, lay.feeds
        self.expect = {workers + j: {c.key: (c.numel, init[c.name].dtype) for c in cs}
                       for j, cs in lay.copies.items()}  # predecessor id -> its keys' shapes
        self.nbytes = {c.key: c.numel * init[c.name].element_size()
                       for cs in lay.ranges.values() for c in cs}
        self.params = params = {c.key: torch.nn.Parameter(init[c.name].detach().reshape(-1)[
            c.start:c.stop].clone()) for cs in lay.copies.values() for c in cs}  # the copies
        self.optimizer = optimizer(list(params.values())) if params else None
        self.stepper = StaleStep(self.optimizer, policy.rule)
        self.origins = {self.chains[k][0] for k in params}  # heads whose keys are copied here
        self.version = dict.fromkeys(self.origins, 0)  # each copied range's head version
        self.finals: set[tuple] = set()  # feeds whose head said it sends nothing more
        ep.workers |= set(self.expect)  # NOTE: predecessors say hello as workers W + index
        self.links: dict[int, WorkerLink] = {}
        self.sent, self.committed, self.received = Counter(), Counter(), Counter()
        self._queue: dict[int, list[Message]] = defaultdict(list)  # until the welcome
        self._version_sent: dict[int, int] = defaultdict(lambda: -1)
        self._pending: list[tuple[dict, object]] = []  # (needed commits, what to do then)
        self._above: dict[int, set[int]] = defaultdict(set)  # frames committed past the prefix
        self._ctx, self._heard = zmq.Context(), {}  # successor -> when it last answered
        self._seen = dict.fromkeys(self.expect, time.monotonic())
        self._next_beat, self.final_sent = 0.0, False
        self.intake = None  # transfer.Intake.handle while this server takes keys' state
        self.hold = None  # recopy.Recopy.hold: sees a predecessor's frame first (True: taken)
        # takeover.py: [worker, clock] of the pushes in the update being forwarded; head ->
        # worker -> (latest clock applied here, its keys applied: a head's own too, which a
        # transfer carries); x timeout before a silent peer stops this server; the servers
        # the manager's ring marks dead (`drop`)
        self.pushes, self.clocks, self.patience, self.dead = [], defaultdict(dict), 1.0, set()

    # ---- links ----------------------------------------------------------------------
    def connect(self, addresses: dict[int, str]) -> None:
        """Open a link to every successor (their addresses, by index) and say hello; does
        not block: messages wait in a queue until the welcome."""
        self.addresses = addresses
        for j in sorted({h for h in self.hop.values() if h is not None}):
            keys = [k for k, h in self.hop.items() if h == j]
            self.open_link(j, addresses[j], keys, sum(self.nbytes[k] for k in keys))

    def open_link(self, j: int, address: str, keys: list[str], nbytes: int) -> WorkerLink:
        """Open the link to server j at `address` for `keys` (`nbytes` per frame at most,
        for its shared-memory ring) and say hello; does not block."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, DEFAULT_LIMITS.max_frame_bytes)
        sock.connect(address)
        link = WorkerLink(sock, self._secret, self.base + self.index, j, DEFAULT_LIMITS,
                          encrypt_setting(), mac_setting(),
                          ring_bytes(nbytes, max(1, len(keys)), self.chunk_bytes)
                          if shm_setting() else 0)
        self.links[j], self._heard[j] = link, time.monotonic()
        self.addresses = {**getattr(self, "addresses", {}), j: address}
        link.send(Message("hello", {"keys": keys, "policy": self.policy_repr,
                                    "replicas": self.r}))
        return link

    def admit(self, peer: int) -> None:
        """Take hellos and frames from link id `peer` (a server W + i) holding no keys yet:
        a new predecessor (transfer.py); its keys are added to `expect` as they arrive."""
        self.expect.setdefault(peer, {})
        self.ep.workers.add(peer)
        self._seen.setdefault(peer, time.monotonic())

    def heard_since(self, j: int, when: float) -> bool:
        """Did successor j answer (a commit, a pong) after `when` (time.monotonic())?"""
        return self._heard.get(j, float("-inf")) > when

    def sockets(self) -> list:
        """The link sockets, for the server's poller."""
        return [link.sock for link in self.links.values()]

    def close(self) -> None:
        """Close every link (never blocks)."""
        for link in self.links.values():
            link.close()
        self._ctx.term()

    def send(self, j: int, msg: Message) -> None:
        """Send `msg` to server j as the link's next numbered frame (queued until the
        welcome); never blocks. Its commit comes back like a replicate frame's."""
        self._send(j, msg)

    def _send(self, j: int, msg: Message) -> None:
        self.sent[j] += 1
        link = self.links[j]
        if link.session is None:
            self._queue[j].append(msg)
        else:
            link.send(msg)

    # ---- sending updates --------------------------------------------------------------
    def batches(self, keys: list[str], sizes: list[int]) -> list[list[str]]:
        """`keys` cut into chunk-sized batches: a head steps and forwards one at a time, so
        the copy to the next replica overlaps the stepping of the next batch."""
        return [[keys[i] for i in g] for g in group_keys(sizes, self.chunk_bytes)]

    def forward(self, origin: int, update: dict, version: int, hyper: tuple,
                final: bool = False, via: int | None = None,
                pushes: list | None = None) -> dict[int, int]:
        """Send an applied update of `origin`'s keys on to their next servers (does not
        block): `update` key -> the gradient stepped, `hyper` (lr factor, implicit
        momentum or None) as StaleStep.step returned. No keys: a marker of the version
        (or, `final`, of the end) to the next server of every chain of `origin`'s keys
        that came here from server `via` (None: this head's, whose `self.pushes` name the
        [worker, clock] pushes it holds; else `pushes` as received). Returns server ->
        number of the frame sent to it."""
        lr, momentum = hyper
        meta = {"origin": origin, "version": version, "lr": float(lr), "final": int(final)}
        if momentum is not None:
            meta["momentum"] = float(momentum)
        if update and (pushes := self.pushes if via is None else pushes):
            meta["pushes"] = [list(p) for p in pushes]
            for w, clock in pushes:  # NOTE: what a takeover (or a new tail) must not redo
                have = self.clocks[origin].get(w)
                keys = have[1] if have is not None and have[0] == clock else set()
                if have is None or clock >= have[0]:
                    self.clocks[origin][w] = (clock, keys | set(update))
        per: dict[int, list[str]] = defaultdict(list)
        for k in update:
            if self.hop[k] is not None:
                per[self.hop[k]].append(k)
        if not update:
            per = {j: [] for j in self.paths[(origin, via)]}
        for j, keys in per.items():
            self._send(j, Message("replicate", dict(meta), keys, [update[k] for k in keys]))
        if per:
            self._version_sent[origin] = max(self._version_sent[origin], version)
        return {j: self.sent[j] for j in per}

    def mark(self, version: int) -> None:
        """After this head applied version `version`: a marker unless its data said so."""
        if self._version_sent[self.index] < version:
            self.forward(self.index, {}, version, (1.0, None))

    def end(self, version: int) -> None:
        """This head applies nothing more (every worker is done): tell its successors once."""
        if not self.final_sent:
            self.final_sent = True
            self.forward(self.index, {}, version, (1.0, None), final=True)

    def when_committed(self, action, frames: dict | None = None) -> None:
        """Run `action()` once committed (now, if it is): with `frames` (server -> frame
        number), exactly those frames; else every replicate frame sent so far on the links
        that carry this head's keys. A push's ack and a pull's answer take the latter; a
        commit to a predecessor waits for the frames its update was forwarded as.

        NOTE: a commit waits only for the frames of its own update further down the chain
        (never for earlier frames of a link, which may wait on other chains: each link
        carries several), and tails commit at once, so nothing waits in a circle."""
        if frames is None:
            need = {j: self.sent[j] for j in self.origin_hops[self.index]}
        else:
            need = {j: -n for j, n in frames.items()}  # NOTE: negative: that frame alone
        if all(self._committed(j, n) for j, n in need.items()):
            action()
        else:
            self._pending.append((need, action))

    def _run_ready(self) -> None:  # every action whose commits all came, in order
        ready = [a for need, a in self._pending if all(self._committed(i, n)
                                                       for i, n in need.items())]
        self._pending = [(need, a) for need, a in self._pending if a not in ready]
        for action in ready:
            action()

    def _committed(self, j: int, n: int) -> bool:
        """Frame n (n < 0: frame -n alone) or every frame up to n of link j committed?"""
        return self.committed[j] >= abs(n) or n < 0 and -n in self._above[j]

    def drained(self) -> bool:
        """True when this server may exit: its end was sent, every head it copies said it
        ended, and everything it sent is committed."""
        return (self.final_sent and self.finals >= self.feeds and not self._pending
                and all(self.committed[j] >= n for j, n in self.sent.items()))

    # ---- receiving ------------------------------------------------------------------
    def is_peer(self, worker: int) -> bool:
        """Is this session id a predecessor server's link (not a worker)?"""
        return worker >= self.base

    def handle(self, session, msg: Message) -> None:
        """A frame of a predecessor's link (schema checked): hello, replicate or beat."""
        peer = session.worker
        self._seen[peer] = time.monotonic()
        if self.hold is not None and self.hold(session, msg):
            return
        if msg.op == "hello":  # NOTE: a link with no keys yet (a transfer's) carries nothing
            want = (list(self.expect.get(peer, {})), self.policy_repr, self.r)
            got = (msg.meta["keys"], msg.meta["policy"], msg.meta["replicas"])
            ok = got == want or not got[0] and got[1:] == want[1:]
            self.ep.send(session, Message("welcome", {"version": 0}) if ok else Message(
                "error", {"message": f"server {self.index} expects from server {peer - self.base} "
                          f"{len(want[0])} keys under {want[1]}, replicas={want[2]}; it offers "
                          f"{len(got[0])} under {got[1]}, replicas={got[2]}: build the same "
                          "model, policy and replicas on every rank"}))
        elif msg.op == "replicate":
            self._replicate(session, msg)
        elif msg.op == "beat":
            self.ep.send(session, Message("pong", {}))
        elif msg.op == "transfer" and self.intake is not None:  # chain extension, transfer.py
            self.intake(session, msg)
        else:
            self.ep.rejected["not a worker"] += 1
            self.ep.send(session, Message("error", {"message": (
                f"server {self.index} refused a {msg.op} frame from server {peer - self.base}'s "
                "replica link: it sends hello, replicate and beat")}))

    def _replicate(self, session, msg: Message) -> None:
        """Take the same step as the head did on these copies, forward it, commit it back
        once every later replica has it."""
        peer, o = session.worker, msg.meta["origin"]
        try:
            check_keys(msg, self.expect.get(peer, {}))
            if o not in self.origins or any(self.chains[k][0] != o for k in msg.keys):
                raise SchemaError("replicate", "origin", f"server {o} heads none of these keys")
        except SchemaError as e:
            self.ep.rejected[e.reason] += 1
            self.ep.send(session, Message("error", {"message": (
                f"server {self.index} refused a replicate frame from server "
                f"{peer - self.base}: {e}")}))
            return
        update = dict(zip(msg.keys, msg.tensors))
        for k, g in update.items():
            self.params[k].grad = g
        if update:
            self.stepper.replay(msg.meta["lr"], msg.meta.get("momentum"))
        self.version[o] = max(self.version[o], msg.meta["version"])
        if msg.meta["final"]:
            self.finals.add((o, peer - self.base))
        self.received[peer] += 1
        n = self.received[peer]
        sent = self.forward(o, update, msg.meta["version"], (msg.meta["lr"],
                            msg.meta.get("momentum")), bool(msg.meta["final"]), peer - self.base,
                            msg.meta.get("pushes"))
        self.when_committed(lambda: self.ep.send(session, Message("commit", {"frame": n})), sent)

    def receive(self) -> None:
        """Read every ready reply on the links (does not block); raises PSError when a
        successor refuses or breaks the protocol."""
        for j, link in self.links.items():
            while link.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    msg = link.recv()
                except SchemaError as e:
                    raise PSError(f"server {self.index}: replica server {j} sent a malformed "
                                  f"reply: {e}") from None
                if msg is not None:
                    self._heard[j] = time.monotonic()
                    self._reply(j, msg)
                link.release()

    def _reply(self, j: int, msg: Message) -> None:
        if msg.op == "welcome":
            for m in self._queue.pop(j, []):
                self.links[j].send(m)
        elif msg.op == "commit":
            n = msg.meta["frame"]
            if n > self.sent[j]:
                raise PSError(f"server {self.index}: replica server {j} committed replicate "
                              f"frame {n}, only {self.sent[j]} were sent")
            self._above[j].add(n)
            while self.committed[j] + 1 in self._above[j]:  # the prefix committed
                self.committed[j] += 1
                self._above[j].discard(self.committed[j])
            self._run_ready()
        elif msg.op == "error":
            raise PSError(f"server {self.index}: replica server {j} at {self.addresses[j]}: "
                          f"{msg.meta['message']}")

    def tick(self) -> None:
        """Beat on every link; raise PSError naming a successor that owes commits, or a
        predecessor that has not ended, silent for `timeout` x `patience` s."""
        now = time.monotonic()
        if now >= self._next_beat:
            for j, link in self.links.items():
                if link.session is not None and j not in self.dead:
                    link.send(Message("beat", {}))
            self._next_beat = now + min(1.0, self.timeout / 4)
        for j, link in self.links.items():
            if j in self.dead:
                continue
            owed = self.sent[j] - self.committed[j]
            if (owed or link.session is None) and now - self._heard[j] > self.timeout * self.patience:
                raise PSError(
                    f"server {self.index}: replica server {j} at {self.addresses[j]} silent "
                    f"for {now - self._heard[j]:.1f}s (timeout {self.timeout}s), {owed} replicate "
                    f"frames uncommitted: with replicas={self.r} every update waits for every "
                    "replica" + (", and no manager marked it dead" if self.patience > 1 else ""))
        for peer, seen in self._seen.items():
            feeds = {(self.chains[k][0], peer - self.base) for k in self.expect.get(peer, {})}
            if not feeds <= self.finals and now - seen > self.timeout * self.patience:
                raise PSError(f"server {self.index}: server {peer - self.base}, which sends it "
                              f"the updates of keys it copies, silent for {now - seen:.1f}s "
                              f"(timeout {self.timeout}s)")

    def drop(self, dead: int) -> None:
        """Server `dead` is gone (the manager's ring says so): what was sent to it counts as
        committed (this server is the tail of those chains now), nothing more goes to it or
        is awaited from it. Runs the acks and answers that were waiting."""
        self.dead.add(dead)  # NOTE: its link stays open (polled, counted) until close()
        self.committed[dead] = self.sent[dead]
        self._above.pop(dead, None), self._queue.pop(dead, None)
        self.hop = {k: None if j == dead else j for k, j in self.hop.items()}
        for nexts in [*self.origin_hops.values(), *self.paths.values()]:
            nexts.discard(dead)
        self.feeds = {(o, j) for o, j in self.feeds if j != dead and o != dead}
        # NOTE: a drained head's final came on this link; a route of its keys speaks as it
        self.finals = {(o, j) for o, j in self.finals if j != dead and o != dead}
        self._seen.pop(self.base + dead, None)
        self._pending = [({j: n for j, n in need.items() if j != dead}, a)
                         for need, a in self._pending]
        self._run_ready()

    # ---- report ---------------------------------------------------------------------
    def stats(self) -> dict:
        """Role per key range (its chain), replication traffic, the copies' versions."""
        ranges = [{"chain": list(ch), "role": role(ch, self.index), "keys": len(cs),
                   "bytes": sum(self.nbytes[c.key] for c in cs)}
                  for ch, cs in sorted(self.ranges.items())]
        sent = [dict(link.sent_bytes) for link in self.links.values()]
        frames = [dict(link.sent_frames) for link in self.links.values()]
        return {"replicas": self.r, "ranges": ranges,
                "replicate_bytes": sum(s.get("replicate", 0) for s in sent),
                "replicate_frames": sum(f.get("replicate", 0) for f in frames),
                "replica_versions": {str(o): v for o, v in sorted(self.version.items())}}
