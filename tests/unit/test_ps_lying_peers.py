"""Peers with a valid session that lie, on the real wire: a server answering a worker's
push `held` or `ack` for a push it was never sent, and a worker's hello to an old owner
naming a mix of the keys it handed over and the ones it kept. Each is refused with a
message naming the sender and what was wrong, acts on nothing, and never hangs.
(The join's server-to-server and manager refusals: test_ps_join_head.py,
test_ps_join_status.py, test_ps_transfer.py.)
"""

import threading
import time

import pytest
import torch
import zmq

from disttrain.ps.frame import Message
from disttrain.ps.join_tails import join_intakes
from disttrain.ps.joiner import _Joiner
from disttrain.ps.manager import _answer
from disttrain.ps.membership_file import to_json
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.schema import check
from disttrain.ps.server import PSError
from disttrain.ps.session import HELLO, Session, hello_key, new_nonce, open_hello, read_envelope
from disttrain.ps.transfer import SEP
from disttrain.ps.worker import Worker
from tests.unit.test_ps_join import MLP
from tests.unit.test_ps_join_head import _hello, _pump
from tests.unit.test_ps_join_status import _joined
from tests.unit.test_ps_join_tails import CHUNK, INIT, KEY, OPT


class ScriptedServer:
    """A ROUTER speaking the real handshake: welcomes the worker, answers each beat with a
    pong (so a worker that ignored a lie would hang, not time out) and each push or pull
    with the next of `script`'s lists of replies (op names; `ack` and `held` carry no
    meta), then with nothing."""

    def __init__(self, script: list[list[str]]):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.script, self.stop = list(script), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        session = None
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, *parts = self.sock.recv_multipart()
            env = read_envelope(parts)
            if env.kind == HELLO:
                hello = open_hello(hello_key(KEY), env, parts)
                session = Session(KEY, env.nonce_w, new_nonce(), hello.meta["worker"], 0,
                                  "server")
                replies = [Message("welcome", {"version": 0})]
            else:
                op = session.open(env, parts).op
                replies = ([Message("pong", {})] if op == "beat" else
                           [Message(r) for r in self.script.pop(0)] if op in ("push", "pull")
                           and self.script else [])
            for m in replies:
                self.sock.send_multipart([ident, *session.seal(m)])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def _push(worker: Worker, model: torch.nn.Module):
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    return worker.push()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("held_acks,script,op,why", [
    (True, [["held", "ack"], ["held"]], "held", "1 push frames asked for one, this is held 2"),
    (True, [["held", "held"]], "held", "this is held 2"),  # a duplicate held
    (True, [["held"]], "held", None),  # before any push: the pull gets it
    (False, [["held"]], "held", "its policy and replicas get no held"),
    (False, [["ack", "ack"]], "ack", "this is ack 2"),  # an ack of an acknowledged push
    (True, [["ack"]], "ack", "came before that push's held"),
], ids=["after-its-ack", "twice", "no-push", "not-asked", "ack-twice", "ack-first"])
def test_a_held_or_ack_answering_no_push_fails_the_worker_naming_the_server(
        held_acks, script, op, why):
    no_push = why is None
    server = ScriptedServer(script)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    plan = plan_keys([(n, p.numel(), 4) for n, p in model.named_parameters()], 1)
    worker = Worker(model, 0, [server.address], plan, KEY, "Sync()", timeout=10,
                    overlap=False, held_acks=held_acks)
    t0 = time.monotonic()
    with pytest.raises(PSError) as e:
        if not no_push:
            handle = _push(worker, model)
            if script[0] == ["held", "ack"]:  # a good answer first: it completes the push
                handle.wait()
                assert worker.wire_stats()["rejected"] == {}
        worker.pull().wait()  # NOTE: a lie is never taken for the answer awaited
    assert time.monotonic() - t0 < 5, "raised by the timeout, not by the refusal"
    text = str(e.value)
    assert (f"server 0 at {server.address} answered {op} for a push this worker did not "
            "send it, refused" in text), text
    assert why is None or why in text, text
    assert worker.wire_stats()["rejected"] == {f"unasked {op}": 1}
    worker.close()
    assert not worker._thread.is_alive()
    server.close()


# ---- a joiner's and a copy's intake (replicas = 2): transfer and handed markers --------
def _joiner(seed: int = 3):
    """A joiner (server 2 of a 2-server job, r = 2) with its intakes, served on this
    thread (`_pump`); (joiner, plan, init, intakes, stand-in tail links by pair)."""
    torch.manual_seed(seed)
    init = {name: torch.randn(size) for name, size in INIT.items()}
    spec = [(name, t.numel(), 4) for name, t in init.items()]
    plan = plan_keys(spec, 2, chunk_bytes=CHUNK)
    y = _Joiner(2, [], init, Sync(), OPT, [0, 1], KEY, timeout=60)
    intakes = join_intakes(y, spec, plan, init, OPT, 2, secret=KEY, chunk_bytes=CHUNK)
    assert sorted(intakes) == [(0, 1), (1, 0)], intakes  # each server gives keys, the other copies
    return y, plan, init, intakes


