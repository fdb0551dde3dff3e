r"""Rebuild order inside a stage: the same plan with a lower peak.

A staged schedule runs each stage's computes in id order (the contract of `remat.schedule`).
That order is one topological order of the stage's rebuilds among many, and not always the one
with the lowest peak.  U-Net d3 at 0.3x, stage 70 of a plan rebuilds `inc`'s tail, `ups.3.up`
and the concatenation `ups.3:cat` of the two, and `downs.0.conv.conv1` for a later stage; in id
order `ups.3.up`'s input and `downs.0.conv.conv1` are resident while the concatenation is
rebuilt (47 MiB over the budget), while rebuilding `ups.3.up` first and `downs.0.conv.conv1`
after the concatenation fits.  Models that check memory only at instants
(the instant IP: `instant_ip`) give such plans, and the simulator rejected them as over budget.

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

Peak of a stage for an order (what the simulator counts): resident bytes at the stage start,
plus at each compute the bytes of its output, plus its workspace while it runs, less the inputs
freed after their last reader.
"""
from __future__ import annotations

import random
from typing import Iterator, Sequence

from remat.graph import Graph
from remat.schedule import Schedule, ops_from_stages

TRIES = 200  # random orders per stage that peaks above the budget in id order


def stage_peak(graph: Graph, order: Sequence[int], resident: set[int], kept_after: set[int]) -> int:
    """Peak activation bytes of running `order` from `resident` (frees by the contract's rule)."""
    M = graph.sizes
    last = _last_readers(graph, order)
    res = set(resident)
    cur = sum(M[v] for v in res)
    peak = cur
    for k in order:
        if k not in res:
            res.add(k)
            cur += M[k]
        peak = max(peak, cur + graph.nodes[k].workspace_bytes)
        for i in set(graph.preds[k]):
            if last[i] == k and i not in kept_after and i in res:
                res.discard(i)
                cur -= M[i]
    return peak


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
        while ready:
            k = pick(ready, readers)
            ready.remove(k)
            order.append(k)
            for i in set(graph.preds[k]):
                readers[i] -= 1
            for j in users[k]:
                waiting[j] -= 1
                if not waiting[j]:
                    ready.append(j)
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
        if t not in order or stage_peak(graph, order, resident, kept_after) <= cap:
            chosen.append(None)
            continue
        best = None
        for o in orders(graph, st.compute, t, kept_after, tries if len(order) > 2 else 0, seed=t):
            p = stage_peak(graph, o, resident, kept_after)
            if best is None or p < best[0]:
                best = (p, o)
            if p <= cap:
                break
        if best[0] > cap:
            over.append(t)
        chosen.append(best[1])
    return Schedule(ops_from_stages(graph, stages, chosen), None, dict(schedule.report)), over
