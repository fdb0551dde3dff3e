"""Checkpoint-set baselines and the S -> R -> simulate path they share (Checkmate §2.1).

A baseline picks a set K of forward nodes to keep ("checkpoints"); `schedule_from_checkpoints`
turns K into stage matrices the same way for every strategy, so comparisons are fair:

1. backward values are never recomputed: a backward output stays resident from the stage after
   it is computed until the stage of its last consumer;
2. every node's inputs are resident at the start of its own stage;
3. checkpoints stay resident from the stage after they are computed until their last consumer;
4. forward block: while the forward pass is inside segment j (between consecutive checkpoints)
   the values computed so far in the segment stay resident;
5. backward ladder: from the first backward stage that consumes a value of segment j until the
   last one, the segment's forward values that are still needed (and not held by rules 3 or 6)
   stay resident from the start of that stage, so each segment is recomputed once, in the stage
   before, and then held;
6. skip values: a forward value that a forward node of a later segment reads (an attention mask
   every block reads, say) stays resident from its compute to its last consumer, like a
   checkpoint, without cutting its segment.  Without this rule every later segment's forward
   would recompute it, and with it the chain back to the last checkpoint, once per stage.

R is the minimal recomputation that S implies (`solve_r_opt`); the simulator then gives memory
and time.  (Checkmate keeps checkpoints to the end of the step; we release them after their
last consumer, which only lowers the baseline's peak.)
"""
from __future__ import annotations

import math
from typing import Iterable

from remat.core.errors import InfeasibleBudgetError
from remat.core.graph import Graph
from remat.core.schedule import Schedule
from remat.core.simulate import SimResult, simulate

from .registry import register


def schedule_from_checkpoints(graph: Graph, checkpoints: Iterable[int]) -> Schedule:
    n = graph.n
    K = sorted(set(checkpoints))
    fwd = graph.forward_ids()
    last_use = [max(s) if s else i for i, s in enumerate(graph.succs)]
    S: list[set[int]] = [set() for _ in range(n)]

    def hold(i: int, first: int, last: int) -> None:
        for t in range(max(first, i + 1), min(last, n - 1) + 1):
            S[t].add(i)

    # 1. backward (and loss) values live until their last consumer
    for v in graph.nodes:
        if v.kind != "forward":
            hold(v.id, v.id + 1, last_use[v.id])
    # 2. inputs resident at the start of the consumer's stage
    for u, v in graph.edges:
        S[v].add(u)
    # 3. checkpoints
    for k in K:
        hold(k, k + 1, last_use[k])
    # segments over the forward order, cut after each checkpoint
    seg_of: dict[int, int] = {}
    seg = 0
    segments: list[list[int]] = [[]]
    for v in fwd:
        seg_of[v] = seg
        segments[-1].append(v)
        if v in K:
            seg += 1
            segments.append([])
    segments = [s for s in segments if s]
    # 6. skip values
    held = set(K)
    for u in fwd:
        if u not in K and any(seg_of.get(w, seg_of[u]) > seg_of[u] for w in graph.succs[u]):
            hold(u, u + 1, last_use[u])
            held.add(u)
    # 4. forward block
    for members in segments:
        for idx, v in enumerate(members):
            for u in members[:idx]:
                if last_use[u] >= v:
                    S[v].add(u)
    # 5. backward ladder (over the values not held anyway)
    for members in segments:
        free = [u for u in members if u not in held]
        consumers = sorted({k for u in free for k in graph.succs[u] if graph.nodes[k].kind == "backward"})
        if not consumers:
            continue
        first, last = consumers[0], consumers[-1]
        for u in free:
            hold(u, first, min(last, last_use[u]))
    return Schedule.from_sets(graph, S)


def checked(graph: Graph, schedule: Schedule, budget_bytes: int | None, name: str,
            bandwidth: float | None = None) -> tuple[Schedule, SimResult]:
    """Simulate a baseline's schedule; raise if it is invalid or does not fit the budget."""
    res = simulate(graph, schedule, bandwidth)
    if not res.valid:  # a bug in the strategy, never a user's problem
        raise AssertionError(f"{name} produced an invalid schedule: {res.violation}")
    if budget_bytes is not None and res.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(
            f"{name}: its schedule peaks at {res.peak_bytes} bytes, over the budget of {budget_bytes}",
            budget_bytes, fixed_bytes=graph.fixed_bytes)
    schedule.report.update({"name": name, "status": "heuristic", "objective": res.time})
    return schedule, res


@register("checkpoint-all", "keep every activation (no recomputation): fastest, largest peak", parts=True)
def checkpoint_all(graph: Graph, budget_bytes: int | None = None, **_: object) -> Schedule:
    return checked(graph, Schedule.keep_all(graph), budget_bytes, "checkpoint-all")[0]


@register("checkpoint-last-node", "keep only the previous node's output; recompute every other activation")
def checkpoint_last_node(graph: Graph, budget_bytes: int | None = None, **_: object) -> Schedule:
    # Checkmate's S[t, t-1] = 1, plus rule 1 above (gradients and the loss are held until their
    # last consumer): autograd evaluates each backward node once, so only forward values may be
    # recomputed in a schedule the executor can run.
    n = graph.n
    last_use = [max(s) if s else i for i, s in enumerate(graph.succs)]
    S = [set() if t == 0 else {t - 1} for t in range(n)]
    for v in graph.nodes:
        if v.kind != "forward":
            for t in range(v.id + 1, min(last_use[v.id], n - 1) + 1):
                S[t].add(v.id)
    return checked(graph, Schedule.from_sets(graph, S), budget_bytes, "checkpoint-last-node")[0]


def sqrt_checkpoints(candidates: list[int]) -> list[int]:
    """Chen et al.'s sqrt(n) rule over an ordered candidate list."""
    if not candidates:
        return []
    k = max(1, math.isqrt(len(candidates)))
    return [c for idx, c in enumerate(candidates) if (idx + 1) % k == 0]
