"""Bad input anywhere in disttrain gets an error that names the problem and a fix.

Each case calls one public entry point with one bad argument and checks: the exception
type, a message naming the problem, a message saying how to fix it, and that the error
is raised by disttrain itself (the traceback's last frame is in the disttrain package),
not deep inside torch. Cases that need a process group run in a world of one (an
in-process gloo group over a HashStore, torn down after each test).
"""

from __future__ import annotations

import os
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import disttrain
from disttrain import cli, comm, data, plan, ps, settings
from disttrain.checkpoint import CheckpointMismatchError
from disttrain.comm import buckets, compression
from disttrain.finite import FiniteGradCheck, NonFiniteGradError
from disttrain.launch.job import RunConfig, rank_env
from disttrain.models.gpt import GPTConfig
from disttrain.parallel import pipeline
from disttrain.parallel.pipeline import split
from disttrain.parallel.tensor import apply_tp

PACKAGE = os.path.dirname(os.path.abspath(disttrain.__file__)) + os.sep
HERE = os.path.abspath(__file__)


def nan_grads():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    check = FiniteGradCheck(model)
    x = torch.ones(4, 3)
    x[0, 0] = float("inf")
    model(x).sum().backward()
    check.check()


def straggler_ksync():
    ps.KSync(5).start([0, 1, 2])


def init_alone(**kwargs):
    if disttrain.is_initialized():
        pytest.skip("a process group is already up in this test process")
    disttrain.init(**kwargs)


def timeout_env():
    os.environ["DISTTRAIN_TIMEOUT"] = "ten"
    try:
        settings.refresh()
    finally:
        del os.environ["DISTTRAIN_TIMEOUT"]


