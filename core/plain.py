"""The plain class: plans that ask nothing of the step, run as the model's own plain autograd.

A schedule is *plain* when it computes every node once and swaps nothing: nothing is recomputed,
nothing moves to the host, and no tensor can be freed before its last reader has run, which is
what plain autograd does anyway.  Such a plan needs no executor: the model trains as it is
(``loss_fn(model(x), y).backward()``, no hooks, no replayed ops), at plain autograd's own speed.

What plain autograd holds is what PyTorch's eager step holds, which a graph's memory model
approximates but need not equal (on a CPU eager attention dropout saves a float mask where the
captured joint graph keeps a bool one: transformers' GPT-2 holds 5 % more than its keep-all
prediction).  So the prediction of a plain run is not the simulator's peak but the plain step the
trace measured (``graph.meta["plain_step"]``: its peak on the allocator's meter, CUDA's
``max_memory_allocated`` or the CPU allocator's log, and on the storage accounting, at the traced
input shapes, in PyTorch's default loop), and a plain plan runs so only where that measured peak
is within the plan's budget.  The simulator still gives the time: computing every node once is
plain autograd's step, overhead 1.0.
"""
from __future__ import annotations

from .graph import Graph
from .schedule import Schedule
from .simulate import simulate


def plain_obstacle(graph: Graph, schedule: Schedule, budget_bytes: int) -> str | None:
    """Why the model cannot run `schedule` as plain autograd within `budget_bytes` (None: it can,
    module docstring)."""
    measured = graph.meta.get("plain_step")
    if not measured:
        return ("the trace measured no plain step (it does with profile='measure', no optimizer named and "
                "gradients set to None between steps)")
    if measured.get("input_shapes") != graph.meta.get("input_shapes"):
        return "the plain step was measured at other input shapes than this graph's"
    computes: dict[int, int] = {}
    for o in schedule.ops:
        if o.op in ("swap_out", "swap_in"):
            return f"it swaps {graph.nodes[o.node].name}"
        if o.op == "compute":
            computes[o.node] = computes.get(o.node, 0) + 1
            if computes[o.node] > 1:
                return f"it recomputes {graph.nodes[o.node].name}"
    peak = int(measured["peak_bytes"])
    if peak > budget_bytes:
        return f"plain autograd's measured peak ({peak:,} bytes) is over the budget of {budget_bytes:,}"
    return None


def plain_prediction(graph: Graph, schedule: Schedule) -> dict:
    """What running `schedule` as plain autograd predicts: the traced plain step's peaks
    (``peak_bytes`` on the allocator's meter, ``storage_peak_bytes`` on the storage accounting)
    and the simulator's time and overhead of computing every node once; nothing on the host."""
    measured = graph.meta["plain_step"]
    sim = simulate(graph, schedule)
    return {"peak_bytes": int(measured["peak_bytes"]), "storage_peak_bytes": int(measured["storage_peak_bytes"]),
            "time": sim.time, "overhead": sim.overhead(graph), "host_peak_bytes": 0}


__all__ = ["plain_obstacle", "plain_prediction"]
