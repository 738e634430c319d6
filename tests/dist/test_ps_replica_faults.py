"""A replica that falls behind, on real processes: 2 workers, 3 servers, replicas=2, Sync.

Server 2 (the tail of the chains headed by another server, and a head itself) is stopped
with SIGSTOP while the workers train. Shorter than the timeout: the acks wait for it
(a push's wait() lasts about the pause), nothing is lost and the job ends with
parameters bitwise those of the same job without the pause. Longer than the timeout:
every worker's wait ends within a bounded time with an error that names server 2 and
the operation it waited on, and no rank hangs (each returns its error).
NOTE: slow (about 45 s on two loaded cores: three jobs of five processes); the fast tier
covers a silent copy with tests/unit/test_ps_replica.py (one head against a stand-in copy
in one process: its error names the copy, the worker hears it).
"""

import os
import secrets
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import disttrain
from disttrain import ps
from disttrain.ps.server import PSError
from disttrain.testing import spawn

W, S, B, STEPS, R, TIMEOUT = 2, 3, 4, 6, 2, 3.0
SHORT, LONG, AT = 1.0, 6.0, 2  # pause lengths (s), and the step at which worker 0 pauses
ENV = {"DISTTRAIN_SERVERS": str(S), "DISTTRAIN_SECRET": secrets.token_hex(32)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _pause(store, name: str, seconds: float) -> None:
    """SIGSTOP server 2's process for `seconds`, then SIGCONT it (from a thread)."""
    pid = int(store.get(f"{name}/pid2"))
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(pid, signal.SIGCONT)


def _job(name: str, pause: float):
    store = dist.distributed_c10d._get_default_store()
    if disttrain.role() == "server":
        store.set(f"{name}/pid{disttrain.rank() - W}", str(os.getpid()))
        try:
            return {"stats": ps.serve(_model(), ps.Sync(), _opt, timeout=TIMEOUT,
                                      chunk_bytes=64, name=name, replicas=R, manager="")}
        except PSError as e:
            return {"error": str(e)}
    model, i = _model(), disttrain.rank()
    conn = ps.attach(model, ps.Sync(), timeout=TIMEOUT, chunk_bytes=64, name=name,
                     replicas=R, manager="")
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(STEPS, W * B, 8, generator=g), torch.randn(STEPS, W * B, 3, generator=g)
    waits, t0 = [], time.monotonic()
    try:
        for t in range(STEPS):
            if pause and i == 0 and t == AT:
                threading.Thread(target=_pause, args=(store, name, pause)).start()
                time.sleep(0.1)  # NOTE: the pushes below go out while server 2 is stopped
            start = time.monotonic()
            conn.pull().wait()
            model.zero_grad()
            x, y = xs[t, i * B:(i + 1) * B], ys[t, i * B:(i + 1) * B]
            torch.nn.functional.mse_loss(model(x), y).backward()
            conn.push().wait()
            waits.append(time.monotonic() - start)
        conn.pull().wait()
        conn.close()
    except PSError as e:
        return {"error": str(e), "after": time.monotonic() - t0}
    return {"params": [p.detach().clone() for p in model.parameters()], "waits": waits}


def run_all():
    return {"plain": _job("plain", 0), "short": _job("short", SHORT), "long": _job("long", LONG)}


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, W + S, env=ENV, timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tail_paused_shorter_than_the_timeout_delays_acks_and_loses_nothing(results):
    for w in range(W):
        plain, short = results[w]["plain"], results[w]["short"]
        assert "error" not in short, short.get("error")
        for a, b in zip(plain["params"], short["params"]):
            assert torch.equal(a, b)  # Sync: bitwise the run without the pause
        assert max(short["waits"]) > SHORT / 2, "a step went on while a copy was stopped"
    for s in range(S):
        assert results[W + s]["short"]["stats"]["version"] == STEPS


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tail_paused_longer_than_the_timeout_is_named_in_bounded_time(results):
    for w in range(W):
        got = results[w]["long"]
        assert "params" not in got, "the job went on without a copy of its keys"
        assert "server 2" in got["error"] and f"worker {w} p" in got["error"], got["error"]
        # the pause starts at step AT; the error comes within the timeout and its checks
        assert got["after"] < LONG + 2 * TIMEOUT + 5, got
    for s in range(S):
        assert "error" in results[W + s]["long"], s  # no server hangs: each names why
