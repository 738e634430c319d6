"""DataParallel and ZeRO stage 0 with every allreduce algorithm against one process;
ZeRO stages 1-2 with the ring reduce-scatter.

Both strategies reduce their buckets through the shared comm.reducer.BucketReducer; with
`algorithm=` the buckets go through comm/algorithms.py on a thread. In float64 a world-N
run (rank r takes rows [r B/N, (r+1) B/N) of each batch) must equal one process on the
whole batch (outputs, gradients, parameters after every step), and the replicas must be
bitwise equal. One spawn of 4 ranks runs every algorithm at world 2 (the groups [0, 1]
and [2, 3] side by side) and at world 4.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.comm import ops
from disttrain.comm.algorithms import ALGORITHMS
from disttrain.testing import spawn

B, D_IN, HIDDEN, D_OUT, STEPS = 16, 6, 24, 3, 3
BUCKET_MB = 0.001  # ~1 KB: several buckets, so launches overlap backward


class Net(nn.Module):
    def __init__(self, seed: int, unused: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                                  nn.Tanh(), nn.Linear(HIDDEN, D_OUT)).double()
        self.spare = nn.Linear(HIDDEN, D_OUT).double() if unused else None

    def forward(self, x):
        return self.body(x)


def batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(B, D_IN, generator=g, dtype=torch.float64),
             torch.randn(B, D_OUT, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def train(model, opt, params, rank, world):
    """Per step: this rank's outputs, gradients after backward, parameters after the step."""
    log = []
    n = B // world
    for x, y in batches():
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad()
        out = model(x)
        nn.functional.mse_loss(out, y).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        opt.step()
        log.append({"out": out.detach().clone(), "grads": grads,
                    "params": [p.detach().clone() for p in params]})
    return log


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def algorithm_calls() -> dict[str, int]:
    """How often each all_reduce[algorithm] ran on this rank (the flight recorder's counts)."""
    calls: dict[str, int] = {}
    for _, op, _, n in ops.recorder().snapshot()["counts"]:
        calls[op] = calls.get(op, 0) + n
    return calls