# (id, call, exception type, problem regex, fix regex)
NO_GROUP = [
    ("mesh-before-init", lambda: disttrain.Mesh(dp=2), RuntimeError,
     "needs a process group", r"call disttrain\.init\(\)"),
    ("comm-before-init", lambda: comm.all_reduce(torch.ones(2)), RuntimeError,
     "needs a process group", r"call disttrain\.init\(\)"),
    ("global-batch-does-not-divide", lambda: data.shard_loader(list(range(10)), 7, rank=0, world_size=2),
     ValueError, "global_batch_size=7 does not divide by world_size=2", "use 6 or 8"),
    ("global-batch-zero", lambda: data.shard_loader(list(range(10)), 0, rank=0, world_size=2),
     ValueError, "global_batch_size", "must be >= 1"),
    ("sampler-rank-outside-world", lambda: data.DistributedSampler(list(range(10)), num_replicas=2, rank=5),
     ValueError, "rank 5 is out of range for num_replicas=2", "pass matching rank="),
    ("ksync-k-zero", lambda: ps.KSync(0), ValueError, "k must be", "integer >= 1"),
    ("ksync-k-more-than-workers", straggler_ksync, ValueError,
     "waits for 5 workers per round but the job has 3", r"use k <= 3"),
    ("ssp-negative-staleness", lambda: ps.SSP(-1), ValueError, "staleness bound", ">= 0"),
    ("async-unknown-step", lambda: ps.Async(step="fast"), ValueError, "step='fast'",
     "use one of 'constant', 'inverse-staleness'"),
    ("backup-workers-all", lambda: ps.backup_workers(3, 3), ValueError, "backups", r"\[0, 3\)"),
    ("straggler-unknown-model", lambda: ps.Straggler.parse("slowest:rank=1"), ValueError,
     "unknown model 'slowest'", "use one of"),
    ("straggler-not-a-number", lambda: ps.Straggler.parse("fixed:rank=1,delay=abc"), ValueError,
     "delay='abc'", "is not a number"),
    ("compression-unknown", lambda: compression.resolve_compression("fp8"), ValueError,
     "got 'fp8'", r"one of \['bf16', 'fp16', 'none'\]"),
    ("bucket-size-negative", lambda: buckets.mb_to_bytes(-1), ValueError,
     "bucket size", "must be > 0 MB"),
    ("bucket-size-word", lambda: buckets.mb_to_bytes("big"), ValueError,
     "got 'big'", "pass a number such as 25"),
    ("schedule-unknown", lambda: pipeline.make_schedule("zigzag", 2, 4), ValueError,
     "unknown schedule 'zigzag'", "choose one of gpipe, 1f1b, interleaved"),
    ("microbatches-zero", lambda: pipeline.make_schedule("1f1b", 2, 0), ValueError,
     "num_microbatches", "integer >= 1"),
    ("interleaved-microbatches", lambda: pipeline.make_schedule("interleaved", 2, 3, 2), ValueError,
     r"num_microbatches \(3\) must be a multiple of num_stages \(2\)", "use e.g. 4"),
    ("more-stages-than-layers", lambda: split.partition([1.0, 1.0], 3), ValueError,
     "cannot cut 2 layers into 3", "use fewer stages"),
    ("zero-stage-in-plan", lambda: plan.model_state_bytes(1e9, 4, 5), ValueError,
     "stage", "must be 0, 1, 2 or 3"),
    ("plan-dp-zero", lambda: plan.model_state_bytes(1e9, 0, 1), ValueError,
     "dp", "must be a positive integer"),
    ("plan-negative-params", lambda: plan.model_state_bytes(-5, 4, 1), ValueError,
     "params", r"must be > 0 \(a count like 7.5e9\)"),
    ("plan-unknown-optimizer", lambda: plan.bytes_per_param("lion", "mixed"), ValueError,
     "got 'lion'", "must be one of"),
    ("checkpoint-keep-zero", lambda: disttrain.Checkpointer("unused", keep=0), ValueError,
     "keep", "must be an int >= 1"),
    ("timeout-not-a-number", timeout_env, ValueError,
     "DISTTRAIN_TIMEOUT='ten': expected a number of seconds > 0", "e.g. DISTTRAIN_TIMEOUT=300"),
    ("gpt-heads-do-not-divide", lambda: GPTConfig(n_embd=10, n_head=3), ValueError,
     r"n_embd \(10\) must be a multiple of n_head \(3\)", "each head gets"),
    ("nan-or-inf-gradient", nan_grads, NonFiniteGradError,
     r"non-finite .* rank 0: 0\.weight, 1\.weight", "lower the learning rate, clip gradients"),
    ("finite-check-not-a-module", lambda: FiniteGradCheck("model"), TypeError,
     "watches an nn.Module, got str", "pass the model"),
    ("tp-unknown-style", lambda: apply_tp(nn.Sequential(nn.Linear(4, 4)), None, {"0": "diagonal"}),
     ValueError, "'diagonal'", "styles are colwise, rowwise, vocab"),
    ("tp-plan-matches-nothing", lambda: apply_tp(nn.Sequential(nn.Linear(4, 4)), None, {"fc": "colwise"}),
     ValueError, "plan key 'fc' matches no module", "module names look like"),
    ("missing-script", lambda: RunConfig(script="no_such_train.py"), ValueError,
     "script 'no_such_train.py' not found", "give the path of a .py file"),
    ("nproc-zero", lambda: RunConfig(script=HERE, nproc=0), ValueError,
     "--nproc", "must be >= 1"),
    ("nproc-and-workers", lambda: RunConfig(script=HERE, nproc=2, workers=2, servers=1), ValueError,
     "mutually exclusive", "use --nproc N for a data-parallel job"),
    ("timeout-zero", lambda: RunConfig(script=HERE, timeout=0), ValueError,
     "--timeout", "must be > 0 seconds"),
    ("grace-negative", lambda: RunConfig(script=HERE, grace_seconds=-1), ValueError,
     "--grace-seconds must be >= 0", "0: stop at once"),
    ("short-secret", lambda: rank_env(RunConfig(script=HERE), {"DISTTRAIN_SECRET": "abc"}), ValueError,
     "DISTTRAIN_SECRET has 3 characters", "export DISTTRAIN_SECRET="),
    ("init-unknown-backend", lambda: init_alone(backend="mpi"), ValueError,
     "got 'mpi'", "backend must be 'gloo' or 'nccl'"),
    ("init-store-without-rank", lambda: init_alone(store=dist.HashStore()), ValueError,
     r"init\(store=\.\.\.\)", "also needs rank= and world_size="),
    ("hash-ring-no-vnodes", lambda: ps.HashRing(["s0"], vnodes=0), ValueError,
     "vnodes must be >= 1, got 0", r"64\.\.256 is typical"),
    ("straggler-unknown-kind", lambda: ps.Straggler(kind="x"), ValueError,
     "unknown straggler model 'x'", "use one of"),
    ("sampler-not-map-style", lambda: data.DistributedSampler(None, num_replicas=2, rank=0), TypeError,
     "NoneType has no __len__", "shard an IterableDataset inside its __iter__"),
    ("pipeline-model-without-layers", lambda: split.split_model(nn.Linear(2, 2), 2, 0), TypeError,
     "Linear does not name its layers", r"give layers=\[\.\.\.\]"),
    ("gpt-no-layers", lambda: GPTConfig(n_layer=0), ValueError, "GPTConfig.n_layer", "must be >= 1"),
    ("config-mixed-without-zero", lambda: disttrain.Parallelism(precision="bf16"), ValueError,
     "precision is a ZeRO option", "add zero=1, 2 or 3"),
    ("config-zero-without-optimizer", lambda: disttrain.Parallelism(zero=2), ValueError,
     "zero=2 shards the optimizer state", "pass optimizer_factory="),
    ("config-compression-with-zero", lambda: disttrain.Parallelism(
        zero=1, optimizer_factory=torch.optim.SGD, compression="fp16"), ValueError,
     "compression is a DataParallel option", "drop compression or use zero=0"),
    ("config-unknown-schedule", lambda: disttrain.Parallelism(schedule="1F1B"), ValueError,
     "unknown schedule '1F1B'", "choose one of gpipe, 1f1b"),
    ("config-unknown-option", lambda: disttrain.Parallelism.from_options({"micro_batches": 4}),
     TypeError, "parallelize got unknown option", "the options are the fields of disttrain.Parallelism"),
    ("1f1b-with-virtual-stages", lambda: pipeline.make_schedule("1f1b", 2, 4, 2), ValueError,
     "runs one chunk per stage", "num_virtual must be 1"),
    ("interleaved-without-virtual", lambda: pipeline.make_schedule("interleaved", 2, 4, 1), ValueError,
     "schedule 'interleaved'", "needs num_virtual >= 2"),
    ("plan-unknown-precision", lambda: plan.bytes_per_param("adam", "fp8"), ValueError,
     "got 'fp8'", r"precision must be one of \['fp32', 'mixed'\]"),
]


