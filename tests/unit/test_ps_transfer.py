"""A live server taking a key range's state as its new tail (ps/transfer.py `accept`).

The server runs on a thread; a hand-made link plays the range's tail on the real
authenticated wire, its tensors through a shared-memory segment. Good `transfer` frames,
part by part, install the values and the optimizer state (bitwise what was sent) and the
head's version; a following `replicate` frame then steps the new copy exactly as the
head's SGD-momentum step. Frames out of order, of keys not being moved, of another dtype,
with more than a chunk of values, a repeated key, a part count out of range, clocks on
another part than the last, from a worker or from another server are each refused,
counted by reason, answered with an error naming op and field, and change nothing
(nothing is installed before the last good part). A real tail's transfer carries each
worker's push clock: a new tail that takes over skips a push re-sent across the switch.
"""

import threading
import time

import pytest
import torch
import zmq

from disttrain.ps import transfer
from disttrain.ps.frame import Message
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.server import Server
from disttrain.ps.transport import WorkerLink
from tests.unit.test_ps_replica import read_reply

KEY = bytes(range(32))
CHUNK = 256  # bytes: one key of 64 float32 per frame


def _opt(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


class NewTail:
    """Server Y of a 2-server job (1 worker, replicas=1) told to take server X's keys."""

    def __init__(self):
        torch.manual_seed(0)
        self.init = {"w": torch.randn(256)}
        plan = plan_keys([("w", 256, 4)], 2, chunk_bytes=CHUNK)
        self.x = max(range(2), key=lambda i: len(plan[i]))
        self.y = 1 - self.x
        self.keys = [c.key for c in plan[self.x]]
        assert len(self.keys) >= 2, plan
        self.server = Server(self.y, plan[self.y], self.init, Sync(), _opt, [0], KEY, timeout=60,
                             chunk_bytes=CHUNK)
        self.intake = transfer.accept(self.server, plan, self.init, _opt, self.x, self.keys,
                                      replicas=1, secret=KEY, chunk_bytes=CHUNK)
        self.ctx = zmq.Context()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.tail = self._link(1 + self.x, shm=True)
        self.worker = self._link(0, [c.key for c in plan[self.y]])

    def _serve(self):
        self.stats = self.server.serve()

    def _link(self, who: int, keys=(), shm: bool = False) -> WorkerLink:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.server.address)
        link = WorkerLink(sock, KEY, who, self.y, shm_bytes=1 << 16 if shm else 0)
        link.shm_from = 0  # NOTE: the tail's frames through shared memory, as on one host
        link.send(Message("hello", {"keys": list(keys), "policy": "Sync()", "replicas": 1}))
        assert self.read(link).op == "welcome"
        return link

    read = staticmethod(read_reply)

    def send(self, meta: dict, rows, link=None) -> Message:
        """rows: (key, value, momentum buffer or None); returns the reply."""
        fields = ["momentum_buffer"] if rows and rows[0][2] is not None else []
        names = [n for k, *_ in rows for n in [k] + [k + transfer.SEP + f for f in fields]]
        tensors = [t for _, v, b in rows for t in ([v] + ([b] if fields else []))]
        base = {"origin": self.x, "version": 5, "part": 0, "parts": 2, "fields": fields}
        (link or self.tail).send(Message("transfer", {**base, **meta}, names, tensors))
        return self.read(link or self.tail)


@pytest.mark.timeout(60)
def test_a_new_tail_installs_the_state_part_by_part_and_refuses_bad_frames():
    job = NewTail()
    a, b = job.keys[:2]
    rest = job.keys[2:]
    val = {k: torch.randn(64) for k in job.keys}
    buf = {k: torch.randn(64) for k in job.keys}
    bad = [
        ({"part": 1}, [(a, val[a], buf[a])], "schema:transfer.part"),  # out of order
        ({}, [("nope", val[a], buf[a])], "schema:transfer.keys"),  # not being moved
        ({}, [(a, val[a].double(), buf[a])], "schema:transfer.keys"),  # another dtype
        ({}, [(a, val[a], buf[a]), (b, val[b], buf[b])], "schema:transfer.keys"),  # > a chunk
        ({"parts": 1 << 21}, [(a, val[a], buf[a])], "schema:transfer.parts"),  # out of range
        ({"fields": ["momentum_buffer", "x"]}, [(a, val[a], buf[a])], "schema:transfer.keys"),
        ({"clocks": [{"worker": 0, "clock": 1, "keys": [a]}]}, [(a, val[a], buf[a])],
         "schema:transfer.clocks"),  # clocks on a part that is not the last
        ({"clocks": [{"worker": 0, "clock": 1}]}, [(a, val[a], buf[a])],
         "schema:transfer.clocks"),  # a row without its keys
    ]
    for meta, rows, reason in bad:
        reply = job.send(meta, rows)
        assert reply.op == "error" and reason in reply.meta["message"], (reason, reply)
    reply = job.send({}, [(a, val[a], buf[a])], link=job.worker)
    assert "not a replica link" in reply.meta["message"]
    assert not job.intake.staged and a not in job.server.chain.params  # nothing changed
    parts = 2 + len(rest)
    assert job.send({"parts": parts}, [(a, val[a], buf[a])]).meta == {"frame": 1}
    reply = job.send({"parts": parts, "part": 1}, [(a, val[a], buf[a])])  # the same key again
    assert "came twice" in reply.meta["message"]
    reply = job.send({"parts": parts, "part": 1, "version": 6}, [(b, val[b], buf[b])])
    assert "schema:transfer.version" in reply.meta["message"]
    assert a not in job.server.chain.params, "installed before the last part"
    for i, k in enumerate([b, *rest]):
        assert job.send({"parts": parts, "part": 1 + i}, [(k, val[k], buf[k])]).op == "commit"
    chain = job.server.chain
    for k in job.keys:  # bitwise what was sent
        p = chain.params[k]
        assert torch.equal(p.detach(), val[k])
        assert torch.equal(chain.optimizer.state[p]["momentum_buffer"], buf[k])
    assert chain.version[job.x] == 5 and job.intake.stats["keys"] == len(job.keys)
    # the next update is stepped on the new copy as the head steps it
    ref = torch.nn.Parameter(val[a].clone())
    ref_opt = _opt([ref])
    ref_opt.state[ref]["momentum_buffer"] = buf[a].clone()
    g = torch.randn(64)
    job.tail.send(Message("replicate", {"origin": job.x, "version": 6, "lr": 1.0, "final": 0},
                          [a], [g]))
    assert job.read(job.tail).meta == {"frame": 2 + len(rest) + 1}
    ref.grad = g
    ref_opt.step()
    assert torch.equal(chain.params[a].detach(), ref.detach())
    rejected = job.server.ep.rejected
    assert sum(rejected.values()) == len(bad) + 3 and rejected["schema:transfer.keys"] == 5
    job.worker.send(Message("done", {}))
    assert job.read(job.worker).op == "bye"
    job.tail.send(Message("replicate", {"origin": job.x, "version": 6, "lr": 1.0, "final": 1},
                          [], []))
    assert job.read(job.tail).op == "commit"
    job.thread.join(10)
    assert not job.thread.is_alive(), "the new tail ends once its head said final"
    job.tail.close()
    job.worker.close()
    job.ctx.term()


