r"""Checkmate's rematerialization ILP, extended with swapping to host memory: the model and its read-back.

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
             U[t,k] + W_k R[t,k] <= B - fixed_bytes - PB_t;   PB_{n} <= B - fixed_bytes
             (W = workspace bytes; PB_t = the persistent bytes of the nodes before t: node i's
             count from stage i + 1 on, and at the step's end, when the last stage has freed
             everything else, all of them; `remat.core.simulate`)
stage time   tau[t] >= F_t + sum_i C_i R[t,i];  tau[t] >= F_t + sum_i (M_i / bandwidth) (SO[t,i] + SI[t,i])
             with F_t = sum_i (M_i / bandwidth) SF[t,i] (fetches run first and are waited for)
parts        R[t,p] = R[t,l] for every later part p of an op led by l, t past its last part; the
             stages of later parts recompute nothing and bring nothing back (no R, SI, SF
             there): an op's outputs are made together (`remat.core.graph`)
no_waste     S[t,i] <= S[t+1,i] + SO[t,i] + sum_{k in succ(i), k <= t} R[t,k]
             R[t,i] <= S[t+1,i] + sum_{k in succ(i), i < k <= t} R[t,k]          (i < t; for an
             op with parts one row, over the uses of all its parts)
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
(tested): node i's compute in stage i is its first, priced at ``time``; R[t, i] for t > i is a
recomputation, priced at ``recompute_time`` (`Graph.recompute_times`).  What the stage model
cannot express: a transfer spread over several stages, and a
swap-in consumed mid-stage while earlier computes of the stage overlap it (TFLMS's op lists can
do both, so a bare op list can beat the ILP's "optimal" swap schedule by that overlap).

Memory is divided by the gcd of all sizes and the budget.  When that still leaves more than
``max_memory_units`` units, sizes are rounded up and the budget down to a coarser quantum: the
schedule stays feasible in exact bytes, and the report's ``memory_quantum`` says the optimum and
bound are those of the quantised model.

Here: `build_model` (the ILP, or with ``relax=True`` its LP relaxation), `schedule_from_model`
(the schedule an integral solution describes, with the minimal S), `minimal_keep`,
`set_warm_start`, `prune_waste` (a schedule's waste removed, as the no_waste rows would),
`solve_relaxation` (the LP's bound) and `integral`.  Solving it is `exact`'s job.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce

import pulp

from remat.core.errors import SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule, Stage


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


def memory_scale(graph: Graph, act_budget: int, max_units: int,
                  round_down: bool = False) -> tuple[int, list[int], list[int], list[int], int, bool]:
    """(quantum, sizes, workspaces, persistent bytes, budget in quanta, quantised?).

    Exact when the gcd of all sizes and the budget leaves at most `max_units` units.  Otherwise
    sizes round up and the budget down (a restriction: its schedules fit in exact bytes), or,
    with round_down, sizes down and the budget up (a relaxation: its bounds are valid).
    """
    per_node = ([v.bytes for v in graph.nodes], [v.workspace_bytes for v in graph.nodes],
                [v.persistent_bytes for v in graph.nodes])
    vals = [x for xs in per_node for x in xs] + [act_budget]
    q = reduce(math.gcd, [x for x in vals if x > 0], 0) or 1
    quantised = act_budget // q > max_units
    if quantised:
        q = max(q, -(-act_budget // max_units))
    if round_down:
        M, W, P = ([x // q for x in xs] for xs in per_node)
        return q, M, W, P, -(-act_budget // q), quantised
    M, W, P = ([-(-x // q) for x in xs] for xs in per_node)
    return q, M, W, P, act_budget // q, quantised


def time_unit(graph: Graph) -> float:
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
    q, M, W, P, B, quantised = memory_scale(graph, max(act_budget, 0), max_memory_units, round_down)
    PB = [sum(P[:t]) for t in range(n)]  # persistent quanta allocated before stage t
    cu = time_unit(graph)
    C = [v.time / cu for v in graph.nodes]
    CR = [c / cu for c in graph.recompute_times]  # (a compute in a later stage is a recomputation)
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
    part_stage = {p for op in graph.op_members.values() for p in op[1:]}  # (they compute their part only)
    for t in range(n):
        for i in range(t):
            if not sink[i]:
                if (recompute_backward or graph.nodes[i].kind == "forward") and \
                        (r_support is None or (t, i) in r_support) and t not in part_stage:
                    R[t, i] = var("R", t, i)
                S[t, i] = var("S", t, i)
                if swap and M[i] > 0 and (recompute_backward or graph.nodes[i].kind == "forward"):
                    if t < n - 1:
                        SO[t, i] = var("SO", t, i)
                    if t >= 2 and i <= t - 2 and t not in part_stage:
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
    for op in graph.op_members.values():  # parts: an op is recomputed whole or not at all
        for t in range(op[-1] + 1, n):
            rs = [R.get((t, m)) for m in op]
            if all(v is None for v in rs):
                continue
            if any(v is None for v in rs):
                for j, v in enumerate(rs):
                    if v is not None:
                        add(v == 0, f"parts_fixed_{t}_{op[j]}")
            else:
                for j, v in enumerate(rs[1:], 1):
                    add(v == rs[0], f"parts_{t}_{op[j]}")
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
            u = pulp.LpVariable(f"U_{t}_{k}", 0, B - PB[t])  # (beside the persistent bytes of the nodes before t)
            U[t, k] = u
            if k == 0:
                add(u == M[0] * rk + pulp.lpSum(M[i] * (s(t, i) + si(t, i) + sf(t, i)) for i in range(t)),
                    f"memory_init_{t}")
            else:
                add(u == prev + M[k] * rk - pulp.lpSum(M[i] * FREE[t, i, k - 1] for i in in_edges[k - 1]
                                                       if (t, i, k - 1) in FREE), f"memory_{t}_{k}")
            if W[k] > 0:
                add(u + W[k] * rk <= B - PB[t], f"workspace_{t}_{k}")
            prev = u

    if sum(P) > B or graph.step_end_bytes > act_budget:
        # (the step's end holds every persistent byte, and the optimizer's step its transient on
        # top: no schedule fits)
        add(U[n - 1, n - 1] <= -1, "persistent_end")

    # no-waste cuts
    for (t, i), v in S.items():
        used = [r(t, k) for k in succs[i] if k <= t]
        add(v <= s(t + 1, i) + so(t, i) + pulp.lpSum(used), f"no_waste_keep_{t}_{i}")
    op_of, members = graph.op_of, graph.op_members
    for (t, i), v in R.items():
        op = members.get(op_of[i])
        if op is None:
            used = [r(t, k) for k in succs[i] if i < k <= t]
        elif i == op[0]:  # (an op's row: some part of it is used)
            used = [s(t + 1, m) for m in op[1:]] + [r(t, k) for m in op for k in succs[m]
                                                    if op_of[k] != i and k <= t]
        else:
            continue
        add(v <= s(t + 1, i) + pulp.lpSum(used), f"no_waste_recompute_{t}_{i}")
    for (t, i), v in SO.items():  # a host copy nothing brings back (e.g. of a value already dead)
        back = [d[tt, i] for d in (SI, SF) for tt in range(t + 1, n) if (tt, i) in d]
        add(v <= pulp.lpSum(back), f"no_waste_swap_out_{t}_{i}")

    # objective
    tau: dict = {}
    if swap and SO:
        for t in range(n):
            comp = C[t] + pulp.lpSum(CR[i] * R[t, i] for i in range(t) if (t, i) in R)
            xfer = [X[i] * v for (tt, i), v in SO.items() if tt == t] + \
                   [X[i] * v for (tt, i), v in SI.items() if tt == t]
            fetch = [X[i] * v for (tt, i), v in SF.items() if tt == t]
            if xfer or fetch:
                tau[t] = pulp.LpVariable(f"tau_{t}", 0)
                add(tau[t] >= pulp.lpSum(fetch) + comp, f"stage_compute_{t}")
                add(tau[t] >= pulp.lpSum(fetch) + pulp.lpSum(xfer), f"stage_transfer_{t}")
        prob += pulp.lpSum(tau.values()) + pulp.lpSum(
            C[t] + pulp.lpSum(CR[i] * R[t, i] for i in range(t) if (t, i) in R) for t in range(n) if t not in tau)
    else:
        prob += sum(C) + pulp.lpSum(CR[i] * v for (t, i), v in R.items())
    return Model(prob, R, S, SO, SI, SF, FREE, U, tau, q, cu, B, swap,
                 meta={"memory_units_budget": B, "variables": len(prob.variables()),
                       "constraints": len(prob.constraints), "quantised": quantised, "M": M, "W": W, "P": P})


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
    members, op_of = graph.op_members, graph.op_of
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
                op = members.get(op_of[i])
                if op is None:
                    if i != t and i not in nxt and not any(k in R[t] and k > i for k in succs[i]):
                        R[t].discard(i)
                        changed = True
                elif i == op[0] and op[-1] < t and all(
                        m not in nxt and not any(k in R[t] and op_of[k] != i for k in succs[m]) for m in op):
                    R[t].difference_update(op)  # (an op's parts are recomputed together, or not at all)
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


def integral(m: Model, tol: float = 1e-4) -> bool:
    for d in (m.R, m.SO, m.SI, m.SF):
        for v in d.values():
            x = v.varValue
            if x is None or min(abs(x), abs(1 - x)) > tol:
                return False
    return True


__all__ = ["Model", "build_model", "schedule_from_model", "minimal_keep", "set_warm_start", "prune_waste",
           "solve_relaxation", "integral", "memory_scale", "time_unit"]
