"""The executors' stand-ins for ATen ops give the op's result bit for bit (frontends/kernels.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from remat.frontends.kernels import dropout_backward, kernel  # noqa: E402

aten = torch.ops.aten


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_backward_is_atens_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(4, 8, 33, generator=g, dtype=dtype)
    grad[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    grad[1, 1, :2] = torch.tensor([-0.0, 0.0], dtype=dtype)
    mask = torch.rand(4, 8, 33, generator=g) > 0.3
    for scale in (1 / 0.9, 1 / 0.7, 0.0, 1.0):
        want = aten.native_dropout_backward.default(grad, mask, scale)
        got = dropout_backward(grad, mask, scale)
        # the same bits everywhere: signed zeros where the mask drops a negative gradient, NaN
        # where it drops an infinity
        assert torch.equal(_bits(got), _bits(want)), scale
    # a transposed (non-contiguous) gradient too
    grad_t, mask_t = grad.transpose(0, 2), mask.transpose(0, 2)
    want = aten.native_dropout_backward.default(grad_t, mask_t, 1 / 0.9)
    assert torch.equal(_bits(dropout_backward(grad_t, mask_t, 1 / 0.9).contiguous()), _bits(want.contiguous()))


def test_dropout_backward_leaves_other_dtypes_to_aten():
    # (float32 and float64 are where the module docstring's argument holds; others call the op)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))
    grad, mask = torch.randn(64, dtype=torch.bfloat16), torch.rand(64) > 0.5
    with Ops() as ops:
        dropout_backward(grad, mask, 1 / 0.9)
    assert aten.native_dropout_backward.default in ops.seen
    with Ops() as ops:
        dropout_backward(grad.float(), mask, 1 / 0.9)
    assert aten.native_dropout_backward.default not in ops.seen


def test_only_listed_ops_are_replaced():
    assert kernel(aten.native_dropout_backward.default) is dropout_backward
    assert kernel(aten.mm.default) is aten.mm.default
