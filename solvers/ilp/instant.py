r"""The *instant IP*: a cascade-aware relaxation of the ILP, a lower bound and a source of plans.

Checkmate's model (`checkmate`) checks memory after every compute of every stage, which is
what makes it large (R, S and one FREE per stage and edge, plus the U rows).  This model keeps
only the instants at which the schedule advances: instant t is the moment node t is computed for
the first time (every frontier-advancing schedule, staged or an op list in program order, runs
first computes in id order).  Between instant t-1 and instant t a schedule may recompute (and,
with swap, bring back from the host) any values; the model asks only what is resident at each
instant and what was rebuilt in each interval.

Variables (forward values v only; backward values and the loss are computed once, as in the
ILP's default model, so they are resident from their computation to their last use)
----------------------------------------------------------------------------------------------
P[t,v]   binary   v is resident on the device when node t is first computed      (v < t)
N[t,v]   binary   v is computed at least once between instant t-1 and instant t   (v < t-1)
SI[t,v]  binary   (swap) a host copy of v comes back between instant t-1 and t
O[v]     binary   (swap) v is copied to the host (once)
T        continuous  (swap) the step time

Rows
----
need     P[t,u] = 1 for every forward input u of t
keep     P[t,v] <= post(t-1,v) + N[t,v] + SI[t,v]        post(t-1,v) = 1 if v = t-1, else P[t-1,v]
rebuild  N[t,v] <= post(t-1,u) + N[t,u] + SI[t,u]        for every forward input u of v
memory   sum_v M_v P[t,v] <= B - fixed - M_t - W_t - (bytes of non-forward values alive at t)
host     SI[t,v] <= O[v]
time     recompute only: min sum C_v + sum_{t,v} C_v N[t,v]
         swap: min T, T >= sum C_v + sum C_v N[t,v],  T >= sum (M_v / bw) (SI[t,v] + O[v])

Why every schedule is a solution (so the optimum, and CBC's bound, are lower bounds).  Read P
off the schedule at each instant and set N[t,v] = 1 when v is computed at least once in the
interval (SI likewise for host copies coming back).  The inputs of t are resident when it runs
(need); what is resident at instant t was resident at instant t-1 and kept, or is t-1's fresh
output, or was rebuilt in between (keep); the first recomputation of v in the interval finds
each input resident, which it was since instant t-1 or because it was rebuilt before (rebuild);
the resident bytes at instant t, with t's output, its workspace and the gradients still to be
read, fit the budget (memory: the simulator counts all of them at that compute).  Computations
cost their time at least once per interval where N = 1, on top of one pass over the graph; a
host copy costs one transfer out and one per copy back on the single transfer stream, and the
step lasts at least as long as either stream.  Values with no bytes are left out (always
resident).  P[t,v] exists until v's *horizon*, the last program use of v or of any forward
value built from it (a later recomputation of such a value needs v).

What it drops from Checkmate's model is memory inside an interval: a cascade of recomputations
may peak above the budget between two instants.  What it keeps, unlike the window IP
(`bounds.window_bound`), is that a recomputation needs its inputs at that time: rebuilding a
long-dropped value costs the whole chain back to a resident ancestor.  On unit chains its optimum
equals the exact optimum (revolve's count; tested).  Its LP relaxation is as weak as Checkmate's:
the strength is in branching on a model about a fifth the size (docs/results.md has the figures).

Rebuild moments (`in_stage=True`)
---------------------------------
H[t,v]   binary   v is held through interval t: resident from instant t-1 to instant t and
                  neither recomputed nor brought back in between                   (v < t-1)
Z[t]     continuous  bytes of the largest rebuild moment in interval t, beyond the held values
keep     P[t,v] <= H[t,v] + N[t,v] + SI[t,v];   H[t,v] <= P[t-1,v];   H[t,v] <= P[t,v]
moment   Z[t] >= (M_v + W_v + sum_{u in in(v)} M_u) N[t,v] - sum_{u in in(v)} M_u H[t,u]
interval sum_w M_w H[t,w] + Z[t] <= B - fixed - (bytes of non-forward values computed before
         instant t-1 or at it, and read at t or later)
Why every schedule still maps onto a solution: set H as defined; a value resident at both
instants and neither recomputed nor brought back was resident throughout (it cannot reappear
otherwise), so keep holds.  When v is first recomputed in interval t (N = 1), the device holds at
that moment v, its workspace, its inputs, every held value and the gradients alive across the
interval; inputs that are held count once (their H term cancels), so the moment row and the
interval row hold for the largest such moment (tested on every baseline's schedule and the
ILP's).  The rows see a rebuilt value's inputs beside what is held, which the plain model
misses; they do not see rebuilt values kept for later in the interval, so its plans may still
peak above the budget.  Their LP is no stronger (the gain is in
branching), and the model is half as large again, so the exact mode runs it only after the plain
model proved an optimum that does not fit.

Strict moments (`strict=True`, a model for plans, not a bound)
-------------------------------------------------------------
K[t,u]   continuous  K >= N[t,u] + P[t,u] - 1: u is rebuilt in interval t and kept to instant t
moment   as above, plus sum_{u < v rebuilt in t, not an input of v} M_u K[t,u]
`schedule_from` rebuilds an interval's values in id order and keeps those resident at the
instant, so at v's rebuild the earlier ones kept to the instant are resident too; the rebuild
rows miss them (a value rebuilt for a later instant before a concatenation is rebuilt can tip
that moment over the budget).  A schedule that rebuilds in another
order need not satisfy these rows, so the model is no relaxation; the scalable mode's
neighbourhood search uses it where the plain model's plan peaks above the budget.

Rebuild moments on demand (`moments`)
-------------------------------------
The rows above may sit in some intervals only (`build(moments={t: strict?})`): without strict
rows the model is still a relaxation (each interval's rows hold for every schedule on their
own), and it is the plain model's size but for those intervals.  A plan of the plain model
that overflows goes first to `stage_order` (another rebuild order inside the stages that peak
over); the stages where no order fits get rows, then strict rows if they overflow again.  A
few rounds of rows often reach a plan that fits at the relaxation's optimum, which is then the
exact optimum, proven by a relaxation of a few intervals' rows (tested).  A start plan that fits only in another
order may exceed the rows where it rebuilds; `loosen_unmet_moments` raises those rows to its
level so that it stays a solution (then they are no relaxation: a neighbourhood search's
bound is dropped anyway).

An integral solution without host copies is also a schedule: stage t recomputes {v : N[t,v]}
and computes t, and keeps what those computes need (`checkmate.minimal_keep`).  It may peak above
the budget inside a stage, so the caller simulates it like any other candidate.

Here: the model (`build`, `InstantModel`), its warm start and read-back (`set_warm_start`,
`schedule_from`), its solve (`solve`, with path rows from `paths`), the neighbourhoods the
scalable mode frees one at a time (`neighbourhoods`, `time_windows`, `fix_outside`), and the
rebuild-moment rounds (`solve_on_demand`).  The split and coupled bounds over windows of it are
`windows`'.
"""
from __future__ import annotations

