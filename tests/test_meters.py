"""The CPU meters: exact storage accounting, and the allocator's own events, which also see
inside compiled code without changing what runs."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
from torch.profiler import profile  # noqa: E402

from remat.frontends.measuring import measure  # noqa: E402


def mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)])
    x = torch.randn(32, 64)

    def step(mod):
        for p in model.parameters():
            p.grad = None
        mod(x).pow(2).sum().backward()
    return model, x, step


def compiled_calls(fn) -> int:
    with profile() as prof:
        fn()
    return sum(1 for e in prof.events() if "CompiledFunction" in e.name)


def test_allocator_meter_equals_storage_accounting_on_an_eager_step():
    model, x, step = mlp_step()
    resident = list(model.parameters()) + [x]
    storage = measure(lambda: step(model), "cpu", resident, meter="storage").peak_bytes
    allocator = measure(lambda: step(model), "cpu", resident, meter="allocator").peak_bytes
    assert allocator == storage
    # what the step holds at its peak: parameters, input, and more than one layer's activations
    assert storage > sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4 + 2 * 32 * 64 * 4


@pytest.mark.parametrize("meter", ["allocator", "storage"])
def test_a_meter_measures_compiled_code_as_its_eager_step_and_leaves_it_compiled(meter):
    # allocator: sees inside compiled code; aot_eager runs the same ATen ops, so the same bytes.
    # storage: runs the compiled code eagerly for its own call (dynamo meeting a frame under a
    # dispatch mode would mark its code never to compile again)
    model, x, step = mlp_step()
    resident = list(model.parameters()) + [x]
    eager = measure(lambda: step(model), "cpu", resident, meter=meter).peak_bytes
    compiled = torch.compile(model, backend="aot_eager")
    step(compiled)
    assert compiled_calls(lambda: step(compiled)) > 0
    peak = measure(lambda: step(compiled), "cpu", resident, meter=meter).peak_bytes
    assert peak == eager
    assert compiled_calls(lambda: step(compiled)) > 0  # still compiled afterwards


def test_unknown_meter_is_an_error():
    with pytest.raises(ValueError, match="meter"):
        measure(lambda: None, "cpu", meter="nvml")


def test_allocation_log_sees_a_kernels_scratch_buffer_that_storage_accounting_misses():
    from remat.frontends.measuring import AllocationLog, StorageTracker
    x = torch.randn(256, 256)
    mask = torch.rand(256, 256) > 0.5
    with AllocationLog() as log, StorageTracker() as tracker:
        with log.window("mul"):
            y = x * mask  # the bool mask is copied to float inside the kernel, then freed
    assert log.peak("mul") == 2 * y.nbytes == 2 * tracker.peak  # output + the float copy; the tracker: output
