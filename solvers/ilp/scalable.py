r"""The ILP's scalable mode: baselines, the instant IP and its neighbourhoods, a coarse exact ILP,
expansion, refinement, and a lower bound for the whole graph.

Checkmate's model has ~n^2 R and S variables plus one FREE per (stage, edge); CBC solves it up
to about a hundred nodes.  This mode plans larger graphs in steps, keeps the best schedule the
simulator accepts, and reports a lower bound that holds for the WHOLE graph.  `ilp.solve(mode=
"auto")` uses it above `AUTO_THRESHOLD` nodes; mode="scalable"/"exact" force either.  The steps
are the methods of `ScalableSearch`, in this order:

0.  `baselines`: cheap bounds (knapsack, revolve's on chains), the baselines (`BASELINES`: DTR's
    variants cast into stages and as bare op lists, which the cast can push over the budget,
    Chen's, revolve, checkpoint-all; the fastest that fits is the first incumbent), the window IP,
    the closure IP.
0c. `start_worker`: with ``threads >= 2`` the instant IP step (`worker.instant_step`: the instant
    IP, its split and coupled bounds) in a process of its own for `WORKER_SHARE` of the time,
    beside the rest, which gets one thread fewer; its plan and bound are taken when it ends
    (between neighbourhoods, or at the end), its whole model's bound as soon as it has one.
0b. `shift_search`, on graphs up to `REFINE_MAX_NODES`: the fine recompute-only ILP restricted to
    the best schedule's recomputations, each in its own stage or the next (`warm.shift_search`),
    for up to `SHIFT_SHARE` of the time, again around each improvement (`SHIFT_ROUNDS`; once where
    the neighbourhood search follows).  A DTR schedule cast into stages recomputes each value once
    per use; letting the solver choose which stage's copy serves which uses, and which to keep
    instead, is worth a lot.
0c. `instant_in_line` (one thread): the instant IP step here, for `INSTANT_SHARE` of the time left
    (`INSTANT_HIGHS_SHARE` on HiGHS, where the neighbourhood search follows), up to
    `INSTANT_MAX_VARS` variables.  A plan of it that peaks above the budget inside a stage goes to
    one shift search (`use_instant`).
0d. `neighbourhoods` (up to `LNS_MAX_VARS` variables; recompute-only plans, with swap too for
    `LNS_SWAP_SHARE` of the time): free the P and N of one region of forward values
    (`instant.neighbourhoods`: contiguous runs with equal numbers of variables, ends moved to
    articulation points), fix every other to the best plan, start from it, and solve (HiGHS when
    installed) for up to `LNS_REGION_S`; the region the plan recomputes most goes first, then the
    others from the least recomputed, then the time windows (`instant.time_windows`: every value
    free in a run of instants), in turns while `LNS_SHARE` of the time lasts and one still
    improves.  A plan that peaks above the budget inside a stage is offered in the best rebuild
    order `stage_order` finds, or replayed under the budget with evictions
    (`stage_order.evict_to_fit`), and the same neighbourhood is solved again with rebuild-moment
    rows in the intervals where it overflowed (strict where they overflow again); the intervals
    stay in the model for the later neighbourhoods.
1-3. `coarse`: coarsen (`coarsen`), solve the coarse graph with the exact ILP (`exact.solve`),
    expand (`coarsen.expand`: fits the budget by construction, checked by `simulate`); finer
    coarsening when the coarse graph cannot fit the budget (up to `COARSE_MAX` coarse nodes).
4.  Where the fine model fits the time (predicted from `model_units` and constants measured on
    this project's machines, because CBC does not honour its time limit while it solves a root
    LP): (a) `lp_bound`, the LP relaxation of the full fine model with sizes rounded down;
    (b) `refine`: RINS (the fine ILP with every binary fixed on which that LP and the incumbent
    agree, warm-started), then on graphs up to `FULL_REFINE_MAX_NODES` the whole fine ILP
    warm-started from the best schedule.
5.  `late_bound`: time the steps left unused (a large graph whose instant IP, LP and RINS are
    all too large ends its search early) goes to the closure IP at instants spread over the step.

Why the reported lower bound holds for the whole graph.  It is the largest of the
no-recomputation time; the moment knapsack, the window IP and the closure IP (`bounds`); the instant IP's bound
(`instant`), the split at tight instants and the coupled windows (`windows`); revolve's count on
chains (`griewank.chain_bound`); the LP relaxation of the full fine model with sizes rounded down
(a relaxation of the exact model even when sizes need quantising); and CBC's bound on the whole
fine model (when not quantised).  Each is a relaxation of the fine model (proofs in those
modules).  A coarse model's objective or bound is never used as a bound (coarsening restricts the
schedules), nor RINS's.  A bound above a schedule the simulator accepted is dropped (a solver's
garbage).  Status is "optimal" only when the bound meets the incumbent; otherwise "feasible"
with ``lower_bound``, ``gap`` and where each came from (``incumbent_from``, ``bound_from``).
`time_limit` covers the whole call: each step gets a share of what is left, and the best schedule
so far is returned when it runs out.
"""
from __future__ import annotations

import logging
import math
import os
import time as _time
from typing import Callable

from remat.core.analysis import check_budget, check_forced_need, recompute_in
from remat.core.errors import InfeasibleBudgetError, SolverError
from remat.core.graph import Graph
from remat.core.schedule import Schedule, early_frees
from remat.core.simulate import simulate
from remat.solvers import griewank, stage_order
from remat.solvers.registry import register

