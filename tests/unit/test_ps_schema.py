"""Header schemas (ps/schema.py) and the wire protocol version, against live peers.

Every frame here is well signed (built with a real Session, so its MAC verifies): only
its header is wrong. A live server (Sync, two workers, real ZeroMQ sockets) is fed
missing, mistyped, out-of-range and unknown meta fields, wrong tensor counts and ops
sent the wrong way, between real pushes: it refuses each, counts it per field, answers
an error naming op and field, keeps serving both workers, and its parameters end
bitwise equal to an unfuzzed twin run's. A real `Worker` facing a server that answers
such nonsense raises a PSError naming the server and the field at once. A peer of
another protocol version is refused with both versions named, on both sides.
"""

import threading
import time
from collections import Counter
from functools import cache

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain.ps.connect import format_stats
from disttrain.ps.frame import OPS, PROTOCOL, Message
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.schema import SCHEMA, SchemaError, check
from disttrain.ps.server import PSError, Server
from disttrain.ps.session import (
    HELLO,
    Session,
    hello_key,
    new_nonce,
    open_hello,
    read_envelope,
    seal_hello,
)
from disttrain.ps.transport import WorkerLink
from disttrain.ps.worker import Worker

KEY = bytes(range(32))
KEYS = ["w#0", "w#1"]
STEPS = 3
FUZZ = settings(max_examples=12, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- a live server driven by two WorkerLinks -------------------------------------------
def _grads(step: int, w: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + w)
    return [torch.randn(4, generator=g) for _ in KEYS]


def _read(sock: zmq.Socket, recv, wait: float = 10.0):
    """The next message `recv` accepts from `sock`, or None after `wait` seconds."""
    end = time.monotonic() + wait
    while sock.poll(max(1, int((end - time.monotonic()) * 1000))):
        got = recv()
        if got is not None:
            return got
    return None


class Live:
    """A Sync server (SGD with momentum on w, keys w#0 and w#1) serving on a thread."""

    def __init__(self, shm: bool = False):
        plan = plan_keys([("w", 8, 4)], 1, chunk_bytes=16)
        self.server = Server(0, plan[0], {"w": torch.linspace(-1, 1, 8)}, Sync(),
                             lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9), [0, 1], KEY,
                             timeout=30)
        self.ctx = zmq.Context()
        self.out: dict = {}
        self.thread = threading.Thread(target=lambda: self.out.update(stats=self.server.serve()))
        self.thread.start()
        # shm: real pushes and pulls through shared-memory segments (ps/shm.py)
        self.links = [WorkerLink(self.socket(), KEY, w, 0, shm_bytes=4096 if shm else 0)
                      for w in (0, 1)]
        for ep in (self.server.ep, *self.links):  # NOTE: the segment even for tiny tensors
            ep.shm_from = 0
        self.errors: list[list[str]] = [[], []]  # error replies each link got, in order

    def socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.address)
        return sock

    def call(self, w: int, msg: Message, want: str) -> Message:
        link = self.links[w]
        link.send(msg)
        while True:
            got = _read(link.sock, link.recv)
            assert got is not None, f"worker {w}: no {want} reply to {msg.op}"
            if got.op == want:
                return got
            assert got.op == "error", got
            self.errors[w].append(got.meta["message"])

    def close(self) -> dict:
        self.thread.join(20)
        assert not self.thread.is_alive()
        self.ctx.destroy(linger=0)
        return self.out["stats"]


def _real_ops():
    """The job both runs make: (worker, message, reply it waits for)."""
    ops = [(w, Message("hello", {"keys": KEYS, "policy": "Sync()"}), "welcome") for w in (0, 1)]
    for step in range(STEPS):
        ops += [(w, Message("pull", {"have": -1}), "params") for w in (0, 1)]
        ops += [(w, Message("push", {"clock": step, "version": step, "ack": 1}, KEYS,
                            _grads(step, w)), "ack") for w in (0, 1)]
    ops += [(w, Message("pull", {"have": -1}), "params") for w in (0, 1)]
    return ops + [(w, Message("done"), "bye") for w in (0, 1)]


