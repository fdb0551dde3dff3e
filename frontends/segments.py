"""Cut a captured graph into segments ("stages" in the plan's words): the forward nodes of the
training graph.

Module granularity: one stage per call of a *group module*.  Group modules at depth 1 are the
children of the top module, looking through plain containers (exactly `nn.Sequential`,
`nn.ModuleList`, `nn.ModuleDict`, not their subclasses) so a ResNet's blocks and a GPT's layers
are stages; depth k goes k-1 levels further into modules that have children.  Each ATen op
belongs to the innermost group module on its ``nn_module_stack``; a run of consecutive ops of
one module call is one stage.  Ops outside every group module (``torch.flatten`` in a ResNet's
own forward, a residual add) form "glue" stages of their own, one per run.  Op stages
(``granularity="op-stages"``; plans made before "op" meant the joint graph say ``"op"``): one
stage per op.

Storage rules (docs/design.md, "The memory model").  A stage whose output shares storage
with a value another stage produced (a view, ``flatten``), or that writes in place into such a
value (``ReLU(inplace=True)`` after a BatchNorm), cannot be kept or freed apart from that stage,
and a checkpoint cut just before an in-place op breaks autograd (as `torch.utils.checkpoint`'s
documentation warns).  Such a
stage is merged with the producer (and the stages between them): ``bn1+relu``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .capture import Captured

CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass
class Segment:
    name: str
    module: str              # path of the group module ("" for glue at the top)
    module_type: str         # class name, or "glue" / the op for op stages
    nodes: list              # fx nodes in execution order
    inputs: list = field(default_factory=list)    # values from outside the stage, first use order
    outputs: list = field(default_factory=list)   # values used after the stage


def group_modules(model: torch.nn.Module, depth: int = 1) -> dict[str, str]:
    """{path: class name} of the modules whose calls become stages (see the module docstring)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    groups: dict[str, str] = {}

    def visit(mod: torch.nn.Module, prefix: str, d: int) -> None:
        for name, child in mod.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if type(child) in CONTAINERS:
                visit(child, path, d)
            elif d > 1 and next(child.children(), None) is not None:
                visit(child, path, d - 1)
            else:
                groups[path] = type(child).__name__
    visit(model, "", depth)
    return groups


MAX_AUTO_DEPTH = 8


def repeated_blocks(groups: dict[str, str]) -> list[str]:
    """Paths of the group modules that are repeated blocks, in the model's order: siblings of
    one parent (a ``ModuleList``'s layers, a ``Sequential``'s stages) with the class of another
    sibling."""
    count: dict[tuple[str, str], int] = {}
    for path, typ in groups.items():
        key = (path.rpartition(".")[0], typ)
        count[key] = count.get(key, 0) + 1
    return [path for path, typ in groups.items() if count[(path.rpartition(".")[0], typ)] > 1]


def auto_depth(model: torch.nn.Module, min_groups: int = 4, max_depth: int = MAX_AUTO_DEPTH) -> int:
    """The depth `group_modules` should take for `model` when the user names none: the smallest
    that has at least `min_groups` group modules of which some are repeated blocks
    (`repeated_blocks`), looking through wrappers (a one-child top module, transformers'
    ``*ForCausalLM`` around a ``*Model``, plain containers); else the smallest with at least
    `min_groups` groups; else the deepest (every further level the same, or `max_depth`)."""
    previous: dict | None = None
    enough = None
    for d in range(1, max_depth + 1):
        groups = group_modules(model, d)
        if groups == previous:
            return enough or d - 1
        if len(groups) >= min_groups:
            if repeated_blocks(groups):
                return d
            enough = enough or d
        previous = groups
    return enough or max_depth


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    return getattr(t, "__name__", str(t))


def _stack(node: fx.Node) -> list[tuple[str, str, str]]:
    """[(call key, path, type name)] outermost first."""
    st = node.meta.get("nn_module_stack") or {}
    out = []
    for key, val in st.items():
        path, typ = val if isinstance(val, tuple) else (val, "")
        typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
        out.append((key, path, typ.rsplit(".", 1)[-1]))
    return out


