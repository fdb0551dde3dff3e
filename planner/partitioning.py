"""`remat.partition`: split a model's step across devices under a per-device budget.

`partition(graph, devices, budget)` runs Tofu's recursive search (`remat.solvers.tofu`) on an
`OpGraph` and returns a `PartitionPlan`: per tensor its placement on the ``(2, ..., 2)`` device
mesh, per op its strategy per level, and per device the predicted peak (the simulator's, on
`tofu.device_graph`), the compute time of the FLOP model and the bytes communicated per step as
DTensor runs the plan (`tofu.mesh_comm`; the recursion's own sum, which treats a group of
devices as one worker, is ``search["recursion_comm_bytes"]``: the two agree at 2 devices).

The budget: the search first minimises communication alone; when the per-device peak is over the
budget it weighs memory in (`tofu.cut`'s lambda, raised by a geometric bisection, `LAMBDA_STEPS`
probes) and keeps the least communication whose keep-everything peak fits.  When no weighting
fits without recomputation, the single-device planner plans the device graph of the split with
the least memory under the budget (`remat.plan`, recomputation and no swap): the plan then says
what recomputation costs per device.  When that fails too, `InfeasibleBudgetError` names the
smallest per-device peak found.  A Lagrangian search, not a proof: the plan says so.

Baselines in the same cost model (`baselines`): data parallel (every op split along the batch,
parameters whole on every device: their gradients all-reduced), FSDP-style (the same, parameters
sharded along their first dimension: gathered for the forward and again for the backward, gradients
reduce-scattered), Megatron-style (the batch whole on every device, ops split along any other
index: a transformer's column- then row-split products), and layer placement (contiguous modules
per device, balanced by their memory; `layer_placement`, one micro-batch in the baseline row, so a
device idles while the others run).  `layer_placement` with micro-batches is a plan of its own
(``remat partition --pipeline``), run by `remat.pipelining` on `torch.distributed.pipelining`.

File format (``remat.partition``, version 1): see `PartitionPlan.to_dict`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.simulate import keep_all_peak
from remat.core.units import format_bytes
from remat.solvers import tofu
from remat.solvers.partition import REPLICATE, Shard

FORMAT = tofu.FORMAT
VERSION = tofu.VERSION
LAMBDA_STEPS = 10
LAMBDA_MAX = 1e4
BASELINES = ("data-parallel", "fsdp", "megatron", "layers")


@dataclass
class PartitionPlan:
    """A partition of one step over `devices` devices (module docstring)."""
    model: str
    devices: int
    budget_bytes: int | None
    comm_bytes: int                 # per step, all devices together
    peak_bytes: int                 # per device, predicted (keep everything, or the recompute plan's)
    fixed_bytes: int                # per device: parameters (and optimizer state), the batch's share
    compute_time: float             # per device, seconds of the FLOP model, one step
    tensors: list                   # [{"name", "shape", "kind", "placements": [str per mesh dim]}]
    ops: list                       # [{"id", "op", "module", "spec", "strategy": [index or "replicated"]}]
    search: dict = field(default_factory=dict)      # lambda, exact, states, recompute plan, baseline name
    baselines: dict = field(default_factory=dict)   # name -> {"comm_bytes", "peak_bytes"} or {"error"}
    model_spec: dict = field(default_factory=dict)  # how `remat run --plan` builds the model again (CLI)

    @property
    def comm_per_device(self) -> int:
        return self.comm_bytes // max(self.devices, 1)

    def check_runnable(self) -> None:
        """Raise `InvalidInputError` for a plan whose devices recompute but that does not say which
        ops (``search["recompute"]["ops"]``: written by remat before the distributed executor
        recomputed): its peak is a recomputation plan's, which the executor cannot follow."""
        rec = self.search.get("recompute")
        if rec and "ops" not in rec:
            raise InvalidInputError(
                f"the partition plan's per-device peak ({format_bytes(self.peak_bytes)}) is a recomputation plan's "
                f"({rec.get('overhead', 0):.2f}x) that does not name the ops it recomputes (an older remat wrote it): "
                "partition the model again")

    def blocks(self, depth: int = 3) -> list:
        """[(module prefix, {op: strategies})]: the chosen splits per block, in order."""
        out: list = []
        for o in self.ops:
            prefix = ".".join(o["module"].split(".")[:depth]) or "(top level)"
            if not out or out[-1][0] != prefix:
                out.append((prefix, {}))
            heavy = o["op"] in tofu.HEAVY
            if heavy:
                out[-1][1].setdefault(o["op"], []).append("/".join(o["strategy"]))
        return out

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "devices": self.devices,
                "mesh": [2] * int(round(math.log2(self.devices))) if self.devices > 1 else [],
                "budget_bytes": self.budget_bytes,
                "predicted": {"comm_bytes": self.comm_bytes, "comm_bytes_per_device": self.comm_per_device,
                              "peak_bytes": self.peak_bytes, "fixed_bytes": self.fixed_bytes,
                              "compute_time": self.compute_time},
                "search": self.search, "baselines": self.baselines, "model_spec": self.model_spec,
                "tensors": self.tensors, "ops": self.ops}

    @classmethod
    def from_dict(cls, d: dict) -> "PartitionPlan":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise InvalidInputError(f"not a partition plan: expected \"format\": \"{FORMAT}\"")
        if d.get("version") != VERSION:
            raise InvalidInputError(f"partition plan version {d.get('version')!r}: this remat reads version {VERSION}")
        try:
            p = d["predicted"]
            return cls(d["model"], int(d["devices"]), d.get("budget_bytes"), int(p["comm_bytes"]),
                       int(p["peak_bytes"]), int(p["fixed_bytes"]), float(p["compute_time"]), list(d["tensors"]),
                       list(d["ops"]), dict(d.get("search", {})), dict(d.get("baselines", {})),
                       dict(d.get("model_spec") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInputError(f"partition plan: missing or malformed field ({e})") from None

    def save(self, path: "str | Path") -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: "str | Path") -> "PartitionPlan":
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise InvalidInputError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"{str(path)!r} is not JSON: {e}") from None
        return cls.from_dict(d)


