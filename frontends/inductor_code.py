"""What inductor's generated code allocates, read from the code itself.

Inductor compiles each graph of a region (the partitioner's forward, then its backward) into a
Python module whose ``call(args)`` runs the step: the code the executor runs, after inductor's
own fusion, buffer reuse and memory-aware reordering, none of which the op-by-op replay of the
partitioner's graphs (`remat.frontends.compiled.program`) sees.  Its wrapper is straight-line
code of a few statement shapes, which this module follows statement by statement:

* ``a, b, tangents_1 = args; args.clear()``: the inputs, in the graph's placeholder order;
* ``bufN = empty_strided_<device>(size, stride, dtype)``: a new storage of
  ``(1 + sum((size_i - 1) * stride_i)) * itemsize`` bytes (on CUDA rounded up to the caching
  allocator's 512-byte blocks);
* ``bufM = bufN; del bufN  # reuse`` and ``bufM = reinterpret_tensor(bufN, ...)``: another name
  for the same storage (a reuse, or a view);
* ``bufN = extern_kernels.f(...)`` / ``bufN = torch.ops.aten.f.default(...)`` (or a random op
  run through ``torch.ops.higher_order.run_and_save_rng_state`` / ``run_with_rng_state``): a
  kernel that allocates its result, sized by the ``assert_size_stride(bufN, size, stride)``
  inductor writes after it; a result that is a tuple is taken apart by ``bufK = bufN[i]`` (or
  ``bufN[i][j]``: each part a storage, sized by its own assertion, alive while either name is).
  All of a kernel's results are allocated where it runs, with its inputs alive (the code drops
  those before it takes the results apart); a part the code never names is not counted;
* ``del a, b``: names dropped; a storage is freed when no name holds it and the caller does not
  (`CodeRun`'s ``pinned``), as the generated code frees it once its last reader has run;
* ``return (...)``: what the graph hands on (the forward: its results, then what it saves for
  the backward); every other name dies with the call.

Kernels it calls (``cpp_fused_*``, ``triton_*``, ``extern_kernels.mm(..., out=buf)``) allocate
nothing beyond what their statements name, except an ATen kernel's own temporaries (a
convolution's unfolded input, a dropout's random draw): `step_bytes` adds the scratch the
caller knows for the fx ops that the statement's "Source Nodes" comment names.  A statement of another
shape that binds a name raises `UnreadableCode`, so a reading is exact or refused, never a guess.
"""
from __future__ import annotations

import ast
import functools
import itertools
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .measuring import block_bytes

ITEMSIZE = {name: torch.empty((), dtype=getattr(torch, name)).element_size()
            for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                         "bool", "complex64", "float8_e4m3fn", "float8_e5m2")}
_FRESH = itertools.count()
SOURCES = re.compile(r"#\s*(?:Topologically Sorted|Unsorted) Source Nodes:\s*\[([^\]]*)\]")


class UnreadableCode(Exception):
    """The generated code has a statement this module does not follow (its message names it)."""


@dataclass
class CodeRun:
    """One ``call`` followed statement by statement (`follow`).

    ``inputs``: its input names in order; ``peak_bytes``: the most the counted storages took at
    once (the storages given as live at the start included; scratch included); ``returned``: per
    returned value, its storage key (None for ``None`` and scalars); ``sizes``: storage key ->
    bytes of every storage it knows; ``peak_line``: the statement at the peak; ``trace``: the
    counted bytes at each statement that allocates or runs an ATen kernel; ``inputs_bytes``: the
    counted bytes once its inputs are bound."""
    inputs: list
    peak_bytes: int = 0
    inputs_bytes: int = 0
    returned: list = field(default_factory=list)
    sizes: dict = field(default_factory=dict)
    peak_line: str = ""
    trace: list = field(default_factory=list)   # (bytes, statement) at each statement that allocates or runs ATen
    peak_live: dict = field(default_factory=dict)   # storage key -> bytes, counted at the peak


def _call_body(source: str) -> list:
    """The statements of the module's ``call`` (a method of its ``Runner`` class, or a function)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node.body
    raise UnreadableCode("no call() in the generated module")


def _ints(node: ast.AST) -> list[int]:
    value = ast.literal_eval(node)
    return [int(v) for v in value]


def extent_bytes(size: list[int], stride: list[int], itemsize: int) -> int:
    """Bytes a strided tensor spans: its last element's offset plus one, in items."""
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(size, stride))) * itemsize


