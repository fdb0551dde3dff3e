"""Synthetic training graphs for tests and benchmarks (no torch).

Every generator builds a forward DAG and turns it into a training graph with `from_forward`,
following Checkmate's layer-graph rule: forward nodes, one loss node, then one backward node
per forward node in reverse order.  The backward node of layer v reads

* the gradient from the backward node of every consumer of v (the loss for forward sinks),
* v's own output, and the outputs of v's forward inputs (what autograd saves for most layers).

Costs are in abstract units: ``bytes`` integers, ``time`` in "seconds" of unit size, and
``meta["bandwidth"]`` in bytes per unit time (default 1: moving one unit of bytes costs one
unit of forward time, roughly a conv layer against PCIe).
"""
from __future__ import annotations

import random
from typing import Sequence

from remat.core.graph import Graph, Node


def from_forward(times: Sequence[float], sizes: Sequence[int], edges: Sequence[tuple[int, int]],
                 *, bwd_factor: float = 2.0, loss_time: float | None = None, loss_bytes: int | None = None,
                 names: Sequence[str] | None = None, fixed_bytes: int = 0, meta: dict | None = None) -> Graph:
    """Training graph from a forward DAG whose node ids 0..m-1 are a topological order."""
    m = len(times)
    assert len(sizes) == m
    names = list(names) if names is not None else [f"f{i}" for i in range(m)]
    fpreds: list[list[int]] = [[] for _ in range(m)]
    fsuccs: list[list[int]] = [[] for _ in range(m)]
    for a, b in edges:
        assert a < b, "forward edges must follow the topological order"
        fpreds[b].append(a)
        fsuccs[a].append(b)
    loss = m
    bwd = {v: m + 1 + (m - 1 - v) for v in range(m)}
    nodes = [Node(i, names[i], "forward", float(times[i]), int(sizes[i])) for i in range(m)]
    nodes.append(Node(loss, "loss", "loss", float(loss_time if loss_time is not None else min(times)),
                      int(loss_bytes if loss_bytes is not None else 1)))
    for v in reversed(range(m)):
        nodes.append(Node(bwd[v], f"grad_{names[v]}", "backward", float(times[v] * bwd_factor), int(sizes[v])))
    all_edges = list(edges)
    for v in range(m):
        if not fsuccs[v]:
            all_edges.append((v, loss))
            all_edges.append((loss, bwd[v]))
        for w in fsuccs[v]:
            all_edges.append((bwd[w], bwd[v]))
        all_edges.append((v, bwd[v]))
        for u in fpreds[v]:
            all_edges.append((u, bwd[v]))
    return Graph(nodes, all_edges, fixed_bytes, meta)


def linear_chain(n_layers: int, *, fwd_time: float = 1.0, bwd_time: float = 2.0, size: int = 1,
                 bandwidth: float = 1.0, fixed_bytes: int = 0) -> Graph:
    """Checkmate's `linear` graph: n forward layers, a loss, n backward layers (2n+1 nodes)."""
    return from_forward([fwd_time] * n_layers, [size] * n_layers,
                        [(i, i + 1) for i in range(n_layers - 1)], bwd_factor=bwd_time / fwd_time,
                        loss_time=fwd_time, loss_bytes=size, fixed_bytes=fixed_bytes,
                        meta={"model": f"linear_chain({n_layers})", "bandwidth": bandwidth})


def random_layered(n_forward: int, *, width: int = 3, skip_prob: float = 0.2, seed: int = 0,
                   max_size: int = 8, bandwidth: float = 1.0) -> Graph:
    """Random layered forward DAG (about `width` nodes a layer, edges to the previous layer and
    skip edges further back with probability `skip_prob`), turned into a training graph."""
    rng = random.Random(seed)
    layers: list[list[int]] = []
    nid = 0
    while nid < n_forward:
        k = min(rng.randint(1, width), n_forward - nid)
        layers.append(list(range(nid, nid + k)))
        nid += k
    edges: set[tuple[int, int]] = set()
    for li in range(1, len(layers)):
        for v in layers[li]:
            for u in rng.sample(layers[li - 1], rng.randint(1, len(layers[li - 1]))):
                edges.add((u, v))
            for lj in range(li - 1):
                if rng.random() < skip_prob:
                    edges.add((rng.choice(layers[lj]), v))
    # nodes of a layer with no consumer feed the next layer's first node so the DAG has one output
    for li in range(len(layers) - 1):
        for u in layers[li]:
            if not any(a == u for a, _ in edges):
                edges.add((u, layers[li + 1][0]))
    times = [float(rng.randint(1, 4)) for _ in range(n_forward)]
    sizes = [rng.randint(1, max_size) for _ in range(n_forward)]
    return from_forward(times, sizes, sorted(edges),
                        meta={"model": f"random_layered({n_forward}, seed={seed})", "bandwidth": bandwidth})


