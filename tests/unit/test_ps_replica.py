"""Replica chains (ps/replica.py, HashRing.chain) and a live replica's checks.

The ring's chain of a key is its owner then the next distinct servers clockwise, and
refuses more replicas than servers naming both numbers. A live server that holds a copy
(the tail of a 2-server chain) is driven by a hand-made predecessor link, on the real
authenticated wire: a good `replicate` frame takes the same SGD-momentum step as the head
would and is committed; frames with a bad lr, momentum, origin, keys, an unknown field,
a replicate from a worker, and a worker op from a replica link are each refused, counted,
answered with an error naming op and field, and change nothing.
"""

import threading
import time

import pytest
import torch
import zmq

from disttrain.ps.chain import chains, check_replicas
from disttrain.ps.frame import Message
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.replica import Replicas
from disttrain.ps.ring import HashRing
from disttrain.ps.server import PSError, Server
from disttrain.ps.transport import WorkerLink

KEY = bytes(range(32))


def test_chain_is_the_owner_then_the_next_distinct_servers_clockwise():
    ring = HashRing([f"server{i}" for i in range(5)], vnodes=16)
    for i in range(200):
        key = f"layer{i}.weight"
        for r in range(1, 6):
            chain = ring.chain(key, r)
            assert chain[0] == ring.owner(key) and len(set(chain)) == len(chain) == r
            assert chain == ring.chain(key, 5)[:r]  # a longer chain extends a shorter one
    with pytest.raises(ValueError, match=r"r=6 servers needs 1 <= r <= the number of servers \(5\)"):
        ring.chain("x", 6)


def test_chains_start_at_the_plans_owner_and_bad_replicas_are_refused():
    plan = plan_keys([(f"p{i}", 10, 4) for i in range(40)], 4)
    got = chains(plan, 3)
    assert all(got[c.key][0] == s for s, keys in enumerate(plan) for c in keys)
    with pytest.raises(ValueError, match="replicas=5 needs at least 5 servers, the job has 4"):
        check_replicas(5, 4)
    with pytest.raises(ValueError, match="with snapshot="):
        check_replicas(2, 4, "ps{server}.safetensors")
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        check_replicas(0, 4)


def read_reply(link: WorkerLink, timeout: float = 10.0) -> Message:
    """The next message on `link` that is not a pong (blocks up to `timeout` s)."""
    end = time.monotonic() + timeout
    while link.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
        got = link.recv()
        if got is not None and got.op != "pong":
            return got
    raise TimeoutError("no reply")


