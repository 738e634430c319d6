"""The layout cases of benchmarks/plan_accuracy.py: examples/gpt_char.py in a chosen layout.

Each `LayoutCase` predicts its step with the planner's own model (plan/cost.py's
`estimate`, device `cpu-here`) from inputs measured apart from the cases' runs
(`Calibration`: one profile before each round of runs, their median used): the GPT's
block and LM-head seconds and its AdamW step from `disttrain plan profile` of the same
model in one process with one thread, at the cases' micro-batch; the links and CPU-pool terms from devices.json's `cpu-here`
(benchmarks/allreduce.py's fit); an emulated link of rate R at that fit's efficiency x R. `measure()` runs the real
job once (`disttrain run --nproc N`, or `--cluster` on an emulated cluster) and returns
the median of its steady-state step times, read from rank 0's log: the example prints
the cumulative tokens/s after every step (`--log-every 1`), so step k ended at
k x tokens per step / rate_k.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace

from disttrain.plan.cost import Layout, estimate
from disttrain.plan.devices import device
from disttrain.plan.gpt import GPTSpec
from disttrain.plan.profiled import load_profile, median_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "gpt_char.py")
MODEL = GPTSpec(layers=4, hidden=128, heads=4, seq=64, vocab=128)
MICRO = 8
"""Sequences per micro-batch in every case (the profile measures this batch)."""
WARMUP = 3
RANKS = "2,4,8"
"""Process counts the calibration also profiles at once (`plan profile --ranks`): the cases'."""
"""Steps left out at the start of each job (allocation, first-touch, gloo's setup)."""

PROFILE_TARGET = f"""
import torch
from disttrain.models.gpt import GPT, GPTConfig

def profile_target():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size={MODEL.vocab}, block_size={MODEL.seq}, n_layer={MODEL.layers},
                    n_head={MODEL.heads}, n_embd={MODEL.hidden})
    return GPT(cfg), torch.randint(0, {MODEL.vocab}, ({MICRO}, {MODEL.seq}))
"""


def _env() -> dict:
    # NOTE: one intra-op thread per rank, as the profile ran: N ranks on C cores then
    # share them as the planner's `cpu-here` assumes (max(1, N x threads / C) slower)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Calibration:
    """The inputs every prediction uses, measured once before any scored job runs."""

    workdir: str
    profile: str = ""
    lines: list[str] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    """Every `plan profile` run's file; `profile` holds their median."""

    def run(self, steps: int = 20) -> None:
        """Profile the model in one process, then at 2, 4 and 8 ranks at once (blocks ~60 s).

        Each call adds one run; the inputs are the median of the runs so far
        (plan/profiled.py's `median_profile`), so benchmarks/plan_accuracy.py calls it
        before each round of jobs and one burst of load moves no input."""
        target = os.path.join(self.workdir, "profile_target.py")
        with open(target, "w") as f:
            f.write(PROFILE_TARGET)
        out = os.path.join(self.workdir, f"profile_{len(self.runs)}.json")
        cmd = [sys.executable, "-m", "disttrain", "plan", "profile", target, "--out", out,
               "--steps", str(steps), "--threads", "1", "--ranks", RANKS]
        res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
        if res.returncode:
            raise RuntimeError(f"calibration `{' '.join(cmd)}` failed:\n{res.stdout}{res.stderr}")
        with open(out) as f:
            self.runs.append(json.load(f))
        self.profile = os.path.join(self.workdir, "profile.json")
        with open(self.profile, "w") as f:
            json.dump(median_profile(self.runs), f)
        each = [load_profile(os.path.join(self.workdir, f"profile_{i}.json"), MODEL)
                for i in range(len(self.runs))]
        p = load_profile(self.profile, MODEL)
        base = device("cpu-here")
        self.lines = [
            f"compute: `disttrain plan profile` of the {MODEL.layers}-layer GPT (hidden {MODEL.hidden}, "
            f"seq {MODEL.seq}) in one process, 1 thread, batch {MICRO}, {steps} steps: block "
            f"{p.fwd_s * 1e3:.2f} / {p.bwd_s * 1e3:.2f} ms fwd / bwd, head {p.head_fwd_s * 1e3:.2f} / "
            f"{p.head_bwd_s * 1e3:.2f} ms (medians; the median of {len(self.runs)} profile runs, blocks "
            + ", ".join(f"{q.fwd_s * 1e3:.2f}/{q.bwd_s * 1e3:.2f}" for q in each) + ")",
            f"links: devices.json cpu-here ({base.sources.get('inter', '')}); inside one machine "
            f"{base.intra_Bps / 1e9:g} GB/s, alpha {base.intra_alpha * 1e6:g} us; CPU pool "
            f"{base.step_alpha * 1e6:g} us per sender and step ({base.sources.get('cpu', '')})",
            f"emulated link of rate R: {base.inter_Bps * 8 / 1e9:.3g} x R (the 1 Gbit/s fit's "
            f"efficiency), alpha {base.inter_alpha * 1e6:g} us; a node's ranks share its link",
            (f"optimizer: the same profile's AdamW step, {p.optimizer_s * 1e3:.2f} ms at "
             f"{p.optimizer_params:,.0f} parameters (median)" if p.optimizer_s is not None
             else "optimizer: 30 B/param at devices.json cpu-here's copy rate (the profile has no step)"),
            "memory bandwidth (gradient accumulation): devices.json cpu-here (measured copy rate)",
            "ranks sharing the machine: blocks " + ", ".join(
                f"{k:.3g}x slower with {n} copies of the profile at once" for n, k in p.measured)
            + " (plan profile --ranks); any other count: processor sharing",
            "a blocking pair all-reduce of one micro-batch's activation between compute: " + ", ".join(
                f"{s * 1e3:.3g} ms added at {n} ranks" for n, _, s in p.collectives)
            + "; with ranks alternating compute and it (tp > 1; ZeRO-3 on full cores): " + ", ".join(
                f"the call {c * 1e3:.3g} ms, compute {k:.3g}x at {n}" for n, c, k in p.loops)
            + " (plan profile --ranks, plan/profile_sync.py)",
        ]

    @contextlib.contextmanager
    def only(self, i: int):
        """Inside: predictions come from calibration run `i` alone (not the median)."""
        pooled, self.profile = self.profile, os.path.join(self.workdir, "profile_only.json")
        with open(self.profile, "w") as f:
            json.dump(self.runs[i], f)
        try:
            yield
        finally:
            self.profile = pooled

    def device(self, rate_bps: float | None, per_node: int):
        """cpu-here with the profile; on an emulated cluster its link at `rate_bps`."""
        base = device("cpu-here")
        dev = replace(base, profile=load_profile(self.profile, MODEL))
        if rate_bps is None:
            return dev
        fit = base.inter_Bps / 1e9 * 8  # bytes/s the 1 Gbit/s link carried, per bit/s
        return replace(dev, inter_Bps=fit * rate_bps / 8 / per_node)


