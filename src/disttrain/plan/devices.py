"""The device table `disttrain plan layout` prices layouts with: plan/devices.json.

Each device is a peak FLOP/s per dtype, the share of it a large matmul reaches, memory
(what a process can allocate, less the CUDA context and the allocator's fragmentation)
and its bandwidth (datasheet x the share a copy kernel reaches), and the two links a layout's collectives cross (inside a node, one
NIC per device across nodes), every number with its source (printed by `--explain`).
The file is package data read with the standard library: nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources

from disttrain.comm.cost import Links
from disttrain.plan.profiled import LayerProfile

__all__ = ["Device", "DEVICES", "device"]


@dataclass(frozen=True)
class Device:
    """One row of devices.json (rates in FLOP/s and bytes/s, memory in bytes)."""

    key: str
    name: str
    peak_flops: dict
    """dtype -> dense peak FLOP/s."""
    matmul_efficiency: float
    """Achieved / peak FLOP/s of a large matmul (a cited measurement)."""
    memory_bytes: float
    """What one process can allocate (PyTorch's total capacity), before the reserve."""
    hbm_Bps: float
    """Device memory bandwidth (datasheet)."""
    intra_Bps: float
    """Ring bus bandwidth between devices of one node (an all-reduce moves 2(n-1)/n S at it)."""
    intra_alpha: float
    inter_Bps: float
    """Bytes/s of one device's share of its node's network (one NIC per device)."""
    inter_alpha: float
    sources: dict
    """field -> where its number comes from."""
    step_alpha: float = 0.0
    """comm/cost.py's CPU pool terms (emulated clusters on one machine); GPUs leave them out."""
    cpu_Bps: float = math.inf
    cpu_local_Bps: float = math.inf
    shared_cpu: bool = False
    shared_machine: bool = False
    """True when all N devices are processes of one machine: each gets 1/N of its rates."""
    hbm_efficiency: float = 1.0
    """Achieved / datasheet bandwidth of a copy kernel (a cited measurement)."""
    context_bytes: float = 0.0
    """Memory the CUDA context holds before any tensor."""
    fragmentation: float = 0.0
    """Share of the rest the caching allocator loses to fragmentation (a cited measurement)."""
    profile: LayerProfile | None = None
    """Measured layer seconds (`--profile`): compute comes from them, not from FLOPs."""

    @property
    def memory_Bps(self) -> float:
        """Bytes/s memory-bound (non-matmul) work reaches: hbm_Bps x hbm_efficiency."""
        return self.hbm_Bps * self.hbm_efficiency

    @property
    def usable_bytes(self) -> float:
        """What "fits" compares with: (memory_bytes - context_bytes) x (1 - fragmentation)."""
        return (self.memory_bytes - self.context_bytes) * (1 - self.fragmentation)

    def per_rank(self, n: int) -> Device:
        """What one of `n` ranks gets: the device itself, or 1/n of a shared machine."""
        if not self.shared_machine or n == 1:
            return self
        return replace(self, peak_flops={k: v / n for k, v in self.peak_flops.items()},
                       hbm_Bps=self.hbm_Bps / n, memory_bytes=self.memory_bytes / n,
                       profile=self.profile.shared(n) if self.profile else None)

    def matmul_flops(self, dtype: str) -> float:
        """FLOP/s a large matmul reaches in `dtype`: peak x matmul_efficiency."""
        if dtype not in self.peak_flops:
            raise ValueError(f"device {self.key!r} has no {dtype} peak in devices.json; "
                             f"it has {', '.join(sorted(self.peak_flops))}")
        return self.peak_flops[dtype] * self.matmul_efficiency

    def links(self, nics: float = 1.0) -> Links:
        """comm/cost.py's Links for one group: its node link is `nics` of the per-device NICs."""
        return Links(alpha=self.inter_alpha, link_Bps=self.inter_Bps * nics,
                     local_alpha=self.intra_alpha, local_Bps=self.intra_Bps,
                     step_alpha=self.step_alpha, cpu_Bps=self.cpu_Bps,
                     cpu_local_Bps=self.cpu_local_Bps, shared_cpu=self.shared_cpu)


@cache
def _table() -> dict[str, Device]:
    text = resources.files("disttrain.plan").joinpath("devices.json").read_text()
    rows = {k: v for k, v in json.loads(text).items() if not k.startswith("_")}
    out = {}
    for key, row in rows.items():
        sources = {k[: -len("_source")]: v for k, v in row.items() if k.endswith("_source")}
        fields = {k: v for k, v in row.items() if not k.endswith("_source")}
        out[key] = Device(key=key, sources=sources, **fields)
    return out


DEVICES = tuple(_table())
"""The device names devices.json defines (`--device` takes one)."""


def device(key: str) -> Device:
    """The device called `key`; a ValueError naming the known ones otherwise."""
    table = _table()
    if key not in table:
        raise ValueError(f"unknown device {key!r}; devices.json defines {', '.join(table)}")
    return table[key]
