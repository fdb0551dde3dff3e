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
index: a transformer's column- then row-split products), and layer placement (contiguous ops per
device, balanced by their memory; one micro-batch, so a device idles while the others run).

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
    dg = tofu.device_graph(g, sp, optimizer_factor)
    peak = planned.predicted["peak_bytes"] if planned is not None else keep_all_peak(dg)
    compute = planned.predicted["time"] if planned is not None else sum(v.time for v in dg.nodes)
    tensors = [{"name": t.name, "shape": list(t.shape), "kind": t.kind,
                "placements": [str(p) for p in sp.placement[t.id]]} for t in g.tensors.values()]
    ops = [{"id": o.id, "op": o.op, "module": o.module, "spec": tofu.rule(g, o).spec,
            "strategy": [s.index or "replicated" for s in sp.strategy[o.id]]} for o in g.ops]
    search = {**search, "exact": sp.exact, "states": max((c.states for c in sp.levels), default=0),
              "undescribed_ops": tofu.undescribed(g), "recursion_comm_bytes": sp.comm, "device_type": device_type}
    if planned is not None:
        search["recompute"] = {"overhead": planned.predicted["overhead"], "solver": planned.solver.get("status")}
    return PartitionPlan(g.meta.get("model", "model"), sp.devices, budget, tofu.mesh_comm(g, sp, device_type), int(peak), dg.fixed_bytes,
                         float(compute), tensors, ops, search)


def _peak(g: tofu.OpGraph, sp: tofu.Split, optimizer_factor: float) -> int:
    return keep_all_peak(tofu.device_graph(g, sp, optimizer_factor))


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
    chosen, lam = (best, 0.0) if budget is None or peak <= budget else (None, None)
    least = (peak, best, 0.0)
    if chosen is None:
        lo, hi = 0.0, None
        probe = 1e-3
        while probe <= LAMBDA_MAX:                    # the first weight that fits
            sp = tofu.split(graph, devices, probe, **options)
            pk = _peak(graph, sp, optimizer_factor)
            probes.append((probe, sp.comm, pk))
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
        if recompute:
            from .planning import plan as plan_one
            try:
                planned = plan_one(tofu.device_graph(graph, sp, optimizer_factor), int(budget), swap=False,
                                   time_limit=time_limit)
                chosen = sp
                search["lambda"] = lam
            except InfeasibleBudgetError:
                planned = None
        if chosen is None:
            raise InfeasibleBudgetError(
                f"no partition over {devices} devices fits {format_bytes(budget)} per device: the smallest "
                f"per-device peak found is {format_bytes(pk)} without recomputation"
                + (" (recomputation does not bring it under the budget either)" if recompute else "")
                + "; use more devices or a larger budget", int(budget), min_feasible_bytes=int(pk))
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
        return layer_placement(g, devices, optimizer_factor)
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


def layer_placement(g: tofu.OpGraph, devices: int, optimizer_factor: float = 0.0) -> PartitionPlan:
    """Contiguous runs of ops, one per device, cut where each device's memory (its parameters with
    gradients and optimizer state, and the activations it keeps for the backward) reaches 1/devices
    of the total; communication: every tensor read on a later device than the one that made it,
    sent once forward and its gradient once back."""
    factor = 2 + optimizer_factor
    weight = []
    seen: set = set()
    for op in g.ops:
        w = 0
        for t in op.inputs:
            info = g.tensors[t]
            if info.kind == "parameter" and t not in seen:
                seen.add(t)
                w += info.bytes * (factor if info.grad else 1)
        if op.op not in tofu.VIEWS:
            w += sum(g.tensors[t].bytes for t in op.outputs)
        weight.append(w)
    total = sum(weight)
    device_of, acc, d = {}, 0, 0
    loads = [0] * devices
    for op, w in zip(g.ops, weight):
        if acc + w / 2 > total * (d + 1) / devices and d < devices - 1:
            d += 1
        device_of[op.id] = d
        loads[d] += w
        acc += w
    made = {t: device_of[op.id] for op in g.ops for t in op.outputs}
    comm = 0
    for op in g.ops:
        for t in set(op.inputs):
            src = made.get(t)
            if src is not None and src != device_of[op.id]:
                info = g.tensors[t]
                comm += info.bytes * (2 if info.grad else 1)
    fixed = [0] * devices
    first_reader = {}
    for op in g.ops:
        for t in op.inputs:
            first_reader.setdefault(t, device_of[op.id])
    for t, info in g.tensors.items():
        if info.kind in ("parameter", "input") and t in first_reader:
            fixed[first_reader[t]] += info.bytes * (factor - 1 if info.kind == "parameter" and info.grad else 1)
    peak = max(loads)
    tensors = [{"name": t.name, "shape": list(t.shape), "kind": t.kind,
                "placements": [f"device {made.get(t.id, first_reader.get(t.id, 0))}"]} for t in g.tensors.values()]
    ops = [{"id": o.id, "op": o.op, "module": o.module, "spec": tofu.rule(g, o).spec,
            "strategy": [f"device {device_of[o.id]}"]} for o in g.ops]
    return PartitionPlan(g.meta.get("model", "model"), devices, None, comm, int(peak), int(max(fixed)), 0.0, tensors,
                         ops, {"baseline": "layers", "loads": loads,
                               "note": "keep-everything memory per device (parameters, gradients, optimizer "
                                       "state, activations); one micro-batch"})


def report(p: PartitionPlan) -> list:
    """Lines for the CLI: the chosen split per block, per-device memory and communication, and
    the baselines beside it."""
    lines = [f"{p.model}: {p.devices} devices, per device peak {format_bytes(p.peak_bytes)} "
             f"(fixed {format_bytes(p.fixed_bytes)}), communicated {format_bytes(p.comm_per_device)} per device "
             f"per step ({format_bytes(p.comm_bytes)} in all)"
             + (f", budget {format_bytes(p.budget_bytes)}" if p.budget_bytes else "")]
    rec = p.search.get("recompute")
    if rec:
        lines.append(f"  per device the planner recomputes: predicted step {rec['overhead']:.2f}x ({rec['solver']})")
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

