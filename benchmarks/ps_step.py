"""A parameter server's update over many small keys: key by key against runs (ps/runs.py).

Times `Server._apply` (average the pushes' gradients, one optimizer step, one thread; wall
and, in brackets, the thread's CPU time, which a loaded machine disturbs less) of a
real `Server` (its sockets bound, no workers) over the digits MLP's keys, for the server
stepping key by key (`StaleStep(runs=False)`, as before runs.py) and run by run (the
default), interleaved in blocks of 10 updates in one process so both see the same load:

- "server0 of 2": server0's keys when the model is placed on 2 servers (placement.py);
- "whole, 1 server": the 6 whole tensors one server holds;
- "all keys": every key of the 2-server plan on one server: the bytes of the whole
  tensors, cut into many keys (so the ratio to the row above is the cost of the keys).

Also the GPT example's model on 2 servers (server0, fewer bigger keys), with 1 push and 2
pushes per update (Sync with 2 workers averages two), SGD momentum 0.9 and Adam:

    python benchmarks/ps_step.py --reps 400
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from disttrain.models import GPT, GPTConfig
from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.server import Server
from disttrain.ps.staleness import StaleStep

BLOCK = 10  # updates in a row of one kind: call by call, each would run in the caches the
# other left (key by key touches many objects; runs measured 2.5x slower after it)
OPTIMIZERS = {"SGD m=0.9": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "Adam": lambda p: torch.optim.Adam(p, lr=1e-3)}


def models() -> dict[str, dict[str, torch.Tensor]]:
    """name -> its parameters: the models benchmarks/ps_placement.py places (seeded)."""
    nn = torch.nn
    torch.manual_seed(0)
    digits = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                           nn.Linear(64, 10))
    gpt = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64,
                        tie_embeddings=False))
    return {name: {n: p.detach() for n, p in m.named_parameters()}
            for name, m in (("digits MLP", digits), ("GPT example", gpt))}


def cases(init: dict) -> dict[str, list]:
    """case -> the keys (placement Chunks) one server holds."""
    params = [(n, t.numel(), t.element_size()) for n, t in init.items()]
    two = plan_keys(params, 2)
    return {"server0 of 2": two[0], "whole, 1 server": plan_keys(params, 1)[0],
            "all keys": two[0] + two[1]}


def timer(chunks, init, make, pushes: int, runs: bool):
    """A server over `chunks` and a function that times one update (seconds)."""
    server = Server(0, chunks, init, Sync(), make, [0], bytes(32))
    if not runs:  # NOTE: as before runs.py: every key its own memory, stepped alone
        for p in server.params.values():
            p.data = p.data.clone()
        server.stepper = StaleStep(server.optimizer, Sync().rule, runs=False)
    g = torch.Generator().manual_seed(1)
    grads = [{c.key: torch.randn(c.numel, generator=g) for c in chunks} for _ in range(pushes)]

    def once() -> tuple[float, float]:
        w, c = time.perf_counter(), time.thread_time()
        server._apply(grads, [0] * pushes)
        return time.perf_counter() - w, time.thread_time() - c
    return server, once


def measure(chunks, init, make, pushes: int, reps: int) -> dict:
    """Median us (wall, thread CPU) of one update, key by key and run by run, interleaved."""
    before, t_before = timer(chunks, init, make, pushes, runs=False)
    after, t_after = timer(chunks, init, make, pushes, runs=True)
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    try:
        for i in range(reps // BLOCK + 2):
            for runs, f in ((False, t_before), (True, t_after)) if i % 2 else (
                    (True, t_after), (False, t_before)):
                block = [f() for _ in range(BLOCK)]
                if i >= 2:  # NOTE: the first steps make the optimizer's state
                    times[runs] += block
    finally:
        before.close()
        after.close()
    return {(runs, kind): statistics.median(t[kind] for t in ts) * 1e6
            for runs, ts in times.items() for kind in (0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | case | keys | bytes | optimizer | pushes | key by key, us (CPU) "
          "| runs, us (CPU) | key by key / runs (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, init in models().items():
        for case, chunks in cases(init).items():
            if name != "digits MLP" and case != "server0 of 2":
                continue
            nbytes = sum(c.numel * 4 for c in chunks)
            for opt, make in OPTIMIZERS.items():
                for pushes in (1, 2):
                    m = measure(chunks, init, make, pushes, args.reps)
                    print(f"| {name} | {case} | {len(chunks)} | {nbytes:,} | {opt} | {pushes} "
                          f"| {m[False, 0]:.0f} ({m[False, 1]:.0f}) | {m[True, 0]:.0f} "
                          f"({m[True, 1]:.0f}) | {m[False, 0] / m[True, 0]:.2f}x "
                          f"({m[False, 1] / m[True, 1]:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