def _run(bad=(), shm: bool = False) -> tuple[torch.Tensor, dict, Live]:
    """Both workers' real job with `bad` = [(slot, worker, op, meta, tensors, reason)]
    frames sent just before real op number `slot`; returns the final parameters."""
    job = Live(shm)
    final = None
    for slot, (w, msg, want) in enumerate(_real_ops()):
        for _, who, op, meta, n, reason in (b for b in bad if b[0] == slot):
            _inject(job, who, op, meta, n, reason)
        got = job.call(w, msg, want)
        if msg.op == "pull":
            final = torch.cat(got.tensors)
    return final, job.close(), job


def _inject(job: Live, who: int, op: str, meta: dict, n: int, reason: str) -> None:
    tensors = [torch.ones(4)] * n
    msg = Message(op, meta, ["w#0"] * n, tensors)
    if op != "hello":  # on that worker's live session: its error reply comes in order
        link = job.links[who]
        link.sock.send_multipart(link.session.seal(msg))
        return
    attacker = job.socket()  # a hello opens no session: refused in a hello-signed frame
    attacker.send_multipart(seal_hello(hello_key(KEY), nonce := new_nonce(), msg))
    assert attacker.poll(10_000), f"no refusal of a hello failing {reason}"
    parts = attacker.recv_multipart()
    env = read_envelope(parts)
    assert env.kind == HELLO and env.nonce_w == nonce
    refusal = open_hello(hello_key(KEY), env, parts, op="error")
    assert reason in refusal.meta["message"] or (
        reason == "protocol" and f"wire protocol {PROTOCOL}" in refusal.meta["message"])
    attacker.close(linger=0)


@cache
def _twin() -> tuple[bytes, tuple]:
    final, stats, _ = _run()
    assert stats["rejected"] == {} and stats["version"] == STEPS
    return final.numpy().tobytes(), tuple(stats["staleness"].items())


# ---- frames that break the schema, and the reason each must be counted under ------------
_PLAIN = st.none() | st.booleans() | st.integers(-9, 9) | st.text(max_size=4)
_WRONG = {
    "int": st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=4)
    | st.binary(max_size=4) | st.lists(st.integers(0, 9), max_size=2),
    "str": st.none() | st.booleans() | st.integers(0, 9) | st.binary(max_size=4)
    | st.lists(st.text(max_size=2), max_size=2),
    "strs": st.none() | st.integers(0, 9) | st.text(max_size=4)
    | st.lists(st.integers(0, 9) | st.none() | st.binary(max_size=2), min_size=1, max_size=3),
    "map": st.none() | st.integers(0, 9) | st.lists(st.integers(0, 9), max_size=2)
    | st.dictionaries(st.binary(min_size=1, max_size=2), st.integers(), min_size=1, max_size=2),
    "float": st.none() | st.booleans() | st.integers(0, 1) | st.text(max_size=4)
    | st.just(float("nan")) | st.just(float("inf")),
    "pairs": st.none() | st.text(max_size=3) | st.lists(
        st.lists(st.integers(0, 9), min_size=3, max_size=3) | st.text(max_size=2), min_size=1,
        max_size=2),
    "num": st.none() | st.booleans() | st.text(max_size=4) | st.just(float("inf"))
    | st.just(float("nan")) | st.lists(st.integers(0, 9), max_size=2),
    "ints": st.none() | st.integers(0, 9) | st.text(max_size=4)
    | st.lists(st.booleans() | st.none() | st.text(max_size=2) | st.floats(), min_size=1,
               max_size=3),
    "rows": st.none() | st.integers(0, 9) | st.dictionaries(st.text(max_size=2), st.integers())
    | st.lists(st.integers(0, 9) | st.text(max_size=2) | st.dictionaries(
        st.text(max_size=3), _PLAIN, max_size=3), min_size=1, max_size=2),
}
_SHARD = [{"key": "w#0", "bytes": 16, "chain": [0]}]
_RING = [{"server": 0, "address": "ipc://x", "state": "alive", "attempt": 0}]
_TAKEN = [{"server": 1, "by": 0, "address": "ipc://r", "keys": 2, "bytes": 8, "version": 3,
           "after": 0.5}]  # a dead server's keys served by another (ps/takeover.py)
