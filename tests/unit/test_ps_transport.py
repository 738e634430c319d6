"""Frames and sessions: round trip, MAC and sequence checks, limits, and a fuzzed parser
that never crashes. The attacks on a live server (replays, hijacks) are test_ps_session.py."""

import struct

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from disttrain.ps.frame import DEFAULT_LIMITS, FrameError, Limits, Message, group_keys, pack
from disttrain.ps.session import (
    ENCRYPTED,
    ENVELOPE_BYTES,
    HELLO,
    PLAIN,
    SESSION,
    Session,
    hello_key,
    new_nonce,
    open_hello,
    read_envelope,
    seal_hello,
    seal_hello_parts,
)

KEY = bytes(range(32))


def _pair(encrypt=False, secret=KEY, worker=3, server=1):
    nw, ns = new_nonce(), new_nonce()
    return (Session(secret, nw, ns, worker, server, "worker", encrypt),
            Session(secret, nw, ns, worker, server, "server", encrypt))


def _open(session, parts, limits=DEFAULT_LIMITS):
    return session.open(read_envelope(parts, limits), parts)


def _msg():
    return Message("push", {"worker": 3, "version": 7}, ["w", "b#1", "e"],
                   [torch.randn(4, 5), torch.arange(3, dtype=torch.int64),
                    torch.randn(0, dtype=torch.bfloat16)])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("encrypt", [False, True])
