"""Jobs across emulated nodes through the real `disttrain` command: `disttrain cluster up`,
`disttrain run --cluster NAME ...`, `disttrain cluster down`.

Real namespaces and shaped links; skipped, saying why, without root.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import defaultdict

import pytest
import torch

from disttrain import cli as disttrain_cli
from disttrain import settings, trace
from disttrain.cluster import net
from disttrain.trace import analysis, report

ROOT_CAPS = os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0
pytestmark = pytest.mark.skipif(not ROOT_CAPS, reason="needs root and iproute2 to make network namespaces")

DP = """
import sys, torch, disttrain
disttrain.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
model = disttrain.DataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
n, r = disttrain.world_size(), disttrain.rank()
for step in range(5):
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    y = torch.randn(16, 1, generator=g, dtype=torch.float64)
    lo, hi = r * 16 // n, (r + 1) * 16 // n      # this rank's rows of the global batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
if r == 0:
    torch.save([p.detach() for p in model.parameters()], sys.argv[1])
import datetime, os, torch.distributed as dist
if "TORCHELASTIC_RUN_ID" in os.environ:  # under `disttrain run --cluster`, not alone
    # c10d keeps the rendezvous' state under this key in node 0's store (the static one has none)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], 29500, is_master=False, timeout=datetime.timedelta(seconds=20))
    key = "torch.rendezvous." + os.environ["TORCHELASTIC_RUN_ID"]
    print(f"rank {r} of {n} on {os.environ['DISTTRAIN_CLUSTER_NODE']} (group rank {os.environ['GROUP_RANK']}); "
          f"{key} in the store: {store.check([key])}", flush=True)
