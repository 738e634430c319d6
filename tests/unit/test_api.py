"""The public API is a decision: every package's `__all__`, snapshotted.

A change here is a change of the API a user imports: make it on purpose, in the same
commit as the code, and say so. Every name listed must exist, and every package is listed.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys

import pytest

import disttrain

API = {'disttrain': ['Checkpointer', 'CollectiveError', 'DataParallel', 'FiniteGradCheck',
               'LossScaler', 'Mesh', 'MeshShape', 'NonFiniteGradError', 'ParallelModel', 'Parallelism', 'SyncBatchNorm', 'Zero',
               'backend', 'comm', 'convert_sync_batchnorm', 'data', 'device', 'init',
               'is_initialized', 'local_rank', 'local_world_size', 'log', 'memory',
               'parallelize', 'preempted', 'print0', 'ps', 'rank', 'role', 'shutdown', 'testing',
               'token_loss', 'trace', 'world_size'],
 'disttrain.checkpoint': ['CheckpointError', 'CheckpointMismatchError', 'CheckpointWarning',
                          'Checkpointer', 'CorruptCheckpointError', 'LoadsShardedState',
                          'ShardedState', 'ShardedTensor', 'StageModel', 'even_slice',
                          'shard_of'],
 'disttrain.cluster': [],
 'disttrain.comm': ['BF16Compression', 'CollectiveError', 'Compression', 'FP16Compression',
                    'NoCompression', 'all_gather', 'all_gather_into_tensor', 'all_reduce',
                    'barrier', 'broadcast', 'irecv', 'isend', 'recv',
                    'reduce_scatter_tensor', 'send'],
 'disttrain.launch': ['RunConfig', 'run'],
 'disttrain.models': ['GPT', 'GPTConfig'],
 'disttrain.parallel': ['DataParallel', 'ParallelModel', 'Parallelism', 'Pipeline', 'Stages',
                        'Survey', 'SyncBatchNorm', 'Zero', 'apply_data_parallel',
                        'apply_recompute', 'apply_tp', 'convert_sync_batchnorm', 'parallelize',
                        'split_stages', 'survey', 'tie_stages', 'token_loss'],
 'disttrain.parallel.pipeline': ['Action', 'Pipeline', 'SCHEDULES', 'check_schedule', 'gpipe',
                                 'interleaved_1f1b', 'make_schedule', 'one_f_one_b',
                                 'peak_in_flight', 'simulate', 'time_layers',
                                 'zero_bubble_h1'],
 'disttrain.parallel.tensor': ['ColumnParallelLinear', 'RowParallelLinear', 'STYLES',
                               'TPPlan', 'VocabParallelEmbedding', 'apply_tp', 'gpt2_plan',
                               'llama_plan', 'plan_for', 'tied_names',
                               'vocab_parallel_cross_entropy'],
 'disttrain.parallel.zero': ['LossScaler', 'Zero', 'ZeroOptimizer'],
 'disttrain.plan': ['MemoryPlan', 'OPTIMIZERS', 'PRECISIONS', 'add_plan_parser',
                     'bytes_per_param', 'model_state_bytes', 'plan_table'],
 'disttrain.ps': ['Async', 'Cancelled', 'Decision', 'Handle', 'HashRing', 'KAsync',
                  'KBatchAsync', 'KBatchSync', 'KSync', 'PSError', 'Policy', 'SSP',
                  'Straggler', 'Sync', 'TopK', 'Worker', 'attach', 'backup_workers',
                  'connect', 'drain', 'join', 'joined', 'joining', 'serve'],
 'disttrain.trace': ['data', 'end_step', 'is_active', 'merge', 'problems', 'start', 'stop']}

# Old name -> new name: removed from a face or moved, kept for one release; each warns.
DEPRECATED = {
    "disttrain.comm.recorder": "disttrain.comm.ops.recorder",
    "disttrain.trace.log": "disttrain.log",
    "disttrain.trace.on_init": "disttrain.trace.session.on_init",
    "disttrain.trace.clear": "disttrain.trace.merge.clear",
    "disttrain.trace.parse_steps": "disttrain.trace.recorder.parse_steps",
    "disttrain.ps.parse_straggler": "disttrain.ps.Straggler.parse",
    "disttrain.parallel.zero.CommStats": "disttrain.parallel.zero.comm.CommStats",
    "disttrain.cluster.model.choose_algorithm": "disttrain.comm.cost.choose_algorithm",
    "disttrain.cluster.model.Links": "disttrain.comm.cost.Links",
    "disttrain.cluster.run.run_in_cluster": "disttrain.launch.cluster_run.run_in_cluster",
    "disttrain.parallel.dtypes.upcast_half": "disttrain.dtypes.upcast_half",
}


def _lookup(dotted: str):
    """The object at `dotted`: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            value = getattr(value, name)
        return value
    raise ImportError(dotted)


def packages() -> list[str]:
    return ["disttrain"] + sorted(m.name for m in pkgutil.walk_packages(disttrain.__path__, "disttrain.")
                                  if m.ispkg)


def test_every_package_face_is_the_snapshot():
    assert sorted(API) == packages()
    for name in packages():
        module = importlib.import_module(name)
        assert sorted(getattr(module, "__all__", [])) == API[name], name


def test_every_exported_name_exists():
    for name, exported in API.items():
        module = importlib.import_module(name)
        missing = [n for n in exported if not hasattr(module, n)]
        assert not missing, f"{name} exports missing names {missing}"


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_every_deprecated_alias_warns_with_its_new_name(old):
    module, _, name = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {DEPRECATED[old]}")):
        value = getattr(importlib.import_module(module), name)
    assert value == _lookup(DEPRECATED[old])


def test_import_does_not_load_dynamo():
    """`import disttrain` costs no torch._dynamo import (about a second per rank): the
    compile-aware parts load it only under torch.compile (disttrain/compiling.py)."""
    code = "import sys, disttrain; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "a module imports torch._dynamo at import time"
