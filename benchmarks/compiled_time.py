"""remat.compiler's predicted time against the measured step, one plan at a time.

The zoo GPT-2 (4 layers, batch 8, sequence 256, dropout 0.1) compiled with
`remat.compiler("1.0x")` and with a byte budget, backend ``aot_eager_decomp_partition`` (or
``--backend``); both steps timed in turns (median of ``--steps``).  Prints the region's predicted
time (the replay of the partitioner's graphs with `OpTimes`) at the budget over its predicted
time at 1.0x, against the measured ratio of the two steps, and the recomputed ops.

    python benchmarks/compiled_time.py [--budget 87187792] [--backend inductor] [--steps 7]
"""
from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc  # noqa: E402

import torch  # noqa: E402

import remat  # noqa: E402
from remat.frontends import default_loss, zoo  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="87187792", help="bytes or a ratio (0.6x)")
    ap.add_argument("--backend", default="aot_eager_decomp_partition")
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, x = zoo.get("gpt2", batch=8, seq_len=256, n_layer=4)
    x = x if isinstance(x, tuple) else (x,)
    model.train()

    def compiled(budget):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        rc = remat.compiler(budget, backend=args.backend, time_limit=10)
        c = torch.compile(m, backend=rc)

        def step():
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(1)
            default_loss(c(*x), *x).backward()
        step()
        return rc, step
    budget = int(args.budget) if args.budget.isdigit() else args.budget
    (rc1, step1), (rc2, step2) = compiled("1.0x"), compiled(budget)
    times: dict = {1: [], 2: []}
    for _ in range(args.steps + 1):
        for k, step in ((1, step1), (2, step2)):
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    measured = statistics.median(times[2][1:]) / statistics.median(times[1][1:])
    r1, r2 = rc1.regions[0], rc2.regions[0]
    names = set(r2.plan.predicted.get("recomputed", []))
    recomputed = [v for v in r2.graph.nodes if v.name in names]
    print(f"{args.backend}, budget {budget}: predicted {r2.program.time / r1.program.time:.3f}x of the 1.0x step, "
          f"measured {measured:.3f}x; {len(recomputed)} nodes recomputed "
          f"({sum(v.time for v in recomputed) * 1e3:.1f} ms of op times): "
          + ", ".join(f"{op} {n}" for op, n in collections.Counter(v.extra.get('op') for v in recomputed).most_common(6)))
    return 0


if __name__ == "__main__":
    steady_malloc()
    sys.exit(main())
