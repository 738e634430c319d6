"""A parameter-server job that a server joins mid-run (disttrain run).

argv: mode ("sync" or "count", as scripts/ps_failover.py; "count-ssp", "count-ksync",
"count-kbatch": "count" under SSP(2), KSync(1), KBatchSync(2)), join step (0: none),
replicas (default 1). At
that step, right after its push was sent, worker 0 starts this script again as a joining server
(`disttrain ps add-server ADDR --workers 2 -- ps_join.py ARGS`, as a user would): it
takes its share of the keys while both workers train on, and worker 0 waits for it at the
end. Worker 0 prints the final parameters' digest (sync) or each push's apply count
(count); `reference()` is the single-process Sync digest of these STEPS.
"""

import os
import subprocess
import sys
import time

import ps_failover as base
import torch

STEPS = base.STEPS = 30
WORKERS, build, gradient, reference = base.WORKERS, base.build, base.gradient, base.reference
PACE = 0.5  # worker 0's pause per step from the join until every giver re-routed


def givers(model: torch.nn.Module, servers: int) -> set[int]:
    """The old servers that give keys to server `servers` when it joins (join_moves.py)."""
    from disttrain.ps.join_moves import joined_owners
    from disttrain.ps.placement import plan_keys
    spec = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    plan = plan_keys(spec, servers)
    return {x for x in range(servers) if servers in joined_owners(
        spec, servers, servers, x, [c.key for c in plan[x]], 4 << 20).values()}


def print_chains(model: torch.nn.Module, servers: int, replicas: int) -> None:
    """Worker 0, once the joiner serves: the manager's status reply (what `disttrain ps
    status` prints) as `status chains {key: [server, chain]}` once it lists the joiner at
    the head of every moved key (asked every 0.2 s, at most 30 s: then what it lists), and
    the chains join_chains.py computes as `chains after {key: chain}`."""
    import json

    from disttrain.ps.join_chains import chains_after, join_moves
    from disttrain.ps.manager_link import ManagerLink, status_party
    from disttrain.ps.placement import plan_keys
    spec = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    plan = plan_keys(spec, servers)
    moves = join_moves(spec, plan, servers, replicas, 4 << 20)
    link = ManagerLink(os.environ["DISTTRAIN_PS_MANAGER"], status_party())
    end = time.monotonic() + 30
    while True:
        state = link.request("status").meta
        listed = {r["key"]: [r["server"], r["chain"]] for r in state["shard"]}
        if all(listed.get(m.key, [None])[0] == servers for m in moves) or time.monotonic() > end:
            break
        time.sleep(0.2)
    link.close()
    print(f"worker 0: status at ring version {state['version']}: status chains "
          f"{json.dumps(listed, sort_keys=True)} ({len(state['shard'])} rows)", flush=True)
    after = chains_after(plan, replicas, moves)
    print(f"worker 0: chains after {json.dumps(after, sort_keys=True)}", flush=True)


def policy(mode: str):
    """(policy, optimizer) of `mode`: Sync with momentum, else lr 1 and a constant step."""
    from disttrain import ps

    if mode == "sync":
        return ps.Sync(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)
    chosen = {"count": lambda: ps.Async(step="constant"),
              "count-ssp": lambda: ps.SSP(2, step="constant"), "count-ksync": lambda: ps.KSync(1),
              "count-kbatch": lambda: ps.KBatchSync(2)}
    return chosen[mode](), lambda p: torch.optim.SGD(p, lr=1.0)


def main(mode: str, add_at: int, replicas: int = 1) -> None:
    import disttrain
    from disttrain import ps

    torch.set_num_threads(1)
    if not ps.joining():  # NOTE: the joining server has no process group
        disttrain.init()
    chosen, opt = policy(mode)
    mode = "count" if mode.startswith("count") else mode
    model = build(mode)
    # servers (the joining one too) exit here
    conn = ps.connect(model, chosen, optimizer=opt, replicas=replicas)
    store = torch.distributed.distributed_c10d._get_default_store()
    rank, servers = disttrain.rank(), disttrain.world_size() - WORKERS
    give = givers(model, servers) if rank == 0 else set()
    gen = torch.Generator().manual_seed(rank)
    added = None
    for step in range(1, STEPS + 1):
        conn.pull().wait()
        gradient(model, mode, rank, gen, step)
        try:
            handle = conn.push()
        except ps.Cancelled:  # NOTE: KSync: the round closed without this step; it is dropped
            handle = None
        if rank == 0 and step == add_at:
            print(f"worker 0: adding server {servers} at step {step}", flush=True)
            added = subprocess.Popen([sys.executable, "-m", "disttrain", "ps", "add-server",
                                      os.environ["DISTTRAIN_PS_MANAGER"], "--workers",
                                      str(WORKERS), "--", *sys.argv])
            ps.joined()  # NOTE: its process starts in seconds; the job waits for its join
        if handle is not None:
            handle.wait()
        if added is not None and not give <= set(conn.routes.routes):
            time.sleep(PACE)
    if added is not None:
        print_chains(model, servers, replicas)
    base.finish(conn, model, store, "join", mode, rank)
    if added is not None:
        print(f"worker 0: the added server ended with {added.wait(60)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:4]))
