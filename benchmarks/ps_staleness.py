"""examples/digits_ps.py with its defaults, per mode and worker count, and the stale-gradient
update rules against each other.

    python benchmarks/ps_staleness.py --table [--workers 2,4,8,16]
    python benchmarks/ps_staleness.py --rules [--workers 8] [--modes async,ssp]

Each run is exactly `disttrain run --workers W --servers 2 examples/digits_ps.py --mode M`
(plus `--step S --momentum-rule R` with --rules), one at a time. Printed per run: worker
0's final test accuracy, the wall time of the whole job, server 0's mean staleness and
whether a server warned that its momentum and staleness are in the diverging range.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "ksync", "kbatch-sync", "async", "kasync", "kbatch-async", "ssp")
RULES = [(step, momentum) for momentum in ("as-given", "corrected")
         for step in ("constant", "inverse-staleness")]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTTRAIN_SERVERS",
                "DISTTRAIN_SECRET")


def run(workers: int, mode: str, extra: list[str]) -> dict:
    """One job, blocking; its accuracy, wall time, server 0's mean staleness, warning."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    cmd = [sys.executable, "-m", "disttrain", "run", "--workers", str(workers), "--servers", "2",
           "examples/digits_ps.py", "--mode", mode, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall, out = time.perf_counter() - start, proc.stdout + proc.stderr
    acc = re.findall(r"final test accuracy: ([0-9.]+)", out)
    hist = re.search(r"\[ps server0\][^\n]*staleness \{([^}]*)\}", out)
    pairs = [tuple(map(int, kv.split(":"))) for kv in hist.group(1).split(",")] if hist and hist.group(1) else []
    n = sum(c for _, c in pairs)
    return {"accuracy": acc[-1] if acc else f"failed (exit {proc.returncode})", "wall": wall,
            "staleness": sum(k * c for k, c in pairs) / n if n else float("nan"),
            "warned": "WARNING" in out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="every mode, defaults")
    parser.add_argument("--rules", action="store_true", help="the four update rules")
    parser.add_argument("--workers", default=None, help="comma-separated worker counts")
    parser.add_argument("--modes", default=None, help="comma-separated modes")
    args = parser.parse_args()
    if args.table == args.rules:
        parser.error("pass exactly one of --table or --rules")
    workers = [int(w) for w in (args.workers or ("2,4,8,16" if args.table else "8")).split(",")]
    modes = (args.modes or (",".join(MODES) if args.table else "async,ssp")).split(",")
    rules = [[]] if args.table else [["--step", s, "--momentum-rule", m] for s, m in RULES]
    print("| workers | mode | rule | accuracy | wall (s) | mean staleness | warned |")
    print("|---|---|---|---|---|---|---|")
    for w in workers:
        for mode in modes:
            for extra in rules:
                r = run(w, mode, extra)
                rule = " ".join(extra[1::2]) or "default"
                print(f"| {w} | {mode} | {rule} | {r['accuracy']} | {r['wall']:.0f} | "
                      f"{r['staleness']:.1f} | {'yes' if r['warned'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
