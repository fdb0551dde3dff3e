r"""Checkmate's rematerialization ILP, extended with swapping to host memory.

Stages are frontier-advancing (Checkmate §1.3.1): T = n stages, stage t computes node t and may
recompute nodes < t.  Index sets: ``i < t`` for every per-stage variable; E the edges.

Variables (only those the stage structure leaves free are created)
--------------------------------------------------------------------
R[t,i]   binary   i is (re)computed in stage t                 (R[t,t] = 1 is a constant)
S[t,i]   [0,1]    i's output is resident at the start of stage t (S[0,.] = 0); continuous, see below
SO[t,i]  binary   i's copy to the host starts at the start of stage t      (swap only)
SI[t,i]  binary   i's host copy comes back during stage t, usable at t+1   (swap only)
SF[t,i]  binary   i's host copy is fetched at the start of stage t and waited for, usable in t
FREE[t,(i,k)] continuous in [0,1]  i is released right after k runs in stage t
U[t,k]   continuous >= 0  device bytes right after k runs in stage t (before its inputs are freed)
tau[t]   continuous       length of stage t                                  (swap only)

Constraints (family names as in the code)
------------------------------------------
validity     S[t+1,i] <= S[t,i] + R[t,i] + SI[t,i] + SF[t,i]
deps         R[t,k] <= R[t,i] + S[t,i] + SF[t,i]       for (i,k) in E, k <= t
no_dup       R[t,i] + S[t,i] + SI[t,i] + SF[t,i] <= 1  (never bring back a value twice)
swap_out     SO[t,i] <= S[t,i];  sum_t SO[t,i] <= 1    (one host copy, made from a resident value)
swap_in      SI[t,i] <= sum_{t'<t} SO[t',i];  SI[t,i] <= S[t+1,i]
fetch        SF[t,i] <= sum_{t'<t} SO[t',i];  SF[t,i] <= S[t+1,i] + sum_{k in succ(i), k <= t} R[t,k]
free_*       FREE[t,(i,k)] <= R[t,k];  <= 1 - S[t+1,i];  <= 1 - R[t,j] for j in succ(i), k < j <= t;
             <= 1 - SO[t,i]   (Checkmate's hazard rows, disaggregated; see below)
free_once    sum_k FREE[t,(i,k)] <= R[t,i] + S[t,i] + SF[t,i]   (released once, only if present)
memory       U[t,0] = M_0 R[t,0] + sum_i M_i (S[t,i] + SI[t,i] + SF[t,i])
             U[t,k] = U[t,k-1] + M_k R[t,k] - sum_{(i,k-1) in E} M_i FREE[t,(i,k-1)]
             U[t,k] + W_k R[t,k] <= B - fixed_bytes           (W = workspace bytes)
stage time   tau[t] >= F_t + sum_i C_i R[t,i];  tau[t] >= F_t + sum_i (M_i / bandwidth) (SO[t,i] + SI[t,i])
             with F_t = sum_i (M_i / bandwidth) SF[t,i] (fetches run first and are waited for)
no_waste     S[t,i] <= S[t+1,i] + SO[t,i] + sum_{k in succ(i), k <= t} R[t,k]
             R[t,i] <= S[t+1,i] + sum_{k in succ(i), i < k <= t} R[t,k]          (i < t)
             SO[t,i] <= sum_{t' > t} (SI[t',i] + SF[t',i])   (a host copy is brought back)

Objective: min sum_t tau[t] (with swap) or min sum_{t,i} C_i R[t,i] (without: Checkmate's).

Why it is exact.  With swap off and no workspace this is Checkmate's memory model: a value is
released after its last consumer in a stage unless kept into the next stage, its own output is
never released in the stage that computes it, and U counts outputs and inputs of the running
node.  Checkmate writes FREE as a binary pinned from both sides by aggregated hazard rows; here
FREE is continuous and bounded only from above by one row per hazard.  For integral R, S, SO
each bound is 0 or 1 and larger FREE only lowers U, so the best FREE is the indicator itself
and the optimum is unchanged, while n|E| binaries disappear and the LP relaxation tightens.
S is continuous: for binary R, SO, SI every feasible S is entry-wise >= the minimal S that
R and the swaps need (`minimal_keep`; the deps, validity and swap_out rows force each entry),
and the minimal one only lowers memory and loosens the FREE bounds; the schedule is read back
with it.  So only R (and the swaps) are branched on.

Executability.  By default (recompute_backward=False) only forward nodes are recomputed or
swapped: the executor runs backward through autograd, which evaluates each backward node (and
the loss) once, and hands gradients straight to their consumers (a gradient has no host copy).
recompute_backward=True creates R (and the swap variables) for every node, which is
Checkmate's model exactly.

The `no_waste` rows cut off only dominated solutions (a value kept or recomputed that nothing in
the stage uses and that is not kept further): removing such an entry never raises memory or
time, so an optimal solution satisfying them exists.  `no_dup` and the swap rows likewise only
remove pointless combinations.  tests/test_ilp.py checks the optimum against an exhaustive
search over all schedules on small graphs, with and without swap.

The time model is the simulator's for the op list that `Schedule.from_stages` emits: transfers
start at the stage start on their own stream: fetches first, waited for before the first
compute, then swap-outs and prefetches, waited for at the stage end.  So a stage lasts
fetch + max(compute, swap-out + prefetch), and the objective equals `simulate(...).time`
(tested).  What the stage model cannot express: a transfer spread over several stages, and a
swap-in consumed mid-stage while earlier computes of the stage overlap it (TFLMS's op lists can
do both, so a bare op list can beat the ILP's "optimal" swap schedule by that overlap).

Memory is divided by the gcd of all sizes and the budget.  When that still leaves more than
``max_memory_units`` units, sizes are rounded up and the budget down to a coarser quantum: the
schedule stays feasible in exact bytes, and the report's ``memory_quantum`` says the optimum and
bound are those of the quantised model.

Solving: CBC through PuLP by default (HiGHS optional), warm-started from the best baseline that
fits or, without swap, from what `shift_search` finds around the baselines run at slightly looser
budgets (the recompute-only ILP restricted to a seed's recomputations, each in its stage or the
next; a fifth of the time limit).  Without swap, the instant IP (solvers/instant_ip.py, a
relaxation kept only at first computes) runs first for `INSTANT_SHARE` of the limit: when its
optimal plan fits the budget inside every stage too, that plan is returned as proven optimal;
otherwise its plan may become the warm start and its bound joins the report's.  When it proved
an optimum whose plan fits in no rebuild order inside its stages (`stage_order`; one that fits
in another order is returned, proven), rebuild-moment rows go into the stages that overflow, and
again while new ones do (`instant_ip.solve_on_demand`), for `INSTAGE_SHARE` of the time left.
When CBC leaves the instant IP unproven and HiGHS is installed, HiGHS solves it too (its cut loop often closes what CBC's branching does not;
its plan is a candidate like CBC's).  The full model's CBC run is then stopped as soon as
its incumbent meets the best of these bounds (`_run(stop_at=...)`).  On a chain
(recompute only), revolve's count is a bound too (`griewank.chain_bound`: Griewank's theorem on
the instant relaxation); a warm start that meets it is returned as proven optimal at once.
PuLP reports a time-limited CBC run with an incumbent as "Optimal"; we read `sol_status`
and CBC's own bound from its log, and report ``status`` "optimal" only when proven, else
"feasible" with ``lower_bound`` and ``gap``.
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time as _time
from dataclasses import dataclass, field
from functools import reduce
from typing import Callable

import pulp

from remat.core.errors import InfeasibleBudgetError, InvalidInputError, SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule, Stage
from remat.core.simulate import simulate

from . import register, stage_order

log = logging.getLogger(__name__)


@dataclass
class Model:
    prob: pulp.LpProblem
    R: dict
    S: dict
    SO: dict
    SI: dict
    SF: dict
    FREE: dict
    U: dict
    tau: dict
    quantum: int
    time_unit: float
    budget_units: int
    swap: bool
    meta: dict = field(default_factory=dict)


def _memory_scale(graph: Graph, act_budget: int, max_units: int,
                  round_down: bool = False) -> tuple[int, list[int], list[int], int, bool]:
    """(quantum, sizes, workspaces, budget in quanta, quantised?).

    Exact when the gcd of all sizes and the budget leaves at most `max_units` units.  Otherwise
    sizes round up and the budget down (a restriction: its schedules fit in exact bytes), or,
    with round_down, sizes down and the budget up (a relaxation: its bounds are valid).
    """
    vals = [v.bytes for v in graph.nodes] + [v.workspace_bytes for v in graph.nodes] + [act_budget]
    q = reduce(math.gcd, [x for x in vals if x > 0], 0) or 1
    quantised = act_budget // q > max_units
    if quantised:
        q = max(q, -(-act_budget // max_units))
    if round_down:
        return (q, [v.bytes // q for v in graph.nodes], [v.workspace_bytes // q for v in graph.nodes],
                -(-act_budget // q), quantised)
    return (q, [-(-v.bytes // q) for v in graph.nodes], [-(-v.workspace_bytes // q) for v in graph.nodes],
            act_budget // q, quantised)


def _time_unit(graph: Graph) -> float:
    c = [v.time for v in graph.nodes if v.time > 0]
    if not c:
        return 1.0
    if all(float(x).is_integer() and x <= 1e6 for x in c):
        return 1.0
    return max(c) / 1000.0


def build_model(graph: Graph, budget_bytes: int, *, swap: bool = True, bandwidth: float | None = None,
                max_memory_units: int = 1_000_000, relax: bool = False, recompute_backward: bool = False,
                round_down: bool = False, name: str = "remat", r_support: set | None = None) -> Model:
    """The ILP (or, with relax=True, its LP relaxation) for `graph` under `budget_bytes`.

    `r_support`: the only (stage, node) pairs that may be recomputed (every other R is 0 and not
    created): a restriction of the model, used by `shift_search`; its bound is not the graph's."""
    n = graph.n
    act_budget = budget_bytes - graph.fixed_bytes
    q, M, W, B, quantised = _memory_scale(graph, max(act_budget, 0), max_memory_units, round_down)
    cu = _time_unit(graph)
    C = [v.time / cu for v in graph.nodes]
    bw = float(bandwidth if bandwidth is not None else graph.bandwidth)
    X = [v.bytes / bw / cu for v in graph.nodes]  # transfer time, in time units
    succs, preds = graph.succs, graph.preds
    sink = [not s for s in succs]
    cat = pulp.LpContinuous if relax else pulp.LpBinary
    prob = pulp.LpProblem(name, pulp.LpMinimize)

    def var(prefix: str, t: int, i: int) -> pulp.LpVariable:
        return pulp.LpVariable(f"{prefix}_{t}_{i}", 0, 1, pulp.LpContinuous if prefix == "S" else cat)

    R: dict = {}
    S: dict = {}
    SO: dict = {}
    SI: dict = {}
    SF: dict = {}
    for t in range(n):
        for i in range(t):
            if not sink[i]:
                if (recompute_backward or graph.nodes[i].kind == "forward") and \
                        (r_support is None or (t, i) in r_support):
                    R[t, i] = var("R", t, i)
                S[t, i] = var("S", t, i)
                if swap and M[i] > 0 and (recompute_backward or graph.nodes[i].kind == "forward"):
                    if t < n - 1:
                        SO[t, i] = var("SO", t, i)
                    if t >= 2 and i <= t - 2:
                        SF[t, i] = var("SF", t, i)
                        if t < n - 1:
                            SI[t, i] = var("SI", t, i)

    def r(t: int, i: int):
        return 1 if i == t else R.get((t, i), 0)

    def s(t: int, i: int):
        return S.get((t, i), 0) if t < n else 0

    def so(t: int, i: int):
        return SO.get((t, i), 0)

    def si(t: int, i: int):
        return SI.get((t, i), 0)

    def sf(t: int, i: int):
        return SF.get((t, i), 0)

    def host(t: int, i: int):
        """1 when i has a host copy at the start of stage t (swapped out in an earlier stage)."""
        return pulp.lpSum(SO[tt, i] for tt in range(t) if (tt, i) in SO)

    add = prob.addConstraint
    for t in range(n):
        for i in range(t + 1):
            if (t + 1, i) in S:
                add(S[t + 1, i] <= s(t, i) + r(t, i) + si(t, i) + sf(t, i), f"validity_{t}_{i}")
            if (t, i) in R:
                add(R[t, i] + S[t, i] + si(t, i) + sf(t, i) <= 1, f"no_dup_{t}_{i}")
            elif (t, i) in SI or (t, i) in SF:
                add(S[t, i] + si(t, i) + sf(t, i) <= 1, f"no_dup_{t}_{i}")
        for (i, k) in graph.edges:
            if k > t:
                continue
            if k == t:
                add(r(t, i) + S[t, i] + sf(t, i) >= 1, f"deps_{t}_{i}_{k}")
            elif (t, k) in R:
                add(R[t, k] <= r(t, i) + S[t, i] + sf(t, i), f"deps_{t}_{i}_{k}")
    for (t, i), v in SO.items():
        add(v <= S[t, i], f"swap_out_resident_{t}_{i}")
    for i in range(n):
        outs = [SO[t, i] for t in range(n) if (t, i) in SO]
        if len(outs) > 1:
            add(pulp.lpSum(outs) <= 1, f"swap_out_once_{i}")
    for (t, i), v in SI.items():
        add(v <= host(t, i), f"swap_in_host_{t}_{i}")
        add(v <= s(t + 1, i), f"swap_in_used_{t}_{i}")
    for (t, i), v in SF.items():
        add(v <= host(t, i), f"fetch_host_{t}_{i}")
        add(v <= s(t + 1, i) + pulp.lpSum(r(t, k) for k in succs[i] if k <= t), f"fetch_used_{t}_{i}")

    # FREE and memory
    FREE: dict = {}
    U: dict = {}
    in_edges: list[list[int]] = [sorted(set(p)) for p in preds]
    for t in range(n):
        for k in range(t + 1):
            if k < t and (t, k) not in R:
                continue  # k is a sink: never recomputed, frees nothing in stage t
            for i in in_edges[k]:
                later = [j for j in succs[i] if k < j <= t]
                if t in later:
                    continue  # node t itself uses i after k: never freed after k
                if t + 1 < n and (t + 1, i) not in S:
                    nxt = 0
                else:
                    nxt = s(t + 1, i)
                f = pulp.LpVariable(f"FREE_{t}_{i}_{k}", 0, 1)
                FREE[t, i, k] = f
                if k < t:
                    add(f <= R[t, k], f"free_runs_{t}_{i}_{k}")
                if not isinstance(nxt, int):
                    add(f + nxt <= 1, f"free_kept_{t}_{i}_{k}")
                for j in later:
                    if (t, j) in R:
                        add(f + R[t, j] <= 1, f"free_later_{t}_{i}_{k}_{j}")
                if (t, i) in SO:
                    add(f + SO[t, i] <= 1, f"free_swapping_{t}_{i}_{k}")
        # free_once: a value is released at most once per stage, and only if it is there
        by_value: dict[int, list] = {}
        for (tt, i, k), f in FREE.items():
            if tt == t:
                by_value.setdefault(i, []).append(f)
        for i, fs in by_value.items():
            add(pulp.lpSum(fs) <= r(t, i) + s(t, i) + sf(t, i), f"free_once_{t}_{i}")
        prev = None
        for k in range(t + 1):
            rk = r(t, k)
            u = pulp.LpVariable(f"U_{t}_{k}", 0, B)
            U[t, k] = u
            if k == 0:
                add(u == M[0] * rk + pulp.lpSum(M[i] * (s(t, i) + si(t, i) + sf(t, i)) for i in range(t)),
                    f"memory_init_{t}")
            else:
                add(u == prev + M[k] * rk - pulp.lpSum(M[i] * FREE[t, i, k - 1] for i in in_edges[k - 1]
                                                       if (t, i, k - 1) in FREE), f"memory_{t}_{k}")
            if W[k] > 0:
                add(u + W[k] * rk <= B, f"workspace_{t}_{k}")
            prev = u

    # no-waste cuts
    for (t, i), v in S.items():
        used = [r(t, k) for k in succs[i] if k <= t]
        add(v <= s(t + 1, i) + so(t, i) + pulp.lpSum(used), f"no_waste_keep_{t}_{i}")
    for (t, i), v in R.items():
        used = [r(t, k) for k in succs[i] if i < k <= t]
        add(v <= s(t + 1, i) + pulp.lpSum(used), f"no_waste_recompute_{t}_{i}")
    for (t, i), v in SO.items():  # a host copy nothing brings back (e.g. of a value already dead)
        back = [d[tt, i] for d in (SI, SF) for tt in range(t + 1, n) if (tt, i) in d]
        add(v <= pulp.lpSum(back), f"no_waste_swap_out_{t}_{i}")

    # objective
    tau: dict = {}
    if swap and SO:
        for t in range(n):
            comp = C[t] + pulp.lpSum(C[i] * R[t, i] for i in range(t) if (t, i) in R)
            xfer = [X[i] * v for (tt, i), v in SO.items() if tt == t] + \
                   [X[i] * v for (tt, i), v in SI.items() if tt == t]
            fetch = [X[i] * v for (tt, i), v in SF.items() if tt == t]
            if xfer or fetch:
                tau[t] = pulp.LpVariable(f"tau_{t}", 0)
                add(tau[t] >= pulp.lpSum(fetch) + comp, f"stage_compute_{t}")
                add(tau[t] >= pulp.lpSum(fetch) + pulp.lpSum(xfer), f"stage_transfer_{t}")
        prob += pulp.lpSum(tau.values()) + pulp.lpSum(
            C[t] + pulp.lpSum(C[i] * R[t, i] for i in range(t) if (t, i) in R) for t in range(n) if t not in tau)
    else:
        prob += sum(C) + pulp.lpSum(C[i] * v for (t, i), v in R.items())
    return Model(prob, R, S, SO, SI, SF, FREE, U, tau, q, cu, B, swap,
                 meta={"memory_units_budget": B, "variables": len(prob.variables()),
                       "constraints": len(prob.constraints), "quantised": quantised, "M": M, "W": W})


