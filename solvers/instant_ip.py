r"""The *instant IP*: a cascade-aware relaxation of the ILP, a lower bound and a source of plans.

Checkmate's model (solvers/ilp.py) checks memory after every compute of every stage, which is
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
(`ilp_scalable.window_bound`), is that a recomputation needs its inputs at that time: rebuilding
a long-dropped value costs the whole chain back to a resident ancestor.  On unit chains its
optimum equals the exact optimum (revolve's count; 10-16 layers checked); U-Net (depth 2) at
0.5x: 1.2008 proven in 53 s where the window IP gives 1.158 and the full ILP's CBC stalls at
1.158 after 400 s; U-Net (depth 3) at 0.3x: 1.194 after 120 s (window 1.132).  Its LP relaxation
is as weak as Checkmate's (122 on the 32-layer chain at 9 units, optimum 126): the strength is
in CBC's branching on a model a fifth the size.

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
interval row hold for the largest such moment.  Tested on every baseline's schedule (and the
ILP's) on 291 graph/budget cases.  The rows see a rebuilt value's inputs beside what is held,
which the plain model misses (random_layered(20, seed 2) at 0.6x: 1.2520, the exact optimum,
where the plain model proves 1.2362); they do not see rebuilt values kept for later in the
interval, so its plans may still peak above the budget.  Their LP is no stronger (the gain is in
branching), and the model is half as large again, so the exact mode runs it only after the plain
model proved an optimum that does not fit.

Strict moments (`strict=True`, a model for plans, not a bound)
-------------------------------------------------------------
K[t,u]   continuous  K >= N[t,u] + P[t,u] - 1: u is rebuilt in interval t and kept to instant t
moment   as above, plus sum_{u < v rebuilt in t, not an input of v} M_u K[t,u]
`schedule_from` rebuilds an interval's values in id order and keeps those resident at the
instant, so at v's rebuild the earlier ones kept to the instant are resident too; the rebuild
rows miss them (U-Net d3 at 0.3x: `downs.0.conv.conv1` rebuilt before `ups.3:cat` for a later
instant is part of what tips that moment over the budget).  A schedule that rebuilds in another
order need not satisfy these rows, so the model is no relaxation; the scalable mode's
neighbourhood search uses it where the plain model's plan peaks above the budget.

Rebuild moments on demand (`moments`)
-------------------------------------
The rows above may sit in some intervals only (`build(moments={t: strict?})`): without strict
rows the model is still a relaxation (each interval's rows hold for every schedule on their
own), and it is the plain model's size but for those intervals.  A plan of the plain model
that overflows goes first to `stage_order` (another rebuild order inside the stages that peak
over); the stages where no order fits get rows, then strict rows if they overflow again.
random_layered(20, seed 2) at 0.6x: 157 (overflows at stage 27), rows at 27: 158 (at 32), rows
at 27 and 32: 159 (at 29), and with 29 too 159 with a plan that fits: the exact optimum, proven
by a relaxation of three intervals' rows (tested).  A start plan that fits only in another
order may exceed the rows where it rebuilds; `loosen_unmet_moments` raises those rows to its
level so that it stays a solution (then they are no relaxation: a neighbourhood search's
bound is dropped anyway).

Split at tight instants (`split_bound`, recompute only)
-----------------------------------------------------
Cut the instants at s_1 < ... < s_k and give each window (s_i, s_{i+1}] its own model: the
instant IP over instants s_i..s_{i+1} (`build(window=...)`), whose residents at s_i are free but
for s_i's inputs and the memory row there, charged only the recomputation of its intervals.  A
schedule's solution, cut to a window's variables, satisfies every row the window keeps (each
is a row of the whole model), and the windows' intervals are disjoint, so the sum of the
windows' optima (or of their solvers' bounds) plus one pass over the graph is a lower bound.
What the cuts lose is what each window's free start could not really have had; at an instant
where what must be resident leaves little room, the start is nearly forced and little is lost,
while each small window is solved to optimality where the whole model's branching stalls.
ResNet-50 d2 at 0.3x cut at three backward instants of layer1 (11.7 and 110 MiB of room beyond
what they must hold, of 698 MiB): the last three windows are proven (0.141 of the step, 1.5
s), the first gets 0.048 from HiGHS's root: 1.1895, where the whole model plateaus at 1.1818.
The candidates are the `SPLIT_MOST` backward instants with the least room (at most
`SPLIT_ROOM` of the budget's); the first window ends at the earliest, and a longest path over
the windows between the candidates (all pairs, each solved on its own) picks the later cuts,
so a loose candidate costs nothing but its solve.

Coupled windows (`coupled_bound`, recompute only)
-------------------------------------------------
The split loses what a window's free start could not really have had: at a loose cut the second
window starts with whatever fits, and the first is not charged for having held it.  Couple them
instead.  W1 = the window (0, c] (its LP with path rows), W2 = the window (c, e] (its IP), x_s
= the residents P[c, .] they share.  For any multipliers y,
    L(y) = min_{x1 in LP(W1)} (c1 x1 - y x1_s) + min_{x2 in W2} (c2 x2 + y x2_s)
is a lower bound on the recomputation in (0, e] of every schedule (its two restrictions are
feasible for each side with x1_s = x2_s, where the y terms cancel), with W2's minimum replaced
by its solver's bound when unproven.  y comes from Dantzig-Wolfe: a master LP of W1's LP and
convex combinations of W2's solutions found so far (columns), linked by x1_s = sum lambda_k s_k;
its duals on those rows price the next column (W2's IP with + y on x2_s), and the master's value
is reached when no column prices out.  W1 being an LP, the path rows its Lagrangian LP violates
are added each round (to the master too).  ResNet-50 d2 at 0.3x, c = 176, e = 202 (the bound on
(0, 202], share of the step): a free start gives 0.0864 (the split at 196: 0.0858), the coupling
0.0922 after two rounds (59 s), 0.1061 after seven (313 s; each pricing 30-60 s); with the
windows after 202 the bound is 1.2097 where the split gives 1.1894 (the two-minute plan, 1.2494,
is within 3.2 % of optimal).  Where the gain comes from: the free start of (176, 202] holds
layer1's block outputs (98 MiB each) at 176 and rebuilds little (0.0773); W1's LP charges 0.0303
for holding them (0.0091 with nothing held).  A cut elsewhere gave less (before W1's rows, when
176 converged at 0.0984: 188 or 193, 0.0846 / 0.0834 on (0, 202]; (0, 196] coupled at 176,
0.0442 against the split's 0.048).

In the scalable mode's two minutes (`couple_split`, after the split): e = the split's tightest
point (least room beyond what every schedule holds; the earliest of equals: ResNet-50 d2 at
0.3x, 202 and 208 both 11.7 MiB), c = the latest instant whose window (c, e] has at least
`COUPLE_W2_VARS` variables (`couple_cut`: 176 there), the split's best windows from e on kept.
Each pricing gets `COUPLE_PRICE_S` (5 s, unproven: its bound is what counts) and W1 two rounds
of path rows (`COUPLE_SPLIT_PATH_ROUNDS`; ten make a round 10-20 s instead of 6-7): 40 s give
0.0880 on (0, 202] (ten rounds of rows: 0.0859; the split, 0.0858).  A last long pricing at the
final prices (rounds of 5 s, then 15-36 s) gave less in the same time and was left.  On small
graphs, whose split windows are proven, W1's LP is weaker than the split's first windows
(random_layered(20, seed 4) at 0.65x: 178.75 against 179), and U-Net d3 at 0.3x coupled at 87
ends below its split: the caller keeps the best bound.

Path rows (`add_path_rows`, recompute only)
-------------------------------------------
The LP relaxation rebuilds a value in slivers: with its input u held at 0.06 from instant t1 on,
it may rebuild v by 0.06 in each of sixteen intervals and hold v whole at t2, paying for u a
sixteenth of its bytes (U-Net d3 at 0.3x: `downs.0.conv:relu#2` built that way over the whole
decoder's backward).  No integral solution can: v resident at t2 and not at t1 was rebuilt in
some interval s in (t1, t2], which needed u then, so u was resident at t1 or rebuilt in (t1, s].
Following a path of inputs v <- u_1 <- ... <- u_k back from v (each u_i resident at t1 or
rebuilt after it, and a rebuild needs its input likewise):
path     P[t2,v] <= P[t1,v] + sum_i P[t1,u_i] + sum_{t1 < r <= t2} N[r,u_k]
for every value v, instants t1 < t2 with P[t2,v] and P[t1,.] on the path (values first computed
after t1 make no row: they are fresh there).  Each follows from the keep and rebuild rows for
integral points alone (every model here has them: with rebuild moments, keep is P <= H + N with
H <= P[t-1]), so the rows cut off LP points and no solution; tested at 525 integral solutions
of the model under random objectives and at every baseline's schedule, and the models prove the
optima they proved without them.  `path_rows` separates them against an LP point: for each v
and t1, the cheapest path for every t2 at once (a shortest-path recursion over the inputs in
id order, numpy over t2), the most violated t1 per (v, t2).  The LP rises fast where slivers
are what it leans on: U-Net d3 at 0.3x, whole model 1.158 -> 1.213 (21 rounds, 17 s), and its
window (70, 120] 0.099 -> 0.157 of the step in 4 s, which HiGHS then proves (0.1688) in 60 s,
where it needed 1525 s before; in 70 s the whole model's bound goes 1.1847 -> 1.2415.  Where the
LP leans on other things it rises less and costs the MIP its speed (ResNet-50 d2 at 0.3x: LP
1.1346 -> 1.1536, and 70 s of HiGHS bound 1.1734 with the rows against 1.1818 without), so the
rounds stop when the LP stalls (`PATH_STALL`) and only the rows tight at the last LP are kept.
A chain's LP (122 on the 32-layer chain at 9 units, optimum 126) does not move: its weakness
is elsewhere.

An integral solution without host copies is also a schedule: stage t recomputes {v : N[t,v]}
and computes t, and keeps what those computes need (`ilp.minimal_keep`).  It may peak above
the budget inside a stage, so the caller simulates it like any other candidate.
"""
from __future__ import annotations

