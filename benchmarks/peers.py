"""remat side by side with what a user would pick instead, on one model, in one run.

Variants, each on a fresh copy of the model (same initial weights, same batches, the same RNG
seed before every step), in PyTorch's default loop (gradients set to None between steps):

* ``plain``: plain autograd;
* ``ckpt-every-k`` (k = 1, 2, 3): ``torch.utils.checkpoint`` (non-reentrant) on every k-th
  repeated block (`remat.frontends.checkpointing`);
* ``hf-gradient-checkpointing``: transformers' ``gradient_checkpointing_enable`` (named
  ``activation_checkpointing_enable`` from transformers 5; non-reentrant), on its models;
* ``save-on-cpu``: ``torch.autograd.graph.save_on_cpu`` around the step (on a CPU the "host" is
  the same memory: the row shows its cost, not a saving);
* ``compile-BACKEND-SOLVER-B``: ``torch.compile`` with ``activation_memory_budget = B`` (the
  partitioner's knapsack; solvers ``dp``, its default, and ``ilp``), backends
  ``aot_eager_decomp_partition`` and, with ``--inductor``, ``inductor`` (``fallback_random``
  on); budget 1 (no knapsack) first, whose gradients are the reference for the others: the
  compiled step draws its random numbers through decomposed ops, unlike eager, so against plain
  every dropout model differs, and a difference from budget 1 is a recomputation drawing fresh
  randomness (pytorch#190758);
* ``remat-compiled-BACKEND@VARIANT`` (``--remat-compiled``): ``torch.compile(model,
  backend=remat.compiler(B, backend=BACKEND))`` with B the peak VARIANT measured, for every
  peak a compile row of that backend measured (VARIANT: the first row of that peak), and ``@1x``
  (nothing recomputed; ``--buffers``: ``buffers=True``); its gradients are compared with
  that backend's budget-1 row too.  The compile rows compile the model and compute its loss
  eagerly on what it returns (``torch.compile(model)``), or with ``--compile-loss`` compile the
  model and its loss as one module (`WithLoss`), so both torch.compile and remat see the loss's
  bytes (transformers' GPT-2 124M: its eager cross entropy over 50,257 logits holds three
  logits-sized tensors at once, outside any region);
* ``remat@VARIANT``: remat planned (`remat.trace` defaults unless the case names a granularity;
  the ILP without swap) at the peak VARIANT measured, for every peer, applied with
  ``remat.apply(..., executor="auto")`` (a plan that recomputes nothing runs as plain autograd
  where the plain step the trace measured fits; the note names the execution).

For each: the peak (one meter for all: on the CPU the allocator's own events,
``remat.measure(meter="allocator")``, which see inside compiled code and kernels' scratch buffers;
on CUDA ``max_memory_allocated``; eager variants also under the storage accounting, the meter
remat's CPU predictions are made for), the median step time of ``--steps`` steps after a warm-up,
taken in turns with plain autograd's step (`csvout.time_in_turns`; this machine's speed drifts by
tens of percent over minutes, so each variant's time is over the plain steps taken between its own;
a remat row is timed in the same turns with the fastest peer at its budget (a peer's peak) or below, of
any kind for a compiled row and checkpointing or save_on_cpu for an eager one: columns ``peer`` and
``time_over_peer``), and the largest difference of the loss and of any gradient from plain
autograd's on a reference step (the same batch and RNG seed for every variant). A last ``plain
(again)`` row, a fresh copy timed the same way, shows the timing's noise. CSV rows, and a picture:
step time against peak, both over plain's, one marker per variant, remat's points joined.

    python benchmarks/peers.py                                  # zoo GPT-2 (4 layers, batch 8, seq 256)
    python benchmarks/peers.py --case hf-gpt2                   # transformers GPT-2 (4 layers, width 128)
    python benchmarks/peers.py --case resnet50 --inductor --budgets 0.1,0.5,0.9
    python benchmarks/peers.py --case tv-resnet50 --solvers dp --budgets 0.1,0.5,0.9 --time-limit 60
    python benchmarks/peers.py --case mlp --only-compile --remat-compiled --inductor --solvers dp
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import steady_malloc, time_in_turns, write_csv  # noqa: E402

import torch  # noqa: E402

import remat  # noqa: E402
from remat.core.errors import RematError  # noqa: E402
from remat.frontends import default_loss, zoo  # noqa: E402
from remat.frontends.checkpointing import block_names, checkpoint_every_block  # noqa: E402
from remat.frontends.base import step_loss  # noqa: E402
from remat.frontends.run import random_batch  # noqa: E402
from remat.frontends import vision  # noqa: E402

vision.prepare()   # transformers imports torchvision where it is installed

def hf_gpt2(batch: int = 8, seq: int = 256, layers: int = 4, width: int = 128, heads: int = 4,
            vocab: int = 1024) -> tuple:
    """A transformers GPT-2 (by default 4 layers, width 128, vocabulary 1024; dropout 0.1), token
    ids, and the next-token loss a user's loop computes from its logits."""
    import transformers
    torch.manual_seed(0)
    # (no KV cache in training: a DynamicCache in the output stops torch.export)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def lm_loss(out, ids):
        return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return model, (ids,), lm_loss