class Tail:
    """A live server holding a copy of the one key "w" (the tail of its 2-server chain),
    its predecessor's link and a worker's link, all on real sockets."""

    def __init__(self):
        torch.manual_seed(0)
        self.init = {"w": torch.randn(64)}
        plan = plan_keys([("w", 64, 4)], 2)
        self.head = next(i for i in range(2) if plan[i])
        self.index = 1 - self.head  # holds no key of its own, so it has no links itself
        opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
        self.server = Server(self.index, plan[self.index], self.init, Sync(), opt, [0], KEY)
        self.server.chain = Replicas(self.index, 1, plan, 2, self.init, opt, Sync(),
                                     self.server.ep, KEY, timeout=30)
        self.server.chain.connect({})
        self.ctx = zmq.Context()
        self.stats = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.pred = self._link(1 + self.head, ["w"])
        self.worker = self._link(0, [])

    def _serve(self):
        self.stats = self.server.serve()

    def _link(self, who: int, keys: list[str]) -> WorkerLink:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.server.address)
        link = WorkerLink(sock, KEY, who, self.index)
        link.send(Message("hello", {"keys": keys, "policy": "Sync()", "replicas": 2}))
        assert self.read(link).op == "welcome"
        return link

    read = staticmethod(read_reply)

    def copy(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        p = self.server.chain.params["w"]
        buf = self.server.chain.optimizer.state.get(p, {}).get("momentum_buffer")
        return p.detach().clone(), None if buf is None else buf.clone()

    def close(self) -> None:
        for link in (self.pred, self.worker):
            link.close()
        self.ctx.term()

    def finish(self, version: int = 4) -> None:
        """The worker says done, the head its final: the server ends (blocks until it does)."""
        self.worker.send(Message("done", {}))
        assert self.read(self.worker).op == "bye"
        assert self.replicate({"final": 1, "version": version}, keys=[], tensors=[]).op == "commit"
        self.thread.join(10)
        assert not self.thread.is_alive(), "the copy ends once its head said final"
        self.close()

    def replicate(self, meta: dict, keys=("w",), tensors=None, link=None) -> Message:
        tensors = [torch.ones(64)] if tensors is None else tensors
        base = {"origin": self.head, "version": 1, "lr": 1.0, "final": 0}
        (link or self.pred).send(Message("replicate", {**base, **meta}, list(keys), tensors))
        return self.read(link or self.pred)


@pytest.mark.timeout(60)
def test_a_live_copy_steps_as_the_head_and_refuses_bad_replicate_frames():
    job = Tail()
    ref = torch.nn.Parameter(job.init["w"].clone())
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    g = torch.randn(64)
    assert job.replicate({}, tensors=[g]).meta == {"frame": 1}
    ref.grad = g
    ref_opt.step()
    value, buf = job.copy()
    assert torch.equal(value, ref.detach()) and torch.equal(buf, ref_opt.state[ref]["momentum_buffer"])
    bad = [({"lr": float("nan")}, "schema:replicate.lr"), ({"lr": 2.0}, "schema:replicate.lr"),
           ({"momentum": -0.5}, "schema:replicate.momentum"), ({"lr": 1}, "schema:replicate.lr"),
           ({"origin": job.index}, "schema:replicate.origin"), ({"x": 1}, "unknown-field"),
           ({"version": -1}, "schema:replicate.version")]
    for meta, reason in bad:
        reply = job.replicate(meta)
        assert reply.op == "error" and reason.split(".")[-1] in reply.meta["message"], reply
    reply = job.replicate({}, keys=["v"])
    assert reply.op == "error" and "schema:replicate.keys" in reply.meta["message"]
    reply = job.replicate({}, tensors=[torch.ones(64, dtype=torch.float64)])
    assert "must be 1-D torch.float32 of 64" in reply.meta["message"]
    reply = job.replicate({}, link=job.worker)  # a worker is no replica link
    assert "not a replica link" in reply.meta["message"]
    job.pred.send(Message("pull", {"have": -1}))  # a replica link is no worker
    assert "it sends hello, replicate and beat" in job.read(job.pred).meta["message"]
    value2, buf2 = job.copy()
    assert torch.equal(value2, value) and torch.equal(buf2, buf)  # nothing refused applied
    assert job.server.ep.rejected["not a replica link"] == 1
    assert job.server.ep.rejected["not a worker"] == 1
    assert job.server.ep.rejected["schema:replicate.lr"] == 3
    job.finish(version=4)
    assert job.stats["replica_versions"] == {str(job.head): 4}
    assert [r["role"] for r in job.stats["ranges"]] == ["tail"]


@pytest.mark.timeout(60)
def test_a_copy_steps_with_the_lr_factor_and_momentum_the_head_used():
    job = Tail()
    ref = torch.nn.Parameter(job.init["w"].clone())
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for g, lr, m in ((torch.randn(64), 0.5, None), (torch.randn(64), 0.25, 0.4)):
        meta = {"lr": lr} if m is None else {"lr": lr, "momentum": m}
        assert job.replicate(meta, tensors=[g]).op == "commit"
        ref.grad = g
        ref_opt.param_groups[0].update(lr=0.1 * lr, momentum=0.9 if m is None else 0.9 - m)
        ref_opt.step()
    value, buf = job.copy()
    assert torch.equal(value, ref.detach()) and torch.equal(buf, ref_opt.state[ref]["momentum_buffer"])
    group = job.server.chain.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.1, 0.9)  # the user's values restored
    job.finish()


