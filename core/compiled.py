"""The compiled class of joint-graph schedules: what AOTAutograd's partitioner runs when every
forward op carries a save / recompute tag (`remat.frontends.compiled`).  Torch-free.

Given the set R of forward nodes tagged *recompute* (every other forward node is tagged
*save*), the partitioner builds

* a forward graph that computes, in the joint graph's order, the forward nodes the model's
  outputs or the saved values need, each value freed after its last use there unless it is
  saved (a forward node a backward node or a node of R reads) or returned;
* a backward graph that walks the backward nodes in the joint graph's order and, before each,
  runs the nodes of R it needs (through R: saved values are there already) that it has not
  computed yet, in the joint order (``reordering_to_mimic_autograd_engine``); a node of R that
  sits among the backward ops in the joint graph (``extra["follows"]``: the backward node
  before it; a decomposed max-pool backward's zeros, say) is walked to there, not at its first
  use; each value freed after its last use.

With a backend that generates its own kernels (inductor), two marks of the frontend's follow
its code: a node of R marked ``extra["inlined"]`` (a pointwise value it would not store) is an
``inline`` op right before each of its readers in the backward (no bytes; what it reads lives
to its last reader), and a node marked ``extra["in_place"]`` follows an ``into`` op on an input
its kernel reads last, of the same bytes and ``extra["layout"]``, not returned (it writes its
result into that buffer); neither where the node is saved or returned.

With a backend whose kernels keep an unsaved pointwise value in registers (inductor's fused
pricing, `remat.frontends.compiled.OpTimes`), a node's time counts only the bytes its kernel
moves whatever the tags; a forward node marked ``extra["load_s"]`` costs more where the program
saves it: ``extra["store_s"]`` to write it in the forward, and ``extra["load_s"]`` for each
generated kernel that reads it in the backward (``extra["loads"]``: its readers, those of them
that are backward nodes or in R).  A program's time is its schedule's simulated time plus these
(`boundary_time`): recomputing such a value inside its readers' kernels can then cost less than
saving it, as inductor's own partition assumes.

So each forward node runs at most twice: once in the forward, once (if in R) in the backward
(an inlined one once per reader there).
`compiled_schedule` writes that program as a `Schedule`, which `simulate` then prices: the
plan's prediction is the simulation of what the partitioner builds, not of the solver's schedule.
"""
from __future__ import annotations

import dataclasses

from .graph import Graph
from .schedule import Op, Schedule
from .simulate import SimResult, SimState, simulate


def recomputed_of(graph: Graph, schedule: Schedule) -> set[int]:
    """Forward nodes `schedule` computes after the loss: the class's R for that schedule (a
    recomputation during the forward has no tag: the node is saved instead)."""
    nodes = graph.nodes
    loss = next(v.id for v in nodes if v.kind == "loss")
    after, out = False, set()
    for o in schedule.ops:
        if o.op not in ("compute", "inline"):
            continue
        if o.node == loss:
            after = True
        elif after and nodes[o.node].kind == "forward":
            out.add(o.node)
    return out - pinned(graph)


def pinned(graph: Graph) -> set[int]:
    """Forward nodes that cannot be recomputed: those the region returns (``extra["returned"]``:
    kept to the step's end, or with ``extra["dropped"]`` freed after their last reader, the loss
    node the latest: the caller drops them once its loss is computed)
    and those the backend always makes in the forward and saves (``extra["always_saved"]``: its
    copies of the graph's inputs)."""
    return with_parts(graph, {v.id for v in graph.nodes if v.kind == "forward"
                              and (v.extra.get("returned") or v.extra.get("always_saved"))})


def backward_only(graph: Graph) -> set[int]:
    """Forward nodes the region's results do not need (``extra["unclaimed"]``: a backward formula's
    part that reads only forward values): the partitioner is free to place them where it likes
    unless they are tagged *recompute*, so they always are; they then run once, in the backward,
    before their first use there (no time added)."""
    return with_parts(graph, {v.id for v in graph.nodes if v.kind == "forward" and v.extra.get("unclaimed")})


