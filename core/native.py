"""The native class of module-level schedules: what the model's own code can run, hooks and
saved-tensor hooks doing the plan's ops (`remat.frontends.native`), and what the simulator must
count for it.  Torch-free: the planner uses it to plan in the class (``remat.plan(...,
executor="native")``), the executor to check a plan and predict what runs.

A schedule of a module-level graph (granularity ``"module"``) is native when

* its forward computes the forward nodes once each, in order (the model's code hands each
  module its inputs: nothing is recomputed or swapped in before the loss);
* its backward nodes run in the reverse order of the forward, each once (autograd's engine runs
  a graph's functions in reverse creation order);
* every node it recomputes (in the backward) is `recomputable`: a run of group-module calls
  with no glue op among them (glue ops, the model's own code between module calls, have no module
  to call again);
* it swaps forward nodes only.

What runs differs from the schedule in three respects the simulator is told of: the model's
returned outputs live to the step's end (the loop's ``out`` holds them: `native_peak`); a node
whose storage the model's code holds past its free (a local variable of a container's loop) is
freed where the code lets go (`native_peak`, from what the executor observed); and autograd's
engine sums the contributions to a shared parameter's gradient out of place (`engine_sums`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .graph import Graph
from .schedule import Schedule
from .simulate import simulate, storage_view


def recomputable(graph: Graph, v: int) -> bool:
    """Forward node v is a run of group-module calls with no glue op among them."""
    node = graph.nodes[v]
    types = str(node.extra.get("module_type", "glue")).split("+")
    return node.kind == "forward" and "glue" not in types


@dataclass
class Events:
    """The plan's ops, grouped by the event that runs them."""
    start: list = field(default_factory=list)           # before the first forward compute
    after_forward: dict = field(default_factory=dict)   # forward node -> ops after its compute
    before_backward: dict = field(default_factory=dict)  # forward node v -> ops before compute b_v
    order: list = field(default_factory=list)           # forward nodes in the plan's backward order
    tail: list = field(default_factory=list)            # after the last backward compute


def events(graph: Graph, schedule: Schedule) -> "tuple[Events | None, str | None]":
    """The schedule's ops grouped by the native event that runs them, or (None, why the schedule
    is not native): the order rules of the module docstring."""
    nodes = graph.nodes
    fwd_of = {v.id: v.extra.get("forward") for v in nodes if v.kind == "backward"}
    m = sum(1 for v in nodes if v.kind == "forward")
    s = Events()
    current: list = s.start
    phase, expect, last = "forward", 0, None
    for o in schedule.ops:
        v = nodes[o.node]
        if o.op != "compute":
            if v.kind == "forward" or o.op == "wait":
                current.append(o)
            elif o.op != "free":
                return None, f"it swaps {v.kind} node {v.name}"
            continue  # (autograd frees gradients and the loss's tensors itself)
        if phase == "forward":
            if v.kind == "forward":
                if v.id != expect:
                    return None, (f"it computes {v.name} again during the forward (the model's code "
                                  "hands each module its inputs)" if v.id < expect else
                                  f"it computes {v.name} out of the forward's order")
                current = s.after_forward.setdefault(v.id, [])
                expect += 1
            elif v.kind == "loss":
                if expect != m:
                    return None, "it computes the loss before the whole forward"
                phase, current = "backward", []
            else:
                return None, f"it computes {v.name} during the forward"
        elif v.kind == "backward":
            f = fwd_of[v.id]
            if last is not None and f > last:
                return None, f"its backward nodes run in another order than the reverse of the forward ({v.name})"
            if f in s.before_backward:
                return None, f"it computes {v.name} twice"
            s.before_backward[f] = current
            s.order.append(f)
            current, last = [], f
        elif v.kind == "forward":
            current.append(o)  # a recomputation
        else:
            return None, "it computes the loss twice"
    if phase != "backward":
        return None, "it never computes the loss"
    s.tail = current
    return s, None


def obstacle(graph: Graph, schedule: Schedule) -> str | None:
    """Why `schedule` is not native (module docstring), or None."""
    if graph.meta.get("granularity", "module") != "module":
        return f"it is a plan of granularity {graph.meta.get('granularity')!r} (native runs module-level plans)"
    ev, why = events(graph, schedule)
    if why is not None:
        return why
    for ops in list(ev.before_backward.values()) + [ev.tail]:
        for o in ops:
            if o.op == "compute" and not recomputable(graph, o.node):
                return (f"it recomputes {graph.nodes[o.node].name}, which is not a run of module calls "
                        "(glue ops have no module to call again)")
    return None


def held_producers(graph: Graph, v: int, preds: list[int]) -> list[int]:
    """The producers among `preds` whose outputs forward node v's autograd graph may hold to its
    backward: those whose storages v's forward saved (``extra["saves_input_of"]``, measured by
    the module frontend) and, through a producer that passes a storage on as its own output (a
    dropout of probability 0, a view: ``extra["passes_input_of"]``), the node that made it, as
    far back as storages are passed.  A graph that does not record what a node saved: all of
    `preds`."""
    extra = graph.nodes[v].extra
    if "saves_input_of" not in extra or "passes_input_of" not in extra:
        return list(preds)
    held = storages_held(v, lambda j: graph.nodes[j].extra.get("saves_input_of", ()),
                         lambda j: graph.nodes[j].extra.get("passes_input_of", ()))
    return [u for u in preds if u in held] + sorted(held - set(preds))