class Head:
    """A live head of the one key "w" (Sync, one worker) whose next server is a stand-in
    that holds its commits back: a real ServerEndpoint on a ROUTER, driven by the test."""

    def __init__(self, timeout: float = 30):
        from disttrain.ps.transport import ServerEndpoint, bind

        torch.manual_seed(0)
        self.init = {"w": torch.randn(64)}
        plan = plan_keys([("w", 64, 4)], 2)
        self.index = next(i for i in range(2) if plan[i])
        self.next = 1 - self.index
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        addr, self.folder = bind(sock, "127.0.0.1")
        self.succ = ServerEndpoint(sock, KEY, self.next, [1 + self.index])
        opt = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
        self.server = Server(self.index, plan[self.index], self.init, Sync(), opt, [0], KEY)
        self.server.chain = Replicas(self.index, 1, plan, 2, self.init, opt, Sync(),
                                     self.server.ep, KEY, timeout=timeout)
        self.server.chain.connect({self.next: addr})
        self.error = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        wsock = self.ctx.socket(zmq.DEALER)
        wsock.connect(self.server.address)
        self.worker = WorkerLink(wsock, KEY, 0, self.index)
        self.worker.send(Message("hello", {"keys": ["w"], "policy": "Sync()", "replicas": 2}))
        hello = self.frame()
        assert hello[1].op == "hello" and hello[1].meta["keys"] == ["w"]
        self.succ.send(hello[0], Message("welcome", {"version": 0}))
        assert Tail.read(self.worker).op == "welcome"

    def close(self) -> None:
        from disttrain.ps.transport import remove_folder

        self.worker.close()
        self.succ.close()
        self.ctx.term()
        remove_folder(self.folder)

    def _serve(self):
        try:
            self.server.serve()
        except PSError as e:
            self.error = e

    def frame(self, wait: float = 10.0):
        """The next (session, message) the stand-in receives, beats skipped; None if none."""
        end = time.monotonic() + wait
        while self.succ.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
            got = self.succ.recv()
            if got is not None and got[1].op != "beat":
                return got
        return None


@pytest.mark.timeout(60)
def test_a_push_is_acknowledged_and_a_pull_answered_only_once_the_copy_committed():
    job = Head()
    g = torch.randn(64)
    job.worker.send(Message("push", {"clock": 0, "version": 0, "ack": 1}, ["w"], [g]))
    job.worker.send(Message("pull", {"have": 0}))
    session, rep = job.frame()
    assert rep.op == "replicate" and rep.keys == ["w"] and torch.equal(rep.tensors[0], g)
    assert rep.meta["origin"] == job.index and rep.meta["version"] == 1
    assert not job.worker.sock.poll(500), "acked or answered before the copy committed"
    job.succ.send(session, Message("commit", {"frame": 1}))
    ack = Tail.read(job.worker)
    params = Tail.read(job.worker)
    assert (ack.op, params.op) == ("ack", "params") and params.meta["version"] == 1
    assert torch.equal(params.tensors[0], torch.add(job.init["w"], g, alpha=-0.1))
    job.worker.send(Message("done", {}))
    assert Tail.read(job.worker).op == "bye"
    session, final = job.frame()
    assert final.meta["final"] == 1 and final.keys == []
    assert job.thread.is_alive(), "the head left before its final was committed"
    job.succ.send(session, Message("commit", {"frame": 2}))
    job.thread.join(10)
    assert not job.thread.is_alive()
    job.close()


@pytest.mark.timeout(60)
def test_a_silent_copy_stops_its_head_naming_it_and_the_worker_hears_why():
    job = Head(timeout=2)
    job.worker.send(Message("push", {"clock": 0, "version": 0, "ack": 1}, ["w"],
                            [torch.randn(64)]))
    assert job.frame()[1].op == "replicate"  # and the stand-in never commits it
    job.thread.join(15)
    assert not job.thread.is_alive()
    err = Tail.read(job.worker)
    assert err.op == "error" and f"replica server {job.next} at ipc://" in err.meta["message"]
    assert "1 replicate frames uncommitted" in err.meta["message"] == str(job.error)
    job.close()
