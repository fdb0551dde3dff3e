"""Solvers that plan per node on graphs whose ops have several parts (`remat.core.graph`).

A graph with parts lists an op's output tensors as separate nodes (leader and later parts), each
freed at its own last use; an op's parts are computed together.  The ILP plans that natively (the
``parts`` rows of its exact model and its instant IP, coarsening at op boundaries), registered
with ``parts=True``; so does checkpoint-all.  Every other strategy plans the *merged* graph, where each op is
one node again (its parts' bytes summed, `coarsen.coarsen` over the ops: the op's workspace is its
leader's own), and its schedule is expanded back (`expand`):

* stage schedules by `coarsen.expand`: a merged stage's computes become the computes of all the
  op's parts, the first compute of a merged node the stages of its parts, and the keeps the
  minimal ones those computes need (`checkmate.minimal_keep`), so each part is held only while a
  reader needs it: the same plan, each tensor freed at its own last use;
* bare op lists op by op: ``compute`` of a merged node becomes the computes of its parts, and
  ``free``, ``swap_out``, ``swap_in``, ``wait`` apply to each part with bytes (parts are freed
  together there, as the merged plan frees them).

At every op the expanded schedule holds at most the bytes of the merged one, so it fits the
budget the merged plan fits (the simulator checks it on the graph with parts).  What it is not:
optimal for the graph with parts, even when the merged plan is optimal for the merged graph (the
merged graph restricts which tensors can part ways), so a merged "optimal" is reported as
"feasible", with the graph's no-recomputation time as the bound.
"""
from __future__ import annotations

from typing import Callable

from remat.core.graph import Graph
from remat.core.schedule import Op, Schedule

from .ilp.coarsen import Coarsening, coarsen, expand

MERGED_NOTE = "planned on the merged graph (each op's parts kept together), expanded to the parts"


def merge(graph: Graph) -> Coarsening:
    """The merged graph: each op of `graph` one node (`coarsen` over its ops)."""
    groups, v = [], 0
    while v < graph.n:
        members = graph.members_of(v)
        groups.append(members)
        v = members[-1] + 1
    co = coarsen(graph, groups)
    co.graph.meta["model"] = graph.meta.get("model", "?")
    co.graph.meta["merged_from"] = graph.n
    return co


def expand_ops(co: Coarsening, ops: list[Op]) -> list[Op]:
    """A bare op list of the merged graph as ops of the graph with parts (module docstring)."""
    g = co.fine
    out: list[Op] = []
    for o in ops:
        members = co.groups[o.node]
        if o.op == "compute":
            out.extend(Op("compute", m, o.stage) for m in members)
        else:
            out.extend(Op(o.op, m, o.stage) for m in members if o.op == "free" or g.nodes[m].bytes > 0)
    return out


def expand_schedule(co: Coarsening, merged: Schedule) -> Schedule:
    """`merged` (a schedule of `co.graph`) on the graph with parts; the report says how it was made."""
    if merged.stages is not None:
        sched = expand(co, merged)
    else:
        sched = Schedule(expand_ops(co, merged.ops))
    report = dict(merged.report)
    if report.get("status") == "optimal":
        report["status"] = "feasible"
    if report.get("status") in ("optimal", "feasible") or "lower_bound" in report:
        report["lower_bound"] = co.fine.total_time
        report["bound_from"] = "no recomputation (the merged graph's bound does not hold for its parts)"
        obj = report.get("objective")
        if isinstance(obj, (int, float)) and obj > 0:
            report["gap"] = max(0.0, (obj - co.fine.total_time) / obj)
    report["parts"] = MERGED_NOTE
    sched.report = report
    return sched


def solve_merged(fn: Callable, graph: Graph, *args, **options) -> Schedule:
    """``fn(graph, *args, **options)`` (a ``solve(graph, budget_bytes, **options)``) planned on
    `graph`'s merged graph and expanded to its parts (module docstring)."""
    co = merge(graph)
    return expand_schedule(co, fn(co.graph, *args, **options))


def on_merged(fn: Callable) -> Callable:
    """`fn` for graphs with parts by `solve_merged`; graphs without parts go to `fn` as they are."""
    def solve(graph: Graph, *args, **options):
        return solve_merged(fn, graph, *args, **options) if graph.has_parts else fn(graph, *args, **options)
    solve.__doc__ = fn.__doc__
    solve.__name__ = getattr(fn, "__name__", "solve")
    solve.__wrapped__ = fn
    return solve


__all__ = ["merge", "expand_ops", "expand_schedule", "solve_merged", "on_merged", "MERGED_NOTE"]
