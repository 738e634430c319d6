"""A parameter server SIGKILLed mid-run with replicas=2: its copies take over, nothing is lost.

`disttrain run --workers 2 --servers S` (no --max-restarts): worker 0 kills a server from
its loop (scripts/ps_failover.py), right after a push was sent (the round in flight,
before its commit) or once it was acknowledged (after the commit). The job must end
with rc 0, the takeover named in the output, and under Sync the final parameters
bitwise equal to a single-process reference of the same training (which is also what
an uninterrupted run ends with); under Async every push applied exactly once (the
script's one-hot gradients count it). replicas=1 keeps the old behaviour: the job stops.
"""

import importlib.util
import os
import re
import secrets
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.e2e._ps_membership import assert_example_matches_plain

SCRIPT = Path(__file__).parent / "scripts" / "ps_failover.py"
EXAMPLE = Path(__file__).parents[2] / "examples" / "digits_ps.py"
TOOK = re.compile(r"\[ps server(\d)\] took over (\d+) keys \([\d.]+ MB\) of dead server (\d) at "
                  r"version (\d+)")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["DISTTRAIN_PS_TIMEOUT"] = "5"
    return env


def launch(*args: str, servers: int = 2, script: Path = SCRIPT) -> tuple[int, str]:
    """(exit code, output) of the job; a job that hangs is -1 with what it printed."""
    try:
        res = subprocess.run(
            [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers",
             str(servers), str(script), *args], capture_output=True, text=True, timeout=170,
            env=_env())
    except subprocess.TimeoutExpired as e:
        return -1, f"{e}\n{e.stdout or ''}{e.stderr or ''}"
    return res.returncode, res.stdout + res.stderr


@cache
def reference() -> str:
    """The digest a single process computes for the script's Sync training."""
    spec = importlib.util.spec_from_file_location("ps_failover_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.reference()


def check_takeover(code: int, out: str, dead: int) -> None:
    assert code == 0, out
    assert f"server rank {2 + dead} killed (SIGKILL); its replicas take over" in out, out
    took = TOOK.findall(out)
    assert took and all(d == str(dead) for _, _, d, _ in took), out
    assert re.search(rf"\[ps manager\] ring version \d+: server \d took over \d+ keys .* of "
                     rf"dead server {dead} at version \d+, [\d.]+ s after its last heartbeat",
                     out), out



def check_result(mode: str, out: str) -> None:
    """Sync: every worker's final digest is the single-process reference's; Async (count):
    every parameter saw each one-hot push exactly once."""
    if mode == "sync":
        assert set(re.findall(r"worker \d digest (\w+)", out)) == {reference()}, out
    else:
        assert sorted(re.findall(r"worker (\d) counts (.*)", out)) == [
            ("0", "[1.0]"), ("1", "[1.0]")], out

@pytest.mark.timeout(200)
def test_sync_job_outlives_a_killed_server_bitwise():
    code, out = launch("sync", "5", "1", "pushed")
    check_takeover(code, out, dead=1)
    assert sorted(re.findall(r"worker (\d) digest (\w+)", out)) == [
        ("0", reference()), ("1", reference())], out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("servers", [2, 3])
@pytest.mark.parametrize("step,dead,when", [(1, 0, "pushed"), (4, 0, "acked"),
                                            (7, 1, "pushed"), (11, 1, "acked")])
def test_sync_kill_at_any_point_ends_bitwise_equal(servers, step, dead, when):
    code, out = launch("sync", str(step), str(dead), when, servers=servers)
    check_takeover(code, out, dead)
    digests = set(re.findall(r"worker \d digest (\w+)", out))
    assert digests == {reference()}, out


COPIED = re.compile(r"\[ps manager\] ring version \d+: server (\d) holds a copy of \d+ keys "
                    r"\([\d.]+ MB\) of server (\d) again, from server (\d) at version \d+")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["sync", "count"])
def test_three_servers_copy_the_dead_servers_ranges_again(mode):
    """replicas=2, 3 servers, server 1 killed: every range it held is extended to the
    server that held no copy (the routes' and the heads' whose next server it was), the
    manager records each, and the run still ends bitwise equal (Sync) or applies every
    push exactly once (Async)."""
    code, out = launch(mode, "5", "1", "pushed", servers=3)
    check_takeover(code, out, dead=1)
    copied = COPIED.findall(out)
    assert copied and all(to != by and "1" not in (to, by) for to, _, by in copied), out
    check_result(mode, out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_still_attaching_when_a_server_dies_is_welcomed_by_its_routes():
    """replicas=2, 3 servers, Async: worker 1 says hello only after worker 0 killed server
    1 at step 3; its hello to the dead server is answered by the routes that took over,
    and every push of both workers is applied exactly once (the hello's wait was lost in
    the re-route once, and the worker waited for ever)."""
    code, out = launch("count", "3", "1", "pushed", "2", "0", "late", servers=3)
    check_takeover(code, out, dead=1)
    assert re.search(r"\[ps worker1\] server 1 died; its keys are served by", out), out
    check_result("count", out)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["sync", "count"])
