"""Parameter-server training of an MLP on scikit-learn's handwritten digits, every mode.

    disttrain run --workers 2 --servers 1 examples/digits_ps.py --mode sync
    disttrain run --workers 4 --servers 2 examples/digits_ps.py --mode kbatch-sync --k 3 \
        --straggler exp:mean=0.05
    disttrain run --workers 4 --servers 1 examples/digits_ps.py --mode ssp --staleness 2
    disttrain run --workers 2 --servers 1 examples/digits_ps.py --topk 0.01
    disttrain run --workers 2 --servers 3 examples/digits_ps.py --replicas 2
    disttrain run --workers 2 --servers 2 examples/digits_ps.py --replicas 2 --kill-server-at 30
    disttrain run --workers 2 --servers 3 examples/digits_ps.py --drain-server-at 30
    disttrain run --workers 2 --servers 2 examples/digits_ps.py --add-server-at 30

One script, both roles (as ps-lite's one binary): on a server rank `ps.connect` serves
its shard until the workers are done, prints its report (staleness histogram, dropped
late gradients, lost workers) and exits; on a worker it returns the connection and the
loop below runs: pull the parameters, compute a gradient on this worker's shard of the
data, push it. Which gradients the servers apply, and when a pull is answered, is the
consistency mode (--mode). Workers sleep an injected straggler delay (--straggler)
between forward and backward; in ksync / kbatch-sync a worker whose round closed
meanwhile gets `ps.Cancelled`, drops the step and pulls the new version. With --topk R
each worker pushes only the R largest-magnitude fraction of every gradient (indices +
values) and keeps the rest for its next push (top-k with error feedback); every worker
prints the bytes it pushed per step. In the asynchronous modes the servers divide the
learning rate of a gradient by its staleness (--step, --momentum-rule choose another rule,
e.g. `--step constant` for the plain one, which the servers' report warns about).
With --replicas R every key range lives on R servers and a push is acknowledged once
every copy applied it (chain replication); each server's report names its roles.
With --replicas >= 2,
--kill-server-at STEP has worker 0 SIGKILL a server mid-run: its copies take over, the
job goes on, and under sync it ends with the same parameters as a run without the kill.
--drain-server-at STEP has worker 0 drain a server mid-run (`ps.drain`, as `disttrain ps
drain`): with --replicas 1 its keys move to the other servers while the workers train,
with --replicas >= 2 its copies take them over; then it leaves, and under sync the final
parameters are those of a run without the drain.
--add-server-at STEP has worker 0 start this script as a new server (`disttrain ps
add-server`): it takes its share of the keys while the workers train (with --replicas
>= 2 the tails copy them to it first, so every key keeps its copies).
Worker 0 ends with `final test accuracy: 0.9xxx` and a sha256 of the final parameters.
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn

import disttrain
from disttrain import ps

# -----------------------------------------------------------------------------
# config
MODES = ("sync", "ksync", "kbatch-sync", "async", "kasync", "kbatch-async", "ssp")
parser = argparse.ArgumentParser(description="Parameter-server MLP on the digits data set.")
parser.add_argument("--mode", choices=MODES, default="sync", help="consistency policy")
parser.add_argument("--k", type=int, default=None,
                    help="gradients (ksync, kasync) or minibatches (kbatch-*) per update; "
                         "default: number of workers")
parser.add_argument("--staleness", type=int, default=2, help="SSP bound s (clocks)")
parser.add_argument("--step", default=None,
                    help="async modes: lr of a stale gradient, constant or inverse-staleness "
                         "(default: the policy's, inverse-staleness)")
parser.add_argument("--momentum-rule", default=None,
                    help="async modes: the server's momentum as-given or corrected for the "
                         "implicit momentum of asynchrony (default: the policy's, as-given)")
parser.add_argument("--straggler", default="none",
                    help="delay model, e.g. exp:mean=0.05, shifted-exp:shift=0.02,mean=0.05, "
                         "fixed:rank=1,delay=0.2")
parser.add_argument("--topk", type=float, default=None, metavar="RATIO",
                    help="push only this fraction of each gradient (top-k, error feedback), "
                         "e.g. 0.01; default: dense pushes")
# NOTE: 16 epochs (~180 steps per worker with 4 workers) train every mode to convergence
# (test accuracy >= 0.93), so modes are compared at the end, not mid-way (docs/benchmarks.md)
parser.add_argument("--epochs", type=int, default=16)
parser.add_argument("--batch-size", type=int, default=32, help="samples per worker step")
parser.add_argument("--lr", type=float, default=0.05, help="server-side SGD (momentum 0.9)")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--log-json", default=None,
                    help="worker 0 appends {time, step, version, train_loss} lines here "
                         "(benchmarks)")
parser.add_argument("--eval-every", type=int, default=5, help="steps between --log-json points")
# replicated key ranges (docs/design/parameter-server.md, "Replication")
parser.add_argument("--replicas", type=int, default=1,
                    help="copies of each key range, on the owner and the next servers of the "
                         "ring (chain replication; at most --servers); default 1: none")
# server failover (docs/design/parameter-server.md, "Faults and takeover")
parser.add_argument("--kill-server-at", type=int, default=0, metavar="STEP",
                    help="worker 0 SIGKILLs a server at this step (0: never); with --replicas 2 "
                         "its copies take over and the job goes on")
parser.add_argument("--kill-server", type=int, default=0, metavar="I", help="the server to kill")
parser.add_argument("--kill-when", choices=("pushed", "acked"), default="pushed",
                    help="kill right after the step's push was sent, or once it was acknowledged")
# live membership (docs/design/parameter-server.md, "Live membership")
parser.add_argument("--drain-server-at", type=int, default=0, metavar="STEP",
                    help="worker 0 drains a server at this step (0: never): its keys move to "
                         "the other servers (--replicas >= 2: its copies take them over) while "
                         "the workers train, then it leaves")
parser.add_argument("--drain-server", type=int, default=0, metavar="I", help="the server to drain")
parser.add_argument("--add-server-at", type=int, default=0, metavar="STEP",
                    help="worker 0 starts this script as a new server at this step (0: never), "
                         "with `disttrain ps add-server`: it takes its share of the keys while "
                         "the workers train")
parser.add_argument("--step-times", default=None, metavar="PATH",
                    help="worker 0 appends {step, time} after every step here (benchmarks)")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# processes: `disttrain run --workers W --servers S` (the last S ranks are servers)
joining = ps.joining()  # the job's workers when started by `disttrain ps add-server`, else 0
if not joining:  # NOTE: a joining server has no process group (ps.connect joins the ring)
    disttrain.init()
workers = joining or disttrain.world_size() - int(disttrain.runtime.num_servers())
k = args.k or workers
rule = {n: v for n, v in (("step", args.step), ("momentum", args.momentum_rule)) if v}
policy = {"sync": lambda: ps.Sync(), "ksync": lambda: ps.KSync(k),
          "kbatch-sync": lambda: ps.KBatchSync(k), "async": lambda: ps.Async(**rule),
          "kasync": lambda: ps.KAsync(k, **rule), "kbatch-async": lambda: ps.KBatchAsync(k, **rule),
          "ssp": lambda: ps.SSP(args.staleness, **rule)}[args.mode]()
straggler = ps.Straggler.parse(args.straggler, seed=args.seed)
torch.manual_seed(args.seed)  # same init on every rank; the servers' copy is the start
store = None if joining else torch.distributed.distributed_c10d._get_default_store()
if store is not None and disttrain.role() == "server":  # NOTE: --kill-server-at: worker 0 finds the process here
    store.set(f"digits/pid{disttrain.rank() - workers}", str(os.getpid()))


def kill_server(step: int, when: str) -> None:
    """--kill-server-at: SIGKILL server --kill-server (one node: a pid in the store)."""
    if rank == 0 and step == args.kill_server_at and when == args.kill_when:
        print(f"worker 0: killing server {args.kill_server} (SIGKILL) at step {step}", flush=True)
        os.kill(int(store.get(f"digits/pid{args.kill_server}")), signal.SIGKILL)


def drain_server(step: int) -> bool:
    """--drain-server-at: ask the job's server manager to drain server --drain-server."""
    if rank == 0 and step == args.drain_server_at:
        print(f"worker 0: draining server {args.drain_server} at step {step}", flush=True)
        ps.drain(args.drain_server)
        return True
    return False

