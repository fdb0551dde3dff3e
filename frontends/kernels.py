"""Faster stand-ins for ATen ops in remat's eager executors, bit-identical to the op they replace.

The joint graph's ops run from Python (`JointProgram.run`, the straight-line code of
`joint_codegen`), and the same call profiles them, so a stand-in changes what is measured and
what runs together.  A stand-in applies only where its result is bit for bit the op's (dtype,
device); everywhere else it calls the op.

* ``native_dropout_backward(grad, mask, scale)``: on the CPU ATen computes
  ``grad * (mask.to(grad.dtype) * scale)``: two full-size temporaries beside its result (scratch
  the step must hold) and three passes over memory (1.15x the time of the product below on an
  8 MiB tensor, a 2-core Xeon, the allocator warm).  For float32 and float64,
  ``(grad * mask) * scale`` is the same number in every element: ``grad * 1`` is exact,
  ``grad * 0`` is the same signed zero (or NaN) either way, and both multiply by the scale
  rounded once to the dtype.  The product is made in place, so no temporary at all.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten
EXACT_DTYPES = (torch.float32, torch.float64)


def dropout_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward``, bit for bit, without its float copy of the mask on the CPU."""
    if grad.device.type != "cpu" or grad.dtype not in EXACT_DTYPES or mask.dtype != torch.bool:
        return aten.native_dropout_backward.default(grad, mask, scale)
    return torch.mul(grad, mask).mul_(scale)


STAND_INS: dict = {aten.native_dropout_backward.default: dropout_backward}


def kernel(target: Any) -> Callable:
    """What runs for an fx node's `target`: its stand-in, or the target itself."""
    return STAND_INS.get(target, target)


__all__ = ["kernel", "dropout_backward", "STAND_INS"]
