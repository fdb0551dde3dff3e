r"""Bounds over windows of the instant IP: the split at tight instants and the coupled windows.

Split at tight instants (`split_bound`, recompute only)
-----------------------------------------------------
Cut the instants at s_1 < ... < s_k and give each window (s_i, s_{i+1}] its own model: the
instant IP over instants s_i..s_{i+1} (`instant.build(window=...)`), whose residents at s_i are
free but for s_i's inputs and the memory row there, charged only the recomputation of its
intervals.  A schedule's solution, cut to a window's variables, satisfies every row the window
keeps (each is a row of the whole model), and the windows' intervals are disjoint, so the sum of
the windows' optima (or of their solvers' bounds) plus one pass over the graph is a lower bound.
What the cuts lose is what each window's free start could not really have had; at an instant
where what must be resident leaves little room, the start is nearly forced and little is lost,
while each small window is solved to optimality where the whole model's branching stalls.
The candidates are the `SPLIT_MOST` backward instants with the least room (at most
`SPLIT_ROOM` of the budget's; `split_candidates`); the first window ends at the earliest, and a
longest path over the windows between the candidates (all pairs, each solved on its own) picks
the later cuts, so a loose candidate costs nothing but its solve.

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
are added each round (to the master too).  What it gains over the split: the second window's
free start may hold large values that the first window's LP is charged for holding.

In the scalable mode's limit (`couple_split`, after the split): e = the split's tightest point
(least room beyond what every schedule holds; the earliest of equals), c = the latest instant
whose window (c, e] has at least `COUPLE_W2_VARS` variables (`couple_cut`), the split's best
windows from e on kept.  Each pricing gets `COUPLE_PRICE_S` (unproven: its bound is what counts)
and W1 `COUPLE_SPLIT_PATH_ROUNDS` rounds of path rows.  On small graphs, whose split windows are
proven, W1's LP can be weaker than the split's first windows: the caller keeps the best bound.
(Figures: docs/results.md, "Certificates".)
"""
from __future__ import annotations

import logging
import math
import time as _time

import pulp

from remat.core.analysis import free_room, horizons
from remat.core.errors import SolverError
from remat.core.graph import Graph

from . import instant, mip, paths

log = logging.getLogger(__name__)

SPLIT_MOST = 5      # split candidates: at most this many backward instants,
SPLIT_ROOM = 0.3    # each with at most this share of the budget's room beyond what it must hold
SPLIT_FIRST = 0.6   # of split_bound's time, what the first window (the largest) may take at most
COUPLE_EPS = 1e-6   # coupled_bound: converged when the bound is within this share of the master's value
COUPLE_PATH_ROUNDS = 10  # and W1's Lagrangian LP gets at most this many rounds of path rows each time
COUPLE_W2_VARS = 1500  # couple_split: the second window is the shortest one ending at the split's tightest point
#                        with at least this many P and N variables (smaller ones price too little)
COUPLE_PRICE_S = 5.0   # and each pricing gets this long (unproven, its bound counts; proving one takes far longer)
COUPLE_SPLIT_PATH_ROUNDS = 2  # with this many rounds of W1's path rows per pricing (more cost the pricings' time)


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
    models: dict[tuple[int, int], instant.InstantModel | None] = {}
    for w in windows:
        models[w] = instant.build(graph, budget_bytes, window=w)
        if models[w] is None:  # (what some instant must hold does not fit: no schedule at all)
            return None
    weight = {w: len(models[w].N) for w in windows}
    got = {w: (0.0, not models[w].N) for w in windows}  # window -> (recompute bound, proven)

    def solve_window(w: tuple[int, int], limit: float | None) -> None:
        m = instant.build(graph, budget_bytes, window=w) if models[w] is None else models[w]
        models[w] = None  # (a model solved once is rebuilt for a second solve)
        limit = paths.path_rows_within(graph, m, limit, least=0.2)
        try:
            out = mip.run(m, backend, limit, 0.0, threads, False, False)
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

    def longest() -> dict[int, tuple[float, list]]:  # from each point, the longest path to the end
        path: dict[int, tuple[float, list]] = {graph.n - 1: (0.0, [])}
        for a in reversed(points):
            path[a] = max(((got[a, b][0] + path[b][0], [(a, b)] + path[b][1]) for b in ends if b > a),
                          key=lambda x: x[0])
        return path

    def best_cuts(path: dict | None = None) -> tuple[float, list[tuple[int, int]]]:  # the longest path from 0
        path = longest() if path is None else path
        return got[head][0] + path[points[0]][0], [head] + path[points[0]][1]

    def unproven_on_best() -> list[tuple[int, int]]:
        return [w for w in best_cuts()[1] if not got[w][1] and w != head]

    tails = sorted((w for w in windows[1:] if not got[w][1]), key=lambda w: weight[w])  # the small ones first
    share_out(tails, None if time_limit is None else (1 - SPLIT_FIRST) * time_limit / 2)
    if not got[head][1]:  # (all that is left when no other window of the best cuts is open)
        share_out([head], None if time_limit is None else
                  min(left(), SPLIT_FIRST * time_limit) if unproven_on_best() else left())
    if unproven_on_best() and (left() is None or left() > 1.0):
        # everything left in one solve each (a second solve starts from scratch, and a hard window
        # may need all of it)
        share_out(unproven_on_best(), left())
    path = longest()
    value, chosen = best_cuts(path)
    log.info("split bound: windows %s (%.1f s)",
             [(a, b, round(got[a, b][0] / graph.total_time, 4), got[a, b][1]) for a, b in chosen],
             _time.perf_counter() - t0)
    return {"bound": graph.total_time + value, "cuts": [a for a, _ in chosen[1:]],
            "windows": [(a, b, got[a, b][0], got[a, b][1]) for a, b in chosen],
            "proven": all(got[w][1] for w in chosen),
            "tails": {a: tail for a, (tail, _) in path.items()}}


