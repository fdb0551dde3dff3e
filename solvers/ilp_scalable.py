r"""The ILP's scalable mode: baselines, a coarse exact ILP, expansion, refinement, and a bound
for the whole graph.

Checkmate's model has ~n^2 R and S variables plus one FREE per (stage, edge); CBC solves it up
to ~100 nodes and struggles beyond ~130 (a 219-node ResNet-50 graph builds 86k variables and
CBC's preprocessing even calls it infeasible).  This mode plans larger graphs in steps, keeps
the best schedule the simulator accepts, and reports a lower bound that holds for the WHOLE
graph.  `ilp.solve(mode="auto")` uses it above `AUTO_THRESHOLD` = 100 nodes (where the exact
model stops proving optimality in a minute on 2 cores); mode="scalable"/"exact" force either.

0. Baselines (`_baselines`): DTR's variants (cast into stages, and as bare op lists, which the
   cast can push over the budget), Chen's, revolve, checkpoint-all; the fastest that fits is
   the first incumbent.
0b. Shift search (`ilp.shift_search`), on graphs up to `REFINE_MAX_NODES`: the fine recompute-only
   ILP restricted to the best schedule's recomputations, each allowed in its own stage or the
   next (no other R is created), for up to `SHIFT_SHARE` of the time, again around each
   improvement (`SHIFT_ROUNDS`; once where the neighbourhood search 0d follows).  A DTR schedule cast into stages recomputes each value once
   per use; letting CBC choose which stage's copy serves which uses, and which to keep instead,
   is worth a lot: U-Net d3 at 0.3x 1.629 -> 1.372 (the coarse ILP reached 1.512), ResNet-50 at
   0.5x 1.076 -> 1.065, unet(3) at 0.6x 304 -> 295 (the exact optimum).
0c. The instant IP (`instant_ip`, up to `INSTANT_MAX_VARS` variables), warm-started from the
   best plan, for `INSTANT_SHARE` of what is left: Checkmate's model kept only at the instants
   of first computes, so it is a fifth the size, yet a recomputation still needs its inputs.
   Its bound is the strongest this mode has at tight budgets (U-Net d3 at 0.3x: 1.183 where
   the window IP gives 1.132; ResNet-50 d2 at 0.3x: 1.172 against 1.122), and where its optimal
   plan also fits inside every stage it proves it (U-Net d3 at 0.5x: 1.0304 in 4 s); a proven
   optimum that peaks over in every rebuild order gets rebuild-moment rows where it does, as in
   the exact mode (`instant_ip.solve_on_demand`; random_layered(20, seed 2) at 0.6x: 157 ->
   159, proven).  A plan of its that peaks above the budget inside a stage goes to one shift
   search.  HiGHS solves it
   when installed (the `highs` extra; `ilp._run` hands it the plan as a MIP start through
   highspy, which PuLP does not): its cut loop lifts the root bound further than CBC's, and it
   proves U-Net d3 at 0.5x as fast.  Where 0d follows, it gets `INSTANT_HIGHS_SHARE` and leaves
   the rest to it.  With `threads` >= 2 it runs instead in a process of its own
   (`InstantWorker`), started right after step 0 for `WORKER_SHARE` of the time, while 0b, 0d
   and the later steps go on beside it with one thread fewer; its plan and bound are taken when
   it ends (between neighbourhoods, or at the end), and its whole model's bound as soon as it has
   one (an interim result: random_layered(150) at 0.95x proven in 94 s instead of 180).  Recompute-only, on a graph with tight
   backward instants, the step keeps `SPLIT_SHARE` of its time (all but `SPLIT_WHOLE_MAX_S` of a
   long one) for the split bound
   (`instant_ip.split_bound`: the instant IP cut at those instants into windows, each solved on
   its own, their optima added), run when the whole model has not proven its optimum:
   ResNet-50 d2 at 0.3x 1.1895 where the whole model plateaus at 1.1818, U-Net d3 at 0.3x
   1.1878 (1.1847).  Both the whole model and each window first get the path rows their LP
   violates (`instant_ip.add_path_rows`): U-Net d3 at 0.3x, the whole model's bound 1.1847 ->
   1.2415 in the worker's 70 s, above the split's sum (1.2293).  With HiGHS and a long enough
   limit (`COUPLE_SHARE` of it at least `COUPLE_MIN_S`), the split's start is then coupled
   (`instant_ip.couple_split`: "Coupled windows" ending at the split's tightest instant, its
   windows after it kept) for `COUPLE_SHARE` of the step (at most `COUPLE_MAX_S`); the split
   then runs first (`SPLIT_COUPLED_SHARE`), and the whole model, between them, gives up where
   its HiGHS bound is still below the split's after `WHOLE_GIVE_UP_SHARE` of its time (a
   `give_up` for `ilp._run`): ResNet-50 d2 at 0.3x 1.1894 -> 1.1923 in the two-minute run
   (coupled at 176, ending at 202; its whole model, at the root, gives up at ~45 s of 103);
   U-Net d3 at 0.3x 1.2415 -> 1.2411 (its whole model passes the split at once and runs 46 s
   instead of 65).
0d. Neighbourhood search in the instant IP (up to `LNS_MAX_VARS` variables; recompute-only
   plans; with swap too, for `LNS_SWAP_SHARE` of the time, the coarse ILP after it being where swap plans come from: U-Net
   d3 and ResNet-50 d2 at 0.3x with swap 1.312 / 1.274 -> 1.279 / 1.257): free the P and N of one region of
   forward values (`instant_ip.neighbourhoods`: contiguous runs with equal numbers of
   variables, ends moved to articulation points), fix every other to the best plan, start from
   it, and solve (HiGHS when installed) for up to `LNS_REGION_S`; the region the plan
   recomputes most goes first, then the others from the least recomputed (little to rearrange:
   HiGHS settles them quickly, and what they change frees memory for the costly ones), and the
   regions take turns, then the time windows (`instant_ip.time_windows`: every value free in a
   run of instants, the run the plan recomputes most in first), while `LNS_SHARE` of the time
   lasts and one of them still improves.  The plans it finds are simulated like any other
   (they can peak above the budget inside a stage); one that does not fit in id order is
   offered in the best rebuild order `stage_order` finds inside the stages that peak over (the
   same computes, the same time: a bare op list).  When no order fits some stages, the plan is
   replayed under the budget with evictions (`stage_order.evict_to_fit`: a few more rebuilds;
   U-Net d3 at 0.3x: a plan of 1.2784 that overflows by 27 MiB fits at 1.2792, the incumbent
   of the 120 s run, where the rows below gave 1.2808), and the same neighbourhood is solved
   again with rebuild-moment rows in those intervals (instant_ip "Rebuild moments on
   demand"), strict rows where they overflow again; the intervals stay in the model for the
   later neighbourhoods.  ResNet-50 d2 at 0.3x: the stem and layer1
   freed, 30 s: 1.2743 -> 1.2605; then layers 3-4 (10 s) 1.2571 and layer2 1.2494 (72 s in
   all; in the old order, layer2 before layers 3-4, 134 s).  U-Net d3 at 0.3x, whose plain
   plans overflow at rebuilt concatenations: the decoder's region 1.3123 -> 1.2849 in another
   rebuild order (session 9, strict rows everywhere: 1.3081), then that region with rows at
   stages 70, 78, 82 and 86 and the window (64, 90] 1.2808 (1.3081 -> 1.2808, 7.3 % from the
   bound, in the 120 s run).
1. Coarsen (`choose_groups`, `fit_groups`, `coarsen`).  The node ids 0..n-1 are cut into
   contiguous runs of one kind (forward runs, the loss, backward runs); each run becomes one
   node of a quotient graph: time = sum of its members' times, bytes = sum of their bytes,
   workspace W_X = max_j (W_{x_j} - sum_{l>j} M_{x_l})^+, edges = the edges between runs.  On
   a Checkmate-layout graph (forward 0..m-1, loss m, backward of v at 2m-v) the backward runs
   mirror the forward ones, and each forward run's last node is a run of its own, so that the
   coarse model can keep a block's output and recompute its interior.  Cut points come from a
   DP over positions that balances the runs' time and bytes (a run costs (time/tau)^2 +
   (bytes/mu)^2 + 2, tau and mu the per-run targets, so about K runs come out) and charges a
   cut 4x the bytes that cross it other than the run's last output: runs end at articulation
   points and narrow waists (block boundaries) where they can.  `fit_groups` halves runs until
   every coarse node fits the budget with its inputs; when the coarse ILP still finds the budget
   infeasible, the runs are made finer (up to `COARSE_MAX` coarse nodes).
2. Solve the coarse graph with the exact ILP (`ilp.solve(mode="exact")`, warm-started as usual).
3. Expand (`expand`).  Coarse stage T (first compute of run X = x_1..x_m) becomes fine stages
   x_1..x_m: stage x_1 recomputes every member of every run the coarse stage recomputes (in id
   order, which is the coarse order since runs are contiguous) and computes x_1; stage x_j
   computes x_j.  Transfers of a run apply to all its members (swap-outs and fetches in stage
   x_1, prefetches in the stage of the run's last member).  Keeps are the minimal ones the
   computes need (`ilp.minimal_keep`), then `ilp.prune_waste`.  Why it fits the budget: at
   every fine compute the resident values are members of runs the coarse model holds at the
   same point, the run being computed has allocated at most its full bytes, and the workspace
   term covers the rest; the coarse model rounds sizes up, never down.  The recompute-only time
   is at most the coarse objective (tested); with swap the simulator decides.  `simulate`
   checks every candidate either way.
4. Refine, where the fine model is small enough for the time left (predicted from
   `model_units` and constants measured on this machine, because CBC does not honour its time
   limit while it solves a root LP):
   a. the LP relaxation of the full fine model, sizes rounded down (a bound, see below);
   b. RINS: the fine ILP with every binary fixed on which that LP and the incumbent agree
      (both 0 or both 1), warm-started from the incumbent: a small neighbourhood CBC searches
      quickly (it is what improves U-Net at 0.5x; at tight budgets the LP and DTR agree on
      nearly every R and nothing is left to search);
   c. on graphs up to `FULL_REFINE_MAX_NODES`, the whole fine ILP warm-started from the best
      schedule: CBC can only improve on it, and its bound is one for the whole graph.

Why the reported lower bound holds for the whole graph.  It is the largest of
* the no-recomputation time sum_v C_v (every node runs at least once);
* the LP relaxation of the full fine model with sizes rounded down and the budget up
  (`ilp.solve_relaxation(round_down=True)`: a relaxation of the exact model even when sizes
  need quantising), where it fits the time;
* CBC's bound on the whole fine model (step 4c; only when the model is not quantised);
* CBC's bound on the *instant IP* (`instant_ip`; backward never recomputed; proof in that
  module's docstring), a relaxation of the whole fine model;
* the sum of the instant IP's windows between tight instants (`instant_ip.split_bound`, proof
  in "Split at tight instants" there);
* (recompute only, chains) revolve's count on the instant relaxation, `griewank.chain_bound`
  (Griewank's theorem; the mapping is in its docstring): exact on unit chains;
* the *window IP*, `window_bound` (with or without swap; backward never recomputed): one binary
  per (forward value, program use) saying whether the value is absent somewhere between the
  use before and this one, one row per instant; proof in its docstring.  It dominates the
  knapsack bound below and needs CBC for 0.01-0.2 s on the zoo graphs;
* (recompute only, backward never recomputed) the *moment knapsack* bound, `knapsack_bound`:
  take the instant node t is computed for the first time (stage t).  Every value v < t that a
  node > t reads is then either resident or computed again later (cost C_v each; without swap
  there is no third way, and a backward value or the loss cannot be recomputed, so it must be
  resident).  Resident bytes at that instant are at most cap_t = B - fixed - M_t - W_t and
  include t's inputs P_t, so the recomputation still to come costs at least
  min { sum_{v in N_t \ K} C_v : P_t \subseteq K, sum_{v in K} M_v <= cap_t },
  which the fractional knapsack bounds from below.  Every schedule pays it, so
  total_time + max_t of it is a lower bound.  When even the forced residents do not fit
  (`forced_need`), no schedule exists and the budget is reported infeasible.
A coarse model's objective or bound is never used as a bound: coarsening restricts the
schedules (it is an upper-bound device only); RINS's bound is not used either.

Status is "optimal" only when the bound meets the incumbent; otherwise "feasible" with
``lower_bound``, ``gap`` and where each came from (``incumbent_from``, ``bound_from``).
`time_limit` covers the whole call: each step gets a share of what is left (CBC gets 80 % of
its share less a second, since a warm-started CBC counts CPU time), and the best schedule so
far is returned when it runs out.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time as _time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pulp

from remat.core.errors import InfeasibleBudgetError, SolverError
from remat.core.graph import Graph, Node
from remat.core.schedule import Schedule, Stage
from remat.core.simulate import simulate

from . import griewank, ilp, instant_ip, register, stage_order

log = logging.getLogger(__name__)

AUTO_THRESHOLD = 100   # mode="auto": graphs with more nodes than this use the scalable mode
COARSE_TARGET = 60     # nodes of the coarse graph the first try aims at
COARSE_MAX = 140       # never hand the exact ILP a coarse graph larger than this
COARSE_MIN_S = 10.0    # with a plan in hand, start the coarse solve only with this much left (or a tenth of the limit;
                       # it overran a 5 s remainder by 11 s at 120 s)
LP_MAX_NODES = 320     # solve the full LP relaxation (bound, RINS guide) up to this many nodes
REFINE_MAX_NODES = 320  # run the RINS-restricted fine ILP up to this many nodes
FULL_REFINE_MAX_NODES = 100  # and the whole fine ILP (warm-started) up to this many
RINS_EPS = 1e-6        # RINS fixes a binary where the LP is within this of the incumbent
GAP_EPS = 1e-9         # a gap this small is met (the bound and the simulator round differently)
SHIFT_SHARE = 0.2      # of the time left, for shift searches around the best schedule (step 0b; 0.35 until session 9)
SHIFT_ROUNDS = 4       # at most this many, each around the last one's schedule
INSTANT_SHARE = 0.85   # of the time left, for the instant IP (step 0c)
INSTANT_HIGHS_SHARE = 0.45  # of the time left, for the instant IP on HiGHS when the neighbourhood search follows
LNS_SHARE = 0.95       # of the time left after step 0c, for the neighbourhood search (step 0d; 0.85 until session 9:
#                        where it runs, the coarse ILP and RINS after it have not given a zoo graph its plan)
LNS_SWAP_SHARE = 0.6   # with swap: its plans are recompute-only, the coarse ILP after it may swap
LNS_PARTS = 3          # regions it frees one at a time
LNS_REGION_S = 40.0    # at most this long on one region (ResNet-50 at 0.3x: 15 s finds nothing in layer1, 30 s does;
#                        layer2 from the 1.2571 plan: 30 s give a plan that peaks over, 40 s give 1.2494)
LNS_MIN_S = 5.0        # and at least this long
INSTANT_MAX_VARS = 40_000  # and only with at most this many P and N variables (GPT-2 d3, 46k: no root LP in 50 s)
LNS_MAX_VARS = 60_000  # the neighbourhood search up to this many (a region fixes two thirds of them: GPT-2 d3 at 0.32x,
#                        46k, 1.3018 -> 1.2741 in its first region's 41 s)
WORKER_SHARE = 0.9     # with threads >= 2: of the time left after step 0, for the instant IP in a worker process
WORKER_START_S = 3.0   # what starting the worker (a fresh interpreter, imports, the model) costs it at most
WORKER_MAX_VARS = 60_000  # the worker's instant IP may be larger: it has nearly all the time
SPLIT_SHARE = 0.35     # of step 0c's time, for the split bound after the instant IP (where the graph has tight instants),
SPLIT_MIN_S = 25.0     # and at least this long, up to 60 % of the step (its first window needs a root LP and cuts)
SPLIT_WHOLE_MAX_S = 150.0  # and where it follows, the whole model runs at most this long (its bound plateaus: U-Net d3
                       # at 0.3x 1.183 from 40 s to 540 s; the split's hard window needs the time: 0.1688, proven in 1525 s)
COUPLE_SHARE = 0.4     # with HiGHS: of step 0c's time, for coupling the split's start (`instant_ip.couple_split`),
COUPLE_MIN_S = 30.0    # where that is at least this long (ResNet-50 d2 at 0.3x: it passes the split after ~40 s)
COUPLE_MAX_S = 300.0   # and at most this long (a long limit's rest goes to the split, which runs first);
SPLIT_COUPLED_SHARE = 0.15  # the split then runs first, for this share (ResNet-50 d2 at 0.3x: 1.1894 in 15 s as in 35),
                       # the whole model the rest (U-Net d3 at 0.3x: 1.2411 in 45 s, 1.2415 in 70)
WHOLE_GIVE_UP_SHARE = 0.3  # and it gives up, for the coupling, where its bound is still below the split's after this
                       # share of its time (ResNet-50 d2 at 0.3x: at the root, 1.1734 after 58 s; U-Net d3 at
                       # 0.3x passes the split in 8 s)


def _recompute_in(graph: Graph, schedule: Schedule, window: tuple[int, int]) -> float:
    """Seconds a schedule spends recomputing between instants a and b (the intervals a+1..b;
    a recomputation belongs to the interval of the next first compute)."""
    a, b = window
    seen: set[int] = set()
    spent, pending = 0.0, 0.0
    for op in schedule.ops:
        if op.op != "compute":
            continue
        if op.node in seen:
            pending += graph.nodes[op.node].time
            continue
        seen.add(op.node)
        if a < op.node <= b:
            spent += pending
        pending = 0.0
    return spent


# ---- coarsening -------------------------------------------------------------------------------
@dataclass
class Coarsening:
    """A quotient of `fine` by contiguous runs of node ids (`groups[X]` = members of coarse X)."""
    fine: Graph
    groups: list[list[int]]
    graph: Graph

    @property
    def group_of(self) -> list[int]:
        g = [0] * self.fine.n
        for x, members in enumerate(self.groups):
            for v in members:
                g[v] = x
        return g


def checkmate_layout(graph: Graph) -> int | None:
    """m if the graph is forward 0..m-1, loss m, backward m+1..2m (as `from_forward` and
    `remat.trace` build them), else None."""
    n = graph.n
    if n % 2 == 0:
        return None
    m = n // 2
    kinds = [v.kind for v in graph.nodes]
    if kinds[:m] == ["forward"] * m and kinds[m] == "loss" and kinds[m + 1:] == ["backward"] * m:
        return m
    return None


def _cut_run(graph: Graph, lo: int, hi: int, k: int, cap_bytes: float) -> list[int]:
    """Boundaries lo = b_0 < b_1 < ... < b_r = hi splitting [lo, hi) into about k runs (DP).

    A run [p, q) costs (time/tau)^2 + (bytes/mu)^2 + 2 plus cross(q)/mu, where cross(q) is the
    bytes of values in [lo, q-1) read at or after q inside [lo, hi); runs over `cap_bytes` are
    not allowed (single nodes always are)."""
    L = hi - lo
    if L <= 1 or k <= 1 and sum(graph.nodes[v].bytes for v in range(lo, hi)) <= cap_bytes:
        return [lo, hi]
    k = max(1, min(k, L))
    T = [0.0] * (L + 1)
    M = [0.0] * (L + 1)
    for j in range(L):
        T[j + 1] = T[j] + graph.nodes[lo + j].time
        M[j + 1] = M[j] + graph.nodes[lo + j].bytes
    tau = T[L] / k or 1.0
    mu = M[L] / k or 1.0
    # cross[q] (q = boundary index relative to lo): bytes of v < q-1 with a consumer >= q in the run
    diff = [0.0] * (L + 2)
    for v in range(lo, hi):
        last = max((c for c in graph.succs[v] if c < hi), default=-1)
        a, b = v - lo + 2, last - lo  # boundaries q in [v+2, last] (relative)
        if last >= 0 and a <= b:
            diff[a] += graph.nodes[v].bytes
            diff[b + 1] -= graph.nodes[v].bytes
    cross = [0.0] * (L + 1)
    run = 0.0
    for q in range(L + 1):
        run += diff[q]
        cross[q] = run
    max_len = max(1, min(L, 4 * -(-L // k)))
    INF = math.inf
    f = [INF] * (L + 1)
    arg = [0] * (L + 1)
    f[0] = 0.0
    for q in range(1, L + 1):
        cut = 4.0 * cross[q] / mu if q < L else 0.0
        best, bp = INF, q - 1
        for p in range(max(0, q - max_len), q):
            if f[p] == INF:
                continue
            if q - p > 1 and M[q] - M[p] > cap_bytes:
                continue
            c = f[p] + ((T[q] - T[p]) / tau) ** 2 + ((M[q] - M[p]) / mu) ** 2 + 2.0 + cut
            if c < best:
                best, bp = c, p
        f[q], arg[q] = best, bp
    cuts = [L]
    while cuts[-1] > 0:
        cuts.append(arg[cuts[-1]])
    return [lo + c for c in reversed(cuts)]


def choose_groups(graph: Graph, n_coarse: int, cap_bytes: float | None = None) -> list[list[int]]:
    """Contiguous same-kind runs of node ids, about `n_coarse` of them in all.

    Checkmate layout: forward runs from `_cut_run`, the loss alone, backward runs mirrored.
    Otherwise every maximal same-kind stretch is cut on its own, with runs in proportion to its
    length.  `cap_bytes` bounds a run's bytes (single nodes excepted)."""
    n = graph.n
    cap = math.inf if cap_bytes is None else cap_bytes
    m = checkmate_layout(graph)
    if m is not None:
        k = max(1, (n_coarse - 1) // 4)
        b = _cut_run(graph, 0, m, k, cap)
        fwd: list[list[int]] = []
        for j in range(len(b) - 1):
            run = list(range(b[j], b[j + 1]))
            # the run's last node is what later runs read: its own coarse node, so that the coarse
            # model can keep the run's output and recompute the interior (checkpointing)
            fwd += [run[:-1], run[-1:]] if len(run) > 1 else [run]
        return mirror(fwd, m)
    groups: list[list[int]] = []
    start = 0
    for v in range(1, n + 1):
        if v == n or graph.nodes[v].kind != graph.nodes[start].kind or graph.nodes[v].kind == "loss":
            k = max(1, round(n_coarse * (v - start) / n))
            b = _cut_run(graph, start, v, k, cap)
            groups += [list(range(b[j], b[j + 1])) for j in range(len(b) - 1)]
            start = v
    return groups


def mirror(fwd: list[list[int]], m: int) -> list[list[int]]:
    """Forward runs, the loss, and the backward runs that mirror them (Checkmate layout)."""
    return fwd + [[m]] + [sorted(2 * m - v for v in g) for g in reversed(fwd)]


def fit_groups(graph: Graph, groups: list[list[int]], budget_bytes: int) -> list[list[int]]:
    """Split runs until every coarse node fits the budget with its inputs (`ilp._check_budget`'s
    test on the coarse graph): the run with the most bytes among an offending node and its
    inputs is halved (mirrored on a Checkmate layout), one at a time."""
    m = checkmate_layout(graph)
    groups = [list(g) for g in groups]
    while True:
        co = coarsen(graph, groups)
        cg = co.graph
        need = [v.bytes + v.workspace_bytes + sum(cg.nodes[u].bytes for u in set(cg.preds[v.id])) + cg.fixed_bytes
                for v in cg.nodes]
        bad = [x for x in range(cg.n) if need[x] > budget_bytes]
        if not bad:
            return groups
        x = max(bad, key=lambda y: need[y])
        cand = [y for y in [x, *cg.preds[x]] if len(groups[y]) > 1]
        if not cand:
            return groups  # single nodes: the fine graph itself cannot fit (the caller finds out)
        y = max(cand, key=lambda z: cg.nodes[z].bytes)
        if m is not None:
            fwd = [g for g in groups if g[0] < m]
            if groups[y][0] > m:  # a backward run: split its forward mirror
                y = next(i for i, g in enumerate(fwd) if 2 * m - g[0] in groups[y])
            half = len(fwd[y]) // 2
            fwd[y:y + 1] = [fwd[y][:half], fwd[y][half:]]
            groups = mirror(fwd, m)
        else:
            half = len(groups[y]) // 2
            groups[y:y + 1] = [groups[y][:half], groups[y][half:]]


def coarsen(graph: Graph, groups: list[list[int]]) -> Coarsening:
    """The quotient graph of `graph` by contiguous same-kind runs `groups` (module docstring)."""
    flat = [v for g in groups for v in g]
    if flat != list(range(graph.n)):
        raise ValueError("groups must be contiguous runs covering 0..n-1 in order")
    gof = [0] * graph.n
    nodes = []
    for x, g in enumerate(groups):
        kinds = {graph.nodes[v].kind for v in g}
        if len(kinds) != 1:
            raise ValueError(f"group {x} mixes kinds {sorted(kinds)}")
        for v in g:
            gof[v] = x
        M = [graph.nodes[v].bytes for v in g]
        W = [graph.nodes[v].workspace_bytes for v in g]
        after = [sum(M[j + 1:]) for j in range(len(g))]
        ws = max(0, max(W[j] - after[j] for j in range(len(g))))
        name = graph.nodes[g[0]].name if len(g) == 1 else f"{graph.nodes[g[0]].name}..{graph.nodes[g[-1]].name}"
        nodes.append(Node(x, name, kinds.pop(), float(sum(graph.nodes[v].time for v in g)), int(sum(M)), int(ws),
                          extra={"members": [g[0], g[-1]]}))
    edges = {(gof[a], gof[b]) for a, b in graph.edges if gof[a] != gof[b]}
    meta = dict(graph.meta)
    meta["model"] = f"coarse({graph.meta.get('model', '?')}, {len(groups)} of {graph.n})"
    meta["bandwidth"] = graph.bandwidth
    return Coarsening(graph, groups, Graph(nodes, edges, graph.fixed_bytes, meta))


def expand(co: Coarsening, coarse: Schedule) -> Schedule:
    """The fine schedule that coarse stage matrices imply (module docstring, step 3)."""
    if coarse.stages is None:
        raise ValueError("the coarse schedule has no stages")
    g, groups = co.fine, co.groups
    n = g.n
    R: list[set[int]] = [set() for _ in range(n)]
    SO: list[set[int]] = [set() for _ in range(n)]
    SI: list[set[int]] = [set() for _ in range(n)]
    SF: list[set[int]] = [set() for _ in range(n)]
    for T, st in enumerate(coarse.stages):
        first, last = groups[T][0], groups[T][-1]
        for x in st.compute:
            if x != T:
                R[first].update(groups[x])
        for v in groups[T]:
            R[v].add(v)
        for x in st.swap_out:
            SO[first].update(v for v in groups[x] if g.nodes[v].bytes > 0)
        for x in st.fetch:
            SF[first].update(v for v in groups[x] if g.nodes[v].bytes > 0)
        for x in st.swap_in:
            SI[last].update(v for v in groups[x] if g.nodes[v].bytes > 0)
    S = ilp.minimal_keep(g, R, SO, SI, SF)
    SI = [SI[t] & (S[t + 1] if t + 1 < n else set()) for t in range(n)]
    sched = Schedule.from_stages(g, [Stage(sorted(R[t]), sorted(S[t]), sorted(SO[t]), sorted(SI[t]),
                                           sorted(SF[t])) for t in range(n)])
    return ilp.prune_waste(g, sched)


# ---- bounds -----------------------------------------------------------------------------------
def forced_need(graph: Graph) -> int:
    """Whole-step bytes below which no recompute-only schedule exists: at the instant node t is
    first computed, t's output and workspace, its inputs, and every non-forward value that a
    later node reads are resident (only forward nodes are recomputed): `instant_ip.forced_loads`."""
    return max(instant_ip.forced_loads(graph), default=0) + graph.fixed_bytes


def check_forced_need(graph: Graph, budget_bytes: int) -> None:
    """Raise `InfeasibleBudgetError` (naming the bytes needed) when the budget is below
    `forced_need`: no recompute-only schedule with backward nodes run once exists."""
    need = forced_need(graph)
    if budget_bytes < need:
        raise InfeasibleBudgetError(
            f"budget {budget_bytes} bytes is below {need} bytes: at some stage a node, its inputs and the "
            f"gradients still to be read (which are never recomputed) need that much with the "
            f"{graph.fixed_bytes} fixed bytes", budget_bytes, min_feasible_lower_bound=need,
            fixed_bytes=graph.fixed_bytes)


def knapsack_bound(graph: Graph, budget_bytes: int) -> float | None:
    """Lower bound on the recompute-only time (module docstring), or None when some instant
    cannot hold what it must (the budget is infeasible)."""
    n = graph.n
    cap0 = budget_bytes - graph.fixed_bytes
    last_use = [max(s, default=-1) for s in graph.succs]
    C = graph.times
    M = graph.sizes
    # t's output, workspace and inputs, and the gradients and loss still to be read (never
    # recomputed) must be resident
    forced = instant_ip.forced_loads(graph)
    best_extra = 0.0
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
        best_extra = max(best_extra, total - kept)
    return graph.total_time + best_extra


WINDOW_IP_S = 10.0  # CBC's limit on the window IP (it solves in 0.01-0.2 s on the zoo graphs)


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
    recomputation needs its own inputs (on a unit chain it stops where the knapsack does: 122
    for 32 layers at 9 units, where the optimum is 126).  ResNet-50 (depth 2) at 0.3x: 1.122
    against the knapsack's 1.107 and the full LP's 1.115, in 0.1 s."""
    n = graph.n
    cap0 = budget_bytes - graph.fixed_bytes
    C, M = graph.times, graph.sizes
    cu = ilp._time_unit(graph)
    bw = float(bandwidth if bandwidth is not None else graph.bandwidth)
    unit = math.gcd(*[m for m in M if m > 0]) or 1
    succs = [sorted(set(s)) for s in graph.succs]
    # t's output, workspace and inputs, and the gradients and loss alive across t
    fixed = instant_ip.forced_loads(graph)
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
    base = graph.total_time / cu
    recompute = pulp.lpSum((C[v] / cu) * x for (v, _), x in zr.items())
    if swap:
        T = pulp.LpVariable("T", 0)
        prob += T
        prob.addConstraint(T >= base + recompute, "compute_stream")
        prob.addConstraint(T >= pulp.lpSum((M[v] / bw / cu) * x for (v, _), x in zs.items())
                           + pulp.lpSum((M[v] / bw / cu) * x for v, x in out_once.items()), "transfer_stream")
    else:
        prob += base + recompute
    try:
        out = ilp._run(SimpleNamespace(prob=prob, time_unit=1.0), "cbc", time_limit, 0.0, threads, False, False)
    except SolverError:
        return None
    if out["bound"] is None or out["infeasible"]:
        return None
    return max(graph.total_time, out["bound"] * cu)


# ---- the solver -------------------------------------------------------------------------------
# Seconds per unit of `model_units` to build the fine model in PuLP, and to build and solve its LP
# relaxation with CBC, measured on this project's 2-core machine (a 219-node ResNet-50 graph:
# 62k units, 7 s and 22 s; a 301-node random DAG: 349k units, 51 s and ~110 s).  CBC does not
# honour a time limit while it solves the root LP, so the LP and the refinement run only when
# the prediction fits the time they are given.
BUILD_S_PER_UNIT = 1.5e-4
LP_S_PER_UNIT = 3.5e-4


# ---- step 0c, in line or in a process of its own -----------------------------------------------
def instant_step(graph: Graph, budget_bytes: int, *, time_limit: float | None, swap: bool = False,
                 threads: int | None = None, backend: str = "cbc", interim: Callable[[dict], None] | None = None,
                 **options) -> dict:
    """Step 0c: the instant IP (`instant_ip.solve`, `options` passed on); when it proves an
    optimum whose plan peaks over in every rebuild order, rebuild-moment rows where it does
    (`instant_ip.solve_on_demand`); and when it does not
    prove its optimum, recompute only, on a graph with tight backward instants, the split bound
    (`instant_ip.split_bound`) for the rest of the time: with a limit, the split bound keeps
    `SPLIT_SHARE` of it, or `SPLIT_MIN_S` up to 60 % of it, and all but `SPLIT_WHOLE_MAX_S` of a
    long one.  With HiGHS and a limit whose `COUPLE_SHARE` is at least `COUPLE_MIN_S`, the order
    changes: the split first (`SPLIT_COUPLED_SHARE` of the limit, or what a long one leaves), then
    the whole model (1 - `SPLIT_COUPLED_SHARE` - `COUPLE_SHARE` of it, at most `SPLIT_WHOLE_MAX_S`),
    which gives up where its bound is still below the split's after `WHOLE_GIVE_UP_SHARE` of its
    time, then, where neither proved its optimum, the coupling of the split's start
    (`instant_ip.couple_split`) with the rest (`COUPLE_SHARE`, at most `COUPLE_MAX_S`).  Returns
    `instant_ip.solve`'s dict with "split": `split_bound`'s dict or None, and "coupled":
    `couple_split`'s dict or None.  `interim`, when given, gets the whole model's result (its
    bound; no schedule, "split" and "coupled" None) as soon as it has one, before the steps after
    it: random_layered(150) at 0.95x proves its bound 1229 there at ~90 s of the worker, whose
    rebuild-moment rounds then take 80 s more."""
    t0 = _time.perf_counter()
    cuts = [] if swap else instant_ip.split_candidates(graph, budget_bytes)
    couple = bool(cuts) and time_limit is not None and COUPLE_SHARE * time_limit >= COUPLE_MIN_S \
        and backend == "highs" and ilp.highs_available()
    split = give_up = None
    if couple:  # the split first, the whole model (given up where it stays below the split), the coupling
        coupled_s = min(COUPLE_SHARE * time_limit, COUPLE_MAX_S)
        whole_s = min(SPLIT_WHOLE_MAX_S, (1 - SPLIT_COUPLED_SHARE - COUPLE_SHARE) * time_limit)
        split_s = max(SPLIT_COUPLED_SHARE * time_limit, time_limit - coupled_s - whole_s)
        split = instant_ip.split_bound(graph, budget_bytes, threads=threads, backend=backend, cuts=cuts,
                                       time_limit=split_s)
        first = min(SPLIT_WHOLE_MAX_S, max(1.0, time_limit - (_time.perf_counter() - t0) - coupled_s))
        if split is not None:
            target, check = split["bound"], WHOLE_GIVE_UP_SHARE * first
            give_up = lambda elapsed, bound: elapsed >= check and (bound is None or bound < target)  # noqa: E731
    else:
        first = time_limit if time_limit is None or not cuts else min(SPLIT_WHOLE_MAX_S, max(
            1.0, time_limit - max(SPLIT_SHARE * time_limit, min(SPLIT_MIN_S, 0.6 * time_limit))))
    out = instant_ip.solve(graph, budget_bytes, swap=swap, threads=threads, backend=backend, time_limit=first,
                           give_up=give_up, **options)
    if interim is not None and out["bound"] is not None and not out["infeasible"]:
        interim(dict(out, split=None, coupled=None, schedule=None))
    if not swap and out["proven"] and out["schedule"] is not None:
        # a proven optimum that peaks over in every rebuild order: rows where it does, as the exact
        # mode does (instant_ip "Rebuild moments on demand", which returns at once when the plan
        # fits in some order; random_layered(20, seed 2) at 0.6x: 157 -> 159, the exact optimum, proven)
        rest = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
        out = instant_ip.solve_on_demand(graph, budget_bytes, out, time_limit=rest, threads=threads,
                                         start=options.get("start"), backend=backend)
    out["split"] = out["coupled"] = None
    if cuts and not out["proven"] and not out["infeasible"]:
        if not couple:
            rest = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
            split = instant_ip.split_bound(graph, budget_bytes, threads=threads, backend=backend, time_limit=rest,
                                           cuts=cuts)
        out["split"] = split
        rest = None if time_limit is None else time_limit - (_time.perf_counter() - t0)
        if couple and split is not None and not split["proven"] and rest >= 1.0:
            out["coupled"] = instant_ip.couple_split(graph, budget_bytes, split, time_limit=rest, threads=threads)
    return out


def _worker_main(task: str, result: str) -> None:
    """The worker process's body (`python -c`): `instant_step` on the pickled (graph, budget,
    options) in `task`, its result dict (or {"error": ...}) pickled to `result`, and its interim
    result (the whole model's bound) to `result` + ".interim" when there is one."""
    def write(out: dict, path: str) -> None:
        with open(path + ".part", "wb") as fh:
            pickle.dump(out, fh)
        os.replace(path + ".part", path)

    try:
        with open(task, "rb") as fh:
            graph, budget_bytes, options = pickle.load(fh)
        out = instant_step(graph, budget_bytes, interim=lambda early: write(early, result + ".interim"), **options)
    except BaseException as e:  # noqa: BLE001 - whatever it was, the parent must hear of it
        out = {"error": f"{type(e).__name__}: {e}"}
    write(out, result)


class InstantWorker:
    """The instant IP (step 0c) solved in a process of its own beside the main search, so that with
    two cores the bound gets the whole time and steps 0b/0d are not paused for it.

    A fresh interpreter (`sys.executable -c`, the parent's `sys.path`), not a thread: HiGHS
    releases the GIL, but `ilp._run` resets HiGHS's process-wide scheduler before each solve,
    which a second HiGHS in the same process would not survive.  Nor multiprocessing: its
    "spawn" re-imports the caller's main script (a user's script without a `__main__` guard
    would run again, or fail), and "fork" copies a process whose solver threads may hold locks.
    The task and the result travel as pickles in a temporary folder.  `poll(wait)` returns
    `instant_step`'s dict once the worker has ended ({"error": ...} when it failed or died),
    None before; `interim()` its interim result, once; `close()` stops the process and removes
    the folder."""

    def __init__(self, graph: Graph, budget_bytes: int, time_limit: float | None, **options) -> None:
        self._dir = tempfile.mkdtemp(prefix="remat_worker_")
        task, self._result = os.path.join(self._dir, "task.pkl"), os.path.join(self._dir, "result.pkl")
        with open(task, "wb") as fh:
            pickle.dump((graph, budget_bytes, dict(options, time_limit=time_limit)), fh)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._errors = open(os.path.join(self._dir, "stderr.txt"), "wb")
        code = f"from remat.solvers.ilp_scalable import _worker_main; _worker_main({task!r}, {self._result!r})"
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=self._errors)
        except OSError:
            self._errors.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.result: dict | None = None
        self._interim_taken = False

    def poll(self, wait: float = 0.0) -> dict | None:
        if self.result is not None:
            return self.result
        try:
            self._proc.wait(timeout=max(0.0, wait))
        except subprocess.TimeoutExpired:
            return None
        try:
            with open(self._result, "rb") as fh:
                self.result = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            self._errors.flush()
            with open(self._errors.name, "rb") as fh:
                tail = fh.read()[-300:].decode(errors="replace").strip()
            self.result = {"error": f"the worker exited with code {self._proc.returncode} ({tail or 'no message'})"}
        return self.result

    def interim(self) -> dict | None:
        """`instant_step`'s interim result (the whole model's bound), once, when the worker has
        written one and not yet ended; None otherwise."""
        if self.result is not None or self._interim_taken:
            return None
        try:
            with open(self._result + ".interim", "rb") as fh:
                early = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        self._interim_taken = True
        return early

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._errors.close()
        shutil.rmtree(self._dir, ignore_errors=True)


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


