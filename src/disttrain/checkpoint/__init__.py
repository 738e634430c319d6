"""Layout-independent, verified, atomically committed checkpoints.

`Checkpointer(directory, keep=3)`: every rank calls `save(step, model=, optimizer=,
loader=, extra=)` and `load(...) -> step`. Files are safetensors plus a JSON manifest
(manifest.py) recording each tensor's global shape and the slice each file holds, so a
checkpoint saved under one layout loads under another (reshard.py); tensor- and
pipeline-parallel models and their optimizers are saved under the unsharded model's
parameter names (modules.py), so tp/pp 2 -> 1 and back load the same values. See
docs/design/checkpoints.md for the format and the `sharded_state_dict()` protocol.
"""

from disttrain.checkpoint.checkpointer import Checkpointer
from disttrain.checkpoint.manifest import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    CorruptCheckpointError,
)
from disttrain.checkpoint.protocols import LoadsShardedState, ShardedState, StageModel
from disttrain.checkpoint.reshard import ShardedTensor, even_slice, shard_of

__all__ = [
    "Checkpointer",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "LoadsShardedState",
    "ShardedState",
    "ShardedTensor",
    "StageModel",
    # for a layer that declares its slice of a global tensor in sharded_state_dict()
    "even_slice",
    "shard_of",
]