import logging
import math
import time as _time
from dataclasses import dataclass, field

import pulp

from remat.core.analysis import checkmate_layout, cut_points, forced_loads, horizons, instant_loads, interval_loads
from remat.core.errors import SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule, Stage
from remat.core.simulate import SimState
from remat.solvers import stage_order

from . import mip, paths
from .checkmate import minimal_keep, prune_waste, time_unit

log = logging.getLogger(__name__)


@dataclass
class InstantModel:
    prob: pulp.LpProblem
    P: dict = field(default_factory=dict)
    N: dict = field(default_factory=dict)
    SI: dict = field(default_factory=dict)
    O: dict = field(default_factory=dict)
    H: dict = field(default_factory=dict)
    Z: dict = field(default_factory=dict)
    K: dict = field(default_factory=dict)  # (strict) rebuilt in the interval and kept to its instant
    moments: dict = field(default_factory=dict)  # interval -> names of its rebuild-moment rows
    T: pulp.LpVariable | None = None
    time_unit: float = 1.0
    swap: bool = False


def variable_counts(graph: Graph) -> list[int]:
    """Per node: the P and N variables `build` creates for its value (without swap), computed
    without building."""
    hor = horizons(graph)
    return [2 * (hor[v] - v) - 1 if node.kind == "forward" and node.bytes > 0 and hor[v] > v else 0
            for v, node in enumerate(graph.nodes)]


def size(graph: Graph) -> int:
    """Number of P and N variables `build` creates (without swap)."""
    return sum(variable_counts(graph))


