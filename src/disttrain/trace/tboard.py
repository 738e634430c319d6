"""TensorBoard event files of a traced run: the scalars of metrics.jsonl, a run per rank.

When the merge (merge.py) has written `DIR/metrics.jsonl` it calls `write(DIR, lines)`:
if the `tensorboard` package is installed (`pip install 'disttrain[tensorboard]'`), every
rank's lines become scalars in `DIR/tensorboard/rank{R}/` (`rank{R}.a{A}` for a restart
attempt), one point per step at the step's end on the aligned clock: each number of the
line under its own name (step_time, compute, exposed_comm, data, idle, samples_per_s,
tokens_per_s, pipeline_bubble, peak_memory_bytes, ps_staleness, ps_updates_per_s, what
`disttrain.log` got, ...) and each dict's entries as `name/key` (bytes/all_reduce,
collectives/all_reduce, idle_named/...). `tensorboard --logdir DIR/tensorboard` shows
them. Written once, after the job, by the process that merges: nothing runs in the
training processes. Without tensorboard nothing is written and nothing is said.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["write", "scalars"]

SKIP = ("step", "rank", "attempt", "t0_s")


def scalars(line: dict) -> list[tuple[str, float]]:
    """(tag, value) of every number in a metrics line (dicts' entries as 'name/key')."""
    out = []
    for key, value in line.items():
        if key in SKIP:
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append((key if sub is None else f"{key}/{sub}", float(v)))
    return out


def write(directory: str, lines: list[dict], start_unix_s: float = 0.0) -> str | None:
    """Write DIR/tensorboard/ from merged metrics lines; its path, or None without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    out = os.path.join(directory, "tensorboard")
    shutil.rmtree(out, ignore_errors=True)  # NOTE: a previous merge's files of this folder
    writers: dict[tuple[int, int], SummaryWriter] = {}
    try:
        for m in lines:
            key = (int(m.get("rank", 0)), int(m.get("attempt", 0)))
            w = writers.get(key)
            if w is None:
                name = f"rank{key[0]}" + (f".a{key[1]}" if key[1] else "")
                w = writers[key] = SummaryWriter(os.path.join(out, name))
            wall = start_unix_s + m.get("t0_s", 0.0) + m.get("step_time", 0.0)
            for tag, value in scalars(m):
                w.add_scalar(tag, value, int(m["step"]), walltime=wall)
    finally:
        for w in writers.values():
            w.close()
    return out
