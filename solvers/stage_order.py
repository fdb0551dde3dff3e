r"""Rebuild order inside a stage: the same plan with a lower peak.

A staged schedule runs each stage's computes in id order (the contract of `remat.core.schedule`).
That order is one topological order of the stage's rebuilds among many, and not always the one
with the lowest peak: a stage that rebuilds two branches and their concatenation, and a value for
a later stage, may peak over in id order (one branch's input and the later value resident while
the concatenation is rebuilt) and fit with the later value rebuilt after the concatenation.
Models that check memory only at instants
(the instant IP: `ilp.instant`) give such plans, and the simulator rejected them as over budget.

`lower_peak` keeps every stage's computes (so every node runs as often, in the same stage, and
the first computes stay in id order: the time is unchanged) and every stage's keeps, and
changes only, in a stage whose id order peaks above the budget, the order of its computes (the
stage's own node last) and with it the frees (an input is freed right after its last reader in
the stage unless the next stage keeps it, the contract's rule).  The orders tried per stage:
id order; the greedy order that at each step runs the ready compute leaving the fewest bytes
resident (ties: the latest id, which goes deep first); and `tries` random topological orders
(seeded, so the result is reproducible), half of whose steps take the latest ready id.  The
result is a bare op list (``stages`` None, as DTR's replay gives); the caller simulates it like
any other plan.

When no order fits, `evict_to_fit` replays the plan's op list under the budget as a hard cap,
freeing resident values where it would peak over and rebuilding them when they are read again
(a DTR-style replay of a fixed program): more time, but a plan that fits.

Peak of a stage for an order (what the simulator counts): resident bytes at the stage start
(with the persistent bytes of the nodes computed before), plus at each compute the bytes of its output, plus its workspace while it runs, less the inputs
freed after their last reader.
"""
from __future__ import annotations

import bisect
import random
import time as _time
from typing import Iterator, Sequence

from remat.core.graph import Graph
from remat.core.schedule import Op, Schedule, ops_from_stages
from remat.core.simulate import SimState, compute_seconds

TRIES = 200  # random orders per stage that peaks above the budget in id order


def stage_peak(graph: Graph, order: Sequence[int], resident: set[int], kept_after: set[int],
               computed: Sequence[int] = ()) -> int:
    """Peak activation bytes of running `order` from `resident` (frees by the contract's rule),
    the nodes `computed` before it already run (their persistent bytes resident), as the
    simulator counts them (`SimState`)."""
    last = _last_readers(graph, order)
    state = SimState(graph, resident=resident, computed=computed, check=False)
    for k in order:
        state.compute(k)
        for i in set(graph.preds[k]):
            if last[i] == k and i not in kept_after and i in state.origin:
                state.free(i)
    return state.peak


def _last_readers(graph: Graph, order: Sequence[int]) -> dict[int, int]:
    last: dict[int, int] = {}
    for k in order:
        for i in graph.preds[k]:
            last[i] = k
    return last


def orders(graph: Graph, compute: Sequence[int], own: int, kept_after: set[int],
           tries: int = TRIES, seed: int = 0) -> Iterator[list[int]]:
    """Topological orders of a stage's computes with `own` (the stage's first compute) last:
    id order, the greedy order, then `tries` random ones."""
    comp = sorted(compute)
    yield comp
    inside = set(comp)
    needs = {k: {p for p in graph.preds[k] if p in inside} for k in comp}
    rest = [k for k in comp if k != own]
    M = graph.sizes
    users = {k: [j for j in rest if k in needs[j]] for k in comp}

    reads: dict[int, int] = {}  # input -> the stage's computes that read it
    for j in comp:
        for i in set(graph.preds[j]):
            reads[i] = reads.get(i, 0) + 1

    def build(pick) -> list[int]:
        waiting = {k: len(needs[k]) for k in rest}
        readers = dict(reads)  # input -> reads still to come in the stage
        ready = [k for k in rest if not waiting[k]]
        order: list[int] = []

        def take(k: int) -> None:
            ready.remove(k)
            order.append(k)
            for i in set(graph.preds[k]):
                readers[i] -= 1
            for j in users[k]:
                waiting[j] -= 1
                if not waiting[j]:
                    ready.append(j)
        while ready:
            k = pick(ready, readers)
            take(k)
            for p in graph.op_members.get(k, ())[1:]:  # (an op's parts right after it: `remat.core.graph`)
                if p in waiting:
                    take(p)
        return order + [own]

    def fewest_left(ready: list[int], readers: dict[int, int]) -> int:
        # the bytes a compute adds less the inputs it reads last
        def left(k: int) -> tuple[int, int]:
            freed = sum(M[i] for i in set(graph.preds[k]) if readers[i] == 1 and i not in kept_after)
            return M[k] - freed, -k
        return min(ready, key=left)

    yield build(fewest_left)
    rng = random.Random(seed)
    for _ in range(tries):
        yield build(lambda ready, readers: rng.choice(ready) if rng.random() < 0.5 else max(ready))


