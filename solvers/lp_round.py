"""LP relaxation (a lower bound) and Checkmate's two-phase rounding (docs/references.md, "Checkmate").

`lower_bound` solves the LP relaxation of the ILP's model (`ilp.checkmate`) at the given budget: no
schedule that fits can be faster, so it is the bound every plan reports against.

`solve` is Checkmate's approximation: solve the relaxation at a reduced budget (0.9 B: slack for
rounding), round S with several thresholds (0.1 .. 0.9) and with randomized rounding
(S_ti ~ Bernoulli(S*_ti)), rebuild the minimal R for each rounded S (`solve_r_opt`), simulate,
and keep the fastest schedule that fits B.  Rounding is recompute-only (swap decisions of the
relaxation are dropped), as in Checkmate.
"""
from __future__ import annotations

import math
import random
import time as _time


from remat.core.analysis import check_budget
from remat.core.errors import InfeasibleBudgetError, SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule
from remat.core.simulate import simulate

from .registry import register
from .ilp.checkmate import solve_relaxation


def lower_bound(graph: Graph, budget_bytes: int, *, swap: bool = True, bandwidth: float | None = None) -> float | None:
    """Time of the LP relaxation at `budget_bytes` (seconds), or None if even the LP is infeasible."""
    check_budget(graph, budget_bytes)
    return solve_relaxation(graph, budget_bytes, swap=swap, bandwidth=bandwidth)[1]


@register("lp-round", "Checkmate's LP relaxation with two-phase rounding; reports the LP bound")
def solve(graph: Graph, budget_bytes: int, *, swap: bool = True, bandwidth: float | None = None,
          slack: float = 0.9, draws: int = 50, seed: int = 0, **_: object) -> Schedule:
    t0 = _time.perf_counter()
    check_budget(graph, budget_bytes)
    bound = lower_bound(graph, budget_bytes, swap=swap, bandwidth=bandwidth)
    if bound is None:
        raise InfeasibleBudgetError(
            f"no schedule fits the budget of {budget_bytes} bytes (even the LP relaxation is infeasible)",
            budget_bytes, fixed_bytes=graph.fixed_bytes)
    best: tuple[float, Schedule] | None = None
    tried = 0
    for frac in (slack, 1.0):
        reduced = graph.fixed_bytes + int((budget_bytes - graph.fixed_bytes) * frac)
        try:
            m, val = solve_relaxation(graph, reduced, swap=False, bandwidth=bandwidth)
        except InfeasibleBudgetError:
            continue
        if val is None:
            continue
        frac_S = {key: (v.varValue or 0.0) for key, v in m.S.items()}
        rng = random.Random(seed)
        roundings = [lambda x, th=th: x >= th - 1e-9 for th in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)]
        roundings += [lambda x: rng.random() < x for _ in range(draws)]
        for rnd in roundings:
            S = [set() for _ in range(graph.n)]
            for (t, i), x in frac_S.items():
                if rnd(x):
                    S[t].add(i)
            sched = Schedule.from_sets(graph, S)
            res = simulate(graph, sched, bandwidth)
            tried += 1
            if res.valid and res.peak_bytes <= budget_bytes and (best is None or res.time < best[0]):
                best = (res.time, sched)
        if best is not None:
            break
    if best is None:
        raise InfeasibleBudgetError(
            f"lp-round: no rounding of the LP relaxation fits {budget_bytes} bytes; try --solver ilp",
            budget_bytes, fixed_bytes=graph.fixed_bytes)
    time_, sched = best
    gap = max(0.0, (time_ - bound) / time_) if time_ > 0 else 0.0
    sched.report = {"name": "lp-round", "status": "optimal" if gap <= 1e-9 else "feasible",
                    "objective": time_, "lower_bound": bound, "gap": gap, "roundings": tried,
                    "wall_time": _time.perf_counter() - t0}
    if not math.isfinite(time_):  # pragma: no cover
        raise SolverError("lp-round produced no finite schedule")
    return sched
