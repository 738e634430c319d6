"""State trees <-> (JSON skeleton, named tensors), and every rank's RNG state, without pickle.

A state dict (a model's, an optimizer's with its integer keys and `betas` tuples, a
sampler's, the user's `extra`) is a tree of dicts, lists, tuples, scalars and tensors.
`encode` splits it into a JSON skeleton, where each tensor is replaced by
`{"__tensor__": path}`, and a flat `{path: tensor}` map for safetensors; `decode` puts it
back together. Types that JSON cannot say exactly are tagged (`__tuple__`, `__intdict__`);
anything else is refused with the path of the offending value, so nothing is pickled.

RNG: torch's CPU generator state is a uint8 tensor (and CUDA's, when present); Python's
`random` and numpy's legacy global state are lists of ints, kept in JSON.

Pure code: no processes, no files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from disttrain.checkpoint.modules import module_state
from disttrain.checkpoint.protocols import ShardedState
from disttrain.checkpoint.reshard import ShardedTensor

__all__ = [
    "capture_rng",
    "decode",
    "encode",
    "leaves",
    "merge",
    "prune",
    "restore_rng",
    "state_of",
    "state_owner",
]

_TAGS = ("__tensor__", "__tuple__", "__intdict__")
_SCALARS = (type(None), bool, int, float, str)


def state_owner(obj: Any) -> Any:
    """The object whose state a checkpoint stores for `obj`: `obj` itself, or the module
    a wrapper holds when the wrapper's state is exactly that module's (so
    `DataParallel(m)` saves and loads as `m`, and either loads into the other)."""
    while not isinstance(obj, ShardedState):
        inner = getattr(obj, "module", None)
        if not (isinstance(obj, nn.Module) and isinstance(inner, nn.Module)):
            break
        if set(obj.state_dict()) != {f"module.{k}" for k in inner.state_dict()}:
            break
        obj = inner
    return obj


def state_of(obj: Any) -> Any:
    """What a checkpoint stores for `obj`: its owner's `sharded_state_dict()` if it has
    one; for a module, its state under global names with tensor-parallel slices as
    `ShardedTensor`s (modules.py); else its `state_dict()`. Does not block (unless the
    object's method does)."""
    owner = state_owner(obj)
    if isinstance(owner, ShardedState):
        return owner.sharded_state_dict()
    if isinstance(owner, nn.Module):
        return module_state(owner)
    return owner.state_dict()


def encode(tree: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor | ShardedTensor]]:
    """(skeleton, tensors): tensors keyed by `prefix/key/key...` paths. Does not block."""
    tensors: dict[str, torch.Tensor | ShardedTensor] = {}
    return _encode(tree, prefix, tensors), tensors


def _encode(node: Any, path: str, tensors: dict) -> Any:
    if isinstance(node, (torch.Tensor, ShardedTensor)):
        if path in tensors:
            raise ValueError(f"two tensors map to the checkpoint name {path!r}; rename a key")
        tensors[path] = node
        return {"__tensor__": path}
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(node)]
    if isinstance(node, dict):
        if all(isinstance(k, str) for k in node):
            for k in node:
                if k in _TAGS:
                    raise ValueError(f"{path}: the key {k!r} is reserved by the checkpoint format")
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in node.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in node):
            return {"__intdict__": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in node.items()]}
        raise TypeError(
            f"{path}: dict keys must be all str or all int, got "
            f"{sorted({type(k).__name__ for k in node})}"
        )
    raise TypeError(
        f"{path}: cannot checkpoint a {type(node).__name__}; use tensors, numbers, strings, "
        "bools, None, lists, tuples or dicts (checkpoints never pickle). For a numpy value "
        "pass torch.from_numpy(x) or x.item()"
    )


def decode(skeleton: Any, fetch: Callable[[str], Any]) -> Any:
    """Rebuild the tree; `fetch(path)` supplies each tensor (may block on file reads)."""
    if isinstance(skeleton, list):
        return [decode(v, fetch) for v in skeleton]
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return fetch(skeleton["__tensor__"])
        if set(skeleton) == {"__tuple__"}:
            return tuple(decode(v, fetch) for v in skeleton["__tuple__"])
        if set(skeleton) == {"__intdict__"}:
            return {int(k): decode(v, fetch) for k, v in skeleton["__intdict__"]}
        return {k: decode(v, fetch) for k, v in skeleton.items()}
    return skeleton


def leaves(skeleton: Any) -> Iterator[str]:
    """Every tensor path in a skeleton, in order."""
    if isinstance(skeleton, list):
        for v in skeleton:
            yield from leaves(v)
    elif isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            yield skeleton["__tensor__"]
        else:
            for v in skeleton.values():
                yield from leaves(v)


def prune(skeleton: Any, keep: set[str]) -> Any:
    """The skeleton without the tensors not in `keep` (another rank's pieces); a pruned
    list item becomes None so positions do not shift."""
    if isinstance(skeleton, list):
        return [prune(v, keep) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    tag = _tag(skeleton)
    if tag == "__tensor__":
        return skeleton if skeleton[tag] in keep else None
    if tag == "__intdict__":
        return {tag: [[k, prune(v, keep)] for k, v in skeleton[tag] if not _dropped(v, keep)]}
    if tag == "__tuple__":
        return {tag: prune(skeleton[tag], keep)}
    return {k: prune(v, keep) for k, v in skeleton.items() if not _dropped(v, keep)}


def _dropped(node: Any, keep: set[str]) -> bool:
    return isinstance(node, dict) and _tag(node) == "__tensor__" and node["__tensor__"] not in keep


def _tag(node: dict) -> str | None:
    return next(iter(node)) if len(node) == 1 and next(iter(node)) in _TAGS else None


def merge(a: Any, b: Any, path: str) -> Any:
    """The union of two ranks' skeletons (keys one rank lacks come from the other).

    Raises ValueError naming the path where both hold a value and the values differ:
    replicated hyperparameters must agree, keys may be spread over ranks (pipeline
    stages each hold their own layers).
    """
    if isinstance(a, dict) and isinstance(b, dict) and _tag(a) == _tag(b):
        tag = _tag(a)
        if tag == "__intdict__":
            out = {k: v for k, v in a[tag]}
            for k, v in b[tag]:
                out[k] = merge(out[k], v, f"{path}/{k}") if k in out else v
            return {tag: [[k, v] for k, v in out.items()]}
        if tag == "__tuple__":
            return {tag: merge(a[tag], b[tag], path)}
        if tag is None:
            out = dict(a)
            for k, v in b.items():
                out[k] = merge(a[k], v, f"{path}/{k}") if k in a else v
            return out
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [merge(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b))]
    if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
        raise ValueError(f"{path}: {json.dumps(a)[:80]} on one rank, {json.dumps(b)[:80]} on another")
    return a


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's RNG states: (JSON part, tensor part). Does not block."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {
        "python": [version, list(mt), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    return state, tensors


def restore_rng(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Set this process's RNGs to a state from `capture_rng`. Does not block."""
    version, mt, gauss_next = state["python"]
    random.setstate((version, tuple(mt), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(tensors["torch"].to(torch.uint8).contiguous())
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"].to(torch.uint8).contiguous())
