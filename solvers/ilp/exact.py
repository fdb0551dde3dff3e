"""The exact mode: Checkmate's model (`checkmate`) on the whole graph, warm-started, with every
relaxation that can prove its incumbent first.

Phases (each a method of `ExactSolve`, in this order; `time_limit` covers the whole call):

1. *Checks*: every node fits with its inputs (`check_budget`); recompute only, what every
   schedule holds at each first compute fits (`check_forced_need`), so an infeasible budget is
   said at once instead of after CBC's proof.
2. *Warm start*: without swap, the best baseline improved by shift searches around the baselines
   run at looser budgets (`warm.searched_warm_start`, `WARM_SEARCH_SHARE` of the limit); with
   swap, the best baseline, then the recompute-only exact solve for a third of the limit (a
   restriction of the swap model that solves much faster; when it already reaches the
   no-recompute time, which no schedule beats, it is the answer).
3. *Chain proof* (recompute only): on a chain revolve's count is a bound (`griewank.chain_bound`);
   a warm start that meets it is proven optimal with no search.
4. *Instant IP* (recompute only; `instant`): a relaxation kept only at first computes, a fifth
   of the model's size.  CBC for `INSTANT_SHARE` of the limit; HiGHS when CBC leaves it open (its
   cut loop often closes what CBC's branching does not); and when it proved an optimum whose plan
   peaks over inside a stage in every rebuild order (`stage_order`), rebuild-moment rows there
   (`instant.solve_on_demand`) for `INSTAGE_SHARE` of the time left.  A proven optimum that fits
   (in id order, or in another rebuild order) ends the solve; otherwise its plan may become the
   warm start and its bound joins the report.
5. *The full model*, warm-started, stopped as soon as CBC's incumbent meets the best bound known
   (`mip.run(stop_at=...)`).  Two CBC faults are handled: a false "infeasible" from its
   preprocessing when a known schedule fits (the schedule is trusted), and values written by a
   CBC the watchdog interrupted (not a solution: the warm start is returned).
6. *The bound*: CBC's (dropped when above the incumbent: a solver's garbage), else the LP
   relaxation, else the no-recompute time; with quantised memory, the relaxation with sizes
   rounded down (valid for the exact bytes); then the window IP, the instant IPs' and revolve's
   bounds where higher.  ``status`` is "optimal" only when the bound meets the incumbent.

`min_feasible_budget` minimises the peak instead of the time, over the same model.
"""
from __future__ import annotations

import logging
import math
import time as _time
from typing import Callable

import pulp

from remat.core.analysis import check_budget, check_forced_need, node_need
from remat.core.errors import InfeasibleBudgetError, SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule
from remat.core.simulate import SimResult, simulate
from remat.solvers import baselines, chen, griewank, stage_order

from . import bounds, instant, mip, warm
from .checkmate import build_model, integral, prune_waste, schedule_from_model, set_warm_start, solve_relaxation

log = logging.getLogger(__name__)

INSTANT_SHARE = 0.4   # of the time limit, for the instant IP before the full model
INSTAGE_SHARE = 0.5   # of the time left, for the instant IP with rebuild moments on demand after it
INSTANT_CAP_S = 60.0  # the instant IP's limit when the call has none
CLOSURE_S = 2.0      # the closure IPs' limit after an unproven solve (they take milliseconds on the graphs this mode solves)


