"""Step time with tracing on vs off: DataParallel, pipeline and parameter-server jobs.

    python benchmarks/trace_overhead.py [--rounds 3] [--steps 40] [--modes dp,pp,ps]

Each round runs every mode twice through `disttrain run`, once with `--trace DIR` and once
without, in alternating order (so a slow phase of a shared machine hits both); each job
(benchmarks/_trace_job.py) times its own steps on rank 0, loader included. Per job: the
median step after the first 5 (warm-up); per mode: the median over rounds of off and on,
and the median of the rounds' on/off ratios. Jobs: dp = 2 ranks DataParallel MLP
(64-256-256-10, 64 samples per rank); pp = 2 stages 1F1B, 4 micro-batches of a 2-layer
GPT; ps = 2 workers + 1 server, Sync, the same MLP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trace_job.py")
SIZE = {"dp": ["--nproc", "2"], "pp": ["--nproc", "2"], "ps": ["--workers", "2", "--servers", "1"]}
WARMUP = 5


def job(mode: str, steps: int, trace_dir: str | None, out: str) -> float:
    cmd = [sys.executable, "-m", "disttrain", "run", *SIZE[mode]]
    if trace_dir:
        cmd += ["--trace", trace_dir]
    cmd += [JOB, mode, out, "--steps", str(steps)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
    with open(out) as fp:
        times = json.load(fp)
    return statistics.median(times[WARMUP:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--modes", default="dp,pp,ps")
    args = p.parse_args()
    modes = args.modes.split(",")
    got = {m: {"off": [], "on": []} for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in modes:
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for kind in order:
                    trace_dir = os.path.join(tmp, f"trace-{m}-{r}") if kind == "on" else None
                    t = job(m, args.steps, trace_dir, os.path.join(tmp, "times.json"))
                    got[m][kind].append(t)
                    print(f"round {r} {m} trace {kind}: median step {1e3 * t:.2f} ms", flush=True)
    print(f"\n| job | off: median step (ms) | on: median step (ms) | on/off (median of {args.rounds} rounds' ratios) |")
    print("| --- | --- | --- | --- |")
    for m in modes:
        off, on = got[m]["off"], got[m]["on"]
        ratio = statistics.median(b / a for a, b in zip(off, on))
        print(f"| {m} | {1e3 * statistics.median(off):.2f} | {1e3 * statistics.median(on):.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
