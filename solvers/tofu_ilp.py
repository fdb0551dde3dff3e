"""One 2-way cut of Tofu's search as an integer program: the dynamic program's optimum proved, or
bounded where the program kept only its cheapest states.

`tofu.cut` minimises, over a placement per tensor and a strategy per op, the sum of per-op terms
``cost(op, strategy, placement of each of its tensors)`` (communicated bytes + lambda x bytes per
device; `tofu.input_costs`, `tofu.output_costs`, `tofu.sync_costs`) and of a term per leaf
tensor (its own bytes per device).  Every term couples one op's strategy with one tensor's
placement, so the cut is a pairwise labelling problem, written here as the standard integer
program over binaries and their products:

* ``x[o, s]`` = 1 when op o runs strategy s; ``y[t, p]`` = 1 when tensor t is placed p; one of each
  per op and per tensor (``sum_s x[o, s] = 1``, ``sum_p y[t, p] = 1``);
* for every tensor position (op o's input i, or its output j, tensor t) a continuous
  ``z[o, i, s, p] >= 0`` with ``sum_p z = x[o, s]`` and ``sum_s z = y[t, p]``: with x and y
  integral, z is their product (the one s with x = 1 carries all of y's mass), so
  ``sum z[o, i, s, p] x cost(o, s, i, p)`` is exactly the cut's cost of that position;
* objective: those costs, ``x[o, s] x sync_costs(o, s)`` and ``y[t, p] x factor(t) x bytes(t, p)``
  for the tensors no op makes (parameters with their gradient and optimizer state, the batch).

Its optimum is `tofu.cut`'s whenever the program is exact (tested), so on the graphs where the
program keeps every state the integer program only proves it; where it did not (``exact:
False``), CBC started from the program's cut returns a cut at least as good, with CBC's bound.
Only one cut: Tofu's recursion over 2^m devices (cut, halve, cut again) is itself a restriction,
and what is proved is each level's cut given the levels above it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pulp

from remat.core.errors import SolverError
from remat.core.opgraph import OpGraph

from . import tofu
from .ilp import mip


@dataclass
class Certificate:
    """What the integer program says of one cut: the cut it found (`cut`, at least as good as the
    warm start given), its objective and CBC's lower bound on every cut's (comm + lambda x
    memory, bytes), whether it is proven optimal, and the solve's seconds."""
    cut: tofu.Cut
    objective: float
    bound: float | None
    proven: bool
    seconds: float
    result: str


def objective(c: tofu.Cut, lam: float) -> float:
    """A cut's value in the program's objective (bytes)."""
    return c.comm + lam * c.memory


def cut_ilp(g: OpGraph, shapes: dict, lam: float = 0.0, *, allowed: dict | None = None, only=None,
            optimizer_factor: float = 0.0, warm: tofu.Cut | None = None, time_limit: float = 60.0,
            backend: str = "cbc", threads: int | None = None) -> Certificate:
    """The least-cost 2-way cut of `g` at `shapes` by integer programming (module docstring); the
    same arguments as `tofu.cut`; `warm`: a cut to start from (the dynamic program's)."""
    t0 = time.perf_counter()
    allowed = allowed or {}
    prob = pulp.LpProblem("tofu_cut", pulp.LpMinimize)
    made = {t for op in g.ops for t in op.outputs}
    used = sorted({t for op in g.ops for t in op.inputs + op.outputs})
    cands = {}
    for t in used:
        own = tofu.placements(shapes[t])
        cands[t] = ([p for p in own if p in allowed[t]] or [tofu.REPLICATE]) if t in allowed else own
    y = {(t, p): pulp.LpVariable(f"y_{t}_{k}", cat="Binary") for t in used for k, p in enumerate(cands[t])}
    for t in used:
        prob += pulp.lpSum(y[t, p] for p in cands[t]) == 1
    terms = []
    for t in used:
        if t not in made:
            for p in cands[t]:
                nb = math.prod(shapes[t]) * g.tensors[t].itemsize
                held = tofu.held_factor(g.tensors[t], optimizer_factor) * tofu.per_device(p, nb)
                terms.append(lam * held * y[t, p])
    x: dict = {}
    strats_of: dict = {}
    for op in g.ops:
        strats = tofu.op_strategies(g, op, shapes)
        if only is not None:
            strats = [s for s in strats if s is tofu.REPLICATED or only(op, s)] or [tofu.REPLICATED]
        for k, s in enumerate(strats):
            x[op.id, k] = pulp.LpVariable(f"x_{op.id}_{k}", cat="Binary")
            sync = tofu.sync_costs(g, op, s, shapes)
            if sync:
                terms.append(sync * x[op.id, k])
        prob += pulp.lpSum(x[op.id, k] for k in range(len(strats))) == 1
        positions = [("in", i, t) for i, t in enumerate(op.inputs)] + [("out", j, t) for j, t in enumerate(op.outputs)]
        for which, i, t in positions:
            nb = math.prod(shapes[t]) * g.tensors[t].itemsize
            z = {(k, p): pulp.LpVariable(f"z_{op.id}_{which}{i}_{k}_{q}", lowBound=0)
                 for k in range(len(strats)) for q, p in enumerate(cands[t])}
            for k, s in enumerate(strats):
                prob += pulp.lpSum(z[k, p] for p in cands[t]) == x[op.id, k]
                for p in cands[t]:
                    if which == "in":
                        c, m = tofu.input_costs(g, op, s, i, p, nb)
                        if g.tensors[t].kind == "input" and p == tofu.placed(s, "in", i):
                            c = 0                           # the loader places it so
                    else:
                        c, m = tofu.output_costs(g, op, s, i, p, nb)
                    if c + lam * m:
                        terms.append((c + lam * m) * z[k, p])
            for p in cands[t]:
                prob += pulp.lpSum(z[k, p] for k in range(len(strats))) == y[t, p]
        strats_of[op.id] = strats
    prob += pulp.lpSum(terms)
    if warm is not None:
        for t in used:
            for p in cands[t]:
                y[t, p].setInitialValue(1 if warm.placement.get(t) == p else 0)
        for op in g.ops:
            for k, s in enumerate(strats_of[op.id]):
                x[op.id, k].setInitialValue(1 if warm.strategy.get(op.id) == s else 0)
    model = SimpleNamespace(prob=prob, time_unit=1.0)
    info = mip.run(model, backend, time_limit, 0.0, threads, warm is not None, False)
    if info["objective"] is None:
        if warm is None:
            raise SolverError("partition: the integer program found no cut within its time limit; give it more time "
                              "or a warm start")
        return Certificate(warm, objective(warm, lam), info["bound"], False, time.perf_counter() - t0, info["result"])
    placement = {t: next(p for p in cands[t] if (y[t, p].varValue or 0) > 0.5) for t in used}
    for t in g.tensors:
        placement.setdefault(t, tofu.REPLICATE)
    strategy = {op.id: next(s for k, s in enumerate(strats_of[op.id]) if (x[op.id, k].varValue or 0) > 0.5) for op in g.ops}
    found = tofu.Cut(placement, strategy, tofu.evaluate(g, shapes, placement, strategy),
                     tofu.memory_term(g, shapes, placement, strategy, optimizer_factor), bool(info["proven"]), 0)
    if warm is not None and objective(warm, lam) < objective(found, lam):
        found = warm              # (CBC stopped before it reached its own start)
    return Certificate(found, objective(found, lam), info["bound"], bool(info["proven"]), time.perf_counter() - t0,
                       info["result"])

