"""KBatchAsync(2) and KAsync(2) with replicas=2 through `disttrain run --workers 3 --servers
3` (scripts/ps_runs_ahead.py): the job ends, never hangs, and counts every push.

These used to hang (KBatchAsync(2): 3 of 17 runs of 100 steps): a push was acknowledged
only once its round was on every copy, a round could hold a push whose worker had already
gone on, and each worker waited for every server's ack before pushing again, so three
servers' half-filled rounds could each wait for a worker blocked on another's ack. Now
such a push is answered `held` on receipt (server.py, `Server.says_held`) and acknowledged
once applied on every copy. A hang shows as exit code -1 with what the job printed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ps_runs_ahead.py"


def launch(*args: str, timeout: float = 150, workers: int = 3,
           servers: int = 3) -> tuple[int, str]:
    """(exit code, output) of the script's job; a job that hangs is -1 with what it printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DISTTRAIN_PS_TIMEOUT"] = "5"
    try:
        res = subprocess.run([sys.executable, "-m", "disttrain", "run", "--workers", str(workers),
                              "--servers", str(servers), str(SCRIPT), *args], capture_output=True,
                             text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return -1, f"{e}\n{e.stdout or ''}{e.stderr or ''}"
    return res.returncode, res.stdout + res.stderr


def counts(out: str, workers: int = 3) -> tuple[set[float], list[int]]:
    """The distinct counts every worker saw, and the most pushes any parameter never saw."""
    seen = re.findall(r"worker (\d) counts \[(.*)\]", out)
    zeros = re.findall(r"worker (\d) zeros \[(.*)\]", out)
    ranks = [str(w) for w in range(workers)]
    assert sorted(w for w, _ in seen) == sorted(w for w, _ in zeros) == ranks, out
    values = {float(v) for _, row in seen for v in row.split(", ")}
    return values, [max(int(z) for z in row.split(", ")) for _, row in zeros]


@pytest.mark.timeout(200)
def test_kbatch_async_with_replicas_ends_and_applies_each_push_at_most_once():
    code, out = launch("kbatchasync", "2", "40", "2")
    assert code == 0, out
    values, zeros = counts(out)
    # NOTE: each push half of a round of 2, or among the last round's leftover, dropped at
    # the end (at most k - 1 = 1 per server): never applied twice (2)
    assert values <= {0.0, 1.0} and 1.0 in values, out
    assert max(zeros) <= 1, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kasync_with_replicas_ends_and_applies_every_push_once():
    code, out = launch("kasync", "2", "40", "2")
    assert code == 0, out
    rows = re.findall(r"worker (\d) applied \[(.*)\] dropped \[(.*)\]", out)
    assert sorted(w for w, _, _ in rows) == ["0", "1", "2"], out
    applied = [max(int(a.split(", ")[s]) for _, a, _ in rows) for s in range(3)]
    # NOTE: KAsync drops nothing; the last worker's bye counts every push, each once
    assert applied == [3 * 40] * 3 and {d for _, _, d in rows} == {"0, 0, 0"}, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kbatch_async_held_pushes_survive_a_killed_server_at_most_once():
    """Server 1 SIGKILLed right after a push: the pushes it had received (`held`) but not
    applied are sent again to its copies' routes, which apply each once."""
    code, out = launch("kbatchasync", "2", "30", "2", "10", "1", timeout=250)
    assert code == 0, out
    assert re.search(r"\[ps server\d\] took over \d+ keys \([\d.]+ MB\) of dead server 1", out), out
    values, zeros = counts(out)
    assert values <= {0.0, 1.0} and max(zeros) <= 1, out


# NOTE: k > workers: each worker pushes several times into a round, which needs the `held`
# answer (with acks only, every worker waited for a round only its next push could fill)
@pytest.mark.timeout(200)
def test_kbatch_async_k_above_the_workers_with_replicas_applies_every_push_once():
    """KBatchAsync(3), 2 workers, 2 servers, replicas=2, 30 steps: 60 pushes per server,
    20 full rounds, nothing dropped, so every one-hot push counts exactly once."""
    code, out = launch("kbatchasync", "3", "30", "2", workers=2, servers=2)
    assert code == 0, out
    values, zeros = counts(out, workers=2)
    assert values == {1.0} and zeros == [0, 0], out


@pytest.mark.timeout(200)
def test_kbatch_sync_k_above_the_workers_with_replicas_ends_and_applies_at_most_once():
    """KBatchSync(4), 2 workers, 3 servers, replicas=2: a round closes on 4 pushes and
    drops the late ones, so each push counts once or not at all, never twice."""
    code, out = launch("kbatchsync", "4", "30", "2", workers=2)
    assert code == 0, out
    values, _ = counts(out, workers=2)
    assert values <= {0.0, 1.0} and 1.0 in values, out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,k,servers,victim", [("kbatchasync", "3", 3, "1"),
                                                   ("kbatchsync", "4", 2, "0")])
def test_k_above_the_workers_survives_a_killed_server_at_most_once(name, k, servers, victim):
    """A server SIGKILLed right after worker 0's 10th push: its held pushes are sent again
    to its copies' routes; nothing acknowledged is lost, no push counts twice, and under
    KBatchAsync (60 pushes per key, 20 full rounds) every push counts exactly once."""
    code, out = launch(name, k, "30", "2", "10", victim, workers=2, servers=servers,
                       timeout=250)
    assert code == 0, out
    assert re.search(rf"took over \d+ keys \([\d.]+ MB\) of dead server {victim}", out), out
    values, zeros = counts(out, workers=2)
    if name == "kbatchasync":
        assert values == {1.0} and zeros == [0, 0], out
    else:
        assert values <= {0.0, 1.0} and 1.0 in values, out