def _transfer(link, keys: list[str], vals: dict, bufs: dict, **meta) -> None:
    names = [n for k in keys for n in (k, k + SEP + "momentum_buffer")]
    tensors = [t for k in keys for t in (vals[k], bufs[k])]
    link.send(Message("transfer", {"origin": 0, "version": 3, "part": 0, "parts": 1,
                                   "fields": ["momentum_buffer"], "clocks": [], **meta},
                      names, tensors))


@pytest.mark.timeout(60)
def test_a_joiners_intake_refuses_transfers_and_handed_markers_that_lie():
    """Transfers of keys another tail sends, naming another head, of a wrong dtype or
    shape (a value's, or a state tensor's against what the job's optimizer keeps: a
    scalar momentum made the first update raise in the joiner's loop), or a second copy; `handed` markers of keys another link carries, of another
    head, repeated, or a second time: each refused naming the sender and the field,
    nothing installed or recorded; the true ones then install bitwise and commit."""
    y, plan, init, intakes = _joiner()
    ctx = zmq.Context()
    mine, theirs = sorted(intakes[(0, 1)].chunks), sorted(intakes[(1, 0)].chunks)
    vals = {k: torch.randn(c.numel) for (_, _), i in intakes.items() for k, c in i.chunks.items()}
    bufs = {k: torch.randn(v.numel()) for k, v in vals.items()}
    tail = _hello(ctx, y.address, 2 + 1, 2, [], 2)  # server 1: the tail of server 0's keys
    assert _pump(y, tail).op == "welcome"
    k0 = mine[0]
    lies = [  # (frame's changes, reason)
        (dict(keys=theirs[:1]), "schema:transfer.keys"),  # server 0 tails these, not 1
        (dict(origin=1), "schema:transfer.origin"),  # server 1 heads none of them
        (dict(vals={**vals, k0: vals[k0].double()}), "schema:transfer.keys"),  # never cast
        (dict(vals={**vals, k0: vals[k0].to(torch.bfloat16)}), "schema:transfer.keys"),
        (dict(vals={**vals, k0: torch.randn(vals[k0].numel() + 1)}), "schema:transfer.keys"),
        (dict(bufs={**bufs, k0: bufs[k0].double()}), "schema:transfer.keys"),
        (dict(bufs={**bufs, k0: bufs[k0][:-1]}), "schema:transfer.keys"),
        (dict(bufs={**bufs, k0: torch.tensor(0.5)}), "optimizer state"),  # SGD's is 1-D
    ]
    for change, reason in lies:
        change = dict(change)
        _transfer(tail, change.pop("keys", mine), change.pop("vals", vals),
                  change.pop("bufs", bufs), **change)
        reply = _pump(y, tail)
        assert reply.op == "error" and reason in reply.meta["message"] and (
            "refused a transfer frame from server 1" in reply.meta["message"]), (reason, reply)
    assert not any(i.staged or i.stats for i in intakes.values())
    assert not y.chain.params and y.chain.received[2 + 1] == 0  # nothing installed
    _transfer(tail, mine, vals, bufs)
    assert _pump(y, tail).meta == {"frame": 1}
    for k in mine:  # bitwise what was sent, dtype kept
        p = y.chain.params[k]
        assert torch.equal(p.detach(), vals[k]) and torch.equal(
            y.chain.optimizer.state[p]["momentum_buffer"], bufs[k])
    assert y.chain.version[0] == 3 and 1 not in y.chain.version
    _transfer(tail, mine[:1], vals, bufs)  # a second copy of an installed key
    reply = _pump(y, tail)
    assert reply.op == "error" and "only, once" in reply.meta["message"], reply.meta
    other = _hello(ctx, y.address, 2 + 0, 2, [], 2)  # server 0: the tail of server 1's keys
    assert _pump(y, other).op == "welcome"
    _transfer(other, theirs, vals, bufs, origin=1)
    assert _pump(y, other).meta == {"frame": 1}
    meta = {"origin": 0, "version": 4, "lr": 1.0, "final": 0}
    for change, why in [
        (dict(origin=1, handed=theirs[:1]), "no keys"),  # server 0's link carries them
        (dict(handed=theirs[:1]), "no keys"),  # of another head, on another link
        (dict(origin=1, handed=mine[:1]), "of server 1 from it"),  # of another head
        (dict(handed=[*mine[:1], *mine[:1]]), "names a key twice"),
        (dict(handed=mine[:1], final=1), "or is final"),
        (dict(handed=mine[:1], tensors=[vals[mine[0]]]), "carries tensors"),  # an update
    ]:
        tensors = change.pop("tensors", [])
        tail.send(Message("replicate", {**meta, **change}, mine[:len(tensors)], tensors))
        reply = _pump(y, tail)
        assert reply.op == "error" and why in reply.meta["message"] and (
            "refused a handed marker from server 1" in reply.meta["message"]), reply.meta
    assert not y.chain.handed and y.chain.received[2 + 1] == 1
    tail.send(Message("replicate", {**meta, "handed": mine}))
    assert _pump(y, tail).meta == {"frame": 2}
    assert y.chain.handed[0] == set(mine) and y.chain.version[0] == 4
    tail.send(Message("replicate", {**meta, "version": 5, "handed": mine[:1]}))  # again
    reply = _pump(y, tail)
    assert reply.op == "error" and "handed" in reply.meta["message"] and (
        "over already" in reply.meta["message"]), reply.meta
    assert y.chain.version[0] == 4 and y.chain.received[2 + 1] == 2  # nothing changed
    assert y.ep.rejected == {"schema:transfer.keys": 7, "schema:transfer.origin": 1,
                             "schema:transfer.worker": 1, "schema:replicate.handed": 7}
    assert y.chain.received[2 + 0] == 1 and 1 not in y.chain.handed
    assert torch.equal(y.chain.params[mine[0]].detach(), vals[mine[0]])  # no update applied
    other.close()
    tail.close()
    y.close()
    ctx.term()