@pytest.mark.timeout(90)
def test_a_new_tail_that_takes_over_applies_a_push_resent_across_the_switch_once():
    """Async, replicas=1: server X heads 'w' and is extended to Y after the worker's
    pushes 0 and 1 (acknowledged). X dies; Y takes over from its transferred copy. The
    worker sends push 1 again (say its ack was lost): the route acknowledges it without
    applying it, because the transfer carried the worker's clock; push 2 is applied."""
    from disttrain.ps.policy import Async
    from disttrain.ps.takeover import Takeover
    from tests.unit.test_ps_takeover import _Ring

    torch.manual_seed(0)
    init = {"w": torch.randn(256)}
    plan = plan_keys([("w", 256, 4)], 2, chunk_bytes=CHUNK)
    x = max(range(2), key=lambda i: len(plan[i]))
    y, keys = 1 - x, [c.key for c in plan[x]]
    pol = repr(Async())
    servers = {i: Server(i, plan[i], init, Async(), _opt, [0], KEY, timeout=60,
                         chunk_bytes=CHUNK) for i in (x, y)}
    ext = transfer.extend(servers[x], plan, init, _opt, keys, y, servers[y].address,
                          replicas=1, secret=KEY, chunk_bytes=CHUNK, at_version=2)
    intake = transfer.accept(servers[y], plan, init, _opt, x, keys, replicas=1, secret=KEY,
                             chunk_bytes=CHUNK)
    threads = [threading.Thread(target=s.serve, daemon=True) for s in servers.values()]
    for t in threads:
        t.start()
    ctx = zmq.Context()

    def link(address, server, ks):
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        out = WorkerLink(sock, KEY, 0, server)
        out.send(Message("hello", {"keys": ks, "policy": pol, "replicas": 1}))
        assert read_reply(out, timeout=20).op == "welcome"
        return out

    to_x = link(servers[x].address, x, keys)
    to_y = link(servers[y].address, y, [c.key for c in plan[y]])
    grads = {c: [torch.randn(64) for _ in keys] for c in range(3)}
    for c in (0, 1):
        to_x.send(Message("push", {"clock": c, "version": c, "ack": 1}, keys, grads[c]))
        assert read_reply(to_x, timeout=20).op == "ack"
    end = time.monotonic() + 20
    while intake.stats is None:
        assert time.monotonic() < end, f"no transfer: {ext.stats}"
        time.sleep(0.02)
    cut = {k: servers[x].params[k].detach().clone() for k in keys}
    beat = _Ring()
    take = Takeover(servers[y], beat, plan, init, Async(), _opt, KEY, host="127.0.0.1",
                    chunk_bytes=CHUNK)
    beat.ring = {"version": 3, "servers": [{"server": x, "state": "dead"},
                                           {"server": y, "state": "alive"}]}
    while not beat.adopted:
        assert time.monotonic() < end, "Y never took over"
        time.sleep(0.02)
    route = take.routes[0][0]
    to_route = link(beat.adopted[0]["address"], x, keys)
    to_route.send(Message("push", {"clock": 1, "version": 1, "ack": 1}, keys, grads[1]))
    assert read_reply(to_route, timeout=20).op == "ack"
    assert route.policy.applied == 0, "a push the copy held was applied twice"
    assert all(torch.equal(route.params[k].detach(), cut[k]) for k in keys)
    to_route.send(Message("push", {"clock": 2, "version": 2, "ack": 1}, keys, grads[2]))
    assert read_reply(to_route, timeout=20).op == "ack"
    assert route.policy.applied == 1 and route.policy.version == 3
    assert servers[y].chain.clocks[x] == {0: (1, set(keys))}
    for out in (to_route, to_x, to_y):
        out.send(Message("done", {}))
        assert read_reply(out, timeout=20).op == "bye"
        out.close()
    for t in [*threads, take.routes[0][1]]:
        t.join(20)
        assert not t.is_alive()
    ctx.term()