_VALID = {  # what a well-behaved peer sends (worker id filled in per frame)
    "hello": {"server": 0, "protocol": PROTOCOL, "keys": KEYS, "policy": "Sync()"},
    "push": {"clock": 0, "version": 0, "sparse": 0, "ack": 1}, "pull": {"have": -1},
    "beat": {}, "done": {}, "welcome": {"version": 0}, "held": {}, "ack": {},
    "params": {"version": 1, "last": 1}, "cancel": {"version": 1},
    "pong": {"version": 2, "pushes": [[0, 1]], "need": 2, "live": [0, 1]},  # Policy.open_round
    "moved": {"ring": 4},
    "bye": {"stats": {}, "staleness": []}, "error": {"message": "x"},
    # the server manager's (ps/manager.py)
    "register": {"server": 0, "address": "ipc://x", "fingerprint": "f", "expected": 1,
                 "ring": -1, "attempt": 0, "shard": _SHARD, "pid": 4242},
    "report": {"server": 0, "ring": 1, "version": 3, "pushes": 9, "final": 0, "adopted": _TAKEN,
               "copied": [{"server": 1, "by": 0, "to": 2, "keys": 1, "bytes": 16, "version": 3}],
               "accepting": 3, "drained": 1,  # a joiner's moved keys (ps/join_status.py)
               "heads": [{"key": "w#0", "bytes": 16, "chain": [2, 1], "owner": 0}]},
    "lookup": {"ring": -1}, "status": {}, "leave": {"server": 0, "ring": 1},
    "join": {"server": 1, "address": "ipc://y", "fingerprint": "f", "ring": 1},
    "ring": {"version": 1, "expected": 1, "complete": 1, "stale": 0, "servers": _RING,
             "takeovers": _TAKEN, "accepting": [[0, 3]]},
    "state": {"version": 1, "expected": 1, "events": ["e"], "rejected": {}, "shard": [
        dict(_SHARD[0], server=0)], "servers": [dict(_RING[0], fingerprint="f", keys=1, bytes=16,
                                                     version=3, pushes=9, rate=1.5, silent=0)]},
    "replicate": {"origin": 0, "version": 1, "lr": 1.0, "final": 0, "pushes": [[0, 3]]},
    "commit": {"frame": 1}, "transfer": {"origin": 0, "version": 1, "part": 0, "parts": 1,
                                         "fields": [], "clocks": [
                                             {"worker": 0, "clock": 3, "keys": ["k"]}]}}


def _wrong(f):
    bad = _WRONG[f.kind]
    if f.kind == "float":
        bad |= st.floats(max_value=f.lo - 1e-9) | st.floats(min_value=f.hi + 1e-9)
    if f.kind == "int":
        bad |= st.integers(-(2**63), f.lo - 1)
        if f.hi < 2**64 - 1:
            bad |= st.integers(f.hi + 1, 2**64 - 1)
    return bad


@st.composite
def bad_frames(draw, side: str):
    """(worker, op, meta, tensor count, reason) of a frame that `side` must refuse: one
    mutation of a valid frame of that worker (a field missing, mistyped or out of range,
    an unknown field, a wrong tensor count) or an op that `side` never receives."""
    op, who = draw(st.sampled_from(sorted(SCHEMA))), draw(st.sampled_from([0, 1]))
    spec, meta = SCHEMA[op], dict(_VALID[op])
    if "worker" in spec.meta:
        meta["worker"] = who
    n = 1 if op in ("push", "transfer") else 0
    if spec.to != side:
        return who, op, meta, n, f"schema:{op}"
    fields = list(spec.meta)
    kinds = ["unknown"] + ["wrong"] * bool(fields)
    kinds += ["missing"] * any(f.required for f in spec.meta.values())
    kinds += ["tensors"] * (spec.tensors[1] < 2**63 - 1 or spec.tensors[0] > 0)
    kind = draw(st.sampled_from(kinds))
    name = kind
    if kind == "missing":
        name = draw(st.sampled_from([k for k in fields if spec.meta[k].required]))
        del meta[name]
    elif kind == "wrong":
        name = draw(st.sampled_from(fields))
        meta[name] = draw(_wrong(spec.meta[name]))
    elif kind == "unknown":
        meta[draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in fields))] = (
            draw(_PLAIN))
        name = "unknown-field"
    else:
        n = 0 if spec.tensors[0] > 0 else 1
    reason = "protocol" if (op, name) == ("hello", "protocol") else f"schema:{op}.{name}"
    return who, op, meta, n, reason


