"""Griewank's binomial checkpointing (revolve) for chain graphs (docs/references.md, "Griewank").

Revolve's model: a chain of l steps x_i = F_i(x_{i-1}), i = 1..l, reversed with s snapshot
slots, one of them holding x_0.  ``rev(a, b, s)`` reverses steps a+1..b holding x_a: if one step
is left (or one slot), reverse it directly (advancing from x_a for each step when s = 1);
otherwise advance j steps, snapshot x_{a+j}, ``rev(a+j, b, s-1)``, then ``rev(a, a+j, s)``.
The number of advances (un-recorded forward steps) is

    t(1, s) = 0,   t(l, 1) = l(l-1)/2,
    t(l, s) = min_{1<=j<l} [ j + t(l-j, s-1) + t(j, s) ],

with the closed form, for beta(s, r) = C(s+r, s) (the longest chain s slots reverse when no
step is advanced more than r times) and r = min{r : beta(s, r) >= l}:

    t(l, s) = r*l - beta(s+1, r-1)      (beta(s+1, -1) = 0).

Proof sketch of what the code relies on: t(x+1, s) - t(x, s) = r(x+1, s) (inside an r-bracket
the slope is r; at a bracket end x = beta(s, r) the step is r + 1 + x - (beta(s+1, r) -
beta(s+1, r-1)) = r + 1 because beta(s+1, r) - beta(s+1, r-1) = C(s+r, r) = x).  So t(., s) is
convex and f(j) = j + t(l-j, s-1) + t(j, s) is convex in j with forward difference
1 + r(j+1, s) - r(l-j, s-1): the smallest minimiser is the first j where that is >= 0
(`best_split`).  `revolve_table` is the plain DP; tests hold the two to each other.

Mapping onto remat's (Checkmate's) stage model.  Forward node f_{a-1} outputs x_a; x_0 is the
graph input, not a node, so the slot holding it is free.  The backward of layer i reads x_i,
x_{i-1} and the incoming gradient.  For layer i the snapshots held while its backward runs are
the `a` of every rev call enclosing step i.  The keep sets S are:

* before the first backward stage: every node's inputs (at their consumer's stage) plus what the
  first reversed layer (layer l) needs that is already computed: its snapshots and x_{l-1}, x_l;
* in a backward stage of layer i: its snapshots, x_{i-1} and x_i, the stage's inputs, and every
  backward/loss value until its last consumer;

and R is the minimal recomputation S implies (`Schedule.from_sets`).  Because a stage's inputs
must be resident at its start, the advances that prepare layer i happen in layer i+1's stage.

Counting: revolve evaluates t(l, s) advances plus l recorded re-runs.  Here layer i's backward
reads x_i directly, and x_i is already resident (it was an input of layer i+1's backward, or
the loss's for i = l), so the l - 1 recorded re-runs of layers below l and the recorded run of
layer l (which is the first forward computation of x_l) cost nothing extra: the forward nodes
are computed exactly t(l, s) + 1 times in total, i.e. t(l, s) - (l - 1) recomputations.
"""
from __future__ import annotations

import math
from typing import Iterable

from remat.core.analysis import chain_layers, instant_loads
from remat.core.errors import InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Schedule

from .registry import register
from .baselines import checked
from .chen import pick

MAX_SWEEP = 64  # snapshot counts swept by default for long chains (all of 1..l when l <= MAX_SWEEP)


# ---- the binomial model -------------------------------------------------------------------
def beta(s: int, r: int) -> int:
    """C(s+r, s): the longest chain s slots reverse with no step advanced more than r times."""
    return math.comb(s + r, s) if r >= 0 and s >= 0 else 0


def repetitions(l: int, s: int) -> int:
    """r(l, s) = min{r : beta(s, r) >= l}."""
    if s < 1:
        raise ValueError("revolve needs at least one snapshot slot")
    r = 0
    while beta(s, r) < l:
        r += 1
    return r


def binomial_cost(l: int, s: int) -> int:
    """Closed-form t(l, s) = r*l - beta(s+1, r-1): advances needed to reverse l steps with s slots."""
    if l <= 1:
        return 0
    r = repetitions(l, s)
    return r * l - beta(s + 1, r - 1)


