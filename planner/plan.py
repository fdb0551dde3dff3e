"""Plans: a schedule for one graph at one budget, with what the simulator predicts for it.

``remat.plan(graph, budget=...)`` parses the budget, runs a registered solver, replays its
schedule in the simulator and returns a `Plan`.  A plan embeds its graph, so a saved plan is
self-contained (``remat simulate plan.json`` needs nothing else).

JSON format (``remat.plan``, version 1)::

    {"format": "remat.plan", "version": 1,
     "graph_hash": "9caa313e87cc6bf5",        # Graph.content_hash() of the embedded graph
     "budget_bytes": 5,
     "solver": {"name": "ilp", "status": "optimal", "objective": 27.0, "lower_bound": 27.0,
                "gap": 0.0, "wall_time": 0.4, ...},   # whatever else the solver reports
     "predicted": {"peak_bytes": 5, "time": 27.0, "overhead": 1.08, "host_peak_bytes": 0,
                   "fixed_bytes": 0, "activation_peak_bytes": 5, "compute_time": 27.0,
                   "transfer_time": 0.0},
     "schedule": {"ops": [{"op": "compute", "node": 0, "stage": 0}, ...], "stages": [...]},
     "graph": {"format": "remat.graph", ...}}

Loading checks, in order, and names the field that fails: ``format``, ``version``, ``graph``
(as `Graph.from_dict` does), ``graph_hash`` (must equal the embedded graph's content hash),
``budget_bytes``, ``solver``, ``schedule`` (as `Schedule.from_dict` does, node ids against the
graph; stages, when present, must imply the op list), ``predicted``, and finally that the
schedule replays without a violation in the simulator.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from .budget import baseline_peak, format_bytes, format_bytes_exact, parse_budget
from .errors import InfeasibleBudgetError, InvalidInputError, RematError, SolverError
from .graph import Graph, read_json
from .schedule import Schedule, ops_from_stages
from .simulate import SimResult, simulate

log = logging.getLogger(__name__)

FORMAT = "remat.plan"
VERSION = 1
SOLVER_KEYS = ("name", "status", "objective", "lower_bound", "gap", "wall_time")
PREDICTED_KEYS = ("peak_bytes", "time", "overhead", "host_peak_bytes", "fixed_bytes",
                  "activation_peak_bytes", "compute_time", "transfer_time")
# seconds the ILP gets to find the smallest feasible budget when a solver reports infeasibility
MIN_BUDGET_TIME_LIMIT = 10.0


@dataclass
class Plan:
    graph: Graph
    schedule: Schedule
    budget_bytes: int
    solver: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)

    @property
    def graph_hash(self) -> str:
        return self.graph.content_hash()

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget."""
        return self.predicted.get("peak_bytes", math.inf) <= self.budget_bytes

    def simulate(self, bandwidth: float | None = None) -> SimResult:
        return simulate(self.graph, self.schedule, bandwidth)

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "graph_hash": self.graph_hash,
                "budget_bytes": int(self.budget_bytes), "solver": _jsonable(self.solver),
                "predicted": _jsonable(self.predicted), "schedule": self.schedule.to_dict(),
                "graph": self.graph.to_dict()}

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        if not isinstance(d, dict):
            raise InvalidInputError("plan: expected a JSON object")
        if d.get("format") != FORMAT:
            raise InvalidInputError(f"plan.format: expected {FORMAT!r}, got {d.get('format')!r}"
                                    + (" (this is a graph; make a plan with `remat plan`)"
                                       if d.get("format") == "remat.graph" else ""))
        if d.get("version") != VERSION:
            raise InvalidInputError(f"plan.version: this remat reads version {VERSION}, got {d.get('version')!r}")
        if "graph" not in d:
            raise InvalidInputError("plan.graph: missing (a plan embeds the graph it was made for)")
        graph = _prefixed(Graph.from_dict, d["graph"])
        stored = d.get("graph_hash")
        if not isinstance(stored, str):
            raise InvalidInputError(f"plan.graph_hash: missing or not a string: {stored!r}")
        actual = graph.content_hash()
        if stored != actual:
            raise InvalidInputError(
                f"plan.graph_hash: {stored!r} does not match the embedded graph's content hash {actual!r}: "
                "the plan was edited or belongs to another graph; re-plan with `remat plan`")
        budget = d.get("budget_bytes")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise InvalidInputError(f"plan.budget_bytes: expected a positive integer, got {budget!r}")
        solver = d.get("solver")
        if not isinstance(solver, dict):
            raise InvalidInputError("plan.solver: missing or not an object")
        if not isinstance(solver.get("name"), str):
            raise InvalidInputError(f"plan.solver.name: missing or not a string: {solver.get('name')!r}")
        if "status" in solver and not isinstance(solver["status"], str):
            raise InvalidInputError(f"plan.solver.status: expected a string, got {solver['status']!r}")
        if "schedule" not in d:
            raise InvalidInputError("plan.schedule: missing")
        schedule = _prefixed(Schedule.from_dict, d["schedule"], graph)
        schedule.report = dict(solver)
        if schedule.stages is not None and ops_from_stages(graph, schedule.stages) != schedule.ops:
            raise InvalidInputError("plan.schedule.stages: do not imply plan.schedule.ops (one of them "
                                    "was edited); re-plan with `remat plan`")
        predicted = d.get("predicted")
        if not isinstance(predicted, dict):
            raise InvalidInputError("plan.predicted: missing or not an object")
        for key in ("peak_bytes", "time"):
            val = predicted.get(key)
            if not isinstance(val, (int, float)) or isinstance(val, bool):
                raise InvalidInputError(f"plan.predicted.{key}: missing or not a number: {val!r}")
        res = simulate(graph, schedule)
        if not res.valid:
            raise InvalidInputError(f"plan.schedule: the schedule is invalid for the embedded graph: "
                                    f"{res.violation}; re-plan with `remat plan`")
        if res.peak_bytes != predicted["peak_bytes"] or not math.isclose(res.time, predicted["time"],
                                                                          rel_tol=1e-9, abs_tol=1e-12):
            log.warning("plan.predicted says peak %s, time %s; the simulator now says peak %s, time %s "
                        "(graph meta such as the bandwidth changed?)", predicted["peak_bytes"],
                        predicted["time"], res.peak_bytes, res.time)
        return cls(graph, schedule, budget, dict(solver), dict(predicted))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json(path, "plan"))

    def __repr__(self) -> str:
        return (f"Plan(graph={self.graph_hash}, n={self.graph.n}, budget={format_bytes(self.budget_bytes)}, "
                f"solver={self.solver.get('name')!r}, status={self.solver.get('status')!r}, "
                f"peak={format_bytes(self.predicted.get('peak_bytes'))}, time={self.predicted.get('time')})")