disttrain.shutdown()
"""

PS = """
import torch, disttrain
from disttrain import ps
disttrain.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
conn = ps.connect(model, ps.Sync(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
x, y = torch.randn(8, 4), torch.randn(8, 1)
for step in range(5):                  # the README's loop
    conn.pull().wait()
    model.zero_grad()
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        conn.push().wait()
    except ps.Cancelled:
        continue
conn.close()
print(f"worker {disttrain.rank()} done", flush=True)
disttrain.shutdown()
"""

SLEEP = """
import os, sys, time, disttrain
disttrain.init()
with open(sys.argv[1] + f".{disttrain.rank()}", "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


RAISE = """
import disttrain, torch
disttrain.init()
if disttrain.rank() == 1:
    raise ValueError("bad batch on rank 1")
disttrain.comm.all_reduce(torch.ones(4))
"""

HANG = """
import time, disttrain, torch
disttrain.init()
if disttrain.rank() == 1:
    time.sleep(120)                      # never joins the all_reduce
disttrain.comm.all_reduce(torch.ones(4))
"""

DISTTRAIN = shutil.which("disttrain", path=os.path.dirname(sys.executable)) or "disttrain"


def cli(*args, **kw):
    """`disttrain cluster ARGS`, the installed command."""
    return run_cli("cluster", *args, **kw)


def run_cli(*args, **kw):
    return subprocess.run([DISTTRAIN, *args], capture_output=True, text=True,
                          timeout=kw.pop("timeout", 120), **kw)


def here(*args) -> tuple[int, str]:
    """`disttrain cluster ARGS` in this process (no torch import): (exit code, stdout)."""
    settings.refresh()  # NOTE: reads the DISTTRAIN_CLUSTER_DIR two_nodes set
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = disttrain_cli.main(["cluster", *args])
    return code, out.getvalue()


def two_nodes(folder):
    """Bring up a 2-node switch cluster at 1 Gbit/s; yield its name; take it down, check nothing is left.

    `up` is the installed command; the closing `down` and `list` run in this process (each
    launch imports torch: seconds). test_down_after_a_sigkilled_job... runs the command's `down`."""
    saved = os.environ.get("DISTTRAIN_CLUSTER_DIR")
    os.environ["DISTTRAIN_CLUSTER_DIR"] = str(folder)
    name, down = "r" + uuid.uuid4().hex[:8], None
    try:
        up = cli("up", name, "--nodes", "2", "--link", "1gbit")
        assert up.returncode == 0, up.stderr
        yield name
        down, said = here("down", name)
        assert down == 0, said
        assert net.leftover_namespaces(name) == []
        assert name not in here("list")[1]
    finally:
        if down != 0:
            here("down", name)
        if saved is None:
            os.environ.pop("DISTTRAIN_CLUSTER_DIR")
        else:
            os.environ["DISTTRAIN_CLUSTER_DIR"] = saved
        settings.refresh()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the jobs that leave it as they found it (quotas: test_cluster.py)."""
    yield from two_nodes(tmp_path_factory.mktemp("clusters"))


@pytest.fixture
def own_cluster(tmp_path):
    yield from two_nodes(tmp_path / "clusters")


def script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(scope="module")
def dp_job(cluster, tmp_path_factory):
    """The data-parallel job on both nodes, traced: (its result, its folder)."""
    folder = tmp_path_factory.mktemp("dp")
    dp = script(folder, "dp.py", DP)
    job = run_cli("run", "--cluster", cluster, "--nproc-per-node", "1", "--trace", str(folder / "trace"),
                  dp, str(folder / "two.pt"))
    return job, folder


def test_data_parallel_across_two_nodes_equals_one_process(cluster, dp_job, tmp_path):
    job, folder = dp_job
    alone = subprocess.run([sys.executable, str(folder / "dp.py"), str(tmp_path / "one.pt")], capture_output=True,
                           text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert alone.returncode == 0, alone.stderr
    assert job.returncode == 0, job.stdout + job.stderr
    # met through c10d (its state in node 0's store, under this job's own run id); node i holds rank i
    key = f"torch.rendezvous.{cluster}-"
    assert f"[n0] rank 0 of 2 on 0 (group rank 0); {key}" in job.stdout, job.stdout
    assert f"[n1] [rank1]: rank 1 of 2 on 1 (group rank 1); {key}" in job.stdout, job.stdout
    assert job.stdout.count(" in the store: True") == 2
    for a, b in zip(torch.load(tmp_path / "one.pt"), torch.load(folder / "two.pt")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_trace_across_nodes_is_one_aligned_timeline_with_nodes_and_the_link(dp_job):
    job, folder = dp_job
    assert job.returncode == 0, job.stdout + job.stderr
    out = folder / "trace"
    assert "[n0] disttrain trace: clocks of 2 ranks aligned to rank 0" in job.stdout
    assert "disttrain run --cluster: trace of 2 processes" in job.stdout and str(out / "trace.json") in job.stdout
    run = analysis.load(str(out))
    tr = json.loads((out / "trace.json").read_text())
    assert trace.problems(tr) == []
    assert analysis.nodes(run) == {0: 0, 1: 1} and run["other"]["link_gbps"] == 1.0
    spans = defaultdict(dict)  # the same all_reduce, one span per rank, on the two nodes' clocks
    for e in run["events"]:
        if e["ph"] == "X" and e["cat"] == "comm" and e["name"] == "all_reduce":
            spans[(e["args"]["group"], e["args"]["seq"])][e["pid"]] = (e["ts"], e["ts"] + e["dur"])
    err = run["other"]["max_clock_error_us"]
    assert len(spans) == 5 and all(len(s) == 2 for s in spans.values()), spans  # a bucket per step
    for call, s in spans.items():
        assert max(a for a, _ in s.values()) <= min(b for _, b in s.values()) + err, (call, s)
    (row,) = [r for r in analysis.collectives(run["events"], run["other"]) if r["op"] == "all_reduce"]
    assert row["crosses_nodes"] and row["bus_gbps"] > 0 and row["link_share"] == pytest.approx(row["bus_gbps"] / 1.0)
    # the report's tables (the page itself: test_trace_report.py) name each rank's node and the link
    assert "<td>1</td><td>n1</td>" in report._table(analysis.summarize(run), analysis.nodes(run))
    assert "of the 1 Gbit/s link" in report._comm_table(run["events"], run["other"])
    assert sorted({(m["rank"], m["step"]) for m in run["metrics"]}) == [(r, s) for r in (0, 1) for s in range(5)]


def test_parameter_servers_on_one_node_serve_workers_on_the_other(cluster, tmp_path):
    job = run_cli("run", "--cluster", cluster, "--workers", "2", "--servers", "2", "--trace",
                  str(tmp_path / "trace"), script(tmp_path, "ps.py", PS))
    assert job.returncode == 0, job.stdout + job.stderr
    assert "[n0] worker 0 done" in job.stdout and "[n0] [rank1]: worker 1 done" in job.stdout
    # the servers traced on their node too: one timeline of all four processes
    tr = json.loads((tmp_path / "trace" / "trace.json").read_text())
    assert trace.problems(tr) == []
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 on n0", "rank 1 on n0", "rank 2 (server) on n1", "rank 3 (server) on n1"}
    assert {e["pid"] for e in tr["traceEvents"] if e["name"] == "ps server stats"} == {2, 3}


def test_a_rank_raising_on_node_1_is_reported_first_and_the_job_exits_1(cluster, tmp_path):
    job = run_cli("run", "--cluster", cluster, "--nproc-per-node", "1", script(tmp_path, "bad.py", RAISE))
    assert job.returncode == 1, job.stdout + job.stderr
    lines = [line for line in job.stdout.splitlines() if "meeting the other nodes" not in line]
    report = [i for i, line in enumerate(lines) if "disttrain run" in line]
    assert lines[report[0]].startswith("[n1] disttrain run: rank 1 raised an exception (pid ")
    assert lines[report[0] + 1] == "[n1] [rank1]: Traceback (most recent call last):"
    assert "[n1] [rank1]: ValueError: bad batch on rank 1" in lines[report[0]:report[1]]
    assert lines[report[-1]].startswith("disttrain run --cluster: node n0 failed too: ")


def test_a_hang_across_nodes_gives_one_report_with_every_nodes_ranks_and_exits_124(cluster, tmp_path):
    job = run_cli("run", "--cluster", cluster, "--nproc-per-node", "1", "--timeout", "5",
                  script(tmp_path, "hang.py", HANG))
    assert job.returncode == 124, job.stdout + job.stderr
    assert job.stdout.count("a collective timed out") == 1
    assert "[n0]   all_reduce #1 (hang.py:6) on world (ranks 0-1): rank 0 waited; missing: rank 1" in job.stdout
    # rank 1 ran on the other node: its stack comes from there (SIGTERM, then its dump)
    assert '[rank1]:   File "' + str(tmp_path / "hang.py") + '", line 5, in <module>' in job.stdout


def test_down_after_a_sigkilled_job_kills_its_ranks_and_leaves_nothing(own_cluster, tmp_path):
    cluster = own_cluster
    pidfile = str(tmp_path / "pid")
    job = subprocess.Popen([DISTTRAIN, "run", "--cluster", cluster, "--nproc-per-node",
                            "1", script(tmp_path, "sleep.py", SLEEP), pidfile],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{pidfile}.{r}") for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    job.send_signal(signal.SIGKILL)
    job.wait()
    pids = [int(open(f"{pidfile}.{r}").read()) for r in (0, 1)]
    assert all(net.alive(p) for p in pids)  # orphaned in their namespaces
    assert cli("down", cluster).returncode == 0
    assert not any(net.alive(p) for p in pids)
    assert net.leftover_namespaces(cluster) == []
    assert not any(d.startswith(f"dt-{cluster}-") for d in os.listdir("/sys/fs/cgroup/cpu"))