class ExactSolve:
    """One exact solve (module docstring); `run()` returns the schedule with its report."""

    def __init__(self, graph: Graph, budget_bytes: int, *, swap: bool, time_limit: float | None, gap: float,
                 threads: int | None, backend: str, warm_start: bool, bandwidth: float | None,
                 max_memory_units: int, msg: bool, recompute_backward: bool,
                 progress: Callable[[dict], None] | None, use_instant_ip: bool):
        self.graph, self.budget = graph, budget_bytes
        self.swap, self.time_limit, self.gap, self.threads = swap, time_limit, gap, threads
        self.backend, self.use_warm_start, self.bandwidth = backend, warm_start, bandwidth
        self.max_memory_units, self.msg, self.recompute_backward = max_memory_units, msg, recompute_backward
        self.progress, self.use_instant_ip = progress, use_instant_ip
        self.recompute_only = not swap and not recompute_backward
        self.t0 = _time.perf_counter()
        self.warm: Schedule | None = None
        self.chain: float | None = None
        self.instant_bounds: list[tuple[float | None, str]] = []

    def elapsed(self) -> float:
        return _time.perf_counter() - self.t0

    def left(self) -> float | None:
        return None if self.time_limit is None else self.time_limit - self.elapsed()

    def run(self) -> Schedule:
        self.check()
        done = self.warm_start() or self.chain_proof() or self.instant_phases()
        return done if done is not None else self.full_model()

    # ---- 1. checks -----------------------------------------------------------------------
    def check(self) -> None:
        check_budget(self.graph, self.budget)
        if self.recompute_only:
            # what must be resident at some first compute does not fit: no schedule, say so now
            # (CBC may need minutes to prove it)
            check_forced_need(self.graph, self.budget)

    # ---- 2. warm start -------------------------------------------------------------------
    def warm_start(self) -> Schedule | None:
        """Sets `warm`; returns a schedule when the recompute-only solve already answers a swap solve."""
        g, budget, limit = self.graph, self.budget, self.time_limit
        if self.use_warm_start and not self.swap:
            self.warm = warm.searched_warm_start(g, budget, bandwidth=self.bandwidth, threads=self.threads,
                                                 backend=self.backend, recompute_backward=self.recompute_backward,
                                                 time_limit=None if limit is None else warm.WARM_SEARCH_SHARE * limit)
        else:
            self.warm = warm.best_baseline(g, budget, self.bandwidth) if self.use_warm_start else None
        if not (self.swap and self.use_warm_start):
            return None
        # recompute-only is a restriction of the swap model and solves much faster: a third of
        # the time on it gives the swap model a strong start (and ends the search when it already
        # reaches the no-recompute time, which no schedule beats)
        try:
            plain = solve(g, budget, swap=False, time_limit=None if limit is None else limit / 3, gap=self.gap,
                          threads=self.threads, backend=self.backend, bandwidth=self.bandwidth,
                          max_memory_units=self.max_memory_units, recompute_backward=self.recompute_backward)
        except (InfeasibleBudgetError, SolverError):
            plain = None
        if plain is None:
            return None
        if plain.report["objective"] <= g.total_time * (1 + 1e-12):
            plain.report.update(swap=True, time_limit=limit, wall_time=self.elapsed(), status="optimal",
                                lower_bound=plain.report["objective"], gap=0.0,
                                solver_result="recompute-only optimum reaches the no-recompute time")
            return plain
        if self.warm is None or plain.report["objective"] < simulate(g, self.warm, self.bandwidth).time:
            self.warm = plain
            self.warm.report = {"name": "ilp (no swap)"}
        return None

    def proven_early(self, plan: Schedule, time: float, bound: float, source: str, result: str,
                     **extra) -> Schedule:
        """`plan`, with a report that says a relaxation's bound (from `source`) proves it optimal."""
        plan.report = {"name": "ilp", "backend": self.backend, "swap": self.swap, "time_limit": self.time_limit,
                       "gap_limit": self.gap, "wall_time": self.elapsed(), **extra,
                       "warm_start": self.warm.report.get("name") if self.warm else None, "solver_result": result,
                       "bound_from": source, "status": "optimal", "objective": time,
                       "lower_bound": min(time, bound), "gap": 0.0}
        return plan

    # ---- 3. chain proof ------------------------------------------------------------------
    def chain_proof(self) -> Schedule | None:
        if not self.recompute_only:
            return None
        # on a chain, revolve's count is a bound (griewank.chain_bound): a warm start that meets
        # it is optimal with no search (CBC alone may never prove it)
        self.chain = griewank.chain_bound(self.graph, self.budget)
        if self.chain is not None and self.warm is not None:
            res = simulate(self.graph, self.warm, self.bandwidth)
            if res.valid and res.peak_bytes <= self.budget and res.time <= self.chain * (1 + 1e-9):
                return self.proven_early(self.warm, res.time, self.chain, "chain (revolve)",
                                         "the warm start meets revolve's bound for chains")
        return None

    # ---- 4. the instant IP ---------------------------------------------------------------
    def instant_phases(self) -> Schedule | None:
        """The instant IP on CBC, on HiGHS when CBC leaves it open, then with rebuild moments on
        demand (module docstring, 4); a schedule when one of them proves a plan that fits."""
        if not (self.use_instant_ip and self.recompute_only):
            return None
        g, budget, limit, progress = self.graph, self.budget, self.time_limit, self.progress
        phases = [("instant IP", False, "cbc"), ("instant IP (HiGHS)", False, "highs"),
                  ("instant IP, rebuild moments on demand", True, "highs" if mip.highs_available() else "cbc")]
        out = None
        for phase, in_stage, solver in phases:
            left = self.left()
            if in_stage:
                if not (out["proven"] and out["schedule"] is not None) or (left is not None and left < 4.0):
                    break
                limit_ip = INSTANT_CAP_S if left is None else INSTAGE_SHARE * left
            elif solver == "highs":
                # HiGHS's cuts often prove what CBC's do not: its bound, and its plan if that fits
                if out["proven"] or out["infeasible"] or not mip.highs_available() \
                        or (left is not None and left < 8.0):
                    continue
                limit_ip = INSTANT_CAP_S if left is None else min(INSTANT_SHARE * limit, 0.5 * left)
            else:
                limit_ip = INSTANT_CAP_S if limit is None else max(1.0, INSTANT_SHARE * limit)
            if in_stage:  # rows where the proven optimum's plan overflows in every rebuild order, and again
                out = instant.solve_on_demand(g, budget, out, time_limit=limit_ip, threads=self.threads,
                                              start=self.warm, backend=solver)
            else:
                out = instant.solve(g, budget, time_limit=limit_ip, threads=self.threads, start=self.warm,
                                    backend=solver, progress=(lambda d, phase=phase: progress(
                                        {**d, "incumbent": None, "gap": None, "phase": phase}))
                                    if progress else None)
            done = self.take_instant(out, phase)
            if done is not None:
                return done
        return None

    def take_instant(self, out: dict, phase: str) -> Schedule | None:
        """An instant-IP result: its bound noted; its plan returned when proven and fitting (in
        some rebuild order), else made the warm start when it is the fastest that fits."""
        g, budget = self.graph, self.budget
        if not out["infeasible"]:
            self.instant_bounds.append((out["bound"], phase))
        plan_ip = out["schedule"]
        if plan_ip is None:
            return None
        res = simulate(g, plan_ip, self.bandwidth)
        if res.valid and res.peak_bytes > budget and out["bound"] is not None \
                and res.time <= out["bound"] * (1 + 1e-9):
            # a proven optimum that peaks over in id order may fit in another rebuild order
            # inside its stages (stage_order): then it is the optimum still
            ordered = stage_order.lower_peak(g, plan_ip, budget)
            res_o = simulate(g, ordered, self.bandwidth) if ordered is not None else None
            if res_o is not None and res_o.valid and res_o.peak_bytes <= budget:
                return self.proven_early(ordered, res_o.time, out["bound"], phase,
                                         f"the {phase} optimum fits the budget in another rebuild order",
                                         variables=out["variables"])
        if not (res.valid and res.peak_bytes <= budget):
            return None
        if out["bound"] is not None and res.time <= out["bound"] * (1 + 1e-9):  # (proven: bound = optimum)
            return self.proven_early(plan_ip, res.time, out["bound"], phase, f"the {phase} optimum fits the budget",
                                     variables=out["variables"])
        if self.warm is None or res.time < simulate(g, self.warm, self.bandwidth).time * (1 - 1e-12):
            self.warm = plan_ip
            self.warm.report = {"name": phase}
        return None

    # ---- 5. the full model ---------------------------------------------------------------
    def full_model(self) -> Schedule:
        g, budget, warm_ = self.graph, self.budget, self.warm
        m = build_model(g, budget, swap=self.swap, bandwidth=self.bandwidth, max_memory_units=self.max_memory_units,
                        recompute_backward=self.recompute_backward)
        if warm_ is not None:
            set_warm_start(m, warm_)
        log.info("ilp: %d variables, %d constraints, warm start %s", len(m.prob.variables()),
                 len(m.prob.constraints), warm_.report.get("name") if warm_ else None)
        # the time limit covers the whole call: what the warm start and the model took comes off it
        search_limit = None if self.time_limit is None else max(1.0, self.time_limit - self.elapsed())
        known = max([b for b, _ in self.instant_bounds if b is not None] + ([self.chain] if self.chain is not None
                                                                           else []), default=None)
        out = mip.run(m, self.backend, search_limit, self.gap, self.threads, warm_ is not None, self.msg,
                      progress=self.progress, stop_at=known if self.gap <= 0 else None)
        report = {"name": "ilp", "backend": self.backend, "swap": self.swap, "time_limit": self.time_limit,
                  "gap_limit": self.gap, "wall_time": self.elapsed(), "memory_quantum": m.quantum,
                  "variables": m.meta["variables"], "constraints": m.meta["constraints"],
                  "solver_result": out["result"], "warm_start": warm_.report.get("name") if warm_ else None}
        sched, objective, out = self.read_back(m, out, report)
        return self.with_bound(sched, objective, out, m, report, known)

    def read_back(self, m, out: dict, report: dict) -> tuple[Schedule, float, dict]:
        """The schedule of the solver's values, or the warm start, or the error the run ends in."""
        g, budget, warm_ = self.graph, self.budget, self.warm
        if out["infeasible"] and warm_ is not None:
            # CBC's preprocessing sometimes declares large models infeasible although a schedule
            # that satisfies every row is known: trust the schedule
            log.info("CBC reported the model infeasible (%s), but the %s schedule fits it; "
                     "returning the best known schedule", out["result"], warm_.report.get("name"))
            report["solver_result"] += " (contradicted by a known feasible schedule)"
            out.update(infeasible=False, sol_status=0, bound=None, proven=False)
        elif out["infeasible"] and self.backend == "cbc":
            # confirm without CBC's preprocessing before telling the user the budget cannot be met
            out = mip.run(m, self.backend, self.time_limit, self.gap, self.threads, False, self.msg,
                          options=["preprocess off"])
        if out["sol_status"] in (1, 2) and not integral(m):
            # CBC stopped by the time limit before any integer solution writes the relaxation's
            # values, which PuLP labels "integer feasible": not an incumbent
            log.info("the solver's values are fractional (%s): no incumbent", out["result"])
            out.update(sol_status=0, objective=None, proven=False)
        sched = None
        objective = math.inf
        if out["sol_status"] in (1, 2) and out["objective"] is not None:
            sched = schedule_from_model(g, m)
            res = simulate(g, sched, self.bandwidth)
            objective = out["objective"] * m.time_unit
            if not res.valid or res.peak_bytes > budget:  # numerical trouble, a stopped solver, or a bug
                # a proven optimum that does not fit is a modelling bug; values written by a solver
                # stopped at its limit (the watchdog's interrupt) are just not used
                bug = out.get("proven") and not out.get("watchdog")
                (log.error if bug else log.info)(
                    "the ILP's schedule does not fit in the simulator (%s; peak %d > %d; %s)%s", res.violation,
                    res.peak_bytes, budget, out["result"], "; please report this graph" if bug else
                    "; CBC was stopped, its values are not used")
                sched = None
                out.update(proven=False, bound=None)
        if sched is None and warm_ is not None and not out["infeasible"]:
            sched, res = warm_, simulate(g, warm_, self.bandwidth)
            objective = res.time
            report["solver_result"] += " (no usable incumbent; returned the warm start)"
        elif sched is None and out["infeasible"]:
            raise InfeasibleBudgetError(
                f"no schedule fits the budget of {budget} bytes (the ILP proved it infeasible)",
                budget, fixed_bytes=g.fixed_bytes)
        elif sched is None:
            raise SolverError(f"the ILP found no schedule within the time limit of {self.time_limit} s "
                              f"({out['result'] or 'no result'}); raise --time-limit or use a baseline solver")
        return sched, objective, out

    # ---- 6. the bound --------------------------------------------------------------------
    def with_bound(self, sched: Schedule, objective: float, out: dict, m, report: dict,
                   known: float | None) -> Schedule:
        g, budget = self.graph, self.budget
        kw = dict(swap=self.swap, bandwidth=self.bandwidth, recompute_backward=self.recompute_backward)

        def above_incumbent(value: float) -> bool:  # then it is no bound (a solver's garbage, or a bug)
            return value > objective * (1 + 1e-6) + 1e-9

        bound = out["bound"] * m.time_unit if out["bound"] is not None else None
        proven = out["proven"]
        if bound is not None and not proven and above_incumbent(bound):
            # CBC interrupted inside its root cut loop can print a garbage bound; a bound above a
            # schedule we hold is no bound
            log.info("discarding the solver's lower bound %.6g (above the incumbent %.6g)", bound, objective)
            bound = None
        if bound is None:  # the solver gave none (crash, or stopped before its root bound): use the LP
            left = self.left()
            # (with a relaxation's bound, which take_bound adds below, the LP adds nothing)
            if (known is None or above_incumbent(known)) and (left is None or left > 1.0):
                try:
                    bound = solve_relaxation(g, budget, time_limit=left, **kw)[1]
                    report["bound_from"] = "lp_relaxation"
                except SolverError:
                    bound = None
            if bound is None:  # every node runs at least once: the no-recomputation time
                bound = g.total_time
                report["bound_from"] = "no_recompute_time"
        if m.meta["quantised"]:
            # optimal and bound above hold for the rounded-up model; the exact problem's bound comes
            # from the relaxation with sizes rounded down
            report.update({"quantised_status": "optimal" if proven else "feasible", "quantised_lower_bound": bound})
            bound = solve_relaxation(g, budget, round_down=True, max_memory_units=self.max_memory_units, **kw)[1]
            proven = bound is not None and objective <= bound * (1 + 1e-9)
            report["bound_from"] = "lp_relaxation_rounded_down"

        def take_bound(value: float | None, source: str) -> None:
            """A relaxation's bound joins the report when it is higher (and not above the
            incumbent, as for CBC's bound above)."""
            nonlocal bound, proven
            if proven or value is None:
                return
            if above_incumbent(value):
                log.info("discarding the %s's bound %.6g (above the incumbent %.6g)", source, value, objective)
            elif bound is None or value > bound * (1 + 1e-12):
                bound = value
                report["bound_from"] = source
                proven = objective <= value * (1 + 1e-9)

        if not proven and not self.recompute_backward:
            # the window IP (bounds.window_bound): integral where the LP is not; a tenth of a second
            take_bound(bounds.window_bound(g, budget, threads=self.threads, swap=self.swap,
                                           bandwidth=self.bandwidth), "window IP")
            if not proven:   # the closure IP (bounds.closure_bound): rebuilding a value needs its inputs
                take_bound(bounds.closure_bound(g, budget, CLOSURE_S, threads=self.threads, swap=self.swap,
                                                bandwidth=self.bandwidth), "closure IP")
        for value, source in self.instant_bounds:
            take_bound(value, source)
        take_bound(self.chain, "chain (revolve)")
        if bound is not None and bound > objective:  # float noise on a proven optimum
            bound = objective
        gap = max(0.0, (objective - bound) / objective) if bound is not None and objective > 0 else None
        report.update({"status": "optimal" if proven else "feasible", "objective": objective,
                       "lower_bound": bound if bound is not None else None, "gap": 0.0 if proven else gap})
        sched.report = report
        return sched


