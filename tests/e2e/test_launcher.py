"""`disttrain run` as a user runs it: real launcher processes, real ranks, real gloo.

Scripts the launcher starts live in tests/e2e/scripts/. Most of them import only the
standard library so a launch costs a second; the ones that use torch say so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain import cli

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent
# Launcher variables a surrounding job could leak into the tests' launches.
LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "OMP_NUM_THREADS", "DISTTRAIN_SECRET", "DISTTRAIN_SERVERS", "DISTTRAIN_TIMEOUT",
         "LOGLEVEL", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env.update(extra)
    return env


def disttrain(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m disttrain ARGS` to its end; stdout and stderr captured apart."""
    return subprocess.run(
        [sys.executable, "-m", "disttrain", *args],
        env=env or clean_env(), capture_output=True, text=True, timeout=timeout,
    )


def reports(text: str) -> dict[int, tuple[str, dict]]:
    """rank -> (prefix before 'REPORT ', report) for every REPORT line of env_allreduce.py."""
    out = {}
    for line in text.splitlines():
        head, sep, body = line.partition("REPORT ")
        if sep:
            report = json.loads(body)
            out[report["rank"]] = (head, report)
    return out


@contextlib.contextmanager
def hold_port(port: int):
    """Keep `port` busy (listening) for the block; someone else holding it is as good."""
    sock = socket.socket()
    try:
        sock.bind(("", port))
        sock.listen()
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
    try:
        yield
    finally:
        sock.close()


