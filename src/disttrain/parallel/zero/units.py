"""Stage 3's units: which module's forward gathers which parameters, and the check, in
the first eager forward, that no forward reads a parameter its unit has not gathered.

A unit is gathered in the forward pre-hook of the module that owns its parameters and
freed after that module's forward. Some forwards read their submodules' parameters
directly instead of calling the submodule: `nn.MultiheadAttention` hands
`out_proj.weight` to `F.multi_head_attention_forward`. Such a module is gathered *whole*
at its own forward, its submodules' parameters with it, as FSDP wraps at the parent and
DeepSpeed's ZeRO-3 treats "leaf modules". torch's are listed in `WHOLE`
(`nn.TransformerEncoderLayer`'s inference fast path reads every weight of the layer too,
but it is never taken while forward hooks are attached, and stage 3's are); a user
passes their own classes (`Zero(..., whole_modules=[Block])`). A pattern not listed is
caught by `ReadCheck` during the first eager forward and refused with the module and
the fix, not with torch's storage error.

Who talks to whom: stage3.ParamShards calls `owned_by_gatherer` once and hands out a
`ReadCheck` that api.Zero.forward enters around the first eager forward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["WHOLE", "ReadCheck", "owned_by_gatherer"]

WHOLE: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
"""torch modules whose forward reads their submodules' parameters directly."""

# Tensor methods that read metadata only (shape, dtype, device, requires_grad: the
# property getters are `__get__`), which a freed unit answers: never refused.
_METADATA = frozenset({"__get__", "size", "dim", "ndimension", "numel", "nelement", "stride",
                       "storage_offset", "is_contiguous", "element_size", "data_ptr",
                       "is_floating_point", "is_complex", "get_device", "__len__", "__hash__"})

Entry = tuple[nn.Module, str, str, nn.Parameter]  # (owner, state_dict key, attribute, param)


def owned_by_gatherer(module: nn.Module, whole: tuple[type[nn.Module], ...]
                      ) -> dict[nn.Module, list[Entry]]:
    """Trainable parameters by the module whose forward gathers them: the outermost
    module of a `whole` type around their owner, else the owner itself (in
    `named_modules` order, shared modules under each of their names)."""
    tops: list[tuple[str, nn.Module]] = []  # (prefix, module) of the whole modules met
    owned: dict[nn.Module, list[Entry]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        gatherer = next((g for p, g in tops if _inside(prefix, p)), None)
        if gatherer is None and isinstance(m, whole):
            tops.append((prefix, m))
            gatherer = m
        for n, p in m._parameters.items():
            if p is not None and p.requires_grad:
                key = f"{prefix}.{n}" if prefix else n
                owned.setdefault(gatherer or m, []).append((m, key, n, p))
    return owned


def _inside(prefix: str, top: str) -> bool:
    return top == "" or prefix == top or prefix.startswith(top + ".")


class ReadCheck(TorchFunctionMode):
    """Refuses a torch function that reads a stage-3 parameter whose unit is not gathered
    (a forward reading a submodule's parameter without calling the submodule).

    `names`: (state_dict key, owner, attribute, unit, index) of every bound parameter
    of `root`; `rank` goes into the message. Costs one Python call per torch function: entered for
    the first eager forward only (ParamShards.read_check). Metadata reads (`_METADATA`)
    pass.
    """

    def __init__(self, root: nn.Module, names, rank: int):
        super().__init__()
        self.root, self.names, self.rank = root, names, rank
        self.units = {id(u.full): u for *_, u, _ in names}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _METADATA:
            return func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and t._base is not None:
                unit = self.units.get(id(t._base))
                if unit is not None and not unit.gathered:
                    raise RuntimeError(self._message(t, func))
        return func(*args, **(kwargs or {}))

    def _message(self, t: torch.Tensor, func) -> str:
        key = next((k for k, owner, n, _, _ in self.names if getattr(owner, n) is t), "?")
        owner = key.rpartition(".")[0]
        parent = owner.rpartition(".")[0]
        reader = type(self.root.get_submodule(parent)).__name__
        where = f"`{parent}` ({reader})" if parent else f"the wrapped module ({reader})"
        return (f"ZeRO stage 3, rank {self.rank}: `{key}` was read by "
                f"{getattr(func, '__name__', func)} outside the forward of `{owner}`, the "
                f"only place its parameters are gathered: the forward of {where} reads it "
                f"without calling `{owner}`. Fix: Zero(..., whole_modules=[{reader}]) "
                "gathers that module whole at its own forward, its submodules' parameters "
                "with it (or use stage 2)")
