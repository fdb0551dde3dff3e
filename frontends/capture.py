"""Capture a model's forward as an ATen-level `torch.fx.Graph` whose ops know their module.

`capture(model, args, kwargs)` returns a `Captured`: the graph, the real value of every
placeholder (parameters, buffers, user inputs, constants) and the user outputs with their
pytree spec.  Every ``call_function`` node carries ``meta["nn_module_stack"]``: ``{call key:
(module path, module type)}`` from the outermost module to the innermost one that ran it, with
one key per call (a module called twice has two keys), as `torch.export` records it.

Two ways, tried in order:

1. ``torch.export.export(model, args, kwargs, strict=False)`` (training IR: ATen before
   autograd, in-place ops kept; docs/references.md, "PyTorch mechanisms");
2. when export fails (data-dependent control flow, say), an *eager recording*: the model runs
   once on the real inputs under a `TorchDispatchMode` that records each ATen op with the module
   stack kept by forward hooks.  Control flow is taken as it went for these inputs (the graph
   is specialised to them).  The log says which was used and why.

If the model does not run on the example inputs at all, `InvalidInputError` names the module
that failed and the reason; if neither way captures it, `CaptureError` does.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from remat.core.errors import InvalidInputError, RematError

log = logging.getLogger(__name__)

EXPORT = "torch.export(strict=False)"
EAGER = "eager recording (TorchDispatchMode)"


class CaptureError(RematError):
    """The model runs eagerly but cannot be captured as a graph."""
    exit_code = 1


@dataclass
class Captured:
    graph: fx.Graph
    values: dict            # placeholder node -> real value
    kinds: dict             # placeholder node -> "parameter" | "buffer" | "input" | "constant"
    targets: dict           # placeholder node -> FQN (parameters, buffers) or input position
    outputs: list           # user outputs: fx nodes or constants, flattened
    out_spec: Any           # pytree spec of the model's output
    method: str
    notes: list = field(default_factory=list)


# ---- where a failure happened ------------------------------------------------------------
class ModuleStack:
    """Forward (pre-)hooks on every submodule keep the stack of modules running now.  After an
    exception the stack still names the innermost module that was running."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.stack: list[tuple[str, str, str]] = []  # (call key, path, type)
        self.calls: dict[str, int] = {}
        self.handles: list = []
        self.failed_at: tuple[str, str] | None = None

    def __enter__(self) -> "ModuleStack":
        for path, mod in self.model.named_modules(remove_duplicate=False):
            self.handles.append(mod.register_forward_pre_hook(self._pre(path, mod)))
            self.handles.append(mod.register_forward_hook(self._post(), always_call=True))
        return self

    def _pre(self, path: str, mod: torch.nn.Module):
        qual = f"{type(mod).__module__}.{type(mod).__qualname__}"

        def hook(module, args):
            n = self.calls.get(path, 0)
            self.calls[path] = n + 1
            self.stack.append((f"{path}@{n}" if n else path, path, qual))
        return hook

    def _post(self):
        def hook(module, args, output):
            if self.stack:
                if self.failed_at is None and _in_exception():
                    self.failed_at = self.innermost()
                self.stack.pop()
        return hook

    def innermost(self) -> tuple[str, str]:
        if not self.stack:
            return "", type(self.model).__name__
        _, path, qual = self.stack[-1]
        return path, qual.rsplit(".", 1)[-1]

    def module_stack(self) -> dict:
        return {key: (path, qual) for key, path, qual in self.stack}

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _in_exception() -> bool:
    import sys
    return sys.exc_info()[0] is not None


def _describe(where: tuple[str, str], model: torch.nn.Module) -> str:
    path, typ = where
    return f"module {path!r} ({typ})" if path else f"the model's own forward ({type(model).__name__})"


def _reason(e: BaseException) -> str:
    """First line of an exception plus the user frame torch.export names, if any."""
    text = str(e).strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    m = re.search(r'The following call raised this error:\s*\n\s*File "([^"]+)", line (\d+), in (\w+)[ \t]*\n'
                  r'(?:[ \t]+(\S.*))?', text)
    where = ""
    if m:
        where = f" (at {m.group(1)}:{m.group(2)} in {m.group(3)}"
        where += f": {m.group(4).strip()})" if m.group(4) else ")"
    if "data-dependent" in text or "GuardOnDataDependent" in type(e).__name__:
        first = "data-dependent control flow: " + re.split(r" \(unhinted|\.  ", first)[0]
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(e).__name__}: {first}{where}"


