"""A plan over a joint graph as straight-line Python: the joint executor's step without its per-op dispatch.

`joint_executor` interprets the plan: for every op it looks up a handler, for every fx node it
maps the arguments through the environment, checks residency, and keeps values in dicts per node.
On a step of a thousand small ops that Python costs as much as the kernels (a ResNet-50 at 64 px:
about a third of plain autograd's step).  Everything it decides per op is fixed by the plan, so
this module decides it once, when the step is prepared, and writes the step's two halves (the
ops up to the loss's compute, and the rest) as two Python functions in which every fx value is a
local variable:

* ``compute i``: node i's ATen ops as assignments (``v12 = aten_conv(v3, v4, ...)``), each
  intermediate deleted right after the op that last reads it (the group's ``release`` map),
  random nodes inside the executor's RNG context, the first compute's parameter gradients and
  buffer updates applied through the executor (``apply_sink``), and a recomputation after a
  buffer update checked as the interpreter checks it;
* ``free i``: ``del`` of node i's values;
* ``swap_out i``: the executor's ``send`` of node i's values (the copies start; the values stay
  resident until ``free i``); ``swap_in i``: its ``receive``, whose views become the variables
  again; ``wait i`` the executor's ``wait``, which the first read of a value whose transfer is
  still pending also gets, as the interpreter's lookups do;
* the values resident at the loss are handed from the first function to the second through the
  executor's ``values`` (where its ``start_backward`` puts the incoming gradient in place of
  the seed), as the interpreter holds them.

The memory the step holds is the interpreter's at every op (the same values are referenced by a
local variable instead of a dict entry, and released at the same ops), and the kernels are the
same calls in the same order; gradients and measured peaks equal the interpreter's (tested).
Residency is checked while generating, so a plan that reads a value it freed is refused before
the step runs.

Not generated (`Unsupported`, and the executor interprets the plan instead): a later part of an
op that is still waiting for its compute at the loss or when its op is computed again, and plans
that read values that are not resident (the interpreter raises where it happens).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch.fx as fx

from .joint import STATIC
from .kernels import kernel


class Unsupported(Exception):
    """The plan holds something this generator does not write; the interpreter runs it."""


class _Code:
    """Lines, indentation, and the objects the code names (its globals)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.globals: dict[str, Any] = {}
        self._ids: dict[int, str] = {}

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + line)

    def ref(self, obj: Any, prefix: str) -> str:
        """A global name for `obj` (one per object)."""
        key = id(obj)
        if key not in self._ids:
            name = f"{prefix}{len(self._ids)}"
            self._ids[key] = name
            self.globals[name] = obj
        return self._ids[key]


