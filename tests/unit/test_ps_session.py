"""Attacks on a live server: a real `Server.serve()` on a thread, real ZeroMQ sockets, the
worker side a `WorkerLink`, and an attacker that resends frames it captured (the exact
parts the worker sent). Replays change nothing and are counted; a replayed hello takes
no worker over; frames of another session or another worker id are refused; the server
keeps serving and the job finishes. The attacks run on both paths of a loopback server:
`mac` (DISTTRAIN_PS_MAC=always: every byte authenticated), `plain` (DISTTRAIN_PS_SHM=0
between processes of one user on a Unix socket: tensor buffers without a MAC, envelope,
lengths and header authenticated) and `shm` (the default there: the tensors in a shared
memory segment, the header on the socket, authenticated; tests/unit/test_ps_shm.py)."""

import os
import threading
import time

import pytest
import torch
import zmq

from disttrain import settings
from disttrain.ps.frame import DEFAULT_LIMITS, Limits, Message
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Async, Sync
from disttrain.ps.server import Server
from disttrain.ps.session import PLAIN
from disttrain.ps.transport import WorkerLink
from disttrain.ps.worker import fuse

KEY = bytes(range(32))
KEYS = ["w#0", "w#1"]
PATHS = ["mac", "plain", "shm"]
RING = 4096  # bytes per direction of a `shm` job's segments


class Job:
    """A server (SGD lr=1 on w = zeros(8), keys w#0 and w#1) serving on a thread."""

    def __init__(self, workers=(0,), encrypt=False, limits=DEFAULT_LIMITS, path="mac",
                 policy=None, momentum=0.0):
        plan = plan_keys([("w", 8, 4)], 1, chunk_bytes=16)
        self.always_mac, self.shm = path == "mac", path == "shm"
        self.server = Server(0, plan[0], {"w": torch.zeros(8)}, policy or Async(),
                             lambda p: torch.optim.SGD(p, lr=1.0, momentum=momentum),
                             list(workers), KEY, timeout=30, encrypt=encrypt, limits=limits,
                             always_mac=self.always_mac, shm=self.shm)
        self.server.ep.shm_from = 0  # NOTE: the segment even for these tiny tensors
        assert self.server.keys == KEYS
        self.ctx = zmq.Context()
        self.out: dict = {}
        self.thread = threading.Thread(target=lambda: self.out.update(stats=self.server.serve()))
        self.thread.start()

    def socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.address)
        return sock

    def link(self, worker: int, secret: bytes = KEY, encrypt: bool = False) -> WorkerLink:
        link = WorkerLink(self.socket(), secret, worker, 0, encrypt=encrypt,
                          always_mac=self.always_mac, shm_bytes=RING if self.shm else 0)
        link.shm_from = 0  # NOTE: as the server's
        return link

    def rejected(self, reason: str | None, n: int) -> None:
        """Wait until `n` frames were dropped for `reason` (None: for any reason)."""
        def count():
            counts = self.server.ep.rejected
            return sum(counts.values()) if reason is None else counts[reason]
        deadline = time.monotonic() + 10
        while count() < n:
            assert time.monotonic() < deadline, dict(self.server.ep.rejected)
            time.sleep(0.01)
        assert count() == n, dict(self.server.ep.rejected)

    def finish(self, *links) -> dict:
        for link in links:
            assert call(link, Message("done"), "bye")
        self.thread.join(20)
        assert not self.thread.is_alive()
        self.ctx.destroy(linger=0)
        return self.out["stats"]


def reply(link: WorkerLink, wait: float = 5.0) -> Message | None:
    """The next message the link accepts, or None after `wait` seconds."""
    end = time.monotonic() + wait
    while link.sock.poll(max(1, int((end - time.monotonic()) * 1000))):
        got = link.recv()
        if got is not None:
            return got
        if time.monotonic() >= end:
            break
    return None


def call(link: WorkerLink, msg: Message, want: str):
    """Send `msg`, return (captured parts, the reply) once a `want` reply arrives."""
    parts = [bytes(p) for p in link.send(msg)]
    got = reply(link)
    while got is not None and got.op != want:
        got = reply(link)
    assert got is not None, f"no {want} reply to {msg.op}"
    return parts, got


