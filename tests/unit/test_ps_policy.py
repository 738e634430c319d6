"""Consistency policies driven by scripted arrival orders (no processes, no tensors)."""

import pytest

from disttrain.ps.policy import (
    SSP,
    Async,
    KAsync,
    KBatchAsync,
    KBatchSync,
    KSync,
    Sync,
    backup_workers,
)


def started(policy, workers=(0, 1, 2, 3)):
    policy.start(list(workers))
    return policy


@pytest.mark.timeout(10)
def test_sync_waits_for_every_worker_and_parks_pulls():
    p = started(Sync())
    for w in range(4):
        assert p.pull(w).release == [w]  # version 0 available to everyone
    for pid, w in enumerate([2, 0, 3]):
        d = p.push(pid, w, 0)
        assert d.apply == [] and d.cancel == []
        assert p.pull(w).release == []  # must wait for the round
    d = p.push(3, 1, 0)
    assert d.apply == [1, 3, 0, 2] and p.version == 1  # in worker order, not arrival order
    assert d.release == [0, 2, 3]  # the parked pulls
    assert p.pull(1).release == [1]
    assert p.staleness == {0: 4}


@pytest.mark.timeout(10)
def test_sync_lost_worker_is_an_error_naming_it():
    p = started(Sync())
    p.push(0, 0, 0)
    d = p.lost(2)
    assert d.error and "worker 2" in d.error and d.apply == []


@pytest.mark.timeout(10)
def test_ksync_applies_first_k_cancels_others_drops_late():
    p = started(KSync(2))
    assert p.push(0, 3, 0).apply == []
    d = p.push(1, 1, 0)
    assert d.apply == [1, 0] and d.cancel == [0, 2] and p.version == 1  # worker 1, then 3
    d = p.push(2, 0, 0)  # worker 0 finished before hearing the cancel: dropped
    assert d.drop == [2] and p.dropped == 1 and d.apply == []
    assert p.pull(0).release == [0]  # late worker pulls the new version at once
    assert p.pull(3).release == [3]


@pytest.mark.timeout(10)
def test_ksync_all_equals_sync_and_backup_workers():
    a, b = started(KSync(4)), started(Sync())
    for pid, w in enumerate([1, 3, 0, 2]):
        assert a.push(pid, w, 0).apply == b.push(pid, w, 0).apply
    assert a.version == b.version == 1
    assert repr(backup_workers(4, 1)) == "KSync(k=3)"
    with pytest.raises(ValueError, match="backups"):
        backup_workers(4, 4)
    with pytest.raises(ValueError, match="k <= 4"):
        started(KSync(5))


@pytest.mark.timeout(10)
def test_ksync_survives_lost_worker_by_closing_with_those_left():
    p = started(KSync(3), workers=(0, 1, 2))
    p.push(0, 0, 0)
    p.push(1, 1, 0)
    d = p.lost(2)
    assert d.error is None and d.apply == [0, 1] and p.lost_workers == [2]


@pytest.mark.timeout(10)
def test_kbatch_sync_counts_minibatches_from_any_worker():
    p = started(KBatchSync(3))
    assert p.push(0, 0, 0).apply == []
    assert p.pull(0).release == [0]  # keeps computing on the same version 0
    assert p.push(1, 0, 0).apply == []  # worker 0's second minibatch on version 0
    d = p.push(2, 1, 0)
    assert d.apply == [0, 1, 2] and p.version == 1
    assert d.cancel == [0, 1, 2, 3]  # everyone still computing on version 0
    assert p.push(3, 2, 0).drop == [3]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("make", [Sync, lambda: KSync(3), lambda: KBatchSync(3),
                                  lambda: KAsync(3), lambda: KBatchAsync(3)])