# ---- the search under a budget ------------------------------------------------------------------
def _record(g: tofu.OpGraph, sp: tofu.Split, budget: int | None, optimizer_factor: float, search: dict,
            planned=None, device_type: str = "cpu") -> PartitionPlan:
    dg = planned.graph if planned is not None else tofu.device_graph(g, sp, optimizer_factor)   # (what was planned)
    peak = planned.predicted["peak_bytes"] if planned is not None else keep_all_peak(dg)
    compute = planned.predicted["time"] if planned is not None else sum(v.time for v in dg.nodes)
    tensors = [{"name": t.name, "shape": list(t.shape), "kind": t.kind,
                "placements": [str(p) for p in sp.placement[t.id]]} for t in g.tensors.values()]
    ops = [{"id": o.id, "op": o.op, "module": o.module, "spec": tofu.rule(g, o).spec,
            "strategy": [s.index or "replicated" for s in sp.strategy[o.id]]} for o in g.ops]
    search = {**search, "exact": sp.exact, "states": max((c.states for c in sp.levels), default=0),
              "undescribed_ops": tofu.undescribed(g), "recursion_comm_bytes": sp.comm, "device_type": device_type}
    if planned is not None:
        by_name = {v.name: v for v in dg.nodes}
        search["recompute"] = {"overhead": planned.predicted["overhead"], "solver": planned.solver.get("status"),
                               "ops": sorted({by_name[n].extra["op"] for n in planned.predicted["recomputed"]})}
    return PartitionPlan(g.meta.get("model", "model"), sp.devices, budget, tofu.mesh_comm(g, sp, device_type), int(peak), dg.fixed_bytes,
                         float(compute), tensors, ops, search)


def _peak(g: tofu.OpGraph, sp: tofu.Split, optimizer_factor: float) -> int:
    return keep_all_peak(tofu.device_graph(g, sp, optimizer_factor))