def hello(link: WorkerLink, policy: str = "Async()"):
    return call(link, Message("hello", {"keys": KEYS, "policy": policy}), "welcome")


def push(clock: int, value: float, worker: int = 0) -> Message:
    return Message("push", {"clock": clock, "version": 0, "ack": 1, "worker": worker}, KEYS,
                   [torch.full((4,), value), torch.full((4,), value)])


def params(link: WorkerLink) -> torch.Tensor:
    _, got = call(link, Message("pull", {"have": -1}), "params")
    return torch.cat(got.tensors)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_replayed_push_on_same_or_new_connection_changes_nothing_and_is_counted(path):
    job = Job(path=path)
    worker = job.link(0)
    hello(worker)
    assert worker.session.plain_out == (path != "mac")
    assert (worker.session.shm is not None) == (path == "shm")
    captured, _ = call(worker, push(0, 1.0), "ack")
    assert len(captured) == (2 if path == "shm" else 4)  # shm: envelope and header only
    assert torch.equal(params(worker), torch.full((8,), -1.0))
    worker.sock.send_multipart(captured)  # same connection
    job.rejected("replayed or reordered", 1)
    attacker = job.socket()  # a new connection, no hello
    attacker.send_multipart(captured)
    job.rejected("no session", 1)
    for part in range(4):  # one flipped bit in any part of a fresh, unsent push
        fresh = [bytes(p) for p in worker.session.seal(push(1, 5.0))]
        worker.session.send_seq -= 1  # NOTE: never sent: the real push below takes its number
        assert bool(fresh[0][1] & PLAIN) == (path != "mac")
        flipped = bytearray(fresh[part])
        flipped[len(flipped) // 2] ^= 1
        attacker.send_multipart([*fresh[:part], bytes(flipped), *fresh[part + 1:]])
        if part < 2 or path == "mac":  # NOTE: plain, shm: only this connection's owner could
            worker.sock.send_multipart([*fresh[:part], bytes(flipped), *fresh[part + 1:]])
    fresh = [bytes(p) for p in worker.session.seal(push(1, 5.0))]
    worker.session.send_seq -= 1
    for cut in (fresh[:-1], [*fresh[:2], fresh[2][:-4], fresh[3]], [fresh[0][:40], *fresh[1:]],
                [b"garbage"]):  # truncated frames
        worker.sock.send_multipart(cut)
    want = 14 if path == "mac" else 12  # 2 replays, 8 (plain: 6) flipped bits, 4 cut frames
    job.rejected(None, want)  # every frame sent is refused
    assert torch.equal(params(worker), torch.full((8,), -1.0))  # still one update
    stats = job.finish(worker)
    assert stats["version"] == 1 and stats["applied"] == 1
    assert stats["rejected_frames"] == sum(stats["rejected"].values()) == want, stats["rejected"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_replayed_hello_takes_no_worker_over(path):
    job = Job(path=path)
    worker = job.link(0)
    captured, _ = hello(worker)
    assert torch.equal(params(worker), torch.zeros(8))
    attacker = job.socket()
    attacker.send_multipart(captured)
    job.rejected("replayed hello", 1)
    assert not attacker.poll(300)  # no welcome for the replay
    call(worker, push(0, 1.0), "ack")  # the real worker is still served
    # a hello with a fresh nonce (what a restarted server cannot tell from a replay) opens
    # a session that takes over only once its first frame proves it holds the key
    again = job.link(0)
    hello(again)
    assert torch.equal(params(worker), torch.full((8,), -1.0))
    assert torch.equal(params(again), torch.full((8,), -1.0))
    worker.send(Message("pull", {"have": -1}))
    job.rejected("no session", 1)  # the old session is closed
    stats = job.finish(again)
    assert stats["rejected"] == {"replayed hello": 1, "no session": 1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_reordered_and_duplicated_chunks_are_rejected(path):
    job = Job(path=path)
    worker = job.link(0)
    hello(worker)
    meta = {"clock": 0, "version": 0, "worker": 0}
    first = worker.session.seal(Message("push", meta, KEYS[:1], [torch.ones(4)]))
    second = worker.session.seal(Message("push", dict(meta, ack=1), KEYS[1:], [torch.ones(4)]))
    worker.sock.send_multipart(second)
    job.rejected("replayed or reordered", 1)
    worker.sock.send_multipart(first)
    worker.sock.send_multipart(first)
    job.rejected("replayed or reordered", 2)
    worker.sock.send_multipart(second)
    assert reply(worker).op == "ack"
    assert torch.equal(params(worker), torch.full((8,), -1.0))
    assert job.finish(worker)["applied"] == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_a_pull_riding_on_a_push_is_answered_after_it_and_its_replay_changes_nothing(path):
    job = Job(workers=(0, 1), path=path, policy=Sync())
    links = [job.link(0), job.link(1)]
    for link in links:
        hello(link, "Sync()")
    fused = [push(0, 1.0, w) for w in (0, 1)]
    for m in fused:
        m.meta["pull"] = -1
    captured = [bytes(p) for p in links[0].send(fused[0])]
    got = reply(links[0])  # the round waits for worker 1: the pull is parked, the ack is not
    assert got.op == "ack" and reply(links[0], 0.3) is None
    links[1].send(fused[1])  # closes the round: both pulls are answered
    for link in links:
        got = reply(link)
        assert got.op == "params" and got.meta["version"] == 1
        assert torch.equal(torch.cat(got.tensors), torch.full((8,), -1.0))
        link.release()
    assert got.meta["ack"] == 1  # worker 1's push was acked by the params answering it
    assert reply(links[1], 0.3) is None  # and by nothing else
    links[0].sock.send_multipart(captured)  # same connection
    job.rejected("replayed or reordered", 1)
    attacker = job.socket()  # a new connection
    attacker.send_multipart(captured)
    job.rejected("no session", 1)
    assert reply(links[0], 0.3) is None  # no second ack or params for the replays
    stats = job.finish(*links)
    assert stats["version"] == 1 and stats["applied"] == 2


def test_fuse_puts_a_pull_on_the_push_frame_right_before_it_to_the_same_server():
    def push_frame(ack):
        return Message("push", {"clock": 0, "version": 3, "ack": ack})

    pull = Message("pull", {"have": 3})
    cmds = [(0, push_frame(0), None, "ack"), (1, push_frame(1), "h1", "ack"),
            (0, push_frame(1), "h0", "ack"), (1, Message("beat"), None, "pong"),
            (0, pull, "p0", "params"), (1, Message("pull", {"have": 3}), "p1", "params")]
    out = fuse(cmds)
    assert [(s, m.op, r) for s, m, r in out] == [
        (0, "push", []), (1, "push", [("h1", "ack")]),
        (0, "push", [("h0", "ack"), ("p0", "params")]),  # the other server's frame between
        (1, "beat", []), (1, "pull", [("p1", "params")])]  # a beat between: sent as it is
    assert out[2][1].meta["pull"] == 3 and "pull" not in out[1][1].meta
    assert fuse([(0, push_frame(0), None, "ack"), (0, pull, "p", "params")])[1][1] is pull


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_frames_of_another_session_worker_id_or_secret_are_rejected(path):
    job = Job(workers=(0, 1), path=path)
    w0, w1 = job.link(0), job.link(1)
    hello(w0)
    hello(w1)
    params(w0)
    w1.sock.send_multipart(w0.session.seal(push(0, 1.0)))  # session A's frame on B
    job.rejected("other session", 1)
    w0.session.send_seq -= 1  # NOTE: that frame never reached session A: reuse its number
    w1.sock.send_multipart(w1.session.seal(push(0, 1.0, worker=0)))
    job.rejected("worker of another session", 1)
    stranger = job.link(0, secret=bytes(32))
    stranger.send(Message("hello", {"keys": KEYS, "policy": "Async()"}))
    job.rejected("bad MAC", 1)
    assert torch.equal(params(w1), torch.zeros(8))
    stats = job.finish(w0, w1)
    assert stats["applied"] == 0 and sum(stats["rejected"].values()) == 3


@pytest.mark.timeout(60)
def test_encrypted_job_round_trips_and_refuses_a_plaintext_session():
    job = Job(encrypt=True)
    plain = job.link(0)
    plain.send(Message("hello", {"keys": KEYS, "policy": "Async()"}))
    assert reply(plain, wait=1.0) is None and plain.rejected["encryption mismatch"] == 1
    worker = job.link(0, encrypt=True)
    hello(worker)
    captured, _ = call(worker, push(0, 2.0), "ack")
    assert bytes(torch.full((4,), 2.0).numpy()) not in b"".join(captured)  # not in clear
    assert torch.equal(params(worker), torch.full((8,), -2.0))
    assert job.finish(worker)["applied"] == 1


@pytest.mark.timeout(60)
def test_a_refused_hello_gets_the_servers_reason_not_silence():
    job = Job()
    worker = job.link(0)
    worker.send(Message("hello", {"keys": ["other#0"], "policy": "Async()"}))
    got = reply(worker)
    assert got is not None and got.op == "error", worker.rejected
    assert "build the same model and policy on every rank" in got.meta["message"]
    hello(worker)  # the same worker, now with the right keys, is served
    assert torch.equal(params(worker), torch.zeros(8))
    assert job.finish(worker)["rejected_frames"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", PATHS)
def test_after_a_server_restart_old_frames_are_refused_and_a_reconnect_opens_a_new_session(path):
    first = Job(path=path)
    worker = first.link(0)
    old_hello, _ = hello(worker)
    old_push, _ = call(worker, push(0, 1.0), "ack")
    first.finish(worker)
    second = Job(path=path)  # the restarted server: same job secret, nonces it saw forgotten
    attacker = second.socket()
    attacker.send_multipart(old_hello)  # accepted as a hello (a fresh server cannot tell)...
    assert attacker.poll(5000)  # ...and answered on a session only the real worker could use
    attacker.recv_multipart()
    attacker.send_multipart(old_push)  # the old session's push: its nonces are not the new one's
    second.rejected("other session", 1)
    again = second.link(0)
    hello(again)
    assert (again.session.nonce_w, again.session.nonce_s) != (
        worker.session.nonce_w, worker.session.nonce_s)
    assert torch.equal(params(again), torch.zeros(8))  # the replayed push changed nothing
    stats = second.finish(again)
    assert stats["applied"] == 0 and stats["rejected"] == {"other session": 1}


@pytest.mark.timeout(60)
def test_a_part_over_the_limits_drops_its_connection_before_the_server_reads_it():
    job = Job(limits=Limits(max_tensor_bytes=4096))
    attacker = job.socket()
    attacker.send_multipart([b"x" * 64, b"y" * (4 << 20)])  # 4 MB: over max_frame_bytes (8 KB)
    worker = job.link(0)
    hello(worker)
    call(worker, push(0, 1.0), "ack")
    assert torch.equal(params(worker), torch.full((8,), -1.0))
    small = job.socket()  # under the limit: read, and refused for what it is
    small.send_multipart([b"z" * 64])
    job.rejected("bad part count", 1)
    stats = job.finish(worker)
    assert stats["rejected_frames"] == 1, stats["rejected"]  # the 4 MB part was never read
    with pytest.raises(ValueError, match="key of 16 bytes exceeds Limits.max_tensor_bytes=15"):
        Job(limits=Limits(max_tensor_bytes=15))  # keys of 4 floats: said, not dropped unseen


def _state(job: Job) -> list[torch.Tensor]:
    """Every server tensor a push may change: parameters and optimizer state, copied."""
    out = [p.detach().clone() for p in job.server.params.values()]
    for p in job.server.params.values():
        out += [v.clone() for v in job.server.optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.timeout(60)
def test_a_push_with_its_last_byte_flipped_changes_no_parameter_and_no_optimizer_state():
    """MAC path: the tag is checked before anything is applied, for a push of one frame
    (Async steps it on arrival) and for a push of two chunks whose first one verified
    (Sync waits for the whole push)."""
    for policy, frames in ((Async(), 1), (Sync(), 2)):
        job = Job(policy=policy, momentum=0.9)
        worker = job.link(0)
        hello(worker, repr(policy))
        call(worker, push(0, 1.0), "ack")  # momentum buffers exist from here on
        before = _state(job)
        assert len(before) == 4
        meta = {"clock": 1, "version": 1, "worker": 0}
        if frames == 1:
            last = [bytes(p) for p in worker.session.seal(push(1, 3.0))]
        else:
            worker.sock.send_multipart(worker.session.seal(
                Message("push", meta, KEYS[:1], [torch.full((4,), 3.0)])))
            last = [bytes(p) for p in worker.session.seal(
                Message("push", dict(meta, ack=1), KEYS[1:], [torch.full((4,), 3.0)]))]
        last[-1] = last[-1][:-1] + bytes([last[-1][-1] ^ 0x01])
        worker.sock.send_multipart(last)
        job.rejected("bad MAC", 1)
        after = _state(job)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        worker.session.send_seq -= 1  # NOTE: the refused frame did not move the sequence
        call(worker, push(1, 3.0) if frames == 1 else Message(
            "push", dict(meta, ack=1), KEYS[1:], [torch.full((4,), 3.0)]), "ack")
        assert not torch.equal(_state(job)[0], before[0])  # the intact one is applied
        assert job.finish(worker)["applied"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["tcp", "server says always", "worker says always"])
def test_buffers_go_without_a_mac_only_between_consenting_same_user_unix_peers(
        where, monkeypatch):
    """Neither side sends PLAIN frames unless both allow it on a Unix socket, and the side
    that does not allow it refuses one (the other side forced to send it)."""
    if where == "tcp":
        monkeypatch.setenv("DISTTRAIN_PS_IPC", "0")
        settings.refresh()
    job = Job(path="mac" if where == "server says always" else "plain")
    worker = WorkerLink(job.socket(), KEY, 0, 0, always_mac=where == "worker says always")
    hello(worker)
    call(worker, push(0, 1.0), "ack")
    server_side = job.server.ep.active[0]
    assert not worker.session.plain_out and not server_side.plain_out
    assert torch.equal(params(worker), torch.full((8,), -1.0))  # both ways MAC'd, accepted
    if where != "worker says always":  # the server refuses a worker's PLAIN push
        worker.session.plain_out = True
        worker.send(push(1, 2.0))
        job.rejected("unauthenticated payload", 1)
        worker.session.send_seq -= 1
        worker.session.plain_out = False
        assert torch.equal(params(worker), torch.full((8,), -1.0))
    if where != "server says always":  # the worker refuses the server's PLAIN parameters
        server_side.plain_out = True
        worker.send(Message("pull", {"have": -1}))
        assert reply(worker, wait=1.0) is None
        assert worker.rejected == {"unauthenticated payload": 1}
        server_side.plain_out = False
        worker.session.recv_seq += 1  # NOTE: skip the refused frame's number
    refused = {} if where == "worker says always" else {"unauthenticated payload": 1}
    assert job.finish(worker)["rejected"] == refused


def _as_nobody(address: str, plain: bool) -> int:
    """In a forked child running as uid 65534: hello, then (plain) a push sent without a
    MAC over its buffers although the server did not offer it. Exit status: 0 as
    expected, 3 when the welcome offered PLAIN, 4 when no welcome came, 1 on error."""
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1] >> 8
    code = 1
    try:
        os.setgid(65534)
        os.setuid(65534)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(address)
        link = WorkerLink(sock, KEY, 0, 0, shm_bytes=RING)  # NOTE: offers a segment too
        link.send(Message("hello", {"keys": KEYS, "policy": "Async()"}))
        got = reply(link, wait=1.0 if not plain else 5.0)
        if got is None or got.op != "welcome":
            code = 4
        elif link.session.plain_out or got.meta["mapped"]:
            code = 3
        else:
            link.session.plain_out = True
            link.send(push(0, 1.0))
            code = 0
        sock.close()
        ctx.term()
    finally:
        os._exit(code)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
def test_another_user_cannot_connect_and_gets_no_plain_path_where_it_can():
    job = Job(path="shm")
    folder = os.path.dirname(job.server.address.removeprefix("ipc://"))
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert _as_nobody(job.server.address, plain=False) == 4  # the kernel refused it
    os.chmod(folder, 0o755)  # NOTE: opened up by hand, to reach the server's own check
    os.chmod(job.server.address.removeprefix("ipc://"), 0o777)
    assert _as_nobody(job.server.address, plain=True) == 0  # MAC'd hello welcomed...
    job.rejected("unauthenticated payload", 1)  # ...its PLAIN push refused: uid != ours
    worker = job.link(0)
    hello(worker)
    assert worker.session.plain_out and worker.session.shm  # this user still gets both
    assert torch.equal(params(worker), torch.zeros(8))
    assert job.finish(worker)["rejected"] == {"unauthenticated payload": 1}