from . import bounds, checkmate, exact, instant, mip, warm
from .coarsen import choose_groups, coarsen, expand, fit_groups
from .worker import InstantWorker, instant_step

log = logging.getLogger(__name__)

AUTO_THRESHOLD = 100   # mode="auto": graphs with more nodes than this use the scalable mode
COARSE_TARGET = 60     # nodes of the coarse graph the first try aims at
COARSE_MAX = 140       # never hand the exact ILP a coarse graph larger than this
COARSE_MIN_S = 10.0    # with a plan in hand, start the coarse solve only with this much left (or a tenth of the
#                        limit): a shorter one can overrun the call's limit
LP_MAX_NODES = 320     # solve the full LP relaxation (bound, RINS guide) up to this many nodes
REFINE_MAX_NODES = 320  # run the RINS-restricted fine ILP up to this many nodes
FULL_REFINE_MAX_NODES = 100  # and the whole fine ILP (warm-started) up to this many
RINS_EPS = 1e-6        # RINS fixes a binary where the LP is within this of the incumbent
GAP_EPS = 1e-9         # a gap this small is met (the bound and the simulator round differently)
SHIFT_SHARE = 0.2      # of the time left, for shift searches around the best schedule (step 0b)
SHIFT_ROUNDS = 4       # at most this many, each around the last one's schedule
INSTANT_SHARE = 0.85   # of the time left, for the instant IP (step 0c, one thread)
INSTANT_HIGHS_SHARE = 0.45  # of the time left, for the instant IP on HiGHS when the neighbourhood search follows
LNS_SHARE = 0.95       # of the time left after step 0c, for the neighbourhood search (step 0d: where it runs, the
#                        coarse ILP and RINS after it rarely improve the plan)
LNS_SWAP_SHARE = 0.6   # with swap: its plans are recompute-only, the coarse ILP after it may swap
LNS_PARTS = 3          # regions it frees one at a time
LNS_REGION_S = 40.0    # at most this long on one region (shorter ones stop before a region's better plans)
LNS_MIN_S = 5.0        # and at least this long
INSTANT_MAX_VARS = 40_000  # the instant IP in the main process only up to this many P and N variables (larger
#                            ones find no root LP in their share)
LNS_MAX_VARS = 60_000  # the neighbourhood search up to this many (a region fixes two thirds of them)
LATE_BOUND_S = 30.0    # at most this long for the closure IP at spread instants, with time left at the end (step 5)
WORKER_SHARE = 0.9     # with threads >= 2: of the time left after step 0, for the instant IP in a worker process
WORKER_START_S = 3.0   # what starting the worker (a fresh interpreter, imports, the model) costs it at most
WORKER_MAX_VARS = 60_000  # the worker's instant IP may be larger: it has nearly all the time
# seconds per unit of `model_units` to build the fine model in PuLP, and to build and solve its LP
# relaxation with CBC, measured on this project's 2-core machine (docs/results.md): CBC does not
# honour a time limit while it solves the root LP, so the LP and the refinement run only when the
# prediction fits the time they are given
BUILD_S_PER_UNIT = 1.5e-4
LP_S_PER_UNIT = 3.5e-4

# the baselines of step 0, in the order they are offered
BASELINES = ("lookahead", "dtr-eq", "dtr", "dtr-msps", "dtr-local", "checkpoint-all", "griewank", "chen-sqrtn",
             "chen-greedy-ap", "chen-greedy", "checkpoint-last-node")
SLOW_BASELINES = {"chen-greedy": 300, "checkpoint-last-node": 300}  # skipped above this many nodes


def model_units(graph: Graph) -> int:
    """Size of the fine model, for predicting its cost: R and S entries plus one FREE per
    (stage, input of a node that may run in it)."""
    n = graph.n
    sink = [not s for s in graph.succs]
    fwd = [v.kind == "forward" for v in graph.nodes]
    indeg = [len(set(p)) for p in graph.preds]
    units = 0
    movable_in = 0  # inputs of earlier forward nodes that may be recomputed
    live = live_fwd = 0
    for t in range(n):
        units += live + live_fwd + indeg[t] + movable_in
        if not sink[t]:
            live += 1
            if fwd[t]:
                live_fwd += 1
                movable_in += indeg[t]
    return units


