"""Parallel strategies that wrap a user's model (data parallel; more to come)."""

from disttrain.parallel.data_parallel import DataParallel

__all__ = ["DataParallel"]