# ---- the manager: a report's `adopted` and `copied` rows that lie --------------------------
def _report(m, by: int, **rows) -> Message:
    beat = {"server": by, "ring": m.version, "version": 0, "pushes": 0, "final": 0,
            "accepting": -1, "drained": 0, **rows}
    check(Message("report", {**beat, "worker": 0}), "manager")  # NOTE: the lie is in values
    return _answer(m, Message("report", beat), 3.0, {})


@pytest.mark.parametrize("why", ["old-owner-route", "joiner-of-itself", "partly-true",
                                 "copier-is-owner", "not-a-member", "not-its-tail",
                                 "more-keys"])
def test_the_manager_refuses_report_rows_no_join_makes_and_records_nothing(why):
    """3 servers (r = 2) and a joiner 3: a route of an alive old owner's keys reported by
    another old owner or by the joiner for itself, a batch with one true route and one
    false, a copy whose copier is no member, or, to the joiner, is the owner itself (a
    recopy's may be) or the joiner, tail of none of the owner's chains, or of more keys
    than it tails: each refused naming
    the reporter and the field, nothing recorded (the ring's version and state as before)."""
    m, plan, moves, _ = _joined(MLP, 3, 2)
    x = moves[0].before[0]
    tail = moves[0].before[-1]
    other = next(i for i in range(3) if i not in moves[0].before)
    route = dict(m.takeovers[0], by=3)
    m.takeovers.clear()
    tails = sum(plan.indices(c.key, 2)[-1] == tail for c in plan[x])
    copy = {"server": x, "by": tail, "to": 3, "keys": 1, "bytes": 4, "version": 2}
    by, rows, match = {
        "old-owner-route": (other, dict(adopted=[dict(route, server=x, by=other)]),
                            f"server {other} reports in `adopted` a route of alive server {x}"),
        "joiner-of-itself": (3, dict(adopted=[dict(route, server=3)]), "alive server 3"),
        "partly-true": (3, dict(adopted=[route, dict(route, server=9)]), "does not mark dead"),
        "copier-is-owner": (3, dict(copied=[dict(copy, by=x)]), "the tail of 0 of"),
        "not-a-member": (3, dict(copied=[dict(copy, by=9)]), "must be members"),
        "not-its-tail": (3, dict(copied=[dict(copy, by=3)]), "the tail of 0 of"),  # itself
        "more-keys": (3, dict(copied=[dict(copy, keys=tails + 1)]), f"the tail of {tails} of"),
    }[why]
    version, state = m.version, to_json(m)
    reply = _report(m, by, **rows)
    assert reply.op == "error" and match in reply.meta["message"], reply.meta
    assert reply.meta["message"].startswith(f"server manager refused report: server {by} ")
    assert m.version == version and to_json(m) == state and not m.takeovers
    true = {"adopted": [route]} if "adopted" in rows else {"copied": [copy]}
    assert _report(m, 3, **true).op == "ring" and m.version == version + 1  # the true row


def test_a_route_of_an_alive_old_owner_is_taken_from_a_dead_joiner_only():
    """After a join (r = 2) the joiner serves old owner x's moved keys as a route; once the
    ring marks the joiner dead, their first live copy serves them as a route of x
    (takeover.py's `_joiner_routes`): the manager takes that row then, and refuses it while
    the joiner is alive (the "old-owner-route" lie above)."""
    m, plan, moves, _ = _joined(MLP, 3, 2)
    x = moves[0].before[0]
    heir = moves[0].before[1]  # NOTE: the first copy after the head of x's moved chain
    row = dict(m.takeovers[0], by=heir, address="ipc://heir")
    assert m.takeovers[0]["server"] == x and m.takeovers[0]["by"] == 3
    reply = _report(m, heir, adopted=[row])
    assert reply.op == "error" and f"a route of alive server {x}" in reply.meta["message"]
    for i in range(3):
        m.members[i].beat = 100.0  # NOTE: the old servers beat on: only the joiner dies
    assert m.expire(now=100.0, timeout=5.0) and m.members[3].state == "dead"
    version = m.version
    assert _report(m, heir, adopted=[row]).op == "ring" and m.version == version + 1
    assert any(t["server"] == x and t["by"] == heir for t in m.takeovers)
