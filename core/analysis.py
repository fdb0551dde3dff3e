"""Graph analyses that several solvers and bounds share.  Nothing here imports torch.

Instants.  Every frontier-advancing schedule (staged, or an op list in program order) computes
node t for the first time in id order; *instant t* is that moment.  Only forward values are ever
recomputed (autograd runs each backward node once), so at instant t every schedule holds:

* t's output and workspace, the non-forward values (gradients, the loss) computed before t and
  read at t or later, and the persistent bytes of every node before t (`instant_loads`; the
  latter two alone, alive across the interval between instants t-1 and t: `interval_loads`);
* t's forward inputs (`forced_loads` adds them).

`free_room` is what a budget leaves beyond that; `forced_need` the smallest whole-step budget
for which every instant fits at all.  A value's *horizon* (`horizons`) is its last program use
or that of any forward value built from it: a later recomputation of such a value needs it.

Structure.  `checkmate_layout` recognises forward 0..m-1, loss m, backward m+1..2m (what
`remat.trace` and `remat.generators.from_forward` build); `cut_points` finds where such a graph
splits into a chain of blocks; `chain_layers` the forward nodes of a chain.  `node_need` is the
least any schedule needs for its largest node; `recompute_in` reads a schedule's recomputation
time per window of instants.
"""
from __future__ import annotations

from .errors import InfeasibleBudgetError, InvalidInputError
from .graph import Graph
from .schedule import Schedule


def horizons(graph: Graph) -> list[int]:
    """Per node: the last program use of it or of any forward value computed from it."""
    fwd = [v.kind == "forward" for v in graph.nodes]
    hor = [max(s, default=v) for v, s in enumerate(graph.succs)]
    for v in reversed(range(graph.n)):
        for s in graph.succs[v]:
            if fwd[s]:
                hor[v] = max(hor[v], hor[s])
    return hor


def interval_loads(graph: Graph) -> list[int]:
    """Per t: the bytes of non-forward values computed before t and read at t or later
    (gradients and the loss, never recomputed, stay resident), and the persistent bytes of the
    nodes before t: alive at instant t and across the interval between instants t-1 and t."""
    load = list(graph.persistent_before)
    for v, node in enumerate(graph.nodes):
        if node.kind != "forward" and graph.succs[v]:
            for t in range(v + 1, max(graph.succs[v]) + 1):
                load[t] += node.bytes
    return load


def instant_loads(graph: Graph) -> list[int]:
    """Per instant t: the bytes resident besides forward values (t's output and workspace, and
    `interval_loads`; t's own persistent bytes count after it: `remat.core.simulate`)."""
    return [alive + graph.nodes[t].bytes + graph.nodes[t].workspace_bytes
            for t, alive in enumerate(interval_loads(graph))]


def forced_loads(graph: Graph, load: list[int] | None = None) -> list[int]:
    """Per instant t: `instant_loads` (given or computed) plus t's forward inputs, i.e. the bytes
    every schedule holds on the device when t first runs, besides the fixed bytes (only forward
    values are ever recomputed)."""
    load = instant_loads(graph) if load is None else load
    return [load[t] + sum(graph.nodes[u].bytes for u in set(graph.preds[t]) if graph.nodes[u].kind == "forward")
            for t in range(graph.n)]


def free_room(graph: Graph, budget_bytes: int) -> list[int]:
    """Per instant t: the bytes the budget leaves beyond the fixed bytes and what every schedule
    holds when t first runs (`forced_loads`)."""
    cap = budget_bytes - graph.fixed_bytes
    return [cap - f for f in forced_loads(graph)]


def forced_need(graph: Graph) -> int:
    """Whole-step bytes below which no recompute-only schedule exists: at the instant node t is
    first computed, t's output and workspace, its inputs, and every non-forward value that a
    later node reads are resident (only forward nodes are recomputed): `forced_loads`; and at
    the step's end every persistent byte and the optimizer step's transient."""
    return max(list(forced_loads(graph)) + [graph.step_end_bytes]) + graph.fixed_bytes


def check_forced_need(graph: Graph, budget_bytes: int) -> None:
    """Raise `InfeasibleBudgetError` (naming the bytes needed) when the budget is below
    `forced_need`: no recompute-only schedule with backward nodes run once exists."""
    need = forced_need(graph)
    if budget_bytes < need:
        raise InfeasibleBudgetError(
            f"budget {budget_bytes} bytes is below {need} bytes: at some stage a node, its inputs and the "
            f"gradients still to be read (which are never recomputed) need that much with the "
            f"{graph.fixed_bytes} fixed bytes", budget_bytes, min_feasible_lower_bound=need,
            fixed_bytes=graph.fixed_bytes)


