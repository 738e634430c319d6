"""Where the trace hears about work: torch's global hooks, comm/ops.py and the data loader.

`active` is the process's `Tracer` while tracing is on and None otherwise: comm/ops.py
and data.py test it once per call and do nothing more when it is None, and no torch hook
exists then (`install()` adds them, `remove()` takes them away), so tracing off costs
nothing.

What it installs (torch's public global hooks: no user class is patched):
- module forward pre/post hooks: the outermost forward on a thread is one "forward" span
  (DataParallel, Zero, a pipeline stage or the user's own module, whichever is called);
  torch's global ones only until the first step ends, then the outermost modules' own;
  a hook on its output's gradient marks the start of "backward", and a callback queued
  on the autograd engine its end;
- optimizer step pre/post hooks: "optimizer.step"; a step of the job ends at the first
  forward or data wait after an optimizer step (so several optimizers stepping one after
  the other, ZeRO's inner one included, make one step).

Collectives: ops.py calls `issued(entry)` and `finished(entry, exposed)` around each one
(and `waited(entry, t0)` when an async handle's wait() returns): one row per collective
(recorder.py), which the merge makes a span on a communication lane, its exposed part on
the caller's track, and a flow arrow from each point-to-point send to its receive (the
flight recorder numbers them per direction, so both ends compute the same id).
"""

from __future__ import annotations

import math
import threading

import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

from disttrain.trace.recorder import MAIN_TID, Recorder, now_us

__all__ = ["Tracer", "active", "now_us", "batch_size"]

active: Tracer | None = None
"""The process's tracer while tracing is on; None when off (checked by ops.py, data.py)."""

_ITEMSIZE: dict[str, int] = {}
_MODULE_ARGS: dict[type, dict] = {}  # a forward span's args per module class (shared: never mutated)


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        dt = getattr(torch, dtype, None)
        size = _ITEMSIZE[dtype] = dt.itemsize if isinstance(dt, torch.dtype) else 0
    return size


