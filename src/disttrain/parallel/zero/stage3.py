"""ZeRO stage 3: parameters sharded too, gathered per layer just in time.
Follows ZeRO stage 3 (Rajbhandari et al. 2019, sec. 5.3) with FSDP's mechanics (Zhao et al. 2023).

Which module's forward gathers which parameters: units.py (a module whose forward reads
its submodules' parameters, as nn.MultiheadAttention, is gathered whole).

Who talks to whom: api.Zero drives this; module hooks call back into `_pre_forward`,
`_post_forward`, `_pre_backward_of` and `_on_full_grad_of`; those call comm.py.

More (the design and its reasons): docs/design/zero.md, "Notes from parallel/zero/stage3.py".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from disttrain.parallel.zero import comm
from disttrain.parallel.zero.flat import Piece, Segment
from disttrain.parallel.zero.mixed import accumulate_shard_grad
from disttrain.parallel.zero.units import WHOLE, ReadCheck, owned_by_gatherer

__all__ = ["ParamShards"]

_MAX_INFLIGHT = 2  # reduce-scatters in flight during backward (bounds transient grads)


class _Unit:
    """One module's own trainable parameters as a sharded flat buffer."""

    def __init__(self, params, world, rank):
        self.numels = [p.numel() for p in params]
        self.param_ids = [id(p) for p in params]
        self.shapes = [p.shape for p in params]
        payload = sum(self.numels)
        numel = -(-payload // world) * world
        self.pad = numel - payload
        p0 = params[0]
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"ZeRO stage 3 flattens a module's own parameters into one "
                             f"buffer, but they mix {sorted(map(str, kinds))}; give each "
                             "dtype/device its own submodule, or use stage 2")
        flat = torch.zeros(numel, dtype=p0.dtype, device=p0.device)  # (numel,)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[:payload])
        size = numel // world
        self.shard = nn.Parameter(flat[rank * size:(rank + 1) * size].clone())  # (S,)
        self.full = torch.empty(numel, dtype=p0.dtype, device=p0.device).requires_grad_()
        self.rgrad = None  # with reduce_dtype: (S,) shard gradient in it
        self.numel, self.nbytes = numel, numel * flat.element_size()
        self.work = None  # all-gather in flight
        self.views: list[torch.Tensor] = []
        self.make_views()  # NOTE: views need a real storage to be made; free after
        self.full.untyped_storage().resize_(0)  # (numel,) leaf; storage only while in use

    def make_views(self) -> None:
        """Fresh per-parameter views of `full` (new autograd edges for this forward)."""
        parts = self.full.split(self.numels + [self.pad])
        self.views = [t.view(s) for t, s in zip(parts, self.shapes)]

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0


