"""The ILP's scalable mode on graphs beyond the exact ILP's reach: zoo models and 1,000-node DAGs.

For each case: nodes, budget, what produced the plan and the bound, wall time, overhead (time /
no-recompute time), lower bound (valid for the whole graph) and gap.  Zoo graphs are traced once
by benchmarks/scalable_graphs.py (profile="flops", module granularity) and cached under
benchmarks/out/graphs/.  CBC with one thread (`--threads 2`: the instant IP in a worker process
beside the rest, each on one thread).  Writes a CSV and prints a Markdown table.

    python benchmarks/scalable.py                              # every case, 120 s (zoo) / 280 s (random)
    python benchmarks/scalable.py --cases resnet50_d2@0.5x,random500@0.8x --time-limit 120
    python benchmarks/scalable.py --swap                       # let the ILP swap too
"""
from __future__ import annotations

import argparse
import csv
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from remat import simulate  # noqa: E402
from remat.budget import parse_budget  # noqa: E402
from remat.generators import random_layered  # noqa: E402
from remat.solvers import ilp  # noqa: E402

DEFAULT_CASES = ("resnet50_d2@0.5x,resnet50_d2@0.3x,gpt2s_d2@0.5x,gpt2s_d3@0.5x,gpt2s_d3@0.3x,unet_d3@0.5x,"
                 "unet_d3@0.3x,random500@0.8x,random500@0.9x")
COLUMNS = ("graph", "nodes", "budget", "swap", "mode", "status", "incumbent_from", "bound_from", "coarse_nodes",
           "wall_s", "overhead", "lower_bound", "gap", "valid", "fits")


def load(name: str):
    if name.startswith("random"):
        return random_layered(int(name[len("random"):]), seed=0)  # forward nodes; 2m+1 in all
    import scalable_graphs
    return scalable_graphs.load(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of GRAPH@BUDGET")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per zoo solve (default 120)")
    ap.add_argument("--random-time-limit", type=float, default=280.0, help="seconds per random-DAG solve")
    ap.add_argument("--swap", action="store_true")
    ap.add_argument("--mode", default="auto", choices=("auto", "scalable", "exact"))
    ap.add_argument("--threads", type=int, default=1, help="solver threads (default 1; 2 runs the instant IP beside)")
    ap.add_argument("--out", default="benchmarks/out/scalable.csv")
    ap.add_argument("-v", action="store_true", help="log the solver's phases")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.v else logging.WARNING, format="%(relativeCreated)8.0f %(message)s")
    logging.getLogger("pulp").setLevel(logging.WARNING)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        name, ratio = case.split("@")
        g = load(name)
        budget = parse_budget(ratio, g)
        limit = args.random_time_limit if name.startswith("random") else args.time_limit
        t0 = time.perf_counter()
        try:
            s = ilp.solve(g, budget, swap=args.swap, time_limit=limit, threads=args.threads, mode=args.mode)
        except Exception as e:  # report and go on
            print(f"{case}: {type(e).__name__}: {e}", flush=True)
            rows.append({"graph": name, "nodes": g.n, "budget": ratio, "swap": args.swap, "mode": args.mode,
                         "status": type(e).__name__})
            continue
        wall = time.perf_counter() - t0
        res = simulate(g, s)
        rep = s.report
        row = {"graph": name, "nodes": g.n, "budget": ratio, "swap": args.swap, "mode": rep.get("mode", "exact"),
               "status": rep["status"], "incumbent_from": rep.get("incumbent_from", rep.get("warm_start")),
               "bound_from": rep.get("bound_from", "cbc"), "coarse_nodes": rep.get("coarse_nodes"),
               "wall_s": round(wall, 1), "overhead": round(res.time / g.total_time, 4),
               "lower_bound": round(rep["lower_bound"] / g.total_time, 4) if rep.get("lower_bound") else None,
               "gap": round(rep["gap"], 4) if rep.get("gap") is not None else None,
               "valid": res.valid, "fits": res.peak_bytes <= budget}
        rows.append(row)
        print(" | ".join(str(row.get(c)) for c in COLUMNS), flush=True)
        with out.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    print()
    print("| graph | nodes | budget | method (plan / bound) | wall s | overhead | lower bound | gap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "wall_s" not in r:
            print(f"| {r['graph']} | {r['nodes']} | {r['budget']} | {r['status']} | | | | |")
            continue
        method = f"{r['mode']}: {r['incumbent_from']} / {r['bound_from']}"
        print(f"| {r['graph']} | {r['nodes']} | {r['budget']} | {method} | {r['wall_s']} | {r['overhead']:.3f} | "
              f"{r['lower_bound']:.3f} | {100 * r['gap']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
