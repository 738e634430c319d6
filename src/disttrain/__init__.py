"""disttrain: distributed training of PyTorch models, every strategy behind one API.

This module only re-exports the public API; see docs/design/index.md for the layers.

NOTE: each re-export is imported when first asked for (PEP 562 `__getattr__`), so
`import disttrain` and the `disttrain` command's light subcommands (`cluster`, `--version`)
do not import torch (seconds); `from disttrain import X` and `disttrain.X` work as before.
"""

import importlib

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "CollectiveError",
    "DataParallel",
    "FiniteGradCheck",
    "LossScaler",
    "Mesh",
    "MeshShape",
    "NonFiniteGradError",
    "ParallelModel",
    "Parallelism",
    "SyncBatchNorm",
    "Zero",
    "backend",
    "comm",
    "convert_sync_batchnorm",
    "data",
    "ps",
    "device",
    "init",
    "is_initialized",
    "log",
    "local_rank",
    "local_world_size",
    "memory",
    "parallelize",
    "preempted",
    "print0",
    "rank",
    "role",
    "shutdown",
    "testing",
    "token_loss",
    "trace",
    "world_size",
]


# Where each re-export lives; None: the name is the submodule itself.
_HOMES = {
    "comm": None, "data": None, "memory": None, "ps": None, "testing": None, "trace": None,
    "Checkpointer": "disttrain.checkpoint",
    "CollectiveError": "disttrain.comm.ops",
    "FiniteGradCheck": "disttrain.finite", "NonFiniteGradError": "disttrain.finite",
    "Mesh": "disttrain.mesh", "MeshShape": "disttrain.mesh",
    "DataParallel": "disttrain.parallel",
    "Parallelism": "disttrain.parallel.config",
    "ParallelModel": "disttrain.parallel.parallelize",
    "parallelize": "disttrain.parallel.parallelize",
    "token_loss": "disttrain.parallel.parallelize",
    "SyncBatchNorm": "disttrain.parallel.sync_batchnorm",
    "convert_sync_batchnorm": "disttrain.parallel.sync_batchnorm",
    "LossScaler": "disttrain.parallel.zero", "Zero": "disttrain.parallel.zero",
    "preempted": "disttrain.preempt",
    "log": "disttrain.trace.events",
    **{name: "disttrain.runtime" for name in (
        "backend", "device", "init", "is_initialized", "local_rank", "local_world_size",
        "print0", "rank", "role", "shutdown", "world_size")},
}


def __getattr__(name: str):
    """NOTE: any other name is a submodule (`disttrain.runtime`), imported on first use."""
    home = _HOMES.get(name)
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(home or f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if home or err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(module, name) if home else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