@contextlib.contextmanager
def quiet_torch_logs():
    """torch.export logs warnings and graph dumps on failure; keep them out of our output."""
    names = ["torch", "torch.fx", "torch._export", "torch.export", "torch._dynamo",
             "torch.fx.experimental.symbolic_shapes", "torch._subclasses"]
    saved = []
    for n in names:
        lg = logging.getLogger(n)
        saved.append((lg, lg.level))
        lg.setLevel(logging.CRITICAL)
    try:
        import io
        import warnings
        # torch.export prints a partial graph to stderr when it fails (torch/export/_trace.py)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lvl in saved:
            lg.setLevel(lvl)


# ---- 1. torch.export -------------------------------------------------------------------------
@contextlib.contextmanager
def traced_like_export():
    """Run the model's Python as `torch.export` does: `torch.compiler.is_compiling()` and
    `is_exporting()` answer True, so libraries take their traceable paths (transformers skips its
    data-dependent packed-sequence check, which otherwise reads a tensor's value while fake
    tensors are traced: ``DataDependentOutputException: aten._local_scalar_dense``).  torch.export
    enters this same state around its tracing (`torch._export.utils._compiling_state_context`)."""
    try:
        from torch._export.utils import _compiling_state_context as state
    except ImportError:  # pragma: no cover - older or newer torch: the public flags by hand
        state = None
    if state is not None:
        with state():
            yield
        return
    old = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = old


def capture_export(model: torch.nn.Module, args: tuple, kwargs: dict) -> Captured:
    from torch.export import export
    from torch.export.graph_signature import InputKind, OutputKind
    ep = export(model, args, kwargs, strict=False)
    sig = ep.graph_signature
    gm = ep.graph_module
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    flat_inputs = tree_flatten((args, kwargs))[0]
    values, kinds, targets = {}, {}, {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_pos = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.PARAMETER:
            values[node], kinds[node], targets[node] = params[spec.target], "parameter", spec.target
        elif spec.kind == InputKind.BUFFER:
            values[node], kinds[node], targets[node] = buffers[spec.target], "buffer", spec.target
        elif spec.kind == InputKind.USER_INPUT:
            values[node], kinds[node], targets[node] = flat_inputs[user_pos], "input", user_pos
            user_pos += 1
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            values[node], kinds[node], targets[node] = ep.constants[spec.target], "constant", spec.target
        else:
            raise CaptureError(f"torch.export gave an input of kind {spec.kind.name} ({node.name}), which "
                               "remat does not handle")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    user_outs = [o for o, spec in zip(outs, sig.output_specs) if spec.kind == OutputKind.USER_OUTPUT]
    for o, spec in zip(outs, sig.output_specs):
        if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION):
            raise CaptureError(f"torch.export gave an output of kind {spec.kind.name}, which remat does not "
                               "handle")
    # buffer mutations (functionalised graphs) are applied by the ops themselves in the training IR
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            values[n], kinds[n], targets[n] = getattr(gm, n.target), "constant", n.target
    return Captured(gm.graph, values, kinds, targets, user_outs, ep.call_spec.out_spec, EXPORT)


# ---- 2. eager recording --------------------------------------------------------------------
_SKIP = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.sym_size.int,
         torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}


