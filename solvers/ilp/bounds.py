r"""Lower bounds on the step time that need no instant IP: the moment knapsack and the window IP.

Both hold for every schedule whose backward nodes run once (the ILP's default model).  The
instants are those of `remat.core.analysis` (node t computed for the first time).

Moment knapsack (`knapsack_bound`, recompute only).  At instant t every value v < t that a node
after t reads is either resident or computed again later (cost C_v each, its recompute time;
without swap there is no third way, and a backward value or the loss cannot be recomputed, so it
must be resident).
Resident bytes at that instant are at most cap_t = B - fixed - forced_t (`forced_loads`: t's
output, workspace, forward inputs P_t and the gradients alive across t), so the recomputation
still to come costs at least

    min { sum_{v in N_t \ K} C_v : P_t subset of K, sum_{v in K} M_v <= cap_t },

which the fractional knapsack bounds from below.  Every schedule pays it, so total_time + max_t
of it is a lower bound.  When even the forced residents do not fit, no schedule exists (None).

Window IP (`window_bound`, with or without swap).  Cut each forward value's life at its program
uses; a value absent at any instant strictly inside such a window is brought back before the
window's use, and the windows of one value are disjoint, so each window with an absence costs
the value's compute time once (or, with swap, a copy from the host).  One binary per (value,
use), one row per instant; proof in `window_bound`'s docstring.  It dominates the knapsack (one
instant's row, solved fractionally) and is integral where the LP is not; it ignores that a
recomputation needs its own inputs.

Closure IP (`closure_bound`, with or without swap).  At instants t_1 < ... < t_m, k[i,v] = 1 iff
forward value v < t_i is resident at t_i, r[i,v] = 1 iff v is computed again in the interval
after t_i (up to t_{i+1}, or to the step's end), h[i,v] likewise for a host copy coming back
(swap).  A value read in interval i (t_i's inputs aside, resident by force) was resident at t_i or
comes back in it: k[i,v] + r[i,v] + h[i,v] >= 1.  What is resident at t_i was resident at
t_{i-1} or came back in between: k[i,v] <= k[i-1,v] + r[i-1,v] + h[i-1,v].  The first
recomputation of v in interval i finds each forward input u resident, which it was since t_i or
because it came back before: r[i,v] <= k[i,u] + r[i,u] + h[i,u].  Resident bytes at t_i fit
cap_{t_i} as above.  Each r is a distinct computation (one per value and interval), so every
schedule pays total_time + sum C_v r[i,v] at least on the compute stream (with swap, one copy
out per value and one per copy back on the transfer stream, the step at least the longer), and
the IP's optimum, or CBC's bound on it, is a lower bound.  It is the instant IP's model at m
instants with the intervals between them merged (a relaxation of it): a few hundred binaries per
instant where the instant IP has hundreds of thousands on a real model's joint graph.  It sees
what the window IP does not: rebuilding a value the backward reads may need values it never
reads (an attention block's scores before its softmax), each rebuilt too where it was not kept.
`closure_bound` solves it at each of the instants where the moment knapsack leaves the most to
recompute (where the knapsack leaves nothing, so does it) and at those instants together.  On
transformers' GPT-2 124M at batch 8 at checkpointing's peak it raises the bound from 1.09x to
1.26x of the step (docs/results.md, "Real models at full size").
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pulp

from remat.core.analysis import forced_loads
from remat.core.errors import SolverError
from remat.core.graph import Graph

from . import mip
from .checkmate import time_unit

WINDOW_IP_S = 10.0  # CBC's limit on the window IP (it solves in well under a second on the zoo graphs)
CLOSURE_IP_S = 10.0  # CBC's limit on the closure IPs, all instants together
CLOSURE_INSTANTS = 4  # the closure IP at this many instants, those the knapsack leaves the most to recompute at


def knapsack_bound(graph: Graph, budget_bytes: int) -> float | None:
    """Lower bound on the recompute-only time (module docstring), or None when some instant
    cannot hold what it must (the budget is infeasible)."""
    extra = instant_extras(graph, budget_bytes)
    return None if extra is None else graph.total_time + max(extra, default=0.0)


def instant_extras(graph: Graph, budget_bytes: int) -> list[float] | None:
    """At each instant t, the moment knapsack's recomputation still to come (module docstring);
    None when some instant cannot hold what it must."""
    n = graph.n
    cap0 = budget_bytes - graph.fixed_bytes
    last_use = [max(s, default=-1) for s in graph.succs]
    C = graph.recompute_times
    M = graph.sizes
    # t's output, workspace and inputs, and the gradients and loss still to be read (never
    # recomputed) must be resident
    forced = forced_loads(graph)
    out = []
    for t in range(n):
        need = set(graph.preds[t])
        cap = cap0 - forced[t]
        items = [(C[v], M[v]) for v in range(t)
                 if v not in need and last_use[v] > t and graph.nodes[v].kind == "forward"]
        if cap < 0:
            return None
        total = sum(c for c, _ in items)
        # fractional knapsack: keep the most time per byte
        kept = 0.0
        room = float(cap)
        for c, m in sorted(items, key=lambda cm: -(cm[0] / cm[1]) if cm[1] > 0 else -math.inf):
            if m <= room:
                kept += c
                room -= m
            else:
                kept += c * room / m
                break
        out.append(total - kept)
    return out


def window_bound(graph: Graph, budget_bytes: int, time_limit: float | None = WINDOW_IP_S,
                 threads: int | None = None, *, swap: bool = False, bandwidth: float | None = None) -> float | None:
    """Lower bound on the step time (backward values never recomputed nor swapped, as in the ILP's
    default model) from the *window IP*, an integer program over every instant at once; None
    when CBC gives no bound.

    The instants are those of the knapsack bound (node t computed for the first time; a
    frontier-advancing schedule, staged or an op list in program order, runs first computes in
    id order).  Cut each forward value v's life at its program uses u_1 < u_2 < ...: window
    (v, u_j) is the instants strictly between u_{j-1} (or v) and u_j.  At u_{j-1} and u_j
    themselves v is an input, hence resident.  If v is absent at some instant of a window, it is
    brought back between that instant and u_j, i.e. inside the window's span, by a computation
    or (with swap) a copy from the host; spans of one value are disjoint, so these events are
    distinct.  With z[v,u] = 1 iff v is absent somewhere in window (v, u), at every instant t the
    values whose window covers t with z = 0 are resident all through it, so
        sum_{(v,u) covers t} M_v (1 - z[v,u]) <= B - fixed - M_t - W_t - M(inputs of t)
                                                   - M(loss/backward values alive across t).
    Recompute only: every schedule pays at least sum C_v z[v,u] on top of one pass, so the
    minimum over binary z under these rows is a lower bound.  With swap, z = zr + zs (brought
    back by a computation or by a host copy): the compute stream still runs one pass plus
    sum C_v zr, and the one transfer stream carries M_v / bandwidth for every host copy brought
    back and for at least one copy out (o_v >= zs[v,u]); the step lasts at least the longer of
    the two, so min T with T >= each is the bound.  Forward values that cost no time are left out
    (free to drop).  CBC's bound is used, so a time-limited run stays valid.

    It dominates the knapsack bound (one instant's row, solved fractionally); it ignores that a
    recomputation needs its own inputs (on a unit chain it stops where the knapsack does)."""
    n = graph.n
    cap0 = budget_bytes - graph.fixed_bytes
    C, M = graph.recompute_times, graph.sizes
    cu = time_unit(graph)
    bw = float(bandwidth if bandwidth is not None else graph.bandwidth)
    unit = math.gcd(*[m for m in M if m > 0]) or 1
    succs = [sorted(set(s)) for s in graph.succs]
    # t's output, workspace and inputs, and the gradients and loss alive across t
    fixed = forced_loads(graph)
    cover: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for v in range(n):
        if M[v] <= 0 or graph.nodes[v].kind != "forward" or C[v] <= 0:
            continue  # holds nothing, is in `fixed`, or can be dropped and rebuilt for free
        prev = v
        for u in succs[v]:
            for t in range(prev + 1, u):
                cover[t].append((v, u))
            prev = u
    if any(f > cap0 for f in fixed):
        return None
    prob = pulp.LpProblem("remat_window", pulp.LpMinimize)
    zr: dict = {}
    zs: dict = {}
    out_once: dict = {}
    for t in range(n):
        load = sum(M[v] for v, _ in cover[t])
        if load + fixed[t] <= cap0:
            continue
        for key in cover[t]:
            if key not in zr:
                zr[key] = pulp.LpVariable(f"zr_{key[0]}_{key[1]}", 0, 1, pulp.LpBinary)
                if swap:
                    zs[key] = pulp.LpVariable(f"zs_{key[0]}_{key[1]}", 0, 1, pulp.LpBinary)
                    if key[0] not in out_once:
                        out_once[key[0]] = pulp.LpVariable(f"o_{key[0]}", 0, 1, pulp.LpBinary)
                    prob.addConstraint(zs[key] <= out_once[key[0]], f"out_before_in_{key[0]}_{key[1]}")
                    prob.addConstraint(zr[key] + zs[key] <= 1, f"one_way_back_{key[0]}_{key[1]}")
        prob.addConstraint(pulp.lpSum((M[v] // unit) * (zr[v, u] + zs.get((v, u), 0)) for v, u in cover[t])
                           >= (load + fixed[t] - cap0) / unit, f"instant_{t}")
    if not zr:
        return graph.total_time
    compute = graph.total_time / cu + pulp.lpSum((C[v] / cu) * x for (v, _), x in zr.items())
    transfer = (pulp.lpSum((M[v] / bw / cu) * x for (v, _), x in zs.items())
                + pulp.lpSum((M[v] / bw / cu) * x for v, x in out_once.items())) if swap else None
    return _streams_bound(graph, prob, compute, transfer, cu, time_limit, threads)


def _streams_bound(graph: Graph, prob: "pulp.LpProblem", compute, transfer, cu: float, time_limit: float | None,
                   threads: int | None) -> float | None:
    """`prob` minimising the step's time, at least the `compute` stream's and (with swap, when
    `transfer` is given) the transfer stream's, in units of `cu` seconds, solved by CBC: the
    bound CBC proves, in seconds and never below one pass over the graph; None without one."""
    if transfer is not None:
        T = pulp.LpVariable("T", 0)
        prob += T
        prob.addConstraint(T >= compute, "compute_stream")
        prob.addConstraint(T >= transfer, "transfer_stream")
    else:
        prob += compute
    try:
        out = mip.run(SimpleNamespace(prob=prob, time_unit=1.0), "cbc", time_limit, 0.0, threads, False, False)
    except SolverError:
        return None
    if out["bound"] is None or out["infeasible"]:
        return None
    return max(graph.total_time, out["bound"] * cu)


def closure_bound(graph: Graph, budget_bytes: int, time_limit: float | None = CLOSURE_IP_S,
                  threads: int | None = None, *, swap: bool = False, bandwidth: float | None = None,
                  instants: int = CLOSURE_INSTANTS) -> float | None:
    """Lower bound on the step time (backward values never recomputed nor swapped, as in the ILP's
    default model) from the *closure IP* (module docstring) at each of the `instants` instants
    where the moment knapsack leaves the most to recompute, and at those instants together; None
    when CBC gives no bound, or when some instant cannot hold what it must.  `time_limit` is
    shared by the IPs (the joint one gets half)."""
    extra = instant_extras(graph, budget_bytes)
    if extra is None:
        return None
    order = _tightest(extra)[:max(1, instants)]
    if not order:
        return graph.total_time
    joint = len(order) > 1
    each = (0.5 if joint else 1.0) / len(order)
    runs = [([t], each) for t in order] + ([(sorted(order), 0.5)] if joint else [])
    best = None
    for at, share in runs:
        value = closure_at(graph, budget_bytes, at, None if time_limit is None else max(1.0, time_limit * share),
                           threads, swap=swap, bandwidth=bandwidth)
        if value is not None and (best is None or value > best):
            best = value
    return best


def _tightest(extra: list[float]) -> list[int]:
    """The instants where the moment knapsack leaves something to recompute, the most first."""
    return sorted((t for t, e in enumerate(extra) if e > 0), key=lambda t: -extra[t])


def spread_closure_bound(graph: Graph, budget_bytes: int, time_limit: float | None, threads: int | None = None, *,
                         swap: bool = False, bandwidth: float | None = None, instants: int = 5,
                         apart: int | None = None) -> float | None:
    """The closure IP at `instants` instants together, spread over the step: the tightest (most
    left to recompute, `instant_extras`) first, each next one the tightest at least `apart`
    instants from those chosen (default n / 20), so that the IP couples distant parts of the
    step (a value dropped in the forward and wanted in the backward).  None as `closure_at`."""
    extra = instant_extras(graph, budget_bytes)
    if extra is None:
        return None
    apart = max(1, graph.n // 20) if apart is None else apart
    chosen: list[int] = []
    for t in _tightest(extra):
        if all(abs(t - u) >= apart for u in chosen):
            chosen.append(t)
            if len(chosen) == instants:
                break
    if not chosen:
        return graph.total_time
    return closure_at(graph, budget_bytes, chosen, time_limit, threads, swap=swap, bandwidth=bandwidth)


def closure_at(graph: Graph, budget_bytes: int, instants: "int | list[int]", time_limit: float | None = None,
               threads: int | None = None, *, swap: bool = False, bandwidth: float | None = None) -> float | None:
    """The closure IP's bound at one instant, or at several together (module docstring): None
    when CBC gives none or an instant cannot hold what it must."""
    ts = sorted(set([instants] if isinstance(instants, int) else instants))
    C, M = graph.recompute_times, graph.sizes
    forced = forced_loads(graph)
    caps = [budget_bytes - graph.fixed_bytes - forced[t] for t in ts]
    if min(caps) < 0:
        return None
    succs = [sorted(set(x)) for x in graph.succs]

    def stored(v: int) -> bool:
        return graph.nodes[v].kind == "forward" and M[v] > 0
    # per instant: the values read after it, and what rebuilding them may read (resident at the
    # instant, or rebuilt after it)
    vals: list[set] = []
    for t in ts:
        seen, stack = set(), [v for v in range(t) if stored(v) and succs[v] and succs[v][-1] > t]
        while stack:
            v = stack.pop()
            if v not in seen:
                seen.add(v)
                stack.extend(u for u in graph.preds[v] if stored(u) and u not in seen)
        vals.append(seen)
    for i in range(len(ts) - 1, 0, -1):   # what is wanted at an instant was there at the one before, or came back
        vals[i - 1] |= {v for v in vals[i] if v < ts[i - 1]}
    if not any(vals):
        return graph.total_time
    cu = time_unit(graph)
    bw = float(bandwidth if bandwidth is not None else graph.bandwidth)
    unit = math.gcd(*[M[v] for vs in vals for v in vs])
    prob = pulp.LpProblem("remat_closure", pulp.LpMinimize)
    k: dict = {}
    r: dict = {}
    h: dict = {}
    for i, (t, vs) in enumerate(zip(ts, vals)):
        need = set(graph.preds[t])
        for v in vs:
            k[i, v] = 1 if v in need else pulp.LpVariable(f"k_{i}_{v}", 0, 1, pulp.LpBinary)
            r[i, v] = pulp.LpVariable(f"r_{i}_{v}", 0, 1, pulp.LpBinary)
            if swap:
                h[i, v] = pulp.LpVariable(f"h_{i}_{v}", 0, 1, pulp.LpBinary)

    def back(i: int, v: int):   # resident at instant i, or brought back in the interval after it
        return k[i, v] + r[i, v] + h.get((i, v), 0)
    for i, (t, vs) in enumerate(zip(ts, vals)):
        end = ts[i + 1] if i + 1 < len(ts) else graph.n
        for v in vs:
            if any(t < u <= end for u in succs[v]):
                prob.addConstraint(back(i, v) >= 1, f"read_{i}_{v}")
            if i > 0 and v < ts[i - 1] and not isinstance(k[i, v], int):
                prob.addConstraint(k[i, v] <= back(i - 1, v), f"kept_{i}_{v}")
            for u in set(graph.preds[v]) & vs:
                prob.addConstraint(r[i, v] <= k[i, u] + r[i, u] + h.get((i, u), 0), f"rebuild_{i}_{v}_{u}")
        prob.addConstraint(pulp.lpSum((M[v] // unit) * k[i, v] for v in vs if not isinstance(k[i, v], int))
                           <= caps[i] // unit, f"memory_{i}")
    compute = graph.total_time / cu + pulp.lpSum((C[v] / cu) * x for (_, v), x in r.items())
    transfer = None
    if swap:
        out_once = {v: pulp.LpVariable(f"o_{v}", 0, 1, pulp.LpBinary) for _, v in h}
        for (i, v), x in h.items():
            prob.addConstraint(x <= out_once[v], f"out_before_in_{i}_{v}")
        transfer = (pulp.lpSum((M[v] / bw / cu) * x for (_, v), x in h.items())
                    + pulp.lpSum((M[v] / bw / cu) * x for v, x in out_once.items()))
    return _streams_bound(graph, prob, compute, transfer, cu, time_limit, threads)


__all__ = ["closure_at", "closure_bound", "spread_closure_bound", "instant_extras", "knapsack_bound", "window_bound", "CLOSURE_IP_S",
           "CLOSURE_INSTANTS", "WINDOW_IP_S"]
