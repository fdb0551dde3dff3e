"""Warm starts for the ILP: the baselines' schedules, and the shift search around them.

* `baseline_schedules` runs registered baselines at the budget; an op-list schedule (DTR's)
  comes cast into frontier-advancing stages (`stages_from_ops`) and pruned of waste so that it
  can seed the stage model, and, when asked, also as the bare op list (which the cast can push
  over the budget).  `best_baseline` is the fastest that fits.
* `shift_search` is the recompute-only ILP restricted to a seed's recomputations, each allowed
  in its own stage or `SHIFTS` stages later (no other R is created): a neighbourhood far smaller
  than the full model, which repairs a seed that peaks a little above the budget (a value
  prepared in the stage before its consumer costs memory there; recomputed in the consumer's
  stage it does not).  On a unit chain, revolve with one more snapshot than fits, shifted, is
  exactly the optimum (tests/test_ilp.py).  `near_seeds` gives it seeds from the baselines run at
  `SEED_SLACK` looser budgets, and `searched_warm_start` keeps the best of both.
"""
from __future__ import annotations

import logging
import math
import time as _time

from remat.core.errors import InfeasibleBudgetError, InvalidInputError, SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule, stages_from_ops
from remat.core.simulate import simulate
from remat.solvers import baselines, chen, dtr, griewank, registry  # noqa: F401  (the baselines register here)

from . import mip
from .checkmate import build_model, integral, prune_waste, schedule_from_model

log = logging.getLogger(__name__)

# the baselines that seed the exact ILP, in the order they are tried
WARM_START_SOLVERS = ("checkpoint-all", "chen-greedy", "griewank", "chen-sqrtn", "checkpoint-last-node",
                      "dtr-eq", "dtr", "lookahead")
SEED_SLACK = (0.0, 0.125, 0.25)  # looser budgets (activation bytes x (1 + slack)) the shift search's seeds run at
SHIFTS = (0, 1)                  # stages a seed's recomputation may move by
WARM_SEARCH_SHARE = 0.2          # of the exact solve's time limit, spent on shift searches for its warm start
SHIFT_SEARCH_S = 10.0            # per shift search when the solve has no time limit


def baseline_schedules(graph: Graph, budget_bytes: int, solvers: tuple = WARM_START_SOLVERS, *,
                       op_lists: bool = False, skip_above: dict | None = None):
    """(name, schedule) for each of `solvers` that runs at `budget_bytes`, in that order.  An
    op-list schedule (DTR's) comes cast into stages (`stages_from_ops`) and pruned of waste, so
    that it can seed the ILP; with `op_lists` also as the bare op list (``name + " (op list)"``),
    which the stage cast can push over the budget.  Whether a schedule fits is for the caller to
    check.  `skip_above`: solver name -> the node count above which it is too slow to run."""
    for nm in solvers:
        if nm not in registry.names() or graph.n > (skip_above or {}).get(nm, graph.n):
            continue
        try:
            sch = registry.get(nm)(graph, budget_bytes)
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
    or `shifts` stages later (module docstring): a neighbourhood far smaller than the full model,
    which keeps the best of the seed's variants.  Returns the schedule if it fits, else None; its
    bound is not the graph's.  The limit covers the call: building the model comes off it."""
    t0 = _time.perf_counter()
    support = {(t + d, i) for t, st in enumerate(seed.stages or []) for i in st.compute if i != t for d in shifts}
    support = {(t, i) for t, i in support if i < t < graph.n}
    m = build_model(graph, budget_bytes, swap=False, bandwidth=bandwidth, recompute_backward=recompute_backward,
                    r_support=support, name="remat_shift")
    # (quantised memory rounds sizes up: still a restriction whose schedules fit in exact bytes)
    # no MIP start: CBC started from the seed tends to stay there (and would run under a CPU-time
    # limit); docs/results.md, "Figures behind the solvers' constants"
    left = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
    out = mip.run(m, backend, left, 0.0, threads, False, False)
    if out["sol_status"] not in (1, 2) or out["objective"] is None or not integral(m):
        return None
    sched = schedule_from_model(graph, m)
    res = simulate(graph, sched, bandwidth)
    return sched if res.valid and res.peak_bytes <= budget_bytes else None


__all__ = ["WARM_START_SOLVERS", "baseline_schedules", "best_baseline", "near_seeds", "searched_warm_start",
           "shift_search", "SEED_SLACK", "SHIFTS"]