import logging
import math
import time as _time
from dataclasses import dataclass, field

import pulp

from remat.core.errors import SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule, Stage

from . import ilp

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
    (gradients and the loss, never recomputed, stay resident): alive at instant t and across the
    interval between instants t-1 and t."""
    load = [0] * graph.n
    for v, node in enumerate(graph.nodes):
        if node.kind != "forward" and graph.succs[v]:
            for t in range(v + 1, max(graph.succs[v]) + 1):
                load[t] += node.bytes
    return load


def instant_loads(graph: Graph) -> list[int]:
    """Per instant t: the bytes resident besides forward values (t's output and workspace, and
    `interval_loads`)."""
    return [alive + graph.nodes[t].bytes + graph.nodes[t].workspace_bytes
            for t, alive in enumerate(interval_loads(graph))]


def forced_loads(graph: Graph, load: list[int] | None = None) -> list[int]:
    """Per instant t: `instant_loads` (given or computed) plus t's forward inputs, i.e. the bytes
    every schedule holds on the device when t first runs, besides the fixed bytes (only forward
    values are ever recomputed)."""
    load = instant_loads(graph) if load is None else load
    return [load[t] + sum(graph.nodes[u].bytes for u in set(graph.preds[t]) if graph.nodes[u].kind == "forward")
            for t in range(graph.n)]


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
    C, M = graph.times, graph.sizes
    fwd = [v.kind == "forward" for v in graph.nodes]
    preds = [sorted(set(p)) for p in graph.preds]
    cap = budget_bytes - graph.fixed_bytes
    load = instant_loads(graph)
    hor = horizons(graph)
    unit = math.gcd(*[m for m in M if m > 0]) or 1
    cu = ilp._time_unit(graph)
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
    from . import stage_order
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
        # which the rows' other choice among equal optima can miss: random_layered(20, seed 2))
        out = solve(graph, budget_bytes, time_limit=left, threads=threads, start=start, backend=backend,
                    moments=dict(moments), path=False)
        if out["bound"] is not None:
            best = out["bound"] if best is None else max(best, out["bound"])
    return {**out, "bound": best, "moments": sorted(moments)}


SPLIT_MOST = 5      # split candidates: at most this many backward instants,
SPLIT_ROOM = 0.3    # each with at most this share of the budget's room beyond what it must hold
SPLIT_FIRST = 0.6   # of split_bound's time, what the first window (the largest) may take at most


def free_room(graph: Graph, budget_bytes: int) -> list[int]:
    """Per instant t: the bytes the budget leaves beyond the fixed bytes and what every schedule
    holds when t first runs (`forced_loads`)."""
    cap = budget_bytes - graph.fixed_bytes
    return [cap - f for f in forced_loads(graph)]


def split_candidates(graph: Graph, budget_bytes: int, most: int = SPLIT_MOST, room: float = SPLIT_ROOM) -> list[int]:
    """The backward instants where what every schedule holds leaves the least room (at most
    `room` of the budget's room, at most `most` of them), in id order ("Split at tight
    instants")."""
    cap = budget_bytes - graph.fixed_bytes
    if cap <= 0:
        return []
    free = free_room(graph, budget_bytes)
    tight = sorted((free[t], t) for t, node in enumerate(graph.nodes)
                   if node.kind == "backward" and 0 < t < graph.n - 1 and free[t] <= room * cap)
    return sorted(t for _, t in tight[:most])


def split_bound(graph: Graph, budget_bytes: int, *, time_limit: float | None = 30.0, threads: int | None = None,
                backend: str = "cbc", cuts: list[int] | None = None) -> dict | None:
    """The lower bound of "Split at tight instants": {"bound": seconds, "cuts": the instants cut
    at, "windows": [(a, b, recompute bound in seconds, proven)], "proven": every window chosen
    solved to optimality, "tails": candidate (and the last instant) -> the best sum of windows
    from it to the end}; None without candidates (`split_candidates`, or `cuts` when given).
    The windows between candidates (or a candidate and the end), small ones first, share half of
    1 - `SPLIT_FIRST` of the time (what one leaves goes to the next); the first window (from 0 to
    the first candidate) gets up to `SPLIT_FIRST` of it (all that is left when the best cuts so far
    have no other window open); then the windows of the best cuts that are still unproven are
    solved again with all that is left (from scratch; each window keeps its better bound)."""
    points = sorted(set(cuts)) if cuts is not None else split_candidates(graph, budget_bytes)
    if not points:
        return None
    t0 = _time.perf_counter()
    ends = points + [graph.n - 1]
    windows = [(0, points[0])] + [(a, b) for i, a in enumerate(points) for b in ends[i + 1:]]
    models: dict[tuple[int, int], InstantModel | None] = {}
    for w in windows:
        models[w] = build(graph, budget_bytes, window=w)
        if models[w] is None:  # (what some instant must hold does not fit: no schedule at all)
            return None
    weight = {w: len(models[w].N) for w in windows}
    got = {w: (0.0, not models[w].N) for w in windows}  # window -> (recompute bound, proven)

    def solve_window(w: tuple[int, int], limit: float | None) -> None:
        m = build(graph, budget_bytes, window=w) if models[w] is None else models[w]
        models[w] = None  # (a model solved once is rebuilt for a second solve)
        limit = path_rows_within(graph, m, limit, least=0.2)
        try:
            out = ilp._run(m, backend, limit, 0.0, threads, False, False)
        except SolverError as e:
            log.info("split bound: window (%d, %d] failed (%s)", *w, e)
            return
        if out["bound"] is not None and not out.get("infeasible"):
            got[w] = (max(got[w][0], out["bound"] * m.time_unit), got[w][1] or bool(out["proven"]))

    def left() -> float | None:
        return None if time_limit is None else time_limit - (_time.perf_counter() - t0)

    def share_out(todo: list[tuple[int, int]], total: float | None) -> None:  # equal parts, what one leaves to the next
        start = _time.perf_counter()
        for k, w in enumerate(todo):
            solve_window(w, None if total is None else
                         max(0.2, (total - (_time.perf_counter() - start)) / (len(todo) - k)))

    head = (0, points[0])

    def paths() -> dict[int, tuple[float, list]]:  # from each point, the longest path to the end
        path: dict[int, tuple[float, list]] = {graph.n - 1: (0.0, [])}
        for a in reversed(points):
            path[a] = max(((got[a, b][0] + path[b][0], [(a, b)] + path[b][1]) for b in ends if b > a),
                          key=lambda x: x[0])
        return path

    def best_cuts(path: dict | None = None) -> tuple[float, list[tuple[int, int]]]:  # the longest path from 0
        path = paths() if path is None else path
        return got[head][0] + path[points[0]][0], [head] + path[points[0]][1]

    def unproven_on_best() -> list[tuple[int, int]]:
        return [w for w in best_cuts()[1] if not got[w][1] and w != head]

    tails = sorted((w for w in windows[1:] if not got[w][1]), key=lambda w: weight[w])  # the small ones first
    share_out(tails, None if time_limit is None else (1 - SPLIT_FIRST) * time_limit / 2)
    if not got[head][1]:  # (all that is left when no other window of the best cuts is open)
        share_out([head], None if time_limit is None else
                  min(left(), SPLIT_FIRST * time_limit) if unproven_on_best() else left())
    if unproven_on_best() and (left() is None or left() > 1.0):
        # everything left in one solve each (a second solve starts from scratch: U-Net d3 at 0.3x,
        # whose (70, 120] window HiGHS needs 790 s for 0.153 and 1525 s to prove 0.1688)
        share_out(unproven_on_best(), left())
    path = paths()
    value, chosen = best_cuts(path)
    log.info("split bound: windows %s (%.1f s)",
             [(a, b, round(got[a, b][0] / graph.total_time, 4), got[a, b][1]) for a, b in chosen],
             _time.perf_counter() - t0)
    return {"bound": graph.total_time + value, "cuts": [a for a, _ in chosen[1:]],
            "windows": [(a, b, got[a, b][0], got[a, b][1]) for a, b in chosen],
            "proven": all(got[w][1] for w in chosen),
            "tails": {a: tail for a, (tail, _) in path.items()}}


COUPLE_EPS = 1e-6   # coupled_bound: converged when the bound is within this share of the master's value
COUPLE_PATH_ROUNDS = 10  # and W1's Lagrangian LP gets at most this many rounds of path rows each time


def coupled_bound(graph: Graph, budget_bytes: int, cut: int, end: int, *, time_limit: float | None = 300.0,
                  price_limit: float = 60.0, rounds: int = 30, backend: str = "highs",
                  threads: int | None = None, path_rounds: int = COUPLE_PATH_ROUNDS) -> dict | None:
    """The bound of "Coupled windows" on the recomputation in the intervals 1..`end` (the windows
    (0, `cut`] and (`cut`, `end`] coupled through the residents at `cut`): {"bound": seconds,
    "master": seconds (the last master LP's value: what more columns alone could reach at most),
    "rounds": pricings run, "converged": the bound met the master}.  Each round solves W2's IP
    (`backend`) for up to `price_limit` seconds, within what is left of `time_limit` (W1's LP
    and rows after it may run past it by seconds: ResNet-50 d2, 80 s for 70).  None without
    highspy (the master and W1's Lagrangian LP are HiGHS models in memory) or when a window cannot
    hold what it must."""
    if not ilp.highs_available() or not 0 < cut < end < graph.n:
        return None
    t0 = _time.perf_counter()

    def left() -> float | None:
        return None if time_limit is None else time_limit - (_time.perf_counter() - t0)

    m1 = build(graph, budget_bytes, window=(0, cut))
    m2 = build(graph, budget_bytes, window=(cut, end))
    if m1 is None or m2 is None:
        return None
    # (W1 is only ever an LP here, where every tight row helps; W2 is an IP, with the usual rule)
    add_path_rows(graph, m1, time_limit=None if time_limit is None else 0.1 * time_limit, keep_gain=0.0)
    add_path_rows(graph, m2, time_limit=None if time_limit is None else 0.05 * time_limit)
    shared = sorted({v for t, v in m1.P if t == cut} & {v for t, v in m2.P if t == cut})
    lag = _Relaxation(m1)  # W1's Lagrangian LP
    master = _highs_lp(m1)  # (the same columns in the same order: var.index)
    col = {v: m1.P[cut, v].index for v in shared}
    cost1 = {v: lag.h.getLp().col_cost_[col[v]] for v in shared}
    first_row = master.getNumRow()
    for v in shared:  # x1_s - sum_k lambda_k s_k = 0
        master.addRow(0.0, 0.0, 1, [col[v]], [1.0])
    convexity = master.getNumRow()
    master.addRow(1.0, 1.0, 0, [], [])
    const1 = m1.prob.objective.constant or 0.0
    objective2 = m2.prob.objective

    def tighten() -> int | None:  # W1's Lagrangian LP with the path rows it violates (into the master too):
        added = 0                 # how many, None if the LP has no optimum
        for i in range(path_rounds + 1):
            x = lag.solve()
            if x is None:
                return None
            rows = [] if i == path_rounds else [row for row in path_rows(graph, m1, x) if lag.add(row)]
            for row in rows:
                master.addRow(-math.inf, 0.0, len(row), [var.index for var in row], list(row.values()))
            added += len(rows)
            if not rows:
                return added

    y: dict[int, float] = {}
    best, value, k, converged = -math.inf, math.inf, 0, False
    while k < rounds and (left() is None or left() >= 1.0):
        k += 1
        m2.prob.setObjective(objective2 + pulp.lpSum(y[v] * m2.P[cut, v] for v in shared if y.get(v)))
        try:
            out = ilp._run(m2, backend, price_limit if left() is None else min(price_limit, left()), 0.0,
                           threads, k > 1, False)  # (from the last column: it is still a solution)
        except SolverError as e:
            log.info("coupled bound: pricing failed (%s)", e)
            break
        finally:
            m2.prob.setObjective(objective2)
        for v in shared:
            lag.h.changeColCost(col[v], cost1[v] - y.get(v, 0.0))
        added = None if out["bound"] is None else tighten()
        if added is None:
            break
        best = max(best, lag.objective + out["bound"])
        log.info("coupled bound: round %d, bound %.6g, master %.6g (%.1f s)", k, best * m1.time_unit,
                 value * m1.time_unit, _time.perf_counter() - t0)
        # (the master's last value is its value before this round's rows: met only where none came)
        converged = not added and best >= value - COUPLE_EPS * abs(value)
        if converged or out["objective"] is None:
            break
        rows = [first_row + i for i, v in enumerate(shared) if (m2.P[cut, v].varValue or 0) > 0.5]
        master.addCol(pulp.value(objective2), 0.0, math.inf, len(rows) + 1, rows + [convexity],
                      [-1.0] * len(rows) + [1.0])
        master.run()
        if master.modelStatusToString(master.getModelStatus()) != "Optimal":
            break
        value = master.getInfo().objective_function_value + const1
        dual = master.getSolution().row_dual
        y = {v: dual[first_row + i] for i, v in enumerate(shared)}
    if best == -math.inf:
        return None
    return {"bound": max(0.0, best * m1.time_unit), "master": value * m1.time_unit, "rounds": k,
            "converged": converged}


COUPLE_W2_VARS = 1500  # couple_split: the second window is the shortest one ending at the split's tightest point
#                        with at least this many P and N variables (ResNet-50 d2 at 0.3x: (176, 202], 1551)
COUPLE_PRICE_S = 5.0  # and each pricing gets this long (unproven, its bound counts; 30-60 s would prove it)
COUPLE_SPLIT_PATH_ROUNDS = 2  # with this many rounds of W1's path rows per pricing (10: a round takes 10-20 s
#                        instead of 6-7; ResNet-50 d2 at 0.3x after 40 s, 0.0859 of the step instead of 0.0880)


def window_size(graph: Graph, a: int, b: int) -> int:
    """Number of P and N variables of the window model (a, b] (`build(window=(a, b))`), computed
    without building it."""
    hor = horizons(graph)
    count = 0
    for v, node in enumerate(graph.nodes):
        if node.kind == "forward" and node.bytes > 0:
            last = min(hor[v], b)
            count += max(0, last - max(v + 1, a) + 1) + max(0, last - max(v + 2, a + 1) + 1)
    return count


def couple_cut(graph: Graph, end: int, least: int | None = None) -> int | None:
    """The latest instant c < `end` whose window (c, `end`] has at least `least` (default
    `COUPLE_W2_VARS`) P and N variables (`window_size`), None when even (0, `end`] has fewer."""
    least = COUPLE_W2_VARS if least is None else least
    if window_size(graph, 0, end) < least:
        return None
    lo, hi = 0, end - 1  # window_size(lo, end) >= least; the size shrinks as the start moves later
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if window_size(graph, mid, end) >= least:
            lo = mid
        else:
            hi = mid - 1
    return lo


def couple_split(graph: Graph, budget_bytes: int, split: dict, *, time_limit: float | None,
                 threads: int | None = None) -> dict | None:
    """The split's bound with its start coupled ("Coupled windows" after "Split at tight
    instants"): the windows before the split's tightest point e (the least room beyond what every
    schedule holds; the earliest of equals) replaced by the coupled bound of (0, c] and (c, e]
    (c = `couple_cut(e)`), pricing `COUPLE_PRICE_S` each, the split's best windows from e on
    kept.  Returns {"bound": seconds of the whole step, "cut": c, "end": e, "rounds", "converged"},
    or None (no highspy, no cut, or the coupling found nothing)."""
    points = [a for a in split["tails"] if 0 < a < graph.n - 1]
    if not points:
        return None
    free = free_room(graph, budget_bytes)
    end = min(points, key=lambda t: (free[t], t))
    cut = couple_cut(graph, end)
    if cut is None or cut <= 0:
        return None
    co = coupled_bound(graph, budget_bytes, cut, end, time_limit=time_limit, price_limit=COUPLE_PRICE_S,
                       threads=threads, path_rounds=COUPLE_SPLIT_PATH_ROUNDS,
                       rounds=10 ** 6 if time_limit is not None else 30)  # (rounds until the time is up)
    if co is None:
        return None
    return {"bound": graph.total_time + co["bound"] + split["tails"][end], "cut": cut, "end": end,
            "rounds": co["rounds"], "converged": co["converged"]}


PATH_ROUNDS = 30     # path rows: at most this many rounds of separation against the LP,
PATH_PER_ROUND = 400  # adding at most this many rows a round (the most violated),
PATH_SHARE = 0.25     # within this share of the solve's time limit
PATH_EPS = 1e-3       # (a row is added when the LP violates it by more than this)
PATH_STALL = 0.01     # and while the LP's recomputation still rises by this share
PATH_STALL_ROUNDS = 3  # over this many rounds; and the rows are kept only if they lifted it by
PATH_KEEP_GAIN = 0.02  # this share (GPT-2 d2/d3 and ResNet-50 d2 at 0.5x: 0, hundreds of tight rows)


def _highs_lp(m: InstantModel):
    """`m` as a silent HiGHS model in memory (`m.prob.solverModel`; each variable's `index` is
    its column), for LPs solved and changed in place."""
    import highspy
    ilp.highs_ready()
    m.prob.solverModel = h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    pulp.HiGHS(mip=False, msg=False).buildSolverModel(m.prob)
    return h


class _Relaxation:
    """The LP relaxation of `m` with rows added as they are separated: in HiGHS (highspy) in
    memory, each solve from the last basis; without highspy, CBC through PuLP (the rows go
    into `m.prob` at once, the LP is written out and solved from scratch each round)."""

    def __init__(self, m: InstantModel):
        self.m = m
        self.cols = m.prob.variables()
        self.in_model = set(self.cols)
        self.rows: list[tuple[str, dict]] = []
        self.highs = ilp.highs_available()
        self.h = None
        if self.highs:
            self.h = _highs_lp(m)
            self.first_row = self.h.getNumRow()

    def solve(self) -> dict | None:
        """Solve; {variable: value} at the LP optimum (None if it has none), and `objective`
        (model units, the objective's constant included)."""
        constant = self.m.prob.objective.constant or 0.0
        if self.highs:
            self.h.run()
            if self.h.modelStatusToString(self.h.getModelStatus()) != "Optimal":
                return None
            self.h.setOptionValue("presolve", "off")  # (later solves start from this basis)
            self.objective = self.h.getInfo().objective_function_value + constant
            value = self.h.getSolution().col_value
            return {var: value[var.index] for var in self.cols}
        self.m.prob.solve(pulp.PULP_CBC_CMD(msg=False, mip=False, threads=1))
        if self.m.prob.status != pulp.LpStatusOptimal:
            return None
        self.objective = pulp.value(self.m.prob.objective)
        return {var: var.varValue or 0.0 for var in self.cols}

    def add(self, row: dict) -> bool:
        """Add the row `sum <= 0`, unless a variable of it is in no row of the model (it sits at
        its bound there); whether it was added."""
        if not all(var in self.in_model for var in row):
            return False
        name = f"path_{len(self.rows)}"
        self.rows.append((name, row))
        if self.highs:
            self.h.addRow(-math.inf, 0.0, len(row), [var.index for var in row], list(row.values()))
        else:
            self.m.prob.addConstraint(pulp.LpAffineExpression(list(row.items())) <= 0, name)
        return True

    def keep(self, solved: int, worth: bool = True) -> int:
        """Leave in `m.prob` the rows tight at the last solve (which had the first `solved` rows)
        and those added after it, none unless `worth`; the model's variables lose the LP's values.
        Returns how many."""
        prob = self.m.prob
        if self.highs:
            activity = self.h.getSolution().row_value if solved else []
            tight = [worth and (j >= solved or activity[self.first_row + j] > -1e-7) for j in range(len(self.rows))]
            prob.solverModel = None
            for (name, row), keep in zip(self.rows, tight):
                if keep:
                    prob.addConstraint(pulp.LpAffineExpression(list(row.items())) <= 0, name)
        else:
            tight = [worth and (j >= solved or prob.constraints[name].value() > -1e-7)
                     for j, (name, _) in enumerate(self.rows)]
            for (name, _), keep in zip(self.rows, tight):
                if not keep:
                    del prob.constraints[name]
            for var in self.cols:
                var.varValue = None
        return sum(tight)


def path_rows(graph: Graph, m: InstantModel, x, *, eps: float = PATH_EPS, most: int = PATH_PER_ROUND) -> list:
    """Path rows ("Path rows" in the module docstring) that the point `x` (a value per P and N
    variable: `x[var]`) violates by more than `eps`, the most violated first, at most `most`:
    each {variable: coefficient} for `sum <= 0` (a path's values are distinct, so no variable
    comes twice).  For every value v, instant t2 and
    instant t1 < t2, the cheapest path is found for all t2 at once (numpy over t2)."""
    import numpy as np
    n = graph.n
    values = sorted({v for _, v in m.P})
    tracked = set(values)
    ins = {v: sorted(u for u in set(graph.preds[v]) if u in tracked) for v in values}
    P = {v: np.zeros(n) for v in values}
    has = {v: np.zeros(n, dtype=bool) for v in values}
    cumN = {v: np.zeros(n) for v in values}
    for (t, v), var in m.P.items():
        P[v][t] = x[var] if var in x else (var.lowBound or 0.0)  # (one in no row: at its bound)
        has[v][t] = True
    for (t, v), var in m.N.items():
        cumN[v][t] += x.get(var, 0.0)
    for v in values:
        cumN[v] = np.cumsum(cumN[v])
    times = sorted({t for (t, _) in m.P})

    def cheapest(t1: int) -> dict[int, np.ndarray]:  # per value: the cheapest way to have it between t1 and t2
        f: dict[int, np.ndarray] = {}
        for y in values:
            if not has[y][t1]:
                continue  # (computed for the first time after t1, or not tracked: no row through it)
            best = cumN[y] - cumN[y][t1]
            for u in ins[y]:
                if u in f:
                    best = np.minimum(best, P[u][t1] + f[u])
            f[y] = best
        return f

    found: dict[tuple[int, int], tuple[float, int]] = {}  # (v, t2) -> (violation, t1), the best t1
    for t1 in times:
        f = cheapest(t1)
        for v in values:
            if not has[v][t1] or not any(u in f for u in ins[v]):
                continue
            via = np.min([P[u][t1] + f[u] for u in ins[v] if u in f], axis=0)
            viol = P[v] - P[v][t1] - via
            viol[: t1 + 1] = 0.0
            viol[~has[v]] = 0.0
            for t2 in np.nonzero(viol > eps)[0]:
                if viol[t2] > found.get((v, int(t2)), (0.0, 0))[0]:
                    found[v, int(t2)] = (float(viol[t2]), t1)
    chosen = sorted(found.items(), key=lambda kv: -kv[1][0])[:most]
    rows = []
    by_t1: dict[int, list] = {}
    for (v, t2), (_, t1) in chosen:
        by_t1.setdefault(t1, []).append((v, t2))
    for t1, cuts in by_t1.items():
        f = cheapest(t1)
        for v, t2 in cuts:
            row = {m.P[t2, v]: 1.0, m.P[t1, v]: -1.0}
            y = v
            while True:  # follow the cheapest path back to where it stops (its rebuilds after t1)
                y = min((u for u in ins[y] if u in f), key=lambda u: P[u][t1] + f[u][t2])
                row[m.P[t1, y]] = -1.0
                if cumN[y][t2] - cumN[y][t1] <= f[y][t2] + 1e-12:
                    row.update({m.N[r, y]: -1.0 for r in range(t1 + 1, t2 + 1) if (r, y) in m.N})
                    break
            rows.append(row)
    return rows


def add_path_rows(graph: Graph, m: InstantModel, *, time_limit: float | None = None,
                  rounds: int = PATH_ROUNDS, keep_gain: float | None = None) -> dict:
    """Strengthen a recompute-only model with the path rows its LP relaxation violates, round by
    round, until none is violated, `rounds` have run, `time_limit` is spent or the LP stalls
    (its recomputation rose less than `PATH_STALL` over the last `PATH_STALL_ROUNDS` rounds).
    Where the rounds lifted the LP's recomputation by `keep_gain` (default `PATH_KEEP_GAIN`) or
    more, the rows tight at the last LP (and those added after it) go into `m.prob`, named
    path_k; the others, and all of them where the LP hardly rose, would only slow the MIP down.  Returns {"rows": kept,
    "separated": added in all, "rounds": run, "lp": the LP value of the model as left, in
    seconds, or None}.  The LP is HiGHS's where highspy is installed, else CBC's (`_Relaxation`)."""
    out = {"rows": 0, "separated": 0, "rounds": 0, "lp": None}
    if m.swap or not m.N:
        return out
    t0 = _time.perf_counter()
    lp = _Relaxation(m)
    solved = 0  # rows added before the last LP
    base = (m.prob.objective.constant or 0.0) * m.time_unit
    history: list[float] = []
    for k in range(rounds):
        if time_limit is not None and _time.perf_counter() - t0 > time_limit:
            break
        if len(history) > PATH_STALL_ROUNDS and \
                history[-1] - history[-1 - PATH_STALL_ROUNDS] < PATH_STALL * (history[-1] - base):
            break
        x = lp.solve()
        if x is None:
            break
        solved = len(lp.rows)
        out["lp"] = lp.objective * m.time_unit
        history.append(out["lp"])
        rows = path_rows(graph, m, x)
        out["rounds"] = k + 1
        if not rows:
            break
        for row in rows:
            lp.add(row)
    # (rows that hardly lift the LP only slow the MIP down: none are kept then)
    gain = PATH_KEEP_GAIN if keep_gain is None else keep_gain
    worth = len(history) > 1 and history[-1] - history[0] >= gain * (history[0] - base)
    out["rows"] = lp.keep(solved, worth)
    if not worth and history:
        out["lp"] = history[0]
    out["separated"] = len(lp.rows)
    log.info("instant IP: %d path rows (of %d) in %d rounds, LP %s (%.1f s)", out["rows"], out["separated"], out["rounds"],
             None if out["lp"] is None else round(out["lp"] / graph.total_time, 4), _time.perf_counter() - t0)
    return out


def path_rows_within(graph: Graph, m: InstantModel, limit: float | None, *, least: float) -> float | None:
    """`add_path_rows` for up to `PATH_SHARE` of a solve's time `limit`; returns what it leaves
    of the limit for the solve (at least `least`; None without a limit)."""
    t0 = _time.perf_counter()
    add_path_rows(graph, m, time_limit=None if limit is None else PATH_SHARE * limit)
    return None if limit is None else max(least, limit - (_time.perf_counter() - t0))


def set_warm_start(graph: Graph, m: InstantModel, schedule: Schedule) -> bool:
    """Initial values read off a schedule's op list; False when it does not map onto the model
    (it computes nodes for the first time out of id order)."""
    for d in (m.P, m.N, m.SI, m.O):
        for x in d.values():
            x.setInitialValue(0, check=False)  # (an input of its instant has lower bound 1)
    resident: set[int] = set()
    seen: set[int] = set()
    t = 0  # the next first compute
    for op in schedule.ops:
        v = op.node
        if op.op == "compute":
            if v not in seen:
                if v != t:
                    return False
                for u in resident:
                    if (t, u) in m.P:
                        m.P[t, u].setInitialValue(1)
                seen.add(v)
                t += 1
            elif (t, v) in m.N:
                m.N[t, v].setInitialValue(1)
            resident.add(v)
        elif op.op == "free":
            resident.discard(v)
        elif op.op == "swap_in":
            resident.add(v)
            if (t, v) in m.SI:
                m.SI[t, v].setInitialValue(1)
                m.O[v].setInitialValue(1)
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
    rebuilding is its block's choice (ResNet-50 at 0.3x: the stem and layer1 freed together
    improve the plan, halves of them freed in turn do not)."""
    from .ilp_scalable import checkmate_layout
    from .rotor import cut_points
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
    none = [set() for _ in range(n)]
    try:
        S = ilp.minimal_keep(graph, R, none, none, none)
    except AssertionError:
        return None
    sched = Schedule.from_stages(graph, [Stage(sorted(R[t]), sorted(S[t])) for t in range(n)])
    return ilp.prune_waste(graph, sched)


def solve(graph: Graph, budget_bytes: int, *, swap: bool = False, bandwidth: float | None = None,
          time_limit: float | None = 30.0, threads: int | None = None, start: Schedule | None = None,
          msg: bool = False, progress=None, in_stage: bool = False, backend: str = "cbc",
          region: set[int] | None = None, strict: bool = False, instants: tuple[int, int] | None = None,
          moments: dict[int, bool] | None = None, path: bool = True, give_up=None) -> dict:
    """Run CBC (or HiGHS) on the instant IP, from `start` when given.  Returns {"bound": seconds
    or None, "schedule": Schedule or None, "objective": seconds or None, "proven": bool,
    "infeasible": bool, "variables": int}.  The bound is valid for every schedule whose backward
    nodes run once (see the module docstring).  `progress` gets CBC's incumbent and bound as
    `ilp._run` reports them (the incumbent is the model's, which a plan may not reach).

    With `region` (a set of forward nodes; needs a `start` that maps onto the model), every
    variable of a value outside it is fixed to `start`'s value: a neighbourhood search around
    `start` (see `neighbourhoods`), whose bound is not the graph's (it is dropped); with
    `instants` = (a, b), every variable of an instant or interval outside (a, b]
    (`time_windows`), likewise.  `strict` builds the model of "Strict moments" (a plan model,
    not a relaxation: its bound is dropped too); `moments` (interval -> strict?) puts the
    rebuild-moment rows only in those intervals (`build`; its bound is dropped where one is
    strict).  `path`: recompute only, where the bound counts (no region, no instants, not
    strict), first add the path rows its LP violates (`add_path_rows`, for up to `PATH_SHARE`
    of the time limit).  `give_up(elapsed, bound in seconds or None)` (HiGHS only, `ilp._run`):
    stop the solve when it returns True."""
    m = build(graph, budget_bytes, swap=swap, bandwidth=bandwidth, in_stage=in_stage, strict=strict,
              moments=moments)
    strict = strict or any((moments or {}).values())
    if m is None:
        return {"bound": None, "schedule": None, "objective": None, "proven": False, "infeasible": True,
                "variables": 0}
    if path and not swap and region is None and instants is None and not strict:
        time_limit = path_rows_within(graph, m, time_limit, least=1.0)
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
        out = ilp._run(m, backend, time_limit, 0.0, threads, warm, msg, progress=progress if backend == "cbc" else None,
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
