"""Count tensor-parallel collectives per transformer layer, measured with torch.profiler.

Megatron-LM (https://arxiv.org/abs/1909.08053, section 3): a transformer layer needs 2
allreduces in the forward pass (g after attention's proj and after the MLP's proj) and 2
in the backward pass (f before qkv and before fc). This runs the TP GPT on 2 real ranks
for several depths, counts the `c10d::allreduce_` events the profiler records in the
forward (incl. the vocab-parallel loss) and in the backward, and fits count = a*L + b.
The peer is PyTorch's own tensor parallel (DTensor `parallelize_module` with
Colwise/RowwiseParallel) on the same MLP, counted the same way, with a timing of both.

    python benchmarks/tp_collectives.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from disttrain.mesh import Mesh
from disttrain.models import GPT, GPTConfig
from disttrain.parallel.tensor_parallel import apply_tp, vocab_parallel_cross_entropy
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


if __name__ == "__main__":
    main()