def solve(graph: Graph, budget_bytes: int, *, swap: bool = True, time_limit: float | None = 60.0,
          gap: float = 0.0, threads: int | None = None, backend: str = "cbc", warm_start: bool = True,
          bandwidth: float | None = None, max_memory_units: int = 1_000_000, msg: bool = False,
          recompute_backward: bool = False, progress: Callable[[dict], None] | None = None,
          use_instant_ip: bool = True, **_: object) -> Schedule:
    """Optimal schedule under `budget_bytes` (whole-step bytes, fixed bytes included) by the exact
    model on the whole graph (module docstring).

    `time_limit` bounds the call: the MIP search gets what building the model and the warm start
    left of it (at least 1 s; reading back the schedule and a fallback LP bound come on top);
    `progress(dict)` receives incumbent, lower bound and gap while CBC runs.
    `use_instant_ip=False` skips the instant IP that runs first without swap.
    """
    return ExactSolve(graph, budget_bytes, swap=swap, time_limit=time_limit, gap=gap, threads=threads,
                      backend=backend, warm_start=warm_start, bandwidth=bandwidth, max_memory_units=max_memory_units,
                      msg=msg, recompute_backward=recompute_backward, progress=progress,
                      use_instant_ip=use_instant_ip).run()


def smallest_peak_start(graph: Graph, bandwidth: float | None = None) -> Schedule:
    """The lowest-peak schedule among checkpoint-all and Chen's greedy segments over all forward
    nodes and over articulation points (segment budget swept), waste pruned: a valid start for
    the stage model without swaps or backward recomputation, found in milliseconds."""
    return _smallest_peak(graph, bandwidth)[0]