def lower_peak(graph: Graph, schedule: Schedule, budget_bytes: int, tries: int = TRIES) -> Schedule | None:
    """The schedule's op list with each stage that peaks above the budget in id order reordered
    (module docstring); None when the schedule has no stages (or transfers) or a stage still
    peaks above the budget in every order tried."""
    ordered, over = reorder(graph, schedule, budget_bytes, tries)
    return None if over else ordered


def reorder(graph: Graph, schedule: Schedule, budget_bytes: int,
            tries: int = TRIES) -> tuple[Schedule | None, list[int]]:
    """(`lower_peak`'s op list with each stage in its best order tried, the stages that peak above
    the budget in every order tried); (None, []) for a schedule without stages or with transfers."""
    stages = schedule.stages
    if stages is None or any(s.swap_out or s.swap_in or s.fetch for s in stages):
        return None, []
    cap = budget_bytes - graph.fixed_bytes
    chosen: list[list[int] | None] = []
    over: list[int] = []
    for t, st in enumerate(stages):
        resident = set(st.keep)
        kept_after = set(stages[t + 1].keep) if t + 1 < len(stages) else set()
        order = sorted(st.compute)
        before = range(t)  # (stage t computes node t for the first time: the ones before have run)
        if t not in order or stage_peak(graph, order, resident, kept_after, before) <= cap:
            chosen.append(None)
            continue
        best = None
        for o in orders(graph, st.compute, t, kept_after, tries if len(order) > 2 else 0, seed=t):
            p = stage_peak(graph, o, resident, kept_after, before)
            if best is None or p < best[0]:
                best = (p, o)
            if p <= cap:
                break
        if best[0] > cap:
            over.append(t)
        chosen.append(best[1])
    return Schedule(ops_from_stages(graph, stages, chosen), None, dict(schedule.report)), over


# ---- evict to fit -----------------------------------------------------------------------------
EVICT_ALPHAS = (0.0, 0.5, 1.0, 2.0)  # the exponents of the distance to the next use that `evict_to_fit` tries
EVICT_S = 2.0                         # `evict_to_fit` tries no further replay after this many seconds
EVICT_EXTRA = 1.0                     # a replay that rebuilds more than this many passes beyond the plan is given up


def evict_to_fit(graph: Graph, schedule: Schedule, budget_bytes: int, alphas: Sequence[float] = EVICT_ALPHAS, *,
                 worse_than: float | None = None, time_limit: float | None = EVICT_S) -> Schedule | None:
    """The plan's op list replayed under the budget as a hard cap, the fastest replay that fits
    (a bare op list), or None (transfers in the plan, or no replay fits, or none is faster than
    `worse_than` seconds of compute: a replay stops once it reaches that, and all of them once
    `time_limit` seconds have passed).

    A plan from a model that checks memory only at some moments (the instant IP) may peak above
    the budget where it rebuilds; when no rebuild order inside its stages fits (`reorder`), a
    small eviction often does.  The replay runs the plan's computes and frees in order; before a
    compute that would peak above the budget it frees resident forward values the compute does
    not read, the one with the least rebuild cost per byte and per distance to its next read
    first (cost = its time plus that of its forward ancestors missing now, or, the other
    variant, missing from what the plan holds at that read; the distance is in the plan's
    compute time, raised to `alpha`; a value no later op reads goes first), and when an op reads
    a value it freed (or that a rebuild needs), it computes it again first, its missing inputs
    recursively (those the plan had freed are freed again after).  A compute the plan repeats
    of a value that is still resident is skipped.  Every compute of the plan runs (or was
    already resident), so the replay is a schedule of the same graph; it costs the plan's time
    plus the rebuilds, and the caller simulates it like any other candidate."""
    ops = schedule.ops
    if any(op.op not in ("compute", "free") for op in ops):
        return None
    best: tuple[float, list[Op]] | None = None
    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    for alpha, ahead in [(a, h) for h in (False, True) for a in alphas]:
        stop = worse_than if best is None else best[0] if worse_than is None else min(worse_than, best[0])
        out = _evict_replay(graph, ops, budget_bytes, alpha, ahead, stop, deadline)
        if out is not None:
            t = compute_seconds(graph, out)
            if best is None or t < best[0]:
                best = (t, out)
        if deadline is not None and _time.perf_counter() > deadline:
            break
    return None if best is None else Schedule(best[1], None, dict(schedule.report))


