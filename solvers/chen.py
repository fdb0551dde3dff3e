"""Chen et al. (2016) checkpointing baselines: sqrt(n) and greedy, over all forward nodes
("linearized") or over articulation points ("-ap"), as Checkmate implements them (docs/references.md, "Chen et al.").

Every strategy here picks a checkpoint set K of forward nodes and hands it to
`schedule_from_checkpoints`, the pipeline every checkpoint-set baseline shares, so the only thing
that differs between strategies is K:

* ``chen-sqrtn`` / ``chen-sqrtn-ap``: candidates C in topological order, k = floor(sqrt(|C|)),
  K = every k-th candidate (``sqrt_checkpoints``).  Budget-free: one schedule, which either fits
  the budget or is reported infeasible with its own peak as the smallest budget it can meet.
* ``chen-greedy`` / ``chen-greedy-ap``: for a segment budget b, walk the forward nodes in
  topological order with ``acc += bytes(v)``; when v is a candidate and ``acc > b``, checkpoint v
  and reset ``acc = 0``.  b is swept over a grid (distinct prefix sums of forward bytes, thinned,
  plus sqrt-based values around total / sqrt(m)); each distinct K is simulated and the fastest
  schedule whose peak fits the budget wins (ties: the lower peak).  Without a budget the schedule
  with the smallest peak wins (ties: the faster).

Articulation points follow Checkmate: a forward node whose removal disconnects the undirected
forward graph after adding a virtual source joined to the first forward node and a virtual sink
joined to the last forward node.  On a chain every forward node is one; inside the span of a
skip connection none is.
"""
from __future__ import annotations

import math
from typing import Iterable

from remat.core.errors import InfeasibleBudgetError
from remat.core.graph import Graph
from remat.core.schedule import Schedule
from remat.core.simulate import SimResult

from .registry import register
from .baselines import checked, schedule_from_checkpoints, sqrt_checkpoints

MAX_SEGMENT_BUDGETS = 64
_SQRT_FACTORS = (0.25, 0.5, 1 / math.sqrt(2), 1.0, math.sqrt(2), 2.0, 4.0)


def articulation_points(graph: Graph) -> list[int]:
    """Checkmate's articulation points of the forward graph, ascending."""
    import networkx as nx
    fwd = graph.forward_ids()
    if not fwd:
        return []
    fset = set(fwd)
    source, sink = "source", "sink"
    g = nx.Graph()
    g.add_nodes_from(fwd)
    g.add_edges_from((a, b) for a, b in graph.edges if a in fset and b in fset)
    g.add_edge(source, fwd[0])
    g.add_edge(fwd[-1], sink)
    return sorted(v for v in nx.articulation_points(g) if v in fset)


def greedy_checkpoints(graph: Graph, candidates: Iterable[int], segment_budget: float) -> list[int]:
    """Chen's greedy rule: checkpoint a candidate once the segment's bytes exceed `segment_budget`."""
    cand = set(candidates)
    K: list[int] = []
    acc = 0
    for v in graph.forward_ids():
        acc += graph.nodes[v].bytes
        if v in cand and acc > segment_budget:
            K.append(v)
            acc = 0
    return K


def segment_budgets(graph: Graph, max_values: int = MAX_SEGMENT_BUDGETS) -> list[float]:
    """The grid of segment budgets the greedy strategies sweep, ascending.

    0 (checkpoint every candidate), the distinct prefix sums of forward bytes thinned evenly to at
    most `max_values`, and Chen's sqrt-based values total/sqrt(m) * {1/4 .. 4}.
    """
    fwd = graph.forward_ids()
    prefix: list[int] = []
    acc = 0
    for v in fwd:
        acc += graph.nodes[v].bytes
        prefix.append(acc)
    distinct = sorted(set(prefix))
    if len(distinct) > max_values:
        step = (len(distinct) - 1) / (max_values - 1)
        distinct = sorted({distinct[round(i * step)] for i in range(max_values)})
    values: set[float] = {0.0, *map(float, distinct)}
    if fwd and acc > 0:
        base = acc / math.sqrt(len(fwd))
        values.update(base * f for f in _SQRT_FACTORS)
    return sorted(values)