class _Recorder(TorchDispatchMode):
    def __init__(self, cap: Captured, node_of: dict, keep: list, modules: ModuleStack):
        super().__init__()
        self.cap = cap
        self.node_of = node_of      # id(tensor) -> fx node
        self.keep = keep            # keeps recorded tensors alive so ids stay unique
        self.modules = modules
        self.n_const = 0

    def _arg(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        node = self.node_of.get(id(x))
        if node is None:  # a tensor made outside the forward: a constant
            node = self.cap.graph.placeholder(f"constant_{self.n_const}")
            self.n_const += 1
            self.cap.values[node], self.cap.kinds[node], self.cap.targets[node] = x, "constant", node.name
            self.node_of[id(x)] = node
            self.keep.append(x)
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SKIP:
            return out
        leaves = tree_flatten(out)[0]
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            return out
        g = self.cap.graph
        node = g.call_function(func, tree_map(self._arg, args), tree_map(self._arg, kwargs))
        node.meta["nn_module_stack"] = self.modules.module_stack()
        if isinstance(out, torch.Tensor):
            self.node_of[id(out)] = node
            self.keep.append(out)
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    item = g.call_function(operator.getitem, (node, i))
                    item.meta["nn_module_stack"] = node.meta["nn_module_stack"]
                    self.node_of[id(t)] = item
                    self.keep.append(t)
        return out


def capture_eager(model: torch.nn.Module, args: tuple, kwargs: dict) -> Captured:
    g = fx.Graph()
    cap = Captured(g, {}, {}, {}, [], None, EAGER)
    node_of: dict[int, fx.Node] = {}
    keep: list = []
    seen: set[int] = set()
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for fqn, t in named:
            if id(t) in seen:  # a shared parameter: one placeholder
                continue
            seen.add(id(t))
            node = g.placeholder(("p_" if kind == "parameter" else "b_") + fqn.replace(".", "_"))
            cap.values[node], cap.kinds[node], cap.targets[node] = t, kind, fqn
            node_of[id(t)] = node
    for pos, x in enumerate(tree_flatten((args, kwargs))[0]):
        node = g.placeholder(f"input_{pos}")
        cap.values[node], cap.kinds[node], cap.targets[node] = x, "input", pos
        if isinstance(x, torch.Tensor):
            node_of[id(x)] = node
    with ModuleStack(model) as modules, _Recorder(cap, node_of, keep, modules) as rec:
        out = model(*args, **kwargs)
    flat, spec = tree_flatten(out)
    cap.outputs = [rec._arg(t) if isinstance(t, torch.Tensor) else t for t in flat]
    cap.out_spec = spec
    g.output(tuple(cap.outputs))
    return cap


# ---- both -------------------------------------------------------------------------------------
def capture(model: torch.nn.Module, args: tuple, kwargs: dict, mode: str = "auto") -> Captured:
    """mode: "auto" (export, else an eager recording), "export" (no fallback), "eager"."""
    if mode == "eager":
        _check_runs(model, args, kwargs)
        return _record(model, args, kwargs, None)
    with quiet_torch_logs(), ModuleStack(model) as where:
        try:
            return capture_export(model, args, kwargs)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - any export failure is diagnosed below
            export_error, export_where = e, where.failed_at or where.innermost()
    _check_runs(model, args, kwargs)
    why = f"{_describe(export_where, model)}: {_reason(export_error)}"
    if mode == "export":
        raise CaptureError(f"torch.export cannot capture the model: {why}") from export_error
    log.warning("torch.export cannot capture the model (%s); falling back to an eager recording of the ops "
                "for these example inputs (control flow is specialised to them)", why)
    return _record(model, args, kwargs, why)


def _check_runs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Run the model once without grad; if it fails, the example inputs do not fit it."""
    with ModuleStack(model) as where, torch.no_grad(), torch.random.fork_rng(devices=_devices(args, kwargs)):
        snapshot = _buffer_snapshot(model)
        try:
            model(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            at = where.failed_at or where.innermost()
            raise InvalidInputError(f"the model fails on the example inputs in {_describe(at, model)}: "
                                    f"{_reason(e)}") from e
        finally:
            _restore(model, snapshot)


def _record(model: torch.nn.Module, args: tuple, kwargs: dict, why: str | None) -> Captured:
    try:
        with torch.random.fork_rng(devices=_devices(args, kwargs)):
            snapshot = _buffer_snapshot(model)
            try:
                cap = capture_eager(model, args, kwargs)
            finally:
                _restore(model, snapshot)
    except Exception as e:  # noqa: BLE001
        first = f"torch.export fails in {why}; the eager recording fails too" if why else "the eager recording fails"
        raise CaptureError(f"cannot capture the model: {first}: {_reason(e)}") from e
    if why:
        cap.notes.append(f"torch.export failed in {why}")
    return cap


def _devices(args: tuple, kwargs: dict) -> list:
    devs = {t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    return sorted(devs, key=str)


def _buffer_snapshot(model: torch.nn.Module) -> list:
    return [(b, b.detach().clone()) for b in model.buffers()]


def _restore(model: torch.nn.Module, snapshot: list) -> None:
    with torch.no_grad():
        for b, saved in snapshot:
            b.copy_(saved)


__all__ = ["capture", "capture_export", "capture_eager", "Captured", "CaptureError", "ModuleStack",
           "quiet_torch_logs", "EXPORT", "EAGER"]
