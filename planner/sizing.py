"""``remat.capacity(make, memory)``: the largest batch (or sequence length) whose training step fits.

`make(size)` builds the model and an example batch at a size (``(model, example_inputs)``).  The
model is traced at a few `sizes` (the first with the caller's trace options, the rest with the
granularity and depth the first one chose, so every size traces to the same graph); the graphs
make a `remat.sizes.GraphFamily` and `remat.sizes.search` finds, per overhead level, the
largest size whose plan fits `memory` (its module docstring says how and when an answer is
proven).  Beside it, what a user would get without remat, measured on the device at the traced
sizes, a guess from the same polynomial and measured steps around it: plain autograd, and
``torch.utils.checkpoint`` on every block (`checkpointing.checkpoint_every_block`).  With ``verify=True`` the answer is
traced at its size, planned within `memory` and one planned step is run: its measured peak must
be within the memory.  Every peak is the allocator's figure, as the search's graphs count it
(kernels' scratch included): on CUDA ``max_memory_allocated``, on the CPU
``remat.measure(..., meter="allocator")``; only a verified plan that swaps is measured by the
CPU's storage accounting against the prediction's storage view (there the allocator counts the
host buffers as its own).
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from .sizes import (MAX_SIZE, CapacityResult, GraphFamily, Probe, fit_polynomial, largest, largest_near,
                         levels_for, polynomial_value, search)
from remat.core.errors import InvalidInputError
from remat.core.graph import Graph
from remat.core.plan import Plan, predicted_from
from remat.core.schedule import Schedule
from remat.core.simulate import simulate

from remat.frontends.base import default_loss, split_inputs, step_loss
from remat.frontends.checkpointing import block_names, checkpoint_every_block
from remat.frontends.measuring import measure
from remat.frontends.run import run_plan
from remat.frontends.tracing import trace

log = logging.getLogger(__name__)

DEFAULT_SIZES = {"batch": (2, 4), "seq": (16, 32, 48)}


@dataclass
class PeerAnswer:
    """A way to train without remat: its measured peak bytes per size probed (the traced sizes,
    then sizes around the guess their fit makes), step times at the traced sizes, and the largest
    size whose measured peak fits (None: it does not apply, `reason` says why).  Measured, not
    extrapolated: a step's peak is the largest of several instants' bytes, each linear in the
    batch, so it bends where another instant takes over."""
    name: str
    size: int | None
    peaks: dict[int, "int | None"] = field(default_factory=dict)  # None: out of device memory
    times: dict[int, float] = field(default_factory=dict)  # median measured step seconds
    reason: str = ""


@dataclass
class Verification:
    """Planned steps at the answer's size: the plan of the graph traced there, its predicted and
    measured peak (None when no plan fits that graph: `reason`), and the measured step time
    against plain autograd's."""
    size: int
    plan: Plan | None
    measured_bytes: int | None
    memory: int
    reason: str = ""
    step_time: float | None = None   # median measured seconds of the planned steps
    plain_time: float | None = None  # and of plain autograd's at the same size (on a CPU, which has the room)
    executor: str = "interpreter"    # what ran them: "native" (the model's own code) or "interpreter"
    predicted_bytes: int | None = None  # the peak that executor predicts, as the device's meter sees it
    meter: str = "allocator"            # the CPU's meter that measured it (`remat.frontends.run.run_meter`)

    @property
    def time_ratio(self) -> float | None:
        return self.step_time / self.plain_time if self.step_time and self.plain_time else None

    @property
    def fits(self) -> bool:
        return self.measured_bytes is not None and self.measured_bytes <= self.memory


@dataclass
class CapacityReport:
    result: CapacityResult
    family: GraphFamily
    peers: list[PeerAnswer]
    verification: Verification | None = None

    def plan(self) -> Plan | None:
        """The plan to keep: the verified one (traced at its size) when there is one, else the
        search's plan at the largest size within the largest overhead level."""
        if self.verification is not None and self.verification.plan is not None:
            return self.verification.plan
        return self.result.plan()


def example_size(inputs: Any, dim: str) -> int | None:
    """The batch (dim 0) or sequence length (dim 1) of the first tensor of an example."""
    axis = 0 if dim == "batch" else 1
    for x in tree_flatten(inputs)[0]:
        if isinstance(x, torch.Tensor) and x.dim() > axis:
            return int(x.shape[axis])
    return None


def _built(make: Callable[[int], Any], size: int, dim: str) -> tuple[torch.nn.Module, Any]:
    made = make(size)
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise InvalidInputError(f"capacity: make({size}) must return (model, example_inputs), got {type(made).__name__}")
    got = example_size(made[1], dim)
    if got != size:
        what = "batch (first dimension)" if dim == "batch" else "sequence length (second dimension)"
        raise InvalidInputError(f"capacity: the example inputs of make({size}) have {what} {got}, not {size}: "
                                f"the model's inputs must change with the {dim} asked for")
    return made[0], made[1]