def schedule_from_model(graph: Graph, m: Model) -> Schedule:
    n = graph.n
    val = lambda v: v.varValue is not None and v.varValue > 0.5  # noqa: E731
    R = [{t} | {i for i in range(t) if (t, i) in m.R and val(m.R[t, i])} for t in range(n)]
    SO = [{i for i in range(t) if (t, i) in m.SO and val(m.SO[t, i])} for t in range(n)]
    SI = [{i for i in range(t) if (t, i) in m.SI and val(m.SI[t, i])} for t in range(n)]
    SF = [{i for i in range(t) if (t, i) in m.SF and val(m.SF[t, i])} for t in range(n)]
    S = minimal_keep(graph, R, SO, SI, SF)
    SI = [SI[t] & (S[t + 1] if t + 1 < n else set()) for t in range(n)]
    return Schedule.from_stages(graph, [Stage(sorted(R[t]), sorted(S[t]), sorted(SO[t]), sorted(SI[t]),
                                              sorted(SF[t])) for t in range(n)])


def minimal_keep(graph: Graph, R: list[set[int]], SO: list[set[int]], SI: list[set[int]],
                 SF: list[set[int]] | None = None) -> list[set[int]]:
    """The smallest S that R and the swaps need, from the last stage back.

    S[t] holds every input of a node computed in stage t that stage t does not compute itself,
    every value swapped out in stage t, and every value S[t+1] holds that stage t neither
    computes nor swaps in.  Any feasible S of the ILP is >= this one entry by entry (the
    `deps`, `validity` and `swap_out` rows force each entry), and a smaller S only lowers memory
    and loosens the FREE bounds, which is why S can be a continuous variable in the model.
    """
    n = graph.n
    SF = SF or [set() for _ in range(n)]
    S: list[set[int]] = [set() for _ in range(n + 1)]
    for t in reversed(range(n)):
        need = {u for k in R[t] for u in graph.preds[k] if u not in R[t] and u not in SF[t]}
        need |= SO[t]
        need |= {i for i in S[t + 1] if i not in R[t] and i not in SI[t] and i not in SF[t]}
        S[t] = need
    if S[0]:
        raise AssertionError(f"schedule needs values {sorted(S[0])} before the first stage")
    return S[:n]


