"""A parameter-server job (replicas=1) one of whose servers is drained mid-run (disttrain run).

argv: mode ("sync" or "count", as scripts/ps_failover.py; "count-ssp": "count" under
SSP(2)), drain step (0: none), server
to drain, when ("pushed": right after the step's push was sent, before its ack;
"acked": once it was acknowledged). Worker 0 asks the job's server manager to drain the
server (`ps.drain`): its keys move to the others while both workers train on, then it
leaves. Worker 0 prints the final parameters' digest (sync) or each push's apply count
(count); `reference()` is the single-process Sync digest of these STEPS.
"""

import sys
import time

import ps_failover as base
import torch

# NOTE: more steps than the kill's script, and worker 0 paced while the keys move, so the
# drain (heartbeats of 1 s apart) lands mid-run, not after the last step
STEPS = base.STEPS = 30
WORKERS, build, digest, gradient, reference = (base.WORKERS, base.build, base.digest,
                                               base.gradient, base.reference)
PACE = 0.25  # worker 0's pause per step from the drain until it re-routed


def main(mode: str, drain_at: int, victim: int, when: str) -> None:
    import disttrain
    from disttrain import ps

    torch.set_num_threads(1)
    disttrain.init()
    store = torch.distributed.distributed_c10d._get_default_store()
    policy = {"sync": ps.Sync(), "count": ps.Async(step="constant"),
              "count-ssp": ps.SSP(2, step="constant")}[mode]
    mode = "count" if mode.startswith("count") else mode
    model = build(mode)
    if mode == "sync":
        opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    else:
        opt = lambda p: torch.optim.SGD(p, lr=1.0)  # noqa: E731
    conn = ps.connect(model, policy, optimizer=opt)  # servers exit here
    rank = disttrain.rank()
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        conn.pull().wait()
        gradient(model, mode, rank, gen, step)
        handle = conn.push()
        if rank == 0 and step == drain_at and when == "pushed":
            print(f"worker 0: draining server {victim} at step {step}", flush=True)
            ps.drain(victim)
        handle.wait()
        if rank == 0 and step == drain_at and when == "acked":
            print(f"worker 0: draining server {victim} at step {step}", flush=True)
            ps.drain(victim)
        if rank == 0 and drain_at and step >= drain_at and victim not in conn.routes.routes:
            time.sleep(PACE)
    base.finish(conn, model, store, "drain", mode, rank)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
