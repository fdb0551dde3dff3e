"""remat against checkpointing every block by hand, in PyTorch's default training loop (CPU).

For each case: plain autograd, `torch.utils.checkpoint` (non-reentrant) on every residual block
(every zoo `Block` / `BasicBlock` / `Bottleneck`), and remat's plans from a module-level or, with
``--granularity joint``, op-level trace (gradients allocated at their first accumulation, as
`zero_grad()` leaves them; an op's output tensors freed one by one) at two budgets:
the peak checkpoint-every-block measured, and the smallest one the planner finds (what
`remat.plan` names when asked for what every schedule must hold, `analysis.forced_need`, or where
it finds no plan in the time limit there, the smallest of a few bisected budgets that it plans).  Peaks: one
step of each variant after a warm-up (`remat.measure(..., meter="allocator")`: the allocator's
figure, kernels' scratch included as the plans count it, as CUDA's ``max_memory_allocated``); times:
the median of `--steps` steps, the variants taking turns step by step after a warm-up round
(`csvout.time_in_turns`: this machine's speed drifts by tens of percent over minutes); gradients
set to None between steps.
Figures are ratios: remat's peak against checkpointing's, and its step time against
checkpointing's at the same peak.

    python benchmarks/vs_checkpoint.py                 # GPT-2 (zoo, 4 layers, batch 16, seq 256), ResNet-50 (batch 8, 64 px)
    python benchmarks/vs_checkpoint.py --cases gpt2 --steps 5
    python benchmarks/vs_checkpoint.py --granularity joint --out benchmarks/out/vs_checkpoint_joint.csv
    python benchmarks/vs_checkpoint.py --executor native --out benchmarks/out/vs_checkpoint_native.csv
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc, time_in_turns, write_csv  # noqa: E402
from gpu_check import time_steps  # noqa: E402  (the same loop)

import remat  # noqa: E402
from remat.frontends import default_loss, zoo  # noqa: E402
from remat.frontends.base import step_loss  # noqa: E402
from remat.frontends.checkpointing import checkpoint_every_block  # noqa: E402
from remat.frontends.run import run_plan  # noqa: E402
from remat.core.analysis import forced_need  # noqa: E402
from remat.core.errors import InfeasibleBudgetError, SolverError  # noqa: E402

# name -> (zoo model, zoo settings, trace depth)
CASES = {
    "gpt2": ("gpt2", {"batch": 16, "seq_len": 256, "n_layer": 4}, 3),
    "resnet50": ("resnet50", {"batch": 8, "image_size": 64}, 2),
}
COLUMNS = ("case", "granularity", "nodes", "plain_peak", "plain_s", "ckpt_peak", "ckpt_s", "at_ckpt_peak", "at_ckpt_s",
           "at_ckpt_predicted_peak", "at_ckpt_predicted_overhead", "tightest_peak", "tightest_s",
           "tightest_predicted_peak", "tightest_over_ckpt_peak", "at_ckpt_over_ckpt_time")


def tightest_plan(graph, ceiling: int, time_limit: float, probes: int = 6, **options):
    """The plan at the smallest budget the planner finds: what every schedule must hold
    (`analysis.forced_need`) when it plans there, else the budget the infeasibility message names,
    else (no plan in the time limit) a bisection between the forced need and `ceiling`."""
    low = forced_need(graph)
    try:
        return remat.plan(graph, low, swap=False, time_limit=time_limit, **options)
    except InfeasibleBudgetError as e:
        if e.min_feasible_bytes is not None:
            low = e.min_feasible_bytes
            ceiling = max(ceiling, int(1.05 * low))   # (natively the class can need a little more)
            try:
                return remat.plan(graph, low, swap=False, time_limit=time_limit, **options)
            except (InfeasibleBudgetError, SolverError):
                pass
    except SolverError:
        pass
    for _ in range(8):   # (a ceiling below what the planner can reach, as blocks are atoms: raised)
        try:
            best = remat.plan(graph, ceiling, swap=False, time_limit=time_limit, **options)
            break
        except InfeasibleBudgetError:
            low, ceiling = ceiling, int(1.1 * ceiling)
    hi = ceiling
    for _ in range(probes):
        mid = (low + hi) // 2
        try:
            best, hi = remat.plan(graph, mid, swap=False, time_limit=time_limit, **options), mid
        except (InfeasibleBudgetError, SolverError):
            low = mid
    return best


def run_case(case: str, steps: int, time_limit: float, granularity: str = "module",
             executor: str = "interpreter") -> dict:
    name, kw, depth = CASES[case]
    model, example = zoo.get(name, **kw)
    example = example if isinstance(example, tuple) else (example,)
    dev = torch.device("cpu")
    plain_peak = time_steps(model, example, dev, 1, set_to_none=True, meter="allocator")[1]
    ckpt_peak = time_steps(checkpoint_every_block(model), example, dev, 1, set_to_none=True, meter="allocator")[1]
    native = executor == "native"   # (the model's own code: module calls recomputed whole, at depth auto)
    graph = remat.trace(model, example, depth="auto" if native else depth, name=case, granularity=granularity)
    row = {"case": case, "granularity": granularity + (" native" if native else ""), "nodes": graph.n,
           "plain_peak": plain_peak, "ckpt_peak": ckpt_peak}
    opts = {"executor": "native"} if native else {}
    try:
        plans = {"at_ckpt": remat.plan(graph, ckpt_peak, swap=False, time_limit=time_limit, **opts)}
    except InfeasibleBudgetError:   # (blocks as atoms: their inputs and insides go together)
        plans = {"at_ckpt": tightest_plan(graph, plain_peak, time_limit, **opts)}
    plans["tightest"] = tightest_plan(graph, ckpt_peak, time_limit, **opts)
    for key, plan in plans.items():
        rep = run_plan(copy.deepcopy(model), example, plan, steps=1, plain=False, executor=executor, meter="allocator")
        row[f"{key}_peak"] = rep.peak_bytes
        row[f"{key}_predicted_peak"] = rep.predicted["peak_bytes"]
        if key == "at_ckpt":
            row["at_ckpt_predicted_overhead"] = plan.predicted["overhead"]
    times = time_in_turns(turns(model, example, default_loss, plans, executor), steps)
    plain_s, ckpt_s = row["plain_s"], row["ckpt_s"] = times["plain"], times["checkpoint every block"]
    for key in plans:
        row[f"{key}_s"] = times[key]
    row["tightest_over_ckpt_peak"] = row["tightest_peak"] / ckpt_peak
    row["at_ckpt_over_ckpt_time"] = row["at_ckpt_s"] / ckpt_s
    mib = 2 ** 20
    print(f"{case} ({granularity}): {graph.n} nodes; plain {plain_peak / mib:.1f} MiB {plain_s * 1e3:.0f} ms; checkpoint every block "
          f"{ckpt_peak / mib:.1f} MiB ({ckpt_peak / plain_peak:.2f}x) {ckpt_s / plain_s:.2f}x time; remat at that peak "
          f"{row['at_ckpt_peak'] / mib:.1f} MiB {row['at_ckpt_s'] / plain_s:.2f}x time (predicted "
          f"{row['at_ckpt_predicted_overhead']:.2f}x); remat tightest {row['tightest_peak'] / mib:.1f} MiB = "
          f"{row['tightest_over_ckpt_peak']:.2f}x checkpointing's peak, {row['tightest_s'] / plain_s:.2f}x time",
          flush=True)
    return row


def turns(model: torch.nn.Module, example: tuple, loss_fn, plans: dict, executor: str = "interpreter") -> dict:
    """One step function per variant for `csvout.time_in_turns`, each on a fresh copy of `model`
    (gradients set to None before its step, as PyTorch's default loop does): plain autograd,
    checkpointing every block, and each plan applied (`remat.apply` with `executor`, as
    `run_plan` runs it)."""
    def eager(m: torch.nn.Module):
        def step() -> None:
            for p in m.parameters():
                p.grad = None
            step_loss(m, loss_fn, example).backward()
        return step

    def planned(m: torch.nn.Module, plan):
        ex = remat.apply(m, plan, example, loss_fn=loss_fn, executor=executor)

        def step() -> None:
            for p in m.parameters():
                p.grad = None
            ex(*example).backward()
        return step
    return {"plain": eager(copy.deepcopy(model)),
            "checkpoint every block": eager(checkpoint_every_block(model)),
            **{name: planned(copy.deepcopy(model), plan) for name, plan in plans.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--granularity", choices=("module", "joint"), default="module")
    ap.add_argument("--executor", choices=("interpreter", "native"), default="interpreter",
                    help="native: module-level plans at depth auto run in the model's own code")
    ap.add_argument("--out", default="benchmarks/out/vs_checkpoint.csv")
    args = ap.parse_args(argv)
    steady_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [run_case(c.strip(), args.steps, args.time_limit, args.granularity, args.executor)
            for c in args.cases.split(",") if c.strip()]
    write_csv(args.out, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