def test_round_trip_keeps_keys_dtypes_shapes_values(encrypt):
    w, s = _pair(encrypt)
    m = _msg()
    parts = w.seal(m)
    assert len(parts[0]) == ENVELOPE_BYTES
    out = _open(s, parts)
    assert (out.op, out.meta, out.keys) == (m.op, m.meta, m.keys)
    for a, b in zip(m.tensors, out.tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    raw = bytes(parts[2])
    assert (raw == bytes(pack(m)[1][0])) != encrypt  # encrypted buffers are not the plaintext
    back = s.seal(Message("ack", {"seq": 0}))  # the other direction has its own numbering
    assert _open(w, back).op == "ack" and (w.send_seq, w.recv_seq) == (1, 1)


@pytest.mark.timeout(10)
def test_a_frame_is_accepted_once_and_in_order_only():
    w, s = _pair()
    first, second = w.seal(_msg()), w.seal(_msg())
    with pytest.raises(FrameError, match="replayed or reordered"):
        _open(s, second)  # reordered: 1 before 0
    _open(s, first)
    with pytest.raises(FrameError, match="replayed or reordered"):
        _open(s, first)  # duplicated
    _open(s, second)
    # the server's own frames do not verify as the worker's (a key per direction)
    with pytest.raises(FrameError, match="bad MAC"):
        _open(s, s.seal(_msg()))


@pytest.mark.timeout(10)
def test_other_secret_session_worker_or_server_index_fails_the_mac():
    w, _ = _pair()
    parts = w.seal(_msg())
    for kw in ({"secret": bytes(32)}, {"worker": 4}, {"server": 2}):
        args = dict(dict(secret=KEY, worker=3, server=1), **kw)
        other = Session(args["secret"], w.nonce_w, w.nonce_s, args["worker"], args["server"],
                        "server")
        with pytest.raises(FrameError, match="bad MAC"):
            _open(other, parts)
    _, plain = _pair()
    enc, _ = _pair(encrypt=True)
    with pytest.raises(FrameError, match="encryption mismatch"):
        _open(plain, enc.seal(_msg()))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("encrypt", [False, True])
def test_one_flipped_bit_anywhere_or_a_truncated_frame_is_rejected(encrypt):
    w, s = _pair(encrypt)
    big = torch.arange((1 << 20) // 4 + 1, dtype=torch.float32)  # 1 MB + 4 bytes
    parts = [bytes(p) for p in w.seal(Message("params", {"version": 1}, ["w", "b"],
                                              [big, torch.ones(3)]))]
    spots = [(0, i) for i in range(0, ENVELOPE_BYTES, 3)] + [(1, 0), (1, len(parts[1]) - 1)]
    spots += [(2, 0), (2, 300_000), (2, len(parts[2]) - 1), (3, 5)]
    for part, at in spots:
        bad = list(parts)
        raw = bytearray(bad[part])
        raw[at] ^= 0x10
        bad[part] = bytes(raw)
        with pytest.raises(FrameError):
            _open(s, bad)
    for bad in (parts[:-1], [parts[0][:-1], *parts[1:]], [*parts[:2], parts[2][:-4], parts[3]],
                [parts[0], parts[1], parts[2] + parts[3], b""]):
        with pytest.raises(FrameError):
            _open(s, bad)
    assert torch.equal(_open(s, parts).tensors[0], big)  # nothing above moved the sequence


@pytest.mark.timeout(10)
def test_hello_is_signed_with_the_job_secret_and_must_be_a_hello():
    nw = new_nonce()
    parts = seal_hello(hello_key(KEY), nw, Message("hello", {"worker": 1, "server": 0}))
    env = read_envelope(parts)
    assert open_hello(hello_key(KEY), env, parts).meta == {"worker": 1, "server": 0}
    with pytest.raises(FrameError, match="bad MAC"):
        open_hello(hello_key(bytes(32)), env, parts)
    forged = seal_hello(hello_key(KEY), nw, Message("push", {"worker": 1}))
    with pytest.raises(FrameError, match="signed as a hello"):
        open_hello(hello_key(KEY), read_envelope(forged), forged)


@pytest.mark.timeout(10)
def test_limits_are_enforced_before_the_mac():
    w, s = _pair()
    parts = w.seal(Message("push", {}, ["w"], [torch.zeros(1000)]))
    with pytest.raises(FrameError, match="over limit"):
        _open(s, parts, Limits(max_tensor_bytes=100))
    with pytest.raises(FrameError, match="over limit"):
        _open(s, parts, Limits(max_header_bytes=10))
    with pytest.raises(FrameError, match="part count"):
        _open(s, parts + [b""], Limits(max_tensors=1))
    with pytest.raises(ValueError, match="max_tensors"):
        Limits(max_tensors=0)


@pytest.mark.timeout(10)
def test_signed_but_inconsistent_headers_are_rejected():
    good = {"op": "push", "meta": {}, "keys": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
    bad = [dict(good, shapes=[[3]]), dict(good, dtypes=["object"]), dict(good, op="exec"),
           dict(good, keys=[1]), dict(good, shapes=[[-1]]), {"op": "push"}]
    w, s = _pair()
    for h in bad:
        with pytest.raises(FrameError, match="bad header"):
            _open(s, w.seal_parts(msgpack.packb(h), [bytes(8)]))
    assert _open(s, w.seal_parts(msgpack.packb(good), [bytes(8)])).tensors[0].shape == (2,)


def test_keys_are_packed_into_chunk_messages_in_order():
    assert group_keys([4, 4, 4, 9, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert group_keys([], 8) == []


# kind (half of them a session frame, the only kind that reaches the tag), flags, seq
_ENVELOPE = st.tuples(st.just(1) | st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**64 - 1))
_LEAF = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
_ANY = st.recursive(_LEAF, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=6), c, max_size=5), max_leaves=20)
_HEADERISH = st.fixed_dictionaries({
    "op": st.sampled_from(["push", "pull", "nope"]) | _ANY, "meta": _ANY,
    "keys": st.lists(st.text(max_size=3) | _ANY, max_size=3),
    "dtypes": st.lists(st.sampled_from(["float32", "int8", "bfloat16", "x"]), max_size=3),
    "shapes": st.lists(st.lists(st.integers(-2, 2**41), max_size=3) | _ANY, max_size=3)})


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _refusal_before_the_tag(kind: int, flags: int, plain: bool, plain_ok: bool) -> str | None:
    """What a session must refuse a frame it signed for, before its tag is checked
    (session.open's order); None: the tag decides."""
    if kind not in (HELLO, SESSION) or flags == ENCRYPTED | PLAIN:
        return "bad envelope"
    if kind != SESSION or flags & ENCRYPTED:
        return "encryption mismatch"
    if plain and not plain_ok:
        return "unauthenticated payload"
    return None


_GOOD = [msgpack.packb({"op": "push", "meta": {"worker": 1}, "keys": ["k"], "dtypes": ["int8"],
                        "shapes": [[3]]}), b"abc"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=80), min_size=0, max_size=6), _ENVELOPE, st.booleans(),
       st.booleans(), st.booleans())
@example(_GOOD, (SESSION, 0, 5), True, False, True)  # every outcome, every run: parsed,
@example(_GOOD, (SESSION, 0, 5), True, False, False)  # replayed or reordered,
@example(_GOOD, (SESSION, PLAIN, 5), True, False, True)  # unauthenticated payload,
@example(_GOOD, (SESSION, PLAIN, 5), True, True, True)  # bad MAC,
@example([b"x"], (SESSION, 0, 5), True, False, True)  # bad header
def test_fuzzed_frames_are_refused_for_the_right_reason(parts, envelope, sign, plain_ok,
                                                        in_order):
    """Random parts (always refused, nothing consumed), or random headers behind a
    correctly signed envelope whose kind, flags and sequence number are drawn too: the
    receiving session refuses each for the reason its checks' order gives, moves its
    sequence number only for a genuine frame, and hands on exactly the bytes sent."""
    w, s = _pair()
    kind, flags, seq = envelope
    signed = sign and bool(parts)
    if signed:
        w.send_seq, w.flags = seq, flags
        s.recv_seq = seq if in_order else (seq + 1) % 2**64
        header, sent = parts[0], parts[1:]
        parts = w.seal_parts(header, sent)
        raw = bytearray(parts[0])
        raw[0] = kind
        parts[0] = bytes(raw)
    before = s.recv_seq
    try:
        msg = s.open(read_envelope(parts, Limits(max_tensors=8)), parts, plain_ok)
    except FrameError as e:
        msg, reason = None, e.reason
    if not signed:
        assert msg is None and s.recv_seq == before  # a random tag never verifies
        return
    plain = bool(flags & PLAIN)
    want = _refusal_before_the_tag(kind, flags, plain, plain_ok)
    if want is None and plain and b"".join(sent):  # tagged with its buffers, opened without
        want = "bad MAC"
    if want is None and not in_order:
        want = "replayed or reordered"
    event(f"refused: {want}" if want else "genuine: " + ("bad header" if msg is None else "parsed"))
    if want is not None:
        assert msg is None and reason.startswith(want), (reason, want)
        assert s.recv_seq == before  # nothing consumed
        return
    assert s.recv_seq == seq + 1  # a genuine frame: its number is used up, parsed or not
    if msg is None:
        assert reason.startswith("bad header"), reason
    else:
        assert b"".join(_bytes(t) for t in msg.tensors) == b"".join(sent)