def _dtype_size(node: ast.AST) -> int:
    name = ast.unparse(node).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise UnreadableCode(f"dtype {name}")
    return ITEMSIZE[name]


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _base(node: ast.AST) -> str | None:
    """The storage's owner a value expression names: ``buf3``, ``reinterpret_tensor(buf3, ...)``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("reinterpret_tensor", "torch.as_strided") \
            and node.args:
        return _base(node.args[0])
    return None


def _tuple(node: ast.AST) -> str | None:
    """The name a part of a tuple result is taken from: ``buf7`` of ``buf7[1][0]``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return _name(node)


def _kernel(call: ast.Call) -> str:
    """The ATen op a kernel statement runs: ``mm`` of ``extern_kernels.mm(...)``,
    ``convolution_backward`` of ``torch.ops.aten.convolution_backward.default(...)``, the op a
    higher-order op is handed (``native_dropout`` of ``run_with_rng_state(state,
    torch.ops.aten.native_dropout.default, ...)``)."""
    parts = ast.unparse(call.func).split(".")
    if parts[:3] == ["torch", "ops", "higher_order"]:
        op = next((a for a in call.args if ast.unparse(a).startswith("torch.ops.aten.")), None)
        return _kernel(ast.Call(func=op, args=[], keywords=[])) if op is not None else parts[-1]
    if parts[:3] == ["torch", "ops", "aten"] and len(parts) > 3:
        return parts[3]
    return parts[-1]


def _path(node: ast.AST) -> tuple:
    """The indices of a part of a tuple result: ``(1, 0)`` for ``buf7[1][0]``."""
    out = []
    while isinstance(node, ast.Subscript):
        out.append(ast.literal_eval(node.slice))
        node = node.value
    return tuple(reversed(out))