def load_plan(path: str | Path) -> Plan:
    """Read and validate a ``remat.plan`` file (see the module docstring)."""
    return Plan.load(path)


def predicted_from(graph: Graph, res: SimResult) -> dict:
    """The ``predicted`` block of a plan: peak, time, overhead and their breakdown."""
    return {"peak_bytes": res.peak_bytes, "time": res.time, "overhead": res.overhead(graph),
            "host_peak_bytes": res.host_peak_bytes, "fixed_bytes": graph.fixed_bytes,
            "activation_peak_bytes": res.activation_peak_bytes, "compute_time": res.compute_time,
            "transfer_time": res.transfer_time}


def plan(graph: "Graph | str | Path", budget: "str | int", solver: str = "ilp", *, swap: bool = True,
         time_limit: float = 60.0, gap: float = 0.0, **options: Any) -> Plan:
    """Plan `graph` (a Graph or a path to a graph.json) to fit `budget` with the named solver.

    `budget` is anything `parse_budget` reads (``"6GiB"``, ``"0.5x"``, bytes).  ``swap``,
    ``time_limit`` (seconds), ``gap`` (relative) and the other ``options`` (``threads``,
    ``backend``, ``warm_start``...) go to the solver; strategies that do not use an option
    ignore it.  Raises `InfeasibleBudgetError` naming the smallest feasible budget found when
    no schedule fits, `InvalidInputError` for a bad budget or solver name.
    """
    if not isinstance(graph, Graph):
        graph = Graph.load(graph)
    graph = _with_bandwidth(graph, options)
    budget_bytes = parse_budget(budget, graph)
    schedule, res, wall = _solve(graph, budget_bytes, solver, swap=swap, time_limit=time_limit, gap=gap,
                                 **options)
    report = _solver_block(schedule.report, solver, wall,
                           {"swap": swap, "time_limit": time_limit, "gap": gap, **options})
    schedule.report = dict(report)
    return Plan(graph, schedule, budget_bytes, report, predicted_from(graph, res))


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
    block.setdefault("options", {k: v for k, v in options.items() if _is_plain(v)})
    return block


