"""The collectives every step of disttrain's runtime waits on outside the layers.

Besides the layers' collectives and the gradients' reduction, a step of
`ParallelModel.train_step` (parallel/parallel_model.py) and `Pipeline.step`
(parallel/pipeline/runtime.py) issues, each blocking:

- pp > 1: a barrier over the pipeline group before the first action (priced as an
  all-reduce of one element: gloo's barrier is one), and after the last one a
  broadcast of [loss, dtype code] (two float64, 16 bytes) from the last stage;
- dp > 1: an all-reduce of the 4-byte fp32 loss over dp (the mean loss every rank returns).

Each is priced by comm/cost.py over its group's links plus `blocking` (the measured
seconds a blocking collective adds between computing ranks, cost.py's `blocking_extra`).
Pure arithmetic; cost.py adds the sum to the step and terms.py prints it.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["step_collectives"]


def step_collectives(pp: int, dp: int, pp_local: int, dp_local: int, blocking: float,
                     price: Callable[[str, float, int, int], float]) -> tuple[float, str]:
    """(seconds, formula) of one step's barrier and loss collectives.

    `pp_local` / `dp_local`: members of a pp / dp group on one node; `price(op, bytes,
    world, local)`: comm/cost.py's seconds of that collective over the group's links.
    """
    total, parts = 0.0, []
    if pp > 1:
        barrier = price("all-reduce", 4, pp, pp_local) + blocking
        bcast = price("all-gather", 16 * pp, pp, pp_local) + blocking  # NOTE: a ring broadcast
        # moves what an all-gather of pp x 16 bytes moves in its pp - 1 steps
        total += barrier + bcast
        parts.append(f"pp barrier {barrier * 1e3:.3g} ms + loss broadcast {bcast * 1e3:.3g} ms "
                     f"over pp={pp}")
    if dp > 1:
        loss = price("all-reduce", 4, dp, dp_local) + blocking
        total += loss
        parts.append(f"loss all-reduce {loss * 1e3:.3g} ms over dp={dp}")
    if parts and blocking:
        parts.append(f"each with {blocking * 1e3:.3g} ms measured per blocking collective")
    return total, "; ".join(parts)
