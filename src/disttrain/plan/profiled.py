"""A measured per-layer profile as `disttrain plan layout --profile FILE` uses it.

`disttrain plan profile script.py` (plan/profile.py) writes the file: the forward and
backward seconds and saved-activation bytes of each top-level layer of the user's
module, measured on this machine. `load_profile` reads it for a GPT of the planner's
notation and returns a `LayerProfile`: the median transformer block's forward and
backward seconds and the LM head's, with the FLOPs they were measured at, so that
cost.py's `layer_seconds` scales them by FLOPs (micro-batch b / profiled b, over tp)
in place of FLOPs over the device's matmul rate. Pure Python over JSON: no torch.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, replace

from disttrain.plan.gpt import GPTSpec, parse_gpt

__all__ = ["LayerProfile", "load_profile", "median_profile", "profile_model"]

FORMAT = "disttrain-plan-profile/1"


@dataclass(frozen=True)
class LayerProfile:
    """Measured seconds of one transformer block and of the LM head, at `flops` / `head_flops`."""

    path: str
    block: str
    """The repeated layer's class (the transformer block)."""
    blocks: int
    fwd_s: float
    bwd_s: float
    head_fwd_s: float
    head_bwd_s: float
    flops: float
    """Forward matmul FLOPs of one block at the profiled batch: (24bsh^2 + 4bs^2h)."""
    head_flops: float
    """Forward FLOPs of the LM head at the profiled batch: 2bshV."""
    batch: int
    threads: int
    """Torch threads the profile ran with."""
    cpus: int
    """CPUs of the machine it ran on."""
    share: float = 1.0
    """How many times slower a layer runs when ranks share the machine."""
    optimizer_s: float | None = None
    """Measured optimizer step at `optimizer_params` parameters per device (`--calibrate`,
    or the AdamW step `plan profile` times)."""
    optimizer_params: float = 0.0
    calibrated: bool = False
    """True when the seconds come from a traced run (`--calibrate DIR`), not `plan profile`."""
    measured: tuple[tuple[int, float], ...] = ()
    """(N, slowdown) measured with N copies at once (`plan profile --ranks`)."""
    share_measured: bool = False
    """True when `share` is one of `measured`, not the sharing formula."""
    collectives: tuple[tuple[int, float, float], ...] = ()
    """(N, bytes, seconds): what one blocking pair all-reduce of `bytes` adds between
    compute with N ranks on the machine (`plan profile --ranks`, plan/profile_sync.py)."""
    inline: tuple[float, float] | None = None
    """(bytes, seconds) of `collectives` for the N of `shared(N)`, if measured."""
    full: bool = False
    """The ranks fill the CPUs (N x threads >= cpus): no core is left to overlap
    communication's CPU work with compute."""
    loops: tuple[tuple[int, float, float], ...] = ()
    """(N, call seconds, compute slowdown) with N ranks alternating compute and a blocking
    pair all-reduce (plan/profile_sync.py's third loop): the all-reduce call's wall
    seconds, and that loop's compute seconds over their CPU seconds."""
    loop: tuple[float, float] | None = None
    """`loops`' (call seconds, slowdown) for the N of `shared(N)`, if measured."""
    alternating: bool = False
    """Priced as ranks that alternate compute and blocking collectives (`alternate()`)."""
    ranks: int = 1
    """The N of `shared(N)`: ranks on this machine."""
    at_once: float | None = None
    """Ranks computing at once on average, where `computing()` priced fewer than `ranks`."""

    def shared(self, n: int) -> LayerProfile:
        """As one of `n` ranks on this machine sees it: the slowdown measured with `n`
        copies at once (`--ranks`), else slower once n x threads > cpus (processor sharing)."""
        k = dict(self.measured).get(n)
        return replace(self, share=max(1.0, n * self.threads / self.cpus if k is None else k),
                       share_measured=k is not None, ranks=n, full=n * self.threads >= self.cpus,
                       inline=next(((b, s) for m, b, s in self.collectives if m == n), None),
                       loop=next(((c, x) for m, c, x in self.loops if m == n), None))

    def computing(self, busy: float) -> LayerProfile:
        """As one of `ranks` ranks that each compute only `busy` of the step (a pipeline
        stage waits in its bubble, blocked in a receive, leaving its core to the others):
        the slowdown measured with `ranks x busy` copies at once, linear between the
        measured counts (one copy: 1.0); itself when not measured or when alternating."""
        if not self.share_measured or self.alternating or busy >= 1.0:
            return self
        n, points = max(1.0, self.ranks * busy), ((1, 1.0), *self.measured)
        for (a, ka), (b, kb) in zip(points, points[1:]):
            if a <= n <= b:
                return replace(self, share=max(1.0, ka + (kb - ka) * (n - a) / (b - a)), at_once=n)
        return self

    def alternate(self) -> LayerProfile:
        """As ranks that block on a collective after every piece of compute (a
        tensor-parallel layer) see it: compute at the measured loop's slowdown, and each
        blocking collective taking the loop's measured call; itself if not measured."""
        if self.loop is None or self.inline is None:
            return self
        call, k = self.loop
        return replace(self, share=max(1.0, k), share_measured=True, alternating=True,
                       inline=(self.inline[0], call))


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise ValueError(f"--profile {path}: cannot read it ({err.strerror}); write one with "
                         f"`disttrain plan profile script.py --out {path}`") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--profile {path}: not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"--profile {path}: not a `disttrain plan profile` file "
                         f"(format {FORMAT!r} expected)")
    missing = [k for k in ("batch", "seq", "threads", "cpus", "layers") if k not in data]
    missing += sorted({k for row in data.get("layers", []) for k in ("kind", "forward_s",
                       "backward_s") if k not in row})
    if missing:
        raise ValueError(f"--profile {path} lacks {', '.join(missing)}; write it again with "
                         f"`disttrain plan profile`")
    return data


