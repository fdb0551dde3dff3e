"""Predicted against measured peak of planned steps on the CPU (`remat.apply`), per model and plan.

The models of tests/test_executor.py (an MLP with dropout, ResNet-18 with BatchNorm, GPT-2 with
dropout; small zoo sizes), traced with the flops profile, planned with the ILP without swap at
1.0x, at fixed bytes + 50 % of the activations and at the smallest feasible budget, and with
swap (ILP and TFLMS, at a bandwidth that makes swaps nearly free) at 40 % of the activations or
the smallest feasible budget.  Each plan runs a warm-up step and a measured one (gradients kept,
as in a training loop); the peak is the exact storage accounting of `remat.measure`.  Prints a
Markdown table and writes benchmarks/out/apply_peaks.csv.

    python benchmarks/apply_peaks.py
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch

import remat
from remat.solvers.ilp import min_feasible_budget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_executor import MODELS, _measured_peak, _plan_at as plan_at  # noqa: E402  (the tests' models and helpers)

OUT = Path(__file__).parent / "out"


def main() -> int:
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    rows = []
    for name in sorted(MODELS):
        model, inputs = MODELS[name]()
        graph = remat.trace(model, inputs, profile="flops", granularity="module", depth=1)
        full = remat.plan(graph, "1.0x", solver="ilp", swap=False, time_limit=30)
        act = full.predicted["peak_bytes"] - graph.fixed_bytes
        plans = {
            ("1.0x", "ilp, no swap"): full,
            ("0.5x act.", "ilp, no swap"): plan_at(graph, int(graph.fixed_bytes + 0.5 * act), solver="ilp", swap=False),
            ("tightest", "ilp, no swap"): remat.plan(graph, min_feasible_budget(graph, swap=False, time_limit=20)[0],
                                                     solver="ilp", swap=False, time_limit=30),
        }
        for solver in ("ilp", "tflms"):
            plans[("0.4x act.", f"{solver}, swap")] = plan_at(graph, int(graph.fixed_bytes + 0.4 * act), solver=solver,
                                                              swap=True, bandwidth=1e13)
        for (budget, how), plan in plans.items():
            peak, planned = _measured_peak(model, inputs, plan)
            host = planned.host_peak_bytes
            sim = remat.simulate(graph, plan.schedule)
            rows.append({"model": name, "budget": budget, "plan": how, "budget_bytes": plan.budget_bytes,
                         "recomputes": sum(c - 1 for c in sim.compute_counts if c > 1),
                         "swaps": sum(o.op == "swap_out" for o in plan.schedule.ops),
                         "predicted": plan.predicted["peak_bytes"], "measured": peak,
                         "ratio": round(peak / plan.predicted["peak_bytes"], 6),
                         "host_predicted": plan.predicted["host_peak_bytes"], "host_measured": host})
            print(rows[-1], file=sys.stderr, flush=True)
    with open(OUT / "apply_peaks.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("| model | budget | plan | recomputes | swaps | predicted B | measured B | ratio | host predicted B | host measured B |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {r['plan']} | {r['recomputes']} | {r['swaps']} | {r['predicted']:,} | "
              f"{r['measured']:,} | {r['ratio']:.5f} | {r['host_predicted']:,} | {r['host_measured']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
