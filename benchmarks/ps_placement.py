"""Where a parameter server's bytes go: the key plan before and after bounded loads.

Prints, for the digits MLP (examples/digits_ps.py) and the GPT example's model
(examples/gpt_char.py defaults), keys and bytes per server under the old plan (whole
tensors under 4 MB hashed one by one on the ring) and under placement.py (tensors cut
into small equal ranges, bounded loads at 1.25x the mean), then, for S = 2..16, the
worst load against the mean and the worst share of bytes moved by adding or removing
one server (in units of 1/S). Pure computation, no processes:

    python benchmarks/ps_placement.py --servers 4

With `--cost`, also what finer keys cost: bytes per push of the digits MLP (2 workers,
Sync, 5 pushes; dense and top-k 1%) on 1 server (whole tensors) and on 2 (cut into keys),
measured by `Worker.wire_stats()` on real processes, and the median time of one
SGD-momentum step over server0's keys (one thread) in each case.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

import torch

import disttrain
from disttrain import ps
from disttrain.models import GPT, GPTConfig
from disttrain.ps.placement import place
from disttrain.ps.ring import HashRing, chunk_tensor
from disttrain.testing import spawn


def _shapes(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    return [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]


def models() -> dict[str, list[tuple[str, int, int]]]:
    nn = torch.nn
    digits = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                           nn.Linear(64, 10))
    gpt = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64,
                        tie_embeddings=False))
    return {"digits MLP": _shapes(digits), "GPT example": _shapes(gpt)}


def old_plan(params, servers: int) -> dict[str, tuple[int, int]]:
    """server -> (keys, bytes) under whole tensors hashed one by one (the plan before)."""
    ring = HashRing([f"server{i}" for i in range(servers)])
    out = {s: (0, 0) for s in ring.servers}
    for name, numel, size in params:
        for c in chunk_tensor(name, numel, size):
            k, b = out[ring.owner(c.key)]
            out[ring.owner(c.key)] = (k + 1, b + c.numel * size)
    return out


def table(name: str, params, servers: int) -> None:
    total = sum(n * e for _, n, e in params)
    new = place(params, [f"server{i}" for i in range(servers)])
    load = new.load()
    print(f"\n{name}: {len(params)} tensors, {total} bytes, {servers} servers "
          f"(mean {total / servers:.0f} bytes)")
    print("| server | keys before | bytes before | x mean | keys after | bytes after | x mean |")
    print("|---|---|---|---|---|---|---|")
    for s, (k, b) in old_plan(params, servers).items():
        print(f"| {s} | {k} | {b} | {b * servers / total:.2f} | {len(new.keys(s))} | "
              f"{load[s]} | {load[s] * servers / total:.2f} |")


def sweep(name: str, params) -> None:
    total = sum(n * e for _, n, e in params)
    names = [f"server{i}" for i in range(17)]
    placed = {s: place(params, names[:s]) for s in range(2, 17)}
    worst_load = max(max(p.load().values()) * s / total for s, p in placed.items())
    worst_add = max(placed[s].moved_bytes(placed[s + 1]) * s / total for s in range(2, 16))
    worst_remove = max(placed[s].moved_bytes(place(params, names[:i] + names[i + 1:s])) * s
                       / total for s in range(2, 17) for i in range(s))
    print(f"{name}, S = 2..16: worst load {worst_load:.3f}x the mean; bytes moved by adding a "
          f"server at most {worst_add:.2f}/S, by removing one at most {worst_remove:.2f}/S "
          f"({len(placed[16].chunks)} keys)")


def _push_bytes() -> dict:
    """On every rank of a 2-worker job: bytes per push, dense and top-k 1% (workers)."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    out = {}
    for name, compression in (("dense", None), ("topk 1%", "topk:ratio=0.01")):
        if disttrain.role() == "server":
            out[name] = ps.serve(model, ps.Sync(), timeout=60, name=name)["keys"]
            continue
        conn = ps.attach(model, ps.Sync(), timeout=60, name=name, compression=compression)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(disttrain.rank()))
        for _ in range(5):
            conn.pull().wait()
            model.zero_grad()
            model(x).sum().backward()
            conn.push().wait()
        conn.pull().wait()  # NOTE: the last round closes with every worker's push in it
        out[name] = conn.wire_stats()["sent_bytes"]["push"] / conn.pushes
        conn.close()
    return out


def wire() -> None:
    print("\n| servers | keys | dense bytes per push | top-k 1% bytes per push |")
    print("|---|---|---|---|")
    for servers in (1, 2):
        env = {"DISTTRAIN_SERVERS": str(servers), "DISTTRAIN_SECRET": secrets.token_hex(32)}
        res = spawn(_push_bytes, 2 + servers, env=env, timeout=300)
        keys = sum(r["dense"] for r in res[2:])
        print(f"| {servers} | {keys} | {res[0]['dense']:.0f} | {res[0]['topk 1%']:.0f} |")


def step_time() -> None:
    """Median seconds of one server-side SGD step (momentum 0.9) over server0's keys."""
    torch.set_num_threads(1)
    print("\n| servers | keys on server0 | median step, us |")
    print("|---|---|---|")
    for servers in (1, 2):
        keys = place(models()["digits MLP"], [f"server{i}" for i in range(servers)]).plan()[0]
        params = [torch.nn.Parameter(torch.zeros(c.numel)) for c in keys]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            for p in params:
                p.grad = torch.ones(p.numel())
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        print(f"| {servers} | {len(keys)} | {statistics.median(times[50:]) * 1e6:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--cost", action="store_true",
                   help="also measure bytes per push and the server's step time")
    args = p.parse_args()
    for name, params in models().items():
        table(name, params, args.servers)
    print()
    for name, params in models().items():
        sweep(name, params)
    if args.cost:
        wire()
        step_time()


if __name__ == "__main__":
    main()
