"""How many bytes this rank holds in model states: parameters, gradients, optimizer.

ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, sec. 3.1) calls these three the
*model states*; `disttrain.plan` has the paper's formulas, this module measures.
Measuring counts each distinct storage once (a parameter that is a view of a flat
bucket costs the bucket, once), so the numbers are what the allocator really holds
for those tensors, padding included. A `Zero` in mixed precision counts its fp32
master weights as optimizer state, as the paper's K does (Adam: 4 + 8 = 12 bytes). Activations and temporary buffers are not model
states; `peak_allocated` (CUDA only: torch's allocator statistics) covers everything.

Who talks to whom: called by users, benchmarks and tests on a `Zero`, a
`DataParallel` or a plain module (+ optimizer); reads tensors, never communicates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelState", "model_state", "storage_bytes", "peak_allocated"]


@dataclass(frozen=True)
class ModelState:
    """Bytes held by this rank in each kind of model state."""

    params: int
    grads: int
    optimizer: int
    peak_allocated: int | None = None  # device allocator's high-water mark, if it has one

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __str__(self) -> str:
        peak = "n/a" if self.peak_allocated is None else _human(self.peak_allocated)
        return (f"params {_human(self.params)}, grads {_human(self.grads)}, "
                f"optimizer {_human(self.optimizer)}, total {_human(self.total)}, "
                f"peak allocated {peak}")


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor (torch FSDP2, TP): count this rank's piece
            t = t.to_local()
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def peak_allocated(device: torch.device | None = None) -> int | None:
    """The device allocator's peak bytes since start (CUDA); None where there is none (CPU)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def _optimizer_tensors(opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelState:
    """Measure this rank's model-state bytes (does not block, no communication).

    `model` is a `disttrain.Zero` (its own optimizer is used; `optimizer` must be None),
    or any module, e.g. a DataParallel, with the `optimizer` that trains it.
    """
    held = getattr(model, "held_tensors", None)
    if held is not None:
        if optimizer is not None:
            raise ValueError("model_state(zero_model): Zero owns its optimizer; "
                             "do not pass one")
        tensors = held()
        params, grads, opt = tensors["params"], tensors["grads"], tensors["optimizer"]
    else:
        params = list(model.parameters())
        grads = [p.grad for p in params]
        opt = _optimizer_tensors(optimizer)
    device = next((t.device for t in params), None)
    return ModelState(storage_bytes(params), storage_bytes(grads), storage_bytes(opt),
                      peak_allocated(device))
