"""Strategies that wrap a user's model: DataParallel, ZeRO (zero/), tensor parallel
(tensor/), pipeline (pipeline/), and `parallelize`, which composes them over a Mesh."""

from disttrain.deprecation import moved_module
from disttrain.parallel.config import Parallelism
from disttrain.parallel.data_parallel import DataParallel
from disttrain.parallel.parallelize import ParallelModel, parallelize, token_loss
from disttrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from disttrain.parallel.zero import Zero

__all__ = ["DataParallel", "ParallelModel", "Parallelism", "SyncBatchNorm", "Zero",
           "convert_sync_batchnorm", "parallelize", "token_loss"]

# NOTE: deprecated for one release: the dtype rule is every package's (disttrain/dtypes.py).
moved_module("disttrain.parallel.dtypes", "disttrain.dtypes")
