"""`disttrain plan profile script.py`: measure each layer of the user's module, here.

The script defines `profile_target()` returning `(model, batch)`: an `nn.Module` and
one sample input (a tensor, or a tuple of tensors passed as `model(*batch)`). Loading
runs the script with `__name__ == "__disttrain_profile__"`, so its `__main__` block
does not run. One warm-up step and `--steps` measured steps of forward and backward
(loss: the output's mean) run in this process on the CPU; module hooks time each
top-level layer (`model.pipeline_layers()` when the model names them, else its
children, containers expanded):

- forward: from the layer's forward pre-hook to its forward hook;
- backward: from the layer's backward pre-hook (its output's gradient is ready) to the
  next layer's, or to the end of `backward()` for the first layer, so the layers'
  backward seconds add up to the whole backward;
- activation bytes: the storages autograd saves while the layer runs forward
  (`torch.autograd.graph.saved_tensors_hooks`), parameters left out;
- the optimizer: after the layers' steps, one warm-up and `--steps` steps of
  torch.optim.AdamW over the whole model's gradients (the step the examples take);
- with `--ranks 2,4,8`, how much slower the blocks run when that many copies of this
  profile run at once (plan/profile_shared.py): the ranks of a job sharing the machine;
- with `--repeat N`, all of it N times, each number the median over the runs
  (plan/profiled.py's `median_profile`): one burst of load during a run moves nothing.

The median over the measured steps (and the minimum, for a loaded machine) goes to a JSON file (format "disttrain-plan-profile/1")
that `disttrain plan layout --profile FILE` reads (plan/profiled.py). Torch is imported
only when a profile runs: the planner itself imports none.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
import warnings

from disttrain.plan.profile_shared import inline_collectives, parse_ranks, shared_slowdowns
from disttrain.plan.profiled import FORMAT, median_profile

__all__ = ["profile_script", "backward_seconds", "add_profile_parser"]

ENTRY = "profile_target"


def _target(script: str):
    """(model, batch) from the script's `profile_target()`; ValueError saying what is missing."""
    import torch

    if not os.path.isfile(script):
        raise ValueError(f"{script}: no such file")
    env = runpy.run_path(script, run_name="__disttrain_profile__")
    fn = env.get(ENTRY)
    if not callable(fn):
        raise ValueError(f"{script} defines no {ENTRY}(); add `def {ENTRY}(): return model, "
                         f"batch` (an nn.Module and one sample input, a tensor or a tuple "
                         f"of tensors passed as model(*batch))")
    got = fn()
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.nn.Module)):
        raise ValueError(f"{script}: {ENTRY}() must return (model, batch) with model an "
                         f"nn.Module; got {type(got).__name__}")
    model, batch = got
    batch = batch if isinstance(batch, tuple) else (batch,)
    if not batch or not all(isinstance(x, torch.Tensor) for x in batch):
        raise ValueError(f"{script}: {ENTRY}()'s batch must be a tensor or a tuple of tensors")
    return model, batch


def _layers(model) -> list[tuple[str, object]]:
    """The top-level layers in forward order: the model's pipeline layers, or its children."""
    import torch

    if hasattr(model, "pipeline_layers"):
        return [(name, model.get_submodule(name)) for name in model.pipeline_layers()]
    out = []
    for name, child in model.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            out += [(f"{name}.{k}", c) for k, c in child.named_children()]
        else:
            out.append((name, child))
    return out


class _Clock:
    """Hooks on every layer: forward and backward timestamps, saved bytes per layer."""

    def __init__(self, layers, params: set[int]):
        self.layers, self.params = layers, params
        self.fwd: dict[str, float] = {}
        self.bwd_start: dict[str, float] = {}
        self.saved: dict[str, dict[int, int]] = {}
        self.current: str | None = None
        self.order: list[str] = []
        self.handles = []
        for name, mod in layers:
            self.handles += [mod.register_forward_pre_hook(self._enter(name)),
                             mod.register_forward_hook(self._leave(name)),
                             mod.register_full_backward_pre_hook(self._backward(name))]

    def _enter(self, name):
        def hook(_mod, _args):
            self.current, self.fwd[name] = name, time.perf_counter()
        return hook

    def _leave(self, name):
        def hook(_mod, _args, _out):
            self.current, self.fwd[name] = None, time.perf_counter() - self.fwd[name]
        return hook

    def _backward(self, name):
        def hook(_mod, _grad):
            self.bwd_start[name] = time.perf_counter()
        return hook

    def pack(self, t):
        """saved_tensors_hooks' pack: count the storage once per layer, not parameters."""
        ptr = t.untyped_storage().data_ptr()
        if self.current is not None and ptr not in self.params:
            self.saved.setdefault(self.current, {})[ptr] = t.untyped_storage().nbytes()
        return t


