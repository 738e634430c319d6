"""torch.compile through every wrapper, on 2 real gloo ranks.

Graph breaks in the forward of DataParallel, ZeRO 0-3 and a TP-sharded model are counted
with `torch._dynamo.explain` and Dynamo's own graph-break counter (which also sees a break
at a graph's edge, where `explain` sees none); ZeRO-3's are set beside FSDP2's on the
same two models (user layers, torch.nn layers). Compiled training (the `aot_eager` backend: Dynamo + AOTAutograd, no code
generation, to stay fast) must match eager training of the same wrapper step by step;
the pipeline compiles each stage's chunk and must match the eager pipeline (slow-marked).
Unloaded on 2 cores: ~10 s for the explain counts and DataParallel (one spawn), ~8 s for
ZeRO and TP, ~6 s for the pipeline.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

import disttrain
from disttrain.comm.buckets import BucketSizeTuner
from disttrain.parallel.tensor import apply_tp
from disttrain.testing import spawn

STEPS = 3


class Net(nn.Module):
    """Two linear layers (a user module: Dynamo compiles its frame, unlike torch's own)."""

    def __init__(self, norm: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()

    def forward(self, x):  # (B, 8) -> (B, 4)
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class Block(nn.Module):
    """A user layer with parameters of its own (as a transformer block is)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.b = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):  # (B, n_in) -> (B, n_out)
        return torch.tanh(x @ self.w.t() + self.b)


class BlockNet(nn.Module):
    """Net with user layers: FSDP2 and ZeRO-3 both compile each layer's own forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = Block(8, 16), Block(16, 4)

    def forward(self, x):  # (B, 8) -> (B, 4)
        return self.fc2(self.fc1(x) * 2)


class AttentionNet(nn.Module):
    """nn.MultiheadAttention (gathered whole at stage 3, out_proj with it), then a head."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # (B, 8) -> (B, 4): two tokens of 4 features, duplicated
        h = x.view(-1, 2, 4).repeat(1, 1, 2)  # (B, 2, 8)
        return self.head(self.att(h, h, h, need_weights=False)[0].mean(1))


def make(norm: bool = False, blocks: bool = False, attention: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if attention:
        return AttentionNet()
    return BlockNet() if blocks else Net(norm)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def wrap(kind: str) -> nn.Module:
    if kind == "dp":  # bucket_mb="auto", with a tuner short enough to finish in STEPS
        model = disttrain.DataParallel(make(), bucket_mb="auto")
        model.tuner = BucketSizeTuner([1e-4, 1e-3], steps=1, warmup=1)
        return model
    if kind == "dp-bn":
        return disttrain.DataParallel(make(norm=True))
    blocks, attention = kind.endswith("-blocks"), kind.endswith("-attention")
    if kind.startswith("zero"):
        return disttrain.Zero(make(blocks=blocks, attention=attention), sgd, stage=int(kind[4]))
    if kind == "tp":
        return apply_tp(make(), None, {"fc1": "colwise", "fc2": "rowwise"})
    if kind.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        model = make(blocks=blocks)
        fully_shard(model.fc1), fully_shard(model.fc2), fully_shard(model)
        return model
    raise ValueError(kind)


def explain_all(kinds):
    """Per kind: (graphs, explain's breaks, Dynamo's break count, ops in the graphs, ops
    per graph)."""
    x = torch.randn(4, 8)
    out = {}
    for kind in kinds:
        model = wrap(kind)
        torch._dynamo.reset()
        counters.clear()
        e = torch._dynamo.explain(model)(x)
        ops = [str(getattr(op, "__name__", op)) for graph in e.ops_per_graph for op in graph]
        out[kind] = (e.graph_count, e.graph_break_count, sum(counters["graph_break"].values()),
                     sorted(ops), [[str(getattr(op, "__name__", op)) for op in graph]
                                   for graph in e.ops_per_graph])
    return out


def explain_and_train_dp(kinds):
    return explain_all(kinds), train_both(["dp"])


@pytest.fixture(scope="module")
def fast_run():
    """One spawn for the fast tests: explain every wrapper, train DataParallel both ways."""
    kinds = ["dp", "dp-bn", "zero0", "zero1", "zero2", "zero3", "tp", "fsdp2", "zero3-blocks",
             "fsdp2-blocks"]
    return spawn(explain_and_train_dp, 2, kinds, timeout=150)


def test_no_graph_break_in_the_forward_of_any_wrapper(fast_run):
    got = fast_run[0][0]
    for kind in ["dp", "zero0", "zero1", "zero2", "tp"]:
        graphs, breaks, dynamo_breaks, ops, _ = got[kind]
        assert (graphs, breaks, dynamo_breaks) == (1, 0, 0), (kind, got[kind])
        assert ops.count("linear") == 2 and "tanh" in ops, (kind, ops)  # the whole model
    # the buffer broadcast runs before the graph (a break at its edge, none inside).
    # NOTE: Dynamo's own counter sees two per not_traced call (the call, and the wrapper's
    # frame that hands it to torch._disable_dynamo); explain's graphs and breaks, one.
    graphs, breaks, dynamo_breaks, ops, _ = got["dp-bn"]
    assert (graphs, breaks) == (1, 0) and dynamo_breaks <= 2, got["dp-bn"]
    assert ops.count("linear") == 2 and "batch_norm" in ops, ops


def test_zero3_breaks_where_fsdp2_breaks(fast_run):
    """ZeRO-3 against FSDP2 (`fully_shard` on fc1, fc2 and the root) on the same models.

    Layers of the user's own (BlockNet): both break at each sharded layer's hooks and
    compile the same graphs. torch.nn layers (Net's nn.Linear): FSDP2's swapped class
    (FSDPLinear) keeps Dynamo from compiling the layer's forward, so each runs wholly
    eagerly; ZeRO-3 keeps the class, and Dynamo compiles each hooked torch.nn layer's
    forward as a graph of its own ("inbuilt nn.Module.forward allowed - module has
    hooks"): one more graph per layer, the layer's compute, where FSDP2 has none.
    Dynamo's own break counter: ZeRO-3 one more than FSDP2 (the break inside Zero's
    forward, a frame FSDP2 does not have).
    """
    got = fast_run[0][0]
    for model in ["", "-blocks"]:  # Dynamo's counter: one more, at Zero's own frame
        assert got["zero3" + model][2] <= got["fsdp2" + model][2] + 1, got
    zero, fsdp = got["zero3-blocks"], got["fsdp2-blocks"]
    assert zero[1] <= fsdp[1] and zero[4] == fsdp[4], (zero, fsdp)
    assert fsdp[4] == [["matmul", "add", "tanh"], ["mul"], ["matmul", "add", "tanh"]], fsdp
    zero, fsdp = got["zero3"], got["fsdp2"]
    assert fsdp[4] == [["tanh"]], fsdp  # fc1 and fc2 ran eagerly, uncompiled
    layers = [g for g in zero[4] if g != ["tanh"]]
    assert layers == [["linear"], ["linear"]] and zero[1] == fsdp[1] + len(layers), (zero, fsdp)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # ZeRO-3: gathers


def train(kind: str, compiled: bool):
    """STEPS steps of `kind`; returns losses and this rank's state before and after."""
    model = wrap(kind)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = model.optimizer if kind.startswith("zero") else sgd(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    before, losses = _snapshot(model), []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        if kind != "tp":  # data parallel: each rank its half of the batch
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        loss = nn.functional.mse_loss(run(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if kind == "dp":  # the tuner timed every step (compiled: from the first gradient)
        assert model.tuner.done and all(t > 0 for ts in model.tuner.samples for t in ts), \
            model.tuner.samples
    return losses, before, _snapshot(model)


def train_both(kinds):
    """Per kind: (eager run, compiled run) on this rank."""
    out = {}
    for kind in kinds:
        torch._dynamo.reset()
        out[kind] = (train(kind, compiled=False), train(kind, compiled=True))
    return out


def check_same(results) -> None:
    for rank_results in results:
        for kind, (eager, compiled) in rank_results.items():
            torch.testing.assert_close(torch.stack(compiled[0]), torch.stack(eager[0]))
            assert compiled[2].keys() == eager[2].keys()
            for name, value in eager[2].items():
                torch.testing.assert_close(compiled[2][name], value, msg=f"{kind}: {name}")
                # the steps moved every weight (a skipped update would match eager too)
                if name.endswith("weight"):
                    assert not torch.equal(value, eager[1][name]), (kind, name)


def test_compiled_data_parallel_trains_as_eager(fast_run):
    check_same([trained for _, trained in fast_run])


def test_compiled_zero_and_tp_train_as_eager():
    check_same(spawn(train_both, 2, ["zero1", "zero2", "zero3", "zero3-attention", "tp"],
                     timeout=300))


class _Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):  # (B, 8) -> (B, 16)
        return torch.tanh(self.fc(x))


def pipeline_grads(schedule: str, compiled: bool):
    """One pipeline step (2 stages, 4 micro-batches) with each stage's chunk compiled as
    torch.distributed.pipelining does; returns the loss, this stage's gradients, whole_w."""
    from disttrain.parallel.pipeline import make_schedule
    from disttrain.parallel.pipeline.runtime import Pipeline

    torch._dynamo.reset()
    torch.manual_seed(0)
    chunks = [_Stage0(), nn.Sequential(nn.Linear(16, 4))]
    rank = dist.get_rank()
    chunk = chunks[rank]
    run = torch.compile(chunk, backend="aot_eager") if compiled else chunk
    pipe = Pipeline([run], make_schedule(schedule, 2, 4)[rank], rank, 2, 4,
                    nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    loss = pipe.step(x, y)
    return loss, [p.grad.clone() for p in chunk.parameters()], pipe.whole_w


def pipeline_both(schedules):
    return {s: (pipeline_grads(s, False), pipeline_grads(s, True)) for s in schedules}


@pytest.mark.slow
def test_compiled_pipeline_stages_train_as_eager():
    for rank_results in spawn(pipeline_both, 2, ["1f1b", "zb-h1"], timeout=300):
        for schedule, (eager, compiled) in rank_results.items():
            torch.testing.assert_close(compiled[0], eager[0])
            for a, b in zip(compiled[1], eager[1], strict=True):
                torch.testing.assert_close(a, b, msg=schedule)
