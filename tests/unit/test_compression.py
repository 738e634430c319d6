"""Wire compression objects: round trips, dtypes, and resolution from names."""

import pytest
import torch

from disttrain.comm.compression import (
    BF16Compression,
    Compression,
    FP16Compression,
    NoCompression,
    resolve_compression,
)

pytestmark = pytest.mark.timeout(30)


def test_none_is_identity():
    t = torch.randn(10)
    wire, ctx = NoCompression().compress(t)
    assert wire is t
    assert NoCompression().decompress(wire, ctx) is t


@pytest.mark.parametrize("comp, dtype, tol", [(FP16Compression(), torch.float16, 1e-3),
                                              (BF16Compression(), torch.bfloat16, 1e-2)])
def test_cast_round_trip(comp, dtype, tol):
    t = torch.randn(1000)
    wire, ctx = comp.compress(t)
    assert wire.dtype == dtype
    back = comp.decompress(wire, ctx)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back, t, rtol=tol, atol=tol)


def test_integer_tensors_pass_through():
    t = torch.arange(5)
    wire, ctx = FP16Compression().compress(t)
    assert wire is t and FP16Compression().decompress(wire, ctx) is t


def test_resolve():
    assert isinstance(resolve_compression(None), NoCompression)
    assert isinstance(resolve_compression("fp16"), FP16Compression)
    assert isinstance(resolve_compression("BF16"), BF16Compression)
    custom = Compression()
    assert resolve_compression(custom) is custom
    with pytest.raises(ValueError, match="fp16"):
        resolve_compression("int8")
