"""Planning: ``remat.plan(graph, budget)`` parses the budget, runs a registered solver, replays
its schedule in the simulator and returns a `remat.core.plan.Plan`; ``sweep`` does it for many
(budget, solver) pairs; ``explain_infeasible`` turns a solver's "no schedule fits" into a message
that names the smallest feasible budget found.

A solver's schedule is always checked here: invalid or over the budget is a `SolverError` (a
bug in the solver), never a plan.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from remat.core import compiled, native
from remat.core.analysis import node_need
from remat.core.errors import InfeasibleBudgetError, InvalidInputError, RematError, SolverError
from remat.core.graph import Graph
from remat.core.plan import SOLVER_KEYS, Plan, is_plain, predicted_from
from remat.core.schedule import Schedule
from remat.core.simulate import SimResult, simulate
from remat.core.units import format_bytes, format_bytes_exact

from .budget import baseline_peak, is_relative, parse_budget

log = logging.getLogger(__name__)

# seconds the ILP gets to find the smallest feasible budget when a solver reports infeasibility
MIN_BUDGET_TIME_LIMIT = 10.0


def plan(graph: "Graph | str | Path", budget: "str | int", solver: str = "ilp", *, swap: bool | None = None,
         time_limit: float = 60.0, gap: float = 0.0, explain: bool = True, executor: str = "any",
         starts: Sequence = (), **options: Any) -> Plan:
    """Plan `graph` (a Graph or a path to a graph.json) to fit `budget` with the named solver.

    `budget` is anything `parse_budget` reads (``"6GiB"``, ``"0.5x"``, bytes).  ``swap``
    (None: `default_swap`), ``time_limit`` (seconds), ``gap`` (relative) and the other
    ``options`` (``threads``, ``backend``, ``warm_start``...) go to the solver; strategies that do
    not use an option ignore it.  Raises `InfeasibleBudgetError` naming the smallest feasible
    budget found when no schedule fits (``explain=False``: the solver's own error, without the
    search for that budget; for callers that probe many budgets), `InvalidInputError` for a bad
    budget or solver name.  ``executor="native"``: a plan in the native class
    (`remat.core.native`, what ``remat.apply(..., executor="native")`` runs in the model's own
    code), `native_plan`; there a relative budget is a fraction of the larger of the graph's
    keep-all peak and that schedule's peak natively (the model's returned outputs held to the
    step's end, as the loop's ``out`` holds them), so ``"1x"`` keeps everything.
    ``executor="compiled"``: a program of the compiled class (`compiled_plan`); `starts` are
    further tag sets (each a collection of node names) its search fits from beside the solver's.
    """
    if executor not in EXECUTORS:
        raise InvalidInputError(f"executor: expected one of {EXECUTORS}, got {executor!r}")
    if starts and executor != "compiled":
        raise InvalidInputError("starts: tag sets to fit from are for executor='compiled' only")
    if not isinstance(graph, Graph):
        graph = Graph.load(graph)
    graph = _with_bandwidth(graph, options)
    swap = default_swap(graph, solver) if swap is None else swap
    # natively "1x" keeps everything: plain autograd in the model's own loop (which holds the
    # returned outputs, and lets incoming gradients go inside a module's backward) or the graph's
    # own keep-all peak, which the solvers plan against, whichever is larger
    base = max(native.native_peak(graph, Schedule.keep_all(graph)), baseline_peak(graph)) \
        if executor == "native" and is_relative(budget) else None
    budget_bytes = parse_budget(budget, graph, base)
    try:
        schedule, res, wall = _solve(graph, budget_bytes, solver, explain, swap=swap, time_limit=time_limit,
                                     gap=gap, **options)
    except (SolverError, InfeasibleBudgetError) as e:
        # (the solver found nothing, where a schedule fits, or where the class's programs hold
        # less than its schedules: the compiled class's own starts may)
        if executor != "compiled" or (isinstance(e, InfeasibleBudgetError) and not compiled.beyond_schedules(graph)
                                      and (e.min_feasible_bytes is None or e.min_feasible_bytes > budget_bytes)):
            raise
        schedule, wall, why = None, time_limit, str(e)
    extra: dict = {}
    if executor == "compiled":
        solved_time = None if schedule is None else res.time
        schedule, res, wall, extra = compiled_plan(graph, budget_bytes, schedule, solved_time, wall,
                                                   why if schedule is None else "", starts)
    if executor == "native":
        schedule, res, wall, extra = native_plan(graph, budget_bytes, solver, schedule, wall, swap=swap,
                                                 time_limit=time_limit, gap=gap, **options)
    report = _solver_block(schedule.report, solver, wall,
                           {"swap": swap, "time_limit": time_limit, "gap": gap, **options})
    if executor in ("native", "compiled"):
        report["options"]["executor"] = executor
    schedule.report = dict(report)
    return Plan(graph, schedule, budget_bytes, report, {**predicted_from(graph, res), **extra})


EXECUTORS = ("any", "native", "compiled")
NATIVE_TRIES = 4   # solves at lower budgets until the native schedule fits


def native_plan(graph: Graph, budget_bytes: int, solver: str, schedule: Schedule, wall: float,
                **options: Any) -> tuple[Schedule, SimResult, float, dict]:
    """The solver's `schedule` made native (`remat.core.native.nativize`: nodes the native class
    cannot recompute kept resident instead); where that, with the model's returned outputs held
    to the step's end (`native.native_peak`), is over the budget, the solver again at the
    budget less what nativizing added to its peak, up to `NATIVE_TRIES` times, until one fits.  The report keeps the first solve's lower bound (every native schedule is a schedule)
    and says "feasible" where the native schedule is slower than the plan it came from.
    Returns (schedule, its simulation, wall seconds, {"native_peak_bytes": ...}).  Raises
    `InvalidInputError` for a graph the native class does not cover, `InfeasibleBudgetError`
    where no try fits."""
    why = native.obstacle(graph, schedule)
    if why is not None and why.startswith("it is a plan of granularity"):
        raise InvalidInputError(f"executor='native': {why}; trace with granularity='module'")
    first = dict(schedule.report or {})
    target, best, tries = budget_bytes, None, []
    for attempt in range(NATIVE_TRIES):
        if attempt:
            t0 = time.perf_counter()
            try:
                schedule, _, _ = _solve(graph, target, solver, False, **options)
            except InfeasibleBudgetError:
                break
            wall += time.perf_counter() - t0
        sched, kept = native.nativize(graph, schedule)
        res = simulate(graph, sched)
        ok = res.valid and native.obstacle(graph, sched) is None
        peak = native.native_peak(graph, sched) if ok else None
        tries.append({"budget_bytes": target, "native_peak_bytes": peak, "kept": kept})
        if not ok:
            break
        if peak <= budget_bytes:
            best = (sched, res, peak, kept)
            break
        # what nativizing added to the solver's own peak, taken off the budget it is given next
        added = peak - simulate(graph, schedule).peak_bytes
        target = min(target - (peak - budget_bytes), budget_bytes - added)
        if target <= 0:
            break
    if best is None:
        peaks = [t["native_peak_bytes"] for t in tries if t["native_peak_bytes"] is not None]
        closest = f"; the closest peaks at {format_bytes_exact(min(peaks))}" if peaks else ""
        raise InfeasibleBudgetError(
            f"no native schedule found within {format_bytes_exact(budget_bytes)} ({len(tries)} tries{closest}: the "
            "native class keeps glue nodes resident, runs the forward once, and counts the model's returned "
            "outputs to the step's end, as the loop holds them): raise the budget, or apply a plan with "
            "executor='interpreter'", budget_bytes=budget_bytes, min_feasible_bytes=min(peaks) if peaks else None)
    sched, res, peak, kept = best
    report = dict(first)
    if kept or res.time > first.get("objective", res.time) + 1e-12:
        if report.get("status") == "optimal":
            report["status"] = "feasible"
        report["native_note"] = (f"native class: {', '.join(kept)} kept resident (not recomputable natively); "
                                 "the bound is the unconstrained plan's")
    report["native_tries"] = tries
    sched.report = report
    return sched, res, wall, {"native_peak_bytes": peak}


def compiled_plan(graph: Graph, budget_bytes: int, schedule: Schedule | None, solved_time: float | None,
                  wall: float, why: str = "", starts: Sequence = ()) -> tuple[Schedule, SimResult, float, dict]:
    """The fastest program of the compiled class (`remat.core.compiled`: each forward node saved,
    or recomputed once in the backward before its first use) that `compiled.fit` reaches within
    the budget from each of these tag sets: the solver's `schedule` (R = the forward nodes it
    computes after the loss), none, every recomputable node, and `starts` (node names; e.g. what
    PyTorch's own partitioner recomputes, `remat.frontends.compiled.knapsack_sets`).  `fit` adds
    recomputation where a program is over and gives back what the budget does not need; the
    fitted programs are simulated and the one with the least time is kept (ties: the first).
    `schedule` None (the solver found nothing in its time, `why`): the others only;
    `solved_time` is the simulated time of `schedule`.  The report keeps the solver's lower bound
    (every compiled program is a schedule), says "feasible" where the program is slower than the
    solver's schedule, and names the start the program was fitted from.  Returns (the program,
    its simulation, wall seconds, {"recomputed": node names}).  Raises `InfeasibleBudgetError`
    where nothing fits."""
    t0 = time.perf_counter()
    by_name = {v.name: v.id for v in graph.nodes}
    begins = [("the solver's", compiled.recomputed_of(graph, schedule))] if schedule is not None else []
    begins += [("none", set()), ("all", compiled.recomputable(graph))]
    for k, names in enumerate(starts):
        unknown = [x for x in names if x not in by_name]
        if unknown:
            raise InvalidInputError(f"starts[{k}]: no node named {unknown[0]!r} in the graph")
        begins.append((f"start {k}", {by_name[x] for x in names}))
    best, lowest, tried = None, None, []
    for label, begin in begins:
        begin = compiled.normal(graph, begin)
        if begin in tried:
            continue
        tried.append(begin)
        R, low = compiled.fit(graph, begin, budget_bytes)
        lowest = low if lowest is None else min(lowest, low)
        if R is not None:
            sched, res = compiled.program(graph, R)
            if best is None or res.time < best[2].time * (1 - 1e-9):
                best = (label, R, res, sched)
    wall += time.perf_counter() - t0
    if best is None:
        raise InfeasibleBudgetError(
            f"no compiled program found within {format_bytes_exact(budget_bytes)} (the lowest peak reached "
            f"{format_bytes_exact(lowest)}: the partitioner recomputes each forward op at most once, in the backward)"
            ": raise the budget", budget_bytes=budget_bytes, min_feasible_bytes=lowest)
    label, R, res, sched = best
    if schedule is not None:
        report = dict(schedule.report or {})
    else:
        report = {"status": "feasible", "objective": res.time, "lower_bound": None, "gap": None,
                  "compiled_note": f"the solver found nothing ({why})"}
    report["objective"] = res.time
    report["compiled_start"] = label
    if schedule is not None and compiled.beyond_schedules(graph):
        # (its programs' inlined and in-place kernels hold less than the solver's schedules: the
        # solver's bound is not theirs)
        report.update(status="feasible", lower_bound=None, gap=None,
                      compiled_note="compiled class: its inlined and in-place kernels are not in the solver's model, "
                                    "so the solver's bound is not the class's")
    elif schedule is not None and res.time > solved_time * (1 + 1e-9):
        if report.get("status") == "optimal":
            report["status"] = "feasible"
        report["compiled_note"] = "compiled class: the bound is the unconstrained plan's"
    lb = report.get("lower_bound")
    if lb:
        report["gap"] = max(0.0, (res.time - lb) / res.time)
    sched.report = report
    R = compiled.normal(graph, R) - compiled.backward_only(graph)   # (those run once, in the backward)
    return sched, res, wall, {"recomputed": sorted(graph.nodes[v].name for v in R)}


def default_swap(graph: Graph, solver: str) -> bool:
    """Whether a plan swaps when the caller does not say: not for a graph traced on a CPU, whose
    "host" is the same memory (a swap there saves nothing), unless the solver only swaps (tflms);
    yes otherwise (a GPU's graph, a synthetic one)."""
    on_cpu = str(graph.meta.get("device", "")).startswith("cpu")
    if on_cpu and solver != "tflms":
        log.info("the graph was traced on a CPU, whose host memory is the same RAM: planning without swap "
                 "(ask for it with swap=True, or --swap)")
        return False
    return True


def _with_bandwidth(graph: Graph, options: dict) -> Graph:
    """A `bandwidth=` option becomes the graph's own (meta, outside the hash), so the solver,
    the predicted figures and a later `remat simulate` of the saved plan all use the same one."""
    bw = options.pop("bandwidth", None)
    if bw is None:
        return graph
    if not float(bw) > 0:
        raise InvalidInputError(f"bandwidth: must be > 0 bytes/s, got {bw}")
    return Graph(graph.nodes, graph.edges, graph.fixed_bytes, {**graph.meta, "bandwidth": float(bw)})


def _solve(graph: Graph, budget_bytes: int, solver: str, explain: bool = True,
           **options: Any) -> tuple[Schedule, SimResult, float]:
    """Run one solver and check its schedule in the simulator; (schedule, result, wall seconds)."""
    from remat import solvers
    fn = solvers.get(solver)
    t0 = time.perf_counter()
    try:
        schedule = fn(graph, budget_bytes, **options)
    except InfeasibleBudgetError as e:
        if not explain:
            raise
        raise explain_infeasible(graph, budget_bytes, solver, e, swap=options.get("swap", True),
                                 time_limit=options.get("time_limit")) from e
    wall = time.perf_counter() - t0
    res = simulate(graph, schedule)
    if not res.valid:
        raise SolverError(f"solver {solver!r} returned an invalid schedule ({res.violation}); "
                          "this is a bug in the solver, please report it")
    if res.peak_bytes > budget_bytes:
        raise SolverError(f"solver {solver!r} returned a schedule that peaks at {format_bytes_exact(res.peak_bytes)}, "
                          f"over the budget of {format_bytes_exact(budget_bytes)}; this is a bug in the solver")
    return schedule, res, wall


def _solver_block(report: dict, solver: str, wall: float, options: dict) -> dict:
    block: dict[str, Any] = {key: None for key in SOLVER_KEYS}
    block.update(report or {})
    if not block.get("name"):
        block["name"] = solver
    if block.get("wall_time") is None:
        block["wall_time"] = wall
    block.setdefault("options", {k: v for k, v in options.items() if is_plain(v)})
    return block


def explain_infeasible(graph: Graph, budget_bytes: int, solver: str, err: InfeasibleBudgetError,
                       swap: bool = True, time_limit: float | None = None) -> InfeasibleBudgetError:
    """An `InfeasibleBudgetError` whose message names the smallest feasible budget found.

    Uses the solver's own figures when it gave them; otherwise, within `MIN_BUDGET_TIME_LIMIT`
    seconds (or the solve's shorter limit), asks ``remat.solvers.ilp.min_feasible_budget`` where
    its model can be built in that time (its size predicted as the scalable mode predicts it),
    else, or when it fails, the smallest budget a DTR replay fits (bisection) and the baselines'
    smallest peak, with a simple lower bound (the largest single node with its inputs, plus the
    fixed bytes; without swap, also what every schedule holds at some first compute).
    """
    found, bound, source = err.min_feasible_bytes, err.min_feasible_lower_bound, solver
    if found is None:
        limit = MIN_BUDGET_TIME_LIMIT if time_limit is None else max(1.0, min(float(time_limit),
                                                                             MIN_BUDGET_TIME_LIMIT))
        deadline = time.perf_counter() + limit
        try:
            from remat.solvers.ilp import min_feasible_budget, scalable
            build = scalable.BUILD_S_PER_UNIT * scalable.model_units(graph) * (3 if swap else 1)
            if build > 0.5 * limit:
                raise SolverError(f"its model would take about {build:.0f} s to build, over the time for it")
            found, bound = min_feasible_budget(graph, swap=swap, time_limit=limit)
            source = "ilp"
        except (ImportError, RematError) as e:
            log.info("the smallest feasible budget without the ILP (%s): replays and baselines", e)
            found, bound, source = _replay_min_budget(graph, swap, deadline)
    elif source != "ilp" and bound is None:
        bound = _simple_lower_bound(graph)
    out = InfeasibleBudgetError(
        infeasible_message(graph, budget_bytes, solver, int(found), None if bound is None else int(bound), source),
        budget_bytes, int(found), None if bound is None else int(bound), graph.fixed_bytes)
    out.cli_hint = (f"Use --budget {int(found)} or more." if budget_bytes < found
                    else "Use a longer --time-limit, or a larger --budget." if solver.startswith("ilp")
                    else "Use --solver ilp, or a larger --budget for this solver.")
    return out


def infeasible_message(graph: Graph, budget_bytes: int, solver: str, found: int, bound: int | None,
                       source: str) -> str:
    by = "the ILP" if source == "ilp" else source
    what = "parameters, inputs" if graph.meta.get("grads") == "accumulated" else "parameters, gradients, inputs"
    fixed = (f"{format_bytes(graph.fixed_bytes)} of it are fixed ({what}) and no "
             f"schedule can remove them" if graph.fixed_bytes else "none of it is fixed bytes")
    if graph.optimizer_step_bytes:
        fixed += (f"; the optimizer's step needs {format_bytes(graph.optimizer_step_bytes)} more at the step's "
                  "end, beside the gradients")
    if budget_bytes >= found:
        fix = ("give it more time (time_limit), or a larger budget" if solver.startswith("ilp")
               else "plan with the solver 'ilp', or with a larger budget for this solver")
        return (f"solver {solver!r} found no schedule within the budget {format_bytes_exact(budget_bytes)}, "
                f"but {by} found one that needs {format_bytes_exact(found)}: {fix}.")
    if bound is not None and bound >= found:
        need = f"a schedule needs at least {format_bytes_exact(found)} (found by {by}; proven lower bound " \
               f"{format_bytes(bound)})"
    else:
        lb = f"; proven lower bound {format_bytes(bound)}" if bound is not None else ""
        need = f"the smallest schedule found needs {format_bytes_exact(found)} (found by {by}{lb})"
    return (f"budget {format_bytes_exact(budget_bytes)} is below the smallest feasible budget: {need}; "
            f"{fixed}. A budget of {found} bytes or more fits.")


def _simple_lower_bound(graph: Graph) -> int:
    """No schedule peaks below the fixed bytes plus any one node computed with its inputs resident
    (and the persistent bytes allocated by then: `analysis.node_need`)."""
    return node_need(graph)


def _baseline_min_budget(graph: Graph) -> tuple[int, int, str]:
    from remat.solvers import baselines
    best: tuple[int, str] | None = None
    for name, fn in (("checkpoint-last-node", baselines.checkpoint_last_node),
                     ("checkpoint-all", baselines.checkpoint_all)):
        peak = simulate(graph, fn(graph)).peak_bytes
        if best is None or peak < best[0]:
            best = (peak, name)
    assert best is not None
    return best[0], _simple_lower_bound(graph), best[1]


def _replay_min_budget(graph: Graph, swap: bool, deadline: float) -> tuple[int, int, str]:
    """(smallest budget found, a lower bound, what found it): the baselines' smallest peak, then a
    bisection on the budget with DTR's replay (milliseconds each) until `deadline`; the bound is
    the largest node with its inputs, and without swap what every schedule holds at some first
    compute (`forced_need`)."""
    from remat.core.analysis import forced_need
    from remat.solvers import dtr
    found, bound, source = _baseline_min_budget(graph)
    if not swap:
        bound = max(bound, forced_need(graph))
    lo = bound
    while lo < found and time.perf_counter() < deadline:
        mid = (lo + found) // 2
        try:
            peak = simulate(graph, dtr.solve(graph, mid)).peak_bytes
        except InfeasibleBudgetError:
            lo = mid + 1
            continue
        if peak < found:
            found, source = peak, "dtr"
        else:  # (a replay at a budget fits at most that budget)
            lo = mid + 1
    return found, min(bound, found), source


# ---- sweeps --------------------------------------------------------------------------
SWEEP_COLUMNS = ("budget_bytes", "budget_ratio", "solver", "status", "time", "overhead", "peak_bytes",
                 "lower_bound", "gap", "wall_time")


def sweep(graph: Graph, budgets: Sequence[int], solvers: Sequence[str], **options: Any) -> Iterator[dict]:
    """One row per (budget, solver), budgets outer, in the order given (columns `SWEEP_COLUMNS`).

    A budget a solver cannot fit gives a row with status ``"infeasible"``; any other solver failure
    (`SolverError`, e.g. a time limit with no incumbent, or an exception from the solver) is logged
    as a warning and gives ``"error"``; a solver that rejects the graph or the options
    (`InvalidInputError`: griewank on a non-chain, tflms without swap) gives ``"n/a"``.  None of
    them stops the sweep; unknown solver names fail before any solving.  ``options`` go to every
    solver (see `plan`).
    """
    from remat import solvers as registry
    graph = _with_bandwidth(graph, options)
    asked = options.pop("swap", None)
    for name in solvers:  # unknown names fail before any solving
        registry.get(name)
    base = baseline_peak(graph)
    for budget in budgets:
        for name in solvers:
            row: dict[str, Any] = {k: None for k in SWEEP_COLUMNS}
            row.update(budget_bytes=int(budget), budget_ratio=budget / base if base else None, solver=name)
            t0 = time.perf_counter()
            try:
                swap = default_swap(graph, name) if asked is None else asked
                schedule, res, wall = _solve(graph, int(budget), name, explain=False, swap=swap, **options)
            except InfeasibleBudgetError:
                row.update(status="infeasible", wall_time=time.perf_counter() - t0)
            except InvalidInputError as e:
                # the solver does not apply here (griewank on a non-chain, tflms without swap)
                log.warning("sweep: %s does not apply: %s", name, e)
                row.update(status="n/a", wall_time=time.perf_counter() - t0)
            except Exception as e:  # SolverError, or a solver bug: record it, keep sweeping
                log.warning("sweep: %s at budget %s failed: %s%s", name, format_bytes(budget),
                            "" if isinstance(e, RematError) else f"{type(e).__name__}: ", e)
                row.update(status="error", wall_time=time.perf_counter() - t0)
            else:
                rep = schedule.report
                row.update(status=rep.get("status"), time=res.time, overhead=res.overhead(graph),
                           peak_bytes=res.peak_bytes, lower_bound=rep.get("lower_bound"), gap=rep.get("gap"),
                           wall_time=rep.get("wall_time") if rep.get("wall_time") is not None else wall)
            yield row


__all__ = ["plan", "sweep", "default_swap", "explain_infeasible", "infeasible_message", "SWEEP_COLUMNS"]