def storages_held(v: int, saved: Callable[[int], Iterable[int]], passed: Callable[[int], Iterable[int]]) -> set[int]:
    """The nodes whose output storages node v's saved tensors hold: ``saved(v)`` (the producers
    whose outputs v's forward saved) and, for each of them, ``passed(u)`` (the producers whose
    storage u returns as its own output), as far back as the storage is passed on."""
    held: set[int] = set()
    stack = list(saved(v))
    while stack:
        u = stack.pop()
        if u not in held:
            held.add(u)
            stack.extend(passed(u))
    return held


def plain_nodes(graph: Graph, schedule: Schedule) -> set[int]:
    """Forward nodes v that plain autograd can run as they are, their saved tensors without hooks:
    the schedule computes v once, never swaps it, frees it (if at all) after its backward node
    b_v or once the model's forward has returned (then b_v does not read v, and the free follows
    v's last reader, where autograd lets it go; inside the forward the model's code may still
    hold v, which only a followed node's free observes), and frees none of the producers v's
    graph holds (`held_producers`) between v's compute and b_v (a storage one node makes and the
    next passes on, a dropout of probability 0, is read by the second's backward under the
    first's name)."""
    nodes = graph.nodes
    ops = schedule.ops
    first: dict[int, int] = {}
    computes: dict[int, int] = {}
    frees: dict[int, list[int]] = {}
    out = {v.id for v in nodes if v.kind == "forward"}
    for k, o in enumerate(ops):
        v = o.node
        if o.op == "compute":
            computes[v] = computes.get(v, 0) + 1
            first.setdefault(v, k)
        elif o.op in ("swap_out", "swap_in"):
            out.discard(v)
        elif o.op == "free":
            frees.setdefault(v, []).append(k)
    bwd = {v.extra.get("forward"): first.get(v.id) for v in nodes if v.kind == "backward"}
    # (the model's forward has returned once the loss, or any backward node, is computed)
    backward_from = min((first[v.id] for v in nodes if v.kind != "forward" and v.id in first), default=len(ops))
    preds: dict[int, list[int]] = {}
    for u, w in graph.edges:
        if nodes[u].kind == "forward":
            preds.setdefault(w, []).append(u)
    for v in list(out):
        start, end = first.get(v), bwd.get(v)
        if computes.get(v, 0) != 1 or start is None:
            out.discard(v)
            continue
        end = len(ops) if end is None else end
        if any(start < k < min(end, backward_from) for k in frees.get(v, [])) or \
                any(start < k < end for u in held_producers(graph, v, preds.get(v, [])) for k in frees.get(u, [])):
            out.discard(v)
    return out


def nativize(graph: Graph, schedule: Schedule) -> tuple[Schedule, list[str]]:
    """`schedule` made runnable natively where it is not only because it recomputes (or swaps
    in) a node during the forward, or recomputes a node that is not a run of module calls: each
    such recomputation or swap-in is dropped with the free before it, so the node stays resident
    from its previous compute.  Returns the schedule and the names of the nodes kept so (the
    schedule is unchanged, and the list empty, when it ran natively already)."""
    nodes = graph.nodes
    loss = next(v.id for v in nodes if v.kind == "loss")
    loss_at = next(k for k, o in enumerate(schedule.ops) if o.op == "compute" and o.node == loss)
    out: list = []
    last_free: dict[int, int] = {}
    computed: set[int] = set()
    kept: list[str] = []
    for k, o in enumerate(schedule.ops):
        v = o.node
        if nodes[v].kind == "forward":
            again = (o.op == "compute" and v in computed) or o.op == "swap_in"
            if again and (k < loss_at or (o.op == "compute" and not recomputable(graph, v))):
                if v in last_free:
                    out[last_free.pop(v)] = None
                    if nodes[v].name not in kept:
                        kept.append(nodes[v].name)
                    continue
            if o.op == "compute":
                computed.add(v)
            elif o.op == "free":
                last_free[v] = len(out)
        out.append(o)
    if not kept:
        return schedule, []
    return Schedule([o for o in out if o is not None]), kept


def returned_nodes(graph: Graph) -> set[int]:
    """Forward nodes whose outputs the model returns (the loss node reads them)."""
    loss = next(v.id for v in graph.nodes if v.kind == "loss")
    return {u for u, w in graph.edges if w == loss and graph.nodes[u].kind == "forward"}


