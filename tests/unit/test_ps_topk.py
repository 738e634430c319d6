"""Top-k push sparsification with error feedback (ps/compress.py), without processes.

Residual bookkeeping is exact, ratio 1 is the dense gradient bit for bit, the server's
check of sparse frames rejects every malformed one (table + hypothesis fuzz through the
real frame parser) and a server applies a sparse push as the dense one it stands for.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.ps.compress import ErrorFeedback, TopK, densify, parse_compression
from disttrain.ps.frame import FrameError, Message, pack, unpack
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import SSP, Async, KBatchSync, KSync, Sync
from disttrain.ps.schema import check
from disttrain.ps.server import Server

KEY = bytes(range(32))
F32 = torch.float32


def _dense(idx, val, n):
    return densify(["k", "k"], [idx, val], {"k": (n, val.dtype)})["k"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
def test_sent_plus_residual_equals_the_sum_of_raw_gradients_exactly(ratio):
    # integer-valued floats: every sum is exact, so the identity must hold bit for bit
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(TopK(ratio))
    sizes = {"w#0": 300, "b": 7}
    raw = {k: torch.zeros(n) for k, n in sizes.items()}
    sent = {k: torch.zeros(n) for k, n in sizes.items()}
    for _ in range(25):
        for k, n in sizes.items():
            grad = torch.randint(-50, 50, (n,), generator=g).to(F32)
            idx, val = ef.compress(k, grad)
            assert idx.dtype == torch.int32 and len(idx) == TopK(ratio).k(n) == val.numel()
            raw[k] += grad
            sent[k] += _dense(idx, val, n)
    for k in sizes:
        residual = ef.residual.get(k, torch.zeros(sizes[k]))
        assert torch.equal(sent[k] + residual, raw[k])


@pytest.mark.timeout(10)
def test_each_push_sends_the_largest_magnitudes_of_gradient_plus_residual():
    torch.manual_seed(1)
    ef = ErrorFeedback(TopK(0.1))
    residual = torch.zeros(100, dtype=torch.float64)
    for _ in range(5):
        grad = torch.randn(100, dtype=torch.float64)
        acc = residual + grad
        idx, val = ef.compress("k", grad)
        assert len(idx) == 10 and bool((idx[1:] > idx[:-1]).all())
        assert set(idx.tolist()) == set(acc.abs().topk(10).indices.tolist())
        torch.testing.assert_close(val, acc[idx.long()])
        residual = acc.clone()
        residual[idx.long()] = 0
        torch.testing.assert_close(ef.residual["k"], residual)


@pytest.mark.timeout(10)
def test_ratio_one_sends_every_entry_bit_for_bit_and_keeps_no_residual():
    ef = ErrorFeedback(TopK(1.0))
    for _ in range(3):
        grad = torch.randn(37)
        idx, val = ef.compress("k", grad)
        assert torch.equal(idx, torch.arange(37, dtype=torch.int32)) and torch.equal(val, grad)
        assert val.data_ptr() != grad.data_ptr() and not ef.residual
    assert TopK(0.01).k(1) == 1 and TopK(0.01).k(101) == 2 and TopK(0.5).k(0) == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize("spec,match", [
    ("topk", "not understood"), ("topk:ratio=0", r"\(0, 1\]"), ("topk:ratio=1.5", r"\(0, 1\]"),
    ("topk:ratio=x", "not a number"), ("fp16", "not understood"), (0.1, "float"),
    ("topk:k=3", "not understood"), ("topk:ratio=nan", r"\(0, 1\]")])
def test_bad_compression_specs_say_what_to_write(spec, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_compression(spec)
    assert "topk:ratio=" in str(e.value)


def test_compression_specs_parse():
    assert parse_compression("topk:ratio=0.01") == TopK(0.01)
    assert parse_compression(" TopK:ratio=1 ") == TopK(1.0)
    assert parse_compression(None) is None and parse_compression("none") is None
    assert str(TopK(0.05)) == "topk:ratio=0.05"


I32, I64 = torch.int32, torch.int64
BAD = {
    "odd tensor count": (["k"], [torch.tensor([0], dtype=I32)]),
    "key pair differs": (["k", "j"], [torch.tensor([0], dtype=I32), torch.ones(1)]),
    "unknown key": (["x", "x"], [torch.tensor([0], dtype=I32), torch.ones(1)]),
    "float indices": (["k", "k"], [torch.tensor([0.0]), torch.ones(1)]),
    "2-D indices": (["k", "k"], [torch.zeros(1, 1, dtype=I32), torch.ones(1)]),
    "int values": (["k", "k"], [torch.tensor([0], dtype=I32), torch.ones(1, dtype=I64)]),
    "length mismatch": (["k", "k"], [torch.tensor([0, 1], dtype=I32), torch.ones(1)]),
    "unsorted": (["k", "k"], [torch.tensor([2, 1], dtype=I32), torch.ones(2)]),
    "duplicate": (["k", "k"], [torch.tensor([1, 1], dtype=I32), torch.ones(2)]),
    "negative": (["k", "k"], [torch.tensor([-1, 1], dtype=I64), torch.ones(2)]),
    "out of range": (["k", "k"], [torch.tensor([0, 8], dtype=I32), torch.ones(2)]),
    "too many": (["k", "k"], [torch.arange(9, dtype=I32), torch.ones(9)]),
    "repeated key": (["k", "k", "k", "k"], [torch.tensor([0], dtype=I32), torch.ones(1)] * 2),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", list(BAD))
def test_malformed_sparse_pushes_are_rejected(case):
    keys, tensors = BAD[case]
    with pytest.raises(FrameError, match="sparse push"):
        densify(keys, tensors, {"k": (8, F32)})


_DTYPES = st.sampled_from([torch.int32, torch.int64, torch.int8, torch.float32, torch.float16])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["k", "j", "?"]), _DTYPES,
                          st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12)), max_size=5),
       st.booleans())
def test_fuzzed_sparse_frames_are_rejected_or_scatter_into_bounds(items, pair_keys):
    """Signed frames with arbitrary index/value tensors go through the real parser and
    the server's sparse check: a FrameError, or dense gradients whose non-zeros lie at
    the sent indices."""
    keys, tensors = [], []
    for key, dt, xs in items:
        keys.append(key)
        tensors.append(torch.tensor(xs, dtype=torch.int64).clamp(
            torch.iinfo(dt).min if not dt.is_floating_point else -(2**24),
            torch.iinfo(dt).max if not dt.is_floating_point else 2**24).to(dt))
        if pair_keys:  # make well-paired frames likely, so the deeper checks are reached
            keys.append(key)
            tensors.append(torch.randn(len(xs)))
    sizes = {"k": 10, "j": 3}
    try:
        msg = unpack(*pack(Message("push", {"sparse": 1}, keys, tensors)))
        out = densify(msg.keys, msg.tensors, {k: (n, F32) for k, n in sizes.items()})
    except FrameError:
        return
    for i in range(0, len(keys), 2):
        idx = tensors[i].long()
        assert out[keys[i]].shape == (sizes[keys[i]],)
        assert bool((idx >= 0).all()) and bool((idx < sizes[keys[i]]).all())
        mask = torch.ones(sizes[keys[i]], dtype=torch.bool)
        mask[idx] = False
        assert not out[keys[i]][mask].any()


def _server(init, policy=None):
    plan = plan_keys([(n, t.numel(), 4) for n, t in init.items()], 1, chunk_bytes=64)
    opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    return Server(0, plan[0], init, policy or Async(), opt, [0, 1], KEY)


def _close(server):
    server.close()


@pytest.mark.timeout(20)
def test_server_applies_a_sparse_push_as_its_dense_gradient_and_counts_bad_ones():
    torch.manual_seed(0)
    init = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    sparse, dense = _server(init), _server(init)
    ef = ErrorFeedback(TopK(0.25))
    for step in range(3):
        grads = {c.key: torch.randn(c.stop - c.start) for c in sparse.chunks}
        keys, tensors, want = [], [], {}
        for k, g in grads.items():
            idx, val = ef.compress(k, g)
            keys += [k, k]
            tensors += [idx, val]
            want[k] = torch.zeros_like(g).index_put_((idx.long(),), val)
        meta = {"clock": step, "version": step, "sparse": 1}
        wire = unpack(*pack(Message("push", meta, keys, tensors)))
        assert sparse._push(0, wire)
        dense._push(0, Message("push", dict(meta, sparse=0), list(want), list(want.values())))
    assert sparse.policy.version == dense.policy.version == 3 and sparse.sparse_pushes == 3
    for k in sparse.keys:
        assert torch.equal(sparse.params[k], dense.params[k])
    bad = Message("push", {"clock": 9, "version": 3, "sparse": 1}, ["b", "b"],
                  [torch.tensor([4, 4], dtype=I32), torch.ones(2)])
    assert not sparse._push(1, bad)
    assert sparse.ep.rejected["bad sparse push"] == 1 and 1 not in sparse.partial
    assert sparse.stats()["rejected_frames"] == 1
    _close(sparse)
    _close(dense)


POLICIES = {"sync": Sync, "ksync": lambda: KSync(1), "kbatch_sync": lambda: KBatchSync(2),
            "ssp": lambda: SSP(1), "async": Async}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_treats_a_sparse_push_as_the_dense_gradient_it_stands_for(policy):
    """Same scripted arrivals (two workers, alternating, some late) to a server fed top-k
    frames and one fed their dense equivalents: same decisions, same parameters."""
    torch.manual_seed(0)
    init = {"w": torch.randn(4, 5), "b": torch.randn(5)}
    sparse, dense = _server(init, POLICIES[policy]()), _server(init, POLICIES[policy]())
    efs = [ErrorFeedback(TopK(0.2)), ErrorFeedback(TopK(0.2))]
    for step in range(6):
        for w in (0, 1) if step % 2 else (1, 0):
            keys, tensors, want = [], [], {}
            for c in sparse.chunks:
                idx, val = efs[w].compress(c.key, torch.randn(c.stop - c.start))
                keys += [c.key, c.key]
                tensors += [idx, val]
                want[c.key] = torch.zeros(c.stop - c.start).index_put_((idx.long(),), val)
            meta = {"clock": step, "version": sparse.policy.version}
            assert sparse._push(w, Message("push", dict(meta, sparse=1), keys, tensors))
            dense._push(w, Message("push", dict(meta, sparse=0), list(want), list(want.values())))
    assert sparse.policy.stats() == dense.policy.stats() and sparse.policy.version >= 3
    for k in sparse.keys:
        assert torch.equal(sparse.params[k], dense.params[k])
    _close(sparse)
    _close(dense)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ratio", [0.05, 1.0])
def test_selection_is_over_the_whole_parameter_whatever_its_cut_points(ratio):
    # placement cuts a parameter into keys at points that depend on the model's size;
    # what a worker sends must not: the same entries as one key, split at the cut points
    g = torch.Generator().manual_seed(5)
    whole, split = ErrorFeedback(TopK(ratio)), ErrorFeedback(TopK(ratio))
    parts = [(0, 37), (37, 64), (64, 200)]
    for _ in range(3):
        grad = torch.randn(200, generator=g)
        idx, val = whole.compress("w", grad)
        got = split.compress_parts("w", grad, parts)
        assert torch.equal(torch.cat([i + start for (i, _), (start, _) in zip(got, parts)]), idx)
        assert torch.equal(torch.cat([v for _, v in got]), val)
        assert all(i.dtype == torch.int32 and (i.numel() == 0 or (i[0] >= 0 and i[-1] < stop - start))
                   for (i, _), (start, stop) in zip(got, parts))
    assert torch.equal(whole.residual.get("w", torch.zeros(200)), split.residual.get("w", torch.zeros(200)))


@pytest.mark.timeout(20)
def test_zero_keys_travel_by_name_and_step_as_their_empty_pairs():
    """A sparse push's keys where top-k selected nothing may travel by name (meta "zero")
    instead of as empty pairs: checked, and stepped bitwise as the pairs would be. A zero
    key that is unknown, repeated, also sent as a pair, or named by a dense push is
    refused and changes nothing."""
    torch.manual_seed(0)
    init = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    named, paired = _server(init), _server(init)
    try:
        ef = ErrorFeedback(TopK(0.05))  # 2 of 30 entries of w, 1 of 5 of b: most keys empty
        for step in range(3):
            keys, tensors, zero = [], [], []
            for name, t in init.items():
                ks = [c for c in named.chunks if c.name == name]
                for c, (idx, val) in zip(ks, ef.compress_parts(
                        name, torch.randn(t.numel()), [(c.start, c.stop) for c in ks])):
                    keys += [c.key, c.key]
                    tensors += [idx, val]
                    zero += [c.key] if not len(idx) else []
            assert zero and len(zero) < len(named.keys)
            meta = {"worker": 0, "clock": step, "version": step, "sparse": 1}
            pairs = [(k, t) for k, t in zip(keys, tensors) if k not in zero]
            wire = unpack(*pack(Message("push", dict(meta, zero=zero), [k for k, _ in pairs],
                                        [t for _, t in pairs])))
            check(wire, "server")  # NOTE: the receive point's schema takes the field
            assert named._push(0, wire) and paired._push(0, Message("push", meta, keys, tensors))
        assert named.policy.version == paired.policy.version == 3
        for k in named.keys:
            assert torch.equal(named.params[k], paired.params[k])
        k0, k1 = named.keys[0], named.keys[1]
        one = [torch.tensor([0], dtype=I32), torch.ones(1)]
        for zero, keys in (([k0, k0], [k1, k1]), (["nope"], [k1, k1]), ([k1], [k1, k1])):
            bad = Message("push", {"clock": 9, "version": 3, "sparse": 1, "zero": zero}, keys, one)
            assert not named._push(1, bad)
        dense = Message("push", {"clock": 9, "version": 3, "sparse": 0, "zero": [k0]},
                        [k1], [torch.ones(named.shard[k1][0])])
        assert not named._push(1, dense)
        assert named.ep.rejected["bad sparse push"] == 3 and named.ep.rejected["schema:push.zero"] == 1
        assert 1 not in named.partial
        for k in named.keys:
            assert torch.equal(named.params[k], paired.params[k])
    finally:
        _close(named)
        _close(paired)


def test_a_frame_names_the_empty_keys_its_pairs_would_have_carried():
    """Worker._frame: pairs of the keys with entries go, empty keys are named in the same
    frame (frames are cut as before, so Async steps them with the same frame); a frame of
    only empty keys still carries one empty pair; dense entries all go."""
    from disttrain.ps.worker import Worker

    def pair(k, n):
        return (k, [torch.arange(n, dtype=I32), torch.ones(n)])
    sent, zero = Worker._frame([pair("a", 0), pair("b", 2), pair("c", 0)])
    assert [k for k, _ in sent] == ["b"] and zero == ["a", "c"]
    sent, zero = Worker._frame([pair("a", 0), pair("c", 0)])
    assert [k for k, _ in sent] == ["a"] and not len(sent[0][1][0]) and zero == ["c"]
    sent, zero = Worker._frame([("a", [torch.ones(3)]), ("b", [torch.ones(2)])])
    assert [k for k, _ in sent] == ["a", "b"] and zero == []