class Clusters:
    """Emulated clusters the cases share, brought up on first use, all down at the end."""

    def __init__(self):
        self.up: dict[tuple[int, str], str] = {}

    def name(self, nodes: int, rate: str) -> str:
        """The cluster of `nodes` nodes at `rate` (brought up now if new). Blocks ~1 s."""
        key = (nodes, rate)
        if key not in self.up:
            name = f"pa{os.getpid() % 1000}{len(self.up)}"
            _disttrain("cluster", "down", name)
            _disttrain("cluster", "up", name, "--nodes", str(nodes), "--link", rate, check=True)
            self.up[key] = name
        return self.up[key]

    def down(self) -> None:
        for name in self.up.values():
            _disttrain("cluster", "down", name)
        self.up.clear()


def _disttrain(*args: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "disttrain", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    if check and res.returncode:
        raise RuntimeError(f"`disttrain {' '.join(args)}` exited {res.returncode}:\n"
                           f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return res


RATE = re.compile(r"step\s+(\d+)\s+loss\s+\S+\s+\(([\d,]+) tokens/s\)")


def step_times(log: str, tokens_per_step: int) -> list[float]:
    """Seconds of each step after the first from the example's cumulative tokens/s lines."""
    ends = {}
    for k, rate in RATE.findall(log):
        ends[int(k)] = int(k) * tokens_per_step / int(rate.replace(",", ""))
    ks = sorted(ends)
    return [ends[k] - ends[j] for j, k in zip(ks, ks[1:]) if k == j + 1]


@dataclass
class LayoutCase:
    """One examples/gpt_char.py layout: predicted by plan/cost.py, measured by running it."""

    name: str
    pp: int = 1
    dp: int = 1
    tp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 2
    algorithm: str = "native"
    nodes: int = 1
    """Emulated nodes (1: `disttrain run --nproc` on this machine)."""
    rate: str = ""
    """The emulated link (`--link`), e.g. 1gbit."""
    steps: int = 10
    calibration: Calibration | None = None
    clusters: Clusters | None = None

    @property
    def procs(self) -> int:
        return self.pp * self.dp * self.tp

    def layout(self) -> Layout:
        return Layout(self.pp, self.dp, self.tp, self.zero, MICRO, self.microbatches,
                      self.schedule if self.pp > 1 else "-", False, False, "fp32", self.algorithm)

    def predict(self) -> float:
        """Seconds per step from the planner's model. Starts no process."""
        per_node = self.procs // self.nodes
        rate = _bits(self.rate) if self.nodes > 1 else None
        dev = self.calibration.device(rate, per_node)
        return estimate(MODEL, self.layout(), dev, per_node).step

    def command(self, cluster: str | None) -> list[str]:
        where = (["--cluster", cluster, "--nproc-per-node", str(self.procs // self.nodes)]
                 if cluster else ["--nproc", str(self.procs)])
        return [sys.executable, "-m", "disttrain", "run", *where, EXAMPLE,
                "--pp", str(self.pp), "--dp", str(self.dp), "--tp", str(self.tp),
                "--zero", str(self.zero), "--schedule", self.schedule, "--algorithm", self.algorithm,
                "--microbatches", str(self.microbatches), "--batch-size", str(MICRO * self.microbatches),
                "--n-layer", str(MODEL.layers), "--n-head", str(MODEL.heads),
                "--n-embd", str(MODEL.hidden), "--block-size", str(MODEL.seq),
                "--steps", str(self.steps), "--log-every", "1", "--sample-chars", "0", "--clip", "0"]

    def measure(self) -> float:
        """Run the job once (blocks, ~10-40 s); the median step after WARMUP steps."""
        cluster = self.clusters.name(self.nodes, self.rate) if self.nodes > 1 else None
        cmd = self.command(cluster)
        with tempfile.TemporaryFile("w+") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                  timeout=600).returncode
            out.seek(0)
            log = out.read()
        if code:
            raise RuntimeError(f"{self.name}: `{' '.join(cmd[2:])}` exited {code}; last lines:\n"
                               + "\n".join(log.splitlines()[-25:]))
        times = step_times(log, MICRO * self.microbatches * self.dp * MODEL.seq)[WARMUP - 1:]
        if not times:
            raise RuntimeError(f"{self.name}: no step times in the job's log; last lines:\n"
                               + "\n".join(log.splitlines()[-25:]))
        return statistics.median(times)


def _bits(rate: str) -> float:
    from disttrain.cluster.spec import parse_rate

    return parse_rate(rate) * 1.0


def layout_cases(calibration: Calibration, clusters: Clusters, quick: bool = False) -> list[LayoutCase]:
    """The scored layouts: DataParallel per algorithm, ZeRO 1-3, tp, pp, pp x dp x tp on 8
    processes with every schedule, and dp / pp over emulated 2-node clusters at two rates."""
    steps = 7 if quick else 10
    c = [
        LayoutCase("dp2 native", dp=2),
        LayoutCase("dp2 ring", dp=2, algorithm="ring"),
        LayoutCase("dp2 halving-doubling", dp=2, algorithm="halving-doubling"),
        LayoutCase("dp4 tree", dp=4, algorithm="tree"),
        LayoutCase("dp2 zero1", dp=2, zero=1),
        LayoutCase("dp2 zero2", dp=2, zero=2),
        LayoutCase("dp2 zero3", dp=2, zero=3),
        LayoutCase("tp2", tp=2),
        LayoutCase("pp2 1f1b m4", pp=2, microbatches=4),
        LayoutCase("pp2 dp2 gpipe m4", pp=2, dp=2, schedule="gpipe", microbatches=4),
        *(LayoutCase(f"pp2 dp2 tp2 {s} m4", pp=2, dp=2, tp=2, schedule=s, microbatches=4)
          for s in ("gpipe", "1f1b", "interleaved", "zb-h1")),
        LayoutCase("2x2 dp4 ring 1gbit", dp=4, algorithm="ring", nodes=2, rate="1gbit"),
        LayoutCase("2x2 dp4 hierarchical 1gbit", dp=4, algorithm="hierarchical", nodes=2, rate="1gbit"),
        LayoutCase("2x2 dp4 ring 100mbit", dp=4, algorithm="ring", nodes=2, rate="100mbit"),
        LayoutCase("2x1 pp2 1f1b m4 100mbit", pp=2, microbatches=4, nodes=2, rate="100mbit"),
    ]
    if quick:
        keep = ("dp2 native", "dp2 zero3", "pp2 dp2 tp2 1f1b m4", "2x2 dp4 ring 100mbit")
        c = [x for x in c if x.name in keep]
    for x in c:
        x.steps, x.calibration, x.clusters = steps, calibration, clusters
    return c