def engine_sums(graph: Graph) -> tuple[dict, dict]:
    """What autograd's engine adds for a parameter whose gradient several backward nodes
    contribute (``graph.meta["engine_sums"]``, from the module frontend): it holds the first
    contribution in the input buffer of the parameter's accumulation and adds each later one
    out of place (a new tensor of the gradient's size beside the two it sums; in place only when
    the held one is a dense tensor no one else references, which a linear's transposed weight
    gradient, say, is not: counted always, so the figure is an upper bound there), and the
    accumulation takes the sum after the last.  Returns ({backward node: bytes of the sum made
    while it runs}, {backward node: bytes it starts (> 0) or stops (< 0) holding after it runs}).
    With gradients the loop keeps (``meta["grads"] == "resident"``), the first contribution is
    held from its node to the last contributor's; in PyTorch's default loop the graph counts it
    already, as the gradient its first node allocates (``persistent_bytes``)."""
    sums: dict[int, int] = {}
    buffered: dict[int, int] = {}
    resident = graph.meta.get("grads") == "resident"
    for entry in graph.meta.get("engine_sums") or []:
        b, nodes = int(entry["bytes"]), list(entry["nodes"])
        for v in nodes[1:]:
            sums[v] = sums.get(v, 0) + b
        if resident:
            buffered[nodes[0]] = buffered.get(nodes[0], 0) + b
            buffered[nodes[-1]] = buffered.get(nodes[-1], 0) - b
    return sums, buffered


def engine_releases(graph: Graph) -> dict:
    """{backward node: bytes}: how much lower the node's backward peaks natively, where autograd's
    engine owns the incoming gradient and frees it once the module's first backward function has
    read it; the module graph (and the interpreter, which holds it) counts it through the whole
    node (``extra["engine_release_bytes"]``, measured by the module frontend).  Only where the
    node alone reads the gradients it is handed (every backward or loss node before it has it as
    its only reader): a gradient another node also reads (an add's backward hands one tensor to
    both inputs) outlives the first reader's backward."""
    out = {}
    for v in graph.nodes:
        if v.kind != "backward" or not v.extra.get("engine_release_bytes"):
            continue
        givers = [u for u in set(graph.preds[v.id]) if graph.nodes[u].kind != "forward"]
        if givers and all(set(graph.succs[u]) == {v.id} for u in givers):
            out[v.id] = int(v.extra["engine_release_bytes"])
    return out


def native_peak(graph: Graph, schedule: Schedule, held: dict | None = None) -> int:
    """The simulator's peak of `schedule` as it runs natively: with the model's returned outputs
    (``output_bytes`` of the nodes the loss reads) alive from their node's free to the step's
    end (the loop's ``out`` holds them), and, for each forward node v in `held` ({v: (j,
    bytes)}, what the executor observed), `bytes` of v's storages alive from v's free during the
    forward through the compute of forward node j (the step's end when j is past the forward:
    something outside the model, its returned cache say, holds them); the gradient sums
    of shared parameters (`engine_sums`); and the incoming gradients the engine frees inside a
    backward node (`engine_releases`)."""
    sim = simulate(graph, schedule, timeline=True)
    pinned = returned_nodes(graph)
    held = held or {}
    loss = next(v.id for v in graph.nodes if v.kind == "loss")
    sums, buffered = engine_sums(graph)
    releases = engine_releases(graph)
    extra, peak, ops_peak, in_forward = 0, 0, 0, True
    release: dict[int, int] = {}
    for o, row in zip(schedule.ops, sim.timeline):
        ops_peak = max(ops_peak, row["device_bytes"])
        during = row["device_bytes"] + extra
        if o.op == "compute":
            during += sums.get(o.node, 0) - releases.get(o.node, 0)
        peak = max(peak, during)
        if o.op == "compute":
            if o.node == loss:
                in_forward = False
            extra -= release.pop(o.node, 0) if in_forward else 0
            extra += buffered.get(o.node, 0)
        elif o.op == "free" and o.node in pinned:
            v = graph.nodes[o.node]
            extra += int(v.extra.get("output_bytes", v.bytes))
        elif o.op == "free" and in_forward and o.node in held:
            through, nbytes = held[o.node]
            extra += nbytes
            if through < loss:
                release[through] = release.get(through, 0) + nbytes
    # the step's end (the optimizer's step, the gradients settled) where no op's row is as high
    return max(peak, sim.peak_bytes if sim.peak_bytes > ops_peak else 0)


def native_prediction(graph: Graph, schedule: Schedule, held: dict | None = None) -> dict:
    """What native execution of `schedule` predicts: the simulator's time, overhead and host
    peak, `native_peak` as ``peak_bytes``, and as ``storage_peak_bytes`` the same peak as the
    exact accounting of tensor storages sees it (`storage_view`)."""
    sim = simulate(graph, schedule)
    return {"peak_bytes": native_peak(graph, schedule, held), "time": sim.time, "overhead": sim.overhead(graph),
            "host_peak_bytes": sim.host_peak_bytes,
            "storage_peak_bytes": native_peak(storage_view(graph), schedule, held)}


__all__ = ["recomputable", "events", "Events", "obstacle", "plain_nodes", "held_producers", "storages_held", "nativize", "returned_nodes",
           "engine_sums", "engine_releases", "native_peak", "native_prediction"]
