"""Workers that leave (done) or are lost mid-round, per policy, with scripted arrivals.

The order that matters: worker 0 pushes its last gradient of a round and leaves at once
(no final pull) while the others' pushes for that round are still in flight. The round
must wait for them and apply every push, the leaving worker's included, in worker order.
"""

import pytest

from disttrain.ps.policy import SSP, Async, KAsync, KBatchAsync, KBatchSync, KSync, Sync


def started(policy, workers=(0, 1)):
    policy.start(list(workers))
    return policy


@pytest.mark.timeout(10)
@pytest.mark.parametrize("workers", [(0, 1), (0, 1, 2)])
def test_sync_round_with_a_leaving_workers_push_waits_for_the_others(workers):
    p = started(Sync(), workers)
    d = p.push(0, 0, 0)
    d = p.leave(0)
    assert d.apply == [] and d.cancel == [] and p.version == 0  # not closed early
    for pid, w in enumerate(reversed(workers[1:]), start=1):
        d = p.push(pid, w, 0)
    assert d.apply == [0, *range(len(workers) - 1, 0, -1)]  # worker order: 0, 1, (2)
    assert d.cancel == [] and d.drop == [] and p.version == 1 and p.dropped == 0
    d = p.push(9, 1, 1)  # the next round no longer waits for worker 0
    assert (d.apply == [9]) == (len(workers) == 2)


@pytest.mark.timeout(10)
def test_sync_leave_without_a_push_closes_the_round_with_the_others():
    p = started(Sync(), (0, 1, 2))
    p.push(0, 1, 0)
    p.push(1, 2, 0)
    d = p.leave(0)
    assert d.apply == [0, 1] and d.cancel == [] and p.version == 1


@pytest.mark.timeout(10)
def test_sync_lost_mid_round_stops_the_job_and_applies_nothing():
    p = started(Sync(), (0, 1, 2))
    p.push(0, 0, 0)
    p.push(1, 1, 0)
    d = p.lost(2)
    assert d.error and "worker 2" in d.error and d.apply == [] and p.version == 0
    p = started(Sync(), (0, 1))
    p.push(0, 0, 0)
    d = p.lost(0)  # lost after its push: still an error, the round is not applied
    assert d.error and "worker 0" in d.error and d.apply == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize("event", ["leave", "lost"])
def test_ksync_counts_a_departed_workers_push_and_waits_for_k(event):
    p = started(KSync(2))
    p.push(0, 0, 0)
    assert getattr(p, event)(0).apply == []  # 1 of 2: wait for worker 1's push
    d = p.push(1, 1, 0)
    assert d.apply == [0, 1] and d.cancel == [] and p.dropped == 0
    p = started(KSync(2), (0, 1, 2))  # as if worker 0 had stayed: first 2, the other cancelled
    p.push(0, 0, 0)
    getattr(p, event)(0)
    d = p.push(1, 2, 0)
    assert d.apply == [0, 1] and d.cancel == [1]
    assert p.push(2, 1, 0).drop == [2]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("event", ["leave", "lost"])
def test_kasync_counts_a_departed_workers_push_and_waits_for_k(event):
    p = started(KAsync(2))
    p.push(0, 0, 0)
    assert getattr(p, event)(0).apply == []
    d = p.push(1, 1, 0)
    assert d.apply == [0, 1] and d.staleness == [0, 0]
    assert p.push(2, 1, 1).apply == [2]  # worker 1 alone now: rounds of one


@pytest.mark.timeout(10)
@pytest.mark.parametrize("make", [lambda: KBatchSync(3), lambda: KBatchAsync(3)])
def test_kbatch_keeps_a_departed_workers_minibatches_and_reports_a_short_tail(make):
    p = started(make())
    p.push(0, 0, 0)
    assert p.leave(0).apply == []
    p.push(1, 1, 0)
    assert p.push(2, 1, 0).apply == [0, 1, 2]  # k = 3 minibatches, worker 0's included
    p.push(3, 1, 1)
    d = p.leave(1)  # nobody left to make it k: dropped, and the report counts it
    assert d.apply == [] and d.drop == [3] and p.dropped == 1 and p.stats()["dropped"] == 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize("make", [Async, lambda: SSP(0)])
def test_apply_at_once_modes_are_unchanged_by_a_leave(make):
    p = started(make())
    assert p.push(0, 0, 0).apply == [0]
    assert p.leave(0).apply == []
    assert p.push(1, 1, 0).apply == [1]
    assert p.pull(1).release == [1]  # SSP(0): no longer held back by the departed worker
