"""The instant IP's split bound (solvers/ilp/windows.py, "Split at tight instants") given all the
time it needs: a certificate of how far a plan is from optimal where the scalable mode's two
minutes do not reach one.

    python benchmarks/split_proof.py --case unet_d3@0.3x --cuts 70,120 --time-limit 1800 --plan 1.2792

Prints each window of the chosen cuts with its bound (a share of the no-recompute step) and
whether it was proven, the bound on the whole step, and, given a plan's overhead (`--plan`,
time / no-recompute time), the gap (plan - bound) / plan.  Without `--cuts`, the graph's split
candidates (`windows.split_candidates`).  One thread, HiGHS when installed.

`--couple C` replaces the first window (0, b] by the coupled bound of (0, C] and (C, b]
(`windows.coupled_bound`, "Coupled windows"; needs highspy) where that is higher, for up to
`--couple-time` seconds beside the split's `--time-limit`:

    python benchmarks/split_proof.py --case resnet50_d2@0.3x --cuts 202,208 --couple 176 --time-limit 300 \
        --couple-time 600 --plan 1.2494
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from remat.budget import parse_budget  # noqa: E402
from remat.solvers import ilp  # noqa: E402
from remat.solvers.ilp import windows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True, help="GRAPH@BUDGET, a graph of benchmarks/scalable.py")
    ap.add_argument("--cuts", help="comma list of instants to cut at (default: the split candidates)")
    ap.add_argument("--time-limit", type=float, default=1800.0, help="seconds for the whole split (default 1800)")
    ap.add_argument("--couple", type=int, help="an instant inside the first window to couple it at")
    ap.add_argument("--couple-time", type=float, default=600.0, help="seconds for the coupled bound (default 600)")
    ap.add_argument("--plan", type=float, help="a plan's overhead, to print its gap to the bound")
    ap.add_argument("-v", action="store_true", help="log the windows as they are solved")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.v else logging.WARNING, format="%(relativeCreated)8.0f %(message)s")
    logging.getLogger("pulp").setLevel(logging.WARNING)
    import scalable
    name, ratio = args.case.split("@")
    g = scalable.load(name)
    budget = parse_budget(ratio, g)
    cuts = [int(c) for c in args.cuts.split(",")] if args.cuts else None
    backend = "highs" if ilp.highs_available() else "cbc"
    t0 = time.perf_counter()
    out = windows.split_bound(g, budget, time_limit=args.time_limit, threads=1, backend=backend, cuts=cuts)
    wall = time.perf_counter() - t0
    if out is None:
        print(f"{args.case}: no split (no tight backward instants, or cuts that leave no schedule)")
        return 1
    total = g.total_time
    for a, b, value, proven in out["windows"]:
        print(f"window ({a}, {b}]: {value / total:.4f} of the step{' (proven)' if proven else ''}")
    lb = out["bound"] / total
    if args.couple is not None:
        _, first, value, _ = out["windows"][0]
        t1 = time.perf_counter()
        co = windows.coupled_bound(g, budget, args.couple, first, time_limit=args.couple_time, backend=backend,
                                      threads=1)
        if co is None:
            print(f"no coupled bound at {args.couple} (needs highspy, and 0 < {args.couple} < {first})")
        else:
            print(f"window (0, {first}] coupled at {args.couple}: {co['bound'] / total:.4f} of the step "
                  f"({co['rounds']} rounds, {time.perf_counter() - t1:.0f} s, master {co['master'] / total:.4f}"
                  f"{', converged' if co['converged'] else ''})")
            lb += max(0.0, co["bound"] - value) / total
    print(f"{args.case}: bound {lb:.4f} ({backend}, {wall:.0f} s){'' if out['proven'] else ', not every window proven'}")
    if args.plan:
        print(f"plan {args.plan:.4f}: gap {(args.plan - lb) / args.plan:.2%} of the plan, {(args.plan - lb) / lb:.2%} of the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