class _NoFit(Exception):
    pass


def _evict_replay(graph: Graph, ops: Sequence[Op], budget_bytes: int, alpha: float, ahead: bool,
                  stop: float | None, deadline: float | None) -> list[Op] | None:
    M, C, CR = graph.sizes, graph.times, graph.recompute_times
    forward = [v.kind == "forward" for v in graph.nodes]
    preds = [sorted(set(p)) for p in graph.preds]
    cap = budget_bytes - graph.fixed_bytes
    clock: list[float] = []  # the plan's compute time before each op
    reads: dict[int, list[int]] = {}  # value -> indices of the plan's computes that read it
    held: list[frozenset[int]] = []  # what the plan holds before each op
    c = 0.0
    now: set[int] = set()
    for idx, op in enumerate(ops):
        clock.append(c)
        held.append(frozenset(now))
        if op.op == "compute":
            c += C[op.node]
            now.add(op.node)
            for u in preds[op.node]:
                reads.setdefault(u, []).append(idx)
        else:
            now.discard(op.node)
    limit = c + EVICT_EXTRA * graph.total_time if stop is None else min(stop, c + EVICT_EXTRA * graph.total_time)
    # the replay's memory and compute time, as the simulator counts them (its ops are valid by
    # construction; the caller simulates the result)
    sim = SimState(graph, check=False)
    res = sim.origin.keys()
    gone: set[int] = set()  # freed by the replay while the plan still holds them
    locks = [0] * graph.n
    out: list[Op] = []
    state = {"idx": 0, "stage": -1}

    def score(v: int) -> float:
        later = reads.get(v, [])
        k = bisect.bisect_left(later, state["idx"])
        if k == len(later):
            return -1.0  # no later read: free to drop
        d = clock[later[k]] - clock[state["idx"]]
        return rebuild_cost(v, held[later[k]] if ahead else res, set()) / (max(M[v], 1) * (d + 1e-12) ** alpha)

    def rebuild_cost(v: int, there: frozenset[int] | set[int], seen: set[int]) -> float:
        # v's recompute time and that of its forward ancestors missing from `there`
        seen.add(v)
        return CR[v] + sum(rebuild_cost(u, there, seen) for u in preds[v]
                          if u not in there and u not in seen and forward[u])

    def drop(v: int) -> None:
        out.append(Op("free", v, state["stage"]))
        sim.free(v)

    def make_room(k: int) -> None:
        while sim.compute_peak(k) > cap:
            pool = [v for v in res if forward[v] and not locks[v] and M[v] > 0]
            if not pool or deadline is not None and _time.perf_counter() > deadline:
                raise _NoFit
            v = min(pool, key=lambda x: (score(x), x))
            drop(v)
            gone.add(v)

    def run(k: int) -> None:
        make_room(k)
        out.append(Op("compute", k, state["stage"]))
        sim.compute(k)
        gone.discard(k)
        if sim.clock > limit:
            raise _NoFit

    def run_reading(k: int) -> list[int]:
        """Compute k with its inputs resident (rebuilt when not, and held while k runs); returns
        the inputs rebuilt for it that the plan had freed."""
        temps = []
        for u in preds[k]:
            if u not in res:
                plan_holds = u in gone
                ensure(u)
                if not plan_holds:
                    temps.append(u)
            locks[u] += 1
        run(k)
        for u in preds[k]:
            locks[u] -= 1
        return temps

    def ensure(v: int) -> None:  # v resident, rebuilt from its inputs when not
        if v in res:
            return
        if not forward[v]:
            raise _NoFit  # (a gradient or the loss is never computed twice)
        for u in run_reading(v):  # (the plan had freed them: only for this rebuild)
            if u in res and not locks[u]:
                drop(u)

    try:
        for idx, op in enumerate(ops):
            state["idx"], state["stage"] = idx, op.stage
            k = op.node
            if op.op == "free":
                if k in res:
                    drop(k)
                gone.discard(k)
                continue
            if k in res:
                continue  # rebuilt already (as an input of a rebuild) and still resident
            run_reading(k)  # (every input of a plan's compute is one the plan holds: nothing to free after)
    except _NoFit:
        return None
    return out
