"""Trace the zoo models that benchmarks/scalable.py plans, once, and cache them as JSON.

Graphs go to benchmarks/out/graphs/<name>.json (gitignored); an existing file is reused.
profile="flops" makes times deterministic (bytes are still measured by one CPU run).

    python benchmarks/scalable_graphs.py                       # all of them
    python benchmarks/scalable_graphs.py resnet50_d1 gpt2_12   # some
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "graphs"

# name -> (zoo model, zoo overrides, trace depth)
SPECS = {
    "resnet50_d1": ("resnet50", dict(full=True, batch=32), 1),
    "resnet50_d2": ("resnet50", dict(full=True, batch=32), 2),
    "gpt2_12": ("gpt2", dict(batch=8, seq_len=256, n_layer=12, n_head=8, n_embd=256, vocab_size=50257), 1),
    "gpt2_12_d2": ("gpt2", dict(batch=8, seq_len=256, n_layer=12, n_head=8, n_embd=256, vocab_size=50257), 2),
    "resnet50_d3": ("resnet50", dict(full=True, batch=32), 3),
    # GPT-2 small's layer shapes (width 768, 12 heads, sequence 1024) at batch 2: logits and
    # per-layer activations in their real proportions
    "gpt2s_d1": ("gpt2", dict(full=True, batch=2), 1),
    "gpt2s_d2": ("gpt2", dict(full=True, batch=2), 2),
    "gpt2s_d3": ("gpt2", dict(full=True, batch=2), 3),
    "unet": ("unet", dict(full=True, batch=4), 1),
    "unet_d2": ("unet", dict(full=True, batch=4), 2),
    "unet_d3": ("unet", dict(full=True, batch=4), 3),
}


def load(name: str):
    """The cached graph `name` (tracing it first if needed)."""
    from remat.core.graph import Graph
    path = OUT / f"{name}.json"
    if not path.exists():
        trace_one(name)
    return Graph.load(path)


def trace_one(name: str) -> Path:
    import torch
    from remat.frontends import trace, zoo
    torch.set_num_threads(1)
    model_name, kw, depth = SPECS[name]
    model, inputs = zoo.get(model_name, **kw)
    t0 = time.perf_counter()
    g = trace(model, inputs, name=name, profile="flops", granularity="module", depth=depth,
              grads="resident")  # (the graphs results.md's solver tables were measured on)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    g.save(path)
    print(f"{name}: {g.n} nodes, {len(g.edges)} edges, traced in {time.perf_counter() - t0:.1f} s -> {path}")
    return path


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    for name in argv or list(SPECS):
        if (OUT / f"{name}.json").exists():
            print(f"{name}: cached")
            continue
        trace_one(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