def _recomputing(g: tofu.OpGraph, splits: list, budget: int, optimizer_factor: float, time_limit: float) -> tuple:
    """(split, plan, lambda, lowest) for the searched split with the least communication whose
    device graph the single-device planner fits in `budget` by recomputation (the compiled class:
    `remat.core.compiled`, ops that `tofu.runs_locally` only), or (None, None, None, lowest):
    `lowest` is the least peak recomputation reached on any of them.  A split whose every
    recomputable op recomputed still peaks over the budget (`compiled.fit`) is passed over
    without solving."""
    from remat.core import compiled

    from .planning import plan as plan_one
    seen: set = set()
    lowest = None
    for lam, sp in sorted(splits, key=lambda x: (x[1].comm, x[0])):
        key = tuple(sorted((op, tuple(s.index for s in st)) for op, st in sp.strategy.items()))
        if key in seen:
            continue
        seen.add(key)
        dg = tofu.device_graph(g, sp, optimizer_factor)
        R, low = compiled.fit(dg, compiled.normal(dg, compiled.recomputable(dg)), budget)
        lowest = low if lowest is None else min(lowest, low)
        if R is None:
            continue
        try:
            return sp, plan_one(dg, budget, swap=False, time_limit=time_limit, executor="compiled"), lam, lowest
        except InfeasibleBudgetError:
            continue
    return None, None, None, lowest


def partition(graph: Any, devices: int, budget: "int | str | None" = None, *, example_inputs: Any = None,
              loss_fn: Any = None, optimizer_factor: float = 0.0, max_states: int = 4096, recompute: bool = True,
              baselines_too: bool = True, time_limit: float = 30.0, device_type: str = "cpu",
              prove: bool = False) -> PartitionPlan:
    """The partition of `graph` over `devices` (a power of 2) with the least communication whose
    per-device peak fits `budget` (bytes or ``"20GiB"``; None: no budget) (module docstring).
    `graph`: an `OpGraph`, or a model captured first with `example_inputs` and `loss_fn`
    (`frontends.partitioning.op_graph`).  `device_type`: where the plan runs (``"cpu"``: gloo,
    whose missing all-to-all DTensor replaces by an all-gather; ``"cuda"``: NCCL).  `prove`: solve
    each level's cut again as an integer program (`certify`, CBC within `time_limit` a level) and
    record in ``search["certificates"]`` whether the dynamic program's cut is optimal."""
    if not isinstance(graph, tofu.OpGraph):
        if example_inputs is None:
            raise InvalidInputError("remat.partition: give an OpGraph, or a model with example_inputs=")
        from remat.frontends.partitioning import op_graph   # (imports torch)
        graph = op_graph(graph, example_inputs, loss_fn)
    if isinstance(budget, str):
        from .budget import parse_memory
        budget = parse_memory(budget)
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise InvalidInputError(f"devices: expected a whole number, got {devices!r}")
    tofu.levels_of(devices)
    graph.meta["device_type"] = device_type     # (the costs: `tofu.conversion`)
    options = {"max_states": max_states, "optimizer_factor": optimizer_factor}
    best = tofu.split(graph, devices, 0.0, **options)
    peak = _peak(graph, best, optimizer_factor)
    probes = [(0.0, best.comm, peak)]
    splits = [(0.0, best)]
    chosen, lam = (best, 0.0) if budget is None or peak <= budget else (None, None)
    least = (peak, best, 0.0)
    if chosen is None:
        lo, hi = 0.0, None
        probe = 1e-3
        while probe <= LAMBDA_MAX:                    # the first weight that fits
            sp = tofu.split(graph, devices, probe, **options)
            pk = _peak(graph, sp, optimizer_factor)
            probes.append((probe, sp.comm, pk))
            splits.append((probe, sp))
            least = min(least, (pk, sp, probe), key=lambda x: x[0])
            if pk <= budget:
                chosen, lam, hi = sp, probe, probe
                break
            lo = probe
            probe *= 10
        if hi is not None:
            for _ in range(LAMBDA_STEPS):             # then the least weight that still fits
                mid = math.sqrt(max(lo, hi * 1e-3) * hi)
                if mid >= hi * 0.99:
                    break
                sp = tofu.split(graph, devices, mid, **options)
                pk = _peak(graph, sp, optimizer_factor)
                probes.append((mid, sp.comm, pk))
                if pk <= budget:
                    hi = mid
                    if sp.comm < chosen.comm:
                        chosen, lam = sp, mid
                else:
                    lo = mid
    search = {"lambda": lam, "probes": [[round(a, 6), c, p] for a, c, p in probes],
              "method": "Tofu's recursive 2-way cuts, a dynamic program per cut; memory by a Lagrangian weight "
                        "(not a proof)"}
    planned = None
    if chosen is None:
        pk, sp, lam = least
        lowest = None
        if recompute:
            chosen, planned, lam, lowest = _recomputing(graph, splits, int(budget), optimizer_factor, time_limit)
            search["lambda"] = lam
        if chosen is None:
            low = min(pk, lowest) if lowest is not None else pk
            raise InfeasibleBudgetError(
                f"no partition over {devices} devices fits {format_bytes(budget)} per device: the smallest "
                f"per-device peak found is {format_bytes(pk)} without recomputation"
                + (f", {format_bytes(lowest)} recomputing what runs on each device's own parts" if lowest is not None
                   else "") + "; use more devices or a larger budget", int(budget), min_feasible_bytes=int(low))
    if prove:
        search["certificates"] = certify(graph, chosen, search["lambda"] or 0.0, optimizer_factor, time_limit)
    out = _record(graph, chosen, budget, optimizer_factor, search, planned, device_type)
    if baselines_too:
        out.baselines = {name: _baseline_row(graph, devices, name, optimizer_factor, max_states, device_type)
                         for name in BASELINES}
    return out