def build(graph: Graph, budget_bytes: int, *, swap: bool = False, bandwidth: float | None = None,
          in_stage: bool = False, strict: bool = False, window: tuple[int, int] | None = None,
          moments: dict[int, bool] | None = None) -> InstantModel | None:
    """The model of the module docstring (with `in_stage`, its held-through variables and
    rebuild-moment rows; with `strict`, those and the kept rebuilds of "Strict moments"); None
    when some instant cannot hold what it must.

    With `window` = (a, b) (recompute only), the model of instants a..b alone ("Split at tight
    instants"): P at instants a..b, N in the intervals a+1..b, what is resident at instant a
    free (it must only hold a's inputs and fit), and the objective is the recomputation in the
    window alone, without the one pass over the graph.

    With `moments` (interval -> strict?), the rebuild-moment rows only in those intervals, strict
    where it says so ("Rebuild moments on demand")."""
    if moments is None and (in_stage or strict):
        moments = {t: strict for t in range(graph.n)}
    in_stage = bool(moments)
    if window is not None and (swap or in_stage):
        raise ValueError("instant IP: a window model is recompute-only and has no rebuild moments")
    first, last = window if window is not None else (0, graph.n - 1)
    n = graph.n
    C, M = graph.recompute_times, graph.sizes  # (C prices the rebuilds N only)
    fwd = [v.kind == "forward" for v in graph.nodes]
    preds = [sorted(set(p)) for p in graph.preds]
    cap = budget_bytes - graph.fixed_bytes
    load = instant_loads(graph)
    hor = horizons(graph)
    unit = math.gcd(*[m for m in M if m > 0]) or 1
    cu = time_unit(graph)
    bw = float(bandwidth if bandwidth is not None else graph.bandwidth)
    tracked = [fwd[v] and M[v] > 0 for v in range(n)]
    if any(f > cap for f in forced_loads(graph, load)):
        return None
    prob = pulp.LpProblem("remat_instant", pulp.LpMinimize)
    m = InstantModel(prob, time_unit=cu, swap=swap)
    for v in range(n):
        if not tracked[v]:
            continue
        for t in range(max(v + 1, first), min(hor[v], last) + 1):
            m.P[t, v] = pulp.LpVariable(f"P_{t}_{v}", 0, 1, pulp.LpBinary)
            if t >= v + 2 and t > first:
                m.N[t, v] = pulp.LpVariable(f"N_{t}_{v}", 0, 1, pulp.LpBinary)
                if swap:
                    if v not in m.O:
                        m.O[v] = pulp.LpVariable(f"O_{v}", 0, 1, pulp.LpBinary)
                    m.SI[t, v] = pulp.LpVariable(f"SI_{t}_{v}", 0, 1, pulp.LpBinary)
                    prob.addConstraint(m.SI[t, v] <= m.O[v], f"host_{t}_{v}")

    def post(t: int, v: int):  # v resident right after instant t (1 for t's own output)
        return 1 if v == t or not tracked[v] else m.P.get((t, v), 0)

    def back(t: int, v: int):  # v rebuilt or brought back between instants t-1 and t
        return m.N.get((t, v), 0) + m.SI.get((t, v), 0)

    add_parts_rows(graph, m, last)
    for t in range(first, last + 1):
        for u in preds[t]:
            if tracked[u]:
                m.P[t, u].lowBound = 1
    for (t, v), p in m.P.items():
        if t == first and window is not None:
            continue  # (the window's first instant: its residents are free)
        if t >= v + 2 and in_stage and t in moments:
            h = m.H[t, v] = pulp.LpVariable(f"H_{t}_{v}", 0, 1, pulp.LpBinary)
            prob.addConstraint(p <= h + back(t, v), f"keep_{t}_{v}")
            prob.addConstraint(h <= post(t - 1, v), f"held_{t}_{v}")
            prob.addConstraint(h <= p, f"held_to_{t}_{v}")
        elif t >= v + 2:
            prob.addConstraint(p <= post(t - 1, v) + back(t, v), f"keep_{t}_{v}")
    for (t, v), x in m.N.items():
        for u in preds[v]:
            if tracked[u]:
                prob.addConstraint(x <= post(t - 1, u) + back(t, u), f"rebuild_{t}_{v}_{u}")
    by_instant: list[list[int]] = [[] for _ in range(n)]
    for (t, v) in m.P:
        by_instant[t].append(v)
    for t in range(first, last + 1):
        room = cap - load[t]
        if sum(M[v] for v in by_instant[t]) > room:
            prob.addConstraint(pulp.lpSum((M[v] // unit) * m.P[t, v] for v in by_instant[t]) <= room // unit,
                               f"memory_{t}")
    if in_stage:
        add_rebuild_moments(graph, m, cap, unit, moments)
    base = graph.total_time / cu if window is None else 0.0
    recompute = pulp.lpSum((C[v] / cu) * x for (_, v), x in m.N.items())
    if swap:
        T = m.T = pulp.LpVariable("T", 0)
        prob += T
        prob.addConstraint(T >= base + recompute, "compute_stream")
        prob.addConstraint(T >= pulp.lpSum((M[v] / bw / cu) * x for (_, v), x in m.SI.items())
                           + pulp.lpSum((M[v] / bw / cu) * x for v, x in m.O.items()), "transfer_stream")
    else:
        prob += base + recompute
    return m


def add_parts_rows(graph: Graph, m: InstantModel, last: int) -> None:
    """Ops with parts (`remat.core.graph`): nothing is rebuilt or brought back in the interval of
    an op's later part, and an op's parts are rebuilt together with its leader (N[t,p] = N[t,l]
    where both exist; a part's horizon ends no later than its leader's).  Every schedule obeys
    both, so the model stays a relaxation."""
    for op in graph.op_members.values():
        for p in op[1:]:
            for d in (m.N, m.SI):
                for (t, v), x in d.items():
                    if t == p:
                        x.upBound = 0
        for t in range(op[-1] + 1, last + 1):
            lead = m.N.get((t, op[0]))
            if lead is None:
                continue
            for p in op[1:]:
                if (t, p) in m.N:
                    m.prob.addConstraint(m.N[t, p] == lead, f"parts_{t}_{p}")


def add_rebuild_moments(graph: Graph, m: InstantModel, cap: int, unit: int, moments: dict[int, bool]) -> None:
    """The `in_stage` rows (module docstring) in the intervals `moments` names: the held-through
    values and the largest rebuild moment fit beside the gradients alive across it; where
    `moments` says strict, a moment also holds the values rebuilt before it in the interval (in
    id order) and kept to its instant."""
    M, W = graph.sizes, [v.workspace_bytes for v in graph.nodes]
    load = interval_loads(graph)
    rebuilt: dict[int, list[int]] = {}
    for (t, v) in m.N:
        if t in moments:
            rebuilt.setdefault(t, []).append(v)
    held_at: dict[int, list[int]] = {}
    for (t, v) in m.H:
        held_at.setdefault(t, []).append(v)
    for (t, u), x in m.N.items():
        if moments.get(t) and (t, u) in m.P:
            k = m.K[t, u] = pulp.LpVariable(f"K_{t}_{u}", 0)
            m.prob.addConstraint(k >= x + m.P[t, u] - 1, f"kept_{t}_{u}")
    for t, vs in rebuilt.items():
        Z = m.Z[t] = pulp.LpVariable(f"Z_{t}", 0)
        for v in vs:
            inputs = [u for u in set(graph.preds[v]) if (t, u) in m.P]  # tracked forward inputs
            kept = [u for u in vs if u < v and u not in inputs and (t, u) in m.K]
            m.prob.addConstraint(
                Z >= ((M[v] + W[v]) // unit + sum(M[u] // unit for u in inputs)) * m.N[t, v]
                - pulp.lpSum((M[u] // unit) * m.H[t, u] for u in inputs if (t, u) in m.H)
                + pulp.lpSum((M[u] // unit) * m.K[t, u] for u in kept), f"moment_{t}_{v}")
            m.moments.setdefault(t, []).append(f"moment_{t}_{v}")
        m.prob.addConstraint(pulp.lpSum((M[w] // unit) * m.H[t, w] for w in held_at.get(t, [])) + Z
                             <= (cap - load[t]) // unit, f"interval_{t}")


def loosen_unmet_moments(m: InstantModel) -> list[int]:
    """Raise the interval row of every interval whose rows the initial values violate (a start
    plan that fits only in another rebuild order, `stage_order`) to the start's own level, so
    that the start stays a solution and no plan rebuilds more there than it does; returns those
    intervals."""
    rows = m.prob.constraints
    unmet = [t for t in m.moments if rows[f"interval_{t}"].value() > 1e-6]
    for t in unmet:
        rows[f"interval_{t}"].constant -= math.ceil(rows[f"interval_{t}"].value())
    if unmet:
        log.info("instant IP: rebuild-moment rows at %s raised to the start plan's level", unmet)
    return unmet


def solve_on_demand(graph: Graph, budget_bytes: int, first: dict, *, time_limit: float | None = 30.0,
                    threads: int | None = None, start: Schedule | None = None, backend: str = "cbc",
                    rounds: int = 12) -> dict:
    """"Rebuild moments on demand" from a proven optimum (`first`, a `solve` result) whose plan
    overflows inside some stages in every rebuild order (`stage_order.reorder`): solve again with
    rows (not strict: each round is a relaxation and its bound holds) in those stages and every
    stage of the rounds before, until a plan fits in some order, a round is not proven, no new
    stage overflows, or the time or `rounds` run out.  Returns the last round's result with
    "moments" (the intervals with rows) and "bound" the best of the rounds'."""
    t0 = _time.perf_counter()
    out, moments = first, {}
    best = first.get("bound")
    for _ in range(rounds):
        if not out["proven"] or out["schedule"] is None:
            break
        _, over = stage_order.reorder(graph, out["schedule"], budget_bytes)
        new = [t for t in over if t not in moments]
        left = None if time_limit is None else time_limit - (_time.perf_counter() - t0)
        if not new or (left is not None and left < 1.0):
            break
        moments.update({t: False for t in new})
        log.info("instant IP: again with rebuild-moment rows at %s", sorted(moments))
        # (without path rows: the bound is proven already, and a round is after a plan that fits,
        # which the rows' other choice among equal optima can miss)
        out = solve(graph, budget_bytes, time_limit=left, threads=threads, start=start, backend=backend,
                    moments=dict(moments), path=False)
        if out["bound"] is not None:
            best = out["bound"] if best is None else max(best, out["bound"])
    return {**out, "bound": best, "moments": sorted(moments)}


def set_warm_start(graph: Graph, m: InstantModel, schedule: Schedule) -> bool:
    """Initial values read off a schedule's op list; False when it does not map onto the model
    (it computes nodes for the first time out of id order)."""
    for d in (m.P, m.N, m.SI, m.O):
        for x in d.values():
            x.setInitialValue(0, check=False)  # (an input of its instant has lower bound 1)
    state = SimState(graph, check=False)  # what is resident before each op, as the simulator has it
    t = 0  # the next first compute
    for op in schedule.ops:
        v = op.node
        if op.op == "compute":
            if v not in state.counts:
                if v != t:
                    return False
                for u in state.origin:
                    if (t, u) in m.P:
                        m.P[t, u].setInitialValue(1)
                t += 1
            elif (t, v) in m.N:
                m.N[t, v].setInitialValue(1)
        elif op.op == "swap_in" and (t, v) in m.SI:
            m.SI[t, v].setInitialValue(1)
            m.O[v].setInitialValue(1)
        state.apply(op)
    on = lambda d, k: k in d and d[k].varValue is not None and d[k].varValue > 0.5  # noqa: E731
    for (i, v), h in m.H.items():  # resident at both instants, neither rebuilt nor brought back
        h.setInitialValue(int(on(m.P, (i, v)) and on(m.P, (i - 1, v)) and not on(m.N, (i, v))
                              and not on(m.SI, (i, v))))
    for (i, v), k in m.K.items():  # rebuilt in the interval and kept to its instant
        k.setInitialValue(int(on(m.N, (i, v)) and on(m.P, (i, v))))
    for i, z in m.Z.items():  # the largest rebuild moment (each row reads Z - moment >= 0)
        z.setInitialValue(0)
        z.setInitialValue(max([0.0] + [-m.prob.constraints[k].value() for k in m.moments[i]]))
    if m.T is not None:  # the longer stream (each row reads T - stream >= 0)
        m.T.setInitialValue(0)
        m.T.setInitialValue(max(-m.prob.constraints[k].value() for k in ("compute_stream", "transfer_stream")))
    return t == graph.n


def fix_outside(m: InstantModel, region: set[int]) -> None:
    """Fix every binary of a value outside `region` to its initial value (`set_warm_start`)."""
    _fix_unless(m, lambda t, v: v in region)
    for v, x in m.O.items():
        if v not in region:
            x.lowBound = x.upBound = round(x.varValue or 0)


def fix_outside_instants(m: InstantModel, window: tuple[int, int]) -> None:
    """Fix every binary of an instant or interval outside (a, b] to its initial value
    (`set_warm_start`)."""
    a, b = window
    _fix_unless(m, lambda t, v: a < t <= b)


def _fix_unless(m: InstantModel, free) -> None:
    """Fix each P, N, SI and H at (t, v) to its initial value unless free(t, v)."""
    for d in (m.P, m.N, m.SI, m.H):
        for (t, v), x in d.items():
            if not free(t, v):
                val = round(x.varValue or 0)
                if (x.lowBound or 0) <= val:  # (an input of its instant stays at its lower bound 1)
                    x.lowBound = x.upBound = val


def time_windows(graph: Graph, parts: int = 3) -> list[tuple[int, int]]:
    """Runs of instants (a, b] with about equal numbers of instant-IP variables, `parts` of
    them, and the `parts` - 1 runs from the middle of one to the middle of the next: the time
    windows a neighbourhood search frees one at a time (every value's P and N inside)."""
    weight = [0] * graph.n
    for v, hor in enumerate(horizons(graph)):
        if graph.nodes[v].kind == "forward" and graph.nodes[v].bytes > 0:
            for t in range(v + 1, hor + 1):
                weight[t] += 1 + (t >= v + 2)
    total = sum(weight) or 1
    marks, acc = [], 0  # the instants where the running weight crosses k / (2 parts) of the total
    for t, w in enumerate(weight):
        acc += w
        while len(marks) < 2 * parts - 1 and acc >= total * (len(marks) + 1) / (2 * parts):
            marks.append(t)
    ends = [-1] + marks[1::2] + [graph.n - 1]
    mids = marks[0::2]
    out = [(a, b) for a, b in zip(ends, ends[1:]) if b > a]
    out += [(a, b) for a, b in zip(mids, mids[1:]) if b > a]
    return list(dict.fromkeys(out))


def neighbourhoods(graph: Graph, parts: int = 3) -> list[set[int]]:
    """Contiguous runs of forward nodes with about equal numbers of instant-IP variables, each
    ending at the articulation point nearest its balanced end where the graph has them: the
    regions a neighbourhood search frees one at a time.  Contiguous and cut at block ends (an end
    moves at most a quarter of a region's length), because what makes a value worth keeping or
    rebuilding is its block's choice: blocks freed together improve plans where halves of them
    freed in turn do not (docs/results.md)."""
    weight = variable_counts(graph)
    fwd = [v for v in range(graph.n) if graph.nodes[v].kind == "forward"]
    total = sum(weight) or 1
    ends, acc = [], 0
    for v in fwd:
        acc += weight[v]
        if len(ends) < parts - 1 and acc >= total * (len(ends) + 1) / parts:
            ends.append(v)
    m = checkmate_layout(graph)
    cuts = cut_points(graph, m) if m else []
    near = len(fwd) / (4 * parts)  # how far an end may move to the nearest cut
    ends = [min([e] + [p for p in cuts if abs(p - e) <= near], key=lambda p: (p == e, abs(p - e), p))
            for e in ends]
    out, lo = [], 0
    for e in sorted(set(ends)) + [max(fwd, default=-1)]:
        run = {v for v in fwd if lo <= v <= e}
        if run:
            out.append(run)
        lo = e + 1
    return out


def schedule_from(graph: Graph, m: InstantModel) -> Schedule | None:
    """The staged schedule an integral recompute-only solution describes (module docstring)."""
    val = lambda x: x.varValue is not None and x.varValue > 0.5  # noqa: E731
    if any(val(x) for x in m.SI.values()):
        return None
    n = graph.n
    R = [{t} for t in range(n)]
    for (t, v), x in m.N.items():
        if val(x):
            R[t].add(v)
    for t in range(n):  # an op rebuilt brings all its parts (those past their horizon too)
        for v in list(R[t]):
            members = graph.op_members.get(graph.op_of[v])
            if members is not None and members[-1] < t:
                R[t].update(members)
    none = [set() for _ in range(n)]
    try:
        S = minimal_keep(graph, R, none, none, none)
    except AssertionError:
        return None
    sched = Schedule.from_stages(graph, [Stage(sorted(R[t]), sorted(S[t])) for t in range(n)])
    return prune_waste(graph, sched)


def solve(graph: Graph, budget_bytes: int, *, swap: bool = False, bandwidth: float | None = None,
          time_limit: float | None = 30.0, threads: int | None = None, start: Schedule | None = None,
          msg: bool = False, progress=None, in_stage: bool = False, backend: str = "cbc",
          region: set[int] | None = None, strict: bool = False, instants: tuple[int, int] | None = None,
          moments: dict[int, bool] | None = None, path: bool = True, give_up=None) -> dict:
    """Run CBC (or HiGHS) on the instant IP, from `start` when given.  Returns {"bound": seconds
    or None, "schedule": Schedule or None, "objective": seconds or None, "proven": bool,
    "infeasible": bool, "variables": int}.  The bound is valid for every schedule whose backward
    nodes run once (see the module docstring).  `progress` gets CBC's incumbent and bound as
    `mip.run` reports them (the incumbent is the model's, which a plan may not reach).

    With `region` (a set of forward nodes; needs a `start` that maps onto the model), every
    variable of a value outside it is fixed to `start`'s value: a neighbourhood search around
    `start` (see `neighbourhoods`), whose bound is not the graph's (it is dropped); with
    `instants` = (a, b), every variable of an instant or interval outside (a, b]
    (`time_windows`), likewise.  `strict` builds the model of "Strict moments" (a plan model,
    not a relaxation: its bound is dropped too); `moments` (interval -> strict?) puts the
    rebuild-moment rows only in those intervals (`build`; its bound is dropped where one is
    strict).  `path`: recompute only, where the bound counts (no region, no instants, not
    strict), first add the path rows its LP violates (`paths.add_path_rows`, for up to
    `paths.PATH_SHARE` of the time limit).  `give_up(elapsed, bound in seconds or None)` (HiGHS only, `mip.run`):
    stop the solve when it returns True."""
    m = build(graph, budget_bytes, swap=swap, bandwidth=bandwidth, in_stage=in_stage, strict=strict,
              moments=moments)
    strict = strict or any((moments or {}).values())
    if m is None:
        return {"bound": None, "schedule": None, "objective": None, "proven": False, "infeasible": True,
                "variables": 0}
    if path and not swap and region is None and instants is None and not strict:
        time_limit = paths.path_rows_within(graph, m, time_limit, least=1.0)
    warm = start is not None and set_warm_start(graph, m, start)
    loosened = loosen_unmet_moments(m) if warm and moments else []
    if region is not None or instants is not None:
        if not warm:
            raise SolverError("instant IP: a neighbourhood search needs a start that maps onto the model")
        if region is not None:
            fix_outside(m, region)
        if instants is not None:
            fix_outside_instants(m, instants)
    nvar = len(m.P) + len(m.N) + len(m.SI) + len(m.O) + len(m.H) + len(m.Z) + len(m.K)
    log.info("instant IP: %d variables, %d rows, warm start %s", nvar, len(m.prob.constraints), warm)
    try:
        out = mip.run(m, backend, time_limit, 0.0, threads, warm, msg, progress=progress if backend == "cbc" else None,
                       give_up=give_up)
    except SolverError as e:
        log.info("instant IP: %s failed (%s)", backend, e)
        return {"bound": None, "schedule": None, "objective": None, "proven": False, "infeasible": False,
                "variables": nvar}
    cu = m.time_unit
    sched = None
    obj = None
    if out["sol_status"] in (1, 2) and out["objective"] is not None:
        obj = out["objective"] * cu
        sched = schedule_from(graph, m)
    bound = out["bound"] * cu if out["bound"] is not None and not out["infeasible"] and region is None \
        and instants is None and not strict and not loosened else None
    if bound is not None:
        bound = max(bound, graph.total_time)
    return {"bound": bound, "schedule": sched, "objective": obj, "proven": bool(out["proven"]),
            "infeasible": bool(out["infeasible"]), "variables": nvar}


__all__ = ["InstantModel", "build", "solve", "solve_on_demand", "set_warm_start", "schedule_from", "variable_counts",
           "size", "neighbourhoods", "time_windows", "fix_outside", "fix_outside_instants", "add_rebuild_moments",
           "loosen_unmet_moments"]