def coupled_bound(graph: Graph, budget_bytes: int, cut: int, end: int, *, time_limit: float | None = 300.0,
                  price_limit: float = 60.0, rounds: int = 30, backend: str = "highs",
                  threads: int | None = None, path_rounds: int = COUPLE_PATH_ROUNDS) -> dict | None:
    """The bound of "Coupled windows" on the recomputation in the intervals 1..`end` (the windows
    (0, `cut`] and (`cut`, `end`] coupled through the residents at `cut`): {"bound": seconds,
    "master": seconds (the last master LP's value: what more columns alone could reach at most),
    "rounds": pricings run, "converged": the bound met the master}.  Each round solves W2's IP
    (`backend`) for up to `price_limit` seconds, within what is left of `time_limit` (W1's LP
    and rows after it may run past it by seconds).  None without
    highspy (the master and W1's Lagrangian LP are HiGHS models in memory) or when a window cannot
    hold what it must."""
    if not mip.highs_available() or not 0 < cut < end < graph.n:
        return None
    t0 = _time.perf_counter()

    def left() -> float | None:
        return None if time_limit is None else time_limit - (_time.perf_counter() - t0)

    m1 = instant.build(graph, budget_bytes, window=(0, cut))
    m2 = instant.build(graph, budget_bytes, window=(cut, end))
    if m1 is None or m2 is None:
        return None
    # (W1 is only ever an LP here, where every tight row helps; W2 is an IP, with the usual rule)
    paths.add_path_rows(graph, m1, time_limit=None if time_limit is None else 0.1 * time_limit, keep_gain=0.0)
    paths.add_path_rows(graph, m2, time_limit=None if time_limit is None else 0.05 * time_limit)
    shared = sorted({v for t, v in m1.P if t == cut} & {v for t, v in m2.P if t == cut})
    lag = paths.Relaxation(m1)  # W1's Lagrangian LP
    master = paths.highs_lp(m1)  # (the same columns in the same order: var.index)
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
            rows = [] if i == path_rounds else [row for row in paths.path_rows(graph, m1, x) if lag.add(row)]
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
            out = mip.run(m2, backend, price_limit if left() is None else min(price_limit, left()), 0.0,
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


__all__ = ["split_candidates", "split_bound", "coupled_bound", "couple_split", "couple_cut", "window_size",
           "SPLIT_MOST", "SPLIT_ROOM", "SPLIT_FIRST", "COUPLE_W2_VARS", "COUPLE_PRICE_S", "COUPLE_SPLIT_PATH_ROUNDS"]
