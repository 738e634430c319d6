"""One rank fails while the others are busy (uses torch): `fail_in.py MODE [RANK]`.

RANK (default 1) is the rank that fails, at step 3, in the way MODE says; every other
rank goes on and ends up waiting for it. Lines the tests look for are marked `# at:NAME`.

- between:    raises between two DataParallel steps (the others wait in an all_reduce);
- backward:   raises inside DataParallel's backward (a tensor hook), buckets in flight;
- zero3:      raises in a layer's forward under ZeRO stage 3 (the others gather the next);
- pipeline:   the last stage raises in its forward (the others wait in send/recv);
- ps-worker:  a parameter-server worker raises (every rank but the last is a worker);
- ps-server:  the server's optimizer raises on its 3rd update (RANK is ignored);
- init:       raises inside disttrain.init() (a bad DISTTRAIN_TIMEOUT on that rank);
- checkpoint: raises inside Checkpointer.save (the model's state_dict fails);
- exit:       sys.exit(3);  os-exit: os._exit(5);  kill: SIGKILL;  segv: SIGSEGV;
- two:        ranks 0 and RANK raise different exceptions, RANK 0.3 s after rank 0.
"""

import ctypes
import os
import signal
import sys
import tempfile
import time

import torch
from torch import nn

import disttrain
from disttrain import ps

MODE = sys.argv[1]
BAD = int(sys.argv[2]) if len(sys.argv) > 2 else 1
RANK = int(os.environ["RANK"])
STEP = 3
now = {"step": 0}  # the training step, for hooks and layers that cannot be handed it


def fail(step: int) -> None:
    """The failure MODE names, on rank BAD at step STEP."""
    if RANK != BAD or step != STEP:
        return
    if MODE == "exit":
        sys.exit(3)  # at:exit
    if MODE == "os-exit":
        os._exit(5)
    if MODE == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "segv":
        ctypes.string_at(0)  # at:segv
    if MODE == "checkpoint":
        raise RuntimeError(f"state_dict of rank {RANK} failed")  # at:checkpoint
    if MODE == "two":
        time.sleep(0.3)
        raise KeyError(f"second failure on rank {RANK}")
    raise ValueError(f"bad batch on rank {RANK} at step {step}")  # at:raise


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def data_parallel() -> None:
    model = disttrain.DataParallel(mlp(), bucket_mb=0.0001)  # several buckets
    for step in range(100):
        x = torch.randn(4, 8)
        if MODE == "backward":
            x.requires_grad_(True)
            x.register_hook(lambda g, s=step: fail(s))  # runs last in backward
        elif MODE == "two" and RANK == 0 and step == STEP:
            raise RuntimeError("first failure on rank 0")  # at:first
        elif MODE != "backward":
            fail(step)  # at:between
        model(x).sum().backward()
        time.sleep(0.02)


def zero3() -> None:
    model = disttrain.Zero(mlp(), lambda p: torch.optim.SGD(p, lr=0.1), stage=3)
    model.module[2].register_forward_pre_hook(lambda mod, args: fail(now["step"]))  # at:zero3
    for step in range(100):
        now["step"] = step
        model(torch.randn(4, 8)).sum().backward()
        model.optimizer.step()
        model.optimizer.zero_grad()


def pipeline() -> None:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

        def pipeline_layers(self):
            return ["a", "b", "c", "d"]

        def forward(self, x):
            for name in self.pipeline_layers():
                if getattr(self, name, None) is not None:
                    if name == "d":
                        fail(now["step"])  # at:pipeline
                    x = getattr(self, name)(x)
            return x

    world = disttrain.world_size()
    mesh = disttrain.Mesh(pp=2, dp=world // 2)
    torch.manual_seed(0)
    net = Net()
    model = disttrain.parallelize(net, mesh, schedule="1f1b", microbatches=2,
                                  loss_fn=lambda out, y: ((out - y) ** 2).mean())
    for step in range(100):
        now["step"] = step
        model.train_step(torch.randn(4, 8), torch.randn(4, 8))


def param_server() -> None:
    class Failing(torch.optim.SGD):
        updates = 0

        def step(self, closure=None):
            Failing.updates += 1
            if MODE == "ps-server" and Failing.updates == STEP:
                raise FloatingPointError("server optimizer: update 3 is not finite")  # at:server
            return super().step(closure)

    model = mlp()
    conn = ps.connect(model, ps.Sync(), optimizer=lambda p: Failing(p, lr=0.1))
    for step in range(100):
        if MODE == "ps-worker":
            fail(step)  # at:worker
        conn.pull().wait()
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        conn.push().wait()
        time.sleep(0.02)
    conn.close()


def checkpoint() -> None:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = mlp()

        def forward(self, x):
            return self.body(x)

        def state_dict(self, *args, **kwargs):
            fail(STEP)
            return super().state_dict(*args, **kwargs)

    model = disttrain.DataParallel(Net())
    ckpt = disttrain.Checkpointer(tempfile.mkdtemp(prefix="fail_in-"))
    model(torch.randn(4, 8)).sum().backward()
    ckpt.save(1, model=model)


if MODE == "init" and RANK == BAD:
    os.environ["DISTTRAIN_TIMEOUT"] = "soon"  # at:init
disttrain.init()
if MODE == "pipeline":
    pipeline()
elif MODE == "zero3":
    zero3()
elif MODE.startswith("ps-"):
    param_server()
elif MODE == "checkpoint":
    checkpoint()
else:
    data_parallel()
print(f"rank {RANK} done (should not happen)", flush=True)