def default_threads() -> int:
    """Threads of a scalable solve whose caller named none: two where the process may use two
    cores (the instant IP's worker beside the search), else one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(2, max(1, cores))


def gap_of(obj: float, bound: float | None) -> float | None:
    """(obj - bound) / obj, the relative gap of MIP solvers; None without a bound."""
    if bound is None or obj <= 0:
        return None
    return max(0.0, (obj - bound) / obj)


@register("ilp-scalable", "the ILP's scalable mode: coarsen at narrow points, solve exactly, expand, refine; "
                          "reports a bound for the whole graph")
def solve(graph: Graph, budget_bytes: int, **options) -> Schedule:
    """A schedule under `budget_bytes` (whole-step bytes) with a lower bound for the whole graph;
    the options are `ScalableSearch`'s.  A worker process it starts (threads >= 2) is stopped
    however the search ends.  `threads` not given: `default_threads()`."""
    if options.get("threads") is None:
        options["threads"] = default_threads()
    search = ScalableSearch(graph, budget_bytes, **options)
    try:
        return search.run()
    finally:
        search.close()


class ScalableSearch:
    """One scalable solve (module docstring): the incumbent, the bound and where each came from,
    the notes of the report, the worker; each step is a method, `run` calls them in order.

    Options as `ilp.solve`, plus `coarse_nodes` (size of the coarse graph to aim at; default
    `COARSE_TARGET`, or the graph itself when smaller), `lp_max_nodes`, `refine_max_nodes` and
    `full_refine_max_nodes` (largest graphs for the full LP bound, for RINS and for the whole
    warm-started fine ILP; 0 turns a step off) and `use_instant_ip` (step 0c, and in the coarse
    solve).  `run` raises `InfeasibleBudgetError` when the budget cannot hold what must be
    resident, `SolverError` when no schedule was found in time.  `progress(dict)` gets {"phase",
    "elapsed", "incumbent", "phase_incumbent", "lower_bound", "gap"} (seconds of the schedule) at
    every new incumbent or bound: "incumbent" is the best schedule held (only improves),
    "phase_incumbent" the coarse or RINS model's own while one solves (its expansion matches the
    coarse one without swap), else None.
    """

    def __init__(self, graph: Graph, budget_bytes: int, *, swap: bool = True, time_limit: float | None = 60.0,
                 gap: float = 0.0, threads: int | None = None, backend: str = "cbc", bandwidth: float | None = None,
                 recompute_backward: bool = False, progress: Callable[[dict], None] | None = None,
                 coarse_nodes: int | None = None, lp_max_nodes: int = LP_MAX_NODES,
                 refine_max_nodes: int = REFINE_MAX_NODES, full_refine_max_nodes: int = FULL_REFINE_MAX_NODES,
                 msg: bool = False, use_instant_ip: bool = True, **_: object):
        self.graph, self.budget = graph, budget_bytes
        self.swap, self.limit, self.gap, self.threads = swap, time_limit, gap, threads
        self.backend, self.bandwidth, self.recompute_backward = backend, bandwidth, recompute_backward
        self.progress, self.coarse_nodes, self.msg, self.use_instant_ip = progress, coarse_nodes, msg, use_instant_ip
        self.lp_max_nodes, self.refine_max_nodes = lp_max_nodes, refine_max_nodes
        self.full_refine_max_nodes = full_refine_max_nodes
        self.t0 = _time.perf_counter()
        self.best: Schedule | None = None
        self.best_time = math.inf
        self.best_from: str | None = None
        self.bound = graph.total_time
        self.bound_from = "no_recompute_time"
        self.notes: dict = {}
        self.staged: Schedule | None = None  # the best schedule with stage matrices (what can seed the fine ILP)
        self.staged_time = math.inf
        self.ip_start: Schedule | None = None  # the best schedule that maps onto the instant IP (stages, or an
        self.ip_start_time = math.inf         # op list whose stages were reordered)
        self.workers: list[InstantWorker] = []
        # for the instant IP (0c) and its neighbourhoods (0d)
        self.ip_backend = "highs" if mip.highs_available() else "cbc"
        self.source_ip = "instant IP" + (" (HiGHS)" if self.ip_backend == "highs" else "")
        self.units = 0
        self.run_instant = self.run_lns = False

    # ---- the run -------------------------------------------------------------------------
    def run(self) -> Schedule:
        check_budget(self.graph, self.budget)
        self.baselines()
        self.units = model_units(self.graph) * (3 if self.swap else 1)  # swap adds SO, SI, SF and their rows
        self.notes["model_units"] = self.units
        self.start_worker()
        self.shift_search()
        self.instant_in_line()
        self.collect()
        self.neighbourhoods()
        self.coarse()
        lp_model = self.lp_bound()
        self.refine(lp_model)
        self.wait_for_worker()
        self.late_bound()
        return self.result()

    def close(self) -> None:
        for w in self.workers:
            w.close()

    # ---- time, progress, incumbent and bound -----------------------------------------------
    def left(self) -> float | None:
        return None if self.limit is None else self.limit - (_time.perf_counter() - self.t0)

    def share(self, frac: float, floor: float = 1.0) -> float | None:
        rest = self.left()
        return None if rest is None else max(floor, rest * frac)

    def tell(self, phase: str, incumbent: float | None = None, lb: float | None = None) -> None:
        """Progress: ``incumbent`` is the best schedule's time held so far (what the call would
        return now), so it only improves; a phase solving a model of its own (the coarse graph,
        RINS) passes that model's incumbent, reported as ``phase_incumbent`` (and as the
        incumbent only while no schedule is held)."""
        if self.progress is None:
            return
        inc = self.best_time if self.best_time < math.inf else incumbent
        b = self.bound if lb is None else lb
        self.progress({"phase": phase, "elapsed": _time.perf_counter() - self.t0, "incumbent": inc,
                       "phase_incumbent": incumbent, "lower_bound": b,
                       "gap": gap_of(inc, b) if inc is not None else None})

    def gap_open(self) -> bool:
        """Is the incumbent still further from the bound than asked?"""
        return (gap_of(self.best_time, self.bound) or 0) > max(self.gap, GAP_EPS)

    def offer(self, sched: Schedule | None, source: str) -> list[int]:
        """Keep `sched` if it fits and is the best; returns the stages where it peaks above the
        budget in every rebuild order tried (`stage_order.reorder`; also when evictions made
        it fit, `stage_order.evict_to_fit`), [] when it fits as it is or reordered."""
        if sched is None:
            return []
        graph, budget = self.graph, self.budget
        res = simulate(graph, sched, self.bandwidth)
        maps = sched.stages is not None  # onto the instant IP (a start for its searches)
        over: list[int] = []
        if res.valid and res.peak_bytes > budget:  # (reorder and evict_to_fit refuse plans with transfers)
            # the instant IP's plans ignore memory inside a stage: another rebuild order in the
            # stages that peak over often fits (stage_order)
            ordered, over = stage_order.reorder(graph, sched, budget)
            res_o = simulate(graph, ordered, self.bandwidth) if ordered is not None and not over else None
            if res_o is not None and res_o.valid and res_o.peak_bytes <= budget:
                log.info("ilp-scalable: the %s schedule fits with another rebuild order inside its stages", source)
                sched, res, source, maps = ordered, res_o, source + " (rebuild order)", True
            else:
                # no order fits: replayed under the budget, with a few evictions and rebuilds where it peaks over
                fitted = stage_order.evict_to_fit(graph, ordered if ordered is not None else sched, budget,
                                                  worse_than=self.best_time if self.best_time < math.inf else None)
                res_e = simulate(graph, fitted, self.bandwidth) if fitted is not None else None
                if res_e is not None and res_e.valid and res_e.peak_bytes <= budget:
                    log.info("ilp-scalable: the %s schedule fits with evictions (%.6g -> %.6g)", source, res.time,
                             res_e.time)
                    sched, res, source, maps = fitted, res_e, source + " (evictions)", True
        if not res.valid or res.peak_bytes > budget:
            # a DTR cast may not fit, nor the instant IP's plan (it ignores memory inside a stage)
            # (expected of those; from the fine or coarse ILP it would be a modelling bug)
            say = log.debug if source.startswith(("baseline", "instant IP", "neighbourhood search")) else log.warning
            say("ilp-scalable: the %s schedule does not fit (%s; peak %d > %d); dropped",
                source, res.violation, res.peak_bytes, budget)
            return over
        if sched.stages is not None and res.time < self.staged_time * (1 - 1e-12):
            self.staged, self.staged_time = sched, res.time
        if maps and res.time < self.ip_start_time * (1 - 1e-12):
            self.ip_start, self.ip_start_time = sched, res.time
        if res.time < self.best_time * (1 - 1e-12):
            self.best, self.best_time, self.best_from = sched, res.time, source
            log.info("ilp-scalable: incumbent %.6g from %s (%.1f s)", res.time, source, _time.perf_counter() - self.t0)
            self.tell(source)
        return over  # (a plan that fits only with evictions still names them)

    def raise_bound(self, value: float | None, source: str) -> None:
        if value is None:
            return
        log.info("ilp-scalable: bound %.6g from %s (%.1f s)", value, source, _time.perf_counter() - self.t0)
        if value > self.best_time * (1 + 1e-6) + 1e-12:
            # above a schedule the simulator accepted: no bound (a solver's garbage, or a bug)
            log.info("ilp-scalable: discarding the %s bound %.6g (above the incumbent %.6g)", source, value,
                     self.best_time)
            return
        if value > self.bound * (1 + 1e-12):
            self.bound, self.bound_from = value, source
            self.tell(f"bound:{source}")

    def overflowed(self, out: dict, before: float) -> bool:
        """A model's plan better than `before` that did not fit."""
        return self.best_time == before and out["objective"] is not None \
            and out["objective"] < self.best_time * (1 - 1e-9)

    # ---- 0. cheap bounds and the fine baselines ------------------------------------------------
    def baselines(self) -> None:
        graph, budget = self.graph, self.budget
        if not self.swap and not self.recompute_backward:
            kb = bounds.knapsack_bound(graph, budget)
            if kb is None:
                check_forced_need(graph, budget)
            self.raise_bound(kb, "knapsack")
            self.raise_bound(griewank.chain_bound(graph, budget), "chain (revolve)")
        for name, sched in warm.baseline_schedules(graph, budget, BASELINES, op_lists=True,
                                                   skip_above=SLOW_BASELINES):
            self.offer(sched, f"baseline {name}")
        if not self.recompute_backward and (self.best is None or self.gap_open()):
            # (after the baselines, so that raise_bound can check it against them; not when a
            # baseline already meets the bound)
            self.raise_bound(bounds.window_bound(graph, budget, min(bounds.WINDOW_IP_S, self.share(0.05)
                                                                    or bounds.WINDOW_IP_S), self.threads,
                                                 swap=self.swap, bandwidth=self.bandwidth), "window IP")
        if not self.recompute_backward and (self.best is None or self.gap_open()):
            self.raise_bound(bounds.closure_bound(graph, budget, min(bounds.CLOSURE_IP_S, self.share(0.05)
                                                                     or bounds.CLOSURE_IP_S), self.threads,
                                                  swap=self.swap, bandwidth=self.bandwidth), "closure IP")

    # ---- 0c. the instant IP step, in a worker or in line -------------------------------------
    def start_worker(self) -> None:
        """Sizes the instant IP (`run_instant`, `run_lns`) and, with two threads or more, starts
        step 0c in a worker process for nearly all the time."""
        graph = self.graph
        instant_vars = instant.size(graph) if self.use_instant_ip and not self.recompute_backward else None
        self.run_instant = instant_vars is not None and instant_vars <= INSTANT_MAX_VARS
        self.run_lns = instant_vars is not None and instant_vars <= LNS_MAX_VARS
        if not (instant_vars is not None and instant_vars <= WORKER_MAX_VARS and (self.threads or 1) >= 2
                and self.gap_open() and (self.left() is None or self.left() > 4.0 + WORKER_START_S)):
            return
        limit_w = exact.INSTANT_CAP_S if self.limit is None else max(1.0, WORKER_SHARE * self.left() - WORKER_START_S)
        try:
            self.workers.append(InstantWorker(graph, self.budget, limit_w, swap=self.swap, bandwidth=self.bandwidth,
                                              threads=1, start=self.ip_start if self.ip_start is not None
                                              else self.best, backend=self.ip_backend))
        except OSError as e:  # no interpreter to start (an embedded Python): step 0c runs in line
            log.warning("ilp-scalable: cannot start the instant IP's worker (%s); solving it in line", e)
        else:
            self.notes["instant_ip_worker_s"] = round(limit_w, 1)
            self.threads -= 1  # the worker's core
            self.tell(self.source_ip + ", worker")

    def take_instant(self, out: dict, source: str, note: str) -> None:
        """An instant-IP run's bound and notes (its whole model's, its split's, its coupling's)."""
        self.notes[note] = {k: out[k] for k in ("objective", "bound", "proven", "variables")}
        if out["infeasible"]:
            log.info("ilp-scalable: %s called the instant IP infeasible; ignored (preprocessing can be wrong)", source)
        else:
            self.raise_bound(out["bound"], source)
        split = out.get("split")
        if split is not None:
            self.notes["split_bound"] = {"bound": split["bound"], "cuts": split["cuts"], "proven": split["proven"]}
            self.raise_bound(split["bound"], source.replace("instant IP", "instant IP split at tight instants"))
        co = out.get("coupled")
        if co is not None:
            self.notes["coupled_bound"] = dict(co)
            self.raise_bound(co["bound"], source.replace("instant IP", f"instant IP split, coupled at {co['cut']}"))

    def use_instant(self, out: dict, source: str) -> None:
        """Step 0c's plan (repaired if it peaks over) and bound."""
        plan_ip = out["schedule"]
        if plan_ip is not None:
            before = self.best_time
            self.offer(plan_ip, source)
            if self.overflowed(out, before) and (self.left() is None or self.left() > 4.0):
                # it peaks above the budget inside a stage: the fine ILP on its recomputations
                # (each in its stage or the next) usually repairs it
                try:
                    self.offer(warm.shift_search(self.graph, self.budget, plan_ip, time_limit=self.share(0.15),
                                                 threads=self.threads, backend=self.backend,
                                                 bandwidth=self.bandwidth), source + ", repaired")
                except SolverError as e:
                    log.info("ilp-scalable: repairing the instant IP's plan failed (%s)", e)
        self.take_instant(out, source, "instant_ip")

    def collect(self, wait: float = 0.0) -> None:
        """The worker's result, once it is there (and its interim bound before)."""
        workers = self.workers
        if not workers or workers[0].result is not None:
            return
        early = workers[0].interim()  # (the whole model's bound, before the worker's later steps)
        if early is not None:
            self.raise_bound(early["bound"], self.source_ip + ", worker")
        if workers[0].poll(wait) is None:
            return
        out = workers[0].result
        workers[0].close()
        if "error" in out:
            log.warning("ilp-scalable: the instant IP's worker failed (%s)", out["error"])
            self.notes["instant_ip"] = {"error": out["error"]}
        else:
            self.use_instant(out, self.source_ip + ", worker")

    def instant_in_line(self) -> None:
        """Step 0c with one thread: the instant IP step here, for its share of the time."""
        if not (self.run_instant and not self.workers and self.gap_open()
                and (self.left() is None or self.left() > 4.0)):
            return
        limit_ip = exact.INSTANT_CAP_S if self.limit is None else \
            max(1.0, 0.8 * self.share(INSTANT_HIGHS_SHARE if self.ip_backend == "highs" else INSTANT_SHARE) - 1.0)
        source = self.source_ip
        self.tell(source)
        progress = (lambda d: self.tell(source, None, max(self.bound, d["lower_bound"] or 0.0))) \
            if self.progress else None
        self.use_instant(instant_step(self.graph, self.budget, swap=self.swap, bandwidth=self.bandwidth,
                                      threads=self.threads, time_limit=limit_ip,
                                      start=self.ip_start if self.ip_start is not None else self.best,
                                      progress=progress, backend=self.ip_backend), source)

    # ---- 0b. shift search ------------------------------------------------------------------
    def shift_search(self) -> None:
        """The fine ILP restricted to the best schedule's recomputations, each in its stage or the
        next (`warm.shift_search`), again around each improvement while its share lasts."""
        graph = self.graph
        if not (graph.n <= self.refine_max_nodes and self.staged is not None
                and (self.left() is None or BUILD_S_PER_UNIT * model_units(graph) <= SHIFT_SHARE * self.left())):
            return
        until = None if self.left() is None else _time.perf_counter() + SHIFT_SHARE * self.left()
        rounds = 0
        # one round where the neighbourhood search follows (its regions do better with the time)
        most = 1 if self.run_lns else SHIFT_ROUNDS
        while self.gap_open() and rounds < most:
            rest = None if until is None else until - _time.perf_counter()
            if rest is not None and rest < 2.0:
                break
            rounds += 1
            before = self.staged_time
            try:
                self.offer(warm.shift_search(graph, self.budget, self.staged, time_limit=rest, threads=self.threads,
                                             backend=self.backend, bandwidth=self.bandwidth,
                                             recompute_backward=self.recompute_backward), "shift search")
            except SolverError as e:
                log.info("ilp-scalable: shift search failed (%s)", e)
                break
            if not self.staged_time < before * (1 - 1e-9):
                break
        self.notes["shift_rounds"] = rounds

    # ---- 0d. neighbourhood search ----------------------------------------------------------
    def neighbourhoods(self) -> None:
        """The instant IP around the best plan with one region of forward values free (the one
        the plan recomputes most, then the others from the least recomputed), then one run of
        instants, the rest fixed to the plan and started from it; again around each improvement
        while the share lasts (module docstring, 0d)."""
        graph, budget = self.graph, self.budget
        if not (self.run_lns and self.gap_open() and self.ip_start is not None
                and (self.left() is None or self.left() > 2 * LNS_MIN_S)):
            return
        until = None if self.limit is None else \
            _time.perf_counter() + (LNS_SWAP_SHARE if self.swap else LNS_SHARE) * self.left()
        regions = instant.neighbourhoods(graph, LNS_PARTS)
        counts = simulate(graph, self.ip_start, self.bandwidth).compute_counts
        regions.sort(key=lambda r: sum((counts[v] - 1) * graph.nodes[v].recompute_cost for v in r))
        regions = regions[-1:] + regions[:-1]  # the most recomputed first, then the others from the least
        # then time windows (every value free in a run of instants), the most recomputed first
        windows = instant.time_windows(graph, LNS_PARTS)
        windows.sort(key=lambda w: -recompute_in(graph, self.ip_start, w))
        hoods = [{"region": r} for r in regions] + [{"instants": w} for w in windows]
        self.tell("neighbourhood search")
        stale, searched, k = 0, 0, 0
        moments: dict[int, bool] = {}  # intervals whose rebuilds overflowed in every order: rows there from then on
        while stale < len(hoods) and self.gap_open():
            self.collect()  # (a worker's plan, or a bound that closes the gap)
            if not self.gap_open():
                break
            rest = None if until is None else until - _time.perf_counter()
            if rest is not None and rest < LNS_MIN_S:
                break
            hood = hoods[k % len(hoods)]
            k += 1
            before = self.best_time
            try:
                out = instant.solve(graph, budget, threads=self.threads, start=self.ip_start, **hood,
                                    time_limit=None if rest is None else max(LNS_MIN_S, min(rest, LNS_REGION_S)),
                                    backend=self.ip_backend, moments=dict(moments) or None)
            except SolverError as e:
                log.info("ilp-scalable: neighbourhood search stopped (%s)", e)
                break
            searched += 1
            over = self.offer(out["schedule"], "neighbourhood search")
            while self.overflowed(out, before):
                # its plan peaks above the budget inside some stages in every rebuild order tried:
                # the same neighbourhood again with rebuild-moment rows in those intervals (instant
                # "Rebuild moments on demand"), strict ones where the rows alone did not keep it in
                rest = None if until is None else until - _time.perf_counter()
                if not over or all(moments.get(t) for t in over) or (rest is not None and rest < LNS_MIN_S):
                    break
                moments.update({t: t in moments for t in over})
                log.info("ilp-scalable: neighbourhood %s again with rebuild moments at %s", hood, moments)
                try:
                    out = instant.solve(graph, budget, threads=self.threads, start=self.ip_start, **hood,
                                        time_limit=None if rest is None else min(rest, LNS_REGION_S),
                                        backend=self.ip_backend, moments=dict(moments))
                except SolverError as e:
                    log.info("ilp-scalable: neighbourhood search with rebuild moments failed (%s)", e)
                    break
                over = self.offer(out["schedule"], "neighbourhood search (rebuild moments)")
            stale = 0 if self.best_time < before * (1 - 1e-9) else stale + 1
        self.notes["neighbourhoods"] = searched

    # ---- 1-3. coarse ILP and expansion ---------------------------------------------------------
    def coarse(self) -> None:
        """Coarsen, solve the coarse graph exactly, expand; finer coarsening when the coarse graph
        cannot fit the budget, or, with time to spare and no fine step after it, to improve."""
        graph, budget, limit = self.graph, self.budget, self.limit
        n_coarse = min(graph.n, self.coarse_nodes or COARSE_TARGET)
        act = max(1, budget - graph.fixed_bytes)
        cap = act / 3
        coarse_report = None
        tries = 0
        co = None
        # does the fine LP (and RINS after it) fit the time? then the coarse solve gets a smaller share
        follow = graph.n <= self.lp_max_nodes and (limit is None or LP_S_PER_UNIT * self.units <= 0.3 * limit)
        first_need = 2.0 if self.best is None or limit is None else max(2.0, min(COARSE_MIN_S, 0.1 * limit))
        while (self.left() is None or self.left() > (first_need if tries == 0 else max(2.0, 0.4 * limit))) \
                and (self.best is None or self.gap_open()):  # (no work once the gap asked for is met)
            tries += 1
            groups = fit_groups(graph, choose_groups(graph, n_coarse, cap), budget)
            co = coarsen(graph, groups)
            log.info("ilp-scalable: coarse graph of %d nodes (asked %d, run bytes <= %.3g)", co.graph.n, n_coarse,
                     cap)
            self.tell("coarse")  # the phase starts (CBC's log may show no incumbent of its own)
            if co.graph.n > COARSE_MAX or (co.graph.n >= graph.n and graph.n > COARSE_MAX):
                break
            try:
                cs = self.coarse_solve(co, follow)
            except InfeasibleBudgetError:
                # runs too large for this budget: finer runs, up to COARSE_MAX nodes
                if co.graph.n >= graph.n or co.graph.n >= COARSE_MAX or tries >= 4:
                    break
                n_coarse, cap = min(COARSE_MAX, int(co.graph.n * 1.5) + 1), cap / 2
                continue
            except SolverError as e:
                log.info("ilp-scalable: the coarse ILP gave no schedule in its share of the time (%s)", e)
                break
            if cs is None:
                break
            coarse_report = dict(cs.report)
            # the phase's own incumbent, said once it ends (CBC's log, polled while it runs, may
            # show none when it ends between two polls)
            self.tell("coarse", coarse_report.get("objective"), None)
            log.info("ilp-scalable: coarse ILP %s, objective %.6g (%.1f s)", cs.report.get("status"),
                     cs.report.get("objective"), _time.perf_counter() - self.t0)
            if co.graph.n == graph.n:
                self.offer(cs, "exact ILP")
            else:
                try:
                    fine, source = expand(co, cs), "coarse ILP"
                    res = simulate(graph, fine, self.bandwidth)
                    if res.valid and res.peak_bytes > budget:
                        # a recomputed run's members that no node of their stage reads are held
                        # to the stage's end, which the coarse model does not count: free them
                        # once made (an op list)
                        fine, source = Schedule(early_frees(graph, fine.ops)), "coarse ILP (early frees)"
                    self.offer(fine, source)
                except ValueError as e:   # (an op list that does not cast into stages: nothing to offer)
                    log.info("ilp-scalable: the coarse schedule does not expand: %s", e)
                except AssertionError as e:  # pragma: no cover - a modelling bug
                    log.error("ilp-scalable: could not expand the coarse schedule: %s", e)
            if follow or co.graph.n >= min(graph.n, COARSE_MAX):
                break
            # time to spare and no fine step to run: a finer coarsening (kept only if it is better)
            n_coarse = min(COARSE_MAX, int(co.graph.n * 1.5) + 1)
        self.notes["coarse_nodes"] = co.graph.n if co is not None else None
        if coarse_report is not None and co is not None:
            self.notes["coarse_status"] = coarse_report.get("status")
            self.notes["coarse_objective"] = coarse_report.get("objective")
            self.notes["coarse_wall_time"] = coarse_report.get("wall_time")
            if co.graph.n == graph.n and coarse_report.get("lower_bound") is not None:
                self.raise_bound(coarse_report["lower_bound"], "exact ilp")

    def coarse_solve(self, co, follow: bool) -> Schedule | None:
        """The exact ILP on the coarse graph for its share of what is left; None when no time is
        left for it.  Raises `InfeasibleBudgetError` when the coarse graph cannot fit the budget."""
        budget = self.budget
        check_budget(co.graph, budget)
        if not self.swap and not self.recompute_backward and bounds.knapsack_bound(co.graph, budget) is None:
            raise InfeasibleBudgetError("coarse graph", budget)
        # the coarse solve gets a share of what is left (most of it when nothing follows), less
        # when CBC, overrunning its limit in a root LP until the watchdog stops it, could end past
        # the call's limit
        limit_c = self.share(0.22 if follow else 0.6)
        within = None if limit_c is None else mip.cbc_limit_within(self.left())
        if within is not None and limit_c > within:
            limit_c = within
            if limit_c < 1.0 and self.best is not None:
                log.info("ilp-scalable: no time left for the coarse ILP")
                return None
            limit_c = max(1.0, limit_c)
        return exact.solve(co.graph, budget, swap=self.swap, time_limit=limit_c, gap=self.gap, threads=self.threads,
                           backend=self.backend, bandwidth=self.bandwidth, recompute_backward=self.recompute_backward,
                           msg=self.msg, use_instant_ip=self.use_instant_ip,
                           progress=(lambda d: self.tell("coarse", d.get("incumbent"), None))
                           if self.progress else None)

    # ---- 4. the fine model ---------------------------------------------------------------------
    def lp_bound(self):
        """4a: the full LP relaxation (sizes rounded down): a bound for the whole graph, and the
        guide of RINS; its model, or None."""
        graph, left = self.graph, self.left
        lp_share = 0.4 if graph.n <= self.refine_max_nodes else 0.95
        if not (graph.n <= self.lp_max_nodes and self.best is not None and (left() is None or left() > 2.0)
                and (left() is None or LP_S_PER_UNIT * self.units <= lp_share * left()) and self.gap_open()):
            return None
        try:
            # sizes rounded down (exact when nothing needs rounding): a relaxation, so a valid bound
            lp_model, lp = checkmate.solve_relaxation(graph, self.budget, swap=self.swap, bandwidth=self.bandwidth,
                                                      recompute_backward=self.recompute_backward, round_down=True,
                                                      time_limit=self.share(lp_share))
        except SolverError as e:
            log.info("ilp-scalable: no LP bound in time (%s)", e)
            return None
        if lp is None:
            return None
        self.raise_bound(lp, "lp_relaxation")
        return lp_model

    def refine(self, lp_model) -> None:
        """4b-c: the fine ILP around the incumbent (RINS: variables on which the LP and the
        incumbent agree are fixed), then, on small graphs, the whole fine ILP, both warm-started."""
        graph, left = self.graph, self.left
        progress = (lambda d: self.tell("refine", d.get("incumbent"), None)) if self.progress else None
        kw = dict(swap=self.swap, gap=self.gap, threads=self.threads, backend=self.backend, bandwidth=self.bandwidth,
                  recompute_backward=self.recompute_backward, msg=self.msg, progress=progress)
        room = 3.0 + 2 * BUILD_S_PER_UNIT * self.units
        if lp_model is not None and graph.n <= self.refine_max_nodes and self.staged is not None \
                and (left() is None or left() > room) and self.gap_open():
            whole = graph.n <= self.full_refine_max_nodes
            try:
                sched, _ = fine_ilp(graph, self.budget, self.staged, lp_model,
                                    time_limit=self.share(0.6 if whole else 1.0), **kw)
                self.offer(sched, "RINS fine ILP")
            except SolverError as e:
                log.info("ilp-scalable: RINS refinement failed (%s)", e)
        if graph.n <= self.full_refine_max_nodes and self.staged is not None \
                and (left() is None or left() > room) and self.gap_open():
            try:
                sched, fb = fine_ilp(graph, self.budget, self.staged, None, time_limit=left(), **kw)
                self.offer(sched, "fine ILP")
                self.raise_bound(fb, "fine ilp")  # (it drops a bound above the incumbent: CBC's garbage)
            except SolverError as e:
                log.info("ilp-scalable: refinement failed (%s)", e)

    # ---- the end -----------------------------------------------------------------------------
    def wait_for_worker(self) -> None:
        """The worker's last word (its time limit ends with ours), or its interim bound."""
        if not self.gap_open():
            return
        until = None if self.left() is None else _time.perf_counter() + max(0.0, self.left()) + WORKER_START_S
        while self.workers and self.workers[0].result is None and self.gap_open():
            rest = None if until is None else until - _time.perf_counter()
            self.collect(wait=5.0 if rest is None else max(0.0, min(5.0, rest)))
            if rest is not None and rest <= 5.0:
                break

    def late_bound(self) -> None:
        """5: time the steps before left unused goes to the closure IP at instants spread over
        the step (`bounds.spread_closure_bound`), up to `LATE_BOUND_S`."""
        left = self.left()
        if self.recompute_backward or self.best is None or not self.gap_open() or (left is not None and left < 5.0):
            return
        limit = LATE_BOUND_S if left is None else min(LATE_BOUND_S, 0.8 * left)
        self.raise_bound(bounds.spread_closure_bound(self.graph, self.budget, limit, self.threads, swap=self.swap,
                                                     bandwidth=self.bandwidth), "closure IP, spread instants")

    def result(self) -> Schedule:
        if self.best is None:
            raise SolverError(f"ilp-scalable found no schedule within {self.limit} s (no baseline fits and the "
                              "coarse ILP gave none); raise --time-limit or use the exact ILP")
        if self.bound > self.best_time:  # float noise
            self.bound = self.best_time
        g_ = gap_of(self.best_time, self.bound)
        proven = g_ is not None and g_ <= 1e-9
        report = {"name": "ilp", "mode": "scalable", "backend": self.backend, "swap": self.swap,
                  "time_limit": self.limit, "gap_limit": self.gap, "wall_time": _time.perf_counter() - self.t0,
                  "status": "optimal" if proven else "feasible", "objective": self.best_time,
                  "lower_bound": self.bound, "gap": 0.0 if proven else g_, "bound_from": self.bound_from,
                  "incumbent_from": self.best_from, **self.notes}
        self.best.report = report
        self.tell("done")
        return self.best


