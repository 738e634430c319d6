"""`disttrain plan profile --ranks 2,4,8`: how much slower a block runs beside N-1 others.

The ranks of a job on one machine share its cores, its caches and its memory bus. The
planner's `cpu-here` gives each of N ranks 1/N of the machine once N x threads exceeds
the CPUs (processor sharing), which leaves out what sharing costs beyond the cores:
measured here, two single-thread copies of the 4-layer GPT each ran their blocks 1.00-1.17x
slower on 2 cores (sharing alone says 1.0), four 2.18-2.55x (2.0), eight 5.0x (4.0).
So `--ranks` measures it, and what a blocking collective costs between computing ranks
(plan/profile_sync.py: "collectives" in the file): for each N, N copies of the same
profile run at once (separate processes; each measures once all N have warmed up and
computes on until all N have measured, `--together`: started alone, two copies'
measured steps barely overlapped and read 0.86-0.99x), and the file records the median
copy's block seconds
(forward + backward) over the single run's, under "shared" (`{"2": 1.10, ...}`).
`plan/profiled.py` then uses the measured slowdown for a layout of exactly N ranks on
the machine, and the sharing formula for any other N.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["shared_slowdowns", "block_seconds", "inline_collectives", "parse_ranks"]


def block_seconds(profile: dict) -> float:
    """Median forward + backward seconds of the profile's repeated layer (its blocks)."""
    kinds: dict[str, list[dict]] = {}
    for row in profile["layers"]:
        kinds.setdefault(row["kind"], []).append(row)
    blocks = max(kinds.values(), key=len)
    return (statistics.median(r["forward_s"] for r in blocks)
            + statistics.median(r["backward_s"] for r in blocks))


def _copies(script: str, n: int, steps: int, threads: int | None, workdir: str) -> list[dict]:
    """Run `n` profiles of `script` at once (blocks until all end); their dicts. The copies
    measure together (`--together`): each starts its measured steps once all n warmed up
    and computes on until all n measured, so no copy measures alone while the others
    still import torch (they did before: two copies measured 0.86-0.99x of one)."""
    procs, outs = [], []
    meet = os.path.join(workdir, f"together{n}")
    os.makedirs(meet, exist_ok=True)
    for i in range(n):
        out = os.path.join(workdir, f"copy{n}_{i}.json")
        cmd = [sys.executable, "-m", "disttrain", "plan", "profile", script, "--steps", str(steps),
               "--out", out, "--together", f"{meet}:{n}",
               *(["--threads", str(threads)] if threads else [])]
        with open(out + ".err", "w") as err:  # NOTE: a file, not a pipe nobody reads yet
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err))
        outs.append(out)
    failed = _wait_all(procs, [o + ".err" for o in outs], timeout=900)
    errors = [] if failed is None else [failed]
    if errors:
        raise ValueError(f"--ranks {n}: a copy of the profile failed: {errors[0][0]}")
    result = []
    for out in outs:
        with open(out) as f:
            result.append(json.load(f))
    return result


def _wait_all(procs: list, errs: list[str], timeout: float) -> list[str] | None:
    """Wait for every process; at the first that fails, kill the rest (they would wait
    for it at --together's meeting) and return its last stderr line. Blocks."""
    end, bad = time.monotonic() + timeout, None
    while bad is None and None in [p.poll() for p in procs]:  # NOTE: a list: poll every one
        bad = next((p for p in procs if p.returncode), None)
        if bad is None and time.monotonic() > end:
            for p in procs:
                p.kill()
            return [f"no result within {timeout:.0f} s"]
        time.sleep(0.05)
    bad = bad or next((p for p in procs if p.returncode), None)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if bad is None:
        return None
    with open(errs[procs.index(bad)]) as f:
        err = f.read()
    return err.strip().splitlines()[-1:] or [f"exit {bad.returncode}"]


def shared_slowdowns(script: str, alone: dict, ranks: list[int], steps: int,
                     threads: int | None) -> dict[str, float]:
    """{str(N): median copy's block seconds / `alone`'s} for each N of `ranks` (N >= 2).

    Blocks for sum(N) profiles' time, N at once."""
    base = block_seconds(alone)
    out = {}
    with tempfile.TemporaryDirectory(prefix="disttrain_profile_") as workdir:
        for n in ranks:
            copies = _copies(script, n, steps, threads, workdir)
            out[str(n)] = round(statistics.median(block_seconds(c) for c in copies) / base, 4)
    return out


def _activation_bytes(profile: dict) -> int:
    """fp32 bytes of one micro-batch's layer output (b x s x h x 4): what tp all-reduces."""
    from disttrain.plan.gpt import parse_gpt

    gpt = profile.get("gpt")
    hidden = parse_gpt(gpt).hidden if gpt else 128
    return 4 * profile["batch"] * profile["seq"] * hidden


def inline_collectives(profile: dict, ranks: list[int]) -> dict[str, dict]:
    """{str(N): plan/profile_sync.py's measurement} for each even N of `ranks`: what one
    blocking pair all-reduce of the profile's activation bytes adds between compute.

    Blocks for about 5 s per N (N processes at once)."""
    nbytes = _activation_bytes(profile)
    out = {}
    with tempfile.TemporaryDirectory(prefix="disttrain_profile_") as workdir:
        for n in (k for k in ranks if k % 2 == 0):
            store, res = os.path.join(workdir, f"store{n}"), os.path.join(workdir, f"sync{n}.json")
            procs = [subprocess.Popen([sys.executable, "-m", "disttrain.plan.profile_sync", str(r),
                                       str(n), store, str(nbytes), res],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
                     for r in range(n)]
            errors = [p.communicate(timeout=600)[1] for p in procs]
            if any(p.returncode for p in procs) or not os.path.exists(res):
                last = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "no output")
                raise ValueError(f"--ranks {n}: the collective measurement failed: {last}")
            with open(res) as f:
                out[str(n)] = json.load(f)
    return out


def parse_ranks(text: str) -> list[int]:
    """"2,4,8" -> [2, 4, 8]; a ValueError naming the fix for anything else."""
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--ranks {text!r}: give process counts like 2,4,8") from None
    if not ranks or ranks[0] < 2 or ranks[-1] > 64:
        raise ValueError(f"--ranks {text!r}: each count must be 2..64 (1 is the profile itself)")
    return ranks
