"""Measured pipeline bubbles and activation memory, per schedule, against the formulas.

Runs GPipe, 1F1B, interleaved 1F1B (v=2) and ZB-H1 on p real processes exchanging
activations and gradients with gloo p2p, on a pipeline of equal layers, and prints for each:

- measured bubble = 1 - busy / (p * makespan), from the runtime's per-stage F/B spans,
  against the formula (p-1)/(m+p-1) (interleaved: (p-1)/(v*m+p-1), i.e. (p-1)/(v*m) of
  the ideal time; ZB-H1: the simulator's bubble with B and W costs (1-w_share) t_b and
  w_share t_b, i.e. (p-1)(F+B-W) idle per stage at equal costs);
- peak bytes saved for backward on stage 0 (GPipe holds m micro-batches, 1F1B p);
- "replayed": the bubble the simulator computes for the same action lists with the
  measured action durations and free messages; measured minus replayed is what p2p
  latency and process wake-ups cost (interleaving has v times more hops);
- step wall time (slowest rank, median) against torch.distributed.pipelining running the
  same schedule on the same stages (the peer a user would otherwise pick; none for ZB-H1,
  which torch ships only in V-shaped/interleaved form);
- ZB-H1's layers put half of t_b (`--w-share`) on the weight's branch, as do the others'
  (their backward costs t_b as before), so its B and W split the backward as the paper's;
  stage 0's input (data) needs no gradient, so there B is empty and W the whole backward;
- with --gantt PATH, a PNG Gantt chart of the executed schedules (stages as rows).

Stage compute: `--compute sleep` (default) makes each layer a real Linear plus a fixed
sleep in forward and backward, standing for device time; it lets p stages overlap on a
machine with fewer cores than stages, so the schedule, not the CPU count, sets the
timing. `--compute matmul` uses real matmuls only (needs >= p free cores).

    python benchmarks/pipeline_bubble.py --stages 4 --microbatches 8 --gantt docs/pipeline_gantt.png
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain.mesh import Mesh
from disttrain.parallel.pipeline import make_schedule, simulate
from disttrain.parallel.pipeline.runtime import Pipeline
from disttrain.parallel.pipeline.split import split_model
from disttrain.testing import spawn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad, None, None


class Layer(nn.Module):
    """Linear + tanh, plus sleeps: t_f in forward; of t_b in backward, the share `w_share`
    on the weight's branch (weight gradient, ZB-H1's W) and the rest on the input path."""

    def __init__(self, width: int, t_f: float, t_b: float, depth: int, w_share: float = 0.5):
        super().__init__()
        self.lin, self.t_f, self.depth = nn.Linear(width, width), t_f, depth
        self.t_w, self.t_b = t_b * w_share, t_b * (1 - w_share)

    def forward(self, x):  # (B, W)
        w = _Sleep.apply(self.lin.weight, 0.0, self.t_w) if self.t_w else self.lin.weight
        for _ in range(self.depth):
            x = torch.tanh(nn.functional.linear(x, w, self.lin.bias))
        return _Sleep.apply(x, self.t_f, self.t_b) if self.t_f or self.t_b else x


class Stack(nn.Module):
    def __init__(self, n: int, **kw):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Layer(**kw) for i in range(n)})

    def pipeline_layers(self):
        return [f"layers.{i}" for i in self.layers]

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _stage_chunks(p, v, width, t_f, t_b, depth, w_share):
    """(mesh, this rank's stage, its chunks of the same seeded Stack) for either runtime."""
    mesh = Mesh(pp=p)
    stage = mesh.local_rank("pp")
    torch.manual_seed(0)
    # per layer: t_f / v, so each stage does t_f (and t_b) per micro-batch in total
    model = Stack(p * v, width=width, t_f=t_f / v, t_b=t_b / v, depth=depth, w_share=w_share)
    return mesh, stage, split_model(model, p, stage, v)


def run_rank(schedule, p, m, v, width, mb_size, t_f, t_b, depth, steps, w_share=0.5):
    mesh, stage, chunks = _stage_chunks(p, v, width, t_f, t_b, depth, w_share)
    pipe = Pipeline(chunks, make_schedule(schedule, p, m, v)[stage], stage, p, m,
                    lambda out, y: (out - y).pow(2).mean(), group=mesh.group("pp"),
                    ranks=mesh.peers("pp"), track_memory=True)
    x, y = torch.randn(m * mb_size, width), torch.randn(m * mb_size, width)
    results, walls = [], []
    for _ in range(steps + 1):  # first step warms up
        dist.barrier()
        t = time.perf_counter()
        pipe.step(x, y)
        walls.append(time.perf_counter() - t)
        spans = torch.tensor([["FBW".index(s.kind), s.microbatch, s.chunk, s.start, s.end]
                              for s in pipe.spans], dtype=torch.float64)
        results.append(spans)
    return {"spans": results[1:], "peak_bytes": pipe.peak_activation_bytes, "wall": walls[1:]}


def run_torch_rank(schedule, p, m, v, width, mb_size, t_f, t_b, depth, steps, w_share=0.5):
    """The peer: torch.distributed.pipelining on the same stages and data."""
    from torch.distributed import pipelining as tpp

    mesh, stage, chunks = _stage_chunks(p, v, width, t_f, t_b, depth, w_share)
    stages = [tpp.PipelineStage(c, i * p + stage, p * v, torch.device("cpu"),
                                group=mesh.group("pp")) for i, c in enumerate(chunks)]
    loss_fn = lambda out, y: (out - y).pow(2).mean()  # noqa: E731
    if schedule == "interleaved":
        sched = tpp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        cls = tpp.ScheduleGPipe if schedule == "gpipe" else tpp.Schedule1F1B
        sched = cls(stages[0], m, loss_fn=loss_fn)
    x, y = torch.randn(m * mb_size, width), torch.randn(m * mb_size, width)
    walls = []
    for _ in range(steps + 1):
        dist.barrier()
        t = time.perf_counter()
        if stage == 0:
            sched.step(x)
        elif stage == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        walls.append(time.perf_counter() - t)
    return {"wall": walls[1:]}


def bubble(stage_spans: list[torch.Tensor]) -> float:
    start = min(float(s[:, 3].min()) for s in stage_spans)
    end = max(float(s[:, 4].max()) for s in stage_spans)
    busy = sum(float((s[:, 4] - s[:, 3]).sum()) for s in stage_spans)
    return 1.0 - busy / (len(stage_spans) * (end - start))


def replayed(name: str, p: int, m: int, v: int, stage_spans: list[torch.Tensor]) -> float:
    """Bubble of the same schedule with the measured action durations and free messages."""
    durations = [(s[:, 4] - s[:, 3]).tolist() for s in stage_spans]
    return simulate(make_schedule(name, p, m, v), p, v, durations=durations).bubble_fraction


def formula(schedule: str, p: int, m: int, v: int, t_f: float = 1.0, t_b: float = 1.0,
            w_share: float = 0.5) -> float:
    if schedule == "zb-h1":
        return simulate(make_schedule(schedule, p, m), p, t_f=t_f, t_b=t_b * (1 - w_share),
                        t_w=t_b * w_share).bubble_fraction
    return (p - 1) / (m + p - 1) if schedule != "interleaved" else (p - 1) / (v * m + p - 1)


def gantt(runs: dict, p: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.1 + 0.55 * p * len(runs)), squeeze=False)
    for ax, (name, stage_spans) in zip(axes[:, 0], runs.items()):
        t0 = min(float(s[:, 3].min()) for s in stage_spans)
        for stage, spans in enumerate(stage_spans):
            for kind, mb, chunk, b, e in spans.tolist():
                color = (("#4C72B0", "#8FAADC"), ("#DD8452", "#F4B183"),
                         ("#55A868", "#A9D18E"))[int(kind)][int(chunk) % 2]
                ax.barh(stage, (e - b) * 1e3, left=(b - t0) * 1e3, color=color, edgecolor="k",
                        linewidth=0.4)
                ax.text((b - t0 + (e - b) / 2) * 1e3, stage, f"{int(mb)}", ha="center",
                        va="center", fontsize=6)
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_title(f"{name}: measured bubble {bubble(stage_spans):.3f}", fontsize=9)
    axes[-1, 0].set_xlabel("ms (F blue, B orange, W green; lighter = chunk 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2)
    ap.add_argument("--compute", choices=["sleep", "matmul"], default="sleep")
    ap.add_argument("--t-f", type=float, default=0.05, help="seconds of forward per stage/mb")
    ap.add_argument("--t-b", type=float, default=0.1, help="seconds of backward per stage/mb")
    ap.add_argument("--w-share", type=float, default=0.5,
                    help="share of t_b spent on the weight gradient (ZB-H1's W)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--mb-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gantt", default=None, help="write a PNG Gantt chart here")
    args = ap.parse_args()
    p, m, v = args.stages, args.microbatches, args.virtual
    sleep = args.compute == "sleep"
    t_f, t_b = (args.t_f, args.t_b) if sleep else (0.0, 0.0)
    depth = 1 if sleep else 40
    print(f"p={p} stages, m={m} micro-batches, v={v} (interleaved), compute={args.compute}, "
          f"t_f={t_f * 1e3:.0f}ms t_b={t_b * 1e3:.0f}ms per stage and micro-batch")
    print(f"{'schedule':12s} {'bubble':>8s} {'formula':>8s} {'ratio':>6s} {'replayed':>9s} "
          f"{'step ms':>8s} {'torch ms':>9s} {'vs torch':>8s} {'stage0 peak act KiB':>20s}")
    runs = {}
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        vv = v if name == "interleaved" else 1
        out = spawn(run_rank, p, name, p, m, vv, args.width, args.mb_size, t_f, t_b, depth,
                    args.steps, args.w_share, timeout=300)
        bubbles = [bubble([o["spans"][k] for o in out]) for k in range(args.steps)]
        wall = statistics.median(max(o["wall"][k] for o in out) for k in range(args.steps))
        peer_wall = float("nan")
        if name != "zb-h1":
            peer = spawn(run_torch_rank, p, name, p, m, vv, args.width, args.mb_size, t_f, t_b,
                         depth, args.steps, args.w_share, timeout=300)
            peer_wall = statistics.median(max(o["wall"][k] for o in peer)
                                          for k in range(args.steps))
        b, f = statistics.median(bubbles), formula(name, p, m, vv, t_f or 1.0, t_b or 1.0,
                                                  args.w_share)
        r = statistics.median(replayed(name, p, m, vv, [o["spans"][k] for o in out])
                              for k in range(args.steps))
        print(f"{name:12s} {b:8.3f} {f:8.3f} {b / f:6.2f} {r:9.3f} {wall * 1e3:8.1f} "
              f"{peer_wall * 1e3:9.1f} {wall / peer_wall:8.2f} "
              f"{out[0]['peak_bytes'] / 1024:20.1f}", flush=True)
        runs[f"{name} (p={p}, m={m}" + (f", v={vv})" if vv > 1 else ")")] = \
            [o["spans"][-1] for o in out]
    if args.gantt:
        gantt(runs, p, args.gantt)
        print(f"wrote {args.gantt}")


if __name__ == "__main__":
    disttrain.print0  # noqa: B018 - the package must import before spawning ranks
    main()