def cut(cap: Captured, model: torch.nn.Module, granularity: str = "module", depth: int = 1) -> list[Segment]:
    ops = [n for n in cap.graph.nodes if n.op == "call_function"]
    stages: list[Segment] = []
    if granularity in ("op", "op-stages"):  # "op": plans traced before op meant the joint graph
        for n in ops:
            st = _stack(n)
            stages.append(Segment(n.name, st[-1][1] if st else "", _op_name(n), [n]))
    else:
        groups = group_modules(model, depth)
        current_key: Any = object()
        for n in ops:
            st = _stack(n)
            key, path, typ = None, "", "glue"
            for k, p, t in reversed(st):
                if p in groups:
                    key, path, typ = k, p, t
                    break
            if key is None:
                inner = next((p for _, p, _ in reversed(st) if p), "")
                if stages and current_key is None:
                    stages[-1].nodes.append(n)
                    continue
                name = f"{inner}:{_op_name(n)}" if inner else _op_name(n)
                stages.append(Segment(name, inner, "glue", [n]))
            elif key == current_key:
                stages[-1].nodes.append(n)
                continue
            else:
                stages.append(Segment(path, path, typ, [n]))
            current_key = key
    _link(stages, cap)
    stages = merge_aliases(stages, cap)
    _unique_names(stages)
    return stages


def _link(stages: list[Segment], cap: Captured) -> None:
    """Fill each stage's inputs and outputs from the graph's uses."""
    owner = {n: i for i, s in enumerate(stages) for n in s.nodes}
    user_outs = {o for o in cap.outputs if isinstance(o, fx.Node)}
    for i, s in enumerate(stages):
        own = set(s.nodes)
        ins: dict[fx.Node, None] = {}
        for n in s.nodes:
            for u in n.all_input_nodes:
                if u not in own:
                    ins.setdefault(u)
        s.inputs = list(ins)
        s.outputs = [n for n in s.nodes
                     if n in user_outs or any(owner.get(u, -1) != i and u.op != "output" for u in n.users)]
    del owner


# ---- storage aliasing ---------------------------------------------------------------------
def _schema_arg(node: fx.Node, idx: int, name: str) -> Any:
    if idx < len(node.args):
        return node.args[idx]
    return node.kwargs.get(name)


def alias_roots(cap: Captured) -> tuple[dict, dict]:
    """(roots, writes): for every op node, the nodes whose storage its output may share (itself
    when fresh), and the storages (as root nodes) it writes in place, from the op schemas."""
    roots: dict[fx.Node, set] = {}
    writes: dict[fx.Node, set] = {}

    def r(x: Any) -> set:
        if isinstance(x, fx.Node):
            return roots.get(x, {x})
        if isinstance(x, (list, tuple)):
            out: set = set()
            for y in x:
                out |= r(y)
            return out
        return set()

    for n in cap.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        mine: set = {n}
        wr: set = set()
        if t is operator.getitem:
            mine = r(n.args[0])
        elif isinstance(t, torch._ops.OpOverload):
            sch = t._schema
            ret_sets: set = set()
            for ret in sch.returns:
                if ret.alias_info is not None:
                    ret_sets |= set(ret.alias_info.before_set)
            shared: set = set()
            for idx, a in enumerate(sch.arguments):
                ai = a.alias_info
                if ai is None:
                    continue
                val = _schema_arg(n, idx, a.name)
                if ret_sets & set(ai.before_set):
                    shared |= r(val)
                if ai.is_write:
                    wr |= r(val)
            if shared:
                mine = shared
        roots[n] = mine
        writes[n] = wr
    return roots, writes


def merge_aliases(stages: list[Segment], cap: Captured) -> list[Segment]:
    roots, writes = alias_roots(cap)
    while True:
        owner = {n: i for i, s in enumerate(stages) for n in s.nodes}
        merge: tuple[int, int] | None = None
        for j, s in enumerate(stages):
            foreign = set()
            for o in s.outputs:
                foreign |= roots.get(o, {o})
            for n in s.nodes:
                foreign |= writes.get(n, set())
            others = [owner[x] for x in foreign if owner.get(x, j) != j]
            if others:
                merge = (min(others), j)
                break
        if merge is None:
            return stages
        a, b = merge
        span = stages[a:b + 1]
        head = span[0]
        joined = Segment("+".join(s.name for s in span), head.module, head.module_type,
                       [n for s in span for n in s.nodes])
        if len({s.module_type for s in span}) > 1:
            joined.module_type = "+".join(s.module_type for s in span)
        stages = stages[:a] + [joined] + stages[b + 1:]
        _link(stages, cap)


def _unique_names(stages: list[Segment]) -> None:
    seen: dict[str, int] = {}
    for s in stages:
        k = seen.get(s.name, 0)
        seen[s.name] = k + 1
        if k:
            s.name = f"{s.name}#{k + 1}"


__all__ = ["Segment", "cut", "group_modules", "alias_roots", "merge_aliases", "CONTAINERS"]