def _pinned(graph: Graph, options: dict) -> dict:
    """Trace options that rebuild `graph`'s granularity and depth at another size."""
    out = dict(options)
    gran = graph.meta.get("granularity")
    if gran in ("module", "op-stages"):
        out["granularity"] = gran
        if graph.meta.get("depth"):
            out["depth"] = graph.meta["depth"]
    elif gran == "joint":
        out["granularity"] = "joint"
    return out


def _step(model: torch.nn.Module, inputs: Any, loss_fn: Callable, device: torch.device, to_none: bool,
          steps: int = 3) -> tuple[int, float]:
    """(peak bytes, median seconds) of `steps` measured training steps (gradients zeroed as the
    graph expects) after one warm-up step, on the allocator's meter."""
    args, kwargs = split_inputs(inputs, None)
    model.to(device).train()
    args = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in args)
    peak, times = 0, []
    for k in range(steps + 1):
        for p in model.parameters():
            p.grad = None if to_none else torch.zeros_like(p)
        resident = (list(model.parameters()) + list(model.buffers()) + tree_flatten((args, kwargs))[0]
                    + [p.grad for p in model.parameters() if p.grad is not None])
        m = measure(lambda: step_loss(model, loss_fn, args, kwargs).backward(), device, resident=resident,
                    meter="allocator")
        if k:
            peak, times = max(peak, m.peak_bytes), times + [m.time]
    return peak, statistics.median(times)


def _peers(make: Callable, sizes: Sequence[int], dim: str, family: GraphFamily, memory: int, loss_fn: Callable,
           device: torch.device, to_none: bool, max_size: int) -> list[PeerAnswer]:
    extra = int(family.graphs[sizes[0]].meta.get("fixed_breakdown", {}).get("optimizer", 0))  # declared state
    out = []
    blocks: list[str] = []  # the blocks to checkpoint, from plain autograd's first model
    for name in ("plain autograd", "checkpoint every block"):
        peer = PeerAnswer(name, None)
        plain = name == "plain autograd"

        def build(s: int, plain: bool = plain) -> tuple[torch.nn.Module, Any]:
            model, inputs = _built(make, s, dim)
            if plain:
                blocks[:] = blocks or block_names(model)
                return model, inputs
            return checkpoint_every_block(model, blocks), inputs
        if not plain and not blocks:
            peer.reason = "no repeated blocks to checkpoint"
            out.append(peer)
            continue
        for s in sizes:
            model, inputs = build(s)
            peak, seconds = _step(model, inputs, loss_fn, device, to_none)
            peer.peaks[s], peer.times[s] = peak + extra, seconds
        # the peaks' fit guesses; measured steps decide
        coef = fit_polynomial(list(peer.peaks), list(peer.peaks.values()), family.degree)
        guess, _ = largest(lambda s: polynomial_value(coef, s) <= memory, max(sizes), max_size)

        def fits(s: int) -> bool:
            if s not in peer.peaks:
                model, inputs = build(s)
                try:
                    peer.peaks[s] = _step(model, inputs, loss_fn, device, to_none, steps=1)[0] + extra
                except torch.OutOfMemoryError:  # (a real device's memory ran out first)
                    peer.peaks[s] = None
                del model, inputs
            return peer.peaks[s] is not None and peer.peaks[s] <= memory
        peer.size = largest_near(fits, max(guess, 1), max_size)
        out.append(peer)
    return out


