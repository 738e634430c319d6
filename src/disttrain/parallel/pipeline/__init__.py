"""Pipeline parallelism: schedules (pure, schedules.py), stage splitting (pure, split.py),
the runtime that runs a schedule over point-to-point sends (runtime.py), the split
backward ZB-H1 runs (split_backward.py), weights tied across stages (tied.py).

The face is what a user needs to compare schedules without processes (build, check,
simulate, count what a stage holds), to measure layer costs for balancing, and to run a
schedule over chunks of their own (`Pipeline`; `disttrain.parallel.split_stages` cuts
them); `disttrain.parallelize` builds it all in one call.
"""

from disttrain.parallel.pipeline.runtime import Pipeline
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
    zero_bubble_h1,
)
from disttrain.parallel.pipeline.split import time_layers

__all__ = [
    "SCHEDULES", "Action", "Pipeline", "check_schedule", "gpipe", "interleaved_1f1b", "make_schedule",
    "one_f_one_b", "peak_in_flight", "simulate", "time_layers", "zero_bubble_h1",
]
