"""The training graph that every solver plans over.

A `Graph` is a DAG of forward, loss and backward nodes whose ids are a topological order
(edge ``(i, k)`` implies ``i < k``).  Each node carries a profiled cost:

* ``time``: seconds to compute it once, at its first compute;
* ``recompute_time``: seconds each later compute (a recomputation) takes, when it differs from
  ``time``: a recomputation reads inputs saved long before, which the step has since pushed out
  of the caches, so a memory-bound op can take several times its first compute
  (`remat.frontends.profile` measures it cold).  None means ``time``.  It is never below ``time``
  (validated), so a bound that prices every recomputation at ``time`` stays a lower bound;
* ``bytes``: bytes of its output, allocated when it runs and held until freed;
* ``workspace_bytes``: transient bytes that live only while it runs;
* ``persistent_bytes``: bytes it allocates at its first run that stay allocated to the end of
  the step: the parameter gradients it accumulates first (PyTorch's default loop,
  ``zero_grad(set_to_none=True)``, allocates each gradient there);
* ``part_of``: set on the second and later *parts* of an op with several output tensors.

Ops with several outputs (batch norm's output and statistics, max pool's values and indices,
dropout's output and mask) are one node per output tensor, so each tensor is freed at its own
last use.  The op is its first node, the *leader* l, which carries the op's time and the bytes
of its first output; its other outputs are the nodes l+1, ..., l+m-1 (``part_of = l``), each
with the bytes of its tensor, time 0, no workspace or persistent bytes, and one input, the
leader (the edge (l, p)).  The leader's workspace includes the other parts' bytes, so that the
op's peak (every output allocated at once) is counted while it runs.  The parts of an op are
computed together: each compute of a part follows the compute of the part before it, with no
other compute or swap-in in between (`remat.core.simulate` checks it), so the bytes the model
counts at the last part are the ones the op really holds.  `Graph.op_members` lists them.

``fixed_bytes`` is memory resident for the whole step (parameters, inputs, optimizer state, and
the gradients when the loop keeps them, ``meta["grads"] == "resident"``); no schedule can remove
it and every budget includes it.  A breakdown of it may sit in ``meta["fixed_breakdown"]``.

JSON format (``remat.graph``; version 4 when a node has ``recompute_time``, else 3 when a node
has ``part_of``, else 2 when a node has ``persistent_bytes``, else 1, so a graph without them
reads as before, and a reader that would price recomputations at ``time`` refuses a version-4
file rather than mispredict it; all four load)::

    {"format": "remat.graph", "version": 1,
     "nodes": [{"id": 0, "name": "fc1", "kind": "forward", "time": 1e-3, "bytes": 4096,
                "workspace_bytes": 0}, ...],
     "edges": [[0, 1], ...], "fixed_bytes": 0, "meta": {...}}

Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from .errors import InvalidInputError

FORMAT = "remat.graph"
VERSION = 4
VERSIONS = (1, 2, 3, 4)  # what this remat reads (1: no persistent bytes; 2: no parts; 3: no recompute times)
KINDS = ("forward", "loss", "backward")
DEFAULT_BANDWIDTH = 16e9  # bytes/s, host<->device, until a frontend measures it


@dataclass(frozen=True)
class Node:
    id: int
    name: str
    kind: str
    time: float
    bytes: int
    workspace_bytes: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    persistent_bytes: int = 0
    part_of: int | None = None
    recompute_time: float | None = None

    @property
    def recompute_cost(self) -> float:
        """Seconds of one recomputation: ``recompute_time``, or ``time`` when it is None."""
        return self.time if self.recompute_time is None else self.recompute_time

    def to_dict(self) -> dict:
        d = {"id": self.id, "name": self.name, "kind": self.kind, "time": self.time,
             "bytes": self.bytes, "workspace_bytes": self.workspace_bytes}
        if self.persistent_bytes:  # (absent when 0: a graph without them hashes and reads as before)
            d["persistent_bytes"] = self.persistent_bytes
        if self.part_of is not None:
            d["part_of"] = self.part_of
        if self.recompute_time is not None:
            d["recompute_time"] = self.recompute_time
        d.update(self.extra)
        return d


class Graph:
    """A validated training DAG. Construct with `Graph(nodes, edges, fixed_bytes, meta)`."""

    def __init__(self, nodes: Iterable[Node], edges: Iterable[tuple[int, int]],
                 fixed_bytes: int = 0, meta: dict | None = None):
        self.nodes: list[Node] = list(nodes)
        self.edges: list[tuple[int, int]] = sorted({(int(a), int(b)) for a, b in edges})
        self.fixed_bytes = int(fixed_bytes)
        self.meta: dict = dict(meta or {})
        self._validate()

    # ---- structure -------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def preds(self) -> list[list[int]]:
        p: list[list[int]] = [[] for _ in self.nodes]
        for a, b in self.edges:
            p[b].append(a)
        return p

    @cached_property
    def succs(self) -> list[list[int]]:
        s: list[list[int]] = [[] for _ in self.nodes]
        for a, b in self.edges:
            s[a].append(b)
        return s

    @cached_property
    def persistent_before(self) -> list[int]:
        """Per node t: the persistent bytes of the nodes before it, all allocated when t first runs
        (first computes come in id order)."""
        out, acc = [], 0
        for v in self.nodes:
            out.append(acc)
            acc += v.persistent_bytes
        return out

    @cached_property
    def op_of(self) -> list[int]:
        """Per node: the leader of its op (itself unless it is a later part)."""
        return [v.id if v.part_of is None else v.part_of for v in self.nodes]

    @cached_property
    def op_members(self) -> dict[int, list[int]]:
        """Leader -> the nodes of its op (leader first), for the ops with several parts."""
        out: dict[int, list[int]] = {}
        for v in self.nodes:
            if v.part_of is not None:
                out.setdefault(v.part_of, [v.part_of]).append(v.id)
        return out

    @property
    def has_parts(self) -> bool:
        return bool(self.op_members)

    def members_of(self, i: int) -> list[int]:
        """The nodes of i's op (leader first): [i] for a node with one output."""
        return self.op_members.get(self.op_of[i], [i])

    @property
    def persistent_total(self) -> int:
        return sum(v.persistent_bytes for v in self.nodes)

    @property
    def optimizer_step_bytes(self) -> int:
        """What the optimizer's step allocates while it runs, after the backward
        (``meta["optimizer_step_bytes"]``, measured at trace when an optimizer is named; 0 else)."""
        return int(self.meta.get("optimizer_step_bytes") or 0)

    @property
    def step_end_bytes(self) -> int:
        """Non-fixed bytes at the step's end, with the optimizer's step: every persistent byte
        (the gradients) and its transient.  No schedule lowers them."""
        return self.persistent_total + self.optimizer_step_bytes

    @property
    def times(self) -> list[float]:
        return [v.time for v in self.nodes]

    @property
    def recompute_times(self) -> list[float]:
        """Per node the seconds of one recomputation (`Node.recompute_cost`): what the simulator
        charges for every compute after the first and the ILP for every R[t, i] with t > i."""
        return [v.recompute_cost for v in self.nodes]

    @property
    def has_recompute_times(self) -> bool:
        return any(v.recompute_time is not None for v in self.nodes)

    @property
    def sizes(self) -> list[int]:
        return [v.bytes for v in self.nodes]

    @property
    def bandwidth(self) -> float:
        """Host<->device bytes/s for the swap model: measured value in meta, else the default."""
        return float(self.meta.get("bandwidth", DEFAULT_BANDWIDTH))

    @property
    def total_time(self) -> float:
        """Time of one forward+backward with no recomputation (checkpoint-all)."""
        return float(sum(self.times))

    def forward_ids(self) -> list[int]:
        return [v.id for v in self.nodes if v.kind == "forward"]

    def to_networkx(self):
        import networkx as nx
        g = nx.DiGraph()
        for v in self.nodes:
            g.add_node(v.id, name=v.name, kind=v.kind, time=v.time, bytes=v.bytes)
        g.add_edges_from(self.edges)
        return g

    # ---- validation ------------------------------------------------------------------
    def _validate(self) -> None:
        ids = [v.id for v in self.nodes]
        if ids != list(range(len(ids))):
            raise InvalidInputError("graph.nodes: ids must be 0..n-1 in order (a topological order); "
                                    f"got {ids[:10]}{'...' if len(ids) > 10 else ''}")
        if not self.nodes:
            raise InvalidInputError("graph.nodes: the graph has no nodes")
        for v in self.nodes:
            where = f"graph.nodes[{v.id}] ({v.name!r})"
            if v.kind not in KINDS:
                raise InvalidInputError(f"{where}.kind: unknown kind {v.kind!r}; expected one of {KINDS}")
            if not isinstance(v.time, (int, float)) or not math.isfinite(v.time) or v.time < 0:
                raise InvalidInputError(f"{where}.time: must be a finite number >= 0, got {v.time!r}")
            r = v.recompute_time
            if r is not None and (not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r)
                                  or r < v.time):
                raise InvalidInputError(f"{where}.recompute_time: must be a finite number >= its time ({v.time!r}) "
                                        f"or absent, got {r!r}")
            for key in ("bytes", "workspace_bytes", "persistent_bytes"):
                val = getattr(v, key)
                if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                    raise InvalidInputError(f"{where}.{key}: must be an integer >= 0, got {val!r}")
        n = len(self.nodes)
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n):
                raise InvalidInputError(f"graph.edges: edge [{a}, {b}] names a missing node (ids are 0..{n - 1})")
            if a == b:
                raise InvalidInputError(f"graph.edges: self-loop [{a}, {b}] makes a cycle")
        back = [(a, b) for a, b in self.edges if a > b]
        if back:
            cyc = self._find_cycle()
            if cyc:
                raise InvalidInputError(f"graph.edges: the graph has a cycle through nodes {cyc}")
            raise InvalidInputError(f"graph.edges: edge {list(back[0])} goes backwards; node ids must be a "
                                    "topological order (renumber the nodes)")
        if self.fixed_bytes < 0:
            raise InvalidInputError(f"graph.fixed_bytes: must be >= 0, got {self.fixed_bytes}")
        self._validate_parts()

    def _validate_parts(self) -> None:
        for v in self.nodes:
            if v.part_of is None:
                continue
            where = f"graph.nodes[{v.id}] ({v.name!r}).part_of"
            l = v.part_of
            if not isinstance(l, int) or isinstance(l, bool) or not 0 <= l < v.id:
                raise InvalidInputError(f"{where}: must be the id of an earlier node (the op's leader), got {l!r}")
            prev = self.nodes[v.id - 1]
            if self.nodes[l].part_of is not None or (prev.id != l and prev.part_of != l):
                raise InvalidInputError(f"{where}: the parts of op {l} must be the nodes right after it, "
                                        f"each with part_of = {l}")
            if v.kind != self.nodes[l].kind or v.time != 0 or v.recompute_cost != 0 or v.workspace_bytes \
                    or v.persistent_bytes:
                raise InvalidInputError(f"{where}: a later part has its leader's kind, time 0 and no workspace "
                                        "or persistent bytes (the leader carries the op's)")
            if self.preds[v.id] != [l]:
                raise InvalidInputError(f"{where}: a later part reads its leader only (edge [{l}, {v.id}]), "
                                        f"got inputs {self.preds[v.id]}")

    def _find_cycle(self) -> list[int] | None:
        import networkx as nx
        try:
            cyc = nx.find_cycle(self.to_networkx())
        except nx.NetworkXNoCycle:
            return None
        return [a for a, _ in cyc]

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        version = 4 if self.has_recompute_times else 3 if self.has_parts else 2 if self.persistent_total else 1
        return {"format": FORMAT, "version": version,
                "nodes": [v.to_dict() for v in self.nodes],
                "edges": [list(e) for e in self.edges],
                "fixed_bytes": self.fixed_bytes, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: Any) -> "Graph":
        if not isinstance(d, dict):
            raise InvalidInputError("graph: expected a JSON object")
        if d.get("format") != FORMAT:
            raise InvalidInputError(f"graph.format: expected {FORMAT!r}, got {d.get('format')!r}")
        if d.get("version") not in VERSIONS:
            raise InvalidInputError(f"graph.version: this remat reads versions {', '.join(map(str, VERSIONS))}, "
                                    f"got {d.get('version')!r}")
        for key in ("nodes", "edges"):
            if not isinstance(d.get(key), list):
                raise InvalidInputError(f"graph.{key}: missing or not a list")
        nodes = []
        for idx, nd in enumerate(d["nodes"]):
            if not isinstance(nd, dict):
                raise InvalidInputError(f"graph.nodes[{idx}]: expected an object")
            for key in ("id", "kind", "time", "bytes"):
                if key not in nd:
                    raise InvalidInputError(f"graph.nodes[{idx}].{key}: missing")
            extra = {k: v for k, v in nd.items()
                     if k not in ("id", "name", "kind", "time", "bytes", "workspace_bytes", "persistent_bytes",
                                  "part_of", "recompute_time")}
            if d["version"] == 1 and "persistent_bytes" in nd:
                raise InvalidInputError(f"graph.nodes[{idx}].persistent_bytes: not in version 1; write version 2")
            if d["version"] < 3 and "part_of" in nd:
                raise InvalidInputError(f"graph.nodes[{idx}].part_of: not in version {d['version']}; write version 3")
            if d["version"] < 4 and "recompute_time" in nd:
                raise InvalidInputError(f"graph.nodes[{idx}].recompute_time: not in version {d['version']}; "
                                        "write version 4")
            nodes.append(Node(id=nd["id"], name=str(nd.get("name", f"n{nd['id']}")), kind=nd["kind"],
                              time=nd["time"], bytes=nd["bytes"],
                              workspace_bytes=nd.get("workspace_bytes", 0), extra=extra,
                              persistent_bytes=nd.get("persistent_bytes", 0), part_of=nd.get("part_of"),
                              recompute_time=nd.get("recompute_time")))
        edges = []
        for idx, e in enumerate(d["edges"]):
            if not (isinstance(e, (list, tuple)) and len(e) == 2 and all(isinstance(x, int) for x in e)):
                raise InvalidInputError(f"graph.edges[{idx}]: expected [src, dst] integers, got {e!r}")
            edges.append((e[0], e[1]))
        fixed = d.get("fixed_bytes", 0)
        if not isinstance(fixed, int) or isinstance(fixed, bool):
            raise InvalidInputError(f"graph.fixed_bytes: must be an integer, got {fixed!r}")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise InvalidInputError("graph.meta: expected an object")
        return cls(nodes, edges, fixed, meta)

    def content_hash(self) -> str:
        """sha256 over what the planner depends on (nodes, edges, fixed bytes), not meta."""
        body = {"nodes": [v.to_dict() for v in self.nodes], "edges": [list(e) for e in self.edges],
                "fixed_bytes": self.fixed_bytes}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Graph":
        return cls.from_dict(read_json(path, "graph"))

    def __repr__(self) -> str:
        return (f"Graph(n={self.n}, edges={len(self.edges)}, fixed_bytes={self.fixed_bytes}, "
                f"model={self.meta.get('model', '?')!r})")


def file_format(path: str | Path) -> str | None:
    """The ``format`` field of a JSON file (``"remat.plan"``, ``"remat.partition"``, ...); None
    when the file cannot be read, is not JSON or has none (the loader of the kind expected then
    says what is wrong)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return d.get("format") if isinstance(d, dict) else None


def read_json(path: str | Path, what: str) -> Any:
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"{what} file {str(p)!r} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{what} file {str(p)!r} is not valid JSON: {e}") from None