@settings(max_examples=300, deadline=None)
@given(_ANY | _HEADERISH, st.lists(st.binary(max_size=16), max_size=3))
def test_fuzzed_signed_msgpack_headers_are_parsed_or_refused_as_bad_headers(obj, buffers):
    """A genuine frame (or hello) with any msgpack header: refused only as a bad header;
    accepted, it carries exactly the header's op, meta and keys and the buffers' bytes."""
    w, s = _pair()
    hello_parts = seal_hello_parts(hello_key(KEY), new_nonce(), msgpack.packb(obj), buffers)
    for opener, parts in [(lambda p: _open(s, p), w.seal_parts(msgpack.packb(obj), buffers)),
                          (lambda p: open_hello(hello_key(KEY), read_envelope(p), p), hello_parts)]:
        try:
            msg = opener(parts)
        except FrameError as e:
            assert e.reason.startswith("bad header"), e.reason
            event("bad header")
            continue
        event("parsed")
        assert isinstance(obj, dict) and [msg.op, msg.meta, msg.keys] == [
            obj["op"], obj["meta"], obj["keys"]]
        assert b"".join(_bytes(t) for t in msg.tensors) == b"".join(buffers)
    assert s.recv_seq == 1  # the session frame was genuine: its number is used up


@pytest.mark.timeout(10)
def test_plain_frames_leave_only_the_buffers_out_of_the_tag():
    """PLAIN (a same-user Unix socket, transport.py): refused unless the receiver allows
    it; the envelope, header and part lengths still verified; replays still refused."""
    w, s = _pair()
    w.plain_out = True
    parts = [bytes(p) for p in w.seal(_msg())]
    env = read_envelope(parts)
    assert env.flags == PLAIN
    with pytest.raises(FrameError, match="unauthenticated payload"):
        s.open(env, parts)
    for part, at in ((0, 1), (0, 40), (1, 3)):
        bad = list(parts)
        bad[part] = bad[part][:at] + bytes([bad[part][at] ^ 1]) + bad[part][at + 1:]
        with pytest.raises(FrameError):
            s.open(read_envelope(bad), bad, plain_ok=True)
    resplit = [*parts[:2], parts[2][:-4], parts[3][:0] + parts[2][-4:] + parts[3], parts[4]]
    with pytest.raises(FrameError, match="bad MAC"):
        s.open(read_envelope(resplit), resplit, plain_ok=True)
    assert s.open(env, parts, plain_ok=True).keys == _msg().keys
    with pytest.raises(FrameError, match="replayed or reordered"):
        s.open(env, parts, plain_ok=True)
    enc, _ = _pair(encrypt=True)
    enc.plain_out = True  # never with encryption
    assert read_envelope(enc.seal(_msg())).flags == ENCRYPTED


@pytest.mark.timeout(10)
def test_small_frames_get_the_same_tag_as_streamed_ones():
    w, _ = _pair()
    parts = [b"h" * 48, b"x" * 1000, bytes(range(256)) * 3]
    small = w._gmac(0, 9, parts)
    big = [*parts, bytes(70 << 10)]
    streamed = w._gmac(0, 9, big)
    enc = Cipher(algorithms.AES(w._key[0]), modes.GCM(struct.pack("<IQ", 0, 9))).encryptor()
    for p in big:
        enc.authenticate_additional_data(p)
    enc.finalize()
    assert streamed == enc.tag
    assert small == AESGCM(w._key[0]).encrypt(struct.pack("<IQ", 0, 9), b"", b"".join(parts))
    one = Cipher(algorithms.AES(w._key[0]), modes.GCM(struct.pack("<IQ", 0, 9))).encryptor()
    one.authenticate_additional_data(b"".join(parts))
    one.finalize()
    assert small == one.tag