def test_a_round_is_applied_in_worker_order_whatever_the_arrival_order(make):
    # the server sums d.apply in this order: worker order makes the sum bitwise the same
    # whichever worker's push arrived first (tests/dist/test_ps_order.py runs it)
    applied = set()
    for arrival in ([2, 0, 1], [1, 2, 0], [0, 1, 2]):
        p = started(make(), workers=(0, 1, 2))
        for w in arrival:
            d = p.push(10 + w, w, 0)
        assert d.apply == [10, 11, 12] and d.staleness == [0, 0, 0]
        applied.add(tuple(d.apply))
    assert applied == {(10, 11, 12)}
    p = started(KBatchSync(3), workers=(0, 1, 2))  # a worker's own pushes in its order
    for pid, w in enumerate([1, 0, 1]):
        d = p.push(pid, w, 0)
    assert d.apply == [1, 0, 2]


@pytest.mark.timeout(10)
def test_kasync_never_cancels_and_counts_stale_gradients():
    p = started(KAsync(2))
    p.push(0, 0, 0)
    d = p.push(1, 1, 0)
    assert d.apply == [0, 1] and d.cancel == [] and p.version == 1
    assert p.push(2, 2, 0).apply == []  # stale, kept for the next round
    d = p.push(3, 0, 1)
    assert d.apply == [3, 2] and p.staleness == {0: 3, 1: 1}  # worker 0's, then worker 2's
    assert p.pull(2).release == [2]


@pytest.mark.timeout(10)
def test_kbatch_async_and_async():
    p = started(KBatchAsync(2))
    p.push(0, 0, 0)
    assert p.push(1, 0, 0).apply == [0, 1]
    assert p.pull(3).release == [3]
    a = started(Async())
    for pid, (w, v) in enumerate([(0, 0), (1, 0), (2, 1), (3, 0)]):
        d = a.push(pid, w, v)
        assert d.apply == [pid] and d.drop == [] and d.cancel == []
    assert a.version == 4 and a.staleness == {0: 1, 1: 2, 3: 1}
    assert a.pull(1).release == [1]


@pytest.mark.timeout(10)
def test_ssp_bounds_the_clock_gap():
    p = started(SSP(1), workers=(0, 1))
    assert p.push(0, 0, 0).apply == [0]  # applied at once
    assert p.pull(0).release == [0]  # clock 1 vs slowest 0: gap 1 <= 1
    p.push(1, 0, 1)
    assert p.pull(0).release == []  # gap 2 > 1: parked
    d = p.push(2, 1, 0)  # the slow worker catches up one clock
    assert d.release == [0]
    d = p.leave(1)
    assert p.pull(0).release == [0]
    with pytest.raises(ValueError, match=">= 0"):
        SSP(-1)


@pytest.mark.timeout(10)
def test_ssp_zero_is_lockstep():
    p = started(SSP(0), workers=(0, 1))
    p.push(0, 0, 0)
    assert p.pull(0).release == []
    assert p.push(1, 1, 0).release == [0]


@pytest.mark.timeout(10)
def test_leaving_workers_shrink_sync_rounds_and_stats_are_plain():
    p = started(Sync(), workers=(0, 1))
    p.push(0, 0, 0)
    d = p.leave(1)
    assert d.apply == [0]
    stats = p.stats()
    assert stats["policy"] == "Sync()" and stats["applied"] == 1
    assert stats["staleness"] == {0: 1}
    with pytest.raises(ValueError, match="k must be"):
        KSync(0)


@pytest.mark.timeout(10)
def test_runs_ahead_is_a_round_that_can_hold_a_push_whose_worker_goes_on():
    """The policies whose servers say `held` with replicas >= 2 (server.py): a round may
    hold a push of a worker that is already free to push again."""
    ahead = [KBatchAsync(2), KAsync(2), KBatchSync(2), KBatchAsync(3)]
    waits = [Sync(), KSync(2), KSync(1), Async(), KBatchAsync(1), KAsync(1), KBatchSync(1),
             SSP(2)]
    assert [p.runs_ahead() for p in ahead] == [True] * len(ahead)
    assert [p.runs_ahead() for p in waits] == [False] * len(waits)
    # KAsync(2): worker 0's push is left for the next round, yet its pull is answered
    p = started(KAsync(2), workers=(0, 1, 2))
    p.push(0, 1, 0)
    p.push(1, 2, 0)  # closes the round of version 0
    assert p.push(2, 0, 0).apply == [] and p.pull(0).release == [0]