def set_warm_start(m: Model, schedule: Schedule) -> None:
    """Initial values for every binary from a schedule with stage matrices."""
    for d in (m.R, m.S, m.SO, m.SI, m.SF):
        for v in d.values():
            v.setInitialValue(0)
    for t, st in enumerate(schedule.stages or []):
        for i in st.compute:
            if (t, i) in m.R:
                m.R[t, i].setInitialValue(1)
        for d, ids in ((m.S, st.keep), (m.SO, st.swap_out), (m.SI, st.swap_in), (m.SF, st.fetch)):
            for i in ids:
                if (t, i) in d:
                    d[t, i].setInitialValue(1)


def prune_waste(graph: Graph, schedule: Schedule) -> Schedule:
    """Remove kept/recomputed/fetched values that nothing uses and swap-outs that nothing brings
    back (the ILP's no_waste rows), to a fixpoint."""
    assert schedule.stages is not None
    n = len(schedule.stages)
    R = [set(s.compute) for s in schedule.stages]
    S = [set(s.keep) for s in schedule.stages]
    SO = [set(s.swap_out) for s in schedule.stages]
    SI = [set(s.swap_in) for s in schedule.stages]
    SF = [set(s.fetch) for s in schedule.stages]
    succs = graph.succs
    changed = True
    while changed:
        changed = False
        for t in range(n):
            nxt = S[t + 1] if t + 1 < n else set()
            for i in sorted(S[t]):
                if i not in nxt and i not in SO[t] and not any(k in R[t] for k in succs[i]):
                    S[t].discard(i)
                    changed = True
            for i in sorted(R[t]):
                if i != t and i not in nxt and not any(k in R[t] and k > i for k in succs[i]):
                    R[t].discard(i)
                    changed = True
            for i in sorted(SI[t]):
                if i not in nxt:
                    SI[t].discard(i)
                    changed = True
            for i in sorted(SF[t]):
                if i not in nxt and not any(k in R[t] for k in succs[i]):
                    SF[t].discard(i)
                    changed = True
            for i in sorted(SO[t]):
                if not any(i in SI[tt] or i in SF[tt] for tt in range(t + 1, n)):
                    SO[t].discard(i)
                    changed = True
    return Schedule.from_stages(graph, [Stage(sorted(R[t]), sorted(S[t]), sorted(SO[t]), sorted(SI[t]),
                                              sorted(SF[t])) for t in range(n)])


_WARM_START_SOLVERS = ("checkpoint-all", "chen-greedy", "griewank", "chen-sqrtn", "checkpoint-last-node",
                       "dtr-eq", "dtr", "lookahead")


def baseline_schedules(graph: Graph, budget_bytes: int, solvers: tuple = _WARM_START_SOLVERS, *,
                       op_lists: bool = False, skip_above: dict | None = None):
    """(name, schedule) for each of `solvers` that runs at `budget_bytes`, in that order.  An
    op-list schedule (DTR's) comes cast into stages (`stages_from_ops`) and pruned of waste, so
    that it can seed the ILP; with `op_lists` also as the bare op list (``name + " (op list)"``),
    which the stage cast can push over the budget.  Whether a schedule fits is for the caller to
    check.  `skip_above`: solver name -> the node count above which it is too slow to run."""
    from remat.core.schedule import stages_from_ops
    from . import get, names
    for nm in solvers:
        if nm not in names() or graph.n > (skip_above or {}).get(nm, graph.n):
            continue
        try:
            sch = get(nm)(graph, budget_bytes)
        except (InfeasibleBudgetError, InvalidInputError, SolverError):
            continue
        if sch.stages is None:
            stages = stages_from_ops(graph, sch.ops)
            if stages is not None:
                yield nm, prune_waste(graph, Schedule.from_stages(graph, stages))
            if op_lists:
                yield f"{nm} (op list)", Schedule(list(sch.ops))
        else:
            yield nm, prune_waste(graph, sch)


def best_baseline(graph: Graph, budget_bytes: int, bandwidth: float | None = None) -> Schedule | None:
    """The fastest baseline schedule (pruned of waste, in stages) that fits, or None."""
    best, best_time = None, math.inf
    for nm, sch in baseline_schedules(graph, budget_bytes):
        res = simulate(graph, sch, bandwidth)
        if res.valid and res.peak_bytes <= budget_bytes and res.time < best_time:
            best, best_time = sch, res.time
            best.report = {"name": nm}
    return best