def batch_size(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = batch_size(item)
            if n:
                return n
    return 0


def _grad_tensor(out):
    """The first tensor in a forward's output that will receive a gradient, if any."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            found = _grad_tensor(item)
            if found is not None:
                return found
    return None


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total overlap of two lists of disjoint intervals, each in time order (one sweep:
    a pipeline step's actions against its exposed waits, every step)."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            c, d = ys[k]
            total += min(b, d) - max(a, c)
            k += 1
    return total


class Tracer:
    """The hooks' state: open spans of the training thread and the step boundaries."""

    def __init__(self, rec: Recorder):
        self.rec, self.m = rec, rec.metrics
        self._main = threading.main_thread().ident
        self._tl = threading.local()
        self._handles: list = []
        self._cdepth = 0  # compute spans open on the training thread
        self._bwd_t0: float | None = None
        self._opt_depth, self._opt_t0 = 0, 0.0
        self._step_t0: float | None = None
        self._opt_done, self._last_end = False, 0.0  # end of the last span counted in a step
        self._global: list = []  # torch's global module hooks, until the first step ends
        self._roots: dict[int, tuple] = {}  # id(module) -> its own hooks, for outermost modules
        self.own_compute = False  # the pipeline runtime times its own actions (pipeline_begin)
        self._pipe_exposed: list[tuple[float, float]] = []  # exposed waits while it does

    def install(self) -> None:
        self._global = [nn_module.register_module_forward_pre_hook(self._global_pre),
                        nn_module.register_module_forward_hook(self._fwd_post, always_call=True)]
        self._handles = [optim_module.register_optimizer_step_pre_hook(self._opt_pre),
                         optim_module.register_optimizer_step_post_hook(self._opt_post)]

    def remove(self) -> None:
        self._drop_global()
        for handle in self._handles + [h for pair in self._roots.values() for h in pair]:
            handle.remove()
        self._handles, self._roots = [], {}

    def _drop_global(self) -> None:
        """Hand over to the outermost modules' own hooks (NOTE: while any global module
        hook exists torch calls every submodule through its slow path: measured 10-15 %
        of a small GPT's step, so they only last until the first step has shown the roots)."""
        for handle in self._global:
            handle.remove()
        self._global = []

    def _global_pre(self, module, args) -> None:
        if self.own_compute and threading.get_ident() == self._main:
            return  # NOTE: a pipeline stage's modules: the runtime's F/B/W spans say it all
        if getattr(self._tl, "depth", 0) == 0 and id(module) not in self._roots:
            self._roots[id(module)] = (module.register_forward_pre_hook(self._root_pre),
                                       module.register_forward_hook(self._root_post, always_call=True))
        self._fwd_pre(module, args)
        if not self._global:  # NOTE: dropped in this call: torch runs the root's own pre-hook next
            self._tl.counted = module

    def _root_pre(self, module, args) -> None:
        if self.own_compute and threading.get_ident() == self._main:
            return
        if getattr(self._tl, "counted", None) is module:
            self._tl.counted = None
        elif not self._global:
            self._fwd_pre(module, args)

    def _root_post(self, module, args, out) -> None:
        if not self._global:
            self._fwd_post(module, args, out)

    # ---- steps ----

    def on_main(self) -> bool:
        """True on the training (main) thread."""
        return threading.get_ident() == self._main

    def begin(self, t: float) -> None:
        """Work starts on the training thread at `t`: the first after an optimizer step opens a step."""
        if self._step_t0 is None:
            self._step_t0 = t
            self.rec.enter_step(self.rec.step)
        elif self._opt_done:
            self._close_step(t)
            self._step_t0 = t

    def end_step(self) -> None:
        """The script says a step ended now (loops with no torch optimizer)."""
        self._opt_done, self._last_end = True, now_us()

    def _close_step(self, t: float) -> None:
        rec, step = self.rec, self.rec.step
        self.m.close_step(step, self._step_t0, t, rec.recording)
        self._opt_done, self.own_compute = False, False
        rec.enter_step(step + 1)
        self._drop_global()

    def finish(self) -> None:
        """Close the last step (where its last span ended) and remove the hooks."""
        self.remove()
        if self._step_t0 is not None and self._opt_done:
            self._close_step(max(self._last_end, self._step_t0))
            self._step_t0 = None

    # ---- compute ----

    def _compute(self, name: str, t0: float, t1: float, args: dict | None, main: bool) -> None:
        """A compute span of this thread (`main`: the training thread's, counted in its step)."""
        rec = self.rec
        if rec.recording:
            rec.push(("X", t0, t1 - t0, MAIN_TID if main else rec.tid(), name, "compute", args))
        if main:
            self._cdepth -= 1
            if self._cdepth == 0 and self._step_t0 is not None:
                self.m.compute += t1 - t0
                self._last_end = max(self._last_end, t1)

    def _fwd_pre(self, module, args) -> None:
        tl = self._tl
        depth = getattr(tl, "depth", 0)
        if depth == 0:
            tl.t0 = t = now_us()
            if threading.get_ident() == self._main:
                self.begin(t)
                self._cdepth += 1
        tl.depth = depth + 1

    def _fwd_post(self, module, args, out) -> None:
        tl = self._tl
        depth = getattr(tl, "depth", 0)
        if depth == 0:  # tracing started inside this forward, or the pipeline times it
            return
        tl.depth = depth - 1
        if depth == 1:
            kind = type(module)
            names = _MODULE_ARGS.get(kind) or _MODULE_ARGS.setdefault(kind, {"module": kind.__name__})
            self._compute("forward", tl.t0, now_us(), names, threading.get_ident() == self._main)
            grad_out = _grad_tensor(out)
            if grad_out is not None and torch.is_grad_enabled():
                node = grad_out.grad_fn
                if node is not None:  # NOTE: a node's pre-hook costs ~1 us less than a tensor hook
                    node.register_prehook(self._bwd_pre)
                else:
                    grad_out.register_hook(self._bwd_start)

    def _bwd_pre(self, grad_outputs):
        self._bwd_start(None)
        return None

    def _bwd_start(self, grad):
        if self._bwd_t0 is None:
            self._bwd_t0 = now_us()
            self._cdepth += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)
        return None

    def _bwd_end(self) -> None:
        t0, self._bwd_t0 = self._bwd_t0, None
        self._compute("backward", t0, now_us(), None, True)

    def _opt_pre(self, opt, args, kwargs) -> None:
        if self._opt_depth == 0:
            self._opt_t0 = now_us()
            self._cdepth += 1
        self._opt_depth += 1

    def _opt_post(self, opt, args, kwargs) -> None:
        self._opt_depth -= 1
        if self._opt_depth == 0:
            t1 = now_us()
            self._compute("optimizer.step", self._opt_t0, t1, {"optimizer": type(opt).__name__}, True)
            self._opt_done = True

    # ---- data ----

    def data(self, iterable):
        """Yield from `iterable`, each wait a "data" span (the training thread's opens a step)."""
        it = iter(iterable)
        while True:
            t0 = now_us()
            main = threading.get_ident() == self._main
            if main:
                self.begin(t0)
            try:
                batch = next(it)
            except StopIteration:
                return
            t1 = now_us()
            self.rec.complete("data", "data", t0, t1)
            if main:
                self.m.data += t1 - t0
                self.m.samples += batch_size(batch)
            yield batch

    # ---- collectives (called by comm/ops.py) ----

    def issued(self, entry) -> None:
        entry.extra["trace_t0"] = now_us()

    def finished(self, entry, exposed: bool) -> None:
        """`entry` completed; `exposed`: the caller waited for all of it (a blocking call).

        NOTE: the hot path of tracing (every collective, on any thread): one row of what the
        entry already has; its lane, flow arrow and exposed span are made by the merge."""
        t0 = entry.extra.pop("trace_t0", None)  # NOTE: atomic: a callback and wait() may race
        if t0 is None:
            return
        t1 = now_us()
        op, m = entry.op, self.m
        nbytes = sum(map(math.prod, entry.shapes)) * (_ITEMSIZE.get(entry.dtype) or _itemsize(entry.dtype))
        m.bytes[op] = m.bytes.get(op, 0) + nbytes
        m.counts[op] = m.counts.get(op, 0) + 1
        self.rec.collective(t0, t1, entry, nbytes, exposed)
        if exposed:
            self._exposed_time(t0, t1)

    def waited(self, entry, t0: float) -> None:
        """The caller waited on an async handle from `t0` until now."""
        t1 = now_us()
        self.rec.waited("wait " + entry.op, t0, t1, entry.op, entry.group, entry.seq)
        self._exposed_time(t0, t1)

    def named_wait(self, name: str, t0: float, t1: float) -> None:
        """A named span of the training thread outside compute (a part of idle) in the step."""
        if threading.get_ident() == self._main and self._step_t0 is not None and self._cdepth == 0:
            self.m.waits[name] = self.m.waits.get(name, 0.0) + t1 - t0

    def exposed(self, name: str, t0: float, t1: float, args: dict) -> None:
        """The calling thread waited for communication from t0 to t1 (µs)."""
        self.rec.complete(name, "comm.exposed", t0, t1, args)
        self._exposed_time(t0, t1)

    def _exposed_time(self, t0: float, t1: float) -> None:
        """The calling thread's wait [t0, t1] in the step's metrics (training thread only)."""
        if threading.get_ident() == self._main and self._step_t0 is not None:
            self.m.exposed += t1 - t0
            self._last_end = max(self._last_end, t1)
            if self._cdepth > 0:
                self.m.exposed_in_compute += t1 - t0
            elif self.own_compute:
                self._pipe_exposed.append((t0, t1))

    def pipeline_compute(self, spans: list[tuple[float, float]], busy: float) -> None:
        """The pipeline's actions [(t0, t1)], `busy` µs in all, ran on the training thread:
        its compute, less the exposed waits inside them (a DataParallel sync in the last
        backward)."""
        inside = _overlap(sorted(spans), self._pipe_exposed)
        self.own_compute, self._pipe_exposed = False, []
        if self._step_t0 is not None and spans:
            self.m.compute += busy
            self.m.exposed_in_compute += inside
            self._last_end = max(self._last_end, max(b for _, b in spans))