def beyond_schedules(graph: Graph) -> bool:
    """Whether the class's programs on `graph` may run ops the solvers' schedules do not: an
    ``inline`` op (a forward node marked ``extra["inlined"]``, which holds bytes where it is
    stored) or an ``into`` op (a node marked ``extra["in_place"]``).  Each holds fewer bytes than
    the compute a schedule runs in its place, so on such a graph a solver's smallest feasible
    budget is not the class's, and its time bound does not bound the class's programs."""
    return any(v.extra.get("in_place") or (v.extra.get("inlined") and v.bytes) for v in graph.nodes)


def normal(graph: Graph, recompute: set[int]) -> set[int]:
    """The tag set the partitioner gets for `recompute`: with every part of its ops, without the
    pinned nodes, with the backward-only ones."""
    return with_parts(graph, (set(recompute) - pinned(graph)) | backward_only(graph))


def with_parts(graph: Graph, vs: set[int]) -> set[int]:
    """`vs` with every part of an op one of whose parts it holds (an op's outputs are made together)."""
    return {m for v in vs for m in graph.members_of(v)}


def compiled_schedule(graph: Graph, recompute: set[int]) -> Schedule:
    """The program the partitioner builds for tag set `recompute` (module docstring)."""
    nodes, preds, succs = graph.nodes, graph.preds, graph.succs
    R = normal(graph, recompute)
    fwd = [v.id for v in nodes if v.kind == "forward"]
    loss = next(v.id for v in nodes if v.kind == "loss")
    bwd = [v.id for v in nodes if v.kind == "backward"]
    saved = {u for u in fwd if u not in R and any(nodes[w].kind == "backward" or w in R for w in succs[u])}
    # the forward graph: ancestors of the returned values and of the saved ones
    need = {u for u in fwd if u in saved or nodes[u].extra.get("returned")}
    need |= {u for u in preds[loss] if nodes[u].kind == "forward"}
    stack = list(need)
    while stack:
        u = stack.pop()
        for p in preds[u]:
            if p not in need and nodes[p].kind == "forward":
                need.add(p)
                stack.append(p)
    seq = sorted(with_parts(graph, need)) + [loss]
    # the backward's walk: each backward node, and each node of R that sits among the backward
    # ops in the joint graph (``extra["follows"]``: the backward node before it), with what it
    # needs of R not computed yet
    # (a node of R the backend computes inside its readers' kernels, ``extra["inlined"]``: an
    # ``inline`` op, no bytes of its own, right before each reader in the backward, freed after
    # it, so what it reads lives to its last reader)
    inline = {u for u in R if nodes[u].extra.get("inlined") and nodes[u].part_of is None and len(graph.members_of(u)) == 1}

    def inlined_into(x: int) -> list[int]:
        out: set[int] = set()
        stack = [p for p in preds[x] if p in inline]
        while stack:
            u = stack.pop()
            if u not in out:
                out.add(u)
                stack.extend(p for p in preds[u] if p in inline)
        return sorted(out)
    follows: dict[int, list[int]] = {}
    for u in sorted(R - inline):
        f = nodes[u].extra.get("follows")
        if f is not None and nodes[u].part_of is None:
            follows.setdefault(f, []).append(u)
    done: set[int] = set()
    inlined_at: set[int] = set()   # (positions in `seq` of inline computes)
    walk: list[int] = []
    for i, b in enumerate(bwd):
        walk.append(b)
        if i + 1 == len(bwd) or graph.op_of[bwd[i + 1]] != graph.op_of[b]:   # (after the op's last part)
            walk.extend(follows.get(graph.op_of[b], []))
    for w in walk:
        if w in done:
            continue
        want: set[int] = set()
        stack = [w] if w in R else [p for p in preds[w] if p in R and p not in done]
        while stack:
            u = stack.pop()
            if u in want:
                continue
            want.add(u)
            stack.extend(p for p in preds[u] if p in R and p not in done)
        for u in sorted(with_parts(graph, want - inline)):
            inlined_at.update(range(len(seq), len(seq) + len(into := inlined_into(u))))
            seq.extend(into)
            seq.append(u)
            done.add(u)
        if w not in R:
            inlined_at.update(range(len(seq), len(seq) + len(into := inlined_into(w))))
            seq.extend(into)
            seq.append(w)
    # frees: each computed instance after its last reader before the node's next compute
    ops: list[Op] = []
    instances: list[tuple[int, int, int]] = []   # (node, compute position, last use position)
    open_at: dict[int, int] = {}
    use_at = list(range(len(seq)))   # (an inline compute reads its inputs where its reader runs)
    for k in range(len(seq) - 2, -1, -1):
        if k in inlined_at:
            use_at[k] = use_at[k + 1]
    read_at: dict[int, list[int]] = {}   # position -> the instances its kernel reads
    for k, v in enumerate(seq):
        for p in preds[v]:
            if p in open_at:
                i = open_at[p]
                n_, start, end = instances[i]
                instances[i] = (n_, start, max(end, use_at[k]))
                read_at.setdefault(use_at[k], []).append(i)
        open_at[v] = len(instances)
        instances.append((v, k, k))
    free_after: dict[int, list[int]] = {}
    for v, start, end in instances:
        if nodes[v].extra.get("returned") and not nodes[v].extra.get("dropped"):
            continue
        free_after.setdefault(end, []).append(v)
    # (a node the backend may write into the buffer of an input its kernel reads last, of its
    # size and layout, ``extra["in_place"]`` and ``extra["layout"]``: an ``into`` op before it;
    # not a returned or saved one)
    given: set[int] = set()
    for k, v in enumerate(seq):
        if (k not in inlined_at and nodes[v].extra.get("in_place") and not nodes[v].extra.get("returned")
                and v not in saved):
            lay = nodes[v].extra.get("layout")
            for i in read_at.get(k, ()):
                p, start, end = instances[i]
                if (end == k and i not in given and start not in inlined_at and nodes[p].extra.get("layout") == lay
                        and nodes[p].bytes == nodes[v].bytes and not nodes[p].extra.get("returned")):
                    given.add(i)
                    ops.append(Op("into", p))
                    break
        ops.append(Op("inline" if k in inlined_at else "compute", v))
        for u in free_after.get(k, []):
            ops.append(Op("free", u))
    return Schedule(ops)