def follow(source: str, device: torch.device, keys: Callable[[list], list], pinned: set = frozenset(),
           itemsize: Callable[[list, list, tuple, str], "int | None"] = lambda names, size, path, kernel: None,
           input_itemsize: Callable[[str], "int | None"] = lambda name: None,
           scratch: Callable[[list, str], int] = lambda names, kernel: 0,
           shape: Callable[[list, tuple, str], "tuple | None"] = lambda names, path, kernel: None) -> CodeRun:
    """Follow ``call`` in `source` (module docstring).

    `keys(inputs)`: per input name (in order; called once the names are read), its storage key
    and, for an input whose bytes count, its bytes (None: not counted, a parameter say); `pinned`:
    keys the caller holds (never freed here); `itemsize(names, size, path, kernel)`: the element
    size of an allocating kernel's result (the fx ops its comment names, the result's size, for a
    part of a tuple result its indices, ``(1, 0)`` for ``buf7[1][0]``, else ``()``, and the ATen
    op it runs, as `scratch`'s), or None: then
    that of the kernel's first argument (an ATen kernel's result has its input's dtype: a matrix
    product's, a convolution's and its backward's; a random op run again from a generator state,
    ``run_with_rng_state(state, op, x, ...)``, its first after the state), `input_itemsize(name)`
    for an input;
    `scratch(names, kernel)`: the bytes an ATen kernel allocates inside itself for those fx ops
    (`kernel`: the ATen op it runs, ``"convolution"`` for ``extern_kernels.convolution``, the
    random op a generator state runs again, where the ops named are more); `shape(names, path,
    kernel)`: (size, stride) of a kernel's result the code never asserts (inductor asserts no
    integer scan's, ``aten.cumsum(..., dtype=torch.int64)``), from the value of the fx op it runs,
    or None (unreadable).  The
    storages the code allocates count, and the counted inputs until the code drops their last
    name (unless pinned)."""
    body = _call_body(source)
    lines = source.splitlines()
    holders: dict = {}     # storage key -> names holding it
    owner: dict = {}       # name -> storage keys it holds
    live: dict = {}        # counted storage key -> bytes
    run = CodeRun(inputs=[])
    sizes = run.sizes
    elem: dict = {}        # name -> element size
    # (first, what the code asserts of each name, and which names are parts of which tuple
    # result: a kernel's results are allocated where it runs, with its inputs alive, so their
    # sizes are needed before the statements that take them apart and assert them)
    asserted: dict = {}    # name -> (size, stride) of its first assertion
    parts: dict = {}       # a tuple result's name -> [(a part's name, its indices)]
    for st in body:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) \
                and ast.unparse(st.value.func) == "assert_size_stride" and _name(st.value.args[0]) is not None:
            asserted.setdefault(_name(st.value.args[0]), (_ints(st.value.args[1]), _ints(st.value.args[2])))
        elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                and isinstance(st.value, ast.Subscript) and _tuple(st.value) is not None:
            parts.setdefault(_tuple(st.value), []).append((st.targets[0].id, _path(st.value)))

    def bind(name: str, ks: list) -> None:
        drop(name)
        owner[name] = list(ks)
        for k in ks:
            holders.setdefault(k, set()).add(name)

    def drop(name: str) -> None:
        for k in owner.pop(name, ()):
            h = holders.get(k)
            if h is not None:
                h.discard(name)
                if not h and k not in pinned:
                    live.pop(k, None)

    def note(line: str, extra: int = 0) -> None:
        now = sum(live.values()) + extra
        run.trace.append((now, line.strip()))
        if now > run.peak_bytes:
            run.peak_bytes, run.peak_line, run.peak_live = now, line.strip(), dict(live)

    def storage(nbytes: int) -> tuple:
        k = ("code", next(_FRESH))   # (unique across calls: a forward's storages go on in its backward)
        sizes[k] = live[k] = nbytes
        return k

    def ops_above(lineno: int) -> list:
        """The fx ops the comments just above a statement name."""
        i = lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            m = SOURCES.search(lines[i])
            if m:
                return [s.strip() for s in m.group(1).split(",") if s.strip()]
            i -= 1
        return []

    note("(start)")
    for st in body:
        text = lines[st.lineno - 1]
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple) \
                and _name(st.value) == "args":
            run.inputs = [_name(e) for e in st.targets[0].elts]
            if any(n is None for n in run.inputs):
                raise UnreadableCode(text.strip())
            for n, (k, nbytes) in zip(run.inputs, keys(run.inputs)):
                bind(n, [k])
                elem[n] = input_itemsize(n)
                if nbytes is not None:
                    sizes[k] = live[k] = nbytes
            run.inputs_bytes = sum(live.values())
            note("(inputs)")
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            target, value = st.targets[0].id, st.value
            func = ast.unparse(value.func) if isinstance(value, ast.Call) else ""
            if func.startswith("empty_strided_"):
                size, stride, elem[target] = _ints(value.args[0]), _ints(value.args[1]), _dtype_size(value.args[2])
                bind(target, [storage(block_bytes(extent_bytes(size, stride, elem[target]), device))])
                note(text)
            elif _base(value) is not None and _base(value) in owner:
                bind(target, owner[_base(value)])
                elem[target] = elem.get(_base(value))
            elif func.startswith(("extern_kernels.", "torch.ops.")):
                # (a kernel that allocates its result, or a tuple of them: each sized by its assertion)
                args = value.args[1:] if func.endswith("run_with_rng_state") else value.args
                first = next((elem.get(_base(a)) for a in args if _base(a) in owner), None)
                ops, kernel = ops_above(st.lineno), _kernel(value)
                results = parts.get(target, [(target, ())])
                for name, path in results:
                    if name not in asserted and (got := shape(ops, path, kernel)) is not None:
                        asserted[name] = got
                if any(name not in asserted for name, _ in results):
                    raise UnreadableCode(f"a kernel's result whose size is never asserted: {text.strip()}")
                ks = []
                for name, path in results:
                    size, stride = asserted[name]
                    # (``run_and_save_rng_state``'s first part is the generator's state: bytes)
                    state = func.endswith("run_and_save_rng_state") and path == (0,)
                    elem[name] = 1 if state else itemsize(ops, size, path, kernel) or first
                    if elem[name] is None:
                        raise UnreadableCode(f"the dtype of {name}: {text.strip()}")
                    ks.append(storage(block_bytes(extent_bytes(size, stride, elem[name]), device)))
                    if name != target:
                        bind(name, [ks[-1]])
                bind(target, ks)   # (a tuple's name holds every part)
                note(text, scratch(ops, kernel))
            elif isinstance(value, ast.Subscript) and _tuple(value) in owner and target in owner:
                pass   # (a part of a kernel's tuple result: bound where the kernel ran)
            else:
                raise UnreadableCode(text.strip())
            continue
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            func = ast.unparse(st.value.func)
            if func.startswith(("extern_kernels.", "torch.ops.")):
                note(text, scratch(ops_above(st.lineno), _kernel(st.value)))
            continue
        if isinstance(st, ast.Delete):
            for t in st.targets:
                for n in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if _name(n) is not None:
                        drop(_name(n))
            continue
        if isinstance(st, ast.Return):
            vals = st.value.elts if isinstance(st.value, ast.Tuple) else [st.value]
            for v in vals:
                b = _base(v)
                run.returned.append(owner[b][0] if b in owner and owner[b] else None)
            break
        # (anything else binds no storage: kernel launches with their outputs given, args.clear())
    return run


