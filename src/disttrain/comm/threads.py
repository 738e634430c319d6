"""One algorithm thread per process group: where point-to-point allreduce algorithms run.

`submit_on_group_thread(group, op, fn, *args)` runs `fn(*args)` on `group`'s single
thread, in submission order, so two users of one group (DataParallel's bucket reducer,
ZeRO's reduce-scatter, `all_reduce(..., async_op=True, algorithm=...)`) never interleave
their point-to-point messages. The bottom of comm/: algorithms.py and reducer.py both
submit here; it knows neither.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from disttrain.trace import events as trace_events

__all__ = ["submit_on_group_thread"]

_pools: dict = {}  # global ranks of a group -> its one algorithm thread
_pools_lock = threading.Lock()


def submit_on_group_thread(group, op: str, fn, *args) -> Future:
    """Run fn(*args) on `group`'s algorithm thread (one per group, calls in submission
    order, so two reducers on one group never interleave their point-to-point messages);
    returns a Future whose `wait()` blocks and re-raises (traced as waiting for `op`)."""
    key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="disttrain-reduce")
    fut = pool.submit(fn, *args)
    fut.wait = trace_events.waiting(fut.result, op)  # NOTE: the shape of torch's Work.wait
    return fut
