"""Count tensor-parallel collectives per transformer layer, measured with torch.profiler.

Megatron-LM (https://arxiv.org/abs/1909.08053, section 3): a transformer layer needs 2
allreduces in the forward pass (g after attention's proj and after the MLP's proj) and 2
in the backward pass (f before qkv and before fc). This runs the TP GPT on 2 real ranks
for several depths, counts the `c10d::allreduce_` events the profiler records in the
forward (incl. the vocab-parallel loss) and in the backward, and fits count = a*L + b.
The peer is PyTorch's own tensor parallel (DTensor `parallelize_module` with
Colwise/RowwiseParallel) on the same MLP, counted the same way, with a timing of both.

Sequence parallelism (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198): the
same GPT with `sequence_parallel=True` at tp=2 and tp=4, its collectives per layer
(counted at the flight recorder, i.e. everything through disttrain.comm, with their
payload bytes: the whole tensor reduced or gathered) against plain TP, and the bytes
one block saves for backward (torch.autograd.graph.saved_tensors_hooks, weights
excluded) in its LayerNorms, its column-parallel inputs and in all.

    python benchmarks/tp_collectives.py
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from disttrain.comm import recorder
from disttrain.mesh import Mesh
from disttrain.models import GPT, GPTConfig
from disttrain.parallel.tensor import apply_tp, vocab_parallel_cross_entropy
from disttrain.testing import spawn

DEPTHS = (1, 2, 4)


def _count(fn) -> tuple[int, object]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return sum(e.name == "c10d::allreduce_" for e in prof.events()), out


def gpt_counts():
    mesh = Mesh(tp=2)
    group = mesh.group("tp")
    counts = {}
    for depth in DEPTHS:
        torch.manual_seed(0)
        model = apply_tp(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=depth, n_head=4,
                                       n_embd=32)), mesh, GPT.tp_plan)
        x = torch.randint(64, (4, 16))
        fwd, loss = _count(lambda m=model, x=x: vocab_parallel_cross_entropy(m(x), x, group))
        bwd, _ = _count(loss.backward)
        counts[depth] = (fwd, bwd)
    return counts


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


def _time(step, n=20) -> float:
    step()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mlp_vs_torch(width=256):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = Mesh(tp=2)
    torch.manual_seed(0)
    ours = apply_tp(MLP(width), mesh, {"fc": "colwise", "proj": "rowwise"})
    torch.manual_seed(0)
    theirs = parallelize_module(MLP(width), init_device_mesh("cpu", (2,)),
                                {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    x = torch.randn(32, width)
    out = {}
    for name, m in (("disttrain", ours), ("torch DTensor", theirs)):
        fwd, y = _count(lambda m=m: m(x.clone().requires_grad_()))
        bwd, _ = _count(lambda y=y: y.sum().backward())
        out[name] = (fwd, bwd, _time(lambda m=m: m(x.clone().requires_grad_()).sum().backward()))
    return out


SP_CFG = dict(vocab_size=64, block_size=16, n_head=4, n_embd=32)
SP_DEPTHS = (1, 3)


@contextlib.contextmanager
def tally():
    """Count collectives issued through disttrain.comm (at the flight recorder) and the
    bytes of the whole tensor each reduces or gathers."""
    rec = recorder()
    start, out = rec.start, collections.Counter()

    def counting(op, group, ranks, shapes, dtype=""):
        n = math.prod(shapes[0]) if shapes else 0
        n *= len(ranks) if op == "all_gather_into_tensor" else 1  # recorded: the shard
        out[op] += 1
        out[op + " bytes"] += n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        return start(op, group, ranks, shapes, dtype)

    rec.start = counting
    try:
        yield out
    finally:
        del rec.start  # the class's method again


def sp_layer(tp: int):
    """Per layer (depth difference): collectives fwd/bwd, SP off and on; saved bytes."""
    mesh = Mesh(tp=tp)
    group = mesh.group("tp")
    counts, saved = {}, {}
    for sp in (False, True):
        per = {}
        for depth in SP_DEPTHS:
            torch.manual_seed(0)
            model = apply_tp(GPT(GPTConfig(n_layer=depth, **SP_CFG)), mesh, GPT.tp_plan,
                             sequence_parallel=sp)
            x = torch.randint(64, (8, 16))
            with tally() as fwd:
                loss = vocab_parallel_cross_entropy(model(x), x, group)
            with tally() as bwd:
                loss.backward()
            per[depth] = (fwd, bwd)
        lo, hi = SP_DEPTHS
        counts[sp] = [{k: (per[hi][i][k] - per[lo][i][k]) / (hi - lo)
                       for k in per[hi][i]} for i in (0, 1)]
        saved[sp] = _saved(model.blocks["0"], mesh, sp, tp)
    return counts, saved


def _saved(block, mesh, sp: bool, tp: int) -> dict:
    t = SP_CFG["block_size"] // tp if sp else SP_CFG["block_size"]
    x = torch.randn(8, t, SP_CFG["n_embd"], requires_grad=True)  # (B, T or T/tp, C)
    where, out = [None], collections.Counter()
    for name in ("ln1", "ln2", "attn.qkv", "mlp.fc"):
        kind = "layernorm" if name.startswith("ln") else "colwise input"
        mod = block.get_submodule(name)
        mod.register_forward_pre_hook(lambda *_, k=kind: where.__setitem__(0, k))
        mod.register_forward_hook(lambda *_: where.__setitem__(0, None))

    def pack(t):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            out["layer"] += t.numel() * t.element_size()
            if where[0]:
                out[where[0]] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return dict(out)


def print_sp() -> None:
    ops = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    short = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}
    print(f"\nSequence parallelism, GPT {SP_CFG}, batch 8, per transformer layer "
          f"(depth {SP_DEPTHS[1]} minus depth {SP_DEPTHS[0]}), counted at disttrain.comm:")
    print(f"{'tp':>3s} {'SP':>4s} {'pass':>8s} " + " ".join(f"{short[o]:>4s} {short[o] + ' KiB':>7s}"
                                                        for o in ops))
    memory = {}
    for tp in (2, 4):
        counts, memory[tp] = spawn(sp_layer, tp, tp, timeout=300)[0]
        for sp in (False, True):
            for name, c in zip(("forward", "backward"), counts[sp]):
                cells = " ".join(f"{c.get(o, 0):4g} {c.get(o + ' bytes', 0) / 1024:7.1f}" for o in ops)
                print(f"{tp:3d} {'on' if sp else 'off':>4s} {name:>8s} {cells}")
    print("\nBytes one block saves for backward (per rank, weights excluded):")
    print(f"{'tp':>3s} {'part':>14s} {'SP off':>8s} {'SP on':>8s} {'ratio':>6s}")
    for tp, mem in memory.items():
        for part in ("layernorm", "colwise input", "layer"):
            off, on = mem[False][part], mem[True][part]
            print(f"{tp:3d} {part:>14s} {off:8d} {on:8d} {off / on:6.2f}")


def main():
    counts = spawn(gpt_counts, 2, timeout=300)[0]
    print("TP GPT on 2 ranks, allreduces counted by torch.profiler (c10d::allreduce_):")
    print(f"{'layers':>6s} {'forward':>8s} {'backward':>9s}")
    for depth in DEPTHS:
        print(f"{depth:6d} {counts[depth][0]:8d} {counts[depth][1]:9d}")
    lo, hi = DEPTHS[0], DEPTHS[-1]
    per_f = (counts[hi][0] - counts[lo][0]) / (hi - lo)
    per_b = (counts[hi][1] - counts[lo][1]) / (hi - lo)
    print(f"per transformer layer: {per_f:g} forward + {per_b:g} backward (Megatron: 2 + 2); "
          f"outside the layers: {counts[lo][0] - per_f * lo:g} forward (embedding g, loss max and "
          f"sums) + {counts[lo][1] - per_b * lo:g} backward (f before the output layer)")
    mlp = spawn(mlp_vs_torch, 2, timeout=300)[0]
    print("\nMegatron MLP (fc colwise -> gelu -> proj rowwise), width 256, batch 32, 2 ranks:")
    print(f"{'':14s} {'fwd allreduce':>13s} {'bwd allreduce':>13s} {'fwd+bwd ms':>11s}")
    for name, (f, b, t) in mlp.items():
        print(f"{name:14s} {f:13d} {b:13d} {t * 1e3:11.2f}")
    ratio = mlp["disttrain"][2] / mlp["torch DTensor"][2]
    print(f"time ratio disttrain / torch DTensor: {ratio:.2f}")
    print_sp()


if __name__ == "__main__":
    main()
