r"""TFLMS: large model support by swapping (Le et al., 2018; TFLMS v2's auto-tuning, ISMM 2019).

TFLMS rewrites a static training graph so that activations the backward pass needs much later
live on the host in between.  Here the rewrite is an op list over the graph in program (id)
order, with swaps on the simulator's one transfer stream overlapping compute:

* Levels: topological levels of the training graph, ``level(v) = 0`` for a node without inputs,
  else ``1 + max level of its inputs``; distance(src, c) = level(c) - level(src).
* Candidates: a forward tensor (non-empty output) with a *far* consumer: a backward node at a
  distance greater than ``threshold``.  Its other consumers are *near*.  ``n_tensors`` keeps the
  first n candidates in breadth-first order from the input side (by level, then id): -1 all,
  0 none.  A candidate whose far consumers all run before its last near consumer is not swapped.
* Swap-out: ``swap_out src`` right after ``compute src``.  The device copy is released once the
  copy is done and the last near consumer has run: ``wait src; free src`` at the first op
  boundary where the transfer has finished (no stall), or at once after the last near consumer
  with ``sync_out`` (TFLMS v2's sync_mode 1: the compute stream waits for the swap-out; less
  memory, less overlap).
* Swap-in: far consumers within ``groupby`` levels of a group's first consumer share one swap-in
  (TFLMS v2's swapin_groupby; a large groupby is v1's fuse_swapins).  A group's swap-in is issued
  before the first op after the previous copy is gone whose level is at least level(c) - ``ahead``,
  c the group's first consumer; ``compute c`` waits for it if it is still in flight (the
  simulator's rule).  The copy is freed after the group's last consumer; the host copy stays for
  the next group.  If the device copy is still resident when the swap-in is due (its swap-out had
  not finished), it is simply kept.
* Everything else is freed after its last consumer (a node without consumers right after it
  runs).  Nothing is recomputed: every node is computed exactly once.

Auto-tuning (TFLMS v2): parameters left as None are tuned against `simulate` (the one model of
memory and time, transfers on their own stream), in v2's order: a binary search for the largest
``threshold`` whose peak fits the budget (fewest swaps; ``ahead`` 1, or 0 if nothing fits at 1;
``groupby`` 0), then the largest ``ahead`` that still fits (earliest prefetch), then the largest
``groupby`` (fewest swap-ins).  When no setting fits, ``sync_out`` is switched on and the search
repeated (v2 raises its sync mode the same way); if still nothing fits, InfeasibleBudgetError.
The peak is not strictly monotone in the parameters: each search's answer is one that was
simulated and fits, and when a search's first probe fails its range is scanned.  Of all the
fitting settings the searches simulated, the fastest is returned.

Timing caveat: a transfer longer than one op overlaps several ops, and a swap-in consumed
mid-stage overlaps the computes before its consumer; the ILP's stage model (`ilp.checkmate`:
transfers within one stage, a same-stage swap-in waited for at the stage start) allows neither,
so at slow links TFLMS can be slightly faster than the ILP's "optimal" swap schedule.  Both are
valid in the simulator.
Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Op, Schedule
from remat.core.simulate import SimResult, SimState, simulate

from .registry import register

DEFAULT_AHEAD = 1


def levels(graph: Graph) -> list[int]:
    """Topological level of every node (0 for nodes without inputs)."""
    lv = [0] * graph.n
    for v in range(graph.n):
        if graph.preds[v]:
            lv[v] = 1 + max(lv[u] for u in graph.preds[v])
    return lv


@dataclass
class _Swap:
    src: int
    last_near: int          # program index after which the device copy may go (src if no near consumer)
    groups: list[tuple[int, int]]  # per swap-in: (program index it is issued before, its last consumer)


def plan_swaps(graph: Graph, threshold: int, ahead: int, groupby: int = 0, n_tensors: int = -1) -> list[_Swap]:
    """Which tensors TFLMS swaps and when (module docstring), for one parameter setting."""
    lv = levels(graph)
    kinds = [v.kind for v in graph.nodes]
    cands: list[tuple[int, int]] = []
    for v in graph.nodes:
        if v.kind != "forward" or v.bytes <= 0:
            continue
        if any(kinds[c] == "backward" and lv[c] - lv[v.id] > threshold for c in graph.succs[v.id]):
            cands.append((lv[v.id], v.id))
    cands.sort()
    if n_tensors >= 0:
        cands = cands[:n_tensors]
    swaps = []
    for _, src in cands:
        consumers = sorted(set(graph.succs[src]))
        far = [c for c in consumers if kinds[c] == "backward" and lv[c] - lv[src] > threshold]
        near = [c for c in consumers if c not in far]
        last_near = max(near, default=src)
        later = [c for c in far if c > last_near]
        if not later:
            continue
        # consumers within `groupby` levels of a group's first consumer share its swap-in
        grouped: list[list[int]] = []
        for c in later:
            if grouped and abs(lv[c] - lv[grouped[-1][0]]) <= groupby:
                grouped[-1].append(c)
            else:
                grouped.append([c])
        groups, prev = [], last_near
        for members in grouped:
            first = members[0]
            trigger = next(k for k in range(prev + 1, first + 1) if lv[k] >= lv[first] - ahead)
            prev = max(members)
            groups.append((trigger, prev))
        swaps.append(_Swap(src, last_near, groups))
    return swaps


def build_ops(graph: Graph, swaps: list[_Swap], sync_out: bool = False, bandwidth: float | None = None) -> list[Op]:
    """The op list for a swap plan; device-copy releases are placed with the simulator's clocks
    (`SimState`, advanced op by op as the list is built)."""
    n = graph.n
    preds = [sorted(set(p)) for p in graph.preds]
    remaining = [len(set(s)) for s in graph.succs]
    by_src = {s.src: s for s in swaps}
    triggers: dict[int, list[int]] = {}
    group_ends: dict[int, set[int]] = {}
    for s in swaps:
        for trig, last in s.groups:
            triggers.setdefault(trig, []).append(s.src)
            group_ends.setdefault(s.src, set()).add(last)
    copy: dict[int, str] = {}             # swapped tensor: device | pending | host | back | kept
    sim = SimState(graph, bandwidth, check=False)  # (the trial simulates the whole list)
    ops: list[Op] = []

    def emit(op: Op) -> None:
        ops.append(op)
        message = sim.apply(op)
        if message is not None:  # a bug here, never the user's problem
            raise AssertionError(f"tflms produced an invalid schedule: {message}")

    def release(i: int, k: int) -> None:
        if i in sim.xfer_end:
            emit(Op("wait", i, k))
        emit(Op("free", i, k))

    for k in range(n):
        for i in sorted(i for i, st in copy.items() if st == "pending"):
            if sim.xfer_end[i] <= sim.clock:
                release(i, k)
                copy[i] = "host"
        for i in sorted(triggers.get(k, [])):
            if copy[i] == "host":
                emit(Op("swap_in", i, k))
                copy[i] = "back"
            else:  # the swap-out has not finished: keep the device copy
                copy[i] = "kept"
        emit(Op("compute", k, k))  # (it waits for its inputs' swap-ins still in flight)
        if k in by_src:
            copy[k] = "device"
            emit(Op("swap_out", k, k))
        for u in preds[k]:
            remaining[u] -= 1
        for u in sorted(set(preds[k]) | {k}):
            if u in by_src and copy[u] == "device" and by_src[u].last_near == k:
                if sync_out:
                    release(u, k)
                    copy[u] = "host"
                else:
                    copy[u] = "pending"
            elif remaining[u] == 0:
                assert copy.get(u, "kept") in ("back", "kept"), (u, copy.get(u))
                release(u, k)
                copy.pop(u, None)
            elif u in by_src and k in group_ends[u]:  # more groups follow: back to the host copy
                assert copy[u] in ("back", "kept"), (u, copy[u])
                release(u, k)
                copy[u] = "host"
    return ops


@dataclass
class _Trial:
    threshold: int
    ahead: int
    groupby: int
    sync_out: bool
    schedule: Schedule
    result: SimResult
    swapped: int


def _largest_fitting(lo: int, hi: int, fits) -> int | None:
    """Largest x in [lo, hi] with fits(x) by binary search, assuming fits holds up to some point
    (None if fits(lo) fails).  The answer always fits; without monotonicity it may not be the largest."""
    if not fits(lo):
        return None
    a, b = lo, hi
    while a < b:
        mid = (a + b + 1) // 2
        if fits(mid):
            a = mid
        else:
            b = mid - 1
    return a


@register("tflms", "TFLMS swapping (Le et al.): swap out far-consumed activations, prefetch `ahead` levels early; "
          "v2 auto-tuning")
def solve(graph: Graph, budget_bytes: int, *, threshold: int | None = None, ahead: int | None = None,
          groupby: int | None = None, sync_out: bool | None = None, n_tensors: int = -1,
          bandwidth: float | None = None, swap: bool = True, **_: object) -> Schedule:
    """TFLMS's swap schedule under `budget_bytes` (whole-step bytes, fixed included).

    threshold / ahead / groupby / sync_out left as None are auto-tuned against the simulator
    (module docstring).  Raises InfeasibleBudgetError when no setting tried fits, and
    InvalidInputError when swapping is switched off (``swap=False``, ``--no-swap``): TFLMS only swaps.
    """
    if not swap:
        raise InvalidInputError("--no-swap: tflms only swaps and cannot plan with swapping off; "
                                "drop --no-swap or choose another solver")
    for name, val in (("threshold", threshold), ("ahead", ahead), ("groupby", groupby)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 0):
            raise InvalidInputError(f"{name}: must be an integer >= 0, got {val!r}")
    if not isinstance(n_tensors, int) or n_tensors < -1:
        raise InvalidInputError(f"n_tensors: must be -1 (all), 0 (none) or a positive integer, got {n_tensors!r}")
    lv = levels(graph)
    max_dist = max((lv[c] - lv[u] for u, c in graph.edges), default=0)
    max_level = max(lv)
    cache: dict[tuple[int, int, int, bool], _Trial] = {}

    def trial(th: int, ah: int, gb: int, so: bool) -> _Trial:
        key = (th, ah, gb, so)
        if key not in cache:
            swaps = plan_swaps(graph, th, ah, gb, n_tensors)
            sched = Schedule(build_ops(graph, swaps, so, bandwidth), None)
            res = simulate(graph, sched, bandwidth)
            if not res.valid:  # a bug here, never the user's problem
                raise AssertionError(f"tflms produced an invalid schedule: {res.violation}")
            cache[key] = _Trial(th, ah, gb, so, sched, res, len(swaps))
        return cache[key]

    def fits(th: int, ah: int, gb: int, so: bool) -> bool:
        return trial(th, ah, gb, so).result.peak_bytes <= budget_bytes

    def search(fixed, lo: int, hi: int, make) -> int | None:
        """The given value if it fits, else None; or the largest fitting one in [lo, hi] (scan if
        the binary search's assumption fails at lo)."""
        if fixed is not None:
            return fixed if make(fixed) else None
        x = _largest_fitting(lo, hi, make)
        if x is None:
            x = next((y for y in range(hi, lo - 1, -1) if make(y)), None)
        return x

    chosen: _Trial | None = None
    for so in ([sync_out] if sync_out is not None else [False, True]):
        gb0 = groupby if groupby is not None else 0
        aheads = [ahead] if ahead is not None else [DEFAULT_AHEAD, 0]
        for ah0 in aheads:  # threshold first, at the default prefetch distance (or none at all)
            th = search(threshold, 0, max_dist, lambda x: fits(x, ah0, gb0, so))
            if th is not None:
                break
        if th is None:
            continue
        ah = search(ahead, ah0, max_level, lambda x: fits(th, x, gb0, so))
        gb = search(groupby, gb0, max_level, lambda x: fits(th, ah, x, so))
        chosen = trial(th, ah, gb, so)
        break
    if chosen is not None:  # the searches' end point, or a faster setting they met on the way
        chosen = min((t for t in cache.values() if t.result.peak_bytes <= budget_bytes),
                     key=lambda t: (t.result.time, -t.threshold, -t.ahead, -t.groupby, t.sync_out))
    if chosen is None:
        best = min(cache.values(), key=lambda t: t.result.peak_bytes)
        raise InfeasibleBudgetError(
            f"tflms: no setting fits the budget of {budget_bytes} bytes; its smallest peak is "
            f"{best.result.peak_bytes} bytes (threshold {best.threshold}, ahead {best.ahead}, groupby "
            f"{best.groupby}, sync_out {best.sync_out}; a bound for this strategy only: ilp with swap may fit less)",
            int(budget_bytes), fixed_bytes=graph.fixed_bytes)
    sched, res = chosen.schedule, chosen.result
    sched.report = {"name": "tflms", "status": "heuristic", "objective": res.time, "threshold": chosen.threshold,
                    "ahead": chosen.ahead, "groupby": chosen.groupby, "sync_out": chosen.sync_out,
                    "n_tensors": n_tensors, "swapped": chosen.swapped, "trials": len(cache),
                    "tuned": [k for k, v in (("threshold", threshold), ("ahead", ahead), ("groupby", groupby),
                                             ("sync_out", sync_out)) if v is None]}
    return sched
