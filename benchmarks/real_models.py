"""The real-model suite at the sizes where activations dominate the step (issue targets, CPU).

For each case, in one run, each variant on a fresh copy of the model with the same seed and
batches, gradients set to None between steps (PyTorch's default loop), every peak measured by one
meter (`remat.measure(..., meter="allocator")`: the CPU allocator's own peak, kernels' scratch
included, one step after a warm-up) and
every time the median of ``--steps`` steps taken at the end, the variants taking turns step by
step after a warm-up round (`csvout.time_in_turns`: this machine's speed drifts by tens of
percent over minutes, so variants timed minutes apart are not comparable):

* plain autograd, and `torch.utils.checkpoint` on every repeated block (`checkpoint_every_block`);
* remat's graph traced with the defaults (``granularity="auto"``): its predicted peak without
  recomputation against plain's measured peak;
* remat's plans at ``--budgets`` (fractions of that predicted plain peak), at the peak
  checkpointing measured, and at the smallest budget the planner finds (`vs_checkpoint.tightest_plan`),
  measured by `remat.run_plan` and timed by `remat.apply` (the same interpreter): measured peak
  against the budget and the prediction, measured time overhead (against plain's step) against
  the predicted one, and the solver's wall time, status and gap.

    python benchmarks/real_models.py                                   # resnet50, vit_b_16, gpt2
    python benchmarks/real_models.py --cases resnet50 --steps 3 --time-limit 120

Cases: torchvision ResNet-50 (batch 8, 224 px), torchvision ViT-B/16 (batch 8, 224 px, its default
dropout 0), transformers' GPT-2 124M (12 layers, width 768, vocabulary 50257; batch 2, sequence
256; dropout 0.1; ``gpt2-b8``: batch 8, where activations, not parameters and gradients, set the
floor).
Output: one CSV row per variant (``--out``) and a line per variant on stdout.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc, time_in_turns, write_csv  # noqa: E402
from gpu_check import time_steps  # noqa: E402  (the same loop)
from peers import hf_gpt2  # noqa: E402
from vs_checkpoint import tightest_plan, turns  # noqa: E402

import remat  # noqa: E402
from remat.core.analysis import forced_need  # noqa: E402
from remat.core.errors import InfeasibleBudgetError, SolverError  # noqa: E402
from remat.frontends import vision  # noqa: E402
from remat.frontends.checkpointing import checkpoint_every_block  # noqa: E402
from remat.frontends.run import run_plan  # noqa: E402

# name -> () -> (model, example batch, loss_fn)
CASES = {
    "resnet50": lambda: (*vision.get("resnet50", batch=8, tiny=False), vision.cross_entropy),
    "vit_b_16": lambda: (*vision.get("vit_b_16", batch=8, tiny=False, dropout=0.0), vision.cross_entropy),
    "gpt2": lambda: hf_gpt2(batch=2, seq=256, layers=12, width=768, heads=12, vocab=50257),
    "gpt2-b8": lambda: hf_gpt2(batch=8, seq=256, layers=12, width=768, heads=12, vocab=50257),
}
COLUMNS = ("case", "variant", "granularity", "nodes", "budget", "predicted_peak", "measured_peak",
           "measured_over_predicted", "peak_over_plain", "predicted_overhead", "measured_overhead", "step_s",
           "plan_s", "status", "gap", "note")


def run_case(case: str, budgets: list[float], steps: int, time_limit: float, tightest: bool = True) -> list[dict]:
    model, example, loss_fn = CASES[case]()
    dev = torch.device("cpu")
    mib = 2 ** 20
    # peaks: one metered step after a warm-up per variant; times: all variants in turns at the end
    plain_peak = time_steps(model, example, dev, 1, set_to_none=True, loss_fn=loss_fn, meter="allocator")[1]
    ckpt_peak = time_steps(checkpoint_every_block(copy.deepcopy(model)), example, dev, 1, set_to_none=True,
                           loss_fn=loss_fn, meter="allocator")[1]
    rows = [{"case": case, "variant": "plain", "measured_peak": plain_peak, "peak_over_plain": 1.0,
             "measured_overhead": 1.0},
            {"case": case, "variant": "checkpoint every block", "measured_peak": ckpt_peak,
             "peak_over_plain": ckpt_peak / plain_peak}]
    print(f"{case}: plain {plain_peak / mib:.1f} MiB; checkpoint every block {ckpt_peak / mib:.1f} MiB "
          f"({ckpt_peak / plain_peak:.3f}x)", flush=True)
    t0 = time.perf_counter()
    graph = remat.trace(model, example, loss_fn=loss_fn, name=case, progress=True)
    traced_s = time.perf_counter() - t0
    keep_all = remat.plan(graph, "1.0x", solver="checkpoint-all").predicted["peak_bytes"]
    gran = graph.meta["granularity"]
    floor = forced_need(graph)
    rows.append({"case": case, "variant": "remat keep-all (predicted)", "granularity": gran, "nodes": graph.n,
                 "predicted_peak": keep_all, "peak_over_plain": keep_all / plain_peak,
                 "plan_s": round(traced_s, 1), "note": "plan_s: trace seconds"})
    rows.append({"case": case, "variant": "floor (proven)", "granularity": gran, "nodes": graph.n,
                 "predicted_peak": floor, "peak_over_plain": floor / plain_peak,
                 "note": f"forced_need: every schedule holds this; {floor / ckpt_peak:.3f}x checkpointing's peak"})
    print(f"  traced ({gran}, {graph.n} nodes) in {traced_s:.0f} s; predicted peak without recomputation "
          f"{keep_all / mib:.1f} MiB = {keep_all / plain_peak:.3f}x plain's measured; every schedule needs "
          f"{floor / mib:.1f} MiB = {floor / ckpt_peak:.3f}x checkpointing's peak (forced_need)", flush=True)
    wanted = [(f"{b:g}x", int(b * keep_all)) for b in budgets] + [("at checkpoint's peak", ckpt_peak)]
    plans = {}
    for label, budget in wanted + ([("tightest", None)] if tightest else []):
        t0 = time.perf_counter()
        try:
            plan = (tightest_plan(graph, ckpt_peak, time_limit) if budget is None
                    else remat.plan(graph, budget, swap=False, time_limit=time_limit))
        except (InfeasibleBudgetError, SolverError) as e:
            rows.append({"case": case, "variant": f"remat {label}", "granularity": gran, "budget": budget,
                         "plan_s": round(time.perf_counter() - t0, 1), "status": type(e).__name__,
                         "note": str(e).split(";")[0][:160]})
            print(f"  remat {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        plan_s = time.perf_counter() - t0
        budget = plan.budget_bytes if budget is None else budget
        rep = run_plan(copy.deepcopy(model), example, plan, steps=1, plain=False, loss_fn=loss_fn,
                       meter="allocator")
        pred = plan.predicted["peak_bytes"]
        row = {"case": case, "variant": f"remat {label}", "granularity": gran, "nodes": graph.n, "budget": budget,
               "predicted_peak": pred, "measured_peak": rep.peak_bytes,
               "measured_over_predicted": rep.peak_bytes / pred, "peak_over_plain": rep.peak_bytes / plain_peak,
               "predicted_overhead": plan.predicted["overhead"], "plan_s": round(plan_s, 1),
               "status": plan.solver.get("status"), "gap": plan.solver.get("gap")}
        rows.append(row)
        plans[row["variant"]] = plan
        print(f"  remat {label}: budget {budget / mib:.1f} MiB, measured {rep.peak_bytes / mib:.1f} MiB "
              f"({row['measured_over_predicted']:.4f}x predicted, {row['peak_over_plain']:.3f}x plain, "
              f"{rep.peak_bytes / ckpt_peak:.3f}x checkpointing's); predicted time {row['predicted_overhead']:.2f}x; "
              f"planned in {plan_s:.0f} s, {row['status']}, gap {row['gap']}", flush=True)
    times = time_in_turns(turns(model, example, loss_fn, plans), steps, progress=True)
    plain_s, ckpt_s = times["plain"], times["checkpoint every block"]
    for row in rows:
        if row["variant"] in times:
            s = row["step_s"] = times[row["variant"]]
            row["measured_overhead"] = s / plain_s
            print(f"  {row['variant']}: {s:.2f} s = {s / plain_s:.3f}x plain, {s / ckpt_s:.3f}x checkpointing's"
                  + (f" (predicted {row['predicted_overhead']:.3f}x)" if row.get("predicted_overhead") else ""),
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--budgets", default="0.7,0.5", help="fractions of the predicted peak without recomputation")
    ap.add_argument("--steps", type=int, default=3, help="timed rounds, the variants taking turns (after a warm-up round)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per plan")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--no-tightest", action="store_true", help="skip the plan at the smallest budget found")
    ap.add_argument("--out", default="benchmarks/out/real_models.csv")
    args = ap.parse_args(argv)
    steady_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    rows = []
    for case in (c.strip() for c in args.cases.split(",") if c.strip()):
        if case not in CASES:
            ap.error(f"--cases: unknown case {case!r}; expected {', '.join(CASES)}")
        rows += run_case(case, budgets, args.steps, args.time_limit, not args.no_tightest)
        write_csv(args.out, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