def boundary_time(graph: Graph, recompute: set[int]) -> float:
    """Seconds the program of `recompute` spends writing and reading back the values it saves
    that the node times leave out (module docstring): over the saved forward nodes marked
    ``extra["load_s"]``, ``store_s + load_s x`` (their readers in ``extra["loads"]`` that are
    backward nodes or recomputed)."""
    nodes = graph.nodes
    marked = [v for v in nodes if "load_s" in v.extra]
    if not marked:   # (every graph but inductor's: `over` calls this once per candidate)
        return 0.0
    R, t = normal(graph, recompute), 0.0
    for v in marked:
        readers = [w for w in v.extra["loads"] if nodes[w].kind == "backward" or w in R]
        if v.id not in R and any(nodes[w].kind == "backward" or w in R for w in graph.succs[v.id]):   # (saved)
            t += v.extra["store_s"] + v.extra["load_s"] * len(readers)
    return t


def program(graph: Graph, recompute: set[int]) -> tuple[Schedule, SimResult]:
    """`compiled_schedule(graph, recompute)` and its simulation, its time with the saved values'
    stores and loads (`boundary_time`) added (a program the simulator rejects is this module's
    error, raised: never priced)."""
    sched = compiled_schedule(graph, recompute)
    res = simulate(graph, sched)
    if not res.valid:
        raise RuntimeError(f"remat.core.compiled: the program of a tag set is not a valid schedule ({res.violation})")
    extra = boundary_time(graph, recompute)
    if extra:
        res = dataclasses.replace(res, time=res.time + extra, compute_time=res.compute_time + extra)
    return sched, res


def over(graph: Graph, recompute: set[int], budget_bytes: int) -> tuple[float, int, float, set[int]]:
    """How far the program of `recompute` is over `budget_bytes`: (time, peak bytes, excess =
    the sum over its ops of the bytes above the budget, the nodes resident at an op above it)."""
    state = SimState(graph, check=False)
    fixed, excess, above = graph.fixed_bytes, 0.0, set()
    for op in compiled_schedule(graph, recompute).ops:
        state.apply(op)
        if state.during + fixed > budget_bytes:
            excess += state.during + fixed - budget_bytes
            above |= set(state.origin)
            above.add(op.node)
    state.settle()
    return max(state.clock, state.xclock) + boundary_time(graph, recompute), state.peak + fixed, excess, above


