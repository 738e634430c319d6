"""One GPU: a GPT training step through disttrain (ZeRO-1, bf16, fp32 masters) and through a
plain PyTorch loop (fp32 weights, bf16 autocast, fused AdamW), interleaved; medians and the
ratio, then where the disttrain step's time goes (torch.profiler, top ops).

    python benchmarks/gpu_step.py --layers 12 --hidden 768 --heads 12 --seq 1024 --batch 8 [--fused]

Needs CUDA. docs/benchmarks.md, "On one H100", records what it printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import disttrain
from disttrain.models import GPT, GPTConfig


def timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 12), ("hidden", 768), ("heads", 12), ("seq", 1024),
                          ("batch", 8), ("steps", 10), ("rounds", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--fused", action="store_true",
                   help="disttrain's AdamW fused too (the plain loop's always is); default foreach")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler tables")
    a = p.parse_args()
    disttrain.init()
    dev = disttrain.device()
    cfg = GPTConfig(vocab_size=128, block_size=a.seq, n_layer=a.layers, n_head=a.heads,
                    n_embd=a.hidden)
    x = torch.randint(0, 128, (a.batch, a.seq), device=dev)
    y = torch.randint(0, 128, (a.batch, a.seq), device=dev)

    torch.manual_seed(0)
    plain = GPT(cfg).to(dev)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)

    def plain_step():
        popt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = plain(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        popt.step()
        loss.item()

    torch.manual_seed(0)
    mesh = disttrain.Mesh(pp=1, dp=1, tp=1)
    base = disttrain.token_loss(None)
    config = disttrain.Parallelism(
        zero=1, precision="bf16", loss_fn=lambda out, t: base(out.float(), t),
        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=a.fused or None))
    ours = disttrain.parallelize(GPT(cfg).to(dev), mesh, GPT.tp_plan, config)

    def ours_step():
        ours.optimizer.zero_grad(set_to_none=True)
        ours.train_step(x, y).item()
        ours.clip_grad_norm_(1.0)
        ours.optimizer.step()

    for step in (plain_step, ours_step):
        timed(step, 3)  # warm-up: kernels, allocator, optimizer state
    times = {"plain": [], "disttrain": []}
    for _ in range(a.rounds):
        times["plain"] += timed(plain_step, a.steps)
        times["disttrain"] += timed(ours_step, a.steps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n = sum(q.numel() for q in plain.parameters())
    print(f"GPT {n / 1e6:.0f}M params, batch {a.batch} x {a.seq}: plain {med['plain']:.1f} ms, "
          f"disttrain {med['disttrain']:.1f} ms ({'fused' if a.fused else 'foreach'} AdamW), "
          f"ratio {med['disttrain'] / med['plain']:.2f}x")
    if a.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            ours_step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
