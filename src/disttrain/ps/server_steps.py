"""What a parameter server does with its policy's decisions (policy.py's `Decision`).

`Server` (server.py) runs the loop that reads frames and feeds the policy; it inherits
these steps, which carry out each answer: average the chosen gradients and step this
shard's keys (staleness.py), drop late ones, tell cancelled workers, answer released
pulls as a stream of chunk messages, and call a worker that stayed silent past the
timeout lost. With replicas (replica.py) acks and pull answers wait until every copy
committed and each stepped batch is forwarded. The state they use (params, the policy,
the endpoint, pushes received, parked pulls) is set by `Server.__init__`.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from disttrain.ps.frame import Message
from disttrain.ps.handle import PSError
from disttrain.ps.policy import Decision
from disttrain.ps.session import Session
from disttrain.trace import events as trace_events

__all__ = ["ServerSteps"]


class ServerSteps:
    """The steps that carry out a policy's decisions on a `Server` (server.py), which
    subclasses it; it is not built alone. Runs on the server's loop thread; never blocks."""

    def _execute(self, d: Decision) -> None:
        if d.error:
            for s in self.ep.active.values():
                self.ep.send(s, Message("error", {"message": d.error}))
            raise PSError(f"server {self.index}: {d.error}")
        if self.chain is not None:
            self.chain.pushes = [self.clocks[p] for p in d.apply]
        for p in [*d.apply, *d.drop]:
            self.clocks.pop(p, None)
        if d.apply:
            with trace_events.span("apply", "ps", server=self.index, pushes=len(d.apply)):
                self._apply([self.complete.pop(p) for p in d.apply], d.staleness)
                trace_events.ps_applied(self.index, d.apply, self.policy.version)
            self._after_update()
            if self.chain is not None:
                self.chain.mark(self.policy.version)
        for p in [*d.apply, *d.drop]:
            self.complete.pop(p, None)
            self._ack_later(self.push_acks.pop(p, []))
        for w in d.cancel:
            if w in self.ep.active:
                self.ep.send(self.ep.active[w], Message("cancel", {"version": self.policy.version}))
        if self.chain and self.policy.per_batch and self.chain.r == 1:
            # NOTE: ack on receipt, as with no copies, any round while a chain of replicas=1
            # copies keys to a joining or draining server: its half-filled round would wait
            # for a push that a worker blocked on this ack never sends (KBatchSync cancels a
            # worker mid-push, so two servers' rounds can hold different workers' pushes).
            # The owner hands over only with no received push unapplied (join_moves.py,
            # move.py), so each is still applied here and copied before the keys move. With
            # replicas >= 2 the worker waits for `held` instead (Server.says_held).
            for pid, _, _ in self.policy.buffer:
                self._ack_later(self.push_acks.pop(pid, []))
        for w in [w for w in d.release if w in self.parked]:
            answer = partial(self._send_params, w, self.parked.pop(w))
            if self.chain is None:
                answer()
            else:  # NOTE: a pull sees only what every copy has
                self.chain.when_committed(answer)

    def _ack_later(self, sessions: list[Session]) -> None:
        """Ack these push frames once all this head applied is on every copy (replicas)."""
        for s in sessions:
            self.chain.when_committed(lambda s=s: self.ep.send(s, Message("ack")))

    def _apply(self, grads: list[dict[str, torch.Tensor]], staleness: list[int]) -> None:
        """Average `grads` (dicts over the same keys, of these staleness values) and step
        those keys' parameters under the policy's update rule (staleness.py)."""
        staleness = [s for g, s in zip(grads, staleness) if g]
        grads = [g for g in grads if g]
        if self.optimizer is None or not grads:
            return
        keys = list(grads[0])
        batches = [keys] if self.chain is None else self.chain.batches(
            keys, [self.params[k].numel() * self.params[k].element_size() for k in keys])
        for batch in batches:
            for k in batch if self._sending else []:
                # NOTE: copy on write: a zero-copy params frame may still read this memory
                if any(not t.done for t in self._sending.pop(k, [])):
                    self.params[k].data = self.params[k].data.clone()
            # NOTE: a key stepped alone with one unscaled gradient steps on the received buffer
            stepped, hyper = self.stepper.apply([self.params[k] for k in batch],
                                                [[g[k] for k in batch] for g in grads],
                                                staleness, self.policy.mean_staleness,
                                                keep=self.chain is not None)
            if self.chain is not None:  # NOTE: batch by batch: the copy overlaps the next
                self.chain.forward(self.chain.index, dict(zip(batch, stepped)), self.policy.version,
                                   hyper)

    def _send_params(self, w: int, have: int) -> None:
        """Answer worker w's pull: the shard as a stream of chunk messages, the last one
        marked, the first one carrying the ack of w's push if it is owed (`acks`); an
        unchanged shard costs one empty message. Does not block."""
        version, session, ack = self.policy.version, self.ep.active[w], self.acks.pop(w, 0)
        groups = self._groups if have != version and self._groups else [[]]
        for i, keys in enumerate(groups):
            meta = {"version": version, "last": int(i == len(groups) - 1), "ack": ack * (i == 0)}
            tensors = [self.params[k].detach() for k in keys]
            tracker = self.ep.send(session, Message("params", meta, keys, tensors), track=True)
            if tracker is not None:  # NOTE: sent without a copy: see _apply
                for k in keys:
                    self._sending.setdefault(k, []).append(tracker)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w not in self.finished and now - self.last_seen[w] > self.timeout:
                self.finished.add(w)
                self.partial.pop(w, None)
                self._execute(self.policy.lost(w))
