"""Pipeline parallelism: schedules (pure), stage splitting (pure), runtime (p2p), tied
weights across stages (tied.py), zero-bubble ZB-H1 (zero_bubble.py)."""

from disttrain.parallel.pipeline.runtime import Pipeline, Span
from disttrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    check_schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    simulate,
)
from disttrain.parallel.pipeline.split import partition, split_model
from disttrain.parallel.pipeline.tied import TiedWeights
from disttrain.parallel.pipeline.zero_bubble import zero_bubble_h1

__all__ = [
    "SCHEDULES", "Action", "Pipeline", "Span", "check_schedule", "gpipe", "interleaved_1f1b",
    "make_schedule", "one_f_one_b", "partition", "peak_in_flight", "simulate", "split_model",
    "TiedWeights", "zero_bubble_h1",
]