class MLP(torch.nn.Sequential):
    """Four blocks Linear(256, 512)-GELU-Dropout(0.1)-Linear(512, 256)-LayerNorm: activations are
    nearly all of its step, and its dropout shows whether recomputation replays the masks."""

    def __init__(self, blocks: int = 4, width: int = 256):
        super().__init__(*[torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                               torch.nn.Dropout(0.1), torch.nn.Linear(2 * width, width),
                                               torch.nn.LayerNorm(width)) for _ in range(blocks)])


def mlp(batch: int = 4096) -> tuple:
    torch.manual_seed(0)
    return MLP().train(), (torch.randn(batch, 256, generator=torch.Generator().manual_seed(1)),), \
        lambda out, x: out.square().mean()


# name -> (build: () -> (model, example inputs, loss_fn), trace options)
CASES = {
    "mlp": (mlp, {}),
    "gpt2": (lambda: (*zoo.get("gpt2", batch=8, seq_len=256, n_layer=4), default_loss), {}),
    "hf-gpt2": (hf_gpt2, {}),
    "resnet50": (lambda: (*zoo.get("resnet50", batch=8, image_size=64), default_loss), {"granularity": "module"}),
    # torchvision at the real-model suite's sizes (cross entropy over labels, an input of the step)
    "tv-resnet50": (lambda: (*vision.get("resnet50", batch=8, tiny=False), vision.cross_entropy), {}),
    "tv-vit_b_16": (lambda: (*vision.get("vit_b_16", batch=8, tiny=False), vision.cross_entropy), {}),
    # transformers' GPT-2 124M (12 layers, width 768, GPT-2's vocabulary), batch 2, sequence 256
    "gpt2-124m": (lambda: hf_gpt2(batch=2, seq=256, layers=12, width=768, heads=12, vocab=50257), {}),
}
COLUMNS = ("case", "variant", "kind", "peak_bytes", "storage_peak_bytes", "predicted_peak_bytes", "step_s",
           "plain_step_s",
           "peak_over_plain", "time_over_plain", "peer", "time_over_peer", "loss_diff", "max_grad_diff",
           "grad_diff_vs_compile_1", "note")
# the kinds of rows that are peers (what a user would pick instead of remat); of these a compiled
# remat row is timed against the fastest of any kind, an eager one against the fastest eager one
PEER_KINDS = ("checkpoint", "save_on_cpu", "compile-")
EAGER_PEER_KINDS = ("checkpoint", "save_on_cpu")