@dataclass
class CodePeaks:
    """A region's peaks by its generated code (`step_bytes`), fixed bytes not included."""
    forward_bytes: int
    backward_bytes: int
    saved_bytes: int
    forward_line: str
    backward_line: str


def step_bytes(forward: str, backward: str, num_fwd_outputs: int, device: torch.device,
               fixed: Callable[[list], list], tangent_bytes: Callable[[str], int], held_tangents: set = frozenset(),
               itemsize: Callable[[str, list, list, tuple, str], "int | None"] = lambda graph, names, size, path, kernel: None,
               input_itemsize: Callable[[str, str], "int | None"] = lambda graph, name: None,
               scratch: Callable[[str, list, str], int] = lambda graph, names, kernel: 0,
               shape: Callable[[str, list, tuple, str], "tuple | None"] = lambda graph, names, path, kernel: None,
               keep_outputs: bool = True) -> CodePeaks:
    """A region's forward and backward as their generated code runs them.

    The forward: its inputs (`fixed(names)`: their storage keys; the parameters, buffers and
    batch, never counted) and the storages it allocates.  Its first `num_fwd_outputs` returned
    values are the region's results, which the caller holds through the backward (with
    `keep_outputs` false it drops them as the backward starts: they count at that instant only,
    with its inputs); the rest are
    what it saves, the backward's first inputs in order; its other inputs are the tangents
    (`tangent_bytes(name)`).  The backward starts with the results, the saved storages and the
    tangents, frees the saved ones and the tangents when their last name goes (but those in
    `held_tangents`, which its caller holds too: a loss's gradient, which ``backward()`` holds
    to its end), and allocates its own; what it returns (the gradients) stays.  `itemsize`,
    `input_itemsize`, `scratch` and `shape` are `follow`'s, with the graph (``"forward"`` or
    ``"backward"``) first."""
    def on(which: str) -> dict:
        return dict(itemsize=functools.partial(itemsize, which), input_itemsize=functools.partial(input_itemsize, which),
                    scratch=functools.partial(scratch, which), shape=functools.partial(shape, which))
    fw = follow(forward, device, lambda names: [(k, None) for k in fixed(names)], **on("forward"))
    fixed_keys = set(fixed(fw.inputs))
    own = lambda k: isinstance(k, tuple) and k[:1] == ("code",)  # noqa: E731
    results = [k for k in fw.returned[:num_fwd_outputs] if own(k)]
    saved = fw.returned[num_fwd_outputs:]

    def bw_keys(names: list) -> list:
        if len(names) < len(saved):
            raise UnreadableCode(f"the backward takes {len(names)} inputs, the forward saves {len(saved)}")
        out = []
        for n, k in zip(names, saved):
            if k in fixed_keys and k != fixed([n])[0]:   # (a saved forward input keeps its name)
                raise UnreadableCode(f"the backward's input {n} is not the forward's saved input {k}")
            out.append((k, fw.sizes[k]) if own(k) else (k if k is not None else ("input", n), None))
        out += [(("tangent", n), tangent_bytes(n)) for n in names[len(saved):]]
        return out

    # (the results, held by the caller: counted from the backward's start, never freed in it)
    held = {k: fw.sizes[k] for k in results} if keep_outputs else {}
    bw = follow(backward, device, bw_keys, pinned=set(held) | fixed_keys | {("tangent", n) for n in held_tangents},
                **on("backward"))
    held_only = sum(b for k, b in held.items() if k not in saved)
    saved_bytes = sum(fw.sizes[k] for k in set(saved) if own(k) and k not in held)
    bw_bytes, bw_line = bw.peak_bytes + held_only, bw.peak_line
    if not keep_outputs:   # (the loss's instant: the results the caller drops, with the backward's inputs)
        start = bw.inputs_bytes + sum(fw.sizes[k] for k in results if k not in saved)
        if start > bw_bytes:
            bw_bytes, bw_line = start, "(the backward's inputs, with the results the caller drops then)"
    return CodePeaks(fw.peak_bytes, bw_bytes, saved_bytes, fw.peak_line, bw_line)
