"""The graph the partition search splits: one step's forward and loss as ATen ops with shapes.

`op_graph(model, example_inputs, loss_fn)` captures ``loss_fn(model(*inputs), *batch)`` with
`capture.capture` (torch.export's training IR, an eager recording where export fails) and lists
every op with a tensor output as an `OpInfo` (`remat.core.opgraph`): its name, its tensors (with
the shapes the capture recorded), its positional arguments and the module that ran it.  Placeholders become parameters (trainable ones have gradients), buffers (whole on every
device, no gradient) and the batch.  An op of several outputs (``split``) lists the outputs the
graph reads (its ``getitem`` results).  Nothing is run beyond the capture itself.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from remat.core.errors import InvalidInputError
from remat.core.opgraph import OpGraph, OpInfo, TensorInfo

from .base import default_loss, split_inputs, step_loss
from .capture import capture


class _Step(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_fn: Callable, count: int | None):
        super().__init__()
        self.model, self.loss_fn, self.count = model, loss_fn, count

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return step_loss(self.model, self.loss_fn, args, kwargs, self.count)


def _name(target: Any) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def _module(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("model.").removeprefix("model")


@dataclass
class StepCapture:
    """An `OpGraph` with what it was made from: the captured fx graph (`captured`), the fx node of
    each op (`op_nodes`, in the order of ``graph.ops``) and of each tensor (`tensor_nodes`)."""
    graph: OpGraph
    captured: Any
    op_nodes: list
    tensor_nodes: dict


def op_graph(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
             model_inputs: int | None = None, name: str = "") -> OpGraph:
    """The forward and loss of one step of `model` on `example_inputs` (module docstring).
    Without `loss_fn`, `base.default_loss` (the sum of the output)."""
    return capture_step(model, example_inputs, loss_fn, model_inputs, name).graph


def capture_step(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
                 model_inputs: int | None = None, name: str = "") -> StepCapture:
    """`op_graph`, keeping the capture (for running the step op by op, `frontends.distributed`)."""
    args, kwargs = split_inputs(example_inputs, None)
    loss_fn = loss_fn or default_loss
    cap = capture(_Step(model, loss_fn, model_inputs), args, kwargs)
    tensors: dict = {}
    ids: dict = {}
    grad: dict = {}

    def tensor_of(n: fx.Node, kind: str, requires: bool) -> int | None:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        tid = len(tensors)
        requires = bool(requires and (val.is_floating_point() or val.is_complex()))
        tensors[tid] = TensorInfo(tid, n.name, tuple(int(s) for s in val.shape), val.element_size(), kind, requires)
        ids[n] = tid
        grad[n] = requires
        return tid

    for n in cap.graph.nodes:
        if n.op != "placeholder":
            continue
        kind = cap.kinds.get(n)
        value = cap.values.get(n)
        if kind == "parameter":
            tensor_of(n, "parameter", bool(getattr(value, "requires_grad", True)))
        elif kind == "buffer":
            tensor_of(n, "parameter", False)
        else:
            tensor_of(n, "input", False)
    raw: list = []       # [op name, input ids, output ids, module, positional arguments without tensors]
    pending: dict = {}   # multi-output op node -> its index in raw
    for n in cap.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:
            src = n.args[0]
            if src in pending:
                tid = tensor_of(n, "activation", grad.get(src, False))
                if tid is not None:
                    raw[pending[src]][2].append(tid)
            continue
        flat_in = [a for a in _flat(n.args) if isinstance(a, fx.Node) and a in ids]
        requires = any(grad.get(a, False) for a in flat_in)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            outs = [tensor_of(n, "activation", requires)]
        elif isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val):
            grad[n] = requires
            outs = []
            pending[n] = len(raw)
        else:
            continue
        raw.append([_name(n.target), [ids[a] for a in flat_in], outs, _module(n),
                    tuple(None if isinstance(a, fx.Node) else a for a in n.args), n])
    done, op_nodes = [], []
    for op, inputs, outputs, module, args_, node in raw:
        if outputs:
            done.append(OpInfo(len(done), op, tuple(inputs), tuple(outputs), module, args_))
            op_nodes.append(node)
    loss_node = cap.outputs[0] if cap.outputs else None
    if not isinstance(loss_node, fx.Node) or loss_node not in ids:
        raise InvalidInputError("partition: the step's loss is not a tensor computed from the model's output")
    loss = ids[loss_node]
    if tensors[loss].shape not in ((), (1,)):
        raise InvalidInputError(f"loss_fn must return a scalar tensor, got shape {tensors[loss].shape}")
    graph = OpGraph(tensors, done, loss, {"model": name or type(model).__name__, "capture": cap.method})
    return StepCapture(graph, cap, op_nodes, {t: n for n, t in ids.items()})


def _flat(args: Any) -> list:
    out: list = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out