def assert_clear(info: pytest.ExceptionInfo, problem: str, fix: str) -> None:
    message = str(info.value)
    assert re.search(problem, message), f"problem {problem!r} not named in: {message}"
    assert re.search(fix, message), f"no fix {fix!r} in: {message}"
    last = traceback.extract_tb(info.tb)[-1].filename
    assert os.path.abspath(last).startswith(PACKAGE), f"raised from {last}, not by disttrain"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call,exc,problem,fix", [c[1:] for c in NO_GROUP], ids=[c[0] for c in NO_GROUP])
def test_bad_input_says_what_is_wrong_and_how_to_fix_it(call, exc, problem, fix):
    with pytest.raises(exc) as info:
        call()
    assert_clear(info, problem, fix)


@pytest.fixture
def world_of_one():
    """An in-process world of one (gloo over a HashStore), destroyed after the test."""
    disttrain.init()
    yield
    disttrain.shutdown()


def checkpoint_of_other_model(tmp):
    ckpt = disttrain.Checkpointer(tmp)
    ckpt.save(1, model=nn.Linear(3, 2))
    ckpt.load(model=nn.Linear(4, 2))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


WITH_GROUP = [
    ("mesh-does-not-divide-world", lambda tmp: disttrain.Mesh(dp=2, tp=3), ValueError,
     r"pp\(1\) \* dp\(2\) \* tp\(3\) != world_size\(1\)", "launch 6 processes"),
    ("mesh-axis-zero", lambda tmp: disttrain.Mesh(dp=0), ValueError,
     "mesh axis dp", "must be an integer >= 1"),
    ("data-parallel-not-a-module", lambda tmp: disttrain.DataParallel("model"), TypeError,
     "DataParallel wraps an nn.Module", "got str"),
    ("data-parallel-bucket-size", lambda tmp: disttrain.DataParallel(nn.Linear(2, 2), bucket_mb=-3),
     ValueError, "bucket size", "must be > 0 MB"),
    ("data-parallel-bucket-word", lambda tmp: disttrain.DataParallel(nn.Linear(2, 2), bucket_mb="huge"),
     ValueError, "got 'huge'", "a number of MiB or 'auto'"),
    ("data-parallel-compression", lambda tmp: disttrain.DataParallel(nn.Linear(2, 2), compression="zip"),
     ValueError, "got 'zip'", r"one of \['bf16', 'fp16', 'none'\]"),
    ("data-parallel-frozen-model",
     lambda tmp: disttrain.DataParallel(nn.Linear(2, 2).requires_grad_(False)), ValueError,
     "no parameter that requires grad", "wrap the model being trained"),
    ("zero-frozen-model",
     lambda tmp: disttrain.Zero(nn.Linear(2, 2).requires_grad_(False), sgd), ValueError,
     "no parameter that requires grad", "wrap the model being trained"),
    ("zero-stage-four", lambda tmp: disttrain.Zero(nn.Linear(2, 2), sgd, stage=4), ValueError,
     "ZeRO stage", "must be 0, 1, 2 or 3"),
    ("zero-optimizer-not-factory",
     lambda tmp: disttrain.Zero(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
     TypeError, "not an optimizer", r"lambda ps: torch\.optim\.AdamW"),
    ("broadcast-src-outside-group", lambda tmp: comm.broadcast(torch.ones(2), src=3), ValueError,
     r"src=3 is not a global rank of world \(ranks 0\)", "pass a global rank in that group"),
    ("all-gather-wrong-list", lambda tmp: comm.all_gather([torch.ones(2)] * 3, torch.ones(2)),
     ValueError, "must be a list of 1 tensors", r"torch\.empty_like"),
    ("all-gather-wrong-dtype",
     lambda tmp: comm.all_gather([torch.ones(2, dtype=torch.int64)], torch.ones(2)), ValueError,
     r"tensor_list\[0\] is torch.int64 \(2,\) but tensor is torch.float32", r"torch\.empty_like\(tensor\)"),
    ("all-reduce-not-a-tensor", lambda tmp: comm.all_reduce([1.0, 2.0]), TypeError,
     "tensor must be a torch.Tensor, got list", r"torch\.tensor\(\.\.\.\)"),
    ("ps-connect-outside-ps-job",
     lambda tmp: ps.connect(nn.Linear(2, 2), policy=ps.KSync(1), optimizer=sgd), RuntimeError,
     "needs 1 <= servers < world size", "disttrain run --workers W --servers S"),
    ("checkpoint-step-not-int", lambda tmp: disttrain.Checkpointer(tmp).save("x", model=nn.Linear(2, 2)),
     ValueError, "got 'x'", "step must be an int >= 0"),
    ("checkpoint-extra-not-dict",
     lambda tmp: disttrain.Checkpointer(tmp).save(1, model=nn.Linear(2, 2), extra=[1]), TypeError,
     "extra must be a dict", "got list"),
    ("mesh-unknown-axis", lambda tmp: disttrain.Mesh().group("xp"), ValueError,
     "unknown mesh axis 'xp'", "axes are pp, dp, tp"),
    ("parallelize-unknown-schedule",
     lambda tmp: disttrain.parallelize(nn.Linear(2, 2), disttrain.Mesh(), None, schedule="zigzag"),
     ValueError, "unknown schedule 'zigzag'", "choose one of"),
    ("collective-group-not-a-group", lambda tmp: comm.all_reduce(torch.ones(2), group="dp"), TypeError,
     "group must be a torch.distributed ProcessGroup", r"use mesh\.group\('dp'\)"),
    ("send-to-self", lambda tmp: comm.send(torch.ones(2), dst=0), ValueError,
     "dst=0 is this rank", "needs another rank"),
    ("reduce-scatter-sizes", lambda tmp: comm.reduce_scatter_tensor(torch.ones(3), torch.ones(4)),
     ValueError, "input has 4 elements, needs 1 x 3", "pad it"),
    ("checkpoint-of-another-model", checkpoint_of_other_model, CheckpointMismatchError,
     r"saved from a different model: shape mismatch: weight: checkpoint \[2, 3\], model \[2, 4\]",
     "load it into the model .* that saved it, or give Checkpointer a new directory"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call,exc,problem,fix", [c[1:] for c in WITH_GROUP], ids=[c[0] for c in WITH_GROUP])
def test_bad_input_with_a_process_group(world_of_one, tmp_path, call, exc, problem, fix):
    with pytest.raises(exc) as info:
        call(str(tmp_path))
    assert_clear(info, problem, fix)


@pytest.mark.timeout(30)
def test_cli_missing_script_exits_2_with_a_fix(capsys):
    assert cli.main(["run", "--nproc", "2", "no_such_train.py"]) == 2
    err = capsys.readouterr().err
    assert "disttrain run: error: script 'no_such_train.py' not found" in err
    assert "give the path of a .py file" in err and "Traceback" not in err


@pytest.mark.timeout(30)
def test_cli_plan_unknown_optimizer_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "memory", "--params", "7e9", "--dp", "8", "--optimizer", "lion"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'lion'" in err and "adam" in err and "Traceback" not in err


def test_there_are_at_least_25_cases():
    assert len(NO_GROUP) + len(WITH_GROUP) + 2 >= 25