class WithLoss(torch.nn.Module):
    """`model` and its loss as one module, ``forward(*batch)`` the step's loss: what a user compiles
    to have torch.compile see the loss too (``--compile-loss``)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return step_loss(self.model, self.loss_fn, batch)


def run_steps(model: torch.nn.Module, step: Callable[[tuple], torch.Tensor], example: tuple,
              warmup: int, device: torch.device, storage: bool) -> dict:
    """Peaks, and the reference step's loss and gradients: `warmup` steps, the reference step, one
    step under the allocator meter and, with `storage`, one under the storage accounting (the
    meter remat's CPU predictions are made for; it would make compiled code run eagerly).  Every
    step's batch and RNG seed are the same across variants.  Times are taken apart
    (`timed_against_plain`), with no meter: a meter's per-op cost grows with the op count, which
    compiled graphs change."""
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(example, gen, device) for _ in range(warmup)]
    reference = random_batch(example, torch.Generator().manual_seed(2), device)
    peak, first = 0, None
    meters = [None] * len(batches) + ["reference", "allocator"] + (["storage"] if storage else [])
    batches = batches + [reference] * (len(meters) - len(batches))
    storage_peak = None
    for k, (batch, meter) in enumerate(zip(batches, meters)):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(999 if meter == "reference" else 100 + k)
        box: list = []

        def one() -> None:
            loss = step(batch)
            loss.backward()
            box.append(loss.detach())
        resident = list(model.parameters()) + list(model.buffers()) + list(batch)
        if meter is None:
            one()
        elif meter == "reference":
            one()
            first = (float(box[0]), [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
        else:
            m = remat.measure(one, device, resident=resident, meter=meter)
            if meter == "storage":
                storage_peak = m.peak_bytes
            else:
                peak = m.peak_bytes
    for p in model.parameters():
        p.grad = None
    return {"peak_bytes": peak, "storage_peak_bytes": storage_peak, "first": first}


def training_step(model: torch.nn.Module, step: Callable[[tuple], torch.Tensor], batch: tuple) -> Callable[[], None]:
    """One step of PyTorch's default loop on a fixed batch: gradients set to None, then the
    step's loss and its backward."""
    def one() -> None:
        for p in model.parameters():
            p.grad = None
        step(batch).backward()
    return one


def timed_against_plain(variant: Callable[[], None], plain: Callable[[], None], rounds: int,
                        device: torch.device, peer: Callable[[], None] | None = None) -> tuple:
    """(median seconds of `variant`'s step, of plain autograd's, of `peer`'s or None), the steps
    taking turns step by step (`csvout.time_in_turns`): the same drift of this shared machine's
    speed falls on each, so their ratios hold where times of variants measured minutes apart do
    not (two remat rows each timed against plain minutes apart differed by 8 % where, in turns,
    they were within 1 %)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    steps = {"variant": variant, "plain": plain, **({"peer": peer} if peer is not None else {})}
    t = time_in_turns(steps, rounds, sync)
    return t["variant"], t["plain"], t.get("peer")


def in_config(config: Callable[[], Any], step: Callable[[], None]) -> Callable[[], None]:
    """`step` run under the context manager `config()` makes."""
    def run() -> None:
        with config():
            step()
    return run


def fastest_peer(rows: list[dict], peak: int, kinds: tuple) -> dict | None:
    """The row of `kinds` (kind prefixes) with the least time over plain among those whose
    measured peak is at most `peak` (the issue's "fastest peer at that peak or below": `peak` is
    the budget a remat row was planned at, a peer's measured peak), or None."""
    fits = [r for r in rows if r["kind"].startswith(kinds) and r["peak_bytes"] <= peak]
    return min(fits, key=lambda r: r["time_over_plain"], default=None)


def grad_diff(a: list, b: list) -> float:
    out = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            out = max(out, 0.0 if x is y else float("inf"))
        else:
            out = max(out, float((x - y).abs().max()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="gpt2", choices=sorted(CASES))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (median)")
    ap.add_argument("--budgets", default="0.1,0.3,0.5,0.7,0.9", help="activation_memory_budget values")
    ap.add_argument("--solvers", default="dp,ilp", help="activation_memory_budget_solver values")
    ap.add_argument("--inductor", action="store_true", help="also the inductor backend (C++ compile: slow)")
    ap.add_argument("--backends", default=None,
                    help="the compile backends, comma-separated (default aot_eager_decomp_partition, and inductor "
                         "with --inductor)")
    ap.add_argument("--remat-compiled", action="store_true",
                    help="also remat.compiler on each compile backend, at 1x and at every compile row's peak")
    ap.add_argument("--only-compile", action="store_true",
                    help="plain, the compile rows and remat's compiled rows only (no checkpointing, save_on_cpu, "
                         "eager remat)")
    ap.add_argument("--compile-loss", action="store_true",
                    help="the compile rows (torch.compile's and remat's) compile the model with its loss, not the "
                         "model alone with the loss computed eagerly on its outputs")
    ap.add_argument("--buffers", action="store_true",
                    help="remat.compiler(..., buffers=True): model inductor's buffer rewrites (a scatter into zeros "
                         "in their buffer, a product folded into addmm)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="ILP seconds per remat plan")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-o", "--output", default=None, help="CSV (default benchmarks/results/peers-CASE.csv)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    build, trace_opts = CASES[args.case]
    base, example, loss_fn = build()
    example = example if isinstance(example, tuple) else (example,)
    base.to(dev)
    rows: list[dict] = []
    plain_first: dict = {}
    timing_batch = random_batch(example, torch.Generator().manual_seed(3), dev)
    plain_model = copy.deepcopy(base)   # plain autograd, timed in turns with every variant
    plain_step: list = []
    out = args.output or f"benchmarks/results/peers-{args.case}.csv"

    def save(quiet: bool = True) -> None:
        """The rows so far to the CSV: written before every row and at the end, so a run stopped
        early keeps what it measured (a remat row's note is set after its row is recorded)."""
        write_csv(out, COLUMNS, [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], quiet=quiet)

    def record(variant: str, kind: str, model: torch.nn.Module, step: Callable, warmup: int = 1,
               note: str = "", predicted: int | None = None, reference: list | None = None,
               keep_grads: bool = False, config: Callable[[], Any] = contextlib.nullcontext,
               budget: int | None = None) -> dict:
        if rows:
            save()
        res = run_steps(model, step, example, warmup, dev,
                        storage=not kind.startswith(("compile", "remat-compiled")) and dev.type == "cpu")
        loss, grads = res["first"]
        # (a remat row: timed in turns with plain and with the fastest peer at its budget -- the
        # peak of the peer it was planned at -- or below; at its own peak where it has no budget)
        peer = None
        if kind.startswith("remat"):
            peer = fastest_peer(rows, max(res["peak_bytes"], budget or 0),
                                PEER_KINDS if kind.startswith("remat-compiled") else EAGER_PEER_KINDS)
        timed = training_step(model, step, timing_batch)
        peer_s = None
        if not plain_first:
            plain_first.update(loss=loss, grads=grads, peak=res["peak_bytes"])
            plain_step.append(training_step(plain_model, eager(plain_model), timing_batch))
            s = plain_s = time_in_turns({"plain": plain_step[0]}, args.steps)["plain"]
        else:
            s, plain_s, peer_s = timed_against_plain(timed, plain_step[0], args.steps, dev,
                                                     peer["_step"] if peer is not None else None)
        for m_ in [model] + ([peer["_model"]] if peer is not None else []):   # (no gradients held between rows)
            for p in m_.parameters():
                p.grad = None
        row = {"case": args.case, "variant": variant, "kind": kind, "peak_bytes": res["peak_bytes"],
               "storage_peak_bytes": res["storage_peak_bytes"], "predicted_peak_bytes": predicted,
               "step_s": round(s, 5), "plain_step_s": round(plain_s, 5),
               "peak_over_plain": round(res["peak_bytes"] / plain_first["peak"], 4),
               "time_over_plain": round(s / plain_s, 3),
               "peer": peer["variant"] if peer is not None else None,
               "time_over_peer": round(s / peer_s, 3) if peer_s else None,
               "loss_diff": abs(loss - plain_first["loss"]), "max_grad_diff": grad_diff(grads, plain_first["grads"]),
               "grad_diff_vs_compile_1": grad_diff(grads, reference) if reference is not None else None,
               "note": note}
        rows.append(row)
        print(f"{variant:<40} peak {row['peak_over_plain']:.3f}x  time {row['time_over_plain']:.3f}x "
              f"({s:.3f} s, plain {plain_s:.3f} s)  grad diff {row['max_grad_diff']:.2e}"
              + (f" (vs budget 1: {row['grad_diff_vs_compile_1']:.2e})" if reference is not None else "")
              + (f"  {row['time_over_peer']:.3f}x {peer['variant']}'s time, in turns" if peer_s else "")
              + f"  {note}", flush=True)
        if keep_grads:
            row["_grads"] = grads
        if kind.startswith(PEER_KINDS):   # (kept to be timed against remat's rows, under its own `config`)
            row["_step"], row["_model"] = in_config(config, timed), model
        return row

    def compiled_step(model: torch.nn.Module, backend: Any) -> Callable:
        """The step of `model` compiled with `backend`: the model alone, its loss computed eagerly
        on what it returns, or with ``--compile-loss`` the model and its loss as one region."""
        if not args.compile_loss:
            return eager(torch.compile(model, backend=backend))
        step = torch.compile(WithLoss(model, loss_fn), backend=backend)
        return lambda batch: step(*batch)

    def eager(model: torch.nn.Module, wrap: Callable[[], Any] = contextlib.nullcontext) -> Callable:
        def step(batch: tuple) -> torch.Tensor:
            with wrap():
                return step_loss(model, loss_fn, batch)   # labels: the loss's only
        return step

    record("plain", "plain", plain_model, eager(plain_model), warmup=3)  # (the process's first steps run slow)
    blocks = block_names(base)
    for k in (1, 2, 3) if not args.only_compile else ():
        m = checkpoint_every_block(base, blocks[k - 1::k])
        record(f"ckpt-every-{k}", "checkpoint", m, eager(m), note=f"{len(blocks[k - 1::k])} of {len(blocks)} blocks")
    # transformers' own switch (``activation_checkpointing_enable`` from 5.x, the older name before)
    switch = next((n for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
                   if hasattr(base, n)), None)
    if switch is not None and not args.only_compile:
        m = copy.deepcopy(base)
        kwargs = "activation" if switch.startswith("activation") else "gradient"
        getattr(m, switch)(**{f"{kwargs}_checkpointing_kwargs": {"use_reentrant": False}})
        record("hf-gradient-checkpointing", "checkpoint", m, eager(m), note=switch)
    m = copy.deepcopy(base)
    if not args.only_compile:
        record("save-on-cpu", "save_on_cpu", m, eager(m, lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)))

    def compiled_rows(backend: str, reference: list | None) -> None:
        """remat.compiler on `backend` at 1x and at the peak of every compile row of that backend
        (once a peak: rows of one peak share remat's row, labelled with the first)."""
        peaks: dict = {}
        for r in rows:
            if r["kind"] == f"compile-{backend}":
                peaks.setdefault(int(r["peak_bytes"]), r["variant"])
        for label, budget in [("1x", "1.0x")] + [(v, b) for b, v in peaks.items()]:
            torch._dynamo.reset()
            m = copy.deepcopy(base)
            rc = remat.compiler(budget, backend=backend, time_limit=args.time_limit,
                                **({"buffers": True} if args.buffers else {}))
            try:
                with iconfig.patch(fallback_random=True):
                    row = record(f"remat-compiled-{backend}@{label}", f"remat-compiled-{backend}", m,
                                 compiled_step(m, rc), warmup=2, reference=reference,
                                 budget=budget if isinstance(budget, int) else None)
            except Exception as e:  # noqa: BLE001 - a budget that does not fit is a row's note
                inner = getattr(e, "inner_exception", None) or e   # (dynamo wraps the backend's error)
                print(f"remat-compiled-{backend}@{label}: {type(inner).__name__}: {str(inner).splitlines()[0]}",
                      flush=True)
                continue
            pr = [r.predicted for r in rc.regions]
            row["predicted_peak_bytes"] = rc.step_peak_bytes   # (the replay of what the partitioner built)
            row["note"] = (f"{len(rc.regions)} region(s), predicted {pr[0]['overhead']:.3f}x, "
                           f"{sum(len(r.recomputed_ops) for r in rc.regions)} ops recomputed, "
                           + ("buffers=True, " if args.buffers else "") +
                           f"{rc.regions[0].plan.solver.get('status')}")
            print(f"{'':<40} predicted peak {row['predicted_peak_bytes'] / row['peak_bytes']:.3f}x of measured; "
                  f"{row['note']}", flush=True)

    backends = (args.backends.split(",") if args.backends
                else ["aot_eager_decomp_partition"] + (["inductor"] if args.inductor else []))
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig

    @contextlib.contextmanager
    def budget_config(b: float, solver: str):
        """torch.compile's knob at `b` (a compile row's step runs, and after a dynamo reset
        compiles again, under it)."""
        with fconfig.patch(activation_memory_budget=b, activation_memory_budget_solver=solver), \
                iconfig.patch(fallback_random=True):
            yield
    for backend in backends:
        # budget 1 first: its gradients are the reference for the budgets below, drawn by the same
        # (decomposed) random ops, so a difference there is a recomputation's fresh randomness
        reference = None
        for solver, b in [("dp", 1.0)] + [(sv, float(x)) for sv in args.solvers.split(",")
                                          for x in args.budgets.split(",")]:
            torch._dynamo.reset()
            m = copy.deepcopy(base)
            knob = functools.partial(budget_config, b, solver)
            with knob():
                try:
                    row = record(f"compile-{backend}-{solver}-{b:g}", f"compile-{backend}", m,
                                 compiled_step(m, backend),
                                 warmup=2, reference=reference, keep_grads=reference is None, config=knob)
                except Exception as e:  # noqa: BLE001 - a peer that fails is a row, not the end
                    print(f"compile-{backend}-{solver}-{b:g}: {type(e).__name__}: {e}", flush=True)
                    continue
            if reference is None:
                reference = row["_grads"]
        if args.remat_compiled:
            compiled_rows(backend, reference)
    torch._dynamo.reset()
    if args.only_compile:
        rows_for_remat = []
    else:
        rows_for_remat = [r for r in rows if r["kind"] != "plain" and not r["kind"].startswith("remat-compiled")
                          and r["variant"] != "compile-" + backends[0] + "-dp-1"]
    if rows_for_remat:
        graph = remat.trace(copy.deepcopy(base), example, loss_fn, name=args.case, **trace_opts)
        print(f"remat graph: {graph.meta.get('granularity')}, {graph.n} nodes", flush=True)
    for peer in rows_for_remat:
        m = copy.deepcopy(base)
        try:
            plan = remat.plan(graph, int(peer["peak_bytes"]), swap=False, time_limit=args.time_limit)
        except RematError as e:
            print(f"remat@{peer['variant']}: {e}", flush=True)
            continue
        planned = remat.apply(m, plan, example, loss_fn, executor="auto")
        predicted = planned.predicted if hasattr(planned, "predicted") else plan.predicted
        record(f"remat@{peer['variant']}", "remat", m, lambda batch, planned=planned: planned(*batch),
               note=f"{plan.solver.get('status')}, predicted {predicted['overhead']:.3f}x, {type(planned).__name__}",
               predicted=predicted["peak_bytes"], budget=int(peer["peak_bytes"]))
    m = copy.deepcopy(base)
    record("plain (again)", "plain", m, eager(m), note="a fresh copy against the first: the timing's noise")
    save(quiet=False)
    picture(rows, Path(out).with_suffix(".png"), args.case)
    return 0


def picture(rows: list[dict], path: Path, case: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in sorted({r["kind"] for r in rows}):
        pts = sorted((r["peak_over_plain"], r["time_over_plain"]) for r in rows if r["kind"] == kind)
        ax.plot(*zip(*pts), "o-" if kind.startswith("remat") else "o", label=kind, alpha=0.8)
    ax.set_xlabel("measured peak / plain autograd's")
    ax.set_ylabel("median step time / plain autograd's")
    ax.set_title(f"{case}: remat and its peers, one run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    steady_malloc()
    sys.exit(main())