# ---- the server side ---------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
@FUZZ
@given(st.lists(st.tuples(st.integers(2, len(_real_ops()) - 2), bad_frames("server")),
                min_size=1, max_size=5))
def test_fuzzed_headers_never_stop_a_live_server_and_change_nothing(shm, bad):
    """Slots: after both hellos, before the first done (each error reply is read). With
    `shm` the real frames carry their tensors in shared memory (the fuzzed ones in the
    frame); the twin run is the socket one: both paths must step alike, bitwise."""
    frames = [(slot, *frame) for slot, frame in bad]
    want_params, want_staleness = _twin()
    final, stats, job = _run(frames, shm)
    if shm:
        assert job.links[0].shm_frames.get("push") == STEPS
    assert final.numpy().tobytes() == want_params  # bitwise: nothing refused was applied
    assert bytes(job.server.params["w#0"].detach().numpy()) == want_params[:16]
    assert tuple(stats["staleness"].items()) == want_staleness
    assert stats["rejected"] == dict(Counter(f[-1] for f in frames)), stats["rejected"]
    for w in (0, 1):  # each session frame refused got an error naming op and field, in order
        sent = [f[-1] for f in sorted(frames, key=lambda f: f[0]) if f[2] != "hello" and f[1] == w]
        assert len(job.errors[w]) == len(sent), (job.errors[w], sent)
        for reason, text in zip(sent, job.errors[w]):
            assert reason in text and "server 0 refused" in text, (reason, text)


@pytest.mark.timeout(60)
def test_a_live_server_refuses_another_protocol_version_naming_both():
    job = Live()
    for meta, theirs in (({"protocol": PROTOCOL + 1}, f"this worker {PROTOCOL + 1}"),
                         ({}, "this worker an older one")):  # a hello of 2 carried none
        sock = job.socket()
        hello = Message("hello", dict(meta, worker=0, server=0, keys=KEYS, policy="Sync()"))
        t0 = time.monotonic()
        sock.send_multipart(seal_hello(hello_key(KEY), new_nonce(), hello))
        assert sock.poll(10_000)
        parts = sock.recv_multipart()
        refusal = open_hello(hello_key(KEY), read_envelope(parts), parts, op="error")
        assert time.monotonic() - t0 < 5
        assert refusal.meta["protocol"] == PROTOCOL
        assert (f"server 0 speaks wire protocol {PROTOCOL}, {theirs}"
                in refusal.meta["message"]), refusal.meta
    for w, msg, want in _real_ops()[:2]:  # the real workers are still served
        job.call(w, msg, want)
    for w in (0, 1):
        job.call(w, Message("done"), "bye")
    stats = job.close()
    assert stats["rejected"] == {"protocol": 2}
    assert "rejected frames 2 (protocol 2), staleness" in format_stats(stats)  # the report


# ---- the worker side ---------------------------------------------------------------------
class FakeServer:
    """A ROUTER speaking the real handshake that answers a worker's hello with
    `on_hello(session, nonce_w)` parts and its first pull with `on_pull(session)` parts,
    then stays silent (no pongs: a worker that ignored the nonsense would time out)."""

    def __init__(self, on_pull=None, on_hello=None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.on_pull = on_pull
        self.on_hello = on_hello or (lambda s, nw: s.seal(Message("welcome", {"version": 0})))
        self.stop = threading.Event()
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
                self.sock.send_multipart([ident, *self.on_hello(session, env.nonce_w)])
            elif session.open(env, parts).op == "pull" and self.on_pull:
                self.sock.send_multipart([ident, *self.on_pull(session)])
                self.on_pull = None

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def _worker(server: FakeServer, timeout: float = 10) -> tuple[Worker, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)  # keys weight, bias
    plan = plan_keys([(n, p.numel(), 4) for n, p in model.named_parameters()], 1)
    return Worker(model, 0, [server.address], plan, KEY, "Sync()", timeout=timeout,
                  overlap=False), model


def _pull_fails(on_pull, reason: str) -> None:
    server = FakeServer(on_pull)
    worker, model = _worker(server)
    before = [p.detach().clone() for p in model.parameters()]
    t0 = time.monotonic()
    with pytest.raises(PSError) as e:
        worker.pull().wait()
    assert time.monotonic() - t0 < 5, "raised by the timeout, not by the refusal"
    text = str(e.value)
    assert f"server 0 at {server.address}" in text and reason in text, text
    assert worker.wire_stats()["rejected"] == {reason: 1}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    worker.close()
    assert not worker._thread.is_alive()
    server.close()


@pytest.mark.timeout(120)
@FUZZ
@given(bad_frames("worker"))
def test_a_worker_facing_a_server_that_answers_nonsense_raises_naming_server_and_field(bad):
    _, op, meta, n, reason = bad
    _pull_fails(lambda s: s.seal(Message(op, meta, ["weight"] * n, [torch.ones(6)] * n)),
                reason)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys,tensors", [
    (["nope"], [torch.ones(2)]),  # a key this server does not hold
    (["bias"], [torch.ones(3)]),  # of the wrong size
    (["bias"], [torch.ones(2, dtype=torch.float64)]),  # of another dtype: never cast
    (["bias", "bias"], [torch.ones(2), torch.ones(2)]),  # repeated
])
def test_params_that_do_not_fit_the_model_fail_the_worker_naming_the_key(keys, tensors):
    _pull_fails(lambda s: s.seal(Message("params", {"version": 1, "last": 1}, keys, tensors)),
                "schema:params.keys")


