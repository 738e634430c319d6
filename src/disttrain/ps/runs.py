"""One optimizer step over a server's many small keys, as a few tensors.

Placement (placement.py) cuts a model into keys of at most 1/16 of a server's share, and
each key is a parameter of the server's optimizer. On CPU torch's optimizers loop over
their parameters in Python (the multi-tensor `foreach` code is the default on CUDA
only), a few torch calls per parameter, about 7 us a key (docs/benchmarks.md, "The
server's step over many keys").

`RunStep(optimizer)` lays each param group's parameters of one dtype out in one buffer,
each parameter a view of its range (values unchanged). A step then hands the optimizer
each *run* of stepped keys (consecutive, one group, one dtype, alike state) as one
tensor, for the length of one `optimizer.step()`: its gradient the run's gradients
concatenated and averaged as one tensor (`load`, `mean`), its state views over the keys'
state. The optimizer's own `step` does the math, and its state stays per key (views of
the run's per-element state; a scalar such as Adam's `step` shared by the run's keys), so
`state_dict`, snapshots and replicas see per-key state as before.

NOTE: stepping a run is bitwise stepping its keys one by one only where every element is
computed the same wherever it sits in a tensor. That holds for SGD, Adam and AdamW in
float32 and float64 on CPU (tests/unit/test_ps_runs.py checks it against key-by-key
stepping). It does not for bfloat16 or float16: ATen's vectorised loop computes them in
float32 and rounds once, its scalar tail rounds every operation, so a key's last
elements would differ; keys of those dtypes are runs of one. Any other optimizer class
(a subclass too), `foreach`, `fused`, `capturable` or `differentiable`, or parameters
off the CPU: `eligible` is False and the server steps key by key as before. With a step
hook registered the step is key by key too (a hook sees the optimizer's parameters).
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["RunStep", "eligible", "mean", "RUN_DTYPES", "RUN_OPTIMIZERS"]

RUN_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
RUN_DTYPES = (torch.float32, torch.float64)
_FLAGS = ("foreach", "fused", "capturable", "differentiable")
_CACHED = 256  # sets of keys whose runs are kept


def eligible(optimizer: torch.optim.Optimizer | None) -> bool:
    """May `optimizer` step runs of keys (bitwise as key by key)? See the module's NOTE."""
    if optimizer is None or type(optimizer) not in RUN_OPTIMIZERS:
        return False
    return all(not g.get(f) for g in optimizer.param_groups for f in _FLAGS) and all(
        p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"])


def mean(grads: list[torch.Tensor], scales: list[float], dtype: torch.dtype) -> torch.Tensor:
    """The mean of `grads` (as `dtype`), each times its scale; one gradient of scale 1 is
    returned as it is (no copy). Element by element, so one call on concatenated keys is
    the calls on each key, bitwise, for RUN_DTYPES."""
    if len(grads) == 1 and scales[0] == 1.0:
        return grads[0].to(dtype)
    total = grads[0].to(dtype) * scales[0]
    for g, s in zip(grads[1:], scales[1:]):
        total.add_(g.to(dtype), alpha=s)
    return total.div_(len(grads))


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_post_hooks", None))


def _per_element(v, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n


def _span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D tensor over the memory of `tensors` when they lie back to back in one
    storage (same dtype, contiguous); else None."""
    first = tensors[0]
    storage, size, ptr = first.untyped_storage(), first.element_size(), first.data_ptr()
    for t in tensors:
        if (t.data_ptr() != ptr or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        ptr += t.numel() * size
    n = (ptr - first.data_ptr()) // size
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (n,))


class _Run:
    """Keys `start:stop` of a step, adjacent in one buffer of group `group`, stepped as one
    tensor `param` (a Parameter over their memory)."""

    def __init__(self, keys: list, start: int, group: int, state: dict):
        self.keys, self.start, self.stop, self.group = keys, start, start + len(keys), group
        self.sizes, self.shapes = [p.numel() for p in keys], [p.shape for p in keys]
        self.one_d = all(len(s) == 1 for s in self.shapes)
        self.n, self.dtype = sum(self.sizes), keys[0].dtype
        flat = _span([p.detach() for p in keys])
        if flat is None:  # NOTE: a key left the buffer (copy on write): the run gets a new one
            flat = torch.cat([p.detach().reshape(-1) for p in keys])
            for p, v in zip(keys, self.split(flat)):
                p.data = v
        self.param = torch.nn.Parameter(flat, requires_grad=False)
        self.ptrs = [p.data_ptr() for p in keys]
        self.grad: torch.Tensor | None = None
        first = state.get(keys[0], {})
        run_state, moved = {}, False
        for name, v in first.items():
            if _per_element(v, self.sizes[0]):
                parts = [state[p][name] for p in keys]
                run_state[name] = _span(parts)
                if run_state[name] is None:  # NOTE: restored state: one new buffer
                    run_state[name], moved = torch.cat([t.reshape(-1) for t in parts]), True
            else:
                run_state[name] = v.clone() if isinstance(v, torch.Tensor) else v
        if moved:
            self._share(state, run_state)
        else:  # NOTE: the keys keep their state objects, so runs of other steps over
            self.state = run_state  # some of these keys stay valid
            self.views = {n: [state[p][n] for p in keys] for n in run_state}
            self.dicts = [state[p] for p in keys] if run_state else [{} for _ in keys]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (the run's n elements) as one view per key, in the keys' shapes."""
        parts = torch.split(flat, self.sizes)
        if self.one_d:  # a server's keys: 1-D already
            return list(parts)
        return [t.view(s) for t, s in zip(parts, self.shapes)]

    def _share(self, state: dict, run_state: dict) -> None:
        """Point every key's state at the run's: views of per-element tensors, the run's
        scalars and other values themselves."""
        self.state, self.views = run_state, {}
        for name, v in run_state.items():
            self.views[name] = self.split(v) if _per_element(v, self.n) else [v] * len(self.keys)
            for p, part in zip(self.keys, self.views[name]):
                state[p][name] = part
        # NOTE: the keys' own state dicts, so `valid` hashes no tensor; a whole new state
        # (load_state_dict) is caught in RunStep._lookup
        self.dicts = [state[p] for p in self.keys] if run_state else [{} for _ in self.keys]

    def valid(self) -> bool:
        """Still as built: every key in place, its state the run's (C-level loops: this
        runs every step)."""
        if list(map(torch.Tensor.data_ptr, self.keys)) != self.ptrs:
            return False
        for name, vs in self.views.items():
            if not all(map(operator.is_, map(dict.get, self.dicts, repeat(name)), vs)):
                return False
        return set(map(len, self.dicts)) <= {len(self.views)}

    def before(self, state: dict) -> None:
        """Hand the run to the optimizer: its gradient, its state (scalars cloned, so no
        tensor another run shares is changed in place)."""
        self.param.grad, self.grad = self.grad, None
        state[self.param] = {n: v if _per_element(v, self.n) or not isinstance(v, torch.Tensor)
                             else v.clone() for n, v in self.state.items()}

    def after(self, state: dict) -> None:
        """Take the run's state back from the optimizer and point the keys at it."""
        self.param.grad = None
        got = state.pop(self.param, {})
        if got.keys() != self.state.keys() or any(
                got[n] is not v for n, v in self.state.items() if _per_element(v, self.n)):
            return self._share(state, dict(got))  # first step: the optimizer made the state
        for name, v in got.items():  # the new scalars (Adam's step)
            if not _per_element(v, self.n):
                self.state[name], self.views[name] = v, [v] * len(self.keys)
                for d in self.dicts:
                    d[name] = v


class RunStep:
    """Steps an eligible optimizer's keys run by run (see the module); never blocks."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self._state = optimizer, optimizer.state
        self._group = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._runs: dict[tuple, list[_Run]] = {}  # ids of the stepped keys -> their runs
        self._loaded: list[_Run] | None = None
        for i, g in enumerate(optimizer.param_groups):
            for dtype in RUN_DTYPES:
                keys = [p for p in g["params"] if p.dtype == dtype]
                if keys:
                    _Run(keys, 0, i, {})  # NOTE: lays them out in one buffer

    def load(self, params: list, grads: list[list[torch.Tensor]], scales: list[float],
             keep: bool = False) -> list[torch.Tensor] | None:
        """Set the gradients of the next `step`: for `params`, the `mean` of `grads` (one
        list per push, a gradient per key, each push times its scale), computed run by
        run. With `keep`, returns each key's gradient (views of its run's)."""
        out: list[torch.Tensor] = []
        self._loaded = self._lookup(params)
        for r in self._loaded:
            parts = [g[r.start:r.stop] for g in grads]
            flats = [ps[0].reshape(-1) if len(ps) == 1 else torch.cat(ps) for ps in parts]
            r.grad = mean(flats, scales, r.dtype)
            if keep:
                out += r.split(r.grad)
        return out if keep else None

    def step(self) -> None:
        """optimizer.step() over what `load` set, else over the keys whose `.grad` is set
        (then cleared). Blocks while it computes."""
        runs, self._loaded = self._loaded, None
        if runs is None:
            live = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            runs = self._lookup(live)
            for r in runs:
                grads = [p.grad.reshape(-1) for p in r.keys]
                r.grad = grads[0] if len(grads) == 1 else torch.cat(grads)
            for p in live:
                p.grad = None
        if _hooked(self.optimizer):
            return self._key_by_key(runs)
        opt, saved = self.optimizer, [g["params"] for g in self.optimizer.param_groups]
        try:
            for i, g in enumerate(opt.param_groups):
                g["params"] = [r.param for r in runs if r.group == i]
            for r in runs:
                r.before(opt.state)
            opt.step()
        finally:
            for g, params in zip(opt.param_groups, saved):
                g["params"] = params
            for r in runs:
                r.after(opt.state)

    def _key_by_key(self, runs: list[_Run]) -> None:
        """optimizer.step() over the keys themselves (a step hook sees what it expects)."""
        for r in runs:
            for p, g in zip(r.keys, r.split(r.grad)):
                p.grad = g
            r.grad = None
            for d in r.dicts:  # NOTE: a run's keys share its scalars (Adam's step): not now
                d.update({n: v.clone() for n, v in d.items()
                          if isinstance(v, torch.Tensor) and v.dim() == 0})
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _lookup(self, params: list) -> list[_Run]:
        """The runs of `params` (cached while still laid out as built)."""
        ident = tuple(map(id, params))
        state = self.optimizer.state
        if state is not self._state:  # NOTE: load_state_dict: every key's state is new
            self._runs.clear()
            self._state = state
        runs = self._runs.get(ident)
        if runs is None or not all(r.valid() for r in runs):
            if len(self._runs) >= _CACHED:  # NOTE: pushes grouped in ever new ways
                self._runs.clear()
            runs = self._runs[ident] = self._split(params, state)
        return runs

    def _split(self, params: list, state: dict) -> list[_Run]:
        """`params` cut into runs: consecutive keys of one group and one dtype of
        RUN_DTYPES (others step alone), with the same state names and scalar values."""
        runs: list[tuple[int, list]] = []
        prev = None
        for i, p in enumerate(params):
            st = state.get(p, {})
            sig = (self._group_of(p), p.dtype, tuple(st), tuple(
                float(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 0))
            if sig == prev and p.dtype in RUN_DTYPES:
                runs[-1][1].append(p)
            else:
                runs.append((i, [p]))
            prev = sig
        return [_Run(keys, i, self._group_of(keys[0]), state) for i, keys in runs]

    def _group_of(self, p) -> int:
        """The param group of `p`; NOTE: groups added after this was built (transfer.py
        installs a new tail's copies with add_param_group) are looked up then."""
        i = self._group.get(id(p))
        if i is None:
            self._group = {id(q): j for j, g in enumerate(self.optimizer.param_groups)
                           for q in g["params"]}
            i = self._group[id(p)]
        return i