def certify(g: tofu.OpGraph, sp: tofu.Split, lam: float, optimizer_factor: float = 0.0,
            time_limit: float = 30.0) -> list:
    """Per level of `sp`, its cut solved again as an integer program from the dynamic program's
    cut (`tofu_ilp.cut_ilp`) at that level's shapes and `lam`: {"level", "objective" (the dynamic
    program's: bytes communicated + lam x bytes per device), "best" (the integer program's, never
    worse), "bound", "proven", "gap" (of the dynamic program's cut against the bound), "seconds"}.
    What is proved is each cut given the levels above it: Tofu's recursion is itself a restriction."""
    from remat.solvers import tofu_ilp
    shapes = {t: tuple(info.shape) for t, info in g.tensors.items()}
    out = []
    for level, c in enumerate(sp.levels):
        cert = tofu_ilp.cut_ilp(g, shapes, lam, optimizer_factor=optimizer_factor, warm=c, time_limit=time_limit)
        dp = tofu_ilp.objective(c, lam)
        gap = 0.0 if cert.proven and cert.objective >= dp - 1e-9 * max(1.0, dp) else (
            None if cert.bound is None or dp <= 0 else max(0.0, (dp - cert.bound) / dp))
        out.append({"level": level, "objective": dp, "best": cert.objective, "bound": cert.bound,
                    "proven": cert.proven, "gap": gap, "seconds": round(cert.seconds, 3)})
        shapes = {t: tofu.halved(shapes[t], c.placement[t]) for t in shapes}
    return out


# ---- baselines ----------------------------------------------------------------------------------
def _baseline_row(g: tofu.OpGraph, devices: int, name: str, optimizer_factor: float, max_states: int,
                  device_type: str) -> dict:
    try:
        p = baseline(g, devices, name, optimizer_factor=optimizer_factor, max_states=max_states,
                     device_type=device_type)
    except InvalidInputError as e:
        return {"error": str(e)}
    return {"comm_bytes": p.comm_bytes, "peak_bytes": p.peak_bytes}


def baseline(g: tofu.OpGraph, devices: int, name: str, *, optimizer_factor: float = 0.0,
             max_states: int = 4096, device_type: str = "cpu") -> PartitionPlan:
    """One baseline (module docstring) in the search's cost model, as a `PartitionPlan`."""
    if name == "layers":
        return layer_placement(g, devices, optimizer_factor, balance="memory")
    if name not in BASELINES:
        raise InvalidInputError(f"baseline: unknown {name!r}; expected one of {', '.join(BASELINES)}")
    g.meta["device_type"] = device_type
    where = tofu.roles(g)
    allowed: dict = {}
    for t, info in g.tensors.items():
        if info.kind == "input":
            allowed[t] = [REPLICATE] if name == "megatron" else [Shard(where[t].get("batch", 0)), REPLICATE]
        elif info.kind == "parameter" and name == "data-parallel":
            allowed[t] = [REPLICATE]
        elif info.kind == "parameter" and name == "fsdp":
            allowed[t] = [Shard(0)]

    def only(op, s):
        letters = tofu.role_letters(g, op, where)
        if name == "megatron":
            return s.index not in letters.values()
        return s.index == letters.get("batch")
    sp = tofu.split(g, devices, 0.0, allowed=allowed, only=only, max_states=max_states,
                    optimizer_factor=optimizer_factor)
    return _record(g, sp, None, optimizer_factor, {"baseline": name}, device_type=device_type)


