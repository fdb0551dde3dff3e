"""How large a batch fits a fixed memory: remat against plain autograd and checkpoint-every-block (CPU).

For each case, one run (`remat.capacity`): the model is traced at two batch sizes (the
granularity `remat.trace` picks by default unless the case names one), plain autograd and
``torch.utils.checkpoint`` on every block are measured at those sizes (the allocator's figure
on the CPU, kernels' scratch included as the plans count it; median of 3 steps) and their peaks extrapolated to the largest batch that fits; remat
searches the largest batch per overhead level (no recomputation, <= 1.1x, <= 1.3x, and <= the
step-time ratio checkpointing measured at its own answer, in turns with plain autograd at that
batch, so the two are compared at the same overhead).  remat's
answer at the largest level is traced at its size, planned and run for `--steps` steps (natively
where the plan fits that way, else by the interpreter: ``executor="auto"``): the
measured peak must be within the memory; the measured step time is set against plain autograd's
at the same batch.  Figures are ratios: remat's batch over plain's and over checkpointing's.

    python benchmarks/capacity.py                      # GPT-2 (zoo, 4 layers, seq 128), ResNet-50 (zoo, 32 px) with and without swap
    python benchmarks/capacity.py --cases gpt2 --time-limit 20
    python benchmarks/capacity.py --cases resnet50-op -o benchmarks/out/capacity-op.csv   # op-level ResNet-50
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc, time_in_turns, write_csv  # noqa: E402
from vs_checkpoint import turns  # noqa: E402  (the same steps)

import remat  # noqa: E402
from remat.core.units import format_bytes  # noqa: E402
from remat.frontends import zoo  # noqa: E402
from remat.frontends.base import default_loss  # noqa: E402
from remat.sizes import search  # noqa: E402

# name -> (zoo model, zoo settings without the batch, memory, capacity options)
CASES = {
    "gpt2": ("gpt2", {"seq_len": 128, "n_layer": 4}, "48MiB", {}),
    "resnet50": ("resnet50", {}, "24MiB", {"granularity": "module"}),
    "resnet50-swap": ("resnet50", {}, "24MiB", {"granularity": "module", "swap": True}),
    "resnet50-op": ("resnet50", {}, "24MiB", {"granularity": "joint"}),   # op level: each tensor on its own
}
COLUMNS = ("case", "memory", "granularity", "nodes", "plain_batch", "plain_predicted_batch", "ckpt_batch",
           "ckpt_time_ratio", "ckpt_time_ratio_traced", "remat_no_recompute", "remat_1.1x", "remat_1.3x",
           "remat_at_ckpt_ratio", "remat_at_ckpt_ratio_proven", "verified_batch", "verified_executor", "verified_peak",
           "verified_predicted_peak", "verified_predicted_overhead", "verified_time_ratio", "remat_over_plain",
           "remat_over_ckpt_same_overhead")


def ckpt_ratio_at(make, size: int, rounds: int) -> float:
    """checkpoint-every-block's step time over plain autograd's at batch `size` (its answer), the
    two taking turns step by step (on the CPU plain runs past the memory; only its time is used)."""
    model, inputs = make(size)
    t = time_in_turns(turns(model, inputs, default_loss, {}), rounds)
    return t["checkpoint every block"] / t["plain"]


def run_case(case: str, steps: int, time_limit: float) -> dict:
    name, settings, memory, opts = CASES[case]

    def make(batch: int):
        return zoo.get(name, batch=batch, **settings)
    opts = dict(opts)
    rep = remat.capacity(make, memory, time_limit=time_limit, verify=True, verify_steps=steps,
                         on_probe=lambda p: print(f"  {case}: batch {p.size}: {p.status}"
                                                  + (f" {p.overhead:.3f}x" if p.overhead else ""), flush=True),
                         **opts)
    res, fam = rep.result, rep.family
    plain, ckpt = rep.peers
    top = max(ckpt.times)
    traced_ratio = ckpt.times[top] / plain.times[top]   # (at the largest traced batch: small steps)
    ratio = ckpt_ratio_at(make, ckpt.size, max(steps, 5)) if ckpt.size else traced_ratio
    at_ckpt = search(fam, res.memory, [ratio], swap=bool(opts.get("swap")), time_limit=time_limit).levels[0]
    v = rep.verification
    g = fam.graphs[fam.sizes[0]]
    levels = {round(a.level, 6): a.size for a in res.levels}
    return {"case": case, "memory": res.memory, "granularity": g.meta.get("granularity"), "nodes": g.n,
            "plain_batch": plain.size, "plain_predicted_batch": res.plain_size, "ckpt_batch": ckpt.size,
            "ckpt_time_ratio": round(ratio, 3), "ckpt_time_ratio_traced": round(traced_ratio, 3),
            "remat_no_recompute": levels.get(1.0), "remat_1.1x": levels.get(1.1),
            "remat_1.3x": levels.get(1.3), "remat_at_ckpt_ratio": at_ckpt.size,
            "remat_at_ckpt_ratio_proven": at_ckpt.proven, "verified_batch": v.size if v else None,
            "verified_executor": v.executor if v else None,
            "verified_peak": v.measured_bytes if v else None,
            "verified_predicted_peak": v.predicted_bytes if v else None,
            "verified_predicted_overhead": round(v.plan.predicted["overhead"], 3) if v and v.plan else None,
            "verified_time_ratio": round(v.time_ratio, 3) if v and v.time_ratio else None,
            "remat_over_plain": round(res.best().size / plain.size, 2) if plain.size else None,
            "remat_over_ckpt_same_overhead": round(at_ckpt.size / ckpt.size, 2) if ckpt.size else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=3, help="verified steps (and plain steps) to time")
    ap.add_argument("--time-limit", type=float, default=10.0, help="ILP seconds per probe")
    ap.add_argument("-o", "--output", default="benchmarks/results/capacity.csv")
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        row = run_case(case, args.steps, args.time_limit)
        rows.append(row)
        print(f"{case}: within {format_bytes(row['memory'])}: plain batch {row['plain_batch']}, checkpoint every block "
              f"{row['ckpt_batch']} ({row['ckpt_time_ratio']}x time), remat {row['remat_no_recompute']} / "
              f"{row['remat_1.1x']} / {row['remat_1.3x']} (none / 1.1x / 1.3x), {row['remat_at_ckpt_ratio']} at "
              f"checkpointing's {row['ckpt_time_ratio']}x; verified batch {row['verified_batch']} ({row['verified_executor']}): "
              f"{format_bytes(row['verified_peak'] or 0)} measured, {row['verified_time_ratio']}x plain's time "
              f"(predicted {row['verified_predicted_overhead']}x)", flush=True)
    write_csv(args.output, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    steady_malloc()
    sys.exit(main())
