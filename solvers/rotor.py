r"""Rotor's dynamic program over the chain of blocks a graph splits into, with per-block keep menus.

The field's other family of planners (rotor, Beaumont et al. 2019; Rockmate, ICML 2023: see
docs/references.md) cuts the training graph at articulation points into a chain of blocks
and decides, by a dynamic program over (block range, memory), which block inputs to checkpoint
and which blocks to run storing their activations.  This module is that family's baseline in
remat, in our memory model and checked by our simulator; it is an upper-bound device (the
optimum over a restricted class of schedules), never a bound.

Blocks.  On a graph in Checkmate's layout (forward 0..m-1, loss m, the backward of forward v at
2m - v; `remat.core.analysis.checkmate_layout`) a forward position p is a cut (`analysis.cut_points`) when no forward edge jumps over it (every value made at or
before p and read after it is p itself), no backward node of the right side reads a forward
value before p, and none of the left side reads one after p.  Block b holds the forward nodes
between two cuts, F_b, their backward nodes B_b, and outputs a_b (the cut value); the loss is
in the last block.  B_b reads forward values of F_b and a_{b-1} only; the gradients that cross
the boundary between blocks b and b+1 (made in blocks > b, read in blocks <= b) are D_b.

Programs (replayed op by op, so their peaks and times are exact in the simulator's terms):
* forward of block b keeping K (a subset of what B_b reads) and a_b: compute F_b in id order,
  free every other value after its last forward use;
* no-keep forward of blocks s..e: compute what a_e needs, free everything but a_e;
* backward of block b: run B_b in id order; before each node, recompute any missing forward
  input (and, recursively, its missing inputs); free each value after its last use in B_b.
A block's menu is every keep set when B_b reads at most `MENU_EXACT_MAX` internal values, else a
ladder of the values ranked by time per byte.

Recursion.  Opt(s, t, h)[k] is the least time to run blocks s..t forward and backward with
a_{s-1} and D_t resident (and a_t when h = 1), k memory slots free beside everything already
held, ending with a_{s-1} and D_{s-1} resident:
* s = t: forward of block s keeping K, then its backward (every K of the menu);
* s < t, store block s: its forward keeping K, then Opt(s+1, t, h) with K and a_s held, then
  its backward (which also frees D_t's and a_t's bytes, gone by then);
* s < t, checkpoint a_{j-1} (s < j <= t): no-keep forward of s..j-1, Opt(j, t, h) with a_{j-1}
  held, then Opt(s, j-1, h') with a_{j-1} held (h' = 1) or freed (h' = 0).
Memory is counted in `slots` units of the budget (sizes rounded up, so a plan the DP accepts
fits in bytes; exact bytes when the budget is at most `slots` times the sizes' gcd); time is exact.
Persistent bytes (gradients allocated at their first accumulation) are taken off the budget
before the DP, as if resident from the start: safe, and a little room lost.  O(L^3) vector operations over the slots for L blocks; chains of
more than `MAX_BLOCKS` blocks are merged into that many.

What it cannot do that the ILP does: a checkpoint stays resident for the whole sub-range it
serves, and a block's recomputation happens where the recursion puts it (its figures against
the ILP's: docs/results.md).
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

import numpy as np

from remat.core.analysis import checkmate_layout, cut_points
from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Op, Schedule
from remat.core.simulate import SimState

from .registry import register
from .baselines import checked

log = logging.getLogger(__name__)

SLOTS = 2000           # memory resolution of the DP (units of the activation budget)
MENU_EXACT_MAX = 8     # every keep set up to this many internal values read by the backward
LADDER_MAX = 12        # otherwise this many keep sets
MAX_BLOCKS = 48        # longer chains of blocks are merged into this many


@dataclass
class Chain:
    """A graph cut into blocks b = 1..L (index 0 is the empty block before the first)."""
    m: int                   # the loss node
    out: list[int]           # out[b] = a_b, the block's output (-1 for b = 0; the loss for b = L)
    fwd: list[list[int]]     # F_b
    bwd: list[list[int]]     # B_b, ascending ids
    cross: list[list[int]]   # D_b, gradients resident between B_{b+1} and B_b

    @property
    def L(self) -> int:
        return len(self.out) - 1


def chain_of_blocks(graph: Graph, max_blocks: int = MAX_BLOCKS) -> Chain:
    m = checkmate_layout(graph)
    if m is None or m == 0:
        raise InvalidInputError("rotor: the graph must have Checkmate's layout (forward nodes, the loss, then the "
                                "backward of each forward node in reverse order), as remat.trace builds it")
    cuts = cut_points(graph, m)
    if len(cuts) + 1 > max_blocks:  # merge: keep cuts that split the forward time evenly
        times = graph.times
        total = sum(times[:m])
        keep, acc, nxt, at = [], 0.0, 1, set(cuts)
        for p in range(m):
            acc += times[p]
            if nxt < max_blocks and p in at and acc >= total * nxt / max_blocks:
                keep.append(p)
                nxt += 1
        cuts = keep
    out = [-1] + cuts + [m]
    L = len(out) - 1
    fwd = [[]] + [list(range(out[b - 1] + 1, out[b] + 1)) for b in range(1, L + 1)]
    bwd = [[]] + [sorted(2 * m - v for v in fwd[b] if v < m) for b in range(1, L + 1)]
    where = {}
    for b in range(1, L + 1):
        for v in fwd[b] + bwd[b]:
            where[v] = b
    cross: list[list[int]] = [[] for _ in range(L + 1)]
    for w in range(m + 1, graph.n):
        for u in set(graph.preds[w]):
            if u > m and where[u] > where[w]:
                for b in range(where[w], where[u]):
                    if u not in cross[b]:
                        cross[b].append(u)
    return Chain(m, out, fwd, bwd, cross)


class Program:
    """A fragment of a schedule built op by op (`compute`, `free`): its ops, and its memory and time
    from the simulator's state (`SimState`) started with `resident` values whose bytes the caller
    counts (`cur`: bytes above the caller's when the fragment starts)."""

    def __init__(self, graph: Graph, resident, cur: int = 0):
        self.state = SimState(graph, resident=resident, live_bytes=cur, check=False)  # (valid by construction)
        self.ops: list[Op] = []

    @property
    def res(self):
        """The resident values (a set-like view)."""
        return self.state.origin.keys()

    @property
    def cur(self) -> int:
        return self.state.live

    @property
    def peak(self) -> int:
        return self.state.peak

    @property
    def time(self) -> float:
        return self.state.clock

    def compute(self, v: int) -> None:
        self.ops.append(Op("compute", v))
        self.state.compute(v)

    def free(self, v: int) -> None:
        self.ops.append(Op("free", v))
        self.state.free(v)


def _free_after_forward(graph: Graph, run: list[int], keep: set[int], rp: Program, i: int, own: set[int]) -> None:
    """After run[i]: free its inputs and itself (members of `own`, not in `keep`) that no later
    node of `run` reads."""
    v = run[i]
    for u in set(graph.preds[v]) | {v}:
        if u in rp.res and u in own and u not in keep and not any(u in graph.preds[w] for w in run[i + 1:]):
            rp.free(u)


def forward_keeping(ch: Chain, graph: Graph, rp: Program, b: int, keep, skip_out: bool = False) -> None:
    """Forward of block b keeping `keep` and a_b (a_b already resident when `skip_out`)."""
    run = [v for v in ch.fwd[b] if not (skip_out and v == ch.out[b])]
    own, kept = set(ch.fwd[b]), set(keep) | {ch.out[b]}
    for i, v in enumerate(run):
        rp.compute(v)
        _free_after_forward(graph, run, kept, rp, i, own)


def forward_through(ch: Chain, graph: Graph, rp: Program, s: int, e: int) -> None:
    """No-keep forward of blocks s..e: a_e resident at the end, a_{s-1} untouched."""
    for b in range(s, e + 1):
        need = _ancestors(graph, set(ch.fwd[b]), ch.out[b])
        run = [v for v in ch.fwd[b] if v in need]
        own = set(ch.fwd[b]) | ({ch.out[b - 1]} if b > s else set())
        for i, v in enumerate(run):
            rp.compute(v)
            _free_after_forward(graph, run, {ch.out[b]}, rp, i, own)


def _ancestors(graph: Graph, within: set[int], v: int) -> set[int]:
    seen, stack = {v}, [v]
    while stack:
        for u in graph.preds[stack.pop()]:
            if u in within and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def backward(ch: Chain, graph: Graph, rp: Program, b: int) -> None:
    """Backward of block b from what is resident; missing forward inputs are recomputed."""
    F, B = set(ch.fwd[b]), ch.bwd[b]
    stay = {ch.out[b - 1]} | set(ch.cross[b - 1])
    own = F | set(B) | set(ch.cross[b])
    last = {}
    for i, w in enumerate(B):
        for u in graph.preds[w]:
            last[u] = i

    def ensure(u: int) -> None:
        if u in rp.res:
            return
        for p in graph.preds[u]:
            ensure(p)
        rp.compute(u)

    for i, w in enumerate(B):
        for u in graph.preds[w]:
            ensure(u)
        rp.compute(w)
        for r in sorted(rp.res & own):
            if last.get(r, -1) <= i and r not in stay:
                rp.free(r)


def menu(ch: Chain, graph: Graph, b: int) -> list[frozenset]:
    read = set()
    for w in ch.bwd[b]:
        read.update(graph.preds[w])
    inner = [v for v in ch.fwd[b] if v != ch.out[b] and v in read and graph.nodes[v].kind == "forward"]
    if len(inner) <= MENU_EXACT_MAX:
        return [frozenset(c) for r in range(len(inner) + 1) for c in itertools.combinations(inner, r)]
    order = sorted(inner, key=lambda v: graph.nodes[v].time / max(1, graph.nodes[v].bytes), reverse=True)
    cuts = sorted({round(len(order) * i / (LADDER_MAX - 1)) for i in range(LADDER_MAX)})
    return [frozenset(order[:k]) for k in cuts]


def plan(graph: Graph, cap_bytes: int, slots: int = SLOTS, max_blocks: int = MAX_BLOCKS):
    """(op list, predicted time, smallest feasible activation bytes at this resolution, number of
    blocks) for an activation budget `cap_bytes` (the budget less the fixed bytes); op list None
    if nothing fits."""
    ch = chain_of_blocks(graph, max_blocks)
    L, a = ch.L, ch.out
    # exact bytes when the budget spans few multiples of the sizes' gcd, else `slots` units
    g = math.gcd(*[v.bytes for v in graph.nodes if v.bytes > 0]) or 1
    unit = g if cap_bytes <= g * slots else cap_bytes / slots
    K = int(cap_bytes // unit) + 1
    ks = np.arange(K)

    def up(x: float) -> int:  # bytes -> slots, rounded up (towards +inf for negatives too)
        return int(math.ceil(x / unit - 1e-9))

    x = [0] + [graph.nodes[a[b]].bytes for b in range(1, L)] + [0]
    dbytes = [sum(graph.nodes[u].bytes for u in c) for c in ch.cross]

    def gone(t: int, h: int) -> int:  # bytes Opt(., t, h) frees by its end: D_t, and a_t when held
        return dbytes[t] + (x[t] if h else 0)
    leaf, store = {}, {}
    for b in range(1, L + 1):
        items = menu(ch, graph, b)
        held = {a[b - 1]} | set(ch.cross[b])
        for h in ((0, 1) if b < L else (0,)):
            opts = {}
            for keep in items:
                rp = Program(graph, held | ({a[b]} if h else set()))
                forward_keeping(ch, graph, rp, b, keep, skip_out=bool(h))
                backward(ch, graph, rp, b)
                key = up(rp.peak)
                if key not in opts or rp.time < opts[key][0]:
                    opts[key] = (rp.time, keep)
            leaf[b, h] = [(pk, tm, keep) for pk, (tm, keep) in sorted(opts.items())]
        if b < L:
            lst = []
            for keep in items:
                rf = Program(graph, {a[b - 1]})
                forward_keeping(ch, graph, rf, b, keep)
                rb = Program(graph, {a[b - 1], a[b]} | set(ch.cross[b]) | set(keep), cur=rf.cur + dbytes[b])
                backward(ch, graph, rb, b)
                lst.append((up(rf.peak), up(rf.cur), rb.peak, rf.time + rb.time, keep))
            store[b] = lst
    through = {}
    for s in range(1, L + 1):
        for e in range(s, L):
            rp = Program(graph, {a[s - 1]})
            forward_through(ch, graph, rp, s, e)
            through[s, e] = (up(rp.peak), rp.time)

    def shift(arr: np.ndarray, c: int) -> np.ndarray:  # out[k] = arr[k - c]; beyond the top: arr[K-1]
        out = np.full(K, np.inf)
        if c >= 0:
            if c < K:
                out[c:] = arr[:K - c]
        elif -c >= K:
            out[:] = arr[K - 1]
        else:
            out[:K + c] = arr[-c:]
            out[K + c:] = arr[K - 1]
        return out

    opt, why = {}, {}
    for length in range(L):
        for s in range(1, L - length + 1):
            t = s + length
            for h in ((0, 1) if t < L else (0,)):
                cands = []
                if length == 0:
                    for pk, tm, keep in leaf[s, h]:
                        cands.append((np.where(ks >= pk, tm, np.inf), ("leaf", keep)))
                else:
                    for pf, kept, pb, tm, keep in store[s]:  # (D_t and a_t are gone when block s runs backward)
                        ok = (ks >= pf) & (ks >= up(pb - gone(t, h)))
                        cands.append((np.where(ok, tm + shift(opt[s + 1, t, h], kept), np.inf), ("store", keep, kept)))
                    for j in range(s + 1, t + 1):
                        pc, tc = through[s, j - 1]
                        first = shift(opt[j, t, h], up(x[j - 1]))
                        for h2 in (0, 1):
                            held = dbytes[j - 1] - gone(t, h) + (x[j - 1] if h2 else 0)
                            c = np.where(ks >= pc, tc + first + shift(opt[s, j - 1, h2], up(held)), np.inf)
                            cands.append((c, ("checkpoint", j, h2)))
                best = np.full(K, np.inf)
                arg = np.zeros(K, dtype=np.int64)
                for i, (c, _) in enumerate(cands):
                    better = c < best
                    best[better] = c[better]
                    arg[better] = i
                opt[s, t, h] = best
                why[s, t, h] = ([lab for _, lab in cands], arg)
    top = opt[1, L, 0]
    finite = np.flatnonzero(np.isfinite(top))
    smallest = int(finite[0] * unit) if finite.size else None
    if not np.isfinite(top[K - 1]):
        return None, math.inf, smallest, L

    rp = Program(graph, set())

    def emit(s: int, t: int, h: int, k: int) -> None:
        labels, arg = why[s, t, h]
        lab = labels[arg[k]]
        if lab[0] == "leaf":
            forward_keeping(ch, graph, rp, s, lab[1], skip_out=bool(h))
            backward(ch, graph, rp, s)
        elif lab[0] == "store":
            _, keep, kept = lab
            forward_keeping(ch, graph, rp, s, keep)
            emit(s + 1, t, h, min(K - 1, k - kept))
            backward(ch, graph, rp, s)
        else:
            _, j, h2 = lab
            forward_through(ch, graph, rp, s, j - 1)
            emit(j, t, h, k - up(x[j - 1]))
            if not h2:
                rp.free(a[j - 1])
            held = dbytes[j - 1] - gone(t, h) + (x[j - 1] if h2 else 0)
            emit(s, j - 1, h2, min(K - 1, k - up(held)))

    emit(1, L, 0, K - 1)
    return rp.ops, float(top[K - 1]), smallest, L


@register("rotor", "rotor/Rockmate-style DP over the chain of blocks (articulation points), per-block keep menus")
def rotor(graph: Graph, budget_bytes: int | None = None, *, slots: int = SLOTS, **_: object) -> Schedule:
    """The DP's schedule for `budget_bytes` (whole-step bytes; without one, room for every value
    at once).  Raises `InfeasibleBudgetError` with the smallest budget the DP reaches."""
    if budget_bytes is None:
        budget_bytes = graph.fixed_bytes + sum(v.bytes for v in graph.nodes)
    # the DP does not model persistent bytes (gradients allocated at their first accumulation)
    # nor the optimizer step's transient at the end: it plans as if all of them were there from
    # the start, which only costs room
    cap = budget_bytes - graph.fixed_bytes - graph.step_end_bytes
    ops = None
    if cap > 0:
        ops, predicted, _, blocks = plan(graph, cap, slots)
    if ops is None:
        widest = sum(v.bytes for v in graph.nodes)  # everything resident at once: always enough
        _, _, smallest, _ = plan(graph, widest, slots)
        least = None if smallest is None else graph.fixed_bytes + graph.step_end_bytes + smallest
        raise InfeasibleBudgetError(
            f"rotor: no schedule of the block DP fits {budget_bytes} bytes"
            + (f"; it needs at least about {least} bytes" if least is not None else ""),
            budget_bytes, min_feasible_bytes=least, fixed_bytes=graph.fixed_bytes)
    sched, res = checked(graph, Schedule(ops), budget_bytes, "rotor")
    sched.report.update({"predicted": predicted, "blocks": blocks})
    return sched