def layer_placement(g: tofu.OpGraph, devices: int, optimizer_factor: float = 0.0, microbatches: int = 1,
                    schedule: str = "gpipe", balance: str = "time", budget: "int | str | None" = None) -> PartitionPlan:
    """Contiguous runs of modules, one a device (`remat.solvers.pipeline`: stages begin at module
    boundaries, the heaviest stage by `balance` (``"memory"`` or ``"time"``) as light as it can
    be), run over `microbatches` micro-batches with `schedule` (``"gpipe"`` or ``"1f1b"``, as
    `torch.distributed.pipelining` runs them: `remat.pipelining`).  Per device: its stage's
    predicted peak (the simulator on one micro-batch's step of the stage, times the micro-batches
    in flight), its fixed bytes; communication: every tensor a later stage reads sent there and
    its gradient back, tied parameters' gradients all-reduced over their stages; time: the
    slowest stage's micro-batch times ``m + k - 1`` (fill and drain).

    With a `budget` (bytes or ``"20GiB"``, per device): stages balanced by time whose heaviest
    peak is over it are balanced by memory instead (the plan's search says so); when that is
    over too, `InfeasibleBudgetError` names the smallest peak found."""
    from remat.solvers import pipeline as pl
    if schedule not in pl.SCHEDULES:
        raise InvalidInputError(f"schedule: expected one of {', '.join(pl.SCHEDULES)}, got {schedule!r}")
    if schedule == "1f1b" and microbatches < devices:
        raise InvalidInputError(f"microbatches: 1F1B runs at least one micro-batch a stage ({devices}), got "
                                f"{microbatches}; use --microbatches {devices} or more, or --schedule gpipe")
    from .budget import parse_memory
    budget_bytes = None if budget is None else parse_memory(budget)
    plan = _layers(g, devices, optimizer_factor, microbatches, schedule, balance)
    if budget_bytes is not None and plan.peak_bytes > budget_bytes and balance == "time":
        by_memory = _layers(g, devices, optimizer_factor, microbatches, schedule, "memory")
        if by_memory.peak_bytes <= budget_bytes or by_memory.peak_bytes < plan.peak_bytes:
            by_memory.search["pipeline"]["note"] = (f"stages balanced by time peak at {format_bytes(plan.peak_bytes)}, "
                                                    "over the budget: balanced by memory instead")
            plan = by_memory
    if budget_bytes is not None and plan.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(f"pipeline: the heaviest stage peaks at {format_bytes(plan.peak_bytes)}, over the "
                                    f"budget of {format_bytes(budget_bytes)}; try more micro-batches, the 1F1B "
                                    "schedule, more devices, or the split search (without --pipeline)",
                                    budget_bytes, plan.peak_bytes, None, plan.fixed_bytes)
    plan.budget_bytes = budget_bytes
    return plan


def _layers(g: tofu.OpGraph, devices: int, optimizer_factor: float, microbatches: int, schedule: str,
            balance: str) -> PartitionPlan:
    from remat.solvers import pipeline as pl
    cuts = pl.choose_cuts(g, devices, optimizer_factor, balance)
    costs = pl.stage_costs(g, cuts, microbatches, schedule, optimizer_factor)
    comm = pl.comm_bytes(g, cuts)
    stage = pl.stage_of(g, cuts)
    made = {t: stage[op.id] for op in g.ops for t in op.outputs}
    first_reader: dict = {}
    for op in g.ops:
        for t in op.inputs:
            first_reader.setdefault(t, stage[op.id])
    tensors = [{"name": t.name, "shape": list(t.shape), "kind": t.kind,
                "placements": [f"device {made.get(t.id, first_reader.get(t.id, 0))}"]} for t in g.tensors.values()]
    ops = [{"id": o.id, "op": o.op, "module": o.module, "spec": tofu.rule(g, o).spec,
            "strategy": [f"device {stage[o.id]}"]} for o in g.ops]
    spec = {"split_points": [c.module for c in costs[1:]], "microbatches": microbatches, "schedule": schedule,
            "balance": balance,
            "bubble": pl.bubble(devices, microbatches),
            "stages": [{"stage": c.stage, "first_op": c.first_op, "module": c.module, "inflight": c.inflight,
                        "fixed_bytes": c.fixed_bytes, "held_bytes": c.held_bytes, "peak_bytes": c.peak_bytes,
                        "microbatch_time": c.microbatch_time} for c in costs]}
    return PartitionPlan(g.meta.get("model", "model"), devices, None, comm, max(c.peak_bytes for c in costs),
                         max(c.fixed_bytes for c in costs), pl.step_time(costs, microbatches), tensors, ops,
                         {"baseline": "layers", "pipeline": spec,
                          "note": f"stages begin at modules; {microbatches} micro-batch"
                                  f"{'es' if microbatches > 1 else ''}, {schedule}: a stage idles "
                                  f"{100 * spec['bubble']:.0f} % of the step (fill and drain)"})