SEED_SLACK = (0.0, 0.125, 0.25)  # budgets (activation bytes x (1 + slack)) the seeds of shift_search run at
SHIFTS = (0, 1)                  # stages a seed's recomputation may move by
INSTANT_SHARE = 0.4  # of the time limit, for the instant IP before the full model
INSTAGE_SHARE = 0.5  # of the time left, for the instant IP with rebuild moments on demand after it
INSTANT_CAP_S = 60.0  # its limit when the call has none
WARM_SEARCH_SHARE = 0.2          # of the time limit, spent on shift searches for the warm start
SHIFT_SEARCH_S = 10.0            # per shift search when the solve has no time limit


def near_seeds(graph: Graph, budget_bytes: int, slack: tuple = SEED_SLACK,
               bandwidth: float | None = None) -> list[tuple[float, int, str, Schedule]]:
    """Valid baseline schedules (time, peak bytes, name, schedule) at `budget_bytes` and at looser budgets,
    the nearest budget first, one per distinct recomputation pattern: the seeds of `shift_search`.  Those
    that peak above the budget are what makes them useful: revolve with one more snapshot, say,
    often fits once each recomputation moves into the stage that consumes it."""
    act = max(0, budget_bytes - graph.fixed_bytes)
    seen: set = set()
    out = []
    for sl in slack:
        for nm, sched in baseline_schedules(graph, graph.fixed_bytes + int(act * (1 + sl))):
            key = tuple(tuple(st.compute) for st in sched.stages)
            if key in seen:
                continue
            seen.add(key)
            res = simulate(graph, sched, bandwidth)
            if res.valid:
                out.append((res.time, res.peak_bytes, f"{nm} at {1 + sl:g}x the budget", sched))
    return out


def searched_warm_start(graph: Graph, budget_bytes: int, *, time_limit: float | None, threads: int | None = None,
                        backend: str = "cbc", bandwidth: float | None = None, recompute_backward: bool = False,
                        max_seeds: int = 4) -> Schedule | None:
    """The best baseline that fits, improved by `shift_search` around the `max_seeds` fastest
    seeds (`near_seeds`) that beat it, within `time_limit` seconds in all."""
    t0 = _time.perf_counter()
    seeds = near_seeds(graph, budget_bytes, bandwidth=bandwidth)
    best, best_time = None, math.inf
    for tm, peak, nm, sched in seeds:
        if tm < best_time and peak <= budget_bytes:
            best, best_time = sched, tm
            best.report = {"name": nm.split(" at ")[0]}
    tried = 0
    for tm, _, nm, sched in seeds:
        left = None if time_limit is None else time_limit - (_time.perf_counter() - t0)
        if tried >= max_seeds or (left is not None and left < 0.5):
            break
        if tm >= best_time * (1 - 1e-12):
            continue
        tried += 1
        found = shift_search(graph, budget_bytes, sched, threads=threads, backend=backend, bandwidth=bandwidth,
                             recompute_backward=recompute_backward,
                             time_limit=SHIFT_SEARCH_S if left is None else max(0.5, left / (max_seeds - tried + 1)))
        if found is not None:
            t_found = simulate(graph, found, bandwidth).time
            if t_found < best_time * (1 - 1e-12):
                best, best_time = found, t_found
                best.report = {"name": f"shift search around {nm}"}
    log.info("ilp: warm start %s (%.6g) after %d shift searches in %.1f s", best.report["name"] if best else None,
             best_time, tried, _time.perf_counter() - t0)
    return best


def shift_search(graph: Graph, budget_bytes: int, seed: Schedule, *, time_limit: float | None,
                 threads: int | None = None, backend: str = "cbc", bandwidth: float | None = None,
                 recompute_backward: bool = False, shifts: tuple = SHIFTS) -> Schedule | None:
    """The recompute-only ILP restricted to `seed`'s recomputations, each allowed in its own stage
    or `shifts` stages later: a neighbourhood far smaller than the full model (a second or two on
    a 65-node chain, tens of seconds on 200-node zoo graphs at tight budgets), which
    repairs a seed that peaks a little above the budget (a value prepared in the stage before its
    consumer costs memory there; recomputed in the consumer's stage it does not) and keeps the
    best of its variants.  Returns the schedule if it fits, else None; its bound is not the graph's.

    Chain of 32 layers at 9 units (tests/test_ilp.py): revolve fits only with 5 snapshots (134);
    with 6 snapshots (126, peak 10 units) shifted it fits in 9 units.  On shorter chains the same
    construction meets the exact optimum wherever the full ILP proves one."""
    t0 = _time.perf_counter()
    support = {(t + d, i) for t, st in enumerate(seed.stages or []) for i in st.compute if i != t for d in shifts}
    support = {(t, i) for t, i in support if i < t < graph.n}
    m = build_model(graph, budget_bytes, swap=False, bandwidth=bandwidth, recompute_backward=recompute_backward,
                    r_support=support, name="remat_shift")
    # (quantised memory rounds sizes up: still a restriction whose schedules fit in exact bytes)
    # no MIP start: measured on ResNet-50 at 0.3x, CBC started from the seed stayed there in 30 s
    # (and ran under a CPU-time limit), while without it found 4.5 % less in 40 s
    # the limit covers the call: building the model (seconds on 200-node graphs) comes off it
    left = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
    out = _run(m, backend, left, 0.0, threads, False, False)
    if out["sol_status"] not in (1, 2) or out["objective"] is None or not _integral(m):
        return None
    sched = schedule_from_model(graph, m)
    res = simulate(graph, sched, bandwidth)
    return sched if res.valid and res.peak_bytes <= budget_bytes else None


_CBC_RESULT = re.compile(r"^Result - (.*)$", re.M)
_CBC_OBJ = re.compile(r"^Objective value:\s*([-+0-9.eE]+)", re.M)
_CBC_BOUND = re.compile(r"^Lower bound:\s*([-+0-9.eE]+)", re.M)
_CBC_EARLY_END = re.compile(r"^(Problem is infeasible.*|Pre-processing says infeasible.*)$", re.M)


def parse_cbc_log(text: str) -> dict:
    out: dict = {}
    m = _CBC_RESULT.findall(text)
    if m:
        out["result"] = m[-1].strip()
    m = _CBC_OBJ.findall(text)
    if m:
        out["objective"] = float(m[-1])
    m = _CBC_BOUND.findall(text)
    if m:
        out["lower_bound"] = float(m[-1])
    if "result" not in out:
        # presolve can end the run before the summary: "Problem is infeasible - 0.00 seconds",
        # "Pre-processing says infeasible or unbounded"
        m = _CBC_EARLY_END.findall(text)
        if m:
            out["result"] = m[-1].strip()
    return out


_CBC_INCUMBENT = re.compile(r"(?:Integer solution of|best solution,?)\s*([-+0-9.eE]+)")
_CBC_PROGRESS = re.compile(r"([-+0-9.eE]+) best solution, best possible ([-+0-9.eE]+)")
_CBC_CONTINUOUS = re.compile(r"Continuous objective value is ([-+0-9.eE]+)")


class _LogWatcher(threading.Thread):
    """Tails CBC's log while it runs and reports (elapsed s, incumbent, bound) in model units."""

    def __init__(self, path: str, callback: Callable[[float, float | None, float | None], None]):
        super().__init__(daemon=True)
        self.path, self.callback = path, callback
        self.done = threading.Event()
        self.incumbent: float | None = None
        self.bound: float | None = None

    def run(self) -> None:
        t0 = _time.perf_counter()
        pos = 0
        while not self.done.wait(0.5):
            try:
                with open(self.path) as fh:
                    fh.seek(pos)
                    chunk = fh.read()
                    pos = fh.tell()
            except OSError:
                continue
            changed = False
            for line in chunk.splitlines():
                for rx, key in ((_CBC_CONTINUOUS, "bound"), (_CBC_PROGRESS, "both"), (_CBC_INCUMBENT, "inc")):
                    mt = rx.search(line)
                    if not mt:
                        continue
                    if key == "bound":
                        self.bound = float(mt.group(1))
                    elif key == "both":
                        self.incumbent, self.bound = float(mt.group(1)), float(mt.group(2))
                    else:
                        self.incumbent = float(mt.group(1))
                    changed = True
                    break
            if changed:
                self.callback(_time.perf_counter() - t0, self.incumbent, self.bound)


