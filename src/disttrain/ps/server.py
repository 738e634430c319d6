"""A parameter server: holds one shard of the parameters and applies workers' gradients.

ps-lite's server with an injected request handler (Mu Li et al. 2014), where the handler
is a consistency policy (policy.py). One thread runs `serve()`: it reads authenticated
messages from its ROUTER socket (transport.py), feeds the policy, and carries out its
decisions: average the chosen gradients and take one step of a torch optimizer built
here over this shard's keys, drop late gradients, tell cancelled workers, answer pulls.
This module is the loop and what it reads; carrying out the policy's decisions is
server_steps.py (`ServerSteps`, which `Server` inherits).

Who talks to whom: each worker's DEALER sends hello, push (gradients of this shard's
keys), pull, beat and done; the server answers welcome, ack, params, cancel, pong, bye,
or error, each on the worker's session. A worker silent for `timeout` seconds is lost:
the policy decides whether the job goes on (K modes, Async, SSP) or stops with an error
naming it (Sync). Keys, chunk streams, sparse pushes: docs/design/parameter-server.md
("Notes from ps/server.py"); snapshots and the restart report are snapshot.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import zmq

from disttrain.ps import snapshot as snap
from disttrain.ps.compress import densify
from disttrain.ps.frame import DEFAULT_LIMITS, FrameError, Limits, Message, group_keys
from disttrain.ps.handle import PSError  # re-exported: disttrain.ps.server.PSError
from disttrain.ps.keys import encrypt_setting, mac_setting, shm_setting
from disttrain.ps.policy import Policy
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES, Chunk
from disttrain.ps.schema import check_keys
from disttrain.ps.server_steps import ServerSteps
from disttrain.ps.session import Session
from disttrain.ps.staleness import StaleStep
from disttrain.ps.transport import ServerEndpoint, bind, remove_folder
from disttrain.trace import events as trace_events

__all__ = ["Server", "PSError"]


class PartialPush(NamedTuple):
    """A worker's push whose keys are still arriving (several messages per push)."""

    clock: int
    """The worker's push counter: a newer one means this attempt was abandoned."""
    version: int
    """The parameter version the worker computed the gradient on (its staleness)."""
    grads: dict
    """key -> gradient received so far (None: already stepped on arrival)."""


