"""Every consistency mode on real processes with one slow worker (3 workers, 1 server).

Worker 2 is slow *inside backward* (a hook on a hidden activation sleeps), so KSync and
KBatchSync must cancel it from the gradient hooks; Async and SSP keep its stale work.
"""

import secrets
import time

import pytest
import torch

import disttrain
from disttrain import ps
from disttrain.testing import spawn

W, ATTEMPTS = 3, 6
# seconds of slow backward: long in the cancelling modes (the others must push first
# even on a loaded machine; a cancel cuts it short), short where nothing cancels
SLOW = {"ksync": 2.0, "kbatch_sync": 2.0, "async": 0.2, "ssp": 0.2, "kasync": 0.2}
ENV = {"DISTTRAIN_SERVERS": "1", "DISTTRAIN_SECRET": secrets.token_hex(32)}
MODES = {"ksync": lambda: ps.KSync(2), "kbatch_sync": lambda: ps.KBatchSync(2),
         "async": ps.Async, "ssp": lambda: ps.SSP(1), "kasync": lambda: ps.KAsync(2)}


def _slow(conn, seconds):
    """Compute that takes `seconds` unless the round closes first (abandoned work)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not conn.cancelled:
        time.sleep(0.005)


def _run(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if disttrain.role() == "server":
        return ps.serve(model, MODES[mode](), timeout=20, name=mode)
    conn = ps.attach(model, MODES[mode](), timeout=20, name=mode)
    r = disttrain.rank()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    done = 0
    for _ in range(ATTEMPTS):
        conn.pull().wait()
        model.zero_grad()
        try:
            h = model[1](model[0](x))
            if r == 2:  # a straggler whose backward is slow below the last layer
                h.register_hook(lambda g: (_slow(conn, SLOW[mode]), g)[1])
            torch.nn.functional.mse_loss(model[2](h), y).backward()
            conn.push().wait()
            done += 1
        except ps.Cancelled:
            continue
    stats = conn.close()
    return {"done": done, "cancelled": conn.cancelled_steps,
            "in_backward": conn.cancelled_in_backward, "server": stats[0]}


def run_all():
    return {mode: _run(mode) for mode in MODES}


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, W + 1, env=ENV, timeout=80)


@pytest.mark.timeout(90)
def test_ksync_cancels_the_straggler_from_its_gradient_hooks(results):
    slow, server = results[2]["ksync"], results[W]["ksync"]
    assert slow["in_backward"] >= 1 and slow["cancelled"] >= slow["in_backward"]
    assert slow["done"] + slow["cancelled"] == ATTEMPTS
    assert set(server["staleness"]) == {0}  # only fresh gradients are ever applied
    assert server["version"] >= ATTEMPTS - 1


@pytest.mark.timeout(90)
def test_kbatch_sync_cancels_and_applies_only_fresh_batches(results):
    slow, server = results[2]["kbatch_sync"], results[W]["kbatch_sync"]
    assert slow["in_backward"] >= 1
    assert set(server["staleness"]) == {0}
    assert server["applied"] == 2 * server["version"]


@pytest.mark.timeout(90)
def test_async_modes_keep_stale_gradients_and_never_cancel(results):
    for mode in ("async", "kasync", "ssp"):
        assert all(results[r][mode]["cancelled"] == 0 for r in range(W)), mode
        assert all(results[r][mode]["done"] == ATTEMPTS for r in range(W)), mode
        server = results[W][mode]
        assert server["applied"] == W * ATTEMPTS and server["dropped"] == 0, mode
    assert max(results[W]["async"]["staleness"]) >= 1  # the straggler's work was stale
    assert results[W]["async"]["version"] == W * ATTEMPTS