# CBC overruns its own limit in preprocessing and infeasibility proofs (seen: 215 s against 30 on
# a 121-node random DAG): it is interrupted at limit * 1.1 + 3 s (SIGINT: it stops and writes its
# incumbent) and killed 5 s later (SIGINT does not stop its preprocessing)
WATCHDOG_GRACE = (1.1, 3.0)
WATCHDOG_KILL_S = 5.0


def cbc_limit_within(seconds: float) -> float:
    """The CBC time limit whose worst case (run to the watchdog's interrupt, then to its kill)
    ends within `seconds`: for a step that must end by then."""
    return (seconds - WATCHDOG_GRACE[1] - WATCHDOG_KILL_S) / WATCHDOG_GRACE[0]


class _HiGHSRun(pulp.HiGHS):
    """PuLP's HiGHS solver with two things PuLP does not pass through highspy: with `start`, the
    variables' current values as a MIP start (highspy's setSolution; HiGHS ignores an infeasible
    one), and `give_up(running seconds, dual bound in model units or None)`, asked at HiGHS's MIP
    interrupt checks (its root cut loop included), which stops the solve when it returns True (the
    status is then "Interrupted by user": the incumbent and the bound stand, nothing is proven)."""

    def __init__(self, *args, start: bool = False, give_up: Callable[[float, float | None], bool] | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start, self.give_up = start, give_up

    def callSolver(self, lp):
        import highspy
        if self.start:
            start = highspy.HighsSolution()
            start.col_value = [float(v.varValue) if v.varValue is not None else 0.0 for v in lp.variables()]
            start.value_valid = True
            lp.solverModel.setSolution(start)  # columns are lp.variables() in order (buildSolverModel)
        if self.give_up is not None:
            def check(event) -> None:
                out = event.data_out
                bound = out.mip_dual_bound if math.isfinite(out.mip_dual_bound) else None
                if self.give_up(out.running_time, bound):
                    event.interrupt()
            lp.solverModel.cbMipInterrupt.subscribe(check)
        super().callSolver(lp)


_highs_banner_shown = False


def _swallow_highs_banner() -> None:
    """HiGHS writes its banner ("Running HiGHS ...: Copyright ...") to the C-level stdout once per
    process, at the first `Highs()`, before any option can turn it off: in `remat plan`'s output
    it landed between the progress lines, and in anything a caller prints to stdout.  That first
    `Highs()` is made here with file descriptor 1 pointed at /dev/null; where there is no such
    descriptor to redirect, the banner shows as before."""
    global _highs_banner_shown
    if _highs_banner_shown:
        return
    _highs_banner_shown = True
    import highspy
    try:
        sys.stdout.flush()  # (what Python holds for fd 1 goes out before fd 1 is swapped)
    except (ValueError, AttributeError):  # (a closed or missing sys.stdout)
        pass
    try:
        saved = os.dup(1)
    except OSError:  # (no descriptor 1)
        highspy.Highs()
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        os.close(saved)
        highspy.Highs()
        return
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(devnull)
        os.close(saved)


def highs_available() -> bool:
    """Whether the optional HiGHS backend (highspy, the `highs` extra) is installed."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def _cbc_binary() -> str:
    return pulp.PULP_CBC_CMD().path


def _cbc_wrapper(pidfile: str, line_buffered: bool) -> str:
    """A script that records its pid in `pidfile` and execs pulp's CBC (line-buffered when asked
    and `stdbuf` exists, so its log can be followed live)."""
    stdbuf = shutil.which("stdbuf") if line_buffered else None
    run = f'"{stdbuf}" -oL "{_cbc_binary()}"' if stdbuf else f'"{_cbc_binary()}"'
    path = os.path.join(os.path.dirname(pidfile), "cbc.sh")
    with open(path, "w") as fh:
        fh.write(f'#!/bin/sh\necho $$ > "{pidfile}"\nexec {run} "$@"\n')
    os.chmod(path, 0o755)
    return path


def _signal_cbc(pidfile: str, sig: int) -> bool:
    """Send `sig` to the CBC that `_cbc_wrapper` started; False if it is not (yet) known."""
    try:
        with open(pidfile) as fh:
            os.kill(int(fh.read().strip()), sig)
        return True
    except (OSError, ValueError):
        return False


class _Watchdog(threading.Thread):
    """Interrupts CBC (SIGINT: it stops and writes its incumbent) when it runs well past its
    time limit, and kills it if that does not end it."""

    def __init__(self, pidfile: str, time_limit: float):
        super().__init__(daemon=True)
        self.pidfile, self.deadline = pidfile, time_limit * WATCHDOG_GRACE[0] + WATCHDOG_GRACE[1]
        self.done = threading.Event()
        self.fired: str | None = None

    def _signal(self, sig: int) -> bool:
        if not _signal_cbc(self.pidfile, sig):
            return False
        self.fired = "interrupted" if sig == signal.SIGINT else "killed"
        return True

    def run(self) -> None:
        if self.done.wait(self.deadline):
            return
        # (information: the caller gets CBC's incumbent, or its own fallback, and says what came of it)
        log.info("CBC is still running %.0f s after its start (time limit %.0f s); interrupting it",
                 self.deadline, (self.deadline - WATCHDOG_GRACE[1]) / WATCHDOG_GRACE[0])
        self._signal(signal.SIGINT)
        if not self.done.wait(WATCHDOG_KILL_S):
            self._signal(signal.SIGKILL)


def _run_cbc(m: Model, time_limit: float | None, gap: float, threads: int | None, warm: bool,
             msg: bool, options: list[str] | None = None,
             progress: Callable[[float, float | None, float | None], None] | None = None,
             stop_at: float | None = None) -> dict:
    workdir = tempfile.mkdtemp(prefix="remat_cbc_")
    logpath = os.path.join(workdir, "cbc.log")
    pidfile = os.path.join(workdir, "pid")
    watcher = None
    guard = _Watchdog(pidfile, time_limit) if time_limit else None
    met = []
    if stop_at is not None:
        # an incumbent at a bound known from elsewhere is optimal: stop CBC there (SIGINT: it
        # writes its incumbent) instead of letting it try to prove what is already proven
        inner = progress

        def progress(elapsed: float, inc: float | None, bnd: float | None) -> None:
            if inner is not None:
                inner(elapsed, inc, bnd)
            if inc is not None and inc <= stop_at and not met:
                met.append(inc)
                _signal_cbc(pidfile, signal.SIGINT)
    try:
        # A MIP start under an elapsed-time limit crashes CBC more often than under a CPU-time
        # limit (the same with one thread, shorter with more).
        kw = dict(msg=msg, timeLimit=time_limit, gapRel=gap if gap > 0 else None, threads=threads,
                  warmStart=warm, logPath=logpath, timeMode="cpu" if warm and time_limit else "elapsed",
                  options=options or [])
        solver = pulp.COIN_CMD(path=_cbc_wrapper(pidfile, progress is not None), **kw)
        if progress is not None:
            watcher = _LogWatcher(logpath, progress)
            watcher.start()
        if guard is not None:
            guard.start()
        try:
            m.prob.solve(solver)
        except pulp.PulpSolverError:
            if guard is None or guard.fired is None:
                raise
        text = open(logpath).read() if os.path.exists(logpath) else ""
        info = parse_cbc_log(text)
        if met:
            info["result"] = "Stopped by remat (the incumbent meets a lower bound known from a relaxation)"
        if guard is not None and guard.fired is not None:
            info["watchdog"] = guard.fired
            info.setdefault("result", f"Stopped by remat ({guard.fired} {guard.deadline:.0f} s after the start, past "
                                      f"CBC's time limit)")
        return info
    finally:
        if guard is not None:
            guard.done.set()
        if watcher is not None:
            watcher.done.set()
            watcher.join()
        shutil.rmtree(workdir, ignore_errors=True)


def highs_ready() -> None:
    """Before any HiGHS solve in this process: a fresh thread pool (HiGHS fixes its pool at the
    first solve of the process and fails later solves that ask for another thread count: "Not
    Set") and its banner swallowed (`_swallow_highs_banner`)."""
    import highspy
    highspy.Highs.resetGlobalScheduler(True)
    _swallow_highs_banner()


def _run(m: Model, backend: str, time_limit: float | None, gap: float, threads: int | None,
         warm: bool, msg: bool, options: list[str] | None = None,
         progress: Callable[[dict], None] | None = None, stop_at: float | None = None,
         give_up: Callable[[float, float | None], bool] | None = None) -> dict:
    """Solve the model; return {'sol_status', 'objective', 'bound', 'proven', 'result'} in model units.

    `progress`, if given, is called with {"elapsed", "incumbent", "lower_bound", "gap"} (seconds
    of the schedule, not of the solve) whenever CBC's log shows a new incumbent or bound.
    `stop_at` (seconds of the schedule; CBC only): stop once an incumbent is that fast.
    `give_up(elapsed seconds of the solve, lower bound in seconds of the schedule or None)` (HiGHS
    only; `_HiGHSRun`): stop the solve when it returns True.
    """
    offset = m.prob.objective.constant or 0.0  # solvers report objectives without the constant

    def seconds(value: float | None) -> float | None:  # a solver's objective value, in seconds of the schedule
        return None if value is None else (value + offset) * m.time_unit

    cb = None
    if progress is not None:
        def _cb(elapsed: float, inc: float | None, bnd: float | None) -> None:
            inc_s, bnd_s = seconds(inc), seconds(bnd)
            g = (inc_s - bnd_s) / inc_s if inc_s and bnd_s is not None and inc_s > 0 else None
            progress({"elapsed": elapsed, "incumbent": inc_s, "lower_bound": bnd_s, "gap": g})
        cb = _cb
    if backend == "cbc":
        t0 = _time.perf_counter()
        try:
            stop = None if stop_at is None else stop_at / m.time_unit - offset + 1e-9 * abs(stop_at / m.time_unit)
            info = _run_cbc(m, time_limit, gap, threads, warm, msg, options, cb, stop)
        except pulp.PulpSolverError:
            # CBC 2.10 (the binary pulp ships) can crash when the time limit runs out while it
            # is still evaluating the MIP start; solve again without it (the caller keeps the
            # warm start as a fallback incumbent).
            left = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
            log.warning("CBC crashed while using the warm start; solving again without it (%s s)", left)
            try:
                info = _run_cbc(m, left, gap, threads, False, msg, options, cb, stop)
            except pulp.PulpSolverError as e:
                raise SolverError(f"CBC failed: {e}") from None
        for key in ("objective", "lower_bound"):
            if key in info:
                info[key] += offset
        obj = pulp.value(m.prob.objective) if m.prob.sol_status in (1, 2) else None
        result = info.get("result", "")
        proven = m.prob.sol_status == 1 and result.startswith("Optimal solution found") and gap <= 0
        bound = info.get("lower_bound")
        if bound is not None and obj is not None and not proven and result.startswith("Stopped") \
                and bound >= obj - 1e-9 * max(1.0, abs(obj)):
            # CBC stopped inside its root cut loop prints a garbage "best possible" (seen: 4.8e12
            # against an incumbent of 29) and then the incumbent as its lower bound; a bound that
            # met the incumbent would have ended the search as optimal, so this one is no bound
            log.info("CBC stopped with its bound at its incumbent (%s): no bound", result)
            bound = None
        if bound is None and proven:
            bound = obj
        if bound is None and result.startswith("Optimal solution found") and obj is not None:
            # stopped by the gap tolerance: CBC's bound is within gap of the incumbent
            bound = obj / (1 + gap) if gap > 0 else obj
        return {"sol_status": m.prob.sol_status, "objective": obj, "bound": bound, "proven": proven,
                "result": result, "infeasible": "infeasible" in result.lower(), "watchdog": info.get("watchdog")}
    if backend == "highs":
        try:
            asked = None if give_up is None else (lambda elapsed, bnd: give_up(elapsed, seconds(bnd)))
            solver = _HiGHSRun(msg=msg, timeLimit=time_limit, gapRel=gap if gap > 0 else None, threads=threads,
                               start=warm, give_up=asked)
        except Exception as e:  # pragma: no cover
            raise SolverError(f"HiGHS backend unavailable ({e}); install highspy or use --backend cbc")
        if not solver.available():
            raise SolverError("HiGHS backend unavailable: pip install highspy, or use --backend cbc")
        highs_ready()
        m.prob.solve(solver)
        h = m.prob.solverModel
        info = h.getInfo()
        status = h.modelStatusToString(h.getModelStatus())
        obj = pulp.value(m.prob.objective) if m.prob.sol_status in (1, 2) else None
        bound = getattr(info, "mip_dual_bound", None)
        if bound is not None and not math.isfinite(bound):
            bound = None
        if bound is not None:
            bound += offset
        proven = status == "Optimal" and (info.mip_gap <= 1e-9 if hasattr(info, "mip_gap") else True)
        if proven and obj is not None:
            # HiGHS rounds its dual bound up when the objective is integral and reports the
            # unrounded one (chain12 at 6 units, from a MIP start: optimal 47, dual bound 46)
            bound = obj if bound is None else max(bound, obj)
        return {"sol_status": m.prob.sol_status, "objective": obj, "bound": bound, "proven": proven,
                "result": status, "infeasible": status == "Infeasible"}
    raise InvalidInputError(f"--backend: unknown backend {backend!r}; use 'cbc' or 'highs'")


@register("ilp", "Checkmate's ILP with keep/recompute/swap (CBC; proven optimal or reports its gap)")
def solve(graph: Graph, budget_bytes: int, *, swap: bool = True, time_limit: float | None = 60.0,
          gap: float = 0.0, threads: int | None = None, backend: str = "cbc", warm_start: bool = True,
          bandwidth: float | None = None, max_memory_units: int = 1_000_000, msg: bool = False,
          recompute_backward: bool = False, progress: Callable[[dict], None] | None = None,
          mode: str = "auto", use_instant_ip: bool = True, **options: object) -> Schedule:
    """Optimal schedule under `budget_bytes` (whole-step bytes, fixed bytes included).

    `time_limit` bounds the call: the MIP search gets what building the model and the warm start
    left of it (at least 1 s; reading back the schedule and a fallback LP bound come on top);
    `progress(dict)` receives incumbent, lower bound and gap while CBC runs.
    `use_instant_ip=False` skips the instant IP that runs first without swap (module docstring).
    `mode`: "exact" (this model on the whole graph), "scalable" (`ilp_scalable`: coarsen, solve,
    expand, refine; a bound for the whole graph) or "auto" (scalable above
    `ilp_scalable.AUTO_THRESHOLD` nodes).
    """
    if mode not in ("auto", "exact", "scalable"):
        raise InvalidInputError(f"--mode: expected 'auto', 'exact' or 'scalable', got {mode!r}")
    from . import ilp_scalable
    if mode == "scalable" or (mode == "auto" and graph.n > ilp_scalable.AUTO_THRESHOLD):
        return ilp_scalable.solve(graph, budget_bytes, swap=swap, time_limit=time_limit, gap=gap, threads=threads,
                                  backend=backend, bandwidth=bandwidth, recompute_backward=recompute_backward,
                                  progress=progress, msg=msg, use_instant_ip=use_instant_ip, **options)
    t0 = _time.perf_counter()
    _check_budget(graph, budget_bytes)
    if not swap and not recompute_backward:
        # what must be resident at some first compute does not fit: no schedule, say so now
        # (CBC may need minutes to prove it: 238 s on random_layered(49) at 0.5x)
        from .ilp_scalable import check_forced_need
        check_forced_need(graph, budget_bytes)
    if warm_start and not swap:
        warm = searched_warm_start(graph, budget_bytes, bandwidth=bandwidth, threads=threads, backend=backend,
                                   recompute_backward=recompute_backward,
                                   time_limit=None if time_limit is None else WARM_SEARCH_SHARE * time_limit)
    else:
        warm = best_baseline(graph, budget_bytes, bandwidth) if warm_start else None
    if swap and warm_start:
        # recompute-only is a restriction of the swap model and solves much faster: a third of
        # the time on it gives the swap model a strong start (and ends the search when it already
        # reaches the no-recompute time, which no schedule beats)
        try:
            plain = solve(graph, budget_bytes, swap=False, time_limit=None if time_limit is None else time_limit / 3,
                          gap=gap, threads=threads, backend=backend, bandwidth=bandwidth,
                          max_memory_units=max_memory_units, recompute_backward=recompute_backward,
                          mode="exact")
        except (InfeasibleBudgetError, SolverError):
            plain = None
        if plain is not None:
            if plain.report["objective"] <= graph.total_time * (1 + 1e-12):
                plain.report.update(swap=True, time_limit=time_limit, wall_time=_time.perf_counter() - t0,
                                    status="optimal", lower_bound=plain.report["objective"], gap=0.0,
                                    solver_result="recompute-only optimum reaches the no-recompute time")
                return plain
            if warm is None or plain.report["objective"] < simulate(graph, warm, bandwidth).time:
                warm = plain
                warm.report = {"name": "ilp (no swap)"}
    def proven_early(plan: Schedule, time: float, bound: float, source: str, result: str, **extra) -> Schedule:
        """`plan`, with a report that says a relaxation's bound (from `source`) proves it optimal."""
        plan.report = {"name": "ilp", "backend": backend, "swap": swap, "time_limit": time_limit, "gap_limit": gap,
                       "wall_time": _time.perf_counter() - t0, **extra,
                       "warm_start": warm.report.get("name") if warm else None, "solver_result": result,
                       "bound_from": source, "status": "optimal", "objective": time,
                       "lower_bound": min(time, bound), "gap": 0.0}
        return plan

    chain = None
    if not swap and not recompute_backward:
        # on a chain, revolve's count is a bound (griewank.chain_bound): a warm start that meets
        # it is optimal with no search (chain32 at 9 units: CBC alone never proves it)
        from . import griewank
        chain = griewank.chain_bound(graph, budget_bytes)
        if chain is not None and warm is not None:
            res = simulate(graph, warm, bandwidth)
            if res.valid and res.peak_bytes <= budget_bytes and res.time <= chain * (1 + 1e-9):
                return proven_early(warm, res.time, chain, "chain (revolve)",
                                    "the warm start meets revolve's bound for chains")
    instant_bounds: list[tuple[float | None, str]] = []
    if use_instant_ip and not swap and not recompute_backward:
        # the instant IP (solvers/instant_ip.py): a relaxation a fifth the size that sees
        # recomputation cascades; its plan often fits, and then its proof ends the search.  When
        # it proves an optimum that peaks above the budget inside a stage in every rebuild order,
        # rebuild-moment rows in those stages come next, again while new ones overflow (instant_ip
        # "Rebuild moments on demand"): often the exact optimum (random_layered(20, seed 2) at
        # 0.6x: 1.2520, proven in 11 s with rows at three stages, where the plain model stops at 1.2362)
        from . import instant_ip
        phases = [("instant IP", False, "cbc"), ("instant IP (HiGHS)", False, "highs"),
                  ("instant IP, rebuild moments on demand", True, "highs" if highs_available() else "cbc")]
        for phase, in_stage, solver in phases:
            left = None if time_limit is None else time_limit - (_time.perf_counter() - t0)
            if in_stage:
                if not (instant["proven"] and instant["schedule"] is not None) or (left is not None and left < 4.0):
                    break
                limit_ip = INSTANT_CAP_S if left is None else INSTAGE_SHARE * left
            elif solver == "highs":
                # HiGHS's cuts often prove what CBC's do not (random_layered(49) at 0.8x: 1.1272
                # proven in 30 s; CBC 1.1200): its bound, and its plan if that fits
                if instant["proven"] or instant["infeasible"] or not highs_available() \
                        or (left is not None and left < 8.0):
                    continue
                limit_ip = INSTANT_CAP_S if left is None else min(INSTANT_SHARE * time_limit, 0.5 * left)
            else:
                limit_ip = INSTANT_CAP_S if time_limit is None else max(1.0, INSTANT_SHARE * time_limit)
            if in_stage:  # rows where the proven optimum's plan overflows in every rebuild order, and again
                instant = instant_ip.solve_on_demand(graph, budget_bytes, instant, time_limit=limit_ip,
                                                     threads=threads, start=warm, backend=solver)
            else:
                instant = instant_ip.solve(graph, budget_bytes, time_limit=limit_ip, threads=threads, start=warm,
                                           backend=solver, progress=(lambda d, phase=phase: progress(
                                               {**d, "incumbent": None, "gap": None, "phase": phase}))
                                           if progress else None)
            if not instant["infeasible"]:
                instant_bounds.append((instant["bound"], phase))
            plan_ip = instant["schedule"]
            if plan_ip is None:
                continue
            res = simulate(graph, plan_ip, bandwidth)
            if res.valid and res.peak_bytes > budget_bytes and instant["bound"] is not None \
                    and res.time <= instant["bound"] * (1 + 1e-9):
                # a proven optimum that peaks over in id order may fit in another rebuild order
                # inside its stages (stage_order): then it is the optimum still
                ordered = stage_order.lower_peak(graph, plan_ip, budget_bytes)
                res_o = simulate(graph, ordered, bandwidth) if ordered is not None else None
                if res_o is not None and res_o.valid and res_o.peak_bytes <= budget_bytes:
                    return proven_early(ordered, res_o.time, instant["bound"], phase,
                                        f"the {phase} optimum fits the budget in another rebuild order",
                                        variables=instant["variables"])
            if not (res.valid and res.peak_bytes <= budget_bytes):
                continue
            if instant["bound"] is not None and res.time <= instant["bound"] * (1 + 1e-9):  # (proven: bound = optimum)
                return proven_early(plan_ip, res.time, instant["bound"], phase, f"the {phase} optimum fits the budget",
                                    variables=instant["variables"])
            if warm is None or res.time < simulate(graph, warm, bandwidth).time * (1 - 1e-12):
                warm = plan_ip
                warm.report = {"name": phase}
    m = build_model(graph, budget_bytes, swap=swap, bandwidth=bandwidth, max_memory_units=max_memory_units,
                    recompute_backward=recompute_backward)
    if warm is not None:
        set_warm_start(m, warm)
    log.info("ilp: %d variables, %d constraints, warm start %s", len(m.prob.variables()),
             len(m.prob.constraints), warm.report.get("name") if warm else None)
    # the time limit covers the whole call: what the warm start and the model took comes off it
    search_limit = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
    known = max([b for b, _ in instant_bounds if b is not None] + ([chain] if chain is not None else []), default=None)
    out = _run(m, backend, search_limit, gap, threads, warm is not None, msg, progress=progress,
               stop_at=known if gap <= 0 else None)
    wall = _time.perf_counter() - t0
    report = {"name": "ilp", "backend": backend, "swap": swap, "time_limit": time_limit, "gap_limit": gap,
              "wall_time": wall, "memory_quantum": m.quantum, "variables": m.meta["variables"],
              "constraints": m.meta["constraints"], "solver_result": out["result"],
              "warm_start": warm.report.get("name") if warm else None}
    if out["infeasible"] and warm is not None:
        # CBC's preprocessing sometimes declares large models infeasible although a schedule
        # that satisfies every row is known (seen on a 257-node chain): trust the schedule.
        log.warning("CBC reported the model infeasible (%s), but the %s schedule fits it; "
                    "returning the best known schedule", out["result"], warm.report.get("name"))
        report["solver_result"] += " (contradicted by a known feasible schedule)"
        out.update(infeasible=False, sol_status=0, bound=None, proven=False)
    elif out["infeasible"] and backend == "cbc":
        # confirm without CBC's preprocessing before telling the user the budget cannot be met
        out = _run(m, backend, time_limit, gap, threads, False, msg, options=["preprocess off"])
    if out["sol_status"] in (1, 2) and not _integral(m):
        # CBC stopped by the time limit before any integer solution writes the relaxation's
        # values, which PuLP labels "integer feasible": not an incumbent
        log.info("the solver's values are fractional (%s): no incumbent", out["result"])
        out.update(sol_status=0, objective=None, proven=False)
    sched = None
    if out["sol_status"] in (1, 2) and out["objective"] is not None:
        sched = schedule_from_model(graph, m)
        res = simulate(graph, sched, bandwidth)
        objective = out["objective"] * m.time_unit
        if not res.valid or res.peak_bytes > budget_bytes:  # numerical trouble or a modelling bug
            # (or a CBC the watchdog interrupted: U-Net d3's coarse graph at 0.3x wrote values
            # that are no solution, peak 2.27 GB against 0.68)
            # a proven optimum that does not fit is a modelling bug; values written by a solver
            # stopped at its limit are just not used (ResNet-50 d2's coarse graph at 0.3x, 2 threads:
            # peak 3.28 GB against 0.96, after which the plan came from the other steps)
            bug = out.get("proven") and not out.get("watchdog")
            (log.error if bug else log.info)(
                "the ILP's schedule does not fit in the simulator (%s; peak %d > %d; %s)%s", res.violation,
                res.peak_bytes, budget_bytes, out["result"], "; please report this graph" if bug else
                "; CBC was stopped, its values are not used")
            sched = None
            out.update(proven=False, bound=None)
    if sched is None and warm is not None and not out["infeasible"]:
        sched, res = warm, simulate(graph, warm, bandwidth)
        objective = res.time
        report["solver_result"] += " (no usable incumbent; returned the warm start)"
    elif sched is None and out["infeasible"]:
        raise InfeasibleBudgetError(
            f"no schedule fits the budget of {budget_bytes} bytes (the ILP proved it infeasible)",
            budget_bytes, fixed_bytes=graph.fixed_bytes)
    elif sched is None:
        raise SolverError(f"the ILP found no schedule within the time limit of {time_limit} s "
                          f"({out['result'] or 'no result'}); raise --time-limit or use a baseline solver")
    def above_incumbent(value: float) -> bool:  # then it is no bound (a solver's garbage, or a bug)
        return value > objective * (1 + 1e-6) + 1e-9

    bound = out["bound"] * m.time_unit if out["bound"] is not None else None
    proven = out["proven"]
    if bound is not None and not proven and above_incumbent(bound):
        # CBC interrupted inside its root cut loop can print a garbage bound (seen: 2e13 against
        # an incumbent of 154); a bound above a schedule we hold is no bound
        log.warning("discarding the solver's lower bound %.6g (above the incumbent %.6g)", bound, objective)
        bound = None
    if bound is None:  # the solver gave none (crash, or stopped before its root bound): use the LP
        left = None if time_limit is None else time_limit - (_time.perf_counter() - t0)
        bound = None
        # (with a relaxation's bound, which take_bound adds below, the LP adds nothing)
        if (known is None or above_incumbent(known)) and (left is None or left > 1.0):
            try:
                bound = solve_relaxation(graph, budget_bytes, swap=swap, bandwidth=bandwidth,
                                         recompute_backward=recompute_backward, time_limit=left)[1]
                report["bound_from"] = "lp_relaxation"
            except SolverError:
                bound = None
        if bound is None:  # every node runs at least once: the no-recomputation time
            bound = graph.total_time
            report["bound_from"] = "no_recompute_time"
    if m.meta["quantised"]:
        # optimal and bound above hold for the rounded-up model; the exact problem's bound comes
        # from the relaxation with sizes rounded down
        report.update({"quantised_status": "optimal" if proven else "feasible", "quantised_lower_bound": bound})
        bound = solve_relaxation(graph, budget_bytes, swap=swap, bandwidth=bandwidth,
                                 recompute_backward=recompute_backward, round_down=True,
                                 max_memory_units=max_memory_units)[1]
        proven = bound is not None and objective <= bound * (1 + 1e-9)
        report["bound_from"] = "lp_relaxation_rounded_down"
    def take_bound(value: float | None, source: str) -> None:
        """A relaxation's bound joins the report when it is higher (and not above the incumbent,
        as for CBC's bound above)."""
        nonlocal bound, proven
        if proven or value is None:
            return
        if above_incumbent(value):
            log.warning("discarding the %s's bound %.6g (above the incumbent %.6g)", source, value, objective)
        elif bound is None or value > bound * (1 + 1e-12):
            bound = value
            report["bound_from"] = source
            proven = objective <= value * (1 + 1e-9)

    if not proven and not recompute_backward:
        # the window IP (ilp_scalable.window_bound): integral where the LP is not; a tenth of a second
        from .ilp_scalable import window_bound
        take_bound(window_bound(graph, budget_bytes, threads=threads, swap=swap, bandwidth=bandwidth), "window IP")
    for value, source in instant_bounds:
        take_bound(value, source)
    take_bound(chain, "chain (revolve)")
    if bound is not None and bound > objective:  # float noise on a proven optimum
        bound = objective
    if bound is not None and objective > 0:
        g = max(0.0, (objective - bound) / objective)
    else:
        g = None
    report.update({"status": "optimal" if proven else "feasible", "objective": objective,
                   "lower_bound": bound if bound is not None else None, "gap": 0.0 if proven else g})
    sched.report = report
    return sched


def solve_relaxation(graph: Graph, budget_bytes: int, *, swap: bool = True, bandwidth: float | None = None,
                     recompute_backward: bool = False, round_down: bool = False,
                     max_memory_units: int = 1_000_000,
                     time_limit: float | None = None) -> tuple[Model, float | None]:
    """The LP relaxation and its optimal time in seconds (None if even the LP is infeasible)."""
    m = build_model(graph, budget_bytes, swap=swap, bandwidth=bandwidth, relax=True,
                    recompute_backward=recompute_backward, round_down=round_down,
                    max_memory_units=max_memory_units)
    m.prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))
    status = pulp.LpStatus[m.prob.status]
    if status == "Infeasible":
        return m, None
    if status != "Optimal":
        raise SolverError(f"the LP relaxation ended with status {status}")
    return m, pulp.value(m.prob.objective) * m.time_unit