def _smallest_peak(graph: Graph, bandwidth: float | None) -> tuple[Schedule, SimResult]:
    """`smallest_peak_start` with its simulation (valid)."""
    best = None
    for make in (baselines.checkpoint_all, chen.chen_greedy, chen.chen_greedy_ap):
        sched = prune_waste(graph, make(graph))
        res = simulate(graph, sched, bandwidth)
        if res.valid and (best is None or res.peak_bytes < best[1].peak_bytes):
            best = (sched, res)
    if best is None:
        raise SolverError("no starting schedule replays (checkpoint-all and Chen's greedy segments)")
    return best


def min_feasible_budget(graph: Graph, swap: bool = True, time_limit: float | None = 30.0,
                        bandwidth: float | None = None, recompute_backward: bool = False) -> tuple[int, int]:
    """(smallest whole-step peak found, proven lower bound on it), by the same stage model.

    Minimises a peak variable >= U[t,k] + W_k R[t,k] (+ the persistent bytes counted by then,
    all of them at the end) over schedules of any time.  The
    incumbent is simulated, so the first number is a budget that is known to work.
    """
    total = sum(v.bytes + v.workspace_bytes + v.persistent_bytes for v in graph.nodes)
    m = build_model(graph, graph.fixed_bytes + total, swap=swap, bandwidth=bandwidth,
                    recompute_backward=recompute_backward)
    peak = pulp.LpVariable("peak", 0)
    P = m.meta["P"]
    for (t, k), u in m.U.items():
        w = m.meta["W"][k]
        rk = 1 if k == t else m.R.get((t, k), 0)
        m.prob.addConstraint(peak >= u + w * rk + sum(P[:t]), f"peak_{t}_{k}")
    if any(P):
        m.prob.addConstraint(peak >= sum(P), "peak_end")  # (the step's end)
    m.prob.setObjective(peak)
    # CBC starts from the smallest peak among checkpoint-all and Chen's greedy segments (each
    # a few simulations): without a start it may find no schedule at all in the time limit on
    # graphs of a hundred nodes, the LP bound is weak so it rarely proves optimality, and the
    # start is the answer when CBC improves on nothing (a loaded machine's short limit)
    start, res = _smallest_peak(graph, bandwidth)
    set_warm_start(m, start)
    out = mip.run(m, "cbc", time_limit, 0.0, None, True, False)
    # the lower simulated peak of CBC's answer and the start: CBC may reject the start (rounding in
    # the quantised model) and stop at a worse incumbent of its own when the limit is short
    if out["sol_status"] in (1, 2):
        found = simulate(graph, schedule_from_model(graph, m), bandwidth)
        if not found.valid:
            raise SolverError(f"the smallest-peak schedule does not replay: {found.violation}")
        res = min(res, found, key=lambda r: r.peak_bytes)
    lb_units = int(math.ceil((out["bound"] if out["bound"] is not None else 0.0) - 1e-6))
    if m.meta["quantised"]:  # each of at most n outputs, one workspace and the persistent sizes was rounded up by < q
        lb_units -= graph.n + 1 + sum(1 for v in graph.nodes if v.persistent_bytes)
    lb = graph.fixed_bytes + max(0, lb_units) * m.quantum
    return res.peak_bytes, min(res.peak_bytes, max(lb, node_need(graph)))


__all__ = ["solve", "ExactSolve", "min_feasible_budget", "smallest_peak_start", "INSTANT_SHARE", "INSTAGE_SHARE", "INSTANT_CAP_S"]
