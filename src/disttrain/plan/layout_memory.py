"""Memory per device of a layout: plan/memory.py's ZeRO formulas plus activations.

The first stage holds the most activations: the micro-batch chunks its schedule keeps
in flight (`peak_in_flight` of stage 0's action list; ZB-H1: `peak_until_w`) times its
layers times Korthikanti et al. 2022's bytes per layer; ZeRO-3 adds the current and the
prefetched layer. Also the schedules' action lists, cached, which plan/cost.py
simulates. Pure arithmetic (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from disttrain.comm.cost import MODELLED
from disttrain.parallel.pipeline.schedules import SCHEDULE_TABLE, peak_in_flight, peak_until_w
from disttrain.plan.gpt import KORTHIKANTI, GPTSpec, layer_cost
from disttrain.plan.memory import model_state_bytes
from disttrain.plan.terms import Term

__all__ = ["Layout", "WIRE_BYTES", "memory", "memory_terms", "schedule_actions", "stage_params"]


WIRE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per element on the wire, per `Layout.precision`."""


@dataclass(frozen=True)
class Layout:
    """One candidate: how N devices split the model and the batch."""

    pp: int
    dp: int
    tp: int
    zero: int
    micro_batch: int
    microbatches: int
    schedule: str
    """"1f1b", "gpipe", "interleaved" (2 chunks per stage), "zb-h1"; "-" when pp == 1."""
    recompute: bool
    sp: bool
    precision: str = "bf16"
    """Elements on the wire: "bf16" (mixed precision) or "fp32" (a plain fp32 job)."""
    algorithm: str = "ring"
    """The dp all-reduce (ZeRO 0): a comm/cost.py MODELLED one, or "native" (as the ring)."""

    def __post_init__(self):
        if self.precision not in WIRE_BYTES:
            raise ValueError(f"precision {self.precision!r}: give one of {', '.join(WIRE_BYTES)}")
        if self.algorithm not in ("native", *MODELLED):
            raise ValueError(f"algorithm {self.algorithm!r}: give native or one of {', '.join(MODELLED)}")

    @property
    def virtual(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def wire(self) -> int:
        return WIRE_BYTES[self.precision]


@lru_cache(maxsize=256)
def schedule_actions(name: str, pp: int, m: int, v: int):
    # NOTE: the builders' lists are checked by tests/unit/test_schedules.py; make_schedule's
    # check (a full simulation) would double the planner's time
    return SCHEDULE_TABLE[name](pp, m, v)


@lru_cache(maxsize=256)
def _held(name: str, pp: int, m: int, v: int) -> int:
    """Micro-batch chunks stage 0 holds activations for (from the schedule's own lists)."""
    first = schedule_actions(name, pp, m, v)[0]
    return peak_until_w(first) if name == "zb-h1" else peak_in_flight(first)


def stage_params(m: GPTSpec, lay: Layout) -> float:
    """Parameters one device of the first stage holds (its layers and the embedding)."""
    return (m.layers // lay.pp * m.layer_params + m.embed_params) / lay.tp


def memory_terms(m: GPTSpec, lay: Layout) -> list[Term]:
    """Bytes on one device of the first stage (the one holding the most activations)."""
    c = layer_cost(m, lay.micro_batch, lay.tp, lay.sp)
    params = stage_params(m, lay)
    states = model_state_bytes(params, lay.dp, lay.zero, "adam", "mixed")
    zero = ("plain DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")[lay.zero]
    terms = [Term("model states", states.total,
                  f"{zero} over dp={lay.dp} of {params:.4g} params (16 B/param mixed Adam)",
                  "plan/memory.py (Rajbhandari et al. 2019, sec. 5)")]
    if lay.pp == 1:
        held, what = 1, "micro-batch (pp=1)"
    elif lay.schedule == "zb-h1":
        held = _held(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
        what = "micro-batches between F and W on stage 0 (schedule lists)"
    else:
        held = _held(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
        what = "micro-batch chunks in flight on stage 0 (schedule lists)"
    lc = m.layers // (lay.pp * lay.virtual)
    per = c.input_bytes if lay.recompute else c.activation_bytes
    kind = "2sbh layer inputs (full recompute)" if lay.recompute else (
        "34sbh/t + 5as^2b/t (sequence parallel)" if lay.sp else "sbh(10 + 24/t) + 5as^2b/t")
    terms.append(Term("activations", held * lc * per,
                      f"{held} {what} x {lc} layers x {per / 1e6:.4g} MB ({kind})", KORTHIKANTI))
    if lay.recompute:
        terms.append(Term("recompute working set", c.activation_bytes,
                          "one layer's full activations, rebuilt during its backward", KORTHIKANTI))
    if lay.zero == 3:
        terms.append(Term("gathered layers", 2 * 2 * 2 * m.layer_params / lay.tp,
                          "current + prefetched layer, bf16 parameters and gradients",
                          "parallel/zero/stage3.py (prefetch of the next unit)"))
    return terms


memory = memory_terms
"""The memory terms of one device of a layout's first stage (bytes)."""