def _step(model, batch, clock: _Clock) -> dict[str, tuple[float, float, int]]:
    """One forward and backward: {layer: (forward s, backward s, saved bytes)}."""
    import torch

    for record in (clock.fwd, clock.bwd_start, clock.saved):
        record.clear()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(clock.pack, lambda t: t):
        out = model(*batch)
    out = out[0] if isinstance(out, (tuple, list)) else out
    with warnings.catch_warnings():  # NOTE: a layer fed token ids has no input gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        out.float().mean().backward()
    bwd = backward_seconds(clock.bwd_start, time.perf_counter())
    clock.order = list(bwd)
    return {name: (clock.fwd[name], bwd.get(name, 0.0), sum(clock.saved.get(name, {}).values()))
            for name, _ in clock.layers}


def backward_seconds(starts: dict[str, float], end: float) -> dict[str, float]:
    """Each layer's backward, in backward order: from its start to the next layer's start
    (backward runs the layers in reverse), the last one to `end` (backward() returned)."""
    order = sorted(starts, key=starts.get)
    stops = [starts[n] for n in order[1:]] + [end]
    return {n: stop - starts[n] for n, stop in zip(order, stops)}


def _optimizer_seconds(model, steps: int) -> dict:
    """Median and least seconds of an AdamW step over `model`'s gradients (1 warm-up step)."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.grad is not None], lr=1e-3)
    times = []
    for _ in range(1 + steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"name": "AdamW", "step_s": statistics.median(times[1:]), "step_min_s": min(times[1:]),
            "params": sum(p.numel() for g in opt.param_groups for p in g["params"])}


def _gpt_spec(model, batch) -> str | None:
    """The planner's `gpt:` string of a models/gpt.py GPT (its cfg), else None."""
    cfg = getattr(model, "cfg", None)
    keys = ("n_layer", "n_embd", "n_head", "vocab_size")
    if cfg is None or not all(hasattr(cfg, k) for k in keys) or batch[0].dim() < 2:
        return None
    return (f"gpt:layers={cfg.n_layer},hidden={cfg.n_embd},heads={cfg.n_head},"
            f"seq={batch[0].shape[1]},vocab={cfg.vocab_size}")


def _meet(folder: str, name: str, copies: int, work=None, timeout: float = 600.0) -> None:
    """Mark `name` in `folder`, then wait until `copies` marks of that name are there,
    calling `work()` meanwhile if given (else polling). Blocks; ValueError after `timeout`."""
    with open(os.path.join(folder, f"{name}.{os.getpid()}"), "w"):
        pass
    end = time.monotonic() + timeout
    while sum(f.startswith(name + ".") for f in os.listdir(folder)) < copies:
        if time.monotonic() > end:
            raise ValueError(f"--together: fewer than {copies} copies reached {name!r} "
                             f"within {timeout:.0f} s")
        work() if work else time.sleep(0.001)


