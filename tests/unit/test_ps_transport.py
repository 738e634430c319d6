"""Frames: round trip, HMAC rejection, limits, and a fuzzed parser that never crashes."""

import hashlib
import hmac

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain.ps.transport import (
    Endpoint,
    FrameError,
    Limits,
    Message,
    _mac,
    decode,
    encode,
)

KEY = bytes(range(32))


def _msg():
    return Message("push", {"worker": 3, "version": 7}, ["w", "b#1", "e"],
                   [torch.randn(4, 5), torch.arange(3, dtype=torch.int64),
                    torch.randn(0, dtype=torch.bfloat16)])


@pytest.mark.timeout(10)
def test_round_trip_keeps_keys_dtypes_shapes_values():
    m = _msg()
    out = decode(encode(m, KEY), KEY)
    assert (out.op, out.meta, out.keys) == (m.op, m.meta, m.keys)
    for a, b in zip(m.tensors, out.tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.timeout(10)
def test_wrong_key_or_tampered_buffer_is_rejected():
    parts = encode(_msg(), KEY)
    with pytest.raises(FrameError, match="HMAC"):
        decode(parts, bytes(32))
    tampered = list(parts)
    buf = bytearray(tampered[2])
    buf[0] ^= 1
    tampered[2] = bytes(buf)
    with pytest.raises(FrameError, match="HMAC"):
        decode(tampered, KEY)
    moved = [parts[0], parts[1], bytes(parts[2]) + bytes(parts[3]), b"", parts[4]]
    with pytest.raises(FrameError):
        decode(moved, KEY)


@pytest.mark.timeout(10)
def test_limits_are_enforced_before_the_mac():
    parts = encode(Message("push", {}, ["w"], [torch.zeros(1000)]), KEY)
    with pytest.raises(FrameError, match="limit"):
        decode(parts, KEY, Limits(max_tensor_bytes=100))
    with pytest.raises(FrameError, match="limit"):
        decode(parts, KEY, Limits(max_header_bytes=10))
    with pytest.raises(FrameError, match="parts"):
        decode(parts + [b""], KEY, Limits(max_tensors=1))
    with pytest.raises(ValueError, match="max_tensors"):
        Limits(max_tensors=0)


@pytest.mark.timeout(20)
def test_big_frames_hashed_on_several_threads_match_and_catch_one_flipped_byte():
    # 2 MB + 3 bytes: several 256 KB pieces (parallel path) and a short last piece
    big = torch.arange((2 << 20) // 4 + 1, dtype=torch.float32)
    parts = encode(Message("params", {"version": 1}, ["w", "b"], [big, torch.ones(3)]), KEY)
    assert torch.equal(decode(parts, KEY).tensors[0], big)
    ref = hmac.new(KEY, digestmod=hashlib.sha256)  # the format, hashed in one thread
    ref.update(len(parts[1]).to_bytes(8, "little") + bytes(parts[1]))
    for b in map(bytes, parts[2:]):
        ref.update(len(b).to_bytes(8, "little"))
        for i in range(0, len(b), 256 << 10):
            ref.update(hashlib.sha256(b[i:i + (256 << 10)]).digest())
    assert parts[0] == ref.digest()
    for at in (0, 300_000, len(parts[2]) - 1):  # first, a middle and the last piece
        buf = bytearray(parts[2])
        buf[at] ^= 0x10
        with pytest.raises(FrameError, match="HMAC"):
            decode([parts[0], parts[1], bytes(buf), parts[3]], KEY)


def _signed(header: bytes, buffers):
    return [_mac(KEY, header, buffers), header, *buffers]


@pytest.mark.timeout(10)
def test_signed_but_inconsistent_headers_are_rejected():
    good = {"op": "push", "meta": {}, "keys": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
    bad = [dict(good, shapes=[[3]]), dict(good, dtypes=["object"]), dict(good, op="exec"),
           dict(good, keys=[1]), dict(good, shapes=[[-1]]), {"op": "push"}]
    for h in bad:
        with pytest.raises(FrameError):
            decode(_signed(msgpack.packb(h), [bytes(8)]), KEY)
    assert decode(_signed(msgpack.packb(good), [bytes(8)]), KEY).tensors[0].shape == (2,)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6), st.booleans())
def test_fuzzed_frames_never_crash_the_parser(parts, sign):
    if sign and parts:  # reach the parser behind the MAC too
        parts = _signed(parts[0], parts[1:])
    try:
        decode(parts, KEY, Limits(max_tensors=8))
    except FrameError:
        pass


_LEAF = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
_ANY = st.recursive(_LEAF, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=6), c, max_size=5), max_leaves=20)
_HEADERISH = st.fixed_dictionaries({
    "op": st.sampled_from(["push", "pull", "nope"]) | _ANY, "meta": _ANY,
    "keys": st.lists(st.text(max_size=3) | _ANY, max_size=3),
    "dtypes": st.lists(st.sampled_from(["float32", "int8", "bfloat16", "x"]), max_size=3),
    "shapes": st.lists(st.lists(st.integers(-2, 2**41), max_size=3) | _ANY, max_size=3)})


@settings(max_examples=300, deadline=None)
@given(_ANY | _HEADERISH, st.lists(st.binary(max_size=16), max_size=3))
def test_fuzzed_signed_msgpack_headers_never_crash(obj, buffers):
    try:
        decode(_signed(msgpack.packb(obj), buffers), KEY)
    except FrameError:
        pass


@pytest.mark.timeout(20)
def test_endpoint_drops_and_counts_bad_frames_and_keeps_serving():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    server = Endpoint(router, KEY)
    good, evil = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (good, evil):
        s.connect(f"tcp://127.0.0.1:{port}")
    try:
        Endpoint(evil, bytes(32)).send(Message("pull", {"worker": 9}))
        evil.send_multipart([b"garbage"])
        Endpoint(good, KEY).send(Message("pull", {"worker": 1}))
        got = []
        router.setsockopt(zmq.RCVTIMEO, 5000)
        while not got or sum(server.rejected.values()) < 2:
            r = server.recv()
            if r is not None:
                got.append(r)
        ident, msg = got[0]
        assert msg.meta == {"worker": 1}
        assert sum(server.rejected.values()) == 2
        server.send(Message("pong", {"ok": 1}), to=ident)
        good.setsockopt(zmq.RCVTIMEO, 5000)
        assert Endpoint(good, KEY).recv()[1].op == "pong"
    finally:
        for s in (router, good, evil):
            s.close(linger=0)
        ctx.term()
