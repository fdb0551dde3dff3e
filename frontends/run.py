"""Train a few steps with a plan and compare what it predicted with what the device did
(``remat run``, `run_plan`).

Each step draws a fresh random batch shaped like the example (floating tensors ``randn``,
integer tensors uniform in ``[0, max(example) + 1)``, so token ids stay in the vocabulary), runs
``loss = planned(*batch); loss.backward(); optimizer.step()`` (natively, ``planned(*batch)`` is
``loss_fn(model(*batch), *batch)`` on the hooked model), and measures the step's peak device
bytes and wall time with `remat.measure`: with the optimizer the graph names
(``meta["optimizer"]``, `base.make_optimizer`) its step is inside the measurement, as its state
and its step's transient are in the plan; without one, plain SGD steps after it.  Gradients are zeroed as the graph
was traced for (`gradients_to_none`): with ``meta["grads"] == "accumulated"`` by PyTorch's
default ``zero_grad()`` (set to None: each step allocates them in its backward, the backward
nodes' persistent bytes), with ``"resident"`` (and in graphs that do not say) in place,
``zero_grad(set_to_none=False)``, so they are fixed bytes alive for the whole step.  One untimed
warm-up step comes first (it allocates the gradients and, on CUDA, the pinned host buffers).
The same accounting measures as many plain autograd steps, each after a planned one (in turns,
after a warm-up of each, on batches of their own; natively with the execution paused), for the
ratio of step times (on the CPU the accounting's per-op cost is in both times: compare the
ratio, not the times).  `meter` picks the CPU's meter (`remat.measure`'s): ``"storage"``, the
accounting of tensor storages, compared with the prediction's storage view (no kernel scratch);
``"allocator"``, the allocator's own figure, kernels' scratch included as CUDA's
``max_memory_allocated`` sees it, compared with the whole prediction; ``"auto"``, the allocator
unless the plan swaps (on a CPU the allocator counts the host buffers as its own bytes).
The global RNG is seeded with `seed` first, so a run is reproducible.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from remat.core.errors import InvalidInputError
from remat.core.plan import Plan

from .applying import PlainExecution, apply
from .native import NativeExecution
from .measuring import Measurement, measure
from .base import default_loss, make_optimizer, optimizer_tensors, split_inputs, step_loss


__all__ = ["run_plan", "run_meter", "RUN_METERS", "RunReport", "random_batch", "gradients_to_none", "metered_prediction"]


def metered_prediction(predicted: dict, storage_peak: int) -> dict:
    """`predicted` (a plan's, or a native execution's) with its peak as the CPU's storage
    accounting sees it, `storage_peak` (`remat.core.simulate.storage_view`: no kernel scratch, no
    saved generator states), the whole peak kept as ``allocator_peak_bytes`` (what the
    allocator's own figure, ``remat.measure(..., meter="allocator")``, is compared with)."""
    if storage_peak == predicted.get("peak_bytes"):
        return dict(predicted)
    return {**predicted, "peak_bytes": int(storage_peak), "allocator_peak_bytes": predicted["peak_bytes"]}


RUN_METERS = ("storage", "allocator", "auto")


def run_meter(plan: Plan, meter: str, device: torch.device) -> str:
    """The meter a run of `plan` on `device` uses for `meter` (module docstring): on CUDA
    "allocator" (``max_memory_allocated``, whatever is asked); on a CPU "auto" is "allocator"
    unless the plan swaps.  Raises `InvalidInputError` for an unknown meter and for the CPU's
    allocator on a plan that swaps (its host buffers would count as device bytes)."""
    if meter not in RUN_METERS:
        raise InvalidInputError(f"meter: expected one of {', '.join(RUN_METERS)}, got {meter!r}")
    if device.type == "cuda":
        return "allocator"
    swaps = plan.predicted.get("host_peak_bytes", 0) > 0
    if meter == "auto":
        return "storage" if swaps else "allocator"
    if meter == "allocator" and swaps:
        raise InvalidInputError("meter 'allocator': the plan swaps, and on a CPU the allocator counts its host "
                                "buffers as device bytes; meter the storage accounting (meter='storage'; on the "
                                "command line --meter storage), or plan without swap")
    return meter


def gradients_to_none(plan: Plan) -> bool:
    """The ``set_to_none`` of the ``zero_grad`` a step of `plan` expects: True when its graph
    counts parameter gradients as allocated at their first accumulation
    (``meta["grads"] == "accumulated"``), False when they are fixed bytes."""
    return plan.graph.meta.get("grads") == "accumulated"


@dataclass
class RunReport:
    """Figures of `run_plan`: per planned step (loss, peak bytes, seconds); plain steps."""
    plan: Plan
    device: str
    losses: list[float] = field(default_factory=list)
    steps: list[Measurement] = field(default_factory=list)
    plain_steps: list[Measurement] = field(default_factory=list)
    host_peak_bytes: int = 0
    executor: str = "interpreter"
    meter: str = "storage"   # the CPU's meter that measured the steps (`run_meter`)
    # what the executor that ran predicts (the plan's own figures; natively or run plain, the execution's `predicted`)
    predicted: dict = field(default_factory=dict)

    @property
    def plain(self) -> Measurement | None:
        """The plain autograd steps: largest peak, median time (None when not measured)."""
        if not self.plain_steps:
            return None
        return Measurement(max(m.peak_bytes for m in self.plain_steps),
                           statistics.median(m.time for m in self.plain_steps), self.device)

    @property
    def peak_bytes(self) -> int:
        """The largest measured peak over the steps."""
        return max(m.peak_bytes for m in self.steps)

    @property
    def step_time(self) -> float:
        """Median wall time of a planned step (seconds)."""
        return statistics.median(m.time for m in self.steps)

    @property
    def peak_error(self) -> float:
        """(measured - predicted) / predicted peak."""
        pred = (self.predicted or self.plan.predicted)["peak_bytes"]
        return (self.peak_bytes - pred) / pred if pred else 0.0


def random_batch(example: Any, generator: torch.Generator | None = None,
                 device: "torch.device | None" = None) -> Any:
    """A batch shaped like `example` (same structure, shapes, dtypes), freshly drawn, on
    `device` (default: each tensor's own)."""
    def draw(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        to = device if device is not None else x.device
        if x.is_floating_point():
            return torch.randn(x.shape, generator=generator, dtype=x.dtype).to(to)
        if x.dtype == torch.bool:
            return torch.randint(0, 2, x.shape, generator=generator).bool().to(to)
        high = int(x.max().item()) + 1 if x.numel() else 1
        return torch.randint(0, max(high, 1), x.shape, generator=generator, dtype=x.dtype).to(to)
    return tree_map(draw, example)


def run_plan(model: torch.nn.Module, example_inputs: Any, plan: Plan, *, steps: int = 3,
             device: "str | torch.device | None" = None, lr: float = 1e-3, loss_fn: Callable | None = None,
             plain: bool = True, seed: int = 0, on_step: Callable[[int, float, Measurement], None] | None = None,
             executor: str = "interpreter", meter: str = "storage") -> RunReport:
    """Train `steps` steps of `model` with `plan` on random batches; measure each (see the
    module docstring).  `device` defaults to where the parameters are; the model and the
    example move there.  `on_step(k, loss, measurement)` is called after each step.
    `executor`: as `remat.apply`'s; a native execution's hooks come off before the plain steps.
    `meter`: "storage", "allocator" or "auto" (module docstring); `RunReport.meter` says which ran."""
    if not isinstance(steps, int) or steps < 1:
        raise InvalidInputError(f"--steps: must be a whole number >= 1, got {steps!r}")
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("--device cuda: no CUDA device is available here; use --device cpu")
    meter = run_meter(plan, meter, dev)
    model.to(dev)
    model.train()
    args, kwargs = split_inputs(example_inputs, None)
    if kwargs:
        raise InvalidInputError("remat run: keyword example inputs are not supported; pass positional inputs")
    loss_fn = loss_fn or default_loss
    planned = apply(model, plan, tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, args), loss_fn,
                    executor=executor)
    native = isinstance(planned, NativeExecution)
    own_prediction = native or isinstance(planned, PlainExecution)   # (else the plan's own figures)
    # batches are drawn from host templates: a device copy of the example would stay resident
    # beside each batch, one batch more than the plan counts
    args = tree_map(lambda x: x.detach().to("cpu") if isinstance(x, torch.Tensor) else x, args)
    # the optimizer the graph names runs inside the measured step (its state and its step's
    # transient are in the plan); without one, plain SGD after it, outside the measurement
    named = plan.graph.meta.get("optimizer")
    opt = make_optimizer(named, model.parameters(), lr) if named else torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    report = RunReport(plan, str(dev), executor=("native" if native else "plain" if own_prediction else "interpreter"),
                       predicted=dict(planned.predicted) if own_prediction else dict(plan.predicted), meter=meter)
    to_none = gradients_to_none(plan)

    def fixed(batch: tuple) -> list:
        return (list(model.parameters()) + list(model.buffers()) + tree_flatten(batch)[0]
                + [p.grad for p in model.parameters() if p.grad is not None] + optimizer_tensors(opt))

    plain_gen = torch.Generator().manual_seed(seed + 1)
    for k in range(steps + 1):  # step 0: warm-up
        held = [random_batch(args, gen, dev)]
        opt.zero_grad(set_to_none=to_none)
        box: list[torch.Tensor] = []

        def step() -> None:
            loss = planned(*held[0])
            loss.backward()
            box.append(loss.detach())
            if named:
                opt.step()
        m = measure(step, dev, resident=fixed(held[0]), meter=meter)
        held.clear()   # (on CUDA every live tensor counts: one step's batch is not the other's)
        if not named:
            opt.step()
        if plain:   # a plain step in turns with each planned one (the machine's drift falls on both)
            held.append(random_batch(args, plain_gen, dev))
            opt.zero_grad(set_to_none=to_none)

            def plain_step() -> None:
                step_loss(model, loss_fn, held[0], count=plan.graph.meta.get("model_inputs")).backward()
                if named:
                    opt.step()
            if native:
                planned.paused = True
            try:
                pm = measure(plain_step, dev, resident=fixed(held[0]), meter=meter)
            finally:
                if native:
                    planned.paused = False
            held.clear()
            if k:
                report.plain_steps.append(pm)
        if k == 0:
            continue
        report.losses.append(float(box[0]))
        report.steps.append(m)
        report.host_peak_bytes = max(report.host_peak_bytes, planned.host_peak_bytes)
        if on_step is not None:
            on_step(k, report.losses[-1], m)
    if native:
        report.predicted = dict(planned.predicted)  # (after what the steps observed: `NativeExecution.held`)
        planned.remove()
    if dev.type != "cuda" and meter == "storage":   # the storage accounting measured it: its view of the prediction
        seen = report.predicted.get("storage_peak_bytes")
        report.predicted = metered_prediction(report.predicted, plan.storage_peak_bytes if seen is None else seen)
    opt.zero_grad(set_to_none=to_none)
    return report