def profile_script(script: str, steps: int = 10, threads: int | None = None,
                   together: tuple[str, int] | None = None) -> dict:
    """Run `script`'s profile_target() for 1 + `steps` steps here; the profile as a dict.

    Blocks for the whole run. `threads` sets torch's intra-op threads (default: torch's).
    `together` = (folder, n): one of n copies started at once (plan/profile_shared.py);
    each measures only once all n have warmed up, and keeps computing (unmeasured) until
    all n have measured, so every measured step runs beside n - 1 computing copies.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    model, batch = _target(script)
    model.train()
    layers = _layers(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    clock = _Clock(layers, params)
    try:
        _step(model, batch, clock)  # NOTE: the first step warms up (allocations, first use)
        if together:
            _meet(together[0], "warm", together[1])
        runs = [_step(model, batch, clock) for _ in range(steps)]
        if together:
            _meet(together[0], "measured", together[1], lambda: _step(model, batch, clock))
    finally:
        for h in clock.handles:
            h.remove()
    optimizer = _optimizer_seconds(model, steps)  # NOTE: after the layers: it moves the weights
    rows = [{"name": name, "kind": type(mod).__name__,
             "forward_s": statistics.median(r[name][0] for r in runs),
             "backward_s": statistics.median(r[name][1] for r in runs),
             "forward_min_s": min(r[name][0] for r in runs),
             "backward_min_s": min(r[name][1] for r in runs),
             "activation_bytes": runs[-1][name][2],
             "params": sum(p.numel() for p in mod.parameters())} for name, mod in layers]
    first = batch[0]
    return {"format": FORMAT, "script": os.path.abspath(script), "device": "cpu",
            "threads": torch.get_num_threads(), "cpus": os.cpu_count() or 1, "steps": steps,
            "batch": int(first.shape[0]), "seq": int(first.shape[1]) if first.dim() > 1 else 1,
            "gpt": _gpt_spec(model, batch), "backward_order": clock.order, "layers": rows,
            "optimizer": optimizer}


def add_profile_parser(sub) -> None:
    """Register `disttrain plan profile` on the `plan` command's subparsers."""
    p = sub.add_parser("profile", help="measure each layer of a module here (for plan layout "
                                       "--profile)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("script", help=f"a Python file defining {ENTRY}() -> (model, batch)")
    p.add_argument("--steps", type=int, default=10, help="measured steps after 1 warm-up; "
                                                         "the median goes to the file (10)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default="profile.json", help="where to write (profile.json)")
    p.add_argument("--ranks", help="also measure the blocks with N copies running at once, for "
                                   "each N of e.g. 2,4,8 (ranks sharing this machine)")
    p.add_argument("--together", help=argparse.SUPPRESS)  # NOTE: DIR:N, set by --ranks' copies
    p.add_argument("--repeat", type=int, default=1,
                   help="profile N times and write each number's median over the runs, so a "
                        "burst of load during one run moves nothing (1)")
    p.set_defaults(handler=_plan_profile)


def _plan_profile(args: argparse.Namespace) -> int:
    try:
        for name in ("steps", "threads", "repeat"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
        ranks = parse_ranks(args.ranks) if args.ranks else []
        together = None
        if args.together:
            folder, _, n = args.together.rpartition(":")
            together = (folder, int(n))
        runs = []
        for _ in range(args.repeat):
            prof = profile_script(args.script, args.steps, args.threads, together)
            if ranks:
                prof["shared"] = shared_slowdowns(args.script, prof, ranks, args.steps, args.threads)
                prof["collectives"] = inline_collectives(prof, ranks)
            runs.append(prof)
        prof = median_profile(runs)
    except ValueError as err:
        print(f"disttrain plan profile: error: {err}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(prof, f, indent=1)
    for row in prof["layers"]:
        print(f"{row['name']:<16} {row['kind']:<12} fwd {row['forward_s'] * 1e3:8.3f} ms  "
              f"bwd {row['backward_s'] * 1e3:8.3f} ms  saved {row['activation_bytes'] / 1e6:8.3f} MB")
    o = prof["optimizer"]
    print(f"{'optimizer':<16} {o['name']:<12} step {o['step_s'] * 1e3:7.3f} ms  "
          f"({o['params']:,} parameters)")
    for n, k in prof.get("shared", {}).items():
        print(f"{n} copies at once: blocks {k:.3g}x slower than alone")
    for n, c in prof.get("collectives", {}).items():
        print(f"{n} ranks in pairs: a blocking all-reduce of {c['bytes'] / 1e6:.3g} MB adds "
              f"{c['inline_s'] * 1e3:.3g} ms between compute ({c['alone_s'] * 1e3:.3g} ms alone; "
              f"the call {c['call_s'] * 1e3:.3g} ms when ranks alternate compute and it, their "
              f"compute {(c['both_s'] - c['call_s']) / c['compute_cpu_s']:.3g}x slower than alone)")
    print(f"wrote {args.out} ({prof['steps']} steps, batch {prof['batch']} x {prof['seq']}, "
          f"{prof['threads']} threads" + (f"; the median of {args.repeat} runs" if args.repeat > 1 else "")
          + ")")
    return 0
