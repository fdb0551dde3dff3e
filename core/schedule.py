"""Schedules: stage matrices and the op list they imply.

Stages follow Checkmate's frontier-advancing structure: there are T = n stages and stage t
computes node t for the first time, possibly recomputing nodes < t.  Per stage t:

* ``compute`` (R[t]):  nodes evaluated in stage t, run in index order;
* ``keep``    (S[t]):  outputs resident on the device at the start of stage t;
* ``swap_out``(SO[t]): resident outputs whose copy to the host starts at the stage start
  (the device copy stays for the whole stage, then is freed unless kept into t+1);
* ``swap_in`` (SI[t]): host copies brought back during stage t; their device bytes are allocated
  at the stage start and they are usable from stage t+1 on (prefetch one stage ahead);
* ``fetch``   (SF[t]): host copies brought back at the start of stage t and waited for before
  its first compute, so stage t can use them (a swap-in on the critical path).

The op list of stage t is (the contract every solver and the executor share):

1. ``swap_in i`` for i in SF[t], ``swap_out i`` for i in SO[t], ``swap_in i`` for i in SI[t]
   (issued at the stage start, in that order on the one transfer stream), then ``wait i`` for
   i in SF[t];
2. for k in R[t] ascending: ``compute k``, then ``free i`` for each input i of k that has no later
   consumer in R[t], is not kept into t+1 and is not being swapped out (Checkmate's FREE rule);
3. ``wait i`` for every transfer of the stage;
4. ``free i`` for every output still resident that is not kept into t+1.

So a stage lasts fetch + max(compute, swap-out + swap-in) transfer/compute time: the ILP's time
model (`remat.solvers.ilp.checkmate`).
A schedule may also be a bare op list (``stages`` None), as DTR's replay produces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .errors import InvalidInputError
from .graph import Graph

OPS = ("compute", "free", "swap_out", "swap_in", "wait", "inline", "into")


@dataclass
class Stage:
    compute: list[int]
    keep: list[int] = field(default_factory=list)
    swap_out: list[int] = field(default_factory=list)
    swap_in: list[int] = field(default_factory=list)
    fetch: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"compute": list(self.compute), "keep": list(self.keep),
                "swap_out": list(self.swap_out), "swap_in": list(self.swap_in), "fetch": list(self.fetch)}


@dataclass(frozen=True)
class Op:
    op: str
    node: int
    stage: int = -1

    def to_dict(self) -> dict:
        return {"op": self.op, "node": self.node, "stage": self.stage}


@dataclass
class Schedule:
    ops: list[Op]
    stages: list[Stage] | None = None
    # what the solver says about how it got here: name, status ("optimal" | "feasible" |
    # "heuristic"), objective, lower_bound, gap, wall_time, options...; not part of the op contract
    report: dict = field(default_factory=dict, compare=False)

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_stages(cls, graph: Graph, stages: Sequence[Stage]) -> "Schedule":
        stages = [Stage(sorted(s.compute), sorted(s.keep), sorted(s.swap_out), sorted(s.swap_in),
                        sorted(s.fetch)) for s in stages]
        return cls(ops_from_stages(graph, stages), stages)

    @classmethod
    def from_sets(cls, graph: Graph, keep: Sequence[Iterable[int]],
                  swap_out: Sequence[Iterable[int]] | None = None,
                  swap_in: Sequence[Iterable[int]] | None = None) -> "Schedule":
        """Schedule from S (and swaps), with the minimal R that S implies (`solve_r_opt`)."""
        T = graph.n
        S = [set(keep[t]) if t < len(keep) else set() for t in range(T)]
        SO = [set(swap_out[t]) for t in range(T)] if swap_out else [set() for _ in range(T)]
        SI = [set(swap_in[t]) for t in range(T)] if swap_in else [set() for _ in range(T)]
        if graph.has_parts:
            hold_through_parts(graph, S, SI)
        R = solve_r_opt(graph, S, SI)
        if graph.has_parts:  # (a kept part of an op the stage recomputes is recomputed with it instead)
            for t in range(T):
                S[t] -= R[t]
        return cls.from_stages(graph, [Stage(sorted(R[t]), sorted(S[t]), sorted(SO[t]), sorted(SI[t]))
                                       for t in range(T)])

    @classmethod
    def keep_all(cls, graph: Graph) -> "Schedule":
        """Plain autograd's schedule: every node computed once, in id order, each value kept
        from its compute to its last use (no recomputation, no swap)."""
        last_use = [max(s, default=v) for v, s in enumerate(graph.succs)]
        return cls.from_sets(graph, [{v for v in range(t) if last_use[v] >= t} for t in range(graph.n)])

    # ---- views -----------------------------------------------------------------------
    def matrices(self, n: int):
        """Dense 0/1 numpy matrices (R, S, SO, SI), each T x n; SI holds both kinds of swap-in
        (prefetch and fetch). Needs stages."""
        import numpy as np
        if self.stages is None:
            raise ValueError("this schedule is a bare op list; it has no stage matrices")
        T = len(self.stages)
        mats = [np.zeros((T, n), dtype=np.int8) for _ in range(4)]
        for t, s in enumerate(self.stages):
            for m, ids in zip(mats, (s.compute, s.keep, s.swap_out, list(s.swap_in) + list(s.fetch))):
                m[t, list(ids)] = 1
        return tuple(mats)

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        d: dict[str, Any] = {"ops": [o.to_dict() for o in self.ops]}
        if self.stages is not None:
            d["stages"] = [s.to_dict() for s in self.stages]
        return d

    @classmethod
    def from_dict(cls, d: Any, graph: Graph | None = None) -> "Schedule":
        if not isinstance(d, dict):
            raise InvalidInputError("schedule: expected an object")
        if not isinstance(d.get("ops"), list):
            raise InvalidInputError("schedule.ops: missing or not a list")
        n = graph.n if graph is not None else None
        ops = []
        for idx, o in enumerate(d["ops"]):
            if not isinstance(o, dict) or o.get("op") not in OPS:
                raise InvalidInputError(f"schedule.ops[{idx}].op: expected one of {OPS}, got "
                                        f"{o.get('op') if isinstance(o, dict) else o!r}")
            node = o.get("node")
            if not isinstance(node, int) or isinstance(node, bool) or (n is not None and not 0 <= node < n):
                raise InvalidInputError(f"schedule.ops[{idx}].node: not a node of the graph: {node!r}")
            stage = o.get("stage", -1)
            if not isinstance(stage, int):
                raise InvalidInputError(f"schedule.ops[{idx}].stage: expected an integer, got {stage!r}")
            ops.append(Op(o["op"], node, stage))
        stages = None
        if d.get("stages") is not None:
            if not isinstance(d["stages"], list):
                raise InvalidInputError("schedule.stages: expected a list")
            stages = []
            for idx, s in enumerate(d["stages"]):
                if not isinstance(s, dict) or not isinstance(s.get("compute"), list):
                    raise InvalidInputError(f"schedule.stages[{idx}].compute: missing or not a list")
                for key in ("compute", "keep", "swap_out", "swap_in", "fetch"):
                    ids = s.get(key, [])
                    if not isinstance(ids, list) or not all(isinstance(i, int) and (n is None or 0 <= i < n)
                                                            for i in ids):
                        raise InvalidInputError(f"schedule.stages[{idx}].{key}: expected a list of node ids")
                stages.append(Stage(s["compute"], s.get("keep", []), s.get("swap_out", []),
                                    s.get("swap_in", []), s.get("fetch", [])))
        return cls(ops, stages)


def solve_r_opt(graph: Graph, S: Sequence[set[int]], SI: Sequence[set[int]] | None = None) -> list[set[int]]:
    """Minimal R consistent with S (Checkmate's solve_r_opt), given swap-ins SI.

    R[t] holds t, every i kept into t+1 that is neither resident at t nor swapped in during t,
    and, transitively, every input of a computed node that is not resident at the start of t.
    """
    T = graph.n
    SI = SI or [set() for _ in range(T)]
    R: list[set[int]] = []
    for t in range(T):
        need = {t}
        if t + 1 < T:
            need |= {i for i in S[t + 1] if i not in S[t] and i not in SI[t]}
        r: set[int] = set()
        for v in sorted(need, reverse=True):
            _add_with_deps(graph, v, S[t], r, t)
        R.append(r)
    return R


def _add_with_deps(graph: Graph, v: int, resident: set[int], r: set[int], t: int) -> None:
    """Add v and, transitively, its inputs not resident to r (stage t's computes); a node of an op
    with several parts that stage t recomputes brings all the op's parts (`Graph.op_members`)."""
    stack = [v]
    members = graph.op_members
    op_of = graph.op_of
    while stack:
        x = stack.pop()
        if x in r:
            continue
        r.add(x)
        op = members.get(op_of[x])
        if op is not None and op[-1] < t:
            stack.extend(m for m in op if m not in r)
        stack.extend(u for u in graph.preds[x] if u not in resident and u not in r)


def hold_through_parts(graph: Graph, S: list[set[int]], SI: list[set[int]]) -> None:
    """Make S and SI follow the parts rule in the stages of an op's later parts (in place): those
    stages compute their part only, so what stage p+1 holds (but p itself) is held at p's start,
    the leader is held through them, and their swap-ins are issued in the leader's stage."""
    T = graph.n
    for lead, op in graph.op_members.items():
        for p in reversed(op[1:]):
            if SI[p]:
                SI[lead] |= SI[p]
                SI[p] = set()
            if p + 1 < T:
                S[p] |= S[p + 1] - {p}
            S[p].add(lead)


def ops_from_stages(graph: Graph, stages: Sequence[Stage],
                    orders: Sequence[Sequence[int] | None] | None = None) -> list[Op]:
    """The op list that stage matrices imply (module docstring, steps 1-4).  `orders[t]`, where
    given, runs stage t's computes in that (topological) order instead of ascending, with the
    same frees after each last reader (`solvers/stage_order.py`); the result is then a bare op
    list, not the stages' own."""
    ops: list[Op] = []
    T = len(stages)
    in_edges = [sorted(set(p)) for p in graph.preds]
    for t, st in enumerate(stages):
        nxt = set(stages[t + 1].keep) if t + 1 < T else set()
        comp = list(orders[t]) if orders is not None and orders[t] is not None else sorted(st.compute)
        last_reader: dict[int, int] = {}
        for k in comp:
            for i in in_edges[k]:
                last_reader[i] = k
        swap_out = set(st.swap_out)
        resident = set(st.keep) | set(st.swap_in) | set(st.fetch)
        for i in sorted(st.fetch):
            ops.append(Op("swap_in", i, t))
        for i in sorted(st.swap_out):
            ops.append(Op("swap_out", i, t))
        for i in sorted(st.swap_in):
            ops.append(Op("swap_in", i, t))
        for i in sorted(st.fetch):
            ops.append(Op("wait", i, t))
        for k in comp:
            ops.append(Op("compute", k, t))
            resident.add(k)
            for i in in_edges[k]:
                if last_reader[i] != k or i in nxt or i in swap_out or i not in resident:
                    continue
                ops.append(Op("free", i, t))
                resident.discard(i)
        for i in sorted(set(st.swap_out) | set(st.swap_in)):
            ops.append(Op("wait", i, t))
        for i in sorted(resident - nxt):
            ops.append(Op("free", i, t))
    return ops


def early_frees(graph: Graph, ops: Sequence[Op]) -> list[Op]:
    """`ops` with each stage-end ``free i`` (step 4) of a value that its stage computed and that
    no later compute of the stage reads moved to right after the compute of its op's last part.
    Such a value is dead once made, but step 4 holds it to the stage's end: a recomputed run of
    nodes whose members only the backward reads (an op's later parts: a layer norm's statistics,
    a dropout's mask) then outlives the run's last reader, which a coarse model of the run does
    not count.  Frees only move earlier and never between an op's parts, so every op still
    finds its inputs and the peak can only fall; the result is a bare op list."""
    out: list[Op] = []
    start = 0
    while start < len(ops):
        end = start
        while end < len(ops) and ops[end].stage == ops[start].stage:
            end += 1
        seg = list(ops[start:end])
        moving = {o.node for o in seg if o.op in ("swap_out", "swap_in")}
        computed = {o.node: j for j, o in enumerate(seg) if o.op == "compute" and o.node not in moving}
        last_compute = max(computed.values(), default=-1)
        moved: dict[int, list[Op]] = {}   # position of the compute after which -> frees moved there
        gone: set[int] = set()             # positions of the frees moved
        for j, o in enumerate(seg):
            if o.op == "free" and j > last_compute and o.node in computed and not any(
                    o.node in graph.preds[k] for k, p in computed.items() if p > computed[o.node]):
                at = max(computed.get(graph.members_of(o.node)[-1], -1), computed[o.node])
                moved.setdefault(at, []).append(o)
                gone.add(j)
        for j, o in enumerate(seg):
            if j not in gone:
                out.append(o)
                out.extend(moved.get(j, ()))
        start = end
    return out


def stages_from_ops(graph: Graph, ops: Sequence[Op]) -> list[Stage] | None:
    """Frontier-advancing stages for a compute/free op list that computes nodes for the first
    time in id order (as DTR's replay does), or None if it does not fit that form.

    Stage t holds the ops after node t-1's first compute up to node t's first compute (the
    recomputations that lead to it), plus the frees that follow it.  S[t] is what is resident
    when the stage starts, less what the stage frees before reading it (dead weight the stage
    model would otherwise carry to the stage end).  The result is an ordinary stage schedule;
    whether it still fits a budget is for the simulator to say.
    """
    if any(o.op not in ("compute", "free") for o in ops):
        return None
    preds = graph.preds
    seen: set[int] = set()
    segments: list[list[Op]] = []
    cur: list[Op] = []
    nxt = 0
    for o in ops:
        if o.op == "compute" and o.node not in seen:
            if o.node != nxt:
                return None
            seen.add(o.node)
            nxt += 1
            cur.append(o)
            segments.append(cur)
            cur = []
        else:
            cur.append(o)
    if nxt != graph.n:
        return None
    stage_ops: list[list[Op]] = [list(seg) for seg in segments]
    # frees right after a first compute belong to that stage, not to the next one
    for t in range(1, graph.n):
        k = 0
        while k < len(stage_ops[t]) and stage_ops[t][k].op == "free":
            k += 1
        stage_ops[t - 1].extend(stage_ops[t][:k])
        stage_ops[t] = stage_ops[t][k:]
    if cur:
        stage_ops[-1].extend(cur)
    stages: list[Stage] = []
    resident: set[int] = set()
    for t in range(graph.n):
        start = set(resident)
        read: set[int] = set()
        dead: set[int] = set()
        comp: list[int] = []
        for o in stage_ops[t]:
            if o.op == "compute":
                read.update(preds[o.node])
                comp.append(o.node)
                resident.add(o.node)
            else:
                if o.node in start and o.node not in read:
                    dead.add(o.node)
                resident.discard(o.node)
        stages.append(Stage(sorted(set(comp)), sorted(start - dead)))
    return stages
