"""Cut a model into pipeline stages by layers, balanced by parameter count or cost.

A model that can be pipelined names its layers in forward order (`pipeline_layers()`,
e.g. ["embed", "blocks.0", ..., "head"]) and its forward skips layers that are gone
(`None` attributes, missing `ModuleDict` keys), as `disttrain.models.GPT` does. A stage is
then a shallow copy of the model holding only its layers: the same Parameter objects,
the same parameter names as the whole model (so checkpoints and reference checks line
up), and no copy of the weights.

Pure: no process talks to another here.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

__all__ = ["partition", "layer_names", "layer_costs", "time_layers", "keep_layers", "split_model"]


def partition(costs: list[float], num_parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges over `costs` minimising the largest part's sum."""
    n = len(costs)
    if num_parts < 1 or n < num_parts:
        raise ValueError(f"cannot cut {n} layers into {num_parts} non-empty pipeline parts; "
                         "use fewer stages (or virtual stages) or a model with more layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-part cost of cutting layers[:i] into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, i = [], n
    for k in range(num_parts, 0, -1):
        ranges.append((cut[k][i], i))
        i = cut[k][i]
    return ranges[::-1]


def layer_names(model: nn.Module, layers: list[str] | None) -> list[str]:
    if layers is not None:
        return list(layers)
    if not hasattr(model, "pipeline_layers"):
        raise TypeError(f"{type(model).__name__} does not name its layers: give layers=[...] "
                        "(module names in forward order) or define pipeline_layers()")
    return list(model.pipeline_layers())


def layer_costs(model: nn.Module, layers: list[str]) -> list[float]:
    """Parameter count of each named layer (the default balancing cost)."""
    return [float(sum(p.numel() for p in model.get_submodule(n).parameters())) for n in layers]


def time_layers(model: nn.Module, example_input: torch.Tensor, layers: list[str] | None = None,
                repeats: int = 3) -> list[float]:
    """Measured seconds of forward + backward of each layer on `example_input` (a cost).

    Runs the layers one after the other in this process (no communication), each alone
    as a one-layer stage, and returns the median of `repeats` timings per layer.
    """
    names = layer_names(model, layers)
    x, out = example_input, []
    for name in names:
        layer = keep_layers(model, names, [name])
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(inp)
            y.backward(torch.ones_like(y))
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
        x = y.detach()
    model.zero_grad(set_to_none=True)
    return out


def keep_layers(model: nn.Module, layers: list[str], keep: list[str]) -> nn.Module:
    """A shallow copy of `model` without the layers in `layers` that are not in `keep`."""
    drop = set(layers) - set(keep)
    return _pruned(model, "", drop)


def _pruned(module: nn.Module, prefix: str, drop: set[str]) -> nn.Module:
    new = copy.copy(module)  # shares parameters; only the child table is new
    new._modules = dict(module._modules)
    for name, child in module._modules.items():
        path = prefix + name
        if path in drop:
            if isinstance(module, nn.ModuleDict):
                del new._modules[name]
            else:
                new._modules[name] = None
        elif child is not None and any(d.startswith(path + ".") for d in drop):
            new._modules[name] = _pruned(child, path + ".", drop)
    return new


def split_model(model: nn.Module, num_stages: int, stage: int, num_virtual: int = 1,
                layers: list[str] | None = None,
                costs: list[float] | None = None) -> list[nn.Module]:
    """The model chunks of pipeline `stage`: chunk c is virtual stage c * num_stages + stage.

    Layers are cut into num_stages * num_virtual contiguous parts balanced by `costs`
    (one per layer: measured times, say), by parameter count when not given.
    """
    names = layer_names(model, layers)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    costs = layer_costs(model, names) if costs is None else list(costs)
    if len(costs) != len(names):
        raise ValueError(f"got {len(costs)} costs for {len(names)} layers {names}")
    ranges = partition(costs, num_stages * num_virtual)
    return [keep_layers(model, names, names[slice(*ranges[c * num_stages + stage])])
            for c in range(num_virtual)]
