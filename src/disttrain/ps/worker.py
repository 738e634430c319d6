"""The worker side of a parameter server: ps-lite's push / pull / wait on a torch model.

`Worker.pull()` asks every server for its shard and writes the answer into the model's
parameters; `Worker.push()` sends the model's gradients; both return a `Handle`
(handle.py) at once and `Handle.wait()` blocks. All sockets live on one background
thread (compute and upload on separate threads, as the user's documents describe): with
`overlap=True` a parameter's gradient is pushed from its post-accumulate-grad hook while
backward still runs for the layers below it.

Who talks to whom: the compute thread queues commands, the communication thread
(worker_loop.py, which `Worker` inherits) owns one `WorkerLink` (transport.py) per
server. Cancellation (KSync, KBatchSync) raises `Cancelled` from the next hook, `push()`
or `sleep()`; top-k pushes go through compress.py. How both behave:
docs/design/parameter-server.md ("Notes from ps/worker.py").
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

import torch
import zmq

from disttrain.ps.compress import ErrorFeedback, TopK
from disttrain.ps.frame import DEFAULT_LIMITS, Limits, Message, group_keys
from disttrain.ps.handle import Cancelled, Handle  # re-exported: disttrain.ps.worker.Handle
from disttrain.ps.reroute import Routes
from disttrain.ps.ring import DEFAULT_CHUNK_BYTES, Chunk
from disttrain.ps.server import PSError
from disttrain.ps.shm import ring_bytes
from disttrain.ps.transport import WorkerLink, encrypt_setting, mac_setting, shm_setting
from disttrain.ps.worker_loop import WAIT, WorkerLoop, fuse
from disttrain.trace import events as trace_events

__all__ = ["Worker", "Handle", "Cancelled", "fuse"]


class Worker(WorkerLoop):
    """One worker's connection to all servers; built by `disttrain.ps.connect`. The
    compute thread's API; the communication thread's loop is `WorkerLoop` (worker_loop.py).
    `held_acks`: a push waits for each server's `held`, not its ack (Server.says_held).
    `wait`: seconds a reply a live server does not send is waited for (default 600, as
    torch's collective timeout; worker_loop.py, `WorkerLoop._unanswered`)."""

    def __init__(self, model: torch.nn.Module, rank: int, addresses: list[str],
                 plan: list[list[Chunk]], secret: bytes, policy_repr: str, *,
                 timeout: float = 10.0, overlap: bool = True, limits: Limits = DEFAULT_LIMITS,
                 compression: TopK | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 encrypt: bool | None = None, always_mac: bool | None = None,
                 shm: bool | None = None, replicas: int = 1, manager: str | None = None,
                 held_acks: bool = False, wait: float | None = None):
        self.rank, self.addresses, self.timeout, self.overlap = rank, addresses, timeout, overlap
        self.wait_limit = wait if wait is not None else WAIT
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
        self._secret, self._limits, self.held_acks = secret, limits, held_acks
        self._by_key = {c.key: c for chunks in plan for c in chunks}
        self._shards = [{c.key: (c.stop - c.start, self.params[c.name].dtype) for c in chunks}
                        for chunks in plan]  # what server s may send: schema.check_keys
        self.feedback = ErrorFeedback(compression) if compression is not None else None
        self._eps: list[WorkerLink] = []
        self._version, self._floor = [-1] * len(addresses), [-1] * len(addresses)
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

        The handle completes when every server received them (with replicas >= 2, once
        applied on every copy; but on receipt, `held`, under a policy whose rounds hold
        pushes of workers free to push again, Policy.runs_ahead, the frames a takeover may
        need sent again copied first); until then the frames read `.grad` without a copy,
        so wait() before changing gradients in place (`zero_grad()`'s default, set_to_none,
        is safe at any time). Raises Cancelled if the round closed without this worker (the
        step is dropped; pull() next).
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
            self._attempt = Handle(self._raise_if_failed, "push", f"clock {self._clock}")
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
                           "held" if self.held_acks else "ack")

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
