r"""Coarsening: a quotient of the graph by contiguous runs of node ids, and the way back.

Coarsen (`choose_groups`, `fit_groups`, `coarsen`).  The node ids 0..n-1 are cut into contiguous
runs of one kind (forward runs, the loss, backward runs); each run becomes one node of a quotient
graph: time = sum of its members' times, bytes = sum of their bytes, persistent bytes = sum of
theirs, workspace W_X = max_j (W_{x_j} + sum_{l<j} P_{x_l} - sum_{l>j} M_{x_l})^+, edges = the
edges between runs.  On a
Checkmate-layout graph (forward 0..m-1, loss m, backward of v at 2m-v) the backward runs mirror
the forward ones, and each forward run's last node is a run of its own, so that the coarse model
can keep a block's output and recompute its interior.  Cut points come from a DP over positions
that balances the runs' time and bytes (a run costs (time/tau)^2 + (bytes/mu)^2 + 2, tau and mu
the per-run targets, so about K runs come out) and charges a cut 4x the bytes that cross it
other than the run's last output: runs end at articulation points and narrow waists (block
boundaries) where they can; never between the parts of an op (`remat.core.graph`).  `fit_groups`
halves runs (at op boundaries) until every coarse node fits the budget with its inputs.

Expand (`expand`).  Coarse stage T (first compute of run X = x_1..x_m) becomes fine stages
x_1..x_m: stage x_1 recomputes every member of every run the coarse stage recomputes (in id
order, which is the coarse order since runs are contiguous) and computes x_1; stage x_j computes
x_j.  Transfers of a run apply to all its members (swap-outs and fetches in stage x_1, prefetches
in the stage of the run's last member, or of its op's leader when that member is a later part of
an op, `remat.core.graph`).  Keeps are the minimal ones the computes need
(`checkmate.minimal_keep`), then `checkmate.prune_waste`.  Why it fits the budget: at every fine
compute the resident values are members of runs the coarse model holds at the same point, the
run being computed has allocated at most its full bytes, and the workspace term covers the rest;
the coarse model rounds sizes up, never down.  One exception: the coarse model frees a run after
its last reader in the stage, while the staged op list holds the members of a recomputed run
that no node of the stage reads (an op's later parts that only the backward reads) to the
stage's end; `remat.core.schedule.early_frees` frees them when made (the scalable mode does so
when the expansion peaks over the budget; GPT-2 124M at batch 8: 1.1 % over, then within).  The recompute-only time is at most the coarse
objective (tested); with swap the simulator decides, and it checks every candidate either way.

A coarse model's objective or bound is never a bound for the fine graph: coarsening restricts
the schedules (an upper-bound device only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from remat.core.analysis import checkmate_layout
from remat.core.graph import Graph, Node
from remat.core.schedule import Schedule, Stage, stages_from_ops

from .checkmate import minimal_keep, prune_waste


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


def cut_run(graph: Graph, lo: int, hi: int, k: int, cap_bytes: float) -> list[int]:
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
    parts = [v.part_of for v in graph.nodes]
    for q in range(1, L + 1):
        if q < L and parts[lo + q] is not None:
            continue  # (never between an op's parts: they are computed together, `remat.core.graph`)
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
        b = cut_run(graph, 0, m, k, cap)
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
            b = cut_run(graph, start, v, k, cap)
            groups += [list(range(b[j], b[j + 1])) for j in range(len(b) - 1)]
            start = v
    return groups


def mirror(fwd: list[list[int]], m: int) -> list[list[int]]:
    """Forward runs, the loss, and the backward runs that mirror them (Checkmate layout)."""
    return fwd + [[m]] + [sorted(2 * m - v for v in g) for g in reversed(fwd)]


def fit_groups(graph: Graph, groups: list[list[int]], budget_bytes: int) -> list[list[int]]:
    """Split runs until every coarse node fits the budget with its inputs (`check_budget`'s
    test on the coarse graph): the run with the most bytes among an offending node and its
    inputs is halved (mirrored on a Checkmate layout), one at a time."""
    m = checkmate_layout(graph)
    groups = [list(g) for g in groups]
    while True:
        co = coarsen(graph, groups)
        cg = co.graph
        need = [v.bytes + v.workspace_bytes + v.persistent_bytes + cg.persistent_before[v.id]
                + sum(cg.nodes[u].bytes for u in set(cg.preds[v.id])) + cg.fixed_bytes for v in cg.nodes]
        bad = [x for x in range(cg.n) if need[x] > budget_bytes]
        if not bad:
            return groups
        x = max(bad, key=lambda y: need[y])
        cand = [y for y in [x, *cg.preds[x]] if op_boundary(graph, groups[y], 1) is not None]
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
            half = op_boundary(graph, groups[y], len(groups[y]) // 2)
            if half is None:
                return groups  # (one op: its parts stay together)
            groups[y:y + 1] = [groups[y][:half], groups[y][half:]]


def op_boundary(graph: Graph, run: list[int], at: int) -> int | None:
    """The position in `run` nearest `at` (0 < position < len) that does not fall between an op's
    parts, or None."""
    ok = [j for j in range(1, len(run)) if graph.nodes[run[j]].part_of is None]
    return min(ok, key=lambda j: (abs(j - at), j)) if ok else None


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
        P = [graph.nodes[v].persistent_bytes for v in g]
        # member j runs with the persistent bytes of the members before it counted, which the
        # coarse node counts only after it runs
        ws = max(0, max(W[j] + sum(P[:j]) - sum(M[j + 1:]) for j in range(len(g))))
        name = graph.nodes[g[0]].name if len(g) == 1 else f"{graph.nodes[g[0]].name}..{graph.nodes[g[-1]].name}"
        recompute = float(sum(graph.nodes[v].recompute_cost for v in g)) if graph.has_recompute_times else None
        nodes.append(Node(x, name, kinds.pop(), float(sum(graph.nodes[v].time for v in g)), int(sum(M)), int(ws),
                          extra={"members": [g[0], g[-1]]}, persistent_bytes=int(sum(P)), recompute_time=recompute))
    edges = {(gof[a], gof[b]) for a, b in graph.edges if gof[a] != gof[b]}
    meta = dict(graph.meta)
    meta["model"] = f"coarse({graph.meta.get('model', '?')}, {len(groups)} of {graph.n})"
    meta["bandwidth"] = graph.bandwidth
    return Coarsening(graph, groups, Graph(nodes, edges, graph.fixed_bytes, meta))


def expand(co: Coarsening, coarse: Schedule) -> Schedule:
    """The fine schedule that coarse stage matrices imply (module docstring, "Expand").  A coarse
    schedule that is an op list (the instant IP's proven optimum) is cast into stages first
    (`stages_from_ops`); raises ValueError where it does not cast."""
    stages = coarse.stages if coarse.stages is not None else stages_from_ops(co.graph, coarse.ops)
    if stages is None:
        raise ValueError("the coarse schedule is an op list that does not cast into stages")
    g, groups = co.fine, co.groups
    n = g.n
    R: list[set[int]] = [set() for _ in range(n)]
    SO: list[set[int]] = [set() for _ in range(n)]
    SI: list[set[int]] = [set() for _ in range(n)]
    SF: list[set[int]] = [set() for _ in range(n)]
    for T, st in enumerate(stages):
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
        for x in st.swap_in:  # (not in the stage of an op's later part: in its leader's, by the parts rule)
            SI[g.op_of[last]].update(v for v in groups[x] if g.nodes[v].bytes > 0)
    S = minimal_keep(g, R, SO, SI, SF)
    SI = [SI[t] & (S[t + 1] if t + 1 < n else set()) for t in range(n)]
    sched = Schedule.from_stages(g, [Stage(sorted(R[t]), sorted(S[t]), sorted(SO[t]), sorted(SI[t]),
                                           sorted(SF[t])) for t in range(n)])
    return prune_waste(g, sched)


__all__ = ["Coarsening", "choose_groups", "fit_groups", "coarsen", "expand", "mirror", "cut_run"]