def capacity(make: Callable[[int], Any], memory: "str | int", *, dim: str = "batch",
             sizes: Sequence[int] | None = None, max_overhead: float = 1.3, swap: bool | None = None,
             solver: str = "ilp", time_limit: float = 30.0, gap: float = 0.0, verify: bool = False,
             peers: bool = True, max_size: int = MAX_SIZE, device: "str | torch.device | None" = None,
             loss_fn: Callable | None = None, on_probe: Callable[[Probe], None] | None = None,
             progress: bool = False, verify_steps: int = 1, **trace_options: Any) -> CapacityReport:
    """The largest `dim` ("batch" or "seq") per overhead level (no recomputation, <= 1.1x, <=
    `max_overhead`) whose step fits `memory` (bytes, or a size such as ``"24GiB"``); see the
    module docstring.  `sizes`: where to trace (default ``DEFAULT_SIZES[dim]``); `trace_options`
    go to `remat.trace` (granularity, depth, grads, optimizer...); `swap` (default: not on a
    CPU), `solver`, `time_limit` (per probe) and `gap` to the planner; `on_probe(probe)` is called
    as each size is decided; `verify_steps` planned steps are measured with `verify`.  Raises `InvalidInputError` for a memory below what size 1 holds
    before any activation, a model whose inputs do not change with the size, or sizes that trace
    to different graphs."""
    from .budget import parse_memory
    from .planning import default_swap
    memory = parse_memory(memory)
    levels = levels_for(max_overhead)
    if dim not in DEFAULT_SIZES:
        raise InvalidInputError(f"dim: expected one of {tuple(DEFAULT_SIZES)}, got {dim!r}")
    sizes = sorted({int(s) for s in (sizes or DEFAULT_SIZES[dim])})
    if len(sizes) < 2 or sizes[0] < 1:
        raise InvalidInputError(f"--sizes: give two or more sizes >= 1 to trace at, got {list(sizes)}")
    loss_fn = loss_fn or default_loss
    graphs: dict[int, Graph] = {}
    options = dict(trace_options)
    for s in sizes:
        model, inputs = _built(make, s, dim)
        g = trace(model, inputs, loss_fn, device=device, progress=progress, **options)
        graphs[s] = g
        options = _pinned(g, trace_options)
    family = GraphFamily(graphs, dim)
    first = graphs[sizes[0]]
    swap = default_swap(first, solver) if swap is None else bool(swap)
    result = search(family, memory, levels, swap=swap, solver=solver, max_size=max_size, on_probe=on_probe,
                    time_limit=time_limit, gap=gap)
    dev = torch.device(device) if device is not None else torch.device(first.meta.get("device", "cpu"))
    to_none = first.meta.get("grads") == "accumulated"
    report = CapacityReport(result, family,
                            _peers(make, sizes, dim, family, memory, loss_fn, dev, to_none, max_size) if peers else [])
    best = result.best()
    if verify and best.size:
        probe_plan = result.plan()
        report.verification = verify_size(make, best.size, dim, memory, options, loss_fn, dev, swap=swap,
                                          steps=verify_steps, solver=solver, time_limit=time_limit, gap=gap,
                                          start=probe_plan)
    return report


def verify_size(make: Callable, size: int, dim: str, memory: int, trace_options: dict, loss_fn: Callable,
                device: torch.device, steps: int = 1, start: Plan | None = None,
                **plan_options: Any) -> Verification:
    """Trace at `size`, plan within `memory`, run `steps` planned steps and measure their peak
    (and, with more than one step on a CPU, as many plain autograd steps for the time ratio).
    The steps run as a user would run the plan (``executor="auto"``, `remat.apply`): as plain
    autograd where it asks nothing of the step and the plain step measured at that size fits,
    natively where it fits that way, else by the interpreter.
    `start`, the search's plan at that size (made on the scaled graph), runs instead of the fresh
    plan when the traced graph has the same nodes, its schedule fits the memory there too and the
    simulator says it is faster (a solver's time limit can give the fresh plan a worse schedule)."""
    from remat.core.errors import InfeasibleBudgetError, SolverError
    from .planning import plan as make_plan
    model, inputs = _built(make, size, dim)
    graph = trace(model, inputs, loss_fn, device=device, **trace_options)
    reused = _replayed(graph, start, memory)
    try:
        p = make_plan(graph, memory, plan_options.pop("solver", "ilp"), **plan_options)
    except (InfeasibleBudgetError, SolverError) as e:
        if reused is None:
            return Verification(size, None, None, memory, f"the graph traced at {dim} {size} has no plan within the "
                                f"memory: {e}")
        p = None
    if reused is not None and (p is None or reused.predicted["time"] < p.predicted["time"]):
        p = reused
    plain = device.type == "cpu" and steps > 1  # (plain autograd may not fit a real device's memory)
    rep = run_plan(model, inputs, p, steps=steps, device=device, loss_fn=loss_fn, plain=plain, executor="auto",
                   meter="auto")
    return Verification(size, p, rep.peak_bytes, memory, step_time=rep.step_time,
                        plain_time=rep.plain.time if rep.plain is not None else None, executor=rep.executor,
                        predicted_bytes=rep.predicted.get("peak_bytes"), meter=rep.meter)


def _replayed(graph: Graph, start: Plan | None, memory: int) -> Plan | None:
    """`start`'s schedule as a plan of `graph` when `graph` has the same nodes (names, parts) and
    the schedule is valid there and fits `memory`, else None."""
    if start is None or [(v.name, v.kind, v.part_of) for v in graph.nodes] != \
            [(v.name, v.kind, v.part_of) for v in start.graph.nodes]:
        return None
    schedule = start.schedule
    res = simulate(graph, schedule)
    if not res.valid or res.peak_bytes > memory:
        return None
    report = {**schedule.report, "replayed": "the capacity search's schedule at this size, on the graph traced here"}
    return Plan(graph, Schedule(schedule.ops, schedule.stages, report), memory, report,
                predicted_from(graph, res))


__all__ = ["capacity", "verify_size", "example_size", "CapacityReport", "PeerAnswer", "Verification", "DEFAULT_SIZES"]
