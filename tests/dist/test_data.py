"""shard_loader in real gloo ranks: rank and world size come from the process group."""

from __future__ import annotations

import pytest
import torch

import disttrain
from disttrain.testing import spawn


def loader_batches(n, global_batch_size):
    """Each rank: the wrong global batch's error, then two epochs of its batches."""
    data = torch.arange(n)
    try:
        disttrain.data.shard_loader(data, global_batch_size + 1)
        error = ""
    except ValueError as e:
        error = str(e)
    loader = disttrain.data.shard_loader(data, global_batch_size, seed=3)
    epochs = [torch.stack([torch.nn.functional.pad(b, (0, loader.batch_size - len(b)), value=-1)
                           for b in loader]) for _ in range(2)]
    return {"error": error, "epochs": epochs, "rank": loader.sampler.rank,
            "replicas": loader.sampler.num_replicas, "epoch": loader.epoch}


@pytest.mark.timeout(60)
def test_ranks_split_every_global_batch_of_the_single_process_run():
    out = spawn(loader_batches, 3, 100, 63)
    assert [(o["rank"], o["replicas"], o["epoch"]) for o in out] == [(r, 3, 1) for r in range(3)]
    assert all("global_batch_size=64 does not divide by world_size=3" in o["error"]
               and "use 63 or 66" in o["error"] for o in out)
    single = disttrain.data.shard_loader(torch.arange(100), 63, seed=3, rank=0, world_size=1)
    for epoch in range(2):
        reference = [set(b.tolist()) for b in single]
        # the world-3 order pads 100 -> 102 by repeating its first two indices
        reference[-1] |= set(single.sampler.global_order()[:2])
        mine = [o["epochs"][epoch] for o in out]  # each (batches, 21), -1 = past the end
        assert [len(m) for m in mine] == [2, 2, 2] == [len(reference)] * 3
        for k, ref in enumerate(reference):
            got = torch.cat([m[k] for m in mine])
            got = set(got[got >= 0].tolist())
            assert got == ref, (epoch, k)
        assert single.epoch == epoch
    assert not torch.equal(out[0]["epochs"][0], out[0]["epochs"][1])  # reshuffled