class Server(ServerSteps):
    """Serves the keys `chunks` (initial values from `init`) to workers `workers`."""

    def __init__(self, index: int, chunks: list[Chunk], init: dict[str, torch.Tensor],
                 policy: Policy, optimizer: Callable, workers: list[int], secret: bytes, *,
                 host: str = "127.0.0.1", timeout: float = 10.0, limits: Limits = DEFAULT_LIMITS,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, encrypt: bool | None = None,
                 always_mac: bool | None = None, shm: bool | None = None):
        self.index, self.chunks, self.policy, self.timeout = index, chunks, policy, timeout
        self.keys = [c.key for c in chunks]
        self.params = {c.key: torch.nn.Parameter(
            init[c.name].detach().reshape(-1)[c.start:c.stop].clone()) for c in chunks}
        self.optimizer = optimizer(list(self.params.values())) if chunks else None
        self.stepper = StaleStep(self.optimizer, policy.rule)  # raises for a rule it cannot do
        self.shard = {k: (p.numel(), p.dtype) for k, p in self.params.items()}
        big = max((p.numel() * p.element_size() for p in self.params.values()), default=0)
        if big > limits.max_tensor_bytes:  # NOTE: its sockets would drop such a part (MAXMSGSIZE)
            raise ValueError(f"server {index}: a key of {big} bytes exceeds Limits.max_tensor_bytes="
                             f"{limits.max_tensor_bytes}; use smaller chunks or larger limits")
        self.workers = list(workers)
        policy.start(self.workers)
        self._groups = [[self.keys[i] for i in g] for g in group_keys(
            [p.numel() * p.element_size() for p in self.params.values()], chunk_bytes)]
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
        self.address, self._folder = bind(sock, host)
        self.ep = ServerEndpoint(sock, secret, index, self.workers, limits,
                                 encrypt_setting() if encrypt is None else encrypt,
                                 mac_setting() if always_mac is None else always_mac,
                                 shm_setting() if shm is None else shm)
        self.partial: dict[int, PartialPush] = {}  # worker -> the push still arriving
        self.complete: dict[int, dict[str, torch.Tensor]] = {}  # push id -> grads
        self.parked: dict[int, int] = {}  # worker -> version it already has
        self.acks: dict[int, int] = {}  # worker -> 1: its push's ack is owed (_handle)
        self.finished: set[int] = set()
        self.partial_dropped = 0
        self._pid = 0
        self._sending: dict[str, list] = {}  # key -> trackers of zero-copy sends of it
        self.snapshot_path: str | None = None
        self.snapshot_every = 0
        self.restored_version: int | None = None
        self.lost_updates: int | None = None
        self.job = snap.job_id(secret)
        self._side: snap.SideFile | None = None
        self.sparse_pushes = 0
        self.chain = None  # replica.Replicas with replicas > 1 (connect.serve sets it)
        self.push_acks: dict[int, list[Session]] = {}  # push id -> its frames' acks (replicas)
        self.held: dict[int, list[Session]] = {}  # worker -> acks of the push still arriving
        self.ticks: list[Callable[[], None]] = []  # run once per loop (transfer.Extension)
        self.clocks: dict[int, tuple[int, int]] = {}  # push id -> (worker, clock)
        self.done_clock: dict[int, int] = {}  # worker -> clocks up to it applied (takeover.py)
        self.watch: Callable[[], None] | None = None  # called every loop (takeover.py)
        self.replicas = 1  # what workers must say without a chain (a takeover's: the job's)
        self.gone: Message | None = None  # the answer to every frame once drained (move.py)
        self.grace = 0.0  # s more a worker not yet heard from has (a route: workers come late)

    # ---- main loop ------------------------------------------------------------------
    def serve(self) -> dict:
        """Serve until every worker is done or lost; blocks; returns the job's stats.

        Raises PSError when the policy stops the job (e.g. Sync lost a worker); the
        workers get the same message.
        """
        self.last_seen = dict.fromkeys(self.workers, time.monotonic() + self.grace)
        poller = self.poller = zmq.Poller()  # NOTE: transfer.py registers links it opens
        for sock in [self.ep.sock, *(self.chain.sockets() if self.chain else [])]:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._ended():
                if poller.poll(timeout=100):
                    while self.ep.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        got = self.ep.recv()
                        if got is not None:
                            self._handle(*got)
                    if self.chain:
                        self.chain.receive()
                self._check_liveness()
                if self.chain:
                    self.chain.tick()
                for tick in self.ticks:
                    tick()
                if self.watch:
                    self.watch()
            trace_events.ps_server_stats(self.stats())
            return self.stats()
        except PSError as e:  # NOTE: a replica's fault (replica.py): every peer hears why
            if self.chain is not None:
                for s in self.ep.active.values():
                    self.ep.send(s, Message("error", {"message": str(e)}))
            raise
        finally:
            self.close()

    def _ended(self) -> bool:
        """Every worker is done or lost and, with replicas, every copy is committed."""
        if len(self.finished) < len(self.workers):
            return False
        if self.chain is not None:
            self.chain.end(self.policy.version)
        return self.chain is None or self.chain.drained()

    def close(self) -> None:
        """Close the socket and files (does not block beyond the socket's linger)."""
        if self.chain is not None:
            self.chain.close()
        if not self.ep.sock.closed:
            self.ep.close()
            self._ctx.term()
            remove_folder(self._folder)
        if self._side is not None:
            self._side.close()

    def _handle(self, session: Session, msg: Message) -> None:
        w = session.worker
        if self.chain is not None and self.chain.is_peer(w):
            return self.chain.handle(session, msg)
        self.last_seen[w] = time.monotonic()
        if session.gone is not None or w in self.finished and msg.op != "done":
            if (gone := session.gone or self.gone) is not None:  # NOTE: keys moved: ask
                self.ep.send(session, gone)  # the manager (move.py; join_head.py)
            return
        if msg.op == "hello":
            self._hello(session, msg)
        elif msg.op == "beat":
            self.ep.send(session, Message("pong", self.policy.open_round()))  # NOTE: worker_loop
        elif msg.op in ("replicate", "transfer"):  # NOTE: only a predecessor's link sends these
            self.ep.rejected["not a replica link"] += 1
            self.ep.send(session, Message("error", {"message": (
                f"server {self.index} refused a {msg.op} frame from worker {w}: not a replica "
                f"link ({msg.op} frames come from the previous server of a replica chain)")}))
        elif msg.op == "done":
            self.partial.pop(w, None)
            if w not in self.finished:
                self.finished.add(w)
                self._execute(self.policy.leave(w))
            # NOTE: msgpack maps here have string keys only; the histogram goes as pairs
            stats = self.stats()
            staleness = [[k, v] for k, v in stats.pop("staleness").items()]
            self.ep.send(session, Message("bye", {"stats": stats, "staleness": staleness}))
        elif msg.op == "push":
            if msg.meta["ack"] and self.says_held():  # NOTE: before its ack, which may go at once
                self.ep.send(session, Message("held"))
            if self._push(w, msg, session) and msg.meta["ack"] and self.chain is None:
                self.acks[w] = 1  # NOTE: params answering a pull that rode on it carry it
            # (with copies, replica.py acks once they committed)
        if msg.op == "pull" or "pull" in msg.meta:  # NOTE: after the push it rode on (worker.fuse)
            self.parked[w] = msg.meta["pull" if msg.op == "push" else "have"]
            self._execute(self.policy.pull(w))
        if self.acks.pop(w, 0):  # no params went at once: the ack on its own
            self.ep.send(session, Message("ack"))

    def says_held(self) -> bool:
        """Whether a push's receipt is answered `held` before its ack: with copies, under a
        policy whose rounds hold pushes of workers free to push again (Policy.runs_ahead),
        whose ack waits for a round they never wait for (docs/design/parameter-server.md,
        "Replication after aggregation")."""
        return self.policy.runs_ahead() and (self.chain.r if self.chain else self.replicas) > 1

    def _hello(self, session: Session, msg: Message) -> None:
        want = {"keys": self.keys, "policy": repr(self.policy),
                "replicas": self.chain.r if self.chain else self.replicas}
        got = {k: msg.meta[k] for k in want}
        if got != want:
            self.ep.send(session, Message("error", {"message": (
                f"server {self.index} holds keys {self.keys[:4]}... under {want['policy']}, "
                f"worker {session.worker} expects {str(got['keys'])[:80]} under "
                f"{got['policy']}, replicas={got['replicas']} (here {want['replicas']}): build "
                "the same model and policy on every rank (and pass the same replicas)")}))
            return
        self.ep.send(session, Message("welcome", {"version": self.policy.version}))

    def _push(self, w: int, msg: Message, session: Session | None = None) -> bool:
        """Take one push message (meta checked by schema.py); False (nothing changed, the
        worker told) if its tensors do not fit this shard."""
        clock, version, sparse = msg.meta["clock"], msg.meta["version"], msg.meta["sparse"]
        try:
            if sparse:
                grads = densify(msg.keys, msg.tensors, self.shard, msg.meta.get("zero", []))
            else:
                check_keys(msg, self.shard)
                grads = dict(zip(msg.keys, msg.tensors))
        except FrameError as e:
            self.ep.rejected["bad sparse push" if sparse else e.reason] += 1
            if session is not None:
                self.ep.send(session, Message("error", {"message": (
                    f"server {self.index} rejected a push from worker {w}: {e}")}))
            return False
        self.sparse_pushes += bool(sparse)
        if clock <= self.done_clock.get(w, -1):  # NOTE: applied before a takeover: not again
            if self.chain is not None and msg.meta["ack"] and session is not None:
                self._ack_later([session])  # NOTE: a route with a copy again (recopy.py)
            return True
        have = self.partial.get(w)
        if have is None or have.clock != clock:
            if have is not None:  # NOTE: a newer clock means the old attempt was abandoned
                self.partial_dropped += 1
                self._ack_later(self.held.pop(w, []))
            have = self.partial[w] = PartialPush(clock, version, {})
        elif have.version is None:  # NOTE: a takeover's seed: part of it applied already
            have = self.partial[w] = have._replace(version=version)
        if self.chain is not None and msg.meta["ack"] and session is not None:
            self.held.setdefault(w, []).append(session)  # NOTE: acked once applied everywhere
        grads = {k: g for k, g in grads.items() if k not in have.grads}
        if self.policy.applies_alone():  # NOTE: step each chunk as soon as it is complete
            if self.chain is not None:
                self.chain.pushes = [(w, clock)]
            self._apply([grads], [self.policy.version - have.version])
            grads = dict.fromkeys(grads)
        have.grads.update(grads)
        if len(have.grads) == len(self.keys):
            del self.partial[w]
            pid, self._pid = self._pid, self._pid + 1
            trace_events.ps_received(self.index, pid, w, clock)
            self.push_acks[pid] = self.held.pop(w, [])
            self.clocks[pid] = (w, clock)
            self.complete[pid] = {k: g for k, g in have.grads.items() if g is not None}
            self._execute(self.policy.push(pid, w, have.version))
        return True

    def drop_from_pulls(self, moved: set[str]) -> None:
        """Leave `moved` out of every pull answer from now on (join_head.py hands them over)."""
        self._groups = [g for g in ([k for k in g if k not in moved] for g in self._groups) if g]

    # ---- reporting and snapshots ----------------------------------------------------
    def stats(self) -> dict:
        """Policy counters plus transport and partial-push counters (plain types)."""
        out = self.policy.stats()
        if self.restored_version is not None:
            out.update(restored_version=self.restored_version, lost_updates=self.lost_updates)
        out.update(server=self.index, partial_dropped=self.partial_dropped,
                   rejected_frames=sum(self.ep.rejected.values()),
                   rejected=dict(self.ep.rejected), keys=len(self.keys),
                   bytes=sum(p.numel() * p.element_size() for p in self.params.values()),
                   push_bytes=self.ep.recv_bytes.get("push", 0),
                   push_frames=self.ep.recv_frames.get("push", 0),
                   shm_params=self.ep.shm_frames.get("params", 0),
                   sparse_pushes=self.sparse_pushes)
        out.update(self.stepper.stats(out))
        out.update(self.chain.stats() if self.chain else {})
        return out

    def keep_snapshots(self, path: str, every: int = 0) -> str | None:
        """Snapshot to `path` every `every` applied updates (0: only when asked); does not block.

        Restores `path` first if it exists and returns the one-line restore report (None
        when there was nothing to restore and no side file). The side file
        `path + ".version"` (snapshot.py) is then stamped with this job's id and rewritten
        after every update, so a restart can say how many updates the snapshot lacks; a
        side file of another job is ignored and the report says so.
        """
        if every < 0:
            raise ValueError(f"snapshot_every={every} must be >= 0 (0 disables periodic "
                             "snapshots)")
        self.snapshot_path, self.snapshot_every = path, every
        side = snap.read_side(path + ".version")
        meta = self.restore(path) if os.path.exists(path) else None
        report, lost = snap.restart_report(path, self.job, side, meta)
        if meta is not None or lost is not None:
            self.restored_version, self.lost_updates = self.policy.version, lost
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._side = snap.SideFile(path + ".version", self.job, self.policy.version)
        return f"[ps server{self.index}] {report}" if report else None

    def _after_update(self) -> None:
        """Record the new version in the side file; snapshot when it is due."""
        if self._side is None:
            return
        v = self.policy.version
        self._side.write(v)
        if self.snapshot_every and v % self.snapshot_every == 0:
            self.snapshot(self.snapshot_path)

    def snapshot(self, path: str) -> None:
        """Save this shard (parameters, optimizer tensors) as safetensors; blocks.

        The file's metadata holds the version, applied-gradient count, server index and
        job id, written atomically with the tensors (snapshot.save_atomic).
        """
        tensors = snap.shard_tensors(self.params, self.optimizer)
        snap.save_atomic(path, tensors, {
            "version": str(self.policy.version), "applied": str(self.policy.applied),
            "server": str(self.index), "job": self.job})

    def restore(self, path: str) -> dict[str, str]:
        """Load a shard saved by `snapshot`, return its metadata; errors name any key
        that does not match."""
        meta = snap.load_shard(path, self.params, self.optimizer)
        self.policy.version = int(meta.get("version", 0))
        return meta

