"""Injected worker slowness, so straggler trade-offs can be studied on one laptop.

A delay model says how many extra seconds worker `rank` spends on step `step`. It is a
pure function of (seed, rank, step): the same spec and seed give the same delays in
any process, in any order, on any machine. Specs (command-line friendly):

    none
    exp:mean=0.05                       every worker, Exp(mean) seconds per step
    shifted-exp:shift=0.02,mean=0.05    shift + Exp(mean), the model of Dutta et al. 2018
    fixed:rank=2,delay=0.2              worker 2 always 0.2 s slower, the others 0

`Straggler.parse(SPEC)` reads one. Used by examples/digits_ps.py (`--straggler SPEC`) and benchmarks/ps_convergence.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Straggler", "parse_straggler"]

_FIELDS = {"none": (), "exp": ("mean",), "shifted-exp": ("shift", "mean"),
           "fixed": ("rank", "delay")}
_HELP = ("use one of: 'none', 'exp:mean=0.05', 'shifted-exp:shift=0.02,mean=0.05', "
         "'fixed:rank=2,delay=0.2'")


@dataclass(frozen=True)
class Straggler:
    """A seeded delay model; `delay(rank, step)` is reproducible seconds >= 0."""

    kind: str = "none"
    mean: float = 0.0
    """mean of the exponential part, seconds (exp, shifted-exp)."""
    shift: float = 0.0
    """constant added to every delay, seconds (shifted-exp)."""
    rank: int = -1
    """the one slow worker (fixed)."""
    fixed: float = 0.0
    """its delay per step, seconds (fixed)."""
    seed: int = 0

    def __post_init__(self):
        if self.kind not in _FIELDS:
            raise ValueError(f"unknown straggler model {self.kind!r}; {_HELP}")
        for name in ("mean", "shift", "fixed"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"straggler {name} must be a finite number >= 0 seconds, "
                                 f"got {value}")

    @classmethod
    def parse(cls, spec: str | None, seed: int = 0) -> Straggler:
        """Parse a spec ('exp:mean=0.05', see above) into a Straggler; raises ValueError
        saying how to fix a bad one."""
        return parse_straggler(spec, seed)

    def delay(self, rank: int, step: int) -> float:
        """Extra seconds for worker `rank` at step `step` (pure, does not sleep)."""
        if self.kind in ("none", "fixed"):
            return self._draw(None, rank)
        # NOTE: a fresh generator per (seed, rank, step) makes delays independent of how
        # many draws other code made before, hence reproducible across runs and modes.
        return self._draw(random.Random(f"{self.seed}/{rank}/{step}"), rank)

    def sampler(self, rank: int) -> Callable[[], float]:
        """Worker `rank`'s delays as a stream from one generator seeded by (seed, rank):
        the distribution of `delay`, not its values per step, at ~0.2 us a draw instead of
        ~6 us (seeding a generator per step is the cost); for simulators (plan/simulate.py)."""
        rng = random.Random(f"{self.seed}/{rank}/stream")
        return lambda: self._draw(rng, rank)

    def _draw(self, rng: random.Random | None, rank: int) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "fixed":
            return self.fixed if rank == self.rank else 0.0
        tail = rng.expovariate(1.0 / self.mean) if self.mean > 0 else 0.0
        return self.shift + tail


def parse_straggler(spec: str | None, seed: int = 0) -> Straggler:
    """Parse 'kind:key=value,...' into a Straggler; raises ValueError saying how to fix."""
    spec = (spec or "none").strip()
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind not in _FIELDS:
        raise ValueError(f"straggler spec {spec!r}: unknown model {kind!r}; {_HELP}")
    values: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in _FIELDS[kind]:
            raise ValueError(f"straggler spec {spec!r}: {item!r} is not one of "
                             f"{list(_FIELDS[kind])} as key=value; {_HELP}")
        try:
            values[key] = float(raw)
        except ValueError:
            raise ValueError(f"straggler spec {spec!r}: {key}={raw!r} is not a number") from None
    missing = [k for k in _FIELDS[kind] if k not in values]
    if missing:
        raise ValueError(f"straggler spec {spec!r} is missing {missing}; {_HELP}")
    if kind == "fixed":
        if values["rank"] != int(values["rank"]) or values["rank"] < 0:
            raise ValueError(f"straggler spec {spec!r}: rank must be an integer >= 0")
        return Straggler("fixed", rank=int(values["rank"]), fixed=values["delay"], seed=seed)
    return Straggler(kind, mean=values.get("mean", 0.0), shift=values.get("shift", 0.0),
                     seed=seed)
