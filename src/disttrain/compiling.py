"""`not_traced`: run a host-side function eagerly under `torch.compile`, without importing
torch._dynamo (about a second) in a process that never compiles.

`torch.compiler.disable` imports Dynamo when it decorates, so every rank of every job
paid for it at `import disttrain`. Here the eager path is a plain call; under compile
the call goes through `torch._disable_dynamo` (torch's own lazy form of the same
decorator, which Dynamo does not trace), so Dynamo breaks the graph there and runs the
function with tracing off, as `torch.compiler.disable` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["not_traced"]

F = TypeVar("F", bound=Callable)


def not_traced(fn: F) -> F:
    """`fn`, run eagerly (a graph break at its call) when torch.compile traces a caller."""
    disabled = torch._disable_dynamo(fn)  # NOTE: imports Dynamo at its first call only

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