def test_the_server_that_took_over_dies_too_and_nothing_is_lost(mode):
    """replicas=2, 3 servers: server 1 is killed at step 3, its ranges are copied again,
    then at step 8 the server that took over its first key is killed too: the third
    server serves everything (the second's own keys and the route it hosted, from the
    copies made again), and the run still ends bitwise equal (Sync) or applies every
    push exactly once (Async)."""
    code, out = launch(mode, "3", "1", "acked", "2", "8", servers=3)
    assert code == 0, out
    second = re.search(r"worker 0 kills server (\d) too", out).group(1)
    took = TOOK.findall(out)
    assert {d for _, _, d, _ in took} == {"1", second}, out
    assert COPIED.findall(out), out
    check_result(mode, out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("servers,step,dead,when", [(2, 5, 0, "pushed"), (2, 9, 1, "acked"),
                                                    (3, 6, 2, "pushed")])
def test_async_applies_every_push_exactly_once_across_a_kill(servers, step, dead, when):
    code, out = launch("count", str(step), str(dead), when, servers=servers)
    check_takeover(code, out, dead)
    # each entry counts how often its push was applied: 0 lost, 2 applied twice
    assert sorted(re.findall(r"worker (\d) counts (.*)", out)) == [("0", "[1.0]"),
                                                                   ("1", "[1.0]")], out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_one_replica_a_killed_server_still_stops_the_job():
    res = subprocess.run(
        [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers", "2",
         str(EXAMPLE), "--epochs", "1", "--kill-server-at", "5", "--kill-server", "1"],
        capture_output=True, text=True, timeout=200, env=_env())
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "take over" not in out and "took over" not in out, out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_digits_example_kill_server_flag_matches_an_uninterrupted_run():
    assert_example_matches_plain(launch, ["--kill-server-at", "9", "--kill-server", "0"],
                                 args=("--epochs", "1", "--replicas", "2"),
                                 check=lambda code, out: check_takeover(code, out, dead=0))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_copy_killed_while_a_range_moves_to_it_is_named_and_nothing_hangs():
    """3 servers, replicas=2, Sync: server 1 is killed at step 3; the first server a range
    is copied to again SIGKILLs itself on the first `transfer` frame it reads. Either the
    job goes on (the sender drops it, the third server serves what it held) and ends
    bitwise equal, or, when it also hosted a route whose copy it had not finished
    sending, the job stops naming it (the receiver) or the keys that had no finished copy
    left (the workers): never a hang, never a wrong result."""
    code, out = launch("sync", "3", "1", "acked", "2", "0", "die", servers=3)
    dead = re.search(r"server (\d) dies on a transfer frame", out)
    assert dead, out
    if code == 0:
        assert set(re.findall(r"worker \d digest (\w+)", out)) == {reference()}, out
    else:  # NOTE: the receiver's error or the workers' may come first
        named = re.search(rf"server {dead.group(1)} died before it finished copying \d+ keys", out)
        lost = re.search(r"server (\d) at \S+ died and every copy of \d+ of its keys", out)
        assert named or lost, out
        if lost:  # right only if the ring never listed a finished copy of its keys again
            assert not re.search(rf"holds a copy of \d+ keys \(\S+ MB\) of server "
                                 rf"{lost.group(1)} again", out), out


def _manager(state: str, env: dict) -> tuple[subprocess.Popen, str]:
    """A standing manager (`disttrain ps manager`) on `state`, and its address."""
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "ps", "manager", "--state", state,
                             "--timeout", "5"], env=env, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    return proc, re.search(r" at (\S+), state in", first).group(1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_manager_killed_and_restarted_while_a_range_is_copied_again_loses_nothing(tmp_path):
    """3 servers, replicas=2, Sync, a standing manager: server 1 is killed at step 3, and
    the moment a server starts copying a range again the manager is SIGKILLed and started
    again on its state file. The takeover and the copies go on (servers and workers
    reconnect by themselves), the restarted manager records the copies once each, and
    the job ends bitwise equal to the reference."""
    env = dict(_env(), DISTTRAIN_SECRET=secrets.token_hex(32))
    state = str(tmp_path / "manager.json")
    manager, address = _manager(state, env)
    job = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--workers", "2", "--servers", "3",
         str(SCRIPT), "sync", "3", "1", "acked"], env=dict(env, DISTTRAIN_PS_MANAGER=address),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, restarted = [], None
    try:
        for line in job.stdout:
            out.append(line)
            if restarted is None and re.search(r"\[ps server\d\] copies \d+ keys", line):
                manager.kill()
                manager.wait()
                restarted, again = _manager(state, env)
                assert again == address
        code = job.wait(timeout=200)
    finally:
        job.kill()
        for m in (manager, restarted):
            if m is not None:
                m.terminate()
    text = "".join(out)
    events = restarted.communicate(timeout=30)[1] if restarted else ""
    assert restarted is not None, text
    assert code == 0, text + events
    assert set(re.findall(r"worker \d digest (\w+)", text)) == {reference()}, text
    copied = COPIED.findall(events)
    assert copied and len(copied) == len(set(copied)), events
