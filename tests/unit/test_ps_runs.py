"""A server's step over many keys as runs (ps/runs.py): bitwise what stepping the keys one
by one gives (the reference is a plain torch optimizer over separate per-key tensors,
which is how the server stepped before), with far fewer torch calls."""

import random

import pytest
import torch

from disttrain.ps.placement import plan_keys
from disttrain.ps.policy import Sync
from disttrain.ps.server import Server
from disttrain.ps.staleness import StaleStep, UpdateRule

SECRET = bytes(32)
F = [torch.float32, torch.float64]
OPTIMIZERS = [  # (factory, dtypes)
    (lambda p: torch.optim.SGD(p, lr=0.1), F),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), F + [torch.bfloat16]),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3), F),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.2, maximize=True), F),
    (lambda p: torch.optim.SGD([{"params": p[:2], "lr": 0.3}, {"params": p[2:]}], lr=0.1,
                               momentum=0.5), F),
    (lambda p: torch.optim.Adam(p, lr=1e-2), F + [torch.bfloat16]),
    (lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-2), F),
    (lambda p: torch.optim.AdamW(p, lr=1e-2), F),
]


def _reference_step(opt, params, grads, staleness, rule):
    """The server's update before runs.py: per key the mean of its scaled gradients, one
    optimizer.step() over the separate per-key tensors at lr x the lr factor."""
    sgd = isinstance(opt, torch.optim.SGD)
    scales = [rule.scale(s) if sgd else 1.0 for s in staleness]
    for i, p in enumerate(params):
        gs = [g[i].to(p.dtype) for g in grads]
        if len(gs) == 1 and scales[0] == 1.0:
            p.grad = gs[0]
        else:
            p.grad = gs[0] * scales[0]
            for g, s in zip(gs[1:], scales[1:]):
                p.grad.add_(g, alpha=s)
            p.grad.div_(len(gs))
    factor = 1.0 if sgd else sum(rule.scale(s) for s in staleness) / len(staleness)
    saved = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = g["lr"] * factor if factor != 1.0 else g["lr"]
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, saved):
        g["lr"] = lr


def _assert_same(ref_opt, ref, opt, params):
    for x, y in zip(ref, params):
        assert torch.equal(x, y), (x.dtype, x.numel())
        assert ref_opt.state[x].keys() == opt.state[y].keys()
        for name, v in ref_opt.state[x].items():
            assert torch.equal(v, opt.state[y][name]), name


@pytest.mark.parametrize("case", range(len(OPTIMIZERS)))
def test_runs_step_bitwise_as_the_keys_one_by_one(case):
    """Random key sizes and dtypes, whole steps and runs of a few keys (an Async chunk, a
    replica batch), 1-3 pushes of random staleness under both step rules."""
    make, dtypes = OPTIMIZERS[case]
    for seed, rule in [(0, UpdateRule()), (1, UpdateRule("inverse-staleness")),
                       (2, UpdateRule("inverse-staleness"))]:
        rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
        sizes = [rnd.choice([1, 3, 16, 17, 64, 100, 257]) for _ in range(rnd.randint(4, 24))]
        dts = [rnd.choice(dtypes) for _ in sizes]
        init = [torch.randn(n, generator=g).to(d) for n, d in zip(sizes, dts)]
        ref = [torch.nn.Parameter(t.clone()) for t in init]
        params = [torch.nn.Parameter(t.clone()) for t in init]
        ref_opt, opt = make(ref), make(params)
        step = StaleStep(opt, rule)
        assert step.runs is not None
        for _ in range(6):
            a, b = (0, len(sizes)) if rnd.random() < 0.5 else sorted(
                rnd.sample(range(len(sizes) + 1), 2))
            stale = [rnd.randint(0, 5) for _ in range(rnd.randint(1, 3))]
            grads = [[torch.randn(sizes[i], generator=g).to(dts[i]) for i in range(a, b)]
                     for _ in stale]
            _reference_step(ref_opt, ref[a:b], grads, stale, rule)
            step.apply(params[a:b], grads, stale, lambda: 1.0)
        _assert_same(ref_opt, ref, opt, params)


