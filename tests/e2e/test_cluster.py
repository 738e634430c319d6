"""`disttrain cluster` on real namespaces: up, traffic between nodes, down, nothing left.

Runs as root (CI does); skipped, saying why, where this machine cannot make namespaces.
The CLI is run as `python -m disttrain.cluster`, which is `disttrain cluster`, for every
`up` and for the first test's first `down`; `show`, `list` and the other `down`s run the
same `disttrain.cli.main` in this process (each launch imports torch: ~2 s of suite time).
"""

import os
import subprocess
import sys
import uuid

import pytest

from disttrain import cli, settings
from disttrain.cluster import net

ROOT_CAPS = os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0
pytestmark = pytest.mark.skipif(not ROOT_CAPS, reason="needs root and iproute2 to make network namespaces")

ECHO = ("import socket,sys\n"
        "s=socket.socket();s.bind((sys.argv[1],5099));s.listen(1);print('ready',flush=True)\n"
        "c,_=s.accept();c.sendall(c.recv(64)[::-1])\n")
ASK = ("import socket,sys,time\n"
       "for _ in range(100):\n"
       "    try: c=socket.create_connection((sys.argv[1],5099),timeout=5);break\n"
       "    except OSError: time.sleep(0.05)\n"
       "c.sendall(b'ping');print(c.recv(64).decode())\n")


def cluster(*args, env=None):
    return subprocess.run([sys.executable, "-m", "disttrain.cluster", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def here(capsys, *args):
    """`disttrain cluster ARGS` in this process: (exit code, stdout, stderr)."""
    settings.refresh()  # NOTE: reads the DISTTRAIN_CLUSTER_DIR the `name` fixture set
    code = cli.main(["cluster", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def name(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTTRAIN_CLUSTER_DIR", str(tmp_path))
    n = "t" + uuid.uuid4().hex[:8]
    yield n
    settings.refresh()  # NOTE: reads the DISTTRAIN_CLUSTER_DIR set above
    net.down(n)  # in-process (no torch import): the tests run the CLI's own `down` themselves


def talk(name, src, dst, addr):
    """Send 'ping' from node src to an echo server on node dst; returns the reply."""
    srv = subprocess.Popen(["ip", "netns", "exec", f"dt-{name}-n{dst}", sys.executable, "-c", ECHO, addr],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "ready"
        out = subprocess.run(["ip", "netns", "exec", f"dt-{name}-n{src}", sys.executable, "-c", ASK, addr],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()
    finally:
        srv.kill()
        srv.wait()


def leftovers(name):
    cg = [d for d in os.listdir("/sys/fs/cgroup/cpu") if d.startswith(f"dt-{name}-")]
    return net.leftover_namespaces(name) + cg


def test_a_two_node_switch_cluster_comes_up_carries_traffic_and_leaves_nothing(name, capsys):
    up = cluster("up", name, "--nodes", "2", "--link", "1gbit")
    assert up.returncode == 0, up.stderr
    assert "10.213." in up.stdout and f"dt-{name}-n1" in up.stdout
    code, show, _ = here(capsys, "show", name)
    assert code == 0, show
    addr1 = show.split("n1  ")[1].split()[0]
    assert talk(name, 0, 1, addr1) == "gnip"
    assert name in here(capsys, "list")[1]
    assert cluster("down", name).returncode == 0
    assert leftovers(name) == [] and name not in here(capsys, "list")[1]
    code, again, _ = here(capsys, "down", name)
    assert code == 0 and "nothing to remove" in again


def test_a_four_node_ring_forwards_through_the_nodes_between_and_has_cpu_quotas(name, capsys):
    up = cluster("up", name, "--nodes", "4", "--link", "1gbit", "--topology", "ring",
                 "--cpus-per-node", "0.5")
    assert up.returncode == 0, up.stderr
    addr2 = here(capsys, "show", name)[1].split("n2  ")[1].split()[0]
    assert talk(name, 0, 2, addr2) == "gnip"  # two hops: n0 -> n1 -> n2
    with open(f"/sys/fs/cgroup/cpu/dt-{name}-n3/cpu.cfs_quota_us") as f:
        assert int(f.read()) == 5_000  # 0.5 x the 10 ms period
    assert here(capsys, "down", name)[0] == 0
    assert leftovers(name) == []


def test_down_cleans_what_a_crashed_up_left(name, capsys):
    subprocess.run(["ip", "netns", "add", f"dt-{name}-n0"], check=True)
    os.makedirs(f"/sys/fs/cgroup/cpu/dt-{name}-n0", exist_ok=True)
    assert "leftover namespace" in here(capsys, "list")[1]
    refused = cluster("up", name, "--nodes", "2", "--link", "1gbit")
    assert refused.returncode == 1 and f"disttrain cluster down {name}" in refused.stderr
    assert here(capsys, "down", name)[0] == 0
    assert leftovers(name) == []


def test_without_cap_net_admin_up_says_what_is_missing_and_makes_nothing(name):
    out = cluster("up", name, "--nodes", "2", "--link", "1gbit", env={"DISTTRAIN_CLUSTER_NO_CAPS": "1"})
    assert out.returncode == 1
    assert "lacks CAP_NET_ADMIN" in out.stderr and "--cap-add NET_ADMIN" in out.stderr
    assert leftovers(name) == []
