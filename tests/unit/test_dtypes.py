"""The dtype rule for losses and sums (dtypes.py): float64 stays float64, only
fp16/bf16 are upcast, to fp32."""

import torch

from disttrain.dtypes import accumulation_dtype, upcast_half


def test_float64_stays_and_only_half_is_upcast():
    assert accumulation_dtype(torch.float64) == torch.float64
    assert accumulation_dtype(torch.bfloat16, torch.float64) == torch.float64
    assert accumulation_dtype(torch.float16) == accumulation_dtype(torch.bfloat16) == torch.float32
    assert accumulation_dtype(torch.float32, torch.int64) == torch.float32
    x = torch.ones(3, dtype=torch.float64)
    assert upcast_half(x) is x  # no copy
    assert upcast_half(x.to(torch.bfloat16)).dtype == torch.float32
    assert upcast_half(x.to(torch.float16)).dtype == torch.float32
    ids = torch.arange(3)
    assert upcast_half(ids) is ids
