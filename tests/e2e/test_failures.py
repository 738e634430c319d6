"""A failing rank's own cause comes first: `disttrain run` on jobs where one rank fails
while the others wait for it (tests/e2e/scripts/fail_in.py, uses torch).

Which rank ends first is a race (the raising rank runs its exit handlers while the
others notice it left), so the launcher must not depend on it. Each case runs
DISTTRAIN_TEST_REPEAT times (default 1; the closing notes quote runs with more).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.e2e.test_launcher import SCRIPTS, disttrain

SCRIPT = SCRIPTS / "fail_in.py"
REPEAT = int(os.environ.get("DISTTRAIN_TEST_REPEAT", "1"))
LIMIT = 30  # seconds: what the issue allows a failing job


def line_of(marker: str) -> int:
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if line.rstrip().endswith(f"# at:{marker}"):
            return n
    raise AssertionError(f"no '# at:{marker}' in {SCRIPT}")


def launch(args: list[str], mode: str, bad: int | None = None):
    """Run fail_in.py MODE [BAD] under `disttrain run ARGS`; (result, seconds)."""
    start = time.monotonic()
    extra = [] if bad is None else [str(bad)]
    res = disttrain("run", *args, str(SCRIPT), mode, *extra, timeout=LIMIT + 60)
    return res, time.monotonic() - start


def assert_cause_first(err: str, rank: int, exception: str) -> list[str]:
    """The report opens with `rank`'s own exception and traceback; returns the lines."""
    lines = err.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("disttrain run: "))
    assert lines[head].startswith(f"disttrain run: rank {rank} raised an exception"), err
    assert lines[head + 1] == f"[rank{rank}]: Traceback (most recent call last):", err
    assert f"[rank{rank}]: {exception}" in lines, err
    # no hang report, no other rank's traceback, no raw backend error before the cause
    assert "timed out" not in err and "a collective failed" not in err, err
    assert "Connection closed by peer" not in err and "GLHF" not in err, err
    assert sum(ln.endswith("Traceback (most recent call last):") for ln in lines) == 1, err
    return lines


PS2, PS4 = ["--workers", "1", "--servers", "1"], ["--workers", "3", "--servers", "1"]
# (mode, launcher args, failing rank, where the others wait: a regex, or None)
RAISING = [
    ("between", ["--nproc", "2"], 1, r"rank 0 waited in all_reduce #\d+ \(fail_in.py:\d+\)"),
    ("between", ["--nproc", "4"], 2, r"ranks 0-1,3 waited in all_reduce #\d+"),
    ("backward", ["--nproc", "2"], 1, r"rank 0 waited in all_reduce"),
    ("backward", ["--nproc", "4"], 1, r"ranks? [0-3,-]+ waited in all_reduce"),
    ("zero3", ["--nproc", "2"], 1, r"rank 0 waited in (broadcast|all_gather)"),
    ("zero3", ["--nproc", "4"], 3, r"waited in (broadcast|all_gather)"),
    ("pipeline", ["--nproc", "2"], 1, r"rank 0 waited in (isend|irecv|send|recv) #\d+ .* on p2p"),
    ("pipeline", ["--nproc", "4"], 3, r"waited in (isend|irecv|send|recv) #\d+ .* on p2p"),
    ("ps-worker", PS2, 0, None),
    ("ps-worker", PS4, 1, None),
    ("ps-server", PS2, 1, None),
    ("ps-server", PS4, 3, None),
]


# NOTE: suite time: the fast suite runs every mode at one world (2 or 4, both worlds for
# "between") and DISTTRAIN_SLOW=1 the whole matrix; each launch costs a few seconds of imports.
FAST_WORLD = {"between": None, "backward": 4, "zero3": 4, "pipeline": 2, "ps-worker": 2, "ps-server": 4}


def _world(args: list[str]) -> int:
    return int(args[1]) + (args[0] == "--workers")


RAISING = [c if FAST_WORLD[c[0]] in (None, _world(c[1])) else pytest.param(*c, marks=pytest.mark.slow)
           for c in RAISING]


@pytest.mark.timeout((REPEAT + 2) * (LIMIT + 60))
@pytest.mark.parametrize("mode,args,bad,waits", RAISING,
                         ids=[f"{c[0]}-{'ps' if c[1][0] == '--workers' else 'np'}{_world(c[1])}"
                              for c in (getattr(x, "values", x) for x in RAISING)])
