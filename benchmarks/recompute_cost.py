"""What a recomputation costs in native execution against what the module graph's profile says.

Native execution (`remat.apply(..., executor="native")`) recomputes a module by calling it again
inside the backward; the simulator prices that call at the module's recompute time (its forward
timed right after the caches were emptied, `profile.cold_factors`), where the first compute is
priced at its forward time in a loop (caches warm).  This script measures, on one model, in one
run:

1. the step times of plain autograd, the native plan at 1.0x and the native plan at a fraction of
   the room (`executor_speed.fraction_plan`), in turns, and the wall time of each recomputation
   (`_Step.recompute`) against the node's profiled recompute time;
2. one module's forward (grad mode) timed as the profile times it (warm), after writing a
   buffer larger than the last-level cache (cold), and inside a backward.

    python benchmarks/recompute_cost.py [--case resnet50] [--fraction 0.5] [--steps 15]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc  # noqa: E402
from executor_speed import fraction_plan  # noqa: E402

import torch  # noqa: E402

import remat  # noqa: E402
from remat.frontends import default_loss, zoo  # noqa: E402
from remat.frontends import native  # noqa: E402
from remat.frontends.base import step_loss  # noqa: E402


def step(model, example) -> None:
    for p in model.parameters():
        p.grad = None
    step_loss(model, default_loss, example).backward()


def forward_contexts(module: torch.nn.Module, inp: torch.Tensor, repeats: int = 7) -> dict:
    """Median forward seconds of `module` on a fresh leaf copy of `inp`: warm, cold, in a backward."""
    flush = torch.empty(256 << 20, dtype=torch.uint8)

    def once() -> float:
        x = inp.clone().requires_grad_(True)
        t0 = time.perf_counter()
        module(x)
        return time.perf_counter() - t0

    def cold() -> float:
        flush.add_(1)
        return once()

    def in_backward() -> float:
        box: list = []

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a):
                return a.clone()

            @staticmethod
            def backward(ctx, g):
                with torch.enable_grad():
                    box.append(once())
                return g
        Probe.apply(torch.ones(4, requires_grad=True)).sum().backward()
        return box[0]
    return {name: statistics.median(f() for _ in range(repeats))
            for name, f in (("warm", once), ("cold", cold), ("in backward", in_backward))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="resnet50", help="a zoo model (batch 8; 64 px for images)")
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args(argv)
    opts = {"batch": 8, "image_size": 64} if args.case.startswith(("resnet", "vgg", "mobilenet", "unet")) else {}
    model, x = zoo.get(args.case, **opts)
    example = x if isinstance(x, tuple) else (x,)
    model.train()
    graph = remat.trace(model, example, loss_fn=default_loss, granularity="module", progress=False)
    plans = {"1.0x": remat.plan(graph, "1.0x", swap=False, executor="native"),
             f"{args.fraction}x": fraction_plan(graph, args.fraction, 20, "native")}
    variants = {"plain": copy.deepcopy(model)}
    for label, plan in plans.items():
        variants[label] = copy.deepcopy(model)
        remat.apply(variants[label], plan, example, default_loss, executor="native")
    walls: dict = {}
    recompute = native._Step.recompute

    def timed(self, v):
        t0 = time.perf_counter()
        recompute(self, v)
        walls.setdefault(v, []).append(time.perf_counter() - t0)
    native._Step.recompute = timed
    times: dict = {name: [] for name in variants}
    for r in range(args.steps + 1):
        for name, m in variants.items():
            t0 = time.perf_counter()
            step(m, example)
            if r:
                times[name].append(time.perf_counter() - t0)
    native._Step.recompute = recompute
    med = {k: statistics.median(v) for k, v in times.items()}
    label = f"{args.fraction}x"
    print(f"{args.case}: {graph.n} nodes; plain {med['plain'] * 1e3:.2f} ms; native 1.0x {med['1.0x'] / med['plain']:.3f}x "
          f"(predicted 1.000x); native {label} {med[label] / med['plain']:.3f}x (predicted "
          f"{plans[label].predicted['overhead']:.3f}x)")
    profiled = measured = 0.0
    for v, ws in sorted(walls.items()):
        w = statistics.median(ws)
        cost = graph.nodes[v].recompute_cost
        profiled, measured = profiled + cost, measured + w
        print(f"  recompute {graph.nodes[v].name:24s} profiled {cost * 1e3:6.2f} ms (first compute "
              f"{graph.nodes[v].time * 1e3:.2f})  measured {w * 1e3:6.2f} ms ({w / cost:.2f}x)")
    print(f"  recomputations per step: profiled {profiled * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms "
          f"({measured / max(profiled, 1e-12):.2f}x)")
    if walls:   # the first recomputed node's module, in the three contexts
        v = min(walls)
        name = graph.nodes[v].name.split("+")[0]
        module = dict(model.named_modules()).get(name)
        if module is not None:
            captured: dict = {}
            h = module.register_forward_pre_hook(lambda mod, a: captured.setdefault("x", a[0].detach()))
            with torch.no_grad():
                model(*example)
            h.remove()
            ctx = forward_contexts(module, captured["x"])
            print(f"  {name} forward: " + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in ctx.items()))
    return 0


if __name__ == "__main__":
    steady_malloc()
    sys.exit(main())