def saved_forward(graph: Graph, recompute: set[int]) -> set[int]:
    """Forward nodes the program saves for the backward: not recomputed, read by a backward node
    or by a recomputed one."""
    R = normal(graph, recompute)
    return {v.id for v in graph.nodes if v.kind == "forward" and v.id not in R
            and any(graph.nodes[w].kind == "backward" or w in R for w in graph.succs[v.id])}


def fit(graph: Graph, recompute: set[int], budget_bytes: int, candidates: int = 32) -> tuple[set[int] | None, int]:
    """A tag set of the compiled class whose program fits `budget_bytes`, searched from
    `recompute`: while the program is over, take the move that lowers the excess (`over`) the
    most per second of recomputation it adds: recompute one more saved node resident where the
    program is over, or save one recomputed node resident there (a recomputation runs back to
    saved values, so saving one can cut a chain); among the `candidates` largest of each kind.
    Then, most expensive first, give back every recomputation the budget does not need.  Returns
    (the tag set, or None where no move lowers the excess; the lowest peak reached)."""
    frozen = pinned(graph) | backward_only(graph)   # (tags no move changes)
    R = normal(graph, recompute)
    t, peak, excess, above = over(graph, R, budget_bytes)
    lowest = peak
    while excess > 0:
        size = lambda v: -graph.nodes[v].bytes  # noqa: E731
        adds = sorted(above & (saved_forward(graph, R) - frozen), key=size)[:candidates]
        saves = sorted((above & R) - frozen, key=size)[:candidates]
        moves = [(v, None) for v in adds] + [(None, v) for v in saves]
        best = _best_move(graph, R, moves, budget_bytes, t, excess)
        if best is None:   # (no single move helps: two at once, among the largest few)
            few = [(v, None) for v in adds[:PAIRS]] + [(None, v) for v in saves[:PAIRS]]
            pairs = [(a[0] or b[0], a[1] or b[1]) for i, a in enumerate(few) for b in few[i + 1:]
                     if not (a[0] and b[0]) and not (a[1] and b[1])]
            pairs += [((a[0], b[0]), None) for i, a in enumerate(few) for b in few[i + 1:] if a[0] and b[0]]
            best = _best_move(graph, R, pairs, budget_bytes, t, excess)
        if best is None:
            return None, lowest
        _, R, t, peak, excess, above = best
        lowest = min(lowest, peak)
    R = prune(graph, R, budget_bytes)
    return R, program(graph, R)[1].peak_bytes


PAIRS = 8   # how many of each kind of move `fit` pairs up where no single move helps


def _best_move(graph: Graph, R: set[int], moves: list, budget_bytes: int, t: float, excess: float):
    """The best of `moves` ((nodes to recompute, nodes to save): a node, a tuple of nodes or None
    each) from tag set R: (score, tag set, its `over`) or None where none lowers the excess."""
    def nodes(x):
        return set() if x is None else set(x) if isinstance(x, tuple) else {x}
    best = None
    for add, save in moves:
        trial = with_parts(graph, R | nodes(add)) - with_parts(graph, nodes(save))
        t2, p2, e2, a2 = over(graph, trial, budget_bytes)
        if e2 >= excess:
            continue
        # (one that fits at once: the fastest of those; else the most excess per second)
        score = (1, -t2) if e2 == 0 else (0, (excess - e2) / max(t2 - t, 1e-12))
        if best is None or score > best[0]:
            best = (score, trial, t2, p2, e2, a2)
    return best


def recomputable(graph: Graph) -> set[int]:
    """Every forward node whose tag the plan chooses (all but the returned and the backward-only
    ones)."""
    return {v.id for v in graph.nodes if v.kind == "forward"} - pinned(graph) - backward_only(graph)


def prune(graph: Graph, recompute: set[int], budget_bytes: int) -> set[int]:
    """`recompute` less every node (most expensive recomputation first) whose removal keeps the
    program within `budget_bytes` and does not make it slower (saving a value costs its stores
    and loads: `boundary_time`)."""
    R = normal(graph, recompute)
    t = over(graph, R, budget_bytes)[0]
    leads = sorted({graph.op_of[v] for v in R - backward_only(graph)}, key=lambda v: -graph.nodes[v].time)
    for v in leads:
        trial = R - with_parts(graph, {v})
        t2, _, excess, _ = over(graph, trial, budget_bytes)
        if excess == 0 and t2 <= t:
            R, t = trial, t2
    return R