def report(p: PartitionPlan) -> list:
    """Lines for the CLI: the chosen split per block, per-device memory and communication, and
    the baselines beside it."""
    lines = [f"{p.model}: {p.devices} devices, per device peak {format_bytes(p.peak_bytes)} "
             f"(fixed {format_bytes(p.fixed_bytes)}), communicated {format_bytes(p.comm_per_device)} per device "
             f"per step ({format_bytes(p.comm_bytes)} in all)"
             + (f", budget {format_bytes(p.budget_bytes)}" if p.budget_bytes else "")]
    pipe = p.search.get("pipeline")
    if pipe:
        lines.append(f"  pipeline: {p.devices} stages balanced by {pipe.get('balance', 'memory')}, "
                     f"{pipe['microbatches']} micro-batches, {pipe['schedule']} (a stage idles "
                     f"{100 * pipe['bubble']:.0f} % of the step in fill and drain; step {p.compute_time * 1e3:.4g} ms in "
                     "the FLOP model)" + (f"; {pipe['note']}" if pipe.get("note") else ""))
        for st in pipe["stages"]:
            lines.append(f"  stage {st['stage']}: from " + (f"module {st['module']!r}" if st["module"] else "the start")
                         + f" (op {st['first_op']}), peak "
                         f"{format_bytes(st['peak_bytes'])} ({st['inflight']} micro-batch"
                         f"{'es' if st['inflight'] > 1 else ''} in flight, {format_bytes(st['held_bytes'])} each)")
    rec = p.search.get("recompute")
    if rec:
        lines.append(f"  per device the planner recomputes {len(rec.get('ops', []))} ops in the backward (each from "
                     f"its devices' own parts, no communication): predicted step {rec['overhead']:.2f}x ({rec['solver']})")
    if p.search.get("undescribed_ops"):
        lines.append(f"  ops run whole on every device (no description): {', '.join(p.search['undescribed_ops'])}")
    if not p.search.get("exact", True):
        lines.append("  (the search kept only the cheapest states at some op: not exact)")
    for c in p.search.get("certificates", []):
        head = f"  level {c['level']}: the dynamic program's cut "
        if c["gap"] == 0.0:
            lines.append(head + f"is optimal (proven by an integer program, CBC, {c['seconds']:.1f} s)")
        elif c["best"] < c["objective"]:
            lines.append(head + f"costs {100 * (c['objective'] / c['best'] - 1):.1f} % more than the integer "
                         f"program's ({'optimal' if c['proven'] else 'its best'}): the search was not exact there")
        else:
            lines.append(head + ("is within " + f"{100 * c['gap']:.1f} % of optimal" if c["gap"] is not None
                                 else "is not proven optimal (no bound)") + f" (CBC, {c['seconds']:.1f} s)")
    for prefix, heavy in p.blocks():
        if heavy:
            lines.append(f"  {prefix}: " + ", ".join(f"{op} {'/'.join(sorted(set(v)))}" for op, v in heavy.items()))
    if p.baselines:
        lines.append("  baselines (same cost model): " + "; ".join(
            f"{n} " + (f"peak {format_bytes(r['peak_bytes'])}, comm {format_bytes(r['comm_bytes'] // p.devices)}/device"
                       if "error" not in r else f"n/a ({r['error'][:60]})") for n, r in p.baselines.items()))
    return lines