def run_algorithms(group, logs, calls, label):
    """Train every variant over `group`; logs[(label, kind, algo)] = its per-step log."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for algo in ALGORITHMS:
        net = Net(seed=rank)  # NOTE: differs by rank; wrapping broadcasts rank 0's
        dp = disttrain.DataParallel(net, bucket_mb=BUCKET_MB, algorithm=algo, group=group)
        params = list(net.parameters())
        before = algorithm_calls()
        logs[(label, "dp", algo)] = train(dp, sgd(params), params, rank, world)
        calls[(label, "dp", algo)] = (before, algorithm_calls(), dp.num_buckets)
        net = Net(seed=rank)
        zero = disttrain.Zero(net, sgd, stage=0, bucket_mb=BUCKET_MB, algorithm=algo, group=group)
        params = list(net.parameters())
        before = algorithm_calls()
        logs[(label, "zero0", algo)] = train(zero, zero.optimizer, params, rank, world)
        calls[(label, "zero0", algo)] = (before, algorithm_calls(), len(zero.engine.buckets))
    for stage in (1, 2):  # ZeRO's reduce-scatter by ring (rank r keeps chunk r)
        net = Net(seed=rank)
        zero = disttrain.Zero(net, sgd, stage=stage, bucket_mb=BUCKET_MB, algorithm="ring",
                              group=group)
        params = list(net.parameters())
        before = algorithm_calls()
        logs[(label, f"zero{stage}", "ring")] = train(zero, zero.optimizer, params, rank, world)
        calls[(label, f"zero{stage}", "ring")] = (before, algorithm_calls(),
                                                  len(zero.engine.buckets))
    # compression on the wire with an algorithm: the fp16 wire tensor is what the ring sums
    net = Net(seed=rank)
    dp = disttrain.DataParallel(net, bucket_mb=BUCKET_MB, algorithm="ring", compression="fp16",
                                group=group)
    logs[(label, "dp-fp16", "ring")] = train(dp, sgd(list(net.parameters())),
                                             list(net.parameters()), rank, world)
    # a parameter no rank uses: its grad stays None; the used-flags all-reduce runs on
    # the main thread while the ring's buckets are on the algorithm thread
    net = Net(seed=rank, unused=True)
    dp = disttrain.DataParallel(net, bucket_mb=BUCKET_MB, algorithm="ring", find_unused=True,
                                group=group)
    logs[(label, "dp-unused", "ring")] = train(dp, sgd(list(net.parameters())),
                                               list(net.parameters()), rank, world)


def rank_all_algorithms():
    """4 ranks: world 2 as the groups [0, 1] and [2, 3] side by side, then world 4."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # NOTE: 2 "nodes" of 2: hierarchical is two-level
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    logs, calls = {}, {}
    run_algorithms(pairs[dist.get_rank() // 2], logs, calls, 2)
    run_algorithms(None, logs, calls, 4)
    logs["calls"] = calls
    return logs


def reference(unused: bool = False):
    net = Net(seed=0, unused=unused)
    params = list(net.parameters())
    return train(net, sgd(params), params, 0, 1)


def _close(got, want, tol, what):
    if want is None:
        assert got is None, f"{what}: expected no gradient"
        return
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def all_logs():
    return spawn(rank_all_algorithms, 4, timeout=300)


@pytest.fixture(params=[2, 4])
def world_logs(request, all_logs):
    """(world, per-rank logs of that world's runs): at world 2 the pairs' ranks 0-1 and 2-3
    (each pair's rank i took rows i of its batch)."""
    world = request.param
    return world, [{k[1:]: v for k, v in logs.items() if k != "calls" and k[0] == world}
                   | {"calls": {k[1:]: v for k, v in logs["calls"].items() if k[0] == world}}
                   for logs in all_logs]


CASES = [(kind, algo) for algo in ALGORITHMS for kind in ("dp", "zero0")] + \
    [("zero1", "ring"), ("zero2", "ring"), ("dp-fp16", "ring"), ("dp-unused", "ring")]


@pytest.mark.parametrize("kind,algo", CASES)
def test_equals_single_process_and_ranks_agree(world_logs, kind, algo):
    world, results = world_logs
    ref = reference(unused=kind == "dp-unused")
    tol = 2e-3 if kind == "dp-fp16" else 1e-12  # fp16 on the wire rounds the sum
    n = B // world
    for rank, logs in enumerate(results):
        r = rank % world  # its rank in its group
        for step, (got, want) in enumerate(zip(logs[(kind, algo)], ref)):
            where = f"{kind} {algo} world {world} rank {rank} step {step}"
            _close(got["out"], want["out"][r * n:(r + 1) * n], 1e-12 if step == 0 else tol,
                   f"{where} output")
            # NOTE: ZeRO 1-2 keep only this rank's chunk of the gradient (checked through
            # the parameters the sharded step produces)
            for i, (g, w) in enumerate(zip(got["grads"], want["grads"])):
                if kind not in ("zero1", "zero2"):
                    _close(g, w, tol, f"{where} grad {i}")
            for i, (p, w) in enumerate(zip(got["params"], want["params"])):
                _close(p, w, tol, f"{where} param {i}")
    for step in range(STEPS):  # replicas bitwise equal (all four: both pairs too)
        first = results[0][(kind, algo)][step]["params"]
        for rank in range(1, len(results)):
            for a, b in zip(first, results[rank][(kind, algo)][step]["params"]):
                assert torch.equal(a, b), f"{kind} {algo}: rank {rank} differs at step {step}"


@pytest.mark.parametrize("algo", ["native", "ring", "halving-doubling", "tree", "hierarchical"])
def test_buckets_run_the_algorithm_asked_for(world_logs, algo):
    """Every bucket of every step went through that algorithm (recorded by name)."""
    _, results = world_logs
    op = "all_reduce" if algo == "native" else f"all_reduce[{algo}]"
    for kind in ("dp", "zero0"):
        before, after, buckets = results[0]["calls"][(kind, algo)]
        assert buckets > 1, "the test model should have several buckets"
        assert after.get(op, 0) - before.get(op, 0) >= buckets * STEPS, (kind, algo, after)
        if algo != "native":  # no bucket fell back to the backend's own all_reduce
            assert after.get("all_reduce", 0) == before.get("all_reduce", 0), (kind, algo)
    if algo == "ring":  # ZeRO 1-2: every bucket's reduce-scatter went round the ring
        for kind in ("zero1", "zero2"):
            before, after, buckets = results[0]["calls"][(kind, algo)]
            op = "reduce_scatter[ring]"
            assert after.get(op, 0) - before.get(op, 0) >= buckets * STEPS, (kind, after)
            assert after.get("reduce_scatter", 0) == before.get("reduce_scatter", 0), kind


def test_bad_algorithm_and_zero_stages_refuse():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'rign'.*ring"):
        disttrain.DataParallel(nn.Linear(2, 2), algorithm="rign")
    with pytest.raises(ValueError, match="stage 2 reduce-scatters.*'ring' or 'native'.*stage=0"):
        disttrain.Zero(nn.Linear(2, 2), sgd, stage=2, algorithm="tree")
    with pytest.raises(ValueError, match="stage 3 .* use algorithm='native'"):
        disttrain.Zero(nn.Linear(2, 2), sgd, stage=3, algorithm="ring")
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        disttrain.Parallelism(algorithm="Ring")
    with pytest.raises(ValueError, match="zero=1: ZeRO stages 1-2 reduce-scatter"):
        disttrain.Parallelism(zero=1, optimizer_factory=sgd, algorithm="hierarchical")
    with pytest.raises(ValueError, match="stage 3 takes 'native' only"):
        disttrain.Parallelism(zero=3, optimizer_factory=sgd, algorithm="ring")
    assert disttrain.Parallelism(zero=2, optimizer_factory=sgd,
                                 algorithm="ring").zero_options()["algorithm"] == "ring"
    assert disttrain.Parallelism(algorithm="tree").data_parallel_options()["algorithm"] == "tree"