def add_server(step: int) -> subprocess.Popen | None:
    """--add-server-at: start this script as a server joining the job (one node)."""
    if rank != 0 or step != args.add_server_at:
        return None
    print(f"worker 0: adding a server at step {step}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "ps", "add-server",
                             os.environ["DISTTRAIN_PS_MANAGER"], "--workers", str(workers),
                             "--", *sys.argv])
    ps.joined(process=proc)  # NOTE: blocks while it starts (seconds): the keys move mid-run
    return proc

# -----------------------------------------------------------------------------
# model: the servers hold it in shards, the workers a working copy
model = nn.Sequential(
    nn.Linear(64, args.hidden), nn.ReLU(),
    nn.Linear(args.hidden, args.hidden), nn.ReLU(),
    nn.Linear(args.hidden, 10),
)
conn = ps.connect(model, policy,
                  optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
                  compression=ps.TopK(args.topk) if args.topk is not None else None,
                  replicas=args.replicas)
rank = disttrain.rank()  # only workers get here: 0..workers-1

# -----------------------------------------------------------------------------
# data: 1797 8x8 images, 10 classes; worker r reads its own 1/workers of the training split
digits = load_digits()
x_train, x_test, y_train, y_test = train_test_split(
    digits.data, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
scaler = StandardScaler().fit(x_train)
x_train = torch.tensor(scaler.transform(x_train), dtype=torch.float32)  # (1437, 64)
x_test = torch.tensor(scaler.transform(x_test), dtype=torch.float32)  # (360, 64)
y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
loader = disttrain.data.shard_loader(torch.utils.data.TensorDataset(x_train, y_train),
                                     args.batch_size * workers, seed=args.seed)

# -----------------------------------------------------------------------------
# training loop: pull, forward, (straggle), backward (pushes start from the grad hooks), push
log = open(args.log_json, "a") if args.log_json and rank == 0 else None
times = open(args.step_times, "a") if args.step_times and rank == 0 else None
start, step, done, added, drained = time.perf_counter(), 0, 0, None, False
for _ in range(args.epochs):
    for x, y in loader:  # (B, 64), (B,)
        conn.pull().wait()  # blocks while the policy holds this worker back (Sync, SSP)
        if log and step % args.eval_every == 0:
            with torch.no_grad():
                train_loss = F.cross_entropy(model(x_train), y_train).item()
            log.write(json.dumps({"time": time.perf_counter() - start, "step": step,
                                  "version": min(conn.versions),
                                  "train_loss": train_loss}) + "\n")
        step += 1
        model.zero_grad(set_to_none=True)
        try:
            loss = F.cross_entropy(model(x), y)
            conn.sleep(straggler.delay(rank, step))  # a slow machine, cut short on cancel
            loss.backward()
            pushed = conn.push()
            kill_server(step, "pushed")
            drained = drain_server(step) or drained
            added = add_server(step) or added
            if (added is not None or drained) and not conn.routes.routes:
                time.sleep(0.2)  # NOTE: this small model trains in seconds: the move lands mid-run
            pushed.wait()  # blocks until every server has the gradient
            kill_server(step, "acked")
            done += 1
            if times:
                times.write(json.dumps({"step": step, "time": time.perf_counter() - start}) + "\n")
        except ps.Cancelled:
            continue  # the round closed without us: drop the step, pull the new version

# -----------------------------------------------------------------------------
# evaluation on worker 0 with the servers' current parameters
conn.pull().wait()
if log:
    with torch.no_grad():
        train_loss = F.cross_entropy(model(x_train), y_train).item()
    log.write(json.dumps({"time": time.perf_counter() - start, "step": step,
                          "train_loss": train_loss}) + "\n")
    log.close()
if times:
    times.close()
stats = conn.close()
if added is not None:
    print(f"worker 0: the added server ended with {added.wait(60)}", flush=True)
pushed = conn.wire_stats()["sent_bytes"].get("push", 0)
print(f"worker {rank}: {done} steps pushed, {conn.cancelled_steps} cancelled "
      f"({conn.cancelled_in_backward} inside backward), "
      f"{pushed / max(1, conn.pushes):.0f} bytes pushed per step", flush=True)
if rank == 0:
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    print(f"final test accuracy: {accuracy:.4f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"final parameters sha256 {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}",
          flush=True)
disttrain.shutdown()
