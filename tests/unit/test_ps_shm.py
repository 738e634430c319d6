"""The shared-memory path of a same-user ipc:// connection (ps/shm.py), against a live server.

A real `Server.serve()` on a thread and `WorkerLink`s over real ZeroMQ sockets, as in
test_ps_session.py (which also runs every replay and session attack on this path): the
tensors go through the segment both ways and only envelope and header on the socket; a
header naming a wrong, stale or oversized place in the segment, a segment frame on a
session without one, and a segment position on a socket frame are refused and change no
parameter and no optimizer state; the server copies a push out of the segment before it
acts, so the worker scribbling there afterwards changes nothing; no memory file or
/dev/shm entry outlives the job.
"""

import os

import pytest
import torch

from disttrain.ps.endpoint import SHM_FROM
from disttrain.ps.frame import Message, pack
from disttrain.ps.policy import Sync
from disttrain.ps.session import PLAIN, SHM, read_envelope
from disttrain.ps.shm import CONTROL_BYTES, Segment
from tests.unit.test_ps_session import KEYS, RING, Job, _state, call, hello, params, push


def _memfds() -> list[str]:
    """This process's open disttrain memory files."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # NOTE: the listing's own descriptor is gone by now
            continue
        if target.startswith("/memfd:disttrain-ps"):
            out.append(target)
    return out


@pytest.mark.timeout(60)
def test_tensors_go_through_the_segment_both_ways_and_nothing_is_left_behind():
    open_before = _memfds()
    job = Job(path="shm")
    worker = job.link(0)
    hello(worker)
    assert len(_memfds()) == len(open_before) + 2  # the worker's file, the server's mapping
    captured, _ = call(worker, push(0, 1.0), "ack")
    env = read_envelope(captured)
    assert len(captured) == 2 and env.flags == PLAIN | SHM  # envelope and header only
    assert bytes(torch.full((4,), 1.0).numpy()) not in b"".join(captured)
    assert torch.equal(params(worker), torch.full((8,), -1.0))
    assert worker.shm_frames == {"push": 1} and job.server.ep.shm_frames == {"params": 1}
    worker.shm_from = SHM_FROM  # the default: a frame of 32 tensor bytes keeps them
    captured, _ = call(worker, push(1, 1.0), "ack")
    assert len(captured) == 4 and worker.shm_frames == {"push": 1}
    stats = job.finish(worker)
    assert stats["applied"] == 2 and stats["push_bytes"] >= 64 and stats["shm_params"] == 1
    worker.close()
    assert _memfds() == open_before  # the memory files are anonymous: nothing in /dev/shm
    assert not [n for n in os.listdir("/dev/shm") if "disttrain" in n]


def _send(worker, meta: dict, tensors, shm_pos=None, flip=False) -> None:
    """Write `tensors` into the worker's ring where they belong (when they fit), then send
    a well-signed segment frame whose header names `shm_pos` (default: that place)."""
    ring, at = worker.session.shm.out, worker.session.shm.out.next
    pos = ring.reserve([t.numel() * t.element_size() for t in tensors])
    if pos is not None:
        ring.write(pos, tensors)
    msg = Message("push", dict(meta, worker=0, shm=pos if shm_pos is None else shm_pos),
                  KEYS[:len(tensors)], tensors)
    parts = [bytes(p) for p in worker.session.seal_parts(pack(msg)[0], [], shm=True)]
    if flip:
        parts[1] = parts[1][:-1] + bytes([parts[1][-1] ^ 1])
    worker.sock.send_multipart(parts)
    ring.next = at  # NOTE: every frame sent here is refused: the receiver's ring stays put


@pytest.mark.timeout(60)
def test_a_header_naming_a_wrong_place_in_the_segment_changes_nothing():
    """The shm path's "last byte flipped": the tensor bytes are not authenticated there
    (docs/design/parameter-server.md, "Shared memory on one host"), the header that says
    where they are is. A flipped header, a wrong, stale or oversized position or length
    is refused before a byte is read, and no parameter or optimizer state moves."""
    job = Job(path="shm", momentum=0.9)
    worker = job.link(0)
    hello(worker)
    call(worker, push(0, 1.0), "ack")
    before = _state(job)
    meta = {"clock": 1, "version": 1, "ack": 1}
    two = [torch.full((4,), 3.0), torch.full((4,), 3.0)]
    at = worker.session.shm.out.next
    _send(worker, meta, two, flip=True)
    job.rejected("bad MAC", 1)
    worker.session.send_seq -= 1  # NOTE: a refused tag does not move the sequence
    bad = [(at + 64, two),  # not where the ring's next frame starts
           (at - 64, two),  # the previous frame's place
           (at + RING, two),  # the right offset, one lap later
           (-1, two), ("0", two),
           (at, [torch.full((RING // 4 + 1,), 3.0)])]  # more bytes than the ring holds
    for n, (pos, tensors) in enumerate(bad):
        _send(worker, meta, tensors, shm_pos=pos)
        job.rejected("schema:push.shm", n + 1)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(job)))
    call(worker, push(1, 3.0), "ack")  # the right place, after all that: applied
    assert not torch.equal(_state(job)[0], before[0])
    assert job.finish(worker)["applied"] == 2


@pytest.mark.timeout(60)
def test_a_segment_frame_without_a_segment_or_a_position_on_the_socket_is_refused():
    job = Job(path="plain", momentum=0.9)  # DISTTRAIN_PS_SHM=0: no segment offered
    worker = job.link(0)
    hello(worker)
    call(worker, push(0, 1.0), "ack")
    assert worker.session.shm is None and worker.session.plain_out
    before = _state(job)
    meta = {"clock": 1, "version": 1, "ack": 1, "worker": 0}
    msg = Message("push", dict(meta, shm=0), KEYS, [torch.full((4,), 3.0)] * 2)
    worker.sock.send_multipart(worker.session.seal_parts(pack(msg)[0], [], shm=True))
    job.rejected("no segment", 1)
    worker.sock.send_multipart(worker.session.seal(msg))  # tensors in the frame, and a position
    job.rejected("schema:push.shm", 1)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(job)))
    assert job.finish(worker)["applied"] == 1


@pytest.mark.timeout(60)
def test_the_server_copies_a_push_out_of_the_segment_before_it_acts():
    """Sync holds worker 0's gradient until worker 1's arrives; worker 0 scribbling over
    its whole ring in between (a same-user peer may) does not change the step."""
    job = Job(workers=(0, 1), policy=Sync(), path="shm")
    w0, w1 = job.link(0), job.link(1)
    hello(w0, "Sync()")
    hello(w1, "Sync()")
    call(w0, push(0, 1.0), "ack")
    assert w0.shm_frames == {"push": 1}
    seg = w0.session.shm
    seg._bytes[CONTROL_BYTES:CONTROL_BYTES + RING].fill_(0x7F)  # the worker-to-server ring
    call(w1, push(0, 3.0, worker=1), "ack")
    assert torch.equal(params(w0), torch.full((8,), -2.0))  # SGD lr=1 on the mean of 1 and 3
    assert job.finish(w0, w1)["applied"] == 2


def test_a_ring_hands_out_room_only_where_the_receiver_has_consumed():
    """Sender and receiver compute the same positions; a frame never wraps the ring's
    end; a full ring, or a consumed count the receiver could not have written, gives no
    room (the frame takes the socket instead)."""
    mine = Segment.create(256)
    if mine is None:
        pytest.skip("no memfd_create here: the shared-memory path is off")
    try:
        theirs = Segment.attach(os.getpid(), mine.fd, 256)
    except OSError as e:  # NOTE: where /proc/<pid>/fd cannot be opened the path is off
        pytest.skip(f"cannot open /proc/self/fd: {e}")
    out, into = mine.out, theirs.into
    t = torch.arange(25, dtype=torch.float32)  # 100 bytes: 128 with alignment
    assert out.reserve([100]) == 0 and into.expect([100]) == (0, 128)
    out.write(0, [t])
    got = into.accept(0, [100], copy=False)
    assert torch.equal(torch.frombuffer(got[0], dtype=torch.float32), t)
    assert out.reserve([100]) == 128 and out.reserve([100]) is None  # full: 0..256 taken
    into.release()
    assert out.consumed() == 128
    assert into.expect([100]) == (128, 128) and into.accept(128, [100], copy=True)
    assert out.reserve([100]) == 256  # room again, from the ring's start
    assert out.reserve([200]) is None  # would wrap: starts a lap later, no room there
    mine._map[0:8] = (10**6).to_bytes(8, "little")  # consumed beyond what was sent
    assert out.reserve([1]) is None
    for size in (0, 100):  # a hello naming a ring of no or unaligned size: not mapped
        with pytest.raises(ValueError, match="positive multiple of 64"):
            Segment.attach(os.getpid(), mine.fd, size)
    for seg in (theirs, mine):
        seg.close()