def _server(init: dict, servers: int, make) -> Server:
    plan = plan_keys([(n, t.numel(), 4) for n, t in init.items()], servers)
    return Server(0, plan[0], init, Sync(), make, [0], SECRET)


def _digits_server(make) -> Server:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    return _server({n: p.detach() for n, p in model.named_parameters()}, 2, make)


def _calls(server: Server) -> int:
    """aten calls of the third update of `server` by 2 pushes (torch's profiler)."""
    grads = [{k: torch.randn(p.numel()) for k, p in server.params.items()} for _ in range(2)]
    for _ in range(2):  # NOTE: the first steps make the state and the runs
        server._apply(grads, [0, 0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        server._apply(grads, [0, 0])
    return sum(e.name.startswith("aten::") and e.cpu_parent is None for e in prof.events())


def test_an_update_makes_as_many_torch_calls_for_many_keys_as_for_one():
    """New property (fails on key-by-key stepping, about 5 calls a key): the torch calls
    of an update do not grow with the keys. SGD momentum and Adam, 2 pushes averaged."""
    for make in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda p: torch.optim.Adam(p, lr=1e-3)):
        many, one = _digits_server(make), _server({"w": torch.randn(4000)}, 1, make)
        try:
            assert len(many.keys) > 30 and len(one.keys) == 1
            calls = _calls(many), _calls(one)
            assert calls[0] <= calls[1] + 2, calls  # + a torch.cat per push
        finally:
            many.close()
            one.close()


def test_snapshot_restore_copy_on_write_and_load_state_dict_stay_bitwise(tmp_path):
    """The layout breaks where the server changes memory behind the optimizer's back: a key
    copied on write, a restored snapshot (new state tensors), load_state_dict. Each step
    after still matches key-by-key stepping, and the old memory is not written."""
    make = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731  (scalar state: step)
    server = _digits_server(make)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in server.params.values()]
    ref_opt, keys = make(ref), server.keys
    g = torch.Generator().manual_seed(3)
    try:
        def update():
            grads = [[torch.randn(p.numel(), generator=g) for p in ref]]
            _reference_step(ref_opt, ref, grads, [0], UpdateRule())
            server._apply([dict(zip(keys, grads[0]))], [0])
        update()
        p = server.params[keys[5]]
        before = p.detach()  # a zero-copy send may still read this memory
        kept = before.clone()
        p.data = p.data.clone()  # what Server._apply does then
        update()
        assert torch.equal(before, kept)
        server.snapshot(str(tmp_path / "s.safetensors"))
        server.restore(str(tmp_path / "s.safetensors"))
        update()
        server.optimizer.load_state_dict(server.optimizer.state_dict())
        update()
        _assert_same(ref_opt, ref, server.optimizer, list(server.params.values()))
    finally:
        server.close()


def test_other_optimizers_flags_and_step_hooks_step_key_by_key():
    p = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    for opt in (torch.optim.RMSprop(p), torch.optim.SGD(p, lr=0.1, foreach=True),
                type("MySGD", (torch.optim.SGD,), {})(p, lr=0.1)):
        assert StaleStep(opt, UpdateRule()).runs is None
    opt = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    step = StaleStep(opt, UpdateRule())
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(len(o.param_groups[0]["params"])))
    step.apply(p, [[torch.ones(4), torch.ones(3)]], [0], lambda: 0.0)
    assert seen == [2]  # the hook saw the two keys, not one run
    assert torch.equal(p[0].detach(), torch.full((4,), 0.9)) and p[0].grad is None
    # Adam stepped as a run, then with a hook key by key: each key counts its own steps
    ref = [torch.nn.Parameter(t.detach().clone()) for t in p]
    opt, ref_opt = torch.optim.Adam(p, lr=0.1), torch.optim.Adam(ref, lr=0.1)
    step = StaleStep(opt, UpdateRule())
    for hooked in (False, True, True):
        if hooked and not seen[2:]:
            opt.register_step_pre_hook(lambda o, a, k: seen.append(0))
        grads = [[torch.full((4,), 0.5), torch.full((3,), -2.0)]]
        step.apply(p, grads, [0], lambda: 0.0)
        _reference_step(ref_opt, ref, grads, [0], UpdateRule())
    _assert_same(ref_opt, ref, opt, p)
