"""Where a 2-rank data-parallel job's step goes beside the planner's terms, here.

    python benchmarks/plan_dp_gap.py [--reps 3]

Interleaved, `--reps` times: examples/gpt_char.py as benchmarks/plan_accuracy.py runs its
dp1 and dp2 native cases (`disttrain run`, 4 layers, hidden 128, 2 micro-batches of 8),
and the same GPT and batch in a bare loop of 1 or 2 gloo ranks (forward and backward
twice, then an all-reduce of every gradient; or `disttrain.DataParallel` with no_sync on
the first micro-batch; AdamW after each). Each job's step is the median after 2 warm-up
steps; each loop's, per rank, after 5. Prints every run, the medians and the ratios to
dp1, and the machine's steal time over the whole run (`/proc/stat`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _plan_accuracy_layouts import MICRO, MODEL, LayoutCase, _env, step_times  # noqa: E402

STEPS = 30


def _job(dp: int) -> float:
    """Median step seconds of the gpt_char dp{dp} case (blocks ~15 s)."""
    case = LayoutCase(f"dp{dp}", dp=dp, steps=STEPS)
    res = subprocess.run(case.command(None), capture_output=True, text=True, env=_env(), timeout=600)
    if res.returncode:
        raise RuntimeError(f"dp{dp} job exited {res.returncode}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return statistics.median(step_times(res.stdout, MICRO * 2 * dp * MODEL.seq)[2:])


def _rank(rank: int, world: int, store: str, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import disttrain
    from disttrain.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=MODEL.vocab, block_size=MODEL.seq, n_layer=MODEL.layers,
                          n_head=MODEL.heads, n_embd=MODEL.hidden))
    x = torch.randint(0, MODEL.vocab, (MICRO, MODEL.seq))
    model = disttrain.DataParallel(model) if mode == "dp" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))

    def micro():
        out = model(x)
        (out[0] if isinstance(out, tuple) else out).float().mean().backward()

    times = []
    dist.barrier()
    for _ in range(STEPS):
        t = time.perf_counter()
        if mode == "dp":
            with model.no_sync():
                micro()
        else:
            micro()
        micro()
        if mode == "raw" and world > 1:
            dist.all_reduce(flat)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    with open(out, "w") as f:
        f.write(str(statistics.median(times[5:])))
    dist.destroy_process_group()


def _loop(world: int, mode: str) -> list[float]:
    """Per rank, the median step seconds of the bare loop (blocks ~10 s)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(world),
                                   os.path.join(tmp, "store"), mode, outs[r]], env=_env())
                 for r in range(world)]
        if any(p.wait(timeout=600) for p in procs):
            raise RuntimeError(f"the {mode} loop at world {world} failed")
        return [float(open(o).read()) for o in outs]


def _steal() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rank", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        r, w, store, mode, out = args.rank
        return _rank(int(r), int(w), store, mode, out)
    runs = {"dp1 job": lambda: [_job(1)], "dp2 job": lambda: [_job(2)],
            "loop, 1 rank": lambda: _loop(1, "raw"), "loop, 2 ranks, all-reduce": lambda: _loop(2, "raw"),
            "loop, 2 ranks, DataParallel": lambda: _loop(2, "dp")}
    got: dict[str, list[float]] = {k: [] for k in runs}
    before = _steal()
    for rep in range(args.reps):
        for name, fn in runs.items():
            ms = [t * 1e3 for t in fn()]
            got[name] += ms
            print(f"rep {rep} {name:30s} " + " ".join(f"{m:6.1f}" for m in ms) + " ms", flush=True)
    d = [b - a for a, b in zip(before, _steal())]
    print(f"\nsteal time over the run: {100 * d[7] / sum(d):.1f}% of CPU time")
    base = statistics.median(got["dp1 job"])
    for name, ms in got.items():
        print(f"{name:30s} median {statistics.median(ms):6.1f} ms (spread {min(ms):.1f}-{max(ms):.1f}), "
              f"{statistics.median(ms) / base:.2f}x dp1 job")


if __name__ == "__main__":
    main()
