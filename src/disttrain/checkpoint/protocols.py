"""What the checkpoint code dispatches on: small `typing.Protocol`s instead of hasattr chains.

An object a user passes to `Checkpointer.save/load` is saved by what it can do:
- `ShardedState`: its state is slices of global tensors (`ShardedTensor`s): ZeRO's
  wrapper and optimizer, the tensor-parallel layers; saved as slices, resharded on load;
- `LoadsShardedState`: also takes such a state back after the pieces were filled in
  place (ZeRO's optimizer: hyperparameters, scalars, masters -> parameters);
- `StageModel`: a model split into pipeline stage chunks (`ParallelModel`) whose
  parameters live under the unsplit model's names;
- anything else: a module (global names, TP slices found inside) or `state_dict()`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

__all__ = ["LoadsShardedState", "ShardedState", "StageModel"]


@runtime_checkable
class ShardedState(Protocol):
    def sharded_state_dict(self) -> dict[str, Any]:
        """State with `ShardedTensor` leaves: this rank's slices of global tensors."""


@runtime_checkable
class LoadsShardedState(ShardedState, Protocol):
    def load_sharded_state_dict(self, tree: dict[str, Any]) -> None:
        """Finish loading after the checkpointer filled every slice in place."""


@runtime_checkable
class StageModel(Protocol):
    def local_modules(self) -> list[nn.Module]:
        """This rank's stage chunks, unwrapped, holding parameters under global names."""
