"""Parameter-server jobs for benchmarks/plan_accuracy.py: `disttrain plan ps` against real runs.

    python benchmarks/_plan_accuracy_ps.py [--reps 3] [--quick]

Each case is one job of examples/digits_ps.py (`disttrain run --workers P --servers S`,
a consistency mode, seeded exponential stragglers). `predict()` asks the simulator
(plan/simulate.py, no process) for its time per update; `measure()` runs the job once
and returns its steady-state seconds per server update: the slope of worker 0's
`--log-json` points (wall time against the server version it pulled), leaving out the
first and last fifth (start-up, workers that already finished).

The simulator's inputs are calibrated once, from runs that are none of the scored jobs
(`calibrate()`, printed): one worker and one server in Sync without stragglers gives a
step's own cost (compute, push, pull, apply: `base`); the same job on 2 workers without
stragglers says how much of it the server holds per update (`apply`: two workers
overlap their compute, the server's part serialises). Run alone, this file runs every
case `--reps` times interleaved and prints medians, spreads and errors.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # NOTE: imported by plan_accuracy.py or alone
    sys.path.insert(0, str(ROOT / "benchmarks"))

from ps_convergence import (  # noqa: E402
    resolved_tau,
    sleep_overrun_seconds,
    steady_seconds_per_update,
)

EPOCHS = 8
EVAL_EVERY = 4


def _run_job(workers: int, servers: int, mode: list[str], straggler: str, epochs: int,
             seed: int = 0) -> list[dict]:
    """Run examples/digits_ps.py once through the launcher; worker 0's log points (blocks)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS")}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "disttrain", "run", "--workers", str(workers),
               "--servers", str(servers), "examples/digits_ps.py", *mode,
               "--straggler", straggler, "--epochs", str(epochs), "--seed", str(seed),
               "--log-json", log, "--eval-every", str(EVAL_EVERY)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[1:])} failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        return [json.loads(line) for line in open(log)]


GRAD_BYTES = 4 * (64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10)
"""Bytes of one push (= one pull) of examples/digits_ps.py's MLP (hidden 64), float32."""


@dataclass(frozen=True)
class Calibration:
    """The simulator's inputs, measured on jobs that are not scored."""

    one_worker: float
    """Seconds per update, 1 worker + 1 server, Sync, no stragglers."""
    two_workers: float
    """The same with 2 workers."""
    apply: float
    """Seconds of the server's optimizer step (a microbenchmark in this process)."""
    load: float
    """The 1-minute load average after the calibration runs (ours and everyone else's)."""
    wake: float
    """Mean seconds a 20 ms `threading.Event.wait` overruns (a microbenchmark here): the
    worker's straggler sleep is such a wait (ps/worker.py `Worker.sleep`)."""
    cores: int = os.cpu_count() or 1

    @property
    def background(self) -> float:
        """Other runnable processes: the load average less the calibration job's own one
        runnable process (its worker and server take turns)."""
        return max(self.load - 1.0, 0.0)

    @property
    def wire(self) -> float:
        """Seconds one whole push (or pull) holds the server: with 2 workers the server
        takes 2 pushes and answers 2 pulls one after the other where 1 worker has one
        of each, so two_workers - one_worker = 2 x wire (their compute overlaps)."""
        return max(self.two_workers - self.one_worker, 0.0) / 2

    @property
    def base(self) -> float:
        """A step's own cost besides the wire and the server's step."""
        return self.one_worker - 2 * self.wire - self.apply

    def network(self):
        from disttrain.comm.cost import Links
        from disttrain.plan.simulate import Network

        rate = GRAD_BYTES / self.wire if self.wire > 0 else float("inf")
        return Network(Links(alpha=0.0, link_Bps=rate), GRAD_BYTES)

    def describe(self) -> str:
        return (f"calibration: 1 worker Sync, no stragglers {self.one_worker * 1e3:.2f} ms per "
                f"update, 2 workers {self.two_workers * 1e3:.2f} ms; server step "
                f"{self.apply * 1e3:.3f} ms -> wire {self.wire * 1e3:.2f} ms per push or pull "
                f"of {GRAD_BYTES} B, base {self.base * 1e3:.2f} ms per step on {self.cores} "
                f"cores shared with {self.background:.1f} other runnable processes; a sleep "
                f"overruns by {self.wake * 1e3:.2f} ms")


