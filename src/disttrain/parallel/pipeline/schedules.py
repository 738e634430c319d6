"""Pipeline schedules as pure functions: per-stage ordered lists of F/B(/W) actions.

Nothing here talks to another process: runtime.py executes the lists with point-to-point
send/recv, and `simulate()` computes their timing from the same dependencies, so bubble
formulas are checked in unit tests (docs/design/model-parallelism.md, "Pipeline").

- GPipe (Huang et al. 2019, arXiv 1811.06965): all forwards, then all backwards.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv 2006.09503): stage i warms up with
  p-i-1 forwards, then alternates one F and one B; holds at most p-i activations.
- Interleaved 1F1B (Narayanan et al. 2021, arXiv 2104.04473, as Megatron-LM): v chunks
  per stage, chunk c of stage s is virtual stage c*p + s; bubble (p-1)/(v*m).
- ZB-H1 (Qi et al. 2023, arXiv 2401.10241): backward split into B (input gradient) and
  W (weight gradients), W deferred into the cool-down; split_backward.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Action", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "make_schedule",
    "check_schedule", "simulate", "Simulation", "peak_in_flight", "peak_pending_w",
    "peak_until_w", "SCHEDULES", "SCHEDULE_TABLE",
]


@dataclass(frozen=True)
class Action:
    """One step of a stage: run `kind` of `microbatch` on model `chunk`.

    kind: "F" forward; "B" backward (input gradient only when the schedule also has W);
    "W" the deferred weight-gradient half of a split backward.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def check_sizes(num_stages: int, num_microbatches: int, num_virtual: int = 1) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("num_virtual", num_virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs F0..F(m-1), then B0..B(m-1)."""
    check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    stage = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return [list(stage) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B: stage i runs min(p-i-1, m) warm-up forwards, then F/B pairs, then the rest of B."""
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def interleaved_1f1b(num_stages: int, num_microbatches: int, num_virtual: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with `num_virtual` chunks per stage.

    Micro-batches go through the chunks in groups of p (so m must be a multiple of p).
    """
    check_sizes(num_stages, num_microbatches, num_virtual)
    p, m, v = num_stages, num_microbatches, num_virtual
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in groups of num_stages: num_microbatches "
            f"({m}) must be a multiple of num_stages ({p}); use e.g. {p * max(1, -(-m // p))}"
        )
    total = m * v

    def unit(k: int, forward: bool) -> Action:
        chunk = (k % (p * v)) // p
        mb = (k // (p * v)) * p + k % p
        return Action("F", mb, chunk) if forward else Action("B", mb, v - 1 - chunk)

    out = []
    for s in range(p):
        # NOTE: same warm-up rule as Megatron-LM; with m == p every forward is warm-up.
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        acts = [unit(k, True) for k in range(warmup)]
        for i in range(total - warmup):
            acts += [unit(warmup + i, True), unit(i, False)]
        acts += [unit(k, False) for k in range(total - warmup, total)]
        out.append(acts)
    return out


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's F/B order per stage; stage i runs W(k) right after B(k + i).

    Stage i: min(p-i-1, m) warm-up forwards, then per micro-batch k: F(k+warm-up) if
    any is left, B(k), and W of the oldest pending micro-batch once i+1 are pending;
    the rest of the W at the end.
    """
    check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    out = []
    for s in range(p):
        warmup, lag = min(p - s - 1, m), s
        acts = [Action("F", i) for i in range(warmup)]
        next_w = 0
        for k in range(m):
            if warmup + k < m:
                acts.append(Action("F", warmup + k))
            acts.append(Action("B", k))
            if k - next_w >= lag:  # NOTE: W lags B by i micro-batches on stage i
                acts.append(Action("W", next_w))
                next_w += 1
        acts += [Action("W", i) for i in range(next_w, m)]
        out.append(acts)
    return out


def peak_pending_w(actions: list[Action]) -> int:
    """Most micro-batches a stage holds between B and W (weight-gradient inputs kept)."""
    return peak_live(actions, opens="B", closes="W")


def peak_until_w(actions: list[Action]) -> int:
    """Most micro-batches a stage holds between F and W (split backward's full lifetime)."""
    return peak_live(actions, opens="F", closes="W")



def _interleaved(num_stages: int, num_microbatches: int, num_virtual: int) -> list[list[Action]]:
    if num_virtual < 2:
        raise ValueError("schedule 'interleaved' needs num_virtual >= 2 chunks per stage")
    return interleaved_1f1b(num_stages, num_microbatches, num_virtual)


# name -> (num_stages, num_microbatches, num_virtual) -> per-stage actions
SCHEDULE_TABLE = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": _interleaved,
    "zb-h1": lambda p, m, v: zero_bubble_h1(p, m),
}
SCHEDULES = tuple(SCHEDULE_TABLE)


def make_schedule(name: str, num_stages: int, num_microbatches: int,
                  num_virtual: int = 1) -> list[list[Action]]:
    """Schedule by name ("gpipe", "1f1b", "interleaved", "zb-h1"), statically checked."""
    if name not in SCHEDULE_TABLE:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    sched = SCHEDULE_TABLE[name](num_stages, num_microbatches, num_virtual)
    if name != "interleaved" and num_virtual != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per stage; num_virtual must be 1")
    check_schedule(sched, num_stages, num_microbatches, num_virtual)
    return sched


def peak_in_flight(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) activations a stage holds at once (F done, B not yet).

    A W action is not counted (its inputs are counted by `peak_pending_w`).
    """
    return peak_live(actions, opens="F", closes="B")


def peak_live(actions: list[Action], opens: str, closes: str) -> int:
    """Most micro-batches held at once between an `opens` action and a `closes` action."""
    live = peak = 0
    for a in actions:
        live += (a.kind == opens) - (a.kind == closes)
        peak = max(peak, live)
    return peak


def check_schedule(schedule: list[list[Action]], num_stages: int, num_microbatches: int,
                   num_virtual: int = 1) -> None:
    """Reject an impossible schedule with a clear message, before anything runs.

    Checks: one list per stage; each stage runs F and B of every (micro-batch, chunk)
    exactly once, F before B (and, if the schedule splits the backward, W exactly once
    after its B); every receive is matched by a send that can happen (a
    dependency-respecting execution exists, i.e. no deadlock).
    """
    if len(schedule) != num_stages:
        raise ValueError(f"schedule has {len(schedule)} stage lists for {num_stages} stages")
    kinds = "FBW" if any(a.kind == "W" for acts in schedule for a in acts) else "FB"
    want = {(k, mb, c) for k in kinds for mb in range(num_microbatches) for c in range(num_virtual)}
    for s, acts in enumerate(schedule):
        got = [(a.kind, a.microbatch, a.chunk) for a in acts]
        if len(got) != len(set(got)) or set(got) != want:
            missing = sorted(want - set(got))[:4]
            extra = sorted(set(got) - want)[:4]
            raise ValueError(
                f"stage {s} must run {'F, B and W' if kinds == 'FBW' else 'F and B'} of each of {num_microbatches} micro-batches on "
                f"{num_virtual} chunk(s) exactly once; missing {missing}, unexpected {extra}"
            )
        pos = {g: i for i, g in enumerate(got)}
        for mb in range(num_microbatches):
            for c in range(num_virtual):
                if pos[("B", mb, c)] < pos[("F", mb, c)]:
                    raise ValueError(f"stage {s} runs B{mb} of chunk {c} before its F")
                if kinds == "FBW" and pos[("W", mb, c)] < pos[("B", mb, c)]:
                    raise ValueError(f"stage {s} runs W{mb} of chunk {c} before its B")
    simulate(schedule, num_stages, num_virtual)  # raises on deadlock


@dataclass
class Simulation:
    """Timing of a schedule: per-stage spans (start, end, action), makespan, busy time."""

    spans: list[list[tuple[float, float, Action]]]
    makespan: float

    @property
    def busy(self) -> float:
        return sum(e - b for stage in self.spans for b, e, _ in stage)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of total stage-time: 1 - busy / (stages * makespan)."""
        return 1.0 - self.busy / (len(self.spans) * self.makespan)


def simulate(schedule: list[list[Action]], num_stages: int, num_virtual: int = 1,
             t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
             durations: list[list[float]] | None = None) -> Simulation:
    """Run the action lists on a model where each stage does one action at a time.

    A chunk's F takes `t_f / num_virtual`, its B `t_b / num_virtual`, its W (split
    backward only; B is then the input-gradient half) `t_w / num_virtual` (or, when given,
    `durations[stage][i]` for the i-th action of a stage, e.g. measured ones); sends are
    free and asynchronous. Raises ValueError naming the stuck actions on a deadlock.
    """
    p, v = num_stages, num_virtual
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> finish
    ptr, clock = [0] * p, [0.0] * p
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    remaining = sum(len(a) for a in schedule)
    costs = {"F": t_f / v, "B": t_b / v, "W": t_w / v}
    while remaining:
        progressed = False
        for s in range(p):
            while ptr[s] < len(schedule[s]):
                a = schedule[s][ptr[s]]
                j = a.chunk * p + s
                if a.kind == "F":
                    dep = ("F", a.microbatch, j - 1) if j > 0 else None
                elif a.kind == "W":
                    dep = ("B", a.microbatch, j)
                else:
                    dep = ("F", a.microbatch, j) if j == last else ("B", a.microbatch, j + 1)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep else 0.0)
                end = start + (durations[s][ptr[s]] if durations is not None else costs[a.kind])
                done[(a.kind, a.microbatch, j)] = clock[s] = end
                spans[s].append((start, end, a))
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {schedule[s][ptr[s]]}" for s in range(p)
                     if ptr[s] < len(schedule[s])]
            raise ValueError(
                "schedule deadlocks: every stage waits for a send that never comes ("
                + "; ".join(stuck) + "); reorder the actions so each receive's sender runs first"
            )
    return Simulation(spans, max(clock))