@pytest.mark.timeout(60)
def test_a_worker_refused_for_its_protocol_version_says_both_versions_at_once():
    newer = PROTOCOL + 1
    server = FakeServer(on_hello=lambda s, nw: seal_hello(hello_key(KEY), nw, Message(
        "error", {"message": "install the same disttrain version on every rank",
                  "protocol": newer})))
    t0 = time.monotonic()
    with pytest.raises(PSError, match=f"speaks wire protocol {newer}, this worker {PROTOCOL}: "
                                      "install the same disttrain"):
        _worker(server)
    assert time.monotonic() - t0 < 5  # at once, not after the 10 s timeout
    server.close()


# ---- the table itself --------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(SCHEMA)), st.sampled_from(["server", "worker"]),
       st.dictionaries(st.sampled_from(["worker", "clock", "version", "have", "keys", "stats",
                                        "staleness", "message", "x"]) | st.binary(max_size=2),
                       st.recursive(_PLAIN | st.binary(max_size=3), lambda c: st.lists(
                           c, max_size=3) | st.dictionaries(st.text(max_size=2), c, max_size=2),
                           max_leaves=6), max_size=5),
       st.integers(0, 2))
def test_check_raises_only_schema_errors_on_any_meta(op, side, meta, n):
    try:
        check(Message(op, meta, ["k"] * n, [torch.ones(1)] * n), side)
    except SchemaError as e:
        assert e.reason.startswith(f"schema:{op}") and e.op == op


def test_every_message_the_code_sends_fits_the_schema():
    """A valid frame of every op passes (the live twin run checks what the code sends)."""
    assert set(_VALID) == set(SCHEMA) == set(OPS)
    for op, meta in _VALID.items():
        n = 1 if op in ("push", "transfer") else 0
        check(Message(op, dict(meta, worker=0) if "worker" in SCHEMA[op].meta else dict(meta),
                      ["w#0"] * n, [torch.ones(4)] * n), SCHEMA[op].to)
    _twin()


@pytest.mark.timeout(60)
def test_a_server_whose_answer_does_not_verify_is_named_as_another_protocol():
    """What a protocol-2 server does (it welcomes a protocol-3 hello on keys of its own
    version) reads, after the timeout, as a version mismatch, not as plain silence."""
    other = Session(bytes(32), new_nonce(), new_nonce(), 0, 0, "server")
    server = FakeServer(on_hello=lambda s, nw: _renonce(other, s, nw))
    with pytest.raises(PSError, match=f"does not verify: it speaks another wire protocol "
                                      rf"\(this worker {PROTOCOL}"):
        _worker(server, timeout=2)
    server.close()


def _renonce(other: Session, s: Session, nonce_w: bytes) -> list:
    """A welcome under keys the worker cannot derive, with its session's nonces."""
    parts = other.seal(Message("welcome", {"version": 0}))
    env = bytearray(parts[0])
    env[8:24], env[24:40] = nonce_w, s.nonce_s
    return [bytes(env), *parts[1:]]