class ParamShards:
    """Stage 3 over `module` (its trainable parameters become per-unit shards)."""

    def __init__(self, module: nn.Module, group, stats: comm.CommStats,
                 group_of: dict[int, int] | None = None,
                 reduce_dtype: torch.dtype | None = None, separate: set[int] = frozenset(),
                 whole: tuple[type[nn.Module], ...] = ()):
        self.group, self.stats = group, stats
        self.reduce_dtype, self._separate = reduce_dtype, separate
        self._group_of = group_of or {}
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.units: list[_Unit] = []
        # hooked module -> (module owning the attribute, attribute, unit, index in unit)
        self.binds: dict[nn.Module, list[tuple[nn.Module, str, _Unit, int]]] = {}
        self.names: list[tuple[str, nn.Module, str, _Unit, int]] = []  # state_dict key first
        self.root = module
        self._build(module, WHOLE + tuple(whole))
        self._fwd_order: list[_Unit] = []
        self._recording = True
        self._reads_checked = False  # the first eager forward is (read_check)
        self._pending: list[tuple] = []
        self.live = self.peak = 0  # bytes of full buffers/grads this engine holds now, max
        # NOTE: the forward hooks are never traced (gathers, storage resizes, hooks on
        # outputs): under torch.compile Dynamo breaks the graph at each hooked module and
        # runs the hooks eagerly, as FSDP2's (torch.distributed.fsdp wraps them in
        # torch._dynamo.disable); the code between them compiles (zero.md has the counts).
        # torch.compiler.disable imports Dynamo, which building the optimizer (Zero, next)
        # does anyway; wrapping here, not in a frame of ours, keeps Dynamo from tracing a
        # wrapper frame each time a hook runs.
        pre, post = torch.compiler.disable(self._pre_forward), \
            torch.compiler.disable(self._post_forward)
        self._handles = []
        for m in self.binds:
            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post))

    def _build(self, module: nn.Module, whole: tuple[type[nn.Module], ...]) -> None:
        owned = owned_by_gatherer(module, whole)
        seen: dict[int, tuple[_Unit, int]] = {}
        for g, entries in owned.items():
            new = list({id(p): p for *_, p in entries if id(p) not in seen}.values())
            by_group: dict[tuple, list[nn.Parameter]] = {}
            for p in new:  # NOTE: one unit per optimizer group: groups never share a shard
                key = (self._group_of.get(id(p), 0), id(p) if id(p) in self._separate else 0)
                by_group.setdefault(key, []).append(p)
            for (gi, _), members in by_group.items():
                unit = _Unit(members, self.world, self.rank)
                unit.group = gi
                self.units.append(unit)
                for i, p in enumerate(members):
                    seen[id(p)] = (unit, i)
            for owner, key, n, p in entries:
                unit, i = seen[id(p)]
                self.binds.setdefault(g, []).append((owner, n, unit, i))
                self.names.append((key, owner, n, unit, i))
        for binds in self.binds.values():
            for owner, n, u, i in binds:
                if n in owner._parameters:
                    del owner._parameters[n]  # NOTE: now a plain attribute, rebound each forward
                setattr(owner, n, u.views[i])
        for u in self.units:
            u.full.register_post_accumulate_grad_hook(self._on_full_grad_of(u))
        if self.reduce_dtype == (self.units[0].shard.dtype if self.units else None):
            self.reduce_dtype = None

    def read_check(self) -> ReadCheck | None:
        """A mode to enter around the first forward (None after it, and under compile):
        refuses a read of a parameter outside its unit's forward (units.py)."""
        if self._reads_checked or torch.compiler.is_compiling():
            return None
        self._reads_checked = True
        return ReadCheck(self.root, self.names, self.rank)

    def shard_parameters(self) -> list[nn.Parameter]:
        return [u.shard for u in self.units]

    def shard_groups(self) -> list[int]:
        """The optimizer group index of each shard parameter (same order)."""
        return [u.group for u in self.units]

    def shard_grads(self) -> list[torch.Tensor | None]:
        """The reduced gradient of each shard (same order): `shard.grad`, or the one
        kept in `reduce_dtype`. Sums until prepare_step() averages them."""
        if self.reduce_dtype is None:
            return [u.shard.grad for u in self.units]
        return [u.rgrad for u in self.units]

    def separate_grad(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the gradient sum of `p`, which has a unit of its own
        (`separate`); zeros if it got none. Waits for reduce-scatters (blocks)."""
        self.finish()
        i, u = next((i, u) for i, u in enumerate(self.units) if id(p) in u.param_ids)
        if len(u.param_ids) != 1:
            raise ValueError("separate_grad needs a parameter given in `separate`")
        if self.shard_grads()[i] is None:
            self._add_shard_grad(u, torch.zeros(u.shard.numel(), device=u.shard.device,
                                                dtype=self.reduce_dtype or u.shard.dtype))
        return self.shard_grads()[i]

    def _add_shard_grad(self, u: _Unit, out: torch.Tensor) -> None:
        accumulate_shard_grad(u, out, self.reduce_dtype)

    def segments(self) -> list[Segment]:
        """Per shard parameter: its slice of its unit and the parameters in the unit."""
        out = []
        for u in self.units:
            size = u.shard.numel()
            offs = [sum(u.numels[:i]) for i in range(len(u.numels))]
            out.append(Segment(self.rank * size, (self.rank + 1) * size,
                               [Piece(*t) for t in zip(u.param_ids, offs, u.numels)]))
        return out

    # ---- gather / free -----------------------------------------------------------

    def _gather(self, u: _Unit, wait: bool) -> None:
        """Start (and with `wait`, finish) all-gathering unit `u` into its full buffer."""
        if not u.gathered:
            u.full.untyped_storage().resize_(u.nbytes)
            self._account(u.nbytes)
            alias = torch.empty(0, dtype=u.full.dtype, device=u.full.device)
            alias.set_(u.full.untyped_storage(), 0, (u.numel,))  # own version counter
            u.work = comm.all_gather(alias, u.shard.detach(), self.group, self.stats,
                                     async_op=True)
        if wait and u.work is not None:
            u.work.wait()
            u.work = None

    def _free(self, u: _Unit) -> None:
        if u.gathered:
            if u.work is not None:
                u.work.wait()
                u.work = None
            u.full.untyped_storage().resize_(0)
            self._account(-u.nbytes)

    def _account(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _units_of(self, m: nn.Module) -> list[_Unit]:
        return list({id(u): u for _, _, u, _ in self.binds[m]}.values())

    def _bind(self, m: nn.Module) -> None:
        for u in self._units_of(m):
            self._gather(u, wait=True)
            u.make_views()
        for owner, n, u, i in self.binds[m]:
            setattr(owner, n, u.views[i])

    def _neighbour(self, u: _Unit, step: int) -> _Unit | None:
        order = self._fwd_order
        if self._recording or u not in order:
            return None
        j = order.index(u) + step
        return order[j] if 0 <= j < len(order) else None

    # ---- hooks -------------------------------------------------------------------

    def _pre_forward(self, m: nn.Module, args) -> None:
        units = self._units_of(m)
        self._bind(m)
        if self._recording:
            self._fwd_order += [u for u in units if u not in self._fwd_order]
        nxt = self._neighbour(units[-1], +1)
        if nxt is not None:
            self._gather(nxt, wait=False)  # prefetch: overlaps this module's forward

    def _post_forward(self, m: nn.Module, args, output):
        units = self._units_of(m)
        for u in units:
            self._free(u)
        if torch.is_grad_enabled():
            leaves, _ = tree_flatten(output)
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_of(units))
        return output

    def _pre_backward_of(self, units):
        def hook(grad):
            for u in units:
                self._gather(u, wait=True)
            prev = self._neighbour(units[0], -1)
            if prev is not None:
                self._gather(prev, wait=False)  # prefetch the layer backward reaches next
            return None
        return hook

    def _on_full_grad_of(self, u: _Unit):
        def hook(full: torch.Tensor) -> None:
            grad = full.grad  # (numel,) sum of every use of the unit's parameters
            full.grad = None
            while len(self._pending) >= _MAX_INFLIGHT:
                self._wait_one()
            if self.reduce_dtype is not None:
                grad = grad.to(self.reduce_dtype)
            self._account(grad.numel() * grad.element_size())
            out = torch.empty(u.shard.numel(), dtype=grad.dtype, device=grad.device)  # (S,)
            work = comm.reduce_scatter(out, grad, self.group, self.stats, async_op=True)
            self._pending.append((work, grad, out, u))
            self._free(u)
        return hook

    @torch.no_grad()
    def _wait_one(self) -> None:
        work, grad, out, u = self._pending.pop(0)
        work.wait()
        self._account(-grad.numel() * grad.element_size())
        self._add_shard_grad(u, out)

    # ---- step --------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for every reduce-scatter, free every full buffer (blocks)."""
        self._recording = False
        while self._pending:
            self._wait_one()
        for u in self.units:
            self._free(u)

    @torch.no_grad()
    def prepare_step(self, average: bool = True) -> None:
        """Wait for reduce-scatters and (`average`) turn sums into means (blocks)."""
        self.finish()
        for g in self.shard_grads() if average else ():
            if g is not None:
                g.div_(self.world)

    def after_step(self) -> None:
        """Nothing to gather: the next forward gathers each unit as it needs it."""

    def zero_grad(self) -> None:
        self.finish()
        for u in self.units:
            u.shard.grad = u.rgrad = None

    def held(self) -> dict[str, list[torch.Tensor]]:
        params = [u.shard for u in self.units] + [u.full for u in self.units if u.gathered]
        grads = [g for g in self.shard_grads() if g is not None]
        return {"params": params, "grads": grads}

    # ---- full parameters for state_dict ---------------------------------------------

    @torch.no_grad()
    def full_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered and cloned, by state_dict key (blocks; collective)."""
        out, flats = {}, {}
        for u in self.units:
            flat = torch.empty(u.numel, dtype=u.shard.dtype, device=u.shard.device)
            comm.all_gather(flat, u.shard.detach(), self.group, self.stats)
            flats[id(u)] = flat.split(u.numels + [u.pad])
        for key, _, _, u, i in self.names:
            out[key] = flats[id(u)][i].view(u.shapes[i]).clone()
        return out

    @torch.no_grad()
    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy this rank's chunk of each parameter in `tensors` into the shards."""
        for key, _, _, u, i in self.names:
            off = sum(u.numels[:i])
            lo, hi = self.rank * u.shard.numel(), (self.rank + 1) * u.shard.numel()
            src = tensors[key].reshape(-1)
            a, b = max(lo, off), min(hi, off + u.numels[i])
            if a < b:
                u.shard[a - lo:b - lo].copy_(src[a - off:b - off])