@pytest.mark.timeout(60)
def test_ranks_get_launcher_env_and_all_reduce_with_29500_busy():
    """Uses torch: disttrain.init() + all_reduce over gloo at nproc 2; 29500 is taken."""
    with hold_port(29500):
        res = disttrain("run", "--nproc", "2", str(SCRIPTS / "env_allreduce.py"), "--lr", "0.1")
    assert res.returncode == 0, res.stderr
    got = reports(res.stdout)
    assert sorted(got) == [0, 1], res.stdout
    assert got[0][0] == "" and got[1][0] == "[rank1]: "  # rank 0 plain, others prefixed
    for rank, (_, r) in got.items():
        assert (r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert r["sum"] == 1.0 and r["world"] == 2 and r["role"] == "worker"
        assert r["argv"] == ["--lr", "0.1"] and r["name"] == "__main__"
        assert r["MASTER_ADDR"] and r["MASTER_PORT"] == got[0][1]["MASTER_PORT"] != "29500"
        assert int(r["OMP_NUM_THREADS"]) >= 1 and r["DISTTRAIN_SERVERS"] == "0"
        assert re.fullmatch(r"[0-9a-f]{64}", r["secret"]) and not r["secret_in_cmdline"]
    assert got[0][1]["secret"] == got[1][1]["secret"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_rank", [0, pytest.param(1, marks=pytest.mark.slow)])  # NOTE: rank 1
# raising is the failure matrix's case in test_failures.py (suite time)
def test_failing_rank_prints_its_traceback_with_its_prefix(fail_rank):
    start = time.monotonic()
    res = disttrain("run", "--nproc", "2", str(SCRIPTS / "fail_rank.py"), str(fail_rank))
    took = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    p = f"[rank{fail_rank}]: "
    lines = res.stderr.splitlines()
    assert f"{p}Traceback (most recent call last):" in lines, res.stderr
    assert f'{p}  File "{SCRIPTS / "fail_rank.py"}", line 9, in check' in lines
    assert f"{p}ValueError: boom on rank {fail_rank} with value 42" in lines
    assert "<N/A>" not in res.stderr and "entry.py" not in res.stderr and "runpy" not in res.stderr
    # The healthy rank sleeps 60 s in its script: it was stopped, not waited for.
    assert took < 45, f"launcher took {took:.0f}s: the healthy rank was not stopped"


@pytest.mark.timeout(60)
def test_max_restarts_restarts_the_group():
    """Rank 1 fails on attempt 0 only; with one restart the job succeeds."""
    res = disttrain("run", "--nproc", "2", "--max-restarts", "1", str(SCRIPTS / "flaky.py"))
    assert res.returncode == 0, res.stderr
    assert "[rank1]: attempt 1 rank 1" in res.stdout.splitlines()
    assert "[rank1]: RuntimeError: first attempt fails" in res.stderr  # attempt 0 is not hidden


@pytest.mark.timeout(60)
def test_rank0_progress_bar_is_unprefixed():
    res = disttrain("run", "--nproc", "2", str(SCRIPTS / "progress.py"))
    assert res.returncode == 0, res.stderr
    assert "[rank1]: done rank 1" in res.stdout.splitlines()
    assert "done rank 0" in res.stdout.splitlines()
    # NOTE: text=True turns tqdm's \r into \n, so every redraw is a line here.
    bar = [line for line in res.stderr.splitlines() if "steps" in line]
    assert bar and all(line.startswith("steps: ") for line in bar), res.stderr
    assert "steps: 100%" in bar[-1]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited, waiting for whoever reaps it


@pytest.mark.timeout(60)
def test_ctrl_c_stops_every_rank(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrain", "run", "--nproc", "2", str(SCRIPTS / "sleeper.py"), str(tmp_path)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "SIGINT" in err, err
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in pids), f"ranks still alive: {pids}"


def _raising_launch(exc_factory):
    def fake_elastic_launch(config, entrypoint):
        def call(*args):
            raise exc_factory()
        return call
    return fake_elastic_launch


def _signal_lost_in_torch_wrapper():
    # What torch's metrics.prof wrapper raises when SIGINT lands on its `start = ...`
    # line: an UnboundLocalError whose context is the agent's SignalException.
    from torch.distributed.elastic.multiprocessing import SignalException
    try:
        raise SignalException("got signal: 2", sigval=signal.SIGINT)
    except SignalException:
        try:
            raise UnboundLocalError("cannot access local variable 'start'")
        except UnboundLocalError as err:
            return err


@pytest.mark.timeout(30)
def test_ctrl_c_inside_torch_metrics_wrapper_is_still_an_interrupt(monkeypatch, capsys, tmp_path):
    from disttrain.launch import job
    script = SCRIPTS / "sleeper.py"
    monkeypatch.setattr(job, "elastic_launch", _raising_launch(_signal_lost_in_torch_wrapper))
    assert job.run(job.RunConfig(script=str(script), nproc=2)) == 130
    assert "got SIGINT, stopped every rank" in capsys.readouterr().err
    # any other error still propagates as itself
    monkeypatch.setattr(job, "elastic_launch", _raising_launch(lambda: RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        job.run(job.RunConfig(script=str(script), nproc=2))


@pytest.mark.timeout(60)
def test_workers_and_servers_get_roles_and_user_secret():
    """Uses torch: --workers 2 --servers 1 is a world of 3, the last rank a server.

    Also: a user-set DISTTRAIN_SECRET is kept (never replaced); --timeout reaches the ranks.
    """
    secret = "s3cret-" + "x" * 20
    res = disttrain("run", "--workers", "2", "--servers", "1", "--timeout", "42",
                    str(SCRIPTS / "env_allreduce.py"), env=clean_env(DISTTRAIN_SECRET=secret))
    assert res.returncode == 0, res.stderr
    got = {rank: r for rank, (_, r) in reports(res.stdout).items()}
    assert sorted(got) == [0, 1, 2]
    assert [got[r]["role"] for r in range(3)] == ["worker", "worker", "server"]
    assert all(r["DISTTRAIN_SERVERS"] == "1" and r["sum"] == 3.0 for r in got.values())
    assert all(r["secret"] == secret and not r["secret_in_cmdline"] for r in got.values())
    assert all(float(r["DISTTRAIN_TIMEOUT"]) == 42.0 for r in got.values())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_two_nodes_rendezvous_at_the_given_master():
    """Two launchers on this machine play node 0 and node 1 of one 4-rank job (c10d rendezvous).

    Node 1 names its own address (another loopback one): c10d orders the nodes by it.
    """
    port = str(free_port())

    def node(rank: int) -> subprocess.Popen:
        local = ["--local-addr", "127.0.0.2"] if rank else []  # node 0's: --master-addr
        return subprocess.Popen(
            [sys.executable, "-m", "disttrain", "run", "--nnodes", "2", "--node-rank", str(rank),
             "--master-addr", "127.0.0.1", "--master-port", port, "--rdzv-id", "job-7", *local,
             "--nproc", "2", str(SCRIPTS / "env_only.py")],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    nodes = [node(1), node(0)]
    try:
        outs = [p.communicate(timeout=45) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], [err for _, err in outs]
    seen = {}
    for out, _ in outs:
        for line in out.splitlines():
            head, _, body = line.partition("ENV ")
            env = json.loads(body)
            seen[int(env["RANK"])] = (head, env)
    assert sorted(seen) == [0, 1, 2, 3]
    assert [seen[r][0] for r in range(4)] == ["", "[rank1]: ", "[rank2]: ", "[rank3]: "]
    for rank, (_, env) in seen.items():
        assert (env["WORLD_SIZE"], env["GROUP_RANK"], env["LOCAL_RANK"]) == ("4", str(rank // 2), str(rank % 2))
        assert (env["MASTER_ADDR"], env["TORCHELASTIC_RUN_ID"]) == ("127.0.0.1", "job-7")
        # the ranks' own store: a port c10d's first node picked, not the rendezvous store's
        assert env["MASTER_PORT"] == seen[0][1]["MASTER_PORT"] != port


@pytest.mark.timeout(60)
def test_same_script_runs_alone_and_under_torchrun():
    """Uses torch: the launch-agnostic script, as `python script.py` and under torchrun."""
    script = str(SCRIPTS / "env_allreduce.py")
    alone = subprocess.run([sys.executable, script], env=clean_env(), capture_output=True,
                           text=True, timeout=60)
    assert alone.returncode == 0, alone.stderr
    (_, r), = reports(alone.stdout).values()
    assert (r["rank"], r["world"], r["sum"], r["RANK"]) == (0, 1, 0.0, None)
    torchrun = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", script],
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert torchrun.returncode == 0, torchrun.stderr
    got = reports(torchrun.stdout)
    assert sorted(got) == [0, 1] and all(r["sum"] == 1.0 for _, r in got.values())


# ---- the CLI's own checks: in-process, nothing is launched ---------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse's --help, --version and usage errors
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "no/such/script.py"], "script 'no/such/script.py' not found"),
        (["run", "--nproc", "2", "--workers", "2", "--servers", "1", "S"], "mutually exclusive"),
        (["run", "--workers", "2", "S"], "needs both --workers W and --servers S"),
        (["run", "--workers", "0", "--servers", "1", "S"], "--workers (0) and --servers (1) must both be >= 1"),
        (["run", "--workers", "2", "--servers", "0", "S"], "must both be >= 1"),
        (["run", "--nproc", "0", "S"], "--nproc must be >= 1"),
        (["run", "--nnodes", "2", "S"], "needs --master-addr"),
        (["run", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "S"], "--node-rank 2 must be in 0..1"),
        (["run", "--max-restarts", "-1", "S"], "--max-restarts must be >= 0"),
        (["run", "--nnodes", "2", "--master-addr", "h", "--rdzv-id", "", "S"], "--rdzv-id must not be empty"),
        (["run", "--cluster", "c", "--rdzv-id", "x", "S"], "drop --nnodes, --node-rank, --master-addr, --local-addr"),
        (["run", "--cluster", "c", "--trace-steps", "1:2", "S"], "--trace-steps needs --trace DIR"),
        (["run", "--timeout", "0", "S"], "--timeout must be > 0"),
        (["run", "--grace-seconds", "nan", "S"], "--grace-seconds must be >= 0"),
    ],
)
def test_bad_flags_are_clear_errors(capsys, argv, message):
    argv = [str(SCRIPTS / "fail_rank.py") if a == "S" else a for a in argv]
    code, text = run_cli(capsys, *argv)
    assert code == 2 and message in text, text


@pytest.mark.timeout(30)
def test_multinode_parameter_server_needs_shared_secret(capsys, monkeypatch):
    monkeypatch.delenv("DISTTRAIN_SECRET", raising=False)
    code, text = run_cli(capsys, "run", "--nnodes", "2", "--master-addr", "127.0.0.1",
                         "--workers", "3", "--servers", "1", str(SCRIPTS / "fail_rank.py"))
    assert code == 2 and "same DISTTRAIN_SECRET on every node" in text
    monkeypatch.setenv("DISTTRAIN_SECRET", "short")
    code, text = run_cli(capsys, "run", "--nproc", "1", str(SCRIPTS / "fail_rank.py"))
    assert code == 2 and "DISTTRAIN_SECRET has 5 characters" in text


@pytest.mark.timeout(30)
def test_busy_master_port_is_a_clear_error(capsys):
    """An explicit --master-port that is taken fails fast, naming the address (no rank starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = str(sock.getsockname()[1])
        code, text = run_cli(capsys, "run", "--master-addr", "127.0.0.1", "--master-port", port,
                             str(SCRIPTS / "fail_rank.py"))
    assert code == 1 and f"the nodes could not meet at 127.0.0.1:{port}" in text, text
    assert "--master-port is free on node 0" in text


@pytest.mark.timeout(30)
def test_version_and_help(capsys):
    from disttrain import __version__

    assert run_cli(capsys, "--version") == (0, f"disttrain {__version__}\n")
    code, text = run_cli(capsys, "--help")
    assert code == 0 and "run" in text
    code, text = run_cli(capsys, "run", "--help")
    assert code == 0 and "--workers" in text and "--max-restarts" in text and "DISTTRAIN_SECRET" in text
    code, text = run_cli(capsys)
    assert code == 2 and "COMMAND" in text