def test_raising_rank_is_shown_first_and_the_job_exits_1(mode, args, bad, waits):
    exception = ("FloatingPointError: server optimizer: update 3 is not finite" if mode == "ps-server"
                 else f"ValueError: bad batch on rank {bad} at step 3")
    named = 0  # launches whose report said where the other ranks waited
    for launched in range(REPEAT + 2):
        if launched >= REPEAT and (named or not waits):
            break
        res, took = launch(args, mode, None if mode == "ps-server" else bad)
        assert res.returncode == 1, res.stderr
        assert took < LIMIT, f"took {took:.0f} s\n{res.stderr}"
        assert "should not happen" not in res.stdout
        lines = assert_cause_first(res.stderr, bad, exception)
        if waits:
            said = [ln for ln in lines if " waited in " in ln]
            if not said and f"after rank {bad} failed" in res.stderr:
                # NOTE: a race, seen once in ~30 CI launches: the launcher can stop the
                # other rank before its flight state shows the wait; it then says so
                # ("stopped rank 0 after rank 1 failed"). The cause-first checks above
                # hold on every launch; the wait line must appear in one of up to 2 more.
                continue
            assert len(said) == 1 and said[0].startswith(
                f"disttrain run: rank {bad} exited (exception) while "), res.stderr
            assert re.search(waits, said[0]), res.stderr
            named += 1
    assert named or not waits, "no launch named where the other ranks waited"


@pytest.mark.timeout(REPEAT * (LIMIT + 60))
@pytest.mark.parametrize("mode,code,shown", [
    ("exit", 3, "[rank1]: SystemExit: 3"),
    ("os-exit", 5, "[rank1]: no Python exception was recorded (os._exit, a C library's exit or a crash); see this rank's output above"),
    ("kill", 128 + 9, "[rank1]: no Python exception: SIGKILL cannot be caught (the kernel's OOM killer, `kill -9`, a lost machine); see this rank's output above"),
])
def test_a_rank_that_exits_or_dies_is_named_with_its_code(mode, code, shown):
    how = {"exit": "exited (sys.exit(3))", "os-exit": "exited with code 5",
           "kill": "was killed by SIGKILL"}[mode]
    for _ in range(REPEAT):
        res, took = launch(["--nproc", "2"], mode)
        assert res.returncode == code, res.stderr
        assert took < LIMIT, f"took {took:.0f} s\n{res.stderr}"
        lines = res.stderr.splitlines()
        head = next(i for i, ln in enumerate(lines) if ln.startswith("disttrain run: "))
        assert lines[head].startswith(f"disttrain run: rank 1 {how} (pid "), res.stderr
        assert shown in lines, res.stderr
        if mode == "exit":  # where it chose to exit
            assert f'[rank1]:   File "{SCRIPT}", line {line_of("exit")}, in fail' in lines
        assert any(re.fullmatch(rf"disttrain run: rank 1 {re.escape(how)} while rank 0 waited in "
                                r"all_reduce #\d+ \(fail_in.py:\d+\); the launcher stopped it", ln)
                   for ln in lines), res.stderr
        assert "timed out" not in res.stderr and "Traceback" not in res.stderr.replace(
            "[rank1]: Traceback", ""), res.stderr


@pytest.mark.timeout(REPEAT * (LIMIT + 60))
def test_rank0_raising_alone_is_shown_first():
    for _ in range(REPEAT):
        res, _ = launch(["--nproc", "2"], "between", 0)
        assert res.returncode == 1, res.stderr
        assert_cause_first(res.stderr, 0, "ValueError: bad batch on rank 0 at step 3")


@pytest.mark.timeout(REPEAT * (LIMIT + 60))
def test_two_ranks_raising_show_the_earlier_first_and_name_the_other():
    for _ in range(REPEAT):
        res, _ = launch(["--nproc", "2"], "two", 1)
        assert res.returncode == 1, res.stderr
        lines = res.stderr.splitlines()
        assert "[rank0]: RuntimeError: first failure on rank 0" in lines, res.stderr
        assert lines.index("[rank0]: RuntimeError: first failure on rank 0") < len(lines) - 1
        assert lines[-1] == "disttrain run: rank 1 also failed: KeyError: 'second failure on rank 1'", res.stderr


@pytest.mark.timeout(REPEAT * (LIMIT + 60))
@pytest.mark.parametrize("mode,exception,waits", [
    ("init", "disttrain.settings.SettingsError: DISTTRAIN_TIMEOUT='soon': expected a number "
             "of seconds > 0, e.g. DISTTRAIN_TIMEOUT=300", None),
    ("checkpoint", "RuntimeError: state_dict of rank 1 failed", r"rank 0 waited in all_gather #\d+"),
])
def test_exception_during_init_or_checkpoint_save_is_shown_first(mode, exception, waits):
    for _ in range(REPEAT):
        res, took = launch(["--nproc", "2"], mode, 1)
        assert res.returncode == 1, res.stderr
        assert took < LIMIT, f"took {took:.0f} s\n{res.stderr}"
        lines = assert_cause_first(res.stderr, 1, exception)
        if waits:
            assert any(re.search(waits, ln) for ln in lines), res.stderr
