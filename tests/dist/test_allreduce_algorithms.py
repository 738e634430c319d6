"""Every allreduce algorithm against a float64 reference sum, bitwise equal on every rank.

One spawn of 8 ranks covers worlds 1..8: the groups [0..k-1] for k = 1..8 and one
non-contiguous group. Inputs are random normals (seeded by case and rank), so the
order of additions shows in the low bits: ranks agree bit for bit only if every
element is summed once and copied. The same 8 processes then run the async submissions
and `disttrain.comm.all_reduce` on the whole world (one spawn: each rank's start imports
torch, seconds of suite time).
"""

import hashlib

import pytest
import torch
import torch.distributed as dist

from disttrain.comm.algorithms import ALGORITHMS, all_reduce
from disttrain.testing import spawn

pytestmark = pytest.mark.timeout(300)  # NOTE: the first test to ask for `eight` waits for its spawn
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIZES = (0, 1, 1003)
TOL = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5, torch.float64: 1e-12}


def _input(seed: int, rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _digest(t: torch.Tensor) -> str:
    raw = t.contiguous().view(torch.uint8 if t.numel() == 0 else torch.int16 if t.element_size() == 2
                              else torch.int32 if t.element_size() == 4 else torch.int64)
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()


def _cases(world: int):
    for algo in ALGORITHMS:
        locals_ = [d for d in range(1, world + 1) if world % d == 0] if algo == "hierarchical" else [1]
        for local in locals_:
            for dtype in DTYPES:  # NOTE: the empty and one-element edge cases in fp32 only
                for n in SIZES if dtype == torch.float32 else SIZES[-1:]:
                    yield algo, local, dtype, n


def _check(group, ranks, cases, seed0, shape=None):
    """Run `cases` on `group` (global `ranks`); return {case: sha1 of the result's bytes}."""
    me = ranks.index(dist.get_rank())
    out = {}
    for i, (algo, local, dtype, n) in enumerate(cases):
        seed = seed0 + i
        t = _input(seed, me, n, dtype)
        if shape is not None:  # a non-contiguous view: the result must land in it
            t = _input(seed, me, n * 2, dtype).view(n, 2)[:, 0]
        all_reduce(t, algorithm=algo, group=group, local_size=local)
        ref = sum(_input(seed, r, n, torch.float64) if shape is None else
                  _input(seed, r, n * 2, torch.float64).view(n, 2)[:, 0] for r in range(len(ranks)))
        torch.testing.assert_close(t.double(), ref, atol=TOL[dtype] * len(ranks), rtol=TOL[dtype],
                                   msg=lambda m, c=(algo, local, dtype, n): f"{c}: {m}")
        out[(algo, local, str(dtype), n)] = _digest(t)
    return out


def every_world():
    digests = {}
    for world in range(1, 9):
        ranks = list(range(world))
        group = dist.new_group(ranks)  # NOTE: every rank must call new_group, member or not
        if dist.get_rank() in ranks:
            digests[world] = _check(group, ranks, list(_cases(world)), 100 * world)
    odd = [1, 3, 4, 6]
    group = dist.new_group(odd)
    if dist.get_rank() in odd:
        cases = [(a, 2, torch.float32, 1003) for a in ALGORITHMS]
        digests["odd"] = _check(group, odd, cases, 7)
        digests["view"] = _check(group, odd, [("ring", 1, torch.float64, 9)], 9, shape=(9, 2))
    big = dist.new_group([0, 1, 2])
    if dist.get_rank() < 3:  # 8 MB: several 1 MB pieces per ring step
        digests["big"] = _check(big, [0, 1, 2], [("ring", 1, torch.float64, 1_000_003),
                                                 ("halving-doubling", 1, torch.float32, 700_001)], 11)
    try:
        all_reduce(torch.zeros(3), algorithm="hierarchical", local_size=3)
    except ValueError as err:
        digests["error"] = str(err)
    return digests


def world_of_eight():
    """Every check that needs processes, on one spawn of 8 ranks."""
    return {"every": every_world(), "overlapped": overlapped(), "face": through_the_face()}


@pytest.fixture(scope="module")
def eight():
    return spawn(world_of_eight, 8, timeout=240)


def test_every_algorithm_sums_exactly_once_and_agrees_bitwise_on_every_rank(eight):
    results = [r["every"] for r in eight]
    assert all("must divide the group size (8)" in r.pop("error", "") for r in results)
    for key in results[0]:
        holders = [r for r in results if key in r]
        for case, digest in holders[0][key].items():
            seen = {h[key][case] for h in holders}
            assert seen == {digest}, f"world {key} {case}: ranks disagree bitwise"
    assert len(results[0][8]) == sum(1 for _ in _cases(8))


def test_an_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match="halving-doubling"):
        all_reduce(torch.zeros(3), algorithm="butterfly")


def overlapped():
    """Buckets submitted to AsyncAllReduce while the main thread runs gloo collectives."""
    from disttrain.comm.algorithms import AsyncAllReduce

    me = dist.get_rank()
    out = {}
    for algo in ("ring", "hierarchical"):
        reducer = AsyncAllReduce(algo, local_size=2)  # NOTE: world 8: 4 nodes of 2
        buckets = [_input(50 + b, me, 1000 + 37 * b, torch.float32) for b in range(4)]
        handles = [reducer.submit(t) for t in buckets]
        side = torch.tensor([float(me)])
        dist.all_reduce(side)  # the main thread keeps talking meanwhile
        for h in handles:
            h.wait()
        reducer.close()
        ref = [sum(_input(50 + b, r, 1000 + 37 * b, torch.float64) for r in range(dist.get_world_size()))
               for b in range(4)]
        for t, want in zip(buckets, ref):
            torch.testing.assert_close(t.double(), want, atol=1e-4, rtol=1e-5)
        out[algo] = [_digest(t) for t in buckets] + [side.item()]
    return out


def test_async_submissions_overlap_main_thread_collectives_and_agree_bitwise(eight):
    results = [r["overlapped"] for r in eight]
    assert all(r == results[0] for r in results) and results[0]["ring"][-1] == sum(range(8))


def through_the_face():
    """`disttrain.comm.all_reduce`: torch.distributed's signature plus `algorithm=`."""
    import disttrain

    me, n = dist.get_rank(), dist.get_world_size()
    a, b = _input(70, me, 1003, torch.float32), _input(71, me, 1003, torch.float32)
    assert disttrain.comm.all_reduce(a, algorithm="ring") is None  # blocking
    handle = disttrain.comm.all_reduce(b, async_op=True, algorithm="halving-doubling")
    biggest = torch.tensor([float(me)])
    disttrain.comm.all_reduce(biggest, op=dist.ReduceOp.MAX)  # native: any op
    handle.wait()
    with pytest.raises(ValueError, match="only sums"):
        disttrain.comm.all_reduce(biggest, op=dist.ReduceOp.MAX, algorithm="ring")
    for t, seed in ((a, 70), (b, 71)):
        torch.testing.assert_close(t.double(), sum(_input(seed, r, 1003, torch.float64)
                                                   for r in range(n)), atol=1e-4, rtol=1e-5)
    return [_digest(a), _digest(b), biggest.item()]


def test_the_comm_face_all_reduce_takes_an_algorithm(eight):
    results = [r["face"] for r in eight]
    assert all(r == results[0] for r in results) and results[0][-1] == 7.0