def profile_model(path: str) -> GPTSpec | None:
    """The GPT the profile measured, when its script's model said (`cfg` of models/gpt.py)."""
    gpt = _read(path).get("gpt")
    return parse_gpt(gpt) if gpt else None


def load_profile(path: str, m: GPTSpec) -> LayerProfile:
    """`path`'s block and head seconds for planning `m`; a ValueError saying what differs."""
    data = _read(path)
    layers = data["layers"]
    kinds = Counter(layer["kind"] for layer in layers)
    block, count = kinds.most_common(1)[0]
    if count != m.layers:
        raise ValueError(f"--profile {path} measured {count} {block} layers; --model has "
                         f"layers={m.layers}: profile the model you plan (or give no --model)")
    if data["seq"] != m.seq:
        raise ValueError(f"--profile {path} measured sequences of {data['seq']} tokens; "
                         f"--model has seq={m.seq}")
    last = max(i for i, layer in enumerate(layers) if layer["kind"] == block)
    after = layers[last + 1:]  # the LM head (and its LayerNorm): what follows the blocks
    blocks = [layer for layer in layers if layer["kind"] == block]
    b, s, h = data["batch"], m.seq, m.hidden
    opt = data.get("optimizer") or {}  # NOTE: files written before the optimizer was timed
    return LayerProfile(
        path=path, block=block, blocks=count,
        fwd_s=statistics.median(x["forward_s"] for x in blocks),
        bwd_s=statistics.median(x["backward_s"] for x in blocks),
        head_fwd_s=sum(x["forward_s"] for x in after),
        head_bwd_s=sum(x["backward_s"] for x in after),
        flops=24 * b * s * h * h + 4 * b * s * s * h, head_flops=2 * b * s * h * m.vocab,
        batch=b, threads=data["threads"], cpus=data["cpus"],
        optimizer_s=opt.get("step_s"), optimizer_params=opt.get("params", 0.0),
        measured=_measured(path, data.get("shared", {})),
        collectives=_collectives(path, data.get("collectives", {})),
        loops=_loops(path, data.get("collectives", {})))


def _loops(path: str, rows) -> tuple[tuple[int, float, float], ...]:
    """(N, call_s, (both_s - call_s) / compute_cpu_s) of the "collectives" rows that have
    them (files written before they were measured have not)."""
    keys = ("call_s", "both_s", "compute_cpu_s")
    out = []
    for n, r in rows.items():
        if not all(k in r for k in keys):
            continue
        call, both, cpu = (float(r[k]) for k in keys)
        if not (0 <= call <= both < math.inf and 0 < cpu < math.inf):
            raise ValueError(f"--profile {path}: collectives[{n!r}] needs 0 <= call_s <= both_s and "
                             f"compute_cpu_s > 0; write it again with `disttrain plan profile --ranks`")
        out.append((int(n), call, (both - call) / cpu))
    return tuple(sorted(out))


def _collectives(path: str, rows) -> tuple[tuple[int, float, float], ...]:
    """The file's "collectives" measurements, checked: {"N": {"bytes", "inline_s"}}."""
    try:
        out = tuple(sorted((int(n), float(r["bytes"]), float(r["inline_s"])) for n, r in rows.items()))
    except (AttributeError, KeyError, TypeError, ValueError):
        out = ((0, 0.0, -1.0),)
    if any(n < 2 or not (0 < b < math.inf and 0 <= s < math.inf) for n, b, s in out):
        raise ValueError(f"--profile {path}: its \"collectives\" must be {{\"N\": {{\"bytes\": B, "
                         f"\"inline_s\": s}}}}; write it again with `disttrain plan profile --ranks`")
    return out


def _measured(path: str, shared) -> tuple[tuple[int, float], ...]:
    """The file's "shared" slowdowns, checked: {"N": k} with N >= 2 and k > 0."""
    try:
        rows = tuple(sorted((int(n), float(k)) for n, k in shared.items()))
    except (AttributeError, TypeError, ValueError):
        rows = ((0, 0.0),)
    if any(n < 2 or not 0 < k < math.inf for n, k in rows):
        raise ValueError(f"--profile {path}: its \"shared\" slowdowns must be {{\"N\": k}} with "
                         f"N >= 2 and k > 0; write it again with `disttrain plan profile --ranks`")
    return rows


def median_profile(docs: list[dict]) -> dict:
    """One profile from several runs of `plan profile` on the same script: each number the
    median of its runs (a run disturbed by a burst of load then moves no input), each
    other field the first run's. Refuses runs of different scripts or shapes."""
    if not docs:
        raise ValueError("median_profile needs at least one profile")
    return _median(docs, "profile")


def _median(values: list, where: str):
    first = values[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict, list)):
        if any(v != first for v in values):
            raise ValueError(f"profiles differ at {where}: {values!r}; merge runs of one script only")
        return first
    if isinstance(first, (int, float)):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"profiles differ at {where}: {values!r}")
        if all(isinstance(v, int) for v in values):
            return statistics.median_low(values)
        return statistics.median(values)
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise ValueError(f"profiles differ in the fields of {where}")
        return {k: _median([v[k] for v in values], f"{where}.{k}") for k in first}
    if any(not isinstance(v, list) or len(v) != len(first) for v in values):
        raise ValueError(f"profiles differ in the length of {where}")
    return [_median([v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]