def _server_step_seconds(iters: int = 300) -> float:
    """Median seconds of the servers' optimizer step (SGD, momentum 0.9) on the MLP's shapes."""
    import torch

    torch.set_num_threads(1)
    params = [torch.zeros(s, requires_grad=True) for s in ((64, 64), (64,), (64, 64), (64,),
                                                            (10, 64), (10,))]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    times = []
    for _ in range(iters):
        for p in params:
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.cache
def calibrate(reps: int = 3) -> Calibration:
    """Calibrate once per process from 1- and 2-worker Sync runs without stragglers
    (medians of `reps`, interleaved) and the server step's microbenchmark; blocks for
    about a minute; prints the result."""
    one, two, load = [], [], []
    for _ in range(reps):
        one.append(steady_seconds_per_update(_run_job(1, 1, ["--mode", "sync"], "none", EPOCHS)))
        load.append(os.getloadavg()[0])
        two.append(steady_seconds_per_update(_run_job(2, 1, ["--mode", "sync"], "none", EPOCHS)))
    cal = Calibration(statistics.median(one), statistics.median(two), _server_step_seconds(),
                      statistics.median(load), sleep_overrun_seconds())
    print(cal.describe(), f"(spread 1 worker {_spread(one):.1%}, 2 workers {_spread(two):.1%})",
          flush=True)
    return cal


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


@dataclass
class PSCase:
    """One parameter-server job: its simulated and its measured seconds per update."""

    name: str
    workers: int
    servers: int
    mode: str
    """plan/ps.py's name, e.g. 'ksync:2'."""
    straggler: str
    epochs: int = EPOCHS
    seed: int = 0
    last: dict = field(default_factory=dict)

    @property
    def procs(self) -> int:
        return self.workers + self.servers

    def _flags(self) -> list[str]:
        name, _, k = self.mode.partition(":")
        flags = ["--mode", name]
        if name == "ssp":
            return flags + ["--staleness", k]
        return flags + (["--k", k] if k else [])

    def predict(self, cores: bool = True, wake: bool = True) -> float:
        """Simulated seconds per update (pure CPU; the calibration runs once first);
        `cores`, `wake`: model the shared cores and the sleeps' overrun (plan/simulate.py)."""
        from disttrain.plan.ps import parse_mode
        from disttrain.plan.simulate import Compute, simulate
        from disttrain.ps.straggler import parse_straggler

        cal = calibrate()
        mode = parse_mode(self.mode)
        compute = Compute(parse_straggler(self.straggler), cal.base,
                          cal.cores if cores else None, cal.background, cal.wake if wake else 0.0)
        r = simulate(lambda: mode.build(self.workers), self.workers, compute,
                     servers=self.servers, network=cal.network(), apply_s=cal.apply / self.servers,
                     seed=self.seed)
        return r.time_per_update

    def measure(self) -> float:
        """Run the job once (blocks, ~10-30 s) and return its steady seconds per update."""
        points = _run_job(self.workers, self.servers, self._flags(), self.straggler,
                          self.epochs, self.seed)
        return steady_seconds_per_update(points)


def ps_cases(quick: bool = False) -> list[PSCase]:
    """The scored parameter-server jobs (`quick`: fewer epochs)."""
    epochs = 4 if quick else EPOCHS
    s = "exp:mean=0.05"
    return [
        PSCase("ps sync 3w+1s exp50ms", 3, 1, "sync", s, epochs),
        PSCase("ps ksync:2 3w+1s exp50ms", 3, 1, "ksync:2", s, epochs),
        PSCase("ps kbatch-sync:2 3w+1s exp50ms", 3, 1, "kbatch-sync:2", s, epochs),
        PSCase("ps async 3w+1s exp50ms", 3, 1, "async", s, epochs),
        PSCase("ps sync 2w+2s exp50ms", 2, 2, "sync", s, epochs),
        PSCase("ps sync 4w+1s exp50ms", 4, 1, "sync", s, epochs),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    cases = ps_cases(args.quick)
    cal = calibrate()
    measured = {c.name: [] for c in cases}
    for rep in range(args.reps):
        for c in cases:
            t0 = time.perf_counter()
            measured[c.name].append(c.measure())
            print(f"rep {rep} {c.name}: {measured[c.name][-1] * 1e3:.2f} ms per update "
                  f"({time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
    print(cal.describe())
    variants = {"own core": dict(cores=False, wake=False), "+ shared cores": dict(wake=False),
                "+ sleep overrun": {}}
    print("| job | procs | measured median (ms) | spread | "
          + " | ".join(f"predicted, {v} (ms) | error" for v in variants) + " |")
    print("|---|---|---|---|" + "---|---|" * len(variants))
    errors: dict[str, list[float]] = {v: [] for v in variants}
    predicted: dict[str, dict[str, float]] = {v: {} for v in variants}
    for c in cases:
        m = statistics.median(measured[c.name])
        row = f"| {c.name} | {c.procs} | {m * 1e3:.2f} | {_spread(measured[c.name]):.1%} |"
        for v, kw in variants.items():
            p = predicted[v][c.name] = c.predict(**kw)
            errors[v].append(abs(p / m - 1))
            row += f" {p * 1e3:.2f} | {p / m - 1:+.1%} |"
        print(row)
    for v, e in errors.items():
        tau, good, bad, _ = resolved_tau(measured, predicted[v])
        print(f"{v}: median |error| {statistics.median(e):.1%}, max {max(e):.1%}; Kendall tau "
              f"{tau} over the {good + bad} pairs apart by more than their spread")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
