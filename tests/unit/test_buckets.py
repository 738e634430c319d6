"""Bucket assignment (pure), flat buffers and views, and the bucket-size tuner."""

import pytest
import torch

from disttrain.comm.buckets import BucketSizeTuner, FlatBucket, assign_buckets, mb_to_bytes

pytestmark = pytest.mark.timeout(30)


def test_reverse_registration_order_and_capacity():
    # 4 bytes per element; cap 40 bytes = 10 elements.
    specs = assign_buckets([4, 4, 4, 4, 4], [4] * 5, cap_bytes=40)
    assert [s.indices for s in specs] == [(4, 3), (2, 1), (0,)]
    assert [s.offsets for s in specs] == [(0, 4), (0, 4), (0,)]
    assert [s.numel for s in specs] == [8, 8, 4]
    for s in specs:
        assert s.payload * 4 <= 40


def test_forward_order_when_not_reversed():
    specs = assign_buckets([4, 4, 4], [4] * 3, cap_bytes=32, reverse=False)
    assert [s.indices for s in specs] == [(0, 1), (2,)]


def test_exactly_full_bucket_is_not_split():
    specs = assign_buckets([5, 5, 5], [4] * 3, cap_bytes=40)
    assert [s.indices for s in specs] == [(2, 1), (0,)]


def test_first_bucket_has_its_own_smaller_cap():
    specs = assign_buckets([4] * 6, [4] * 6, cap_bytes=48, first_cap_bytes=16)
    assert [s.indices for s in specs] == [(5,), (4, 3, 2), (1, 0)]


def test_tensor_larger_than_capacity_gets_its_own_bucket():
    specs = assign_buckets([2, 100, 2, 2], [4] * 4, cap_bytes=40)
    assert [s.indices for s in specs] == [(3, 2), (1,), (0,)]
    assert specs[1].numel == 100


def test_every_tensor_in_exactly_one_bucket():
    numels = [7, 300, 1, 64, 64, 5, 1000, 3]
    specs = assign_buckets(numels, [4] * len(numels), cap_bytes=1024)
    members = sorted(i for s in specs for i in s.indices)
    assert members == list(range(len(numels)))
    for s in specs:  # offsets are contiguous, non-overlapping
        assert list(s.offsets) == [sum(s.numels[:k]) for k in range(len(s.numels))]


def test_keys_never_share_a_bucket():
    keys = ["f32", "f16", "f32", "f16"]
    specs = assign_buckets([2, 2, 2, 2], [4, 2, 4, 2], cap_bytes=1000, keys=keys)
    for s in specs:
        assert len({keys[i] for i in s.indices}) == 1
        assert s.key == keys[s.indices[0]]
    assert sorted(i for s in specs for i in s.indices) == [0, 1, 2, 3]


def test_pad_to_rounds_numel_up():
    specs = assign_buckets([3, 4], [4, 4], cap_bytes=1000, pad_to=4)
    assert specs[0].numel == 8 and specs[0].payload == 7


@pytest.mark.parametrize("bad", [dict(cap_bytes=0), dict(pad_to=0)])
def test_bad_arguments_are_rejected(bad):
    kwargs = dict(cap_bytes=10, pad_to=1) | bad
    with pytest.raises(ValueError):
        assign_buckets([1], [4], **kwargs)
    with pytest.raises(ValueError, match="numels"):
        assign_buckets([1, 2], [4], cap_bytes=10)


def test_flat_bucket_views_share_the_buffer():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(3, 1)]
    spec = assign_buckets([t.numel() for t in tensors], [4] * 3, cap_bytes=1 << 20)[0]
    bucket = FlatBucket.for_tensors(spec, tensors)
    bucket.copy_in(tensors)
    assert [tuple(v.shape) for v in bucket.views] == [(3, 1), (4,), (2, 3)]
    torch.testing.assert_close(bucket.buffer[:3], tensors[2].reshape(-1))
    bucket.buffer.mul_(2)
    out = [torch.empty_like(t) for t in tensors]
    bucket.copy_out(out)
    for o, t in zip(out, tensors):
        torch.testing.assert_close(o, 2 * t)


def test_mb_to_bytes():
    assert mb_to_bytes(25) == 25 * 1024 * 1024
    with pytest.raises(ValueError, match="> 0"):
        mb_to_bytes(0)


def test_tuner_fixed_size_is_done():
    tuner = BucketSizeTuner.parse(25)
    assert tuner.done and tuner.current_bytes() == mb_to_bytes(25)
    with pytest.raises(ValueError, match="auto"):
        BucketSizeTuner.parse("big")


def test_tuner_walks_candidates_and_keeps_fastest():
    tuner = BucketSizeTuner([1, 2, 4], steps=2, warmup=1)
    seen = []
    fake_time = {mb_to_bytes(1): 3.0, mb_to_bytes(2): 1.0, mb_to_bytes(4): 2.0}
    while not tuner.wants_agreement():
        seen.append(tuner.current_bytes())
        tuner.record(fake_time[tuner.current_bytes()])
    assert seen == [mb_to_bytes(m) for m in (1, 1, 2, 4, 1, 2, 4)]  # 1 warmup step first
    assert tuner.candidate_times() == [3.0, 1.0, 2.0]
    tuner.agree(tuner.candidate_times())
    assert tuner.done and tuner.current_bytes() == mb_to_bytes(2)


def test_tuner_auto_drops_candidates_beyond_the_model():
    tuner = BucketSizeTuner.parse("auto", total_bytes=3 * 2**20)
    assert tuner.candidates == [mb_to_bytes(1), mb_to_bytes(3)]
