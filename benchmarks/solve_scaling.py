"""How the ILP scales, and how every solver's overhead compares, on synthetic graphs.

For chains of 16..128 layers and random layered DAGs of 50..400 nodes, at budgets of 0.3x, 0.5x
and 0.8x the checkpoint-all peak: the ILP's solve time, status and gap (CBC, time limit per
solve), and the overhead (time / no-recompute time) of every solver at each budget, measured
side by side in one run.  Writes a CSV and prints a table.

    python benchmarks/solve_scaling.py                  # full run (tens of minutes on 2 cores)
    python benchmarks/solve_scaling.py --quick          # small sizes only
    python benchmarks/solve_scaling.py --time-limit 60 --out benchmarks/out/solve_scaling.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from remat import simulate
from remat.core.errors import InfeasibleBudgetError, InvalidInputError, SolverError
from remat.generators import linear_chain, random_layered
from remat.solvers import get
from remat.solvers.baselines import checkpoint_all

BASELINES = ["checkpoint-all", "chen-sqrtn", "chen-greedy", "griewank", "lp-round"]


def graphs(quick: bool, chains: list[int] | None = None, randoms: list[int] | None = None):
    chains = chains if chains is not None else ([16, 32] if quick else [16, 32, 64, 128])
    randoms = randoms if randoms is not None else ([50, 100] if quick else [50, 100, 200, 400])
    for n in chains:
        yield f"chain{n}", linear_chain(n)
    for n in randoms:
        # random_layered counts forward nodes; the training graph has 2m+1 nodes
        yield f"random{n}", random_layered((n - 1) // 2, seed=0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per ILP solve (default 30)")
    ap.add_argument("--ratios", default="0.8,0.5,0.3")
    ap.add_argument("--swap", action="store_true", help="let the ILP swap (default: recompute only)")
    ap.add_argument("--out", default="benchmarks/out/solve_scaling.csv")
    ap.add_argument("--chains", default=None, help="chain layer counts, e.g. 16,32,64,128 (\"\" for none)")
    ap.add_argument("--randoms", default=None, help="random DAG node counts (at least 3), e.g. 50,100,200,400 (\"\" for none)")
    args = ap.parse_args(argv)
    ratios = [float(x) for x in args.ratios.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    ints = lambda text: [int(x) for x in text.split(",") if x] if text is not None else None  # noqa: E731
    if any(n < 3 for n in ints(args.randoms) or []):
        ap.error("--randoms: node counts of at least 3 (a forward node, the loss, a backward node)")
    for gname, g in graphs(args.quick, ints(args.chains), ints(args.randoms)):
        full = simulate(g, checkpoint_all(g)).peak_bytes
        for ratio in ratios:
            budget = int(full * ratio)
            for solver in ["ilp"] + BASELINES:
                opts = {"swap": args.swap, "time_limit": args.time_limit} if solver == "ilp" else {"swap": args.swap}
                t0 = time.perf_counter()
                row = {"graph": gname, "nodes": g.n, "edges": len(g.edges), "ratio": ratio, "budget": budget,
                       "solver": solver}
                try:
                    s = get(solver)(g, budget, **opts)
                    res = simulate(g, s)
                    r = s.report
                    row.update(status=r.get("status"), overhead=res.time / g.total_time, peak=res.peak_bytes,
                               lower_bound_overhead=(r["lower_bound"] / g.total_time
                                                     if r.get("lower_bound") is not None else ""),
                               gap=r.get("gap", ""), variables=r.get("variables", ""))
                except InfeasibleBudgetError:
                    row.update(status="infeasible")
                except (InvalidInputError, SolverError) as e:
                    row.update(status=f"n/a: {str(e)[:40]}")
                row["wall_s"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                with out.open("w", newline="") as fh:
                    w = csv.DictWriter(fh, fieldnames=sorted({k for r in rows for k in r}, key=_order))
                    w.writeheader()
                    w.writerows(rows)
    print(f"wrote {out}", file=sys.stderr)
    return 0


_ORDER = ["graph", "nodes", "edges", "ratio", "budget", "solver", "status", "overhead", "lower_bound_overhead",
          "gap", "peak", "variables", "wall_s"]


def _order(k: str) -> int:
    return _ORDER.index(k) if k in _ORDER else len(_ORDER)


if __name__ == "__main__":
    sys.exit(main())
