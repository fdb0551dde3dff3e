"""How fast a plan runs in the user's own loop: plain autograd, the interpreter
(``remat.apply(model, plan)``: the captured ops replayed) and native execution
(``remat.apply(model, plan, executor="native")``: the model's own code with hooks), side by side
in one run (CPU; on CUDA the same script, with `max_memory_allocated`).

For each case, module-level trace (depth auto: the repeated blocks), no swap (``--granularity
joint``: the joint graph, plans of the unrestricted class, run by the joint executor as
straight-line code, ``code``, and op by op, ``interpreter``):
* ``1.0x``: the plan that keeps everything, run by both executors (what running a plan costs
  when it saves nothing);
* ``0.5x`` / ``0.3x``: native plans (``remat.plan(..., executor="native")``) at that fraction of
  the room between what every schedule holds and the 1.0x peak, run natively and by the
  interpreter.
Step times: the median of `--steps` steps per variant, the variants taking turns step by step (so
the machine's drift falls on all alike), no meter, gradients set to None between steps as
``zero_grad()`` does.  Peaks: one more step per variant under `remat.measure` (the storage
accounting on the CPU).  Gradients: one step per variant on the same batch and seed, compared with
plain autograd's (max abs difference).  Figures are ratios to plain autograd in this run.

    python benchmarks/executor_speed.py                       # gpt2, hf-gpt2, resnet50
    python benchmarks/executor_speed.py --cases gpt2-124m --steps 5   # transformers' GPT-2 small, batch 2, seq 256
    python benchmarks/executor_speed.py --cases gpt2 --steps 9
    python benchmarks/executor_speed.py --granularity joint   # op-level plans: generated code against the interpreter
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc, turn_order, write_csv  # noqa: E402
from peers import CASES  # noqa: E402  (the same models as the peers' comparison)

import remat  # noqa: E402
from remat.core.analysis import forced_need  # noqa: E402
from remat.core.errors import InfeasibleBudgetError  # noqa: E402
from remat.frontends.base import model_inputs  # noqa: E402
from remat.frontends.native import NativeExecution  # noqa: E402
from remat.frontends.run import random_batch  # noqa: E402

def gpt2_124m(batch: int = 2, seq: int = 256) -> tuple:
    """transformers' GPT-2 small (12 layers, width 768, GPT-2's vocabulary; dropout 0.1), the
    real-model suite's GPT-2, with the loss a user's loop computes from the logits."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=seq, use_cache=False)).train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def lm_loss(out, ids):
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return model, (ids,), lm_loss


CASES = {**CASES, "gpt2-124m": (gpt2_124m, {})}
COLUMNS = ("case", "nodes", "variant", "executor", "budget_bytes", "predicted_peak", "measured_peak", "peak_error",
           "predicted_overhead", "step_s", "time_over_plain", "max_grad_diff", "recomputed", "note")


