"""Strategies that wrap a user's model: DataParallel, ZeRO (zero/), tensor parallel
(tensor/), pipeline (pipeline/), and `parallelize`, which composes them over a Mesh.

The steps `parallelize` composes are public and take plain arguments (steps.py): a
user may call `survey`, `apply_tp`, `apply_recompute`, `split_stages`, `tie_stages`,
`apply_data_parallel` and `Pipeline` alone, on a model of their own."""

from disttrain.deprecation import moved_module
from disttrain.parallel.config import Parallelism
from disttrain.parallel.data_parallel import DataParallel
from disttrain.parallel.parallelize import ParallelModel, parallelize, token_loss
from disttrain.parallel.pipeline import Pipeline
from disttrain.parallel.recompute import apply_recompute
from disttrain.parallel.steps import (
    Stages,
    Survey,
    apply_data_parallel,
    split_stages,
    survey,
    tie_stages,
)
from disttrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from disttrain.parallel.tensor import apply_tp
from disttrain.parallel.zero import Zero

__all__ = ["DataParallel", "ParallelModel", "Parallelism", "Pipeline", "Stages", "Survey",
           "SyncBatchNorm", "Zero", "apply_data_parallel", "apply_recompute", "apply_tp",
           "convert_sync_batchnorm", "parallelize", "split_stages", "survey", "tie_stages",
           "token_loss"]

# NOTE: deprecated for one release: the dtype rule is every package's (disttrain/dtypes.py).
moved_module("disttrain.parallel.dtypes", "disttrain.dtypes")