def revolve_table(l_max: int, s_max: int) -> tuple[list[list[int]], list[list[int | None]]]:
    """The DP t[l][s] for 1 <= l <= l_max, 1 <= s <= s_max, and its smallest argmin j (None where
    there is no split: l = 1 or s = 1).  Index 0 rows/columns are unused."""
    t = [[0] * (s_max + 1) for _ in range(l_max + 1)]
    arg: list[list[int | None]] = [[None] * (s_max + 1) for _ in range(l_max + 1)]
    for l in range(2, l_max + 1):
        t[l][1] = l * (l - 1) // 2
        for s in range(2, s_max + 1):
            best, best_j = None, None
            for j in range(1, l):
                c = j + t[l - j][s - 1] + t[j][s]
                if best is None or c < best:
                    best, best_j = c, j
            t[l][s], arg[l][s] = best, best_j
    return t, arg


def best_split(l: int, s: int) -> int:
    """Smallest optimal first advance j for rev over l >= 2 steps with s >= 2 slots (convexity,
    module docstring): the first j with 1 + r(j+1, s) >= r(l-j, s-1)."""
    lo, hi = 1, l - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if 1 + repetitions(mid + 1, s) >= repetitions(l - mid, s - 1):
            hi = mid
        else:
            lo = mid + 1
    return lo


def snapshot_sets(l: int, s: int) -> list[frozenset[int]]:
    """For each step i (index i, 1..l; index 0 unused), the `a` of every rev call enclosing it:
    the snapshot indices x_a held while step i is reversed."""
    sets: list[frozenset[int]] = [frozenset()] * (l + 1)
    stack: list[tuple[int, int, int, frozenset[int]]] = [(0, l, s, frozenset())]
    while stack:
        a, b, slots, outer = stack.pop()
        held = outer | {a}
        if b - a == 1 or slots == 1:
            for i in range(a + 1, b + 1):
                sets[i] = held
            continue
        j = best_split(b - a, slots)
        stack.append((a + j, b, slots - 1, held))
        stack.append((a, a + j, slots, held))
    return sets


# ---- mapping onto a chain training graph ------------------------------------------------------
def griewank_schedule(graph: Graph, s: int, fwd: list[int] | None = None) -> Schedule:
    """The revolve schedule with s slots (module docstring) as stage keep sets + minimal R."""
    fwd = fwd if fwd is not None else chain_layers(graph)
    l = len(fwd)
    n = graph.n
    layer_of = {v: k + 1 for k, v in enumerate(fwd)}  # forward node -> step whose output it is
    snaps = snapshot_sets(l, s)

    def need(i: int) -> set[int]:  # forward nodes layer i's backward wants resident
        out = {fwd[a - 1] for a in snaps[i] if a > 0}
        out.add(fwd[i - 1])
        if i >= 2:
            out.add(fwd[i - 2])
        return out

    last_use = [max(succ) if succ else i for i, succ in enumerate(graph.succs)]
    S: list[set[int]] = [set() for _ in range(n)]
    for v in graph.nodes:  # backward and loss values live until their last consumer
        if v.kind != "forward":
            for t in range(v.id + 1, min(last_use[v.id], n - 1) + 1):
                S[t].add(v.id)
    for u, v in graph.edges:  # inputs resident at their consumer's stage
        S[v].add(u)
    first_bwd = next((v.id for v in graph.nodes if v.kind == "backward"), n)
    first_need = need(l)
    for t in range(first_bwd):
        S[t] |= {u for u in first_need if u < t}
    layer = l
    for t in range(first_bwd, n):
        if graph.nodes[t].kind == "forward":
            continue
        reads = [layer_of[u] for u in graph.preds[t] if u in layer_of]
        if reads:  # a backward node belongs to the highest layer whose output it reads
            layer = max(reads)
        S[t] |= {u for u in need(layer) if u < t}
    return Schedule.from_sets(graph, S)


