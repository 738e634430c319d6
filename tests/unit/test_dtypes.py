"""The dtype rule for losses and sums (dtypes.py): float64 stays float64, only
fp16/bf16 are upcast, to fp32."""

import torch

from disttrain import dtypes
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


def test_sum_of_squares_groups_dtypes_and_never_lowers():
    a = torch.tensor([3.0, 4.0])  # 25
    b = torch.tensor([1.5], dtype=torch.bfloat16)  # 2.25, summed in float32
    c = torch.empty(0)
    out = dtypes.sum_of_squares([a, b, c], torch.float32)
    assert out.dtype == torch.float32 and out.dim() == 0 and float(out) == 27.25
    # 1e-60 is 0 in float32: a float64 sum must stay float64
    wide = dtypes.sum_of_squares([torch.tensor([1e-30], dtype=torch.float64)], torch.float64)
    assert wide.dtype == torch.float64 and abs(float(wide) - 1e-60) < 1e-70
    assert float(dtypes.sum_of_squares([], torch.float32)) == 0.0


def test_scale_multiplies_every_tensor_in_its_own_dtype():
    a, b = torch.tensor([2.0, 4.0]), torch.tensor([8.0], dtype=torch.bfloat16)
    dtypes.scale_([a, b], torch.tensor(0.5, dtype=torch.float64))
    assert a.tolist() == [1.0, 2.0] and a.dtype == torch.float32
    assert b.tolist() == [4.0] and b.dtype == torch.bfloat16
