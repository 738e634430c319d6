"""Checks shared by the tests of a membership change mid-run (test_ps_drain.py, test_ps_join.py
and their fault tests): what a job's output must say once a server left or joined.

The jobs are scripts/ps_drain.py, scripts/ps_join.py and their kin, run by `disttrain run`
(test_ps_failover.launch): worker 0 prints the final parameters' digest under Sync, or,
under Async, SSP and the K modes with one-hot gradients, how often each push was applied.
"""

import importlib.util
import json
import re
import sys
from functools import cache
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
EXAMPLE = Path(__file__).parents[2] / "examples" / "digits_ps.py"
DIGEST = re.compile(r"worker (\d) digest (\w+)")
COUNTS = re.compile(r"worker (\d) counts (.*)")


@cache
def reference() -> str:
    """The digest one process computes for the membership scripts' Sync training (30 steps)."""
    sys.path.insert(0, str(SCRIPTS))  # NOTE: the script imports ps_failover beside it
    try:
        spec = importlib.util.spec_from_file_location("ps_drain_script", SCRIPTS / "ps_drain.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        return script.reference()
    finally:
        sys.path.remove(str(SCRIPTS))


def assert_bitwise_reference(out: str, workers: int = 2) -> None:
    """Under Sync every worker printed the single-process reference's digest."""
    assert sorted(DIGEST.findall(out)) == [(str(w), reference()) for w in range(workers)], out


def assert_each_push_once(out: str, workers: int = 2) -> None:
    """One-hot gradients: every parameter saw each worker's push exactly once (each printed
    entry counts how often its push was applied: 0 lost, 2 applied twice)."""
    assert sorted(COUNTS.findall(out)) == [(str(w), "[1.0]") for w in range(workers)], out


def assert_each_push_at_most_once(out: str, k: int, workers: int = 2) -> None:
    """The K modes (KSync(k), KBatchSync(k)) with one-hot gradients: a round averages k
    pushes and drops the late ones (computed on a closed round's version), so each entry
    is 1/k (applied once, in a whole round) or 0 (dropped, or cancelled before it was
    sent), never 2/k (applied twice) nor another fraction (a round half applied)."""
    counts = dict(COUNTS.findall(out))
    assert sorted(counts) == [str(w) for w in range(workers)], out
    for seen in counts.values():
        assert set(json.loads(seen)) <= {0.0, 1 / k} and 1 / k in json.loads(seen), out


def assert_example_matches_plain(launch, flags: list[str], changed: str | None = None, *,
                                 args: tuple[str, ...] = ("--epochs", "4"), check=None) -> None:
    """examples/digits_ps.py with `args` (default 4 epochs) and `flags` (a membership change
    or a fault) ends with rc 0, its output matching `changed` (or passing `check(code,
    out)`, which then checks the code itself), and the final parameters of the run
    without `flags`."""
    code, plain = launch(*args, script=EXAMPLE)
    assert code == 0, plain
    code, out = launch(*args, *flags, script=EXAMPLE)
    if check is not None:
        check(code, out)
    else:
        assert code == 0, out
        assert re.search(changed, out), out
    digest = re.compile(r"final parameters sha256 (\w+)")
    assert digest.findall(out) == digest.findall(plain) != [], out


def assert_status_chains(out: str, new: int, replicas: int) -> None:
    """The manager's status after the join (scripts/ps_join.py prints it): each key listed
    once, with `replicas` copies, under the server heading it; the joiner heads the moved
    keys, the chains those of join_chains.py's `chains_after` (the old owners' kept keys
    as registered)."""
    got = re.search(r"worker 0: status at ring version \d+: status chains (\{.*\}) \((\d+) "
                    r"rows\)", out)
    want = re.search(r"worker 0: chains after (\{.*\})", out)
    assert got and want, out
    listed, after = json.loads(got.group(1)), json.loads(want.group(1))
    assert int(got.group(2)) == len(listed) == len(after), out  # each key once
    assert {k: chain for k, (_, chain) in listed.items()} == after, out
    assert all(len(set(c)) == replicas == len(c) and c[0] == s for s, c in listed.values()), out
    assert any(s == new for s, _ in listed.values()), out
    assert re.search(rf"\[ps manager\] ring version \d+: server {new} heads \d+ keys \([\d.]+ "
                     rf"MB\) of server \d with {replicas} cop(ies|y) each, chains \[{new}[,\]]",
                     out), out
