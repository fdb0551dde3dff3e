"""The ILP: Checkmate's rematerialization model with swapping, proven optimal or reported with
its incumbent, lower bound and gap.

``solve(graph, budget_bytes, mode="auto")`` is the registered ``ilp`` solver: the exact model on
the whole graph (`exact`) up to `scalable.AUTO_THRESHOLD` nodes, the scalable mode (`scalable`)
above.  The package's modules, bottom up (imports go one way):

* `mip`: solving a PuLP model with CBC or HiGHS (watchdog, live log, MIP starts, interrupts) and
  reading honestly what the solver proved;
* `checkmate`: the model (variables, constraint families, time model) and its read-back;
* `warm`: baseline warm starts and the shift search;
* `paths`, `instant`, `windows`, `bounds`: the instant IP (a relaxation kept at first computes)
  with its path rows, the split and coupled bounds over its windows, and the cheaper bounds
  (moment knapsack, window IP);
* `exact`: the exact mode's phases; `coarsen`: coarsening and expansion; `worker`: the instant IP
  step in a process of its own; `scalable`: the scalable mode's steps.

docs/solvers.md has the math of each in one place.
"""
from __future__ import annotations

from typing import Callable

from remat.core.errors import InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Schedule
from remat.solvers.registry import register

from . import exact, scalable
from .checkmate import (Model, build_model, integral, minimal_keep, prune_waste, schedule_from_model, set_warm_start,
                        solve_relaxation)
from .exact import min_feasible_budget
from .mip import cbc_limit_within, highs_available, highs_ready, parse_cbc_log
from .warm import baseline_schedules, best_baseline, near_seeds, searched_warm_start, shift_search

MODES = ("auto", "exact", "scalable")


@register("ilp", "Checkmate's ILP with keep/recompute/swap (CBC; proven optimal or reports its gap)", parts=True)
def solve(graph: Graph, budget_bytes: int, *, swap: bool = True, time_limit: float | None = 60.0,
          gap: float = 0.0, threads: int | None = None, backend: str = "cbc", warm_start: bool = True,
          bandwidth: float | None = None, max_memory_units: int = 1_000_000, msg: bool = False,
          recompute_backward: bool = False, progress: Callable[[dict], None] | None = None,
          mode: str = "auto", use_instant_ip: bool = True, **options: object) -> Schedule:
    """Optimal schedule under `budget_bytes` (whole-step bytes, fixed bytes included).

    On a graph whose ops have several parts (`remat.core.graph`) both modes plan the parts (each
    tensor freed at its own last use); ``parts="merged"`` makes the scalable mode plan the merged
    graph and expand its plan instead (`remat.solvers.parts`; for comparison).

    `time_limit` bounds the call; `gap` (relative) lets the search stop early; `progress(dict)`
    receives incumbent, lower bound and gap while the solver runs.  `mode`: "exact" (`exact.solve`:
    the model on the whole graph), "scalable" (`scalable.solve`: coarsen, solve, expand, refine;
    a bound for the whole graph) or "auto" (scalable above `scalable.AUTO_THRESHOLD` nodes).
    `use_instant_ip=False` skips the instant IP.  The other options are the modes' own.
    """
    if mode not in MODES:
        raise InvalidInputError(f"--mode: expected 'auto', 'exact' or 'scalable', got {mode!r}")
    if mode == "scalable" or (mode == "auto" and graph.n > scalable.AUTO_THRESHOLD):
        if graph.has_parts and options.pop("parts", "native") == "merged":  # (`remat.solvers.parts`)
            from remat.solvers.parts import solve_merged
            return solve_merged(scalable.solve, graph, budget_bytes, swap=swap, time_limit=time_limit, gap=gap,
                                threads=threads, backend=backend, bandwidth=bandwidth,
                                recompute_backward=recompute_backward, progress=progress, msg=msg,
                                use_instant_ip=use_instant_ip, **options)
        return scalable.solve(graph, budget_bytes, swap=swap, time_limit=time_limit, gap=gap, threads=threads,
                              backend=backend, bandwidth=bandwidth, recompute_backward=recompute_backward,
                              progress=progress, msg=msg, use_instant_ip=use_instant_ip, **options)
    return exact.solve(graph, budget_bytes, swap=swap, time_limit=time_limit, gap=gap, threads=threads,
                       backend=backend, warm_start=warm_start, bandwidth=bandwidth,
                       max_memory_units=max_memory_units, msg=msg, recompute_backward=recompute_backward,
                       progress=progress, use_instant_ip=use_instant_ip)


__all__ = ["solve", "MODES", "Model", "build_model", "schedule_from_model", "minimal_keep", "set_warm_start",
           "prune_waste", "solve_relaxation", "integral", "min_feasible_budget", "highs_available", "highs_ready",
           "parse_cbc_log", "cbc_limit_within", "baseline_schedules", "best_baseline", "near_seeds",
           "searched_warm_start", "shift_search"]
