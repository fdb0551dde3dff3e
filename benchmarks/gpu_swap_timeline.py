"""Op-by-op device bytes of the CUDA swap test's plans (tests/test_executor.py, DropoutMLP of
width 1024 and 8 layers, batch 512, 40 % of the activation bytes, ILP and TFLMS with swap):
the simulator's against ``max_memory_allocated`` / ``memory_allocated``, one row per op, in
``swap_timeline.csv`` under --out (default $OUT).  A diagnostic for the device check.

    python benchmarks/gpu_swap_timeline.py [--device cuda] [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import remat  # noqa: E402
from gpu_check import TIMELINE_COLUMNS, op_timeline  # noqa: E402
from test_executor import SWAP_BANDWIDTH, DropoutMLP, _activation_budget, _plan_at  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = DropoutMLP(width=args.width, layers=8).to(dev)
    inputs = (torch.randn(args.batch, args.width, device=dev),)
    graph = remat.trace(model, inputs, profile="flops", grads="resident", granularity="module", depth=1)  # (gradients kept, as measured)
    full = remat.plan(graph, "1.0x", solver="checkpoint-all")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "swap_timeline.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TIMELINE_COLUMNS)
        w.writeheader()
        for solver in ("ilp", "tflms"):
            plan = _plan_at(graph, _activation_budget(graph, full, 0.4), solver=solver, swap=True,
                            bandwidth=SWAP_BANDWIDTH)
            rows = op_timeline(model, inputs, plan, dev)
            for r in rows:
                w.writerow({"model": f"mlp-{solver}", "budget": "0.4act", **r})
            worst = max(rows, key=lambda r: r["measured_during"] - r["predicted_during"])
            print(f"{solver}: predicted peak {plan.predicted['peak_bytes']}, measured "
                  f"{max(r['measured_during'] for r in rows)}; runtime "
                  f"{graph.meta['fixed_breakdown'].get('runtime')}; worst op {worst}", flush=True)
        # the joint (op-level) graph: its profiling runs the backward nodes on autograd's thread
        jgraph = remat.trace(model, inputs, granularity="joint", profile="flops", grads="resident")
        jfull = remat.plan(jgraph, "1.0x", solver="checkpoint-all")
        plan = _plan_at(jgraph, _activation_budget(jgraph, jfull, 0.4), solver="ilp", swap=False, time_limit=20)
        rows = op_timeline(model, inputs, plan, dev)
        for r in rows:
            w.writerow({"model": "mlp-joint", "budget": "0.4act", **r})
        print(f"joint: {jgraph.n} nodes, predicted peak {plan.predicted['peak_bytes']}, measured "
              f"{max(r['measured_during'] for r in rows)}; runtime {jgraph.meta['fixed_breakdown'].get('runtime')}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
