"""Zero-bubble pipeline schedule ZB-H1 as a pure function: per-stage F/B/W action lists.

Qi et al. 2023, "Zero Bubble Pipeline Parallelism" (https://arxiv.org/abs/2401.10241),
as torch.distributed.pipelining runs it (separate BACKWARD_INPUT and BACKWARD_WEIGHT
actions): the backward of a micro-batch is split into
- B: the gradient w.r.t. the stage input, on the critical path (sent upstream at once);
- W: the gradients w.r.t. the stage's weights, needed by nobody else until the step ends.

ZB-H1 keeps 1F1B's warm-up (stage i runs p-i-1 forwards first) and 1F1B's F/B order, so
stage i still holds at most p-i micro-batches between F and B; stage i lets its W run i
micro-batches behind its B (the last stage most), so the B chain back to stage 0 is not
delayed by W, and the deferred W fill the cool-down, where 1F1B waits for gradients.
A stage then holds at most p micro-batches between F and W: 1F1B's peak (stage 0's p). With equal F, B, W times the idle time per stage drops from
(p-1)(F+B+W) to (p-1)(F+B-W): a third of 1F1B's. Nothing here talks to another process;
runtime.py executes the lists (B with torch.autograd.grad w.r.t. the stage input,
retaining the graph; W w.r.t. the parameters).
"""

from __future__ import annotations

import torch

from disttrain.parallel.pipeline.schedules import Action, _check_sizes

__all__ = ["zero_bubble_h1", "peak_pending_w", "peak_until_w", "backward_input",
           "backward_weight"]


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's F/B order per stage; stage i runs W(k) right after B(k + i).

    Stage i: min(p-i-1, m) warm-up forwards, then per micro-batch k: F(k+warm-up) if
    any is left, B(k), and W of the oldest pending micro-batch once i+1 are pending;
    the rest of the W at the end.
    """
    _check_sizes(num_stages, num_microbatches)
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
    live = peak = 0
    for a in actions:
        live += {"B": 1, "W": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


def peak_until_w(actions: list[Action]) -> int:
    """Most micro-batches a stage holds between F and W (split backward's full lifetime)."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "W": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


def backward_input(out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor | None):
    """B: d(out)/d(x) times `grad` (None when `out` is the loss), keeping the graph for W.

    Returns None when `x` needs no gradient (the first stage's token ids). Weights'
    `.grad` and their hooks (DataParallel's) are untouched: autograd.grad accumulates
    nothing. Blocks (local compute).
    """
    if not x.requires_grad:
        return None
    (gx,) = torch.autograd.grad(out, [x], grad, retain_graph=True)
    return gx


def backward_weight(out: torch.Tensor, grad: torch.Tensor | None, params: list) -> None:
    """W: accumulate d(out)/d(params) times `grad` into `.grad`; frees the graph. Blocks.

    NOTE: each parameter's AccumulateGrad runs once here, so post-accumulate-grad hooks
    (DataParallel's bucket sync, ZeRO 1/2's gradient reduction) fire once per parameter
    per micro-batch, as with a whole backward. The retained graph is walked again from `out` (torch keeps the input-path
    gradients of B instead, stage_backward_weight): W costs about a full backward here.
    """
    if params:  # NOTE: a chunk without parameters has no W; dropping `out` frees the graph
        torch.autograd.backward(out, grad, inputs=params)
