"""`disttrain.preempted()` on real gloo ranks: one rank gets the notice (a real SIGTERM,
what torchrun and srun send), every rank says True at the same call, and DataParallel
carries the flag without an extra collective."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain import comm
from disttrain.testing import spawn

STEPS = 6


def _world_all_reduces() -> int:
    rec = comm.recorder()
    return sum(n for (group, op, _), n in rec._counts.items() if group == "world" and op == "all_reduce")


def train_and_poll(signal_rank: int, signal_step: int, halves: bool):
    """DataParallel over the world (or, `halves`, over each half of it); `signal_rank`
    sends itself SIGTERM at `signal_step`, after its backward. Returns preempted() per
    step and the all_reduces on the world each step issued."""
    torch.manual_seed(0)
    group = None
    if halves:
        half = disttrain.world_size() // 2
        groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, 2 * half)))]
        group = groups[disttrain.rank() // half]
    model = disttrain.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
                                   bucket_mb=0.0001, group=group)
    seen, issued = [], []
    disttrain.preempted()  # installs the handler (a step before training)
    for step in range(STEPS):
        before = _world_all_reduces()
        model(torch.randn(3, 4)).sum().backward()
        if disttrain.rank() == signal_rank and step == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        seen.append(disttrain.preempted())
        issued.append(_world_all_reduces() - before)
    return {"seen": seen, "issued": issued, "buckets": model.num_buckets}


def test_the_flag_rides_dataparallels_last_bucket_and_every_rank_agrees():
    out = spawn(train_and_poll, 2, 1, 2, False, timeout=120)
    # rank 1 saw its signal after its step-2 contribution: every rank stops after step 3
    assert [o["seen"] for o in out] == [[False] * 3 + [True] * 3] * 2
    # no collective besides the buckets' (before the flag, and after: preempted() is sticky)
    assert all(o["issued"] == [o["buckets"]] * STEPS for o in out), out


def test_a_dataparallel_over_part_of_the_world_falls_back_to_one_all_reduce():
    out = spawn(train_and_poll, 4, 0, 1, True, timeout=180)
    # the call after rank 0's signal asks the world: True on every rank at that step
    assert [o["seen"] for o in out] == [[False] + [True] * 5] * 4
    # the buckets go to each half's group, not the world: preempted() asks the world once
    # per call until it is True, then never again
    assert [o["issued"] for o in out] == [[1, 1, 0, 0, 0, 0]] * 4, out


def poll_without_collectives(signal_rank: int, signal_call: int):
    seen = []
    for call in range(5):
        if disttrain.rank() == signal_rank and call == signal_call:
            os.kill(os.getpid(), signal.SIGTERM)
        seen.append(disttrain.preempted())
    return seen


def test_a_loop_with_no_collective_of_its_own_agrees_through_preempted():
    out = spawn(poll_without_collectives, 3, 2, 3, timeout=120)
    assert out == [[False] * 3 + [True] * 2] * 3