class _Writer:
    """Writes one half of the step; `state` (residency, first computes) carries over to the next."""

    def __init__(self, prog: Any, index: dict, state: dict):
        self.prog, self.index, self.state = prog, index, state
        self.code = _Code()
        self.used_static: dict = {}   # (a dict: the code's lines in a fixed order)
        self.nodes: list = []       # the fx nodes the code names (as dict keys), global N
        self.node_at: dict = {}
        self.code.globals["N"] = self.nodes
        self.depth = 1

    def nref(self, n: fx.Node) -> str:
        if n not in self.node_at:
            self.node_at[n] = len(self.nodes)
            self.nodes.append(n)
        return f"N[{self.node_at[n]}]"

    # ---- names -------------------------------------------------------------------------------
    def var(self, n: fx.Node) -> str:
        return f"v{self.index[n]}"

    def arg(self, a: Any, own: tuple = (set(), set())) -> str:
        """Python source for an fx argument: values by their variable, literals as literals,
        anything else (dtypes, devices, memory formats...) by a global name.  `own`: the
        members of the node being written and those of them computed so far."""
        if isinstance(a, fx.Node):
            mine, local = own
            if a in mine:
                if a not in local:
                    raise Unsupported(f"{a.name} is read before it is computed")
                return self.var(a)
            return self.read(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x, own) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if a is None or isinstance(a, (bool, int, str)) or (isinstance(a, float) and math.isfinite(a)):
            return repr(a)
        return self.code.ref(a, "K")

    def read(self, n: fx.Node) -> str:
        """The variable of a value read by an op of another node: it must be resident."""
        g = self.prog.group_of[n]
        if g == STATIC:
            self.used_static[n] = None
            return self.var(n)
        if n not in self.state["resident"].get(g, ()):
            raise Unsupported(f"{n.name} (a value of node {g}) is read while not resident")
        if g in self.state["transfer"]:  # (the interpreter waits at a value's first use, as here)
            self.state["transfer"].discard(g)
            self.code.emit(f"R.wait({g})", self.depth)
        return self.var(n)

    # ---- ops ---------------------------------------------------------------------------------
    def compute(self, g: int) -> None:
        prog, state = self.prog, self.state
        resident, pending = state["resident"], state["pending"]
        if g in resident:
            raise Unsupported(f"node {g} is computed while resident")
        if prog.part_of[g] is not None:  # a later part: its values came with its op's leader
            if g not in pending:
                raise Unsupported(f"part {g} is computed without its op")
            resident[g] = pending.pop(g)
            return
        for p in prog.parts[g]:
            if p in resident or p in pending:
                raise Unsupported(f"op {g} is computed again while its part {p} holds values")
        first = g not in state["computed"]
        emit = self.code.emit
        if not first and state["buffer_sinks"]:
            emit(f"if R.updated: R.check_buffer_reads({g})")
        depth = self.depth = 1
        if prog.random[g]:
            emit(f"with R.rng_of({g}, True):")
            depth = self.depth = 2
        mine = set(prog.op_members[g])
        rel = prog.release[g]
        local: set = set()
        own = (mine, local)
        for n in prog.op_members[g]:
            args = [self.arg(a, own) for a in n.args] + [f"{k}={self.arg(v, own)}" for k, v in n.kwargs.items()]
            emit(f"{self.var(n)} = {self.code.ref(kernel(n.target), 'T')}({', '.join(args)})", depth)
            local.add(n)
            gone = [d for d in rel.get(n, ()) if d in local]
            if gone:
                emit("del " + ", ".join(self.var(d) for d in gone), depth)
                local.difference_update(gone)
        self.depth = 1
        if prog.random[g] and first:
            emit(f"R.computed.add({g})")
        kept = prog.op_keep(g)
        for node, what, fqn in prog.sinks[g]:
            if first:
                emit(f"R.apply_sink({self.var(node)}, {what!r}, {fqn!r}, {node not in kept!r})")
            if node not in kept and node in local:
                emit(f"del {self.var(node)}")
                local.discard(node)
        for p in prog.parts[g]:
            pending[p] = [x for x in prog.keep[p] if x in local]
            local.difference_update(pending[p])
        resident[g] = [x for x in prog.keep[g] if x in local]
        extra = local - set(resident[g])
        if extra:  # (values the interpreter would hold with the node; none in a consistent program)
            raise Unsupported(f"node {g} leaves values it does not keep: {sorted(x.name for x in extra)[:3]}")
        if g == prog.loss_id:
            emit(f"R.loss_value = {self.var(prog.cap.loss)}")
        state["computed"].add(g)

    def free(self, g: int) -> None:
        vals = self.state["resident"].pop(g, None)
        if vals:
            self.code.emit("del " + ", ".join(self.var(x) for x in vals))

    def swap_out(self, g: int) -> None:
        vals = self.state["resident"].get(g)
        if vals is None:
            raise Unsupported(f"swap_out of node {g}, which is not resident")
        self.code.emit(f"R.send({g}, {{" + ", ".join(f"{self.nref(x)}: {self.var(x)}" for x in vals) + "})")
        self.state["host"][g] = list(vals)
        self.state["transfer"].add(g)

    def swap_in(self, g: int) -> None:
        if g not in self.state["host"] or g in self.state["resident"]:
            raise Unsupported(f"swap_in of node {g}, which has no host copy or is resident")
        vals = self.state["resident"][g] = list(self.state["host"][g])
        self.code.emit("_V = R.receive(%d)" % g)
        for x in vals:
            self.code.emit(f"{self.var(x)} = _V[{self.nref(x)}]")
        self.code.emit("del _V")
        self.state["transfer"].add(g)

    def op(self, op: Any) -> None:
        if op.op == "compute":
            self.compute(op.node)
        elif op.op == "free":
            self.free(op.node)
        elif op.op == "wait":
            self.code.emit(f"R.wait({op.node})")
            self.state["transfer"].discard(op.node)
        elif op.op == "swap_out":
            self.swap_out(op.node)
        elif op.op == "swap_in":
            self.swap_in(op.node)
        else:
            raise Unsupported(f"unknown op {op.op!r}")

    # ---- the function --------------------------------------------------------------------------
    def function(self, name: str, ops: list, first_half: bool) -> Callable:
        resident_before = {g: list(v) for g, v in self.state["resident"].items()}
        for o in ops:
            self.op(o)
        body = self.code.lines
        head: list[str] = []
        for n in self.used_static:
            head.append(f"    {self.var(n)} = C[{self.nref(n)}]")
        if not first_half:  # the values resident at the loss, from the executor (the seed replaced)
            head.append("    V = R.values")
            for g, vals in resident_before.items():
                for x in vals:
                    head.append(f"    {self.var(x)} = V[{g}][{self.nref(x)}]")
            head.append("    V.clear()")
        tail: list[str] = []
        if first_half:
            if self.state["pending"]:
                raise Unsupported("a later part of an op waits for its compute at the loss")
            items = ", ".join(
                f"{g}: {{" + ", ".join(f"{self.nref(x)}: {self.var(x)}" for x in vals) + "}"
                for g, vals in self.state["resident"].items())
            tail.append(f"    R.values = {{{items}}}")
        src = "\n".join([f"def {name}(R, C):", *head, *body, *tail, "    return None", ""])
        scope = dict(self.code.globals)
        exec(compile(src, f"<remat plan: {name}>", "exec"), scope)  # noqa: S102 (our own generated source)
        fn = scope[name]
        fn.source = src
        return fn


def generate(prog: Any, fwd_ops: list, bwd_ops: list) -> tuple[Callable, Callable]:
    """The plan's two halves as ``f(run, const)``: `fwd_ops` up to the loss's compute (leaves the
    resident values in ``run.values``), `bwd_ops` after ``run.start_backward``.  Raises
    `Unsupported` where the interpreter must run the plan (see the module docstring)."""
    index = {n: k for k, n in enumerate(prog.cap.gm.graph.nodes)}
    state: dict = {"resident": {}, "pending": {}, "computed": set(), "host": {}, "transfer": set(),
                   "buffer_sinks": any(what == "buffer" for sinks in prog.sinks for _, what, _ in sinks)}
    fwd = _Writer(prog, index, state).function("planned_forward", fwd_ops, True)
    bwd = _Writer(prog, index, state).function("planned_backward", bwd_ops, False)
    return fwd, bwd


__all__ = ["generate", "Unsupported"]