def unet(depth: int, *, convs_per_level: int = 1, base_size: int = 1, bandwidth: float = 1.0) -> Graph:
    """U-Net-like graph: an encoder of `depth` levels, a bottleneck, a decoder, and a long skip
    edge from each encoder level to the decoder level of the same resolution.  Activation bytes
    halve at each level down (base_size * 2**(depth-level)); times are proportional to bytes."""
    times, sizes, names, edges = [], [], [], []

    def add(name: str, size: int, inputs: list[int]) -> int:
        vid = len(times)
        names.append(name)
        sizes.append(size)
        times.append(float(size))
        edges.extend((u, vid) for u in inputs)
        return vid

    prev: list[int] = []
    skips = []
    for lvl in range(depth):
        size = base_size * 2 ** (depth - lvl)
        for c in range(convs_per_level):
            prev = [add(f"enc{lvl}_conv{c}", size, prev)]
        skips.append(prev[0])
        prev = [add(f"enc{lvl}_pool", max(1, size // 2), prev)]
    prev = [add("bottleneck", base_size, prev)]
    for lvl in reversed(range(depth)):
        size = base_size * 2 ** (depth - lvl)
        prev = [add(f"dec{lvl}_up", size, prev)]
        prev = [add(f"dec{lvl}_cat", 2 * size, prev + [skips[lvl]])]
        for c in range(convs_per_level):
            prev = [add(f"dec{lvl}_conv{c}", size, prev)]
    return from_forward(times, sizes, edges, names=names,
                        meta={"model": f"unet(depth={depth})", "bandwidth": bandwidth})


def split_outputs(graph: Graph, splits: dict[int, list[tuple[int, Sequence[int]]]]) -> Graph:
    """`graph` with some nodes' outputs split into parts (`remat.core.graph`): ``splits[v]`` lists
    (bytes, readers) per extra output of node v, each read by those successors of v instead of v;
    v keeps the rest of its bytes, and its workspace grows by the parts' bytes.  Node ids after v
    shift by the parts inserted before them."""
    new_id, nid = {}, 0
    for v in graph.nodes:
        new_id[v.id] = nid
        nid += 1 + len(splits.get(v.id, ()))
    nodes, edges = [], []
    moved: dict[tuple[int, int], int] = {}  # (v, reader) -> the part it reads instead
    for v in graph.nodes:
        parts = splits.get(v.id, ())
        taken = sum(b for b, _ in parts)
        if taken > v.bytes:
            raise ValueError(f"node {v.id}: parts of {taken} bytes exceed its {v.bytes}")
        lead = new_id[v.id]
        nodes.append(Node(lead, v.name, v.kind, v.time, v.bytes - taken, v.workspace_bytes + taken, dict(v.extra),
                          v.persistent_bytes, recompute_time=v.recompute_time))
        for j, (b, readers) in enumerate(parts, 1):
            nodes.append(Node(lead + j, f"{v.name}.{j}", v.kind, 0.0, int(b), part_of=lead))
            edges.append((lead, lead + j))
            for k in readers:
                if k not in graph.succs[v.id]:
                    raise ValueError(f"node {k} does not read node {v.id}")
                moved[v.id, k] = lead + j
    for a, b in graph.edges:
        edges.append((moved.get((a, b), new_id[a]), new_id[b]))
    return Graph(nodes, edges, graph.fixed_bytes, dict(graph.meta))

