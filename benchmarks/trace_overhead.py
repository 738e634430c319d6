"""Step time with tracing on vs off: DataParallel, pipeline and parameter-server jobs.

    python benchmarks/trace_overhead.py [--rounds 4] [--steps 40] [--modes dp,pp,ps] [--dp-width W] [--pp-width W]
    python benchmarks/trace_overhead.py --in-process 4 [--rounds 2] [--steps 800] [--modes dp,pp,ps]

Each round runs every mode twice through `disttrain run`, once with `--trace DIR` and once
without, in alternating order (so a slow phase of a shared machine hits both); each job
(benchmarks/_trace_job.py) times its own steps on rank 0, loader included. Per job: the
median step after the first 5 (warm-up); per mode: the median over rounds of off and on,
and the geometric mean of the rounds' on/off ratios, of wall time and of rank 0's CPU
time per step (all its threads: the trace writer's too; CPU time is what tracing adds,
and what other jobs on a shared machine disturb least). Jobs: dp = 2 ranks DataParallel MLP
(64-W-W-10, W = --dp-width 256, 64 samples per rank); pp = 2 stages 1F1B, 4 micro-batches of a 2-layer
GPT; ps = 2 workers + 1 server, Sync, the same MLP.

`--in-process K` compares inside one job instead: tracing off and on in
alternate blocks of K steps (`disttrain.trace.start`/`stop` in the job), each traced
block against the mean of the blocks on either side, the first step of each block left
out (it still has the global module hooks, and follows a start or a merge). Per mode:
the geometric mean of those ratios with a 95 % interval (+-2 standard errors of the
log), of wall and CPU time. In the ps job only the workers trace
(`start(..., align=False)`, `stop(merge_files=False)`); the server is not traced, so its
own tracing cost is not in that ratio. Between jobs a run's speed differed by up to 20 % here;
neighbouring blocks of one job share the machine's phase.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trace_job.py")
SIZE = {"dp": ["--nproc", "2"], "pp": ["--nproc", "2"], "ps": ["--workers", "2", "--servers", "1"]}
WARMUP = 5


def job(mode: str, steps: int, trace_dir: str | None, out: str, sizes: list[str]) -> float:
    cmd = [sys.executable, "-m", "disttrain", "run", *SIZE[mode]]
    if trace_dir:
        cmd += ["--trace", trace_dir]
    times = _run([*cmd, JOB, mode, out, "--steps", str(steps), *sizes], out, 600)
    return statistics.median(times["wall"][WARMUP:]), statistics.median(times["cpu"][WARMUP:])


def _run(cmd: list[str], out: str, timeout: float) -> dict:
    """Run one job; its step times (OUT.json), or exit with its output when it failed."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
    with open(out) as fp:
        return json.load(fp)


def in_process(mode: str, steps: int, block: int, tmp: str, out: str, sizes: list[str]) -> dict:
    """Ratios traced/untraced block by block in one job (see the module docstring)."""
    got = _run([sys.executable, "-m", "disttrain", "run", *SIZE[mode], JOB, mode, out, "--steps",
                str(steps), *sizes, "--toggle", str(block), "--toggle-dir", tmp], out, 900)
    result = {}
    for key in ("wall", "cpu"):
        blocks = [statistics.mean(got[key][b * block + 1:(b + 1) * block]) for b in range(steps // block)]
        logs = [math.log(blocks[b] / ((blocks[b - 1] + blocks[b + 1]) / 2))
                for b in range(1, len(blocks) - 1) if got["traced"][b * block]]
        mean, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
        result[key] = (math.exp(mean), math.exp(mean - 2 * se), math.exp(mean + 2 * se), len(logs))
        result[key + "_ms"] = 1e3 * statistics.median(v for v, t in zip(got[key], got["traced"]) if not t)
    return result


def main_in_process(args) -> None:
    print("| job | off: step ms (CPU ms) | on/off step [95 %] | on/off CPU [95 %] | block pairs |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in args.modes.split(","):
                got = in_process(m, args.steps, args.in_process, os.path.join(tmp, f"{m}{r}"),
                                 os.path.join(tmp, "times.json"), _sizes(args))
                w, c = got["wall"], got["cpu"]
                print(f"| {m} (run {r}) | {got['wall_ms']:.2f} ({got['cpu_ms']:.2f}) | {w[0]:.3f} "
                      f"[{w[1]:.3f}-{w[2]:.3f}] | {c[0]:.3f} [{c[1]:.3f}-{c[2]:.3f}] | {w[3]} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="even: each order (off first, on first) "
                   "as often; the second job of a pair ran faster here, whichever it was")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--modes", default="dp,pp,ps")
    p.add_argument("--dp-width", type=int, default=256, help="the dp and ps jobs' MLP hidden width")
    p.add_argument("--pp-width", type=int, default=32, help="the pp job's GPT width (n_embd): larger = "
                   "more compute per traced event")
    p.add_argument("--in-process", type=int, default=0, metavar="K",
                   help="compare inside each job: tracing off and on in alternate blocks of K steps")
    args = p.parse_args()
    if args.in_process:
        return main_in_process(args)
    modes = args.modes.split(",")
    got = {m: {"off": [], "on": []} for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in modes:
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for kind in order:
                    trace_dir = os.path.join(tmp, f"trace-{m}-{r}") if kind == "on" else None
                    t = job(m, args.steps, trace_dir, os.path.join(tmp, "times.json"), _sizes(args))
                    got[m][kind].append(t)
                    print(f"round {r} {m} trace {kind}: median step {1e3 * t[0]:.2f} ms, "
                          f"CPU {1e3 * t[1]:.2f} ms", flush=True)
    print("\n| job | off: step ms (CPU ms) | on: step ms (CPU ms) | on/off step | on/off CPU |")
    print("| --- | --- | --- | --- | --- |")
    for m in modes:
        off, on = got[m]["off"], got[m]["on"]
        cells = [f"{1e3 * statistics.median(x[k] for x in v):.2f}" for v in (off, on) for k in (0, 1)]
        ratios = [_geomean(b[k] / a[k] for a, b in zip(off, on)) for k in (0, 1)]
        print(f"| {m} | {cells[0]} ({cells[1]}) | {cells[2]} ({cells[3]}) | {ratios[0]:.3f} | {ratios[1]:.3f} |")


def _sizes(args) -> list[str]:
    return ["--pp-width", str(args.pp_width), "--dp-width", str(args.dp_width)]


def _geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))

if __name__ == "__main__":
    main()