def _integral(m: Model, tol: float = 1e-4) -> bool:
    for d in (m.R, m.SO, m.SI, m.SF):
        for v in d.values():
            x = v.varValue
            if x is None or min(abs(x), abs(1 - x)) > tol:
                return False
    return True


def _node_need(graph: Graph) -> int:
    """Whole-step bytes the largest node needs with its inputs and workspace: no budget goes lower."""
    return max(v.bytes + v.workspace_bytes + sum(graph.nodes[u].bytes for u in set(graph.preds[v.id]))
               for v in graph.nodes) + graph.fixed_bytes


def _check_budget(graph: Graph, budget_bytes: int) -> None:
    """Cheap necessary condition: every node must fit with its inputs and workspace."""
    need = _node_need(graph)
    if budget_bytes < need:
        raise InfeasibleBudgetError(
            f"budget {budget_bytes} bytes is below {need} bytes, what the largest node needs with its "
            f"inputs, workspace and the {graph.fixed_bytes} fixed bytes", budget_bytes,
            min_feasible_lower_bound=need, fixed_bytes=graph.fixed_bytes)


def min_feasible_budget(graph: Graph, swap: bool = True, time_limit: float | None = 30.0,
                        bandwidth: float | None = None, recompute_backward: bool = False) -> tuple[int, int]:
    """(smallest whole-step peak found, proven lower bound on it), by the same stage model.

    Minimises a peak variable P >= U[t,k] + W_k R[t,k] over schedules of any time.  The
    incumbent is simulated, so the first number is a budget that is known to work.
    """
    total = sum(v.bytes + v.workspace_bytes for v in graph.nodes)
    m = build_model(graph, graph.fixed_bytes + total, swap=swap, bandwidth=bandwidth,
                    recompute_backward=recompute_backward)
    peak = pulp.LpVariable("peak", 0)
    for (t, k), u in m.U.items():
        w = m.meta["W"][k]
        rk = 1 if k == t else m.R.get((t, k), 0)
        m.prob.addConstraint(peak >= u + w * rk, f"peak_{t}_{k}")
    m.prob.setObjective(peak)
    out = _run(m, "cbc", time_limit, 0.0, None, False, False)
    if out["sol_status"] not in (1, 2):
        raise SolverError("could not find any feasible schedule to size the budget")
    sched = schedule_from_model(graph, m)
    res = simulate(graph, sched, bandwidth)
    lb_units = int(math.ceil((out["bound"] if out["bound"] is not None else 0.0) - 1e-6))
    if m.meta["quantised"]:  # each of at most n outputs and one workspace was rounded up by < q
        lb_units -= graph.n + 1
    lb = graph.fixed_bytes + max(0, lb_units) * m.quantum
    return res.peak_bytes, min(res.peak_bytes, max(lb, _node_need(graph)))