def fine_ilp(graph: Graph, budget_bytes: int, start: Schedule, guide: "checkmate.Model | None", *, swap: bool,
             time_limit: float | None, gap: float, threads: int | None, backend: str, bandwidth: float | None,
             recompute_backward: bool, msg: bool,
             progress: Callable[[dict], None] | None) -> tuple[Schedule | None, float | None]:
    """(schedule or None, bound or None) from the fine ILP warm-started at `start`.

    With `guide` (a solved LP relaxation of the same graph) every binary whose LP value and
    warm-start value are both 0 (both 1) is fixed at 0 (at 1): relaxation-induced neighbourhood
    search, a restriction whose bound is not reported.  Without it, the whole model: CBC's bound
    is returned when the model is exact (not quantised)."""
    t0 = _time.perf_counter()
    m = checkmate.build_model(graph, budget_bytes, swap=swap, bandwidth=bandwidth,
                              recompute_backward=recompute_backward)
    checkmate.set_warm_start(m, start)
    fixed = 0
    if guide is not None:
        eps = RINS_EPS
        for name in ("R", "SO", "SI", "SF"):
            lpd, d = getattr(guide, name), getattr(m, name)
            for key, v in d.items():
                g_ = lpd.get(key)
                x = g_.varValue if g_ is not None else None
                if x is None:
                    continue
                w = v.varValue  # the warm start's value
                if x <= eps and w == 0:
                    v.upBound = 0
                    fixed += 1
                elif x >= 1 - eps and w == 1:
                    v.lowBound = 1
                    fixed += 1
    # CBC's limit on a warm-started run is CPU time (see mip.run_cbc), which a loaded machine
    # stretches in wall time, and reading the solution back comes on top: keep a margin
    rest = None if time_limit is None else max(1.0, 0.8 * (time_limit - (_time.perf_counter() - t0)) - 1.0)
    log.info("ilp-scalable: %s fine ILP, %d variables (%d fixed), %.1f s", "RINS" if guide is not None else "whole",
             m.meta["variables"], fixed, rest or -1)
    out = mip.run(m, backend, rest, gap, threads, True, msg, progress=progress)
    if out["infeasible"]:  # CBC's preprocessing can say so although the warm start fits
        log.info("ilp-scalable: CBC called the fine model infeasible (%s); its warm start fits", out["result"])
        return None, None
    sched = None
    if out["sol_status"] in (1, 2) and out["objective"] is not None and checkmate.integral(m):
        sched = checkmate.schedule_from_model(graph, m)
    b = out["bound"] * m.time_unit if out["bound"] is not None and guide is None and not m.meta["quantised"] else None
    return sched, b


__all__ = ["solve", "ScalableSearch", "fine_ilp", "model_units", "default_threads", "gap_of", "AUTO_THRESHOLD",
           "BASELINES", "INSTANT_MAX_VARS", "LNS_MAX_VARS", "WORKER_MAX_VARS"]