BASELINES = ("lookahead", "dtr-eq", "dtr", "dtr-msps", "dtr-local", "checkpoint-all", "griewank", "chen-sqrtn",
             "chen-greedy-ap", "chen-greedy", "checkpoint-last-node")
SLOW_BASELINES = {"chen-greedy": 300, "checkpoint-last-node": 300}  # skipped above this many nodes


def default_threads() -> int:
    """Threads of a scalable solve whose caller named none: two where the process may use two
    cores (the instant IP's worker beside the search; on two cores ResNet-50 at 0.3x gets 1.2494
    instead of 1.2571 with one thread, U-Net at 0.3x with swap 1.2792 instead of 1.2849), else one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(2, max(1, cores))


def _gap(obj: float, bound: float | None) -> float | None:
    if bound is None or obj <= 0:
        return None
    return max(0.0, (obj - bound) / obj)


@register("ilp-scalable", "the ILP's scalable mode: coarsen at narrow points, solve exactly, expand, refine; "
                          "reports a bound for the whole graph")
def solve(graph: Graph, budget_bytes: int, **options) -> Schedule:
    """A schedule under `budget_bytes` (whole-step bytes) with a lower bound for the whole graph;
    the options and the result are `_search`'s.  A worker process it starts (threads >= 2) is
    stopped however the search ends.  `threads` not given: `default_threads()`."""
    if options.get("threads") is None:
        options["threads"] = default_threads()
    workers: list[InstantWorker] = []
    try:
        return _search(graph, budget_bytes, workers, **options)
    finally:
        for w in workers:
            w.close()


def _search(graph: Graph, budget_bytes: int, workers: list, *, swap: bool = True, time_limit: float | None = 60.0,
            gap: float = 0.0, threads: int | None = None, backend: str = "cbc", bandwidth: float | None = None,
            recompute_backward: bool = False, progress: Callable[[dict], None] | None = None,
            coarse_nodes: int | None = None, lp_max_nodes: int = LP_MAX_NODES,
            refine_max_nodes: int = REFINE_MAX_NODES, full_refine_max_nodes: int = FULL_REFINE_MAX_NODES,
            msg: bool = False, use_instant_ip: bool = True, **_: object) -> Schedule:
    """A schedule under `budget_bytes` (whole-step bytes) with a lower bound for the whole graph.

    Options as `ilp.solve`, plus `coarse_nodes` (size of the coarse graph to aim at; default
    `COARSE_TARGET`, or the graph itself when smaller), `lp_max_nodes`, `refine_max_nodes` and
    `full_refine_max_nodes` (largest graphs for the full LP bound, for RINS and for the whole
    warm-started fine ILP; 0 turns a step off) and `use_instant_ip` (step 0c, and in the coarse
    solve).  With `threads` >= 2, step 0c runs in a worker process (`InstantWorker`, one
    thread) from the end of step 0 on, beside the other steps, which get one thread fewer; it is
    appended to `workers` for the caller to stop.  Raises `InfeasibleBudgetError` when the
    budget cannot hold what must be resident, `SolverError` when no schedule was found in
    time.  `progress(dict)`
    gets {"phase", "elapsed", "incumbent", "lower_bound", "gap"} (seconds of the schedule) at
    every new incumbent or bound; during the coarse solve "incumbent" is the coarse model's,
    which its expansion matches without swap.
    """
    t0 = _time.perf_counter()
    ilp._check_budget(graph, budget_bytes)
    limit = time_limit

    def left() -> float | None:
        return None if limit is None else limit - (_time.perf_counter() - t0)

    def share(frac: float, floor: float = 1.0) -> float | None:
        rest = left()
        return None if rest is None else max(floor, rest * frac)

    best: Schedule | None = None
    best_time = math.inf
    best_from = None
    bound = graph.total_time
    bound_from = "no_recompute_time"
    notes: dict = {}
    staged: list[Schedule | None] = [None]  # the best schedule with stage matrices
    staged_time = [math.inf]
    ip_start: list[Schedule | None] = [None]  # the best schedule that maps onto the instant IP (stages, or
    ip_start_time = [math.inf]                  # an op list whose stages were reordered)

    def tell(phase: str, incumbent: float | None = None, lb: float | None = None) -> None:
        if progress is None:
            return
        inc = best_time if incumbent is None and best_time < math.inf else incumbent
        b = bound if lb is None else lb
        progress({"phase": phase, "elapsed": _time.perf_counter() - t0, "incumbent": inc, "lower_bound": b,
                  "gap": _gap(inc, b) if inc is not None else None})

    def offer(sched: Schedule | None, source: str) -> list[int]:
        """Keep `sched` if it fits and is the best; returns the stages where it peaks above the
        budget in every rebuild order tried (`stage_order.reorder`; also when evictions made
        it fit, `stage_order.evict_to_fit`), [] when it fits as it is or reordered."""
        nonlocal best, best_time, best_from
        if sched is None:
            return []
        res = simulate(graph, sched, bandwidth)
        maps = sched.stages is not None  # onto the instant IP (a start for its searches)
        over: list[int] = []
        if res.valid and res.peak_bytes > budget_bytes:  # (reorder and evict_to_fit refuse plans with transfers)
            # the instant IP's plans ignore memory inside a stage: another rebuild order in the
            # stages that peak over often fits (stage_order)
            ordered, over = stage_order.reorder(graph, sched, budget_bytes)
            res_o = simulate(graph, ordered, bandwidth) if ordered is not None and not over else None
            if res_o is not None and res_o.valid and res_o.peak_bytes <= budget_bytes:
                log.info("ilp-scalable: the %s schedule fits with another rebuild order inside its stages", source)
                sched, res, source, maps = ordered, res_o, source + " (rebuild order)", True
            else:
                # no order fits: replayed under the budget, with a few evictions and rebuilds where it peaks over
                fitted = stage_order.evict_to_fit(graph, ordered if ordered is not None else sched, budget_bytes,
                                                  worse_than=best_time if best_time < math.inf else None)
                res_e = simulate(graph, fitted, bandwidth) if fitted is not None else None
                if res_e is not None and res_e.valid and res_e.peak_bytes <= budget_bytes:
                    log.info("ilp-scalable: the %s schedule fits with evictions (%.6g -> %.6g)", source, res.time,
                             res_e.time)
                    sched, res, source, maps = fitted, res_e, source + " (evictions)", True
        if not res.valid or res.peak_bytes > budget_bytes:
            # a DTR cast may not fit, nor the instant IP's plan (it ignores memory inside a stage)
            # (expected of those; from the fine or coarse ILP it would be a modelling bug)
            say = log.debug if source.startswith(("baseline", "instant IP", "neighbourhood search")) else log.warning
            say("ilp-scalable: the %s schedule does not fit (%s; peak %d > %d); dropped",
                source, res.violation, res.peak_bytes, budget_bytes)
            return over
        if sched.stages is not None and res.time < staged_time[0] * (1 - 1e-12):
            staged[0], staged_time[0] = sched, res.time  # what can seed the fine ILP
        if maps and res.time < ip_start_time[0] * (1 - 1e-12):
            ip_start[0], ip_start_time[0] = sched, res.time  # what can seed the instant IP
        if res.time < best_time * (1 - 1e-12):
            best, best_time, best_from = sched, res.time, source
            log.info("ilp-scalable: incumbent %.6g from %s (%.1f s)", res.time, source, _time.perf_counter() - t0)
            tell(source)
        return over  # (a plan that fits only with evictions still names them)

    def gap_open() -> bool:  # is the incumbent still further from the bound than asked?
        return (_gap(best_time, bound) or 0) > max(gap, GAP_EPS)

    def raise_bound(value: float | None, source: str) -> None:
        nonlocal bound, bound_from
        if value is None:
            return
        log.info("ilp-scalable: bound %.6g from %s (%.1f s)", value, source, _time.perf_counter() - t0)
        if value > best_time * (1 + 1e-6) + 1e-12:
            # above a schedule the simulator accepted: no bound (a solver's garbage, or a bug)
            log.warning("ilp-scalable: discarding the %s bound %.6g (above the incumbent %.6g)", source, value,
                        best_time)
            return
        if value > bound * (1 + 1e-12):
            bound, bound_from = value, source
            tell(f"bound:{source}")

    def overflowed(out: dict, before: float) -> bool:  # a model's plan better than `before` that did not fit
        return best_time == before and out["objective"] is not None and out["objective"] < best_time * (1 - 1e-9)

    def take_instant(out: dict, source: str, note: str) -> None:  # an instant-IP run's bound and notes
        notes[note] = {k: out[k] for k in ("objective", "bound", "proven", "variables")}
        if out["infeasible"]:
            log.info("ilp-scalable: %s called the instant IP infeasible; ignored (preprocessing can be wrong)", source)
        else:
            raise_bound(out["bound"], source)
        split = out.get("split")
        if split is not None:
            notes["split_bound"] = {"bound": split["bound"], "cuts": split["cuts"], "proven": split["proven"]}
            raise_bound(split["bound"], source.replace("instant IP", "instant IP split at tight instants"))
        co = out.get("coupled")
        if co is not None:
            notes["coupled_bound"] = dict(co)
            raise_bound(co["bound"], source.replace("instant IP", f"instant IP split, coupled at {co['cut']}"))

    # 0. cheap bounds and the fine baselines
    if not swap and not recompute_backward:
        kb = knapsack_bound(graph, budget_bytes)
        if kb is None:
            check_forced_need(graph, budget_bytes)
        raise_bound(kb, "knapsack")
        raise_bound(griewank.chain_bound(graph, budget_bytes), "chain (revolve)")
    for name, sched in ilp.baseline_schedules(graph, budget_bytes, BASELINES, op_lists=True,
                                              skip_above=SLOW_BASELINES):
        offer(sched, f"baseline {name}")
    if not recompute_backward and (best is None or gap_open()):  # (after the baselines, so that raise_bound can
        # check it against them; not when a baseline already meets the bound: chain24 at 0.6x spent 9 s on it)
        raise_bound(window_bound(graph, budget_bytes, min(WINDOW_IP_S, share(0.05) or WINDOW_IP_S), threads,
                                 swap=swap, bandwidth=bandwidth), "window IP")

    units = model_units(graph) * (3 if swap else 1)  # swap adds SO, SI, SF and their rows
    notes["model_units"] = units

    # 0c. the instant IP, started from the best plan so far: a bound that sees recomputation
    # cascades, and a plan (solvers/instant_ip.py).  HiGHS when installed: its cut loop lifts the
    # root bound further than CBC's (ResNet-50 at 0.3x, 60 s: 1.182 against CBC's plateau of
    # 1.172); when the neighbourhood search (0d) follows, it keeps a share of the time for it.
    # With two threads or more it runs in a worker process, started here (before 0b), for
    # nearly all the time, and its result is taken when it comes (`collect`)
    ip_backend = "highs" if ilp.highs_available() else "cbc"  # for the instant IP (0c) and its neighbourhoods (0d)
    source_ip = "instant IP" + (" (HiGHS)" if ip_backend == "highs" else "")

    def use_instant(out: dict, source: str) -> None:  # step 0c's plan (repaired if it peaks over) and bound
        plan_ip = out["schedule"]
        if plan_ip is not None:
            before = best_time
            offer(plan_ip, source)
            if overflowed(out, before) and (left() is None or left() > 4.0):
                # it peaks above the budget inside a stage: the fine ILP on its recomputations
                # (each in its stage or the next) usually repairs it
                try:
                    offer(ilp.shift_search(graph, budget_bytes, plan_ip, time_limit=share(0.15), threads=threads,
                                           backend=backend, bandwidth=bandwidth), source + ", repaired")
                except SolverError as e:
                    log.info("ilp-scalable: repairing the instant IP's plan failed (%s)", e)
        take_instant(out, source, "instant_ip")

    def collect(wait: float = 0.0) -> None:  # the worker's result, once it is there
        if not workers or workers[0].result is not None:
            return
        early = workers[0].interim()  # (the whole model's bound, before the worker's later steps)
        if early is not None:
            raise_bound(early["bound"], source_ip + ", worker")
        if workers[0].poll(wait) is None:
            return
        out = workers[0].result
        workers[0].close()
        if "error" in out:
            log.warning("ilp-scalable: the instant IP's worker failed (%s)", out["error"])
            notes["instant_ip"] = {"error": out["error"]}
        else:
            use_instant(out, source_ip + ", worker")

    instant_vars = instant_ip.size(graph) if use_instant_ip and not recompute_backward else None
    run_instant = instant_vars is not None and instant_vars <= INSTANT_MAX_VARS
    run_lns = instant_vars is not None and instant_vars <= LNS_MAX_VARS
    if instant_vars is not None and instant_vars <= WORKER_MAX_VARS and (threads or 1) >= 2 and gap_open() \
            and (left() is None or left() > 4.0 + WORKER_START_S):
        limit_w = ilp.INSTANT_CAP_S if limit is None else max(1.0, WORKER_SHARE * left() - WORKER_START_S)
        try:
            workers.append(InstantWorker(graph, budget_bytes, limit_w, swap=swap, bandwidth=bandwidth, threads=1,
                                         start=ip_start[0] if ip_start[0] is not None else best, backend=ip_backend))
        except OSError as e:  # no interpreter to start (an embedded Python): step 0c runs in line
            log.warning("ilp-scalable: cannot start the instant IP's worker (%s); solving it in line", e)
        else:
            notes["instant_ip_worker_s"] = round(limit_w, 1)
            threads -= 1  # the worker's core
            tell(source_ip + ", worker")

    # 0b. the fine ILP restricted to the best schedule's recomputations, each in its stage or the
    # next (ilp.shift_search), again around each improvement while its share of the time lasts
    if graph.n <= refine_max_nodes and staged[0] is not None \
            and (left() is None or BUILD_S_PER_UNIT * model_units(graph) <= SHIFT_SHARE * left()):
        until = None if left() is None else _time.perf_counter() + SHIFT_SHARE * left()
        rounds = 0
        # one round where the neighbourhood search follows: the second round of ResNet-50 d2 at 0.3x
        # found nothing in its 9 s, which layer2's region then missed (1.2494 at 112-114 s instead of 116-117 s)
        most = 1 if run_lns else SHIFT_ROUNDS
        while gap_open() and rounds < most:
            rest = None if until is None else until - _time.perf_counter()
            if rest is not None and rest < 2.0:
                break
            rounds += 1
            before = staged_time[0]
            try:
                offer(ilp.shift_search(graph, budget_bytes, staged[0], time_limit=rest, threads=threads,
                                       backend=backend, bandwidth=bandwidth, recompute_backward=recompute_backward),
                      "shift search")
            except SolverError as e:
                log.info("ilp-scalable: shift search failed (%s)", e)
                break
            if not staged_time[0] < before * (1 - 1e-9):
                break
        notes["shift_rounds"] = rounds

    # 0c (one thread): the instant IP here, for its share of the time
    if run_instant and not workers and gap_open() and (left() is None or left() > 4.0):
        limit_ip = ilp.INSTANT_CAP_S if limit is None else \
            max(1.0, 0.8 * share(INSTANT_HIGHS_SHARE if ip_backend == "highs" else INSTANT_SHARE) - 1.0)
        tell(source_ip)
        use_instant(instant_step(graph, budget_bytes, swap=swap, bandwidth=bandwidth, threads=threads,
                                 time_limit=limit_ip, start=ip_start[0] if ip_start[0] is not None else best,
                                 progress=(lambda d: tell(source_ip, None, max(bound, d["lower_bound"] or 0.0)))
                                 if progress else None, backend=ip_backend), source_ip)
    collect()

    # 0d. neighbourhood search in the instant IP around the best plan: one region of forward
    # values free (instant_ip.neighbourhoods; the one the plan recomputes most, then the others
    # from the least recomputed), the rest fixed to the plan, started from it; again around each
    # improvement while the share lasts
    if run_lns and gap_open() and ip_start[0] is not None \
            and (left() is None or left() > 2 * LNS_MIN_S):
        until = None if limit is None else _time.perf_counter() + (LNS_SWAP_SHARE if swap else LNS_SHARE) * left()
        regions = instant_ip.neighbourhoods(graph, LNS_PARTS)
        counts = simulate(graph, ip_start[0], bandwidth).compute_counts
        regions.sort(key=lambda r: sum((counts[v] - 1) * graph.nodes[v].time for v in r))
        regions = regions[-1:] + regions[:-1]  # the most recomputed first, then the others from the least
        # then time windows (every value free in a run of instants), the most recomputed first
        windows = instant_ip.time_windows(graph, LNS_PARTS)
        windows.sort(key=lambda w: -_recompute_in(graph, ip_start[0], w))
        hoods = [{"region": r} for r in regions] + [{"instants": w} for w in windows]
        tell("neighbourhood search")
        stale, searched, k = 0, 0, 0
        moments: dict[int, bool] = {}  # intervals whose rebuilds overflowed in every order: rows there from then on
        while stale < len(hoods) and gap_open():
            collect()  # (a worker's plan, or a bound that closes the gap)
            if not gap_open():
                break
            rest = None if until is None else until - _time.perf_counter()
            if rest is not None and rest < LNS_MIN_S:
                break
            hood = hoods[k % len(hoods)]
            k += 1
            before = best_time
            try:
                out = instant_ip.solve(graph, budget_bytes, threads=threads, start=ip_start[0], **hood,
                                       time_limit=None if rest is None else max(LNS_MIN_S, min(rest, LNS_REGION_S)),
                                       backend=ip_backend, moments=dict(moments) or None)
            except SolverError as e:
                log.info("ilp-scalable: neighbourhood search stopped (%s)", e)
                break
            searched += 1
            over = offer(out["schedule"], "neighbourhood search")
            while overflowed(out, before):
                # its plan peaks above the budget inside some stages in every rebuild order tried:
                # the same neighbourhood again with rebuild-moment rows in those intervals (instant_ip
                # "Rebuild moments on demand"), strict ones where the rows alone did not keep it in
                rest = None if until is None else until - _time.perf_counter()
                if not over or all(moments.get(t) for t in over) or (rest is not None and rest < LNS_MIN_S):
                    break
                moments.update({t: t in moments for t in over})
                log.info("ilp-scalable: neighbourhood %s again with rebuild moments at %s", hood, moments)
                try:
                    out = instant_ip.solve(graph, budget_bytes, threads=threads, start=ip_start[0], **hood,
                                           time_limit=None if rest is None else min(rest, LNS_REGION_S),
                                           backend=ip_backend, moments=dict(moments))
                except SolverError as e:
                    log.info("ilp-scalable: neighbourhood search with rebuild moments failed (%s)", e)
                    break
                over = offer(out["schedule"], "neighbourhood search (rebuild moments)")
            stale = 0 if best_time < before * (1 - 1e-9) else stale + 1
        notes["neighbourhoods"] = searched

    # 1-3. coarse ILP and expansion; finer coarsening when the coarse graph cannot fit the budget
    n_coarse = min(graph.n, coarse_nodes or COARSE_TARGET)
    act = max(1, budget_bytes - graph.fixed_bytes)
    cap = act / 3
    coarse_report = None
    tries = 0
    co = None
    # does the fine LP (and RINS after it) fit the time? then the coarse solve gets a smaller share
    follow = graph.n <= lp_max_nodes and (limit is None or LP_S_PER_UNIT * units <= 0.3 * limit)
    first_need = 2.0 if best is None or limit is None else max(2.0, min(COARSE_MIN_S, 0.1 * limit))
    while (left() is None or left() > (first_need if tries == 0 else max(2.0, 0.4 * limit))) \
            and (best is None or gap_open()):  # (no work once the gap asked for is met)
        tries += 1
        groups = fit_groups(graph, choose_groups(graph, n_coarse, cap), budget_bytes)
        co = coarsen(graph, groups)
        log.info("ilp-scalable: coarse graph of %d nodes (asked %d, run bytes <= %.3g)", co.graph.n, n_coarse, cap)
        tell("coarse")  # the phase starts (CBC's log may show no incumbent of its own)
        if co.graph.n > COARSE_MAX or (co.graph.n >= graph.n and graph.n > COARSE_MAX):
            break
        try:
            ilp._check_budget(co.graph, budget_bytes)
            if not swap and not recompute_backward and knapsack_bound(co.graph, budget_bytes) is None:
                raise InfeasibleBudgetError("coarse graph", budget_bytes)
            # the coarse solve gets a share of what is left (most of it when nothing follows), less
            # when CBC, overrunning its limit in a root LP until the watchdog stops it, could end past
            # the call's limit (U-Net d3 at 0.3x with swap, 30 s: an 8 s share ended 16 s later)
            limit_c = share(0.22 if follow else 0.6)
            within = None if limit_c is None else ilp.cbc_limit_within(left())
            if within is not None and limit_c > within:
                limit_c = within
                if limit_c < 1.0 and best is not None:
                    log.info("ilp-scalable: no time left for the coarse ILP")
                    break
                limit_c = max(1.0, limit_c)
            cs = ilp.solve(co.graph, budget_bytes, swap=swap, time_limit=limit_c, gap=gap,
                           threads=threads, backend=backend, bandwidth=bandwidth,
                           recompute_backward=recompute_backward, msg=msg, mode="exact",
                           use_instant_ip=use_instant_ip,
                           progress=(lambda d: tell("coarse", d.get("incumbent"), None)) if progress else None)
        except InfeasibleBudgetError:
            # runs too large for this budget: finer runs, up to COARSE_MAX nodes
            if co.graph.n >= graph.n or co.graph.n >= COARSE_MAX or tries >= 4:
                break
            n_coarse, cap = min(COARSE_MAX, int(co.graph.n * 1.5) + 1), cap / 2
            continue
        except SolverError as e:
            log.info("ilp-scalable: the coarse ILP gave no schedule in its share of the time (%s)", e)
            break
        coarse_report = dict(cs.report)
        log.info("ilp-scalable: coarse ILP %s, objective %.6g (%.1f s)", cs.report.get("status"),
                 cs.report.get("objective"), _time.perf_counter() - t0)
        if co.graph.n == graph.n:
            offer(cs, "exact ILP")
        else:
            try:
                offer(expand(co, cs), "coarse ILP")
            except (AssertionError, ValueError) as e:  # pragma: no cover - a modelling bug
                log.error("ilp-scalable: could not expand the coarse schedule: %s", e)
        if follow or co.graph.n >= min(graph.n, COARSE_MAX):
            break
        # time to spare and no fine step to run: a finer coarsening (kept only if it is better)
        n_coarse = min(COARSE_MAX, int(co.graph.n * 1.5) + 1)
    notes["coarse_nodes"] = co.graph.n if co is not None else None
    if coarse_report is not None and co is not None:
        notes["coarse_status"] = coarse_report.get("status")
        notes["coarse_objective"] = coarse_report.get("objective")
        notes["coarse_wall_time"] = coarse_report.get("wall_time")
        if co.graph.n == graph.n and coarse_report.get("lower_bound") is not None:
            raise_bound(coarse_report["lower_bound"], "exact ilp")

    # 4a. the full LP relaxation: a bound for the whole graph, and the guide of step 4b
    lp_model = None
    lp_share = 0.4 if graph.n <= refine_max_nodes else 0.95
    if graph.n <= lp_max_nodes and best is not None and (left() is None or left() > 2.0) \
            and (left() is None or LP_S_PER_UNIT * units <= lp_share * left()) \
            and gap_open():
        try:
            # sizes rounded down (exact when nothing needs rounding): a relaxation, so a valid bound
            lp_model, lp = ilp.solve_relaxation(graph, budget_bytes, swap=swap, bandwidth=bandwidth,
                                                recompute_backward=recompute_backward, round_down=True,
                                                time_limit=share(lp_share))
            if lp is not None:
                raise_bound(lp, "lp_relaxation")
            else:
                lp_model = None
        except SolverError as e:
            lp_model = None
            log.info("ilp-scalable: no LP bound in time (%s)", e)

    # 4b. the fine ILP around the incumbent (RINS: variables on which the LP and the incumbent
    # agree are fixed), then, on small graphs, the whole fine ILP, both warm-started
    refine_progress = (lambda d: tell("refine", d.get("incumbent"), None)) if progress else None
    if lp_model is not None and graph.n <= refine_max_nodes and staged[0] is not None \
            and (left() is None or left() > 3.0 + 2 * BUILD_S_PER_UNIT * units) and gap_open():
        whole = graph.n <= full_refine_max_nodes
        try:
            sched, _ = _refine(graph, budget_bytes, staged[0], lp_model, swap=swap,
                               time_limit=share(0.6 if whole else 1.0), gap=gap, threads=threads, backend=backend,
                               bandwidth=bandwidth, recompute_backward=recompute_backward, msg=msg,
                               progress=refine_progress)
            offer(sched, "RINS fine ILP")
        except SolverError as e:
            log.info("ilp-scalable: RINS refinement failed (%s)", e)
    if graph.n <= full_refine_max_nodes and staged[0] is not None \
            and (left() is None or left() > 3.0 + 2 * BUILD_S_PER_UNIT * units) and gap_open():
        try:
            sched, fb = _refine(graph, budget_bytes, staged[0], None, swap=swap, time_limit=left(), gap=gap,
                                threads=threads, backend=backend, bandwidth=bandwidth,
                                recompute_backward=recompute_backward, msg=msg, progress=refine_progress)
            offer(sched, "fine ILP")
            raise_bound(fb, "fine ilp")  # (it drops a bound above the incumbent: CBC's garbage)
        except SolverError as e:
            log.info("ilp-scalable: refinement failed (%s)", e)

    if gap_open():  # the worker's last word (its time limit ends with ours), or its interim bound
        until = None if left() is None else _time.perf_counter() + max(0.0, left()) + WORKER_START_S
        while workers and workers[0].result is None and gap_open():
            rest = None if until is None else until - _time.perf_counter()
            collect(wait=5.0 if rest is None else max(0.0, min(5.0, rest)))
            if rest is not None and rest <= 5.0:
                break
    if best is None:
        raise SolverError(f"ilp-scalable found no schedule within {time_limit} s (no baseline fits and the "
                          "coarse ILP gave none); raise --time-limit or use the exact ILP")
    if bound > best_time:  # float noise
        bound = best_time
    g_ = _gap(best_time, bound)
    proven = g_ is not None and g_ <= 1e-9
    report = {"name": "ilp", "mode": "scalable", "backend": backend, "swap": swap, "time_limit": time_limit,
              "gap_limit": gap, "wall_time": _time.perf_counter() - t0, "status": "optimal" if proven else "feasible",
              "objective": best_time, "lower_bound": bound, "gap": 0.0 if proven else g_, "bound_from": bound_from,
              "incumbent_from": best_from, **notes}
    best.report = report
    tell("done")
    return best


def _refine(graph: Graph, budget_bytes: int, start: Schedule, guide: "ilp.Model | None", *, swap: bool,
            time_limit: float | None, gap: float, threads: int | None, backend: str, bandwidth: float | None,
            recompute_backward: bool, msg: bool,
            progress: Callable[[dict], None] | None) -> tuple[Schedule | None, float | None]:
    """(schedule or None, bound or None) from the fine ILP warm-started at `start`.

    With `guide` (a solved LP relaxation of the same graph) every binary whose LP value and
    warm-start value are both 0 (both 1) is fixed at 0 (at 1): relaxation-induced neighbourhood
    search, a restriction whose bound is not reported.  Without it, the whole model: CBC's bound
    is returned when the model is exact (not quantised)."""
    t0 = _time.perf_counter()
    m = ilp.build_model(graph, budget_bytes, swap=swap, bandwidth=bandwidth, recompute_backward=recompute_backward)
    ilp.set_warm_start(m, start)
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
    # CBC's limit on a warm-started run is CPU time (see ilp._run_cbc), which a loaded machine
    # stretches in wall time, and reading the solution back comes on top: keep a margin
    rest = None if time_limit is None else max(1.0, 0.8 * (time_limit - (_time.perf_counter() - t0)) - 1.0)
    log.info("ilp-scalable: %s fine ILP, %d variables (%d fixed), %.1f s", "RINS" if guide is not None else "whole",
             m.meta["variables"], fixed, rest or -1)
    out = ilp._run(m, backend, rest, gap, threads, True, msg, progress=progress)
    if out["infeasible"]:  # CBC's preprocessing can say so although the warm start fits
        log.info("ilp-scalable: CBC called the fine model infeasible (%s); its warm start fits", out["result"])
        return None, None
    sched = None
    if out["sol_status"] in (1, 2) and out["objective"] is not None and ilp._integral(m):
        sched = ilp.schedule_from_model(graph, m)
    b = out["bound"] * m.time_unit if out["bound"] is not None and guide is None and not m.meta["quantised"] else None
    return sched, b