def explain_infeasible(graph: Graph, budget_bytes: int, solver: str, err: InfeasibleBudgetError,
                       swap: bool = True, time_limit: float | None = None) -> InfeasibleBudgetError:
    """An `InfeasibleBudgetError` whose message names the smallest feasible budget found.

    Uses the solver's own figures when it gave them; otherwise asks
    ``remat.solvers.ilp.min_feasible_budget`` (short time limit), and if that is not available,
    the smallest peak of the baselines with a simple lower bound (the largest single node with
    its inputs, plus the fixed bytes).
    """
    found, bound, source = err.min_feasible_bytes, err.min_feasible_lower_bound, solver
    if found is None:
        limit = MIN_BUDGET_TIME_LIMIT if time_limit is None else max(1.0, min(float(time_limit),
                                                                             MIN_BUDGET_TIME_LIMIT))
        try:
            from remat.solvers.ilp import min_feasible_budget
            found, bound = min_feasible_budget(graph, swap=swap, time_limit=limit)
            source = "ilp"
        except (ImportError, RematError) as e:
            log.warning("could not compute the smallest feasible budget with the ILP (%s); "
                        "using the baselines instead", e)
            found, bound, source = _baseline_min_budget(graph)
    elif source != "ilp" and bound is None:
        bound = _simple_lower_bound(graph)
    return InfeasibleBudgetError(
        infeasible_message(graph, budget_bytes, solver, int(found), None if bound is None else int(bound), source),
        budget_bytes, int(found), None if bound is None else int(bound), graph.fixed_bytes)


def infeasible_message(graph: Graph, budget_bytes: int, solver: str, found: int, bound: int | None,
                       source: str) -> str:
    by = "the ILP" if source == "ilp" else source
    fixed = (f"{format_bytes(graph.fixed_bytes)} of it are fixed (parameters, gradients, inputs) and no "
             f"schedule can remove them" if graph.fixed_bytes else "none of it is fixed bytes")
    if budget_bytes >= found:
        return (f"solver {solver!r} found no schedule within the budget {format_bytes_exact(budget_bytes)}, "
                f"but {by} found one that needs {format_bytes_exact(found)}: use --solver ilp, or a "
                "larger budget for this solver")
    if bound is not None and bound >= found:
        need = f"a schedule needs at least {format_bytes_exact(found)} (found by {by}; proven lower bound " \
               f"{format_bytes(bound)})"
    else:
        lb = f"; proven lower bound {format_bytes(bound)}" if bound is not None else ""
        need = f"the smallest schedule found needs {format_bytes_exact(found)} (found by {by}{lb})"
    return (f"budget {format_bytes_exact(budget_bytes)} is below the smallest feasible budget: {need}; "
            f"{fixed}. Use --budget {found} or more.")


def _simple_lower_bound(graph: Graph) -> int:
    """No schedule peaks below the fixed bytes plus any one node computed with its inputs resident."""
    return graph.fixed_bytes + max(v.bytes + v.workspace_bytes + sum(graph.nodes[u].bytes for u in set(graph.preds[v.id]))
                                   for v in graph.nodes)


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
    for name in solvers:  # unknown names fail before any solving
        registry.get(name)
    base = baseline_peak(graph)
    for budget in budgets:
        for name in solvers:
            row: dict[str, Any] = {k: None for k in SWEEP_COLUMNS}
            row.update(budget_bytes=int(budget), budget_ratio=budget / base if base else None, solver=name)
            t0 = time.perf_counter()
            try:
                schedule, res, wall = _solve(graph, int(budget), name, explain=False, **options)
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


# ---- helpers -------------------------------------------------------------------------
def _prefixed(fn, *args):
    """Call a from_dict, prefixing its error's field path with ``plan.``."""
    try:
        return fn(*args)
    except InvalidInputError as e:
        raise InvalidInputError(f"plan.{e}") from None


def _is_plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _jsonable(x: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, non-finite floats to None, unknown objects to str."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item") and callable(x.item):  # numpy scalar
        try:
            return _jsonable(x.item())
        except (TypeError, ValueError):
            pass
    if isinstance(x, Schedule):
        return None
    return str(x)


__all__ = ["Plan", "plan", "load_plan", "sweep", "predicted_from", "explain_infeasible", "SWEEP_COLUMNS"]