def fraction_plan(graph, fraction: float, time_limit: float, executor: str = "native"):
    low = forced_need(graph)
    full = remat.plan(graph, "1.0x", solver="checkpoint-all").predicted["peak_bytes"]
    for f in (fraction, fraction + 0.1, fraction + 0.2, fraction + 0.3):
        try:
            return remat.plan(graph, int(low + f * (full - low)), swap=False, time_limit=time_limit, executor=executor)
        except InfeasibleBudgetError:
            continue
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="gpt2,hf-gpt2,resnet50")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--granularity", choices=("module", "joint"), default="module",
                    help="joint: op-level plans, run as straight-line code and by the interpreter")
    ap.add_argument("--out", default="benchmarks/out/executor_speed.csv")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for case in args.cases.split(","):
        build, opts = CASES[case]
        model, example, loss_fn = build()
        if getattr(getattr(model, "config", None), "use_cache", None):
            model.config.use_cache = False   # (a training loop's setting; a cache returned is held to the step's end)
        model.to(device).train()
        example = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example)
        joint = args.granularity == "joint"
        graph = remat.trace(model, example, loss_fn=loss_fn, granularity=args.granularity, progress=False)
        # (module graphs: the native class's 1.0x, whose budget also holds what native execution
        # keeps beyond the graph's keep-all, the model's returned outputs say; the same plan runs
        # in both executors)
        plan_class = "any" if joint else "native"
        plans = {"1.0x": remat.plan(graph, "1.0x", swap=False, time_limit=args.time_limit, executor=plan_class)}
        for f in (0.5, 0.3):
            p = fraction_plan(graph, f, args.time_limit, plan_class)
            if p is not None:
                plans[f"{f}x"] = p
        variants = {"plain": (copy.deepcopy(model), None, None)}
        for label, plan in plans.items():
            for executor in (("interpreter", "code") if joint else ("interpreter", "native")):
                m = copy.deepcopy(model)
                ex = remat.apply(m, plan, example, loss_fn,
                                 executor="native" if executor == "native" else "interpreter")
                if joint:   # the joint executor: the plan as straight-line code, or op by op
                    ex.straight_line = executor == "code"
                variants[f"{executor} {label}"] = (m, ex, plan)

        def step(name: str, batch: tuple) -> torch.Tensor:
            m, ex, _ = variants[name]
            for p in m.parameters():
                p.grad = None
            if ex is None or isinstance(ex, NativeExecution):
                # the user's own loop, holding `out` through the backward as the native
                # prediction assumes (a loop that drops it once the loss is made peaks lower
                # by what autograd then frees: a language model's logits)
                out = m(*model_inputs(m, batch))
                loss = loss_fn(out, *batch)
            else:
                loss = ex(*batch)
            loss.backward()
            return loss.detach()

        gen = torch.Generator().manual_seed(1)
        times = {name: [] for name in variants}
        for k in range(args.steps + 1):   # (round 0: warm-up)
            batch = random_batch(example, gen, device)
            for name in turn_order(list(variants), k):
                torch.manual_seed(100 + k)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step(name, batch)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if k:
                    times[name].append(time.perf_counter() - t0)
        reference = random_batch(example, torch.Generator().manual_seed(2), device)
        grads = {}
        for name, (m, _, _) in variants.items():
            torch.manual_seed(999)
            step(name, reference)
            grads[name] = [p.grad.detach().clone() if p.grad is not None else None for p in m.parameters()]
        plain_s = statistics.median(times["plain"])
        for name, (m, ex, plan) in variants.items():
            for p in m.parameters():
                p.grad = None
            resident = list(m.parameters()) + list(m.buffers()) + list(reference)
            # the allocator's figure (kernels' own scratch included, as the module graphs count it)
            peak = remat.measure(lambda: step(name, reference), device, resident=resident,
                                 meter="allocator").peak_bytes
            predicted = (ex.predicted if isinstance(ex, NativeExecution) else plan.predicted) if plan else None
            diff = max((float((a - b).abs().max()) for a, b in zip(grads[name], grads["plain"])
                        if a is not None and b is not None), default=0.0)
            s = statistics.median(times[name])
            recomputed = None if plan is None else sum(1 for o in plan.schedule.ops if o.op == "compute") - graph.n
            rows.append({"case": case, "nodes": graph.n, "variant": name, "executor": name.split()[0],
                         "budget_bytes": plan.budget_bytes if plan else None,
                         "predicted_peak": predicted["peak_bytes"] if predicted else None, "measured_peak": peak,
                         "peak_error": round(peak / predicted["peak_bytes"] - 1, 4) if predicted else None,
                         "predicted_overhead": round(plan.predicted["overhead"], 4) if plan else None,
                         "step_s": round(s, 5), "time_over_plain": round(s / plain_s, 4),
                         "max_grad_diff": diff, "recomputed": recomputed,
                         "note": ", ".join(ex.kept) if isinstance(ex, NativeExecution) and ex.kept else ""})
            r = rows[-1]
            err = "" if r["peak_error"] is None else f" ({100 * r['peak_error']:+.2f}% of predicted)"
            print(f"{case:9s} {name:18s} peak {peak:>12,}{err} time {s * 1e3:8.2f} ms = {s / plain_s:.3f}x plain "
                  f"(predicted {r['predicted_overhead']}), grad diff {diff:.2g}", flush=True)
        for _, ex, _ in variants.values():
            if isinstance(ex, NativeExecution):
                ex.remove()
    write_csv(args.out, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    steady_malloc()
    sys.exit(main())
