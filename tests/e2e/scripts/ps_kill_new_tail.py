"""A replicas=2 job whose new tail is SIGKILLed while keys move to it (run per rank).

2 workers, 3 servers (ranks 2..4), Sync. At head version 2 the tail T of server 0's keys
whose chain is [0, T] starts sending their state to the third server Y (ps/transfer.py);
Y SIGKILLs itself on the first transfer frame. Every other rank prints what stopped it
(`stopped: ...`) and exits 1, or `finished` and exits 0.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

import disttrain
from disttrain import ps
from disttrain.ps import transfer
from disttrain.ps.placement import plan_keys
from disttrain.ps.replica import Replicas
from disttrain.ps.server import PSError, Server
from disttrain.ps.transport import job_secret

W, S, R, TIMEOUT, CHUNK = 2, 3, 2, 2.0, 64


def opt(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


disttrain.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
plan = plan_keys([(n, p.numel(), p.element_size()) for n, p in model.named_parameters()], S,
                 chunk_bytes=CHUNK)
chains = {c.key: [int(s.removeprefix("server")) for s in plan.chain(c.key, R)] for c in plan[0]}
tail = max({1, 2}, key=lambda t: sum(ch[-1] == t for ch in chains.values()))
keys, new = [k for k, ch in chains.items() if ch[-1] == tail], 3 - tail
store = dist.distributed_c10d._get_default_store()
try:
    if disttrain.role() == "server":
        index, init, secret = disttrain.rank() - W, dict(model.named_parameters()), job_secret()
        print(f"server {index}: moving {len(keys)} keys from server {tail} to server {new}",
              flush=True)
        server = Server(index, plan[index], init, ps.Sync(), opt, list(range(W)), secret,
                        timeout=TIMEOUT, chunk_bytes=CHUNK)
        store.set(f"disttrain/kt/addr{index}", server.address)
        addr = {j: store.get(f"disttrain/kt/addr{j}").decode() for j in range(S)}
        server.chain = Replicas(index, W, plan, R, init, opt, server.policy, server.ep, secret,
                                timeout=TIMEOUT, chunk_bytes=CHUNK)
        server.chain.connect({j: a for j, a in addr.items() if j != index})
        kw = dict(replicas=R, secret=secret, chunk_bytes=CHUNK)
        if index == tail:
            transfer.extend(server, plan, init, opt, keys, new, addr[new], at_version=2, **kw)
        elif index == new:
            transfer.accept(server, plan, init, opt, tail, keys, **kw)
            server.chain.intake = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
        server.serve()
    else:
        conn = ps.attach(model, ps.Sync(), timeout=TIMEOUT, chunk_bytes=CHUNK, name="kt",
                         replicas=R, manager="")
        x, y = torch.randn(8, 8), torch.randn(8, 3)
        for _ in range(40):
            conn.pull().wait()
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            conn.push().wait()
        conn.close()
except PSError as e:
    print(f"rank {disttrain.rank()} stopped: {e}", flush=True)
    sys.exit(1)
print(f"rank {disttrain.rank()} finished", flush=True)