def node_need(graph: Graph) -> int:
    """Whole-step bytes the largest node needs with its inputs and workspace (and the persistent
    bytes of the nodes before it; all of them at the step's end): no budget goes lower."""
    before = graph.persistent_before
    return max([v.bytes + v.workspace_bytes + before[v.id] + sum(graph.nodes[u].bytes for u in set(graph.preds[v.id]))
                for v in graph.nodes] + [graph.step_end_bytes]) + graph.fixed_bytes


def check_budget(graph: Graph, budget_bytes: int) -> None:
    """Cheap necessary condition: every node must fit with its inputs and workspace."""
    need = node_need(graph)
    if budget_bytes < need:
        raise InfeasibleBudgetError(
            f"budget {budget_bytes} bytes is below {need} bytes, what the largest node needs with its "
            f"inputs, workspace and the {graph.fixed_bytes} fixed bytes", budget_bytes,
            min_feasible_lower_bound=need, fixed_bytes=graph.fixed_bytes)


def checkmate_layout(graph: Graph) -> int | None:
    """m if the graph is forward 0..m-1, loss m, backward m+1..2m (as `from_forward` and
    `remat.trace` build them), else None."""
    n = graph.n
    if n % 2 == 0:
        return None
    m = n // 2
    kinds = [v.kind for v in graph.nodes]
    if kinds[:m] == ["forward"] * m and kinds[m] == "loss" and kinds[m + 1:] == ["backward"] * m:
        return m
    return None


def cut_points(graph: Graph, m: int) -> list[int]:
    """Forward positions p (0 <= p < m - 1) at which a Checkmate-layout graph (`checkmate_layout`
    gives m) splits into a chain of blocks: no forward edge jumps over p (every value made at or
    before p and read after it is p itself), no backward node of the right side reads a forward
    value before p, and none of the left side reads one after p."""
    blocked = [0] * (m + 1)

    def block(lo: int, hi: int) -> None:  # positions lo..hi-1
        if lo < hi:
            blocked[max(0, lo)] += 1
            blocked[min(m, hi)] -= 1

    for v in range(graph.n):
        for u in set(graph.preds[v]):
            if u >= m:
                continue  # gradients and the loss: the crossing sets take care of them
            if v <= m:
                block(u + 1, v)          # a forward edge over p
            else:
                q = 2 * m - v            # v is the backward of forward q
                if u < q:
                    block(u + 1, q)      # right-side backward reading left of p
                else:
                    block(q, u)          # left-side backward reading right of p
    out, run = [], 0
    for p in range(m - 1):
        run += blocked[p]
        if run == 0:
            out.append(p)
    return out


def chain_layers(graph: Graph) -> list[int]:
    """The forward nodes in chain order, or InvalidInputError if they are not a path."""
    fwd = graph.forward_ids()
    fset = set(fwd)
    for k, v in enumerate(fwd):
        fpreds = sorted(u for u in graph.preds[v] if u in fset)
        if fpreds != ([fwd[k - 1]] if k else []):
            raise InvalidInputError(
                f"griewank needs a chain: forward node {v} ({graph.nodes[v].name!r}) has forward inputs "
                f"{fpreds}, expected {[fwd[k - 1]] if k else []}; use chen-greedy or ilp for this graph")
    if not fwd:
        raise InvalidInputError("griewank needs a chain of forward nodes; this graph has none")
    return fwd


def recompute_in(graph: Graph, schedule: Schedule, window: tuple[int, int]) -> float:
    """Seconds a schedule spends recomputing between instants a and b (the intervals a+1..b;
    a recomputation belongs to the interval of the next first compute)."""
    a, b = window
    seen: set[int] = set()
    spent, pending = 0.0, 0.0
    for op in schedule.ops:
        if op.op != "compute":
            continue
        if op.node in seen:
            pending += graph.nodes[op.node].recompute_cost
            continue
        seen.add(op.node)
        if a < op.node <= b:
            spent += pending
        pending = 0.0
    return spent


__all__ = ["horizons", "interval_loads", "instant_loads", "forced_loads", "free_room", "forced_need",
           "check_forced_need", "node_need", "check_budget", "checkmate_layout", "cut_points", "chain_layers",
           "recompute_in"]
