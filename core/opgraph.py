"""The graph a partition across devices is searched on: one step's forward and loss as ops with
their tensors' shapes (`remat.frontends.partitioning` captures it from a model; the search is
`remat.solvers.tofu`).

An `OpGraph` lists tensors (`TensorInfo`: shape, bytes per element, kind ``"parameter"`` /
``"input"`` (the batch) / ``"activation"``, and whether the step computes its gradient) and ops
(`OpInfo`: the ATen op's name, its tensor inputs and outputs by id, its positional arguments with
every tensor replaced by None, and the module that ran it), in an order where every tensor is
made before it is read.  The backward is not listed: the search costs each op's backward from
its forward.  Nothing here imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidInputError

KINDS = ("parameter", "input", "activation")


@dataclass(frozen=True)
class TensorInfo:
    id: int
    name: str
    shape: tuple
    itemsize: int
    kind: str
    grad: bool

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class OpInfo:
    id: int
    op: str
    inputs: tuple
    outputs: tuple
    module: str = ""
    args: tuple = ()


@dataclass
class OpGraph:
    tensors: dict          # id -> TensorInfo
    ops: list              # OpInfo, in an order where each tensor is made before it is read
    loss: int              # the id of the loss tensor
    meta: dict = field(default_factory=dict)
    # what is derived from this graph once (the ops' descriptions, last readers): never carried
    # to another graph with `meta`
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        made = {t for t, info in self.tensors.items() if info.kind != "activation"}
        for info in self.tensors.values():
            if info.kind not in KINDS:
                raise InvalidInputError(f"tensor {info.id} ({info.name}): unknown kind {info.kind!r}; expected one "
                                        f"of {KINDS}")
        for i, o in enumerate(self.ops):
            if o.id != i:
                raise InvalidInputError(f"ops[{i}].id: ops are numbered 0..n-1 in order, got {o.id}")
            for t in o.inputs + o.outputs:
                if t not in self.tensors:
                    raise InvalidInputError(f"op {o.id} ({o.op}) names tensor {t}, which the graph does not list")
            late = [t for t in o.inputs if t not in made]
            if late:
                raise InvalidInputError(f"op {o.id} ({o.op}) reads tensor {late[0]} before any op makes it")
            made.update(o.outputs)
        if self.loss not in made or self.tensors[self.loss].kind != "activation":
            raise InvalidInputError(f"the loss tensor {self.loss} is not made by any op")

    @property
    def parameter_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors.values() if t.kind == "parameter")