def pick(graph: Graph, candidates: list[tuple[Schedule, SimResult, dict]], budget_bytes: int | None,
         name: str) -> Schedule:
    """The fastest candidate whose simulated peak fits the budget (ties: lower peak); without a
    budget, the one with the smallest peak (ties: faster).  Each candidate's report gains its
    extra keys.  Raises InfeasibleBudgetError naming the smallest peak among the candidates:
    the smallest budget *this strategy* can meet, not a bound for the problem."""
    if not candidates:
        raise AssertionError(f"{name}: no candidate schedules")
    if budget_bytes is None:
        sched, res, extra = min(candidates, key=lambda c: (c[1].peak_bytes, c[1].time))
    else:
        fits = [c for c in candidates if c[1].peak_bytes <= budget_bytes]
        if not fits:
            smallest = min(c[1].peak_bytes for c in candidates)
            raise InfeasibleBudgetError(
                f"{name}: no schedule it tried fits the budget of {budget_bytes} bytes; its smallest "
                f"peak is {smallest} bytes (a bound for this strategy only: the ilp solver may fit less)",
                budget_bytes, min_feasible_bytes=smallest, fixed_bytes=graph.fixed_bytes)
        sched, res, extra = min(fits, key=lambda c: (c[1].time, c[1].peak_bytes))
    sched.report.update(extra)
    sched.report.update({"peak_bytes": res.peak_bytes, "time": res.time})
    return sched


def _from_checkpoints(graph: Graph, K: list[int], name: str, extra: dict) -> tuple[Schedule, SimResult, dict]:
    sched, res = checked(graph, schedule_from_checkpoints(graph, K), None, name)
    return sched, res, {"checkpoints": list(K), **extra}


def _sqrtn(graph: Graph, candidates: list[int], budget_bytes: int | None, name: str) -> Schedule:
    K = sqrt_checkpoints(candidates)
    return pick(graph, [_from_checkpoints(graph, K, name, {"candidates": len(candidates)})],
                budget_bytes, name)


def _greedy(graph: Graph, candidates: list[int], budget_bytes: int | None, name: str,
            segment_budget: float | None = None) -> Schedule:
    grid = [float(segment_budget)] if segment_budget is not None else segment_budgets(graph)
    seen: dict[tuple[int, ...], float] = {}
    for b in grid:  # ascending, so each K records the smallest b that yields it
        K = tuple(greedy_checkpoints(graph, candidates, b))
        seen.setdefault(K, b)
    tried = [_from_checkpoints(graph, list(K), name, {"segment_budget": b, "candidates": len(candidates)})
             for K, b in seen.items()]
    sched = pick(graph, tried, budget_bytes, name)
    sched.report["segment_budgets_tried"] = len(grid)
    return sched


@register("chen-sqrtn", "Chen sqrt(n): every floor(sqrt(m))-th forward node is a checkpoint")
def chen_sqrtn(graph: Graph, budget_bytes: int | None = None, **_: object) -> Schedule:
    return _sqrtn(graph, graph.forward_ids(), budget_bytes, "chen-sqrtn")


@register("chen-sqrtn-ap", "Chen sqrt(n) over the articulation points of the forward graph")
def chen_sqrtn_ap(graph: Graph, budget_bytes: int | None = None, **_: object) -> Schedule:
    return _sqrtn(graph, articulation_points(graph), budget_bytes, "chen-sqrtn-ap")


@register("chen-greedy", "Chen greedy segments over all forward nodes, segment budget swept")
def chen_greedy(graph: Graph, budget_bytes: int | None = None, segment_budget: float | None = None,
                **_: object) -> Schedule:
    """Chen greedy over all forward nodes; `segment_budget` pins b instead of sweeping it."""
    return _greedy(graph, graph.forward_ids(), budget_bytes, "chen-greedy", segment_budget)


@register("chen-greedy-ap", "Chen greedy segments over articulation points, segment budget swept")
def chen_greedy_ap(graph: Graph, budget_bytes: int | None = None, segment_budget: float | None = None,
                   **_: object) -> Schedule:
    """Chen greedy over articulation points; `segment_budget` pins b instead of sweeping it."""
    return _greedy(graph, articulation_points(graph), budget_bytes, "chen-greedy-ap", segment_budget)