def chain_bound(graph: Graph, budget_bytes: int) -> float | None:
    r"""A lower bound on the recompute-only step time of a chain graph from revolve's optimality,
    or None when the graph is not a chain this argument covers.

    Griewank's theorem (Griewank 1992; Griewank & Walther, TOMS Alg. 799, 2000): reversing l steps
    with at most s snapshots at any time (x_0 in one of them) takes at least t(l, s) advances.
    Every remat schedule maps onto such a reversal, through the instant relaxation
    (`remat.solvers.ilp.instant`, whose solutions cost no more than the schedules they come from):

    * Step j's reversal is the instant t_j = the first backward node that reads x_{j-1} (layer
      j's input), j = 2..l; they must come in the order t_l < ... < t_2, after every forward node.
    * At t_j the schedule holds x_{j-1} (it is an input), which is revolve's cursor.  The values
      useful later are x_1..x_{j-2} (later steps need lower cursors, and advances only go up):
      they are the snapshots, with x_0.  They fit in what t_j leaves free: the budget less the
      fixed bytes, `remat.core.analysis.instant_loads` at t_j and t_j's forward inputs at positions
      >= j-1, so at most k_j = min(room_j // m_min, j-2) of them, m_min the smallest forward
      output.  Hence s = 1 + max_j k_j.
    * Between t_{j+1} and t_j every newly held value x_p was computed from some value held at
      t_{j+1} and everything in between was computed: per gap of the held set, at least (highest
      new value - gap base) computations, which is what revolve pays restoring the base and
      advancing (storing the new snapshots on the way never exceeds the final count).  The forward
      pass is revolve's first sweep (l - 1 advances and the recorded run of step l).

    So the forward computations besides the first pass number R >= t(l, s) - (l - 1), and the
    step takes at least total_time + R * (the cheapest forward time).  On unit chains this is the
    exact optimum (revolve with the shift search reaches it; tests/test_chain_bound.py); on
    heterogeneous chains it is weaker.  Recompute only (a host copy is a snapshot that costs no
    device memory), backward nodes run once.
    """
    try:
        fwd = chain_layers(graph)
    except InvalidInputError:
        return None
    l = len(fwd)
    m_min = min(graph.nodes[v].bytes for v in fwd)
    pos = {v: k + 1 for k, v in enumerate(fwd)}  # forward node -> index of the value it outputs
    if l < 2 or m_min <= 0:
        return None
    bwd = [v for v in graph.nodes if v.kind == "backward"]
    first_read = {}
    for node in bwd:
        for u in graph.preds[node.id]:
            if u in pos and u not in first_read:
                first_read[u] = node.id
    instants = []
    for j in range(2, l + 1):
        t = first_read.get(fwd[j - 2])
        if t is None:
            return None
        instants.append(t)
    if any(a <= b for a, b in zip(instants, instants[1:])) or instants[-1] < max(fwd):
        return None
    load = instant_loads(graph)
    cap = budget_bytes - graph.fixed_bytes
    slots = 0
    for j, t in zip(range(2, l + 1), instants):
        room = cap - load[t] - sum(graph.nodes[u].bytes for u in set(graph.preds[t]) if pos.get(u, 0) >= j - 1)
        if room < 0:
            return None  # nothing fits: the forced-need check says so
        slots = max(slots, min(room // m_min, j - 2))
    advances = binomial_cost(l, 1 + slots)
    cheapest = min(graph.nodes[v].recompute_cost for v in fwd)
    return graph.total_time + max(0, advances - (l - 1)) * cheapest


def snapshot_counts(l: int, max_sweep: int = MAX_SWEEP) -> list[int]:
    """s values to sweep: all of 1..l for short chains, else 1..16 plus a geometric thinning."""
    if l <= max_sweep:
        return list(range(1, l + 1))
    vals = set(range(1, 17))
    x = 16.0
    ratio = (l / 16) ** (1 / max(1, max_sweep - 16))
    while x < l:
        x *= ratio
        vals.add(min(l, round(x)))
    vals.add(l)
    return sorted(vals)


@register("griewank", "binomial checkpointing (revolve) for chain graphs, snapshot count swept")
def griewank(graph: Graph, budget_bytes: int | None = None,
             snapshots: int | Iterable[int] | None = None, **_: object) -> Schedule:
    """Revolve on a chain: the fastest schedule over the swept snapshot counts that fits the
    budget (ties: lower peak); without a budget, the smallest peak.  `snapshots` pins s (an int)
    or the values to sweep."""
    fwd = chain_layers(graph)
    l = len(fwd)
    if snapshots is None:
        counts = snapshot_counts(l)
    elif isinstance(snapshots, int):
        counts = [snapshots]
    else:
        counts = sorted(set(int(x) for x in snapshots))
    if not counts or min(counts) < 1:
        raise InvalidInputError(f"griewank: snapshots must be integers >= 1, got {snapshots!r}")
    tried = []
    for s in counts:
        sched, res = checked(graph, griewank_schedule(graph, s, fwd), None, "griewank")
        tried.append((sched, res, {"snapshots": s, "advances": binomial_cost(l, s)}))
    return pick(graph, tried, budget_bytes, "griewank")
