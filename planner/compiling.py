"""``remat.compiler``: the ``torch.compile`` backend of `remat.frontends.compiled` (what it does
and its limits are there): plans each region's joint graph with `remat.plan(...,
executor="compiled")` and hands the plan to AOTAutograd's partitioner as its tags."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.graph import Graph
from remat.core.units import format_bytes_exact
from remat.frontends.compiled import BACKENDS, OpTimes, Program, joint_graph, program, region_device, tag
from remat.frontends.profile import FlopsModel

from .budget import parse_budget
from .planning import plan as make_plan

log = logging.getLogger("remat.compiled")


TRIES = 4   # plans per region until the partitioner's graphs fit the budget


@dataclass
class Region:
    """One compiled region: its graph, the plan, the recomputed fx ops, the replay of the graphs
    the partitioner built from the plan (`program`: the prediction), the tries that led there."""
    graph: Graph
    plan: Any
    recomputed_ops: list
    program: Program
    budget_bytes: int
    tries: list
    note: str = ""

    @property
    def predicted(self) -> dict:
        """Peak bytes and time of what runs, and the time over the region with nothing recomputed."""
        base = self.graph.total_time
        return {"peak_bytes": self.program.peak_bytes, "time": self.program.time,
                "overhead": self.program.time / base if base > 0 else 1.0,
                "planned_peak_bytes": self.plan.predicted["peak_bytes"]}


class RematCompiler:
    """A ``torch.compile`` backend that plans each region's joint graph (module docstring).

    ``torch.compile(model, backend=remat.compiler("6GiB"))``; ``.regions`` holds each region's
    `Region` after its first compile, ``.report()`` a line per region."""

    def __init__(self, budget: "str | int", backend: str = "inductor", solver: str = "ilp", time_limit: float = 30.0,
                 profile: str = "measure", flops_model: FlopsModel | None = None, **options: Any):
        if backend not in BACKENDS:
            raise InvalidInputError(f"remat.compiler: backend must be one of {BACKENDS}, got {backend!r}")
        if options.get("swap"):
            raise NotImplementedError("remat.compiler: swap (activation offloading) plans are not implemented for "
                                      "compiled regions yet; plan with swap=False or use remat.apply")
        options.pop("swap", None)
        if not (isinstance(budget, str) and budget.strip().lower().endswith("x")):
            parse_budget(budget)   # (a bad budget fails here, not inside the compile)
        self.budget, self.backend, self.solver, self.time_limit = budget, backend, solver, time_limit
        if profile not in ("measure", "flops"):
            raise InvalidInputError(f"remat.compiler: profile must be 'measure' or 'flops', got {profile!r}")
        self.profile, self.flops_model, self.options = profile, flops_model, options
        self.regions: list[Region] = []

    # -- the partitioner -----------------------------------------------------------------
    def partition(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        """Plan the region's joint graph, tag it, and let PyTorch's min-cut partitioner cut it;
        replay the graphs it built (`program`) and, where they are over the budget, plan again at
        the budget less the excess (up to `TRIES` times).  The region's prediction is the replay
        of what the partitioner built."""
        import torch._functorch.config as functorch_config
        from torch._functorch.compile_utils import fx_graph_cse
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        num_fwd = kwargs["num_fwd_outputs"]
        kwargs.pop("compiler", None)
        gm.graph.eliminate_dead_code()
        if functorch_config.cse:   # (the partitioner's own first pass: plan the graph it partitions)
            gm.graph = fx_graph_cse(gm.graph)
        gm.recompile()
        times = OpTimes(region_device(gm), measure=self.profile == "measure", flops_model=self.flops_model)
        jg = joint_graph(gm, num_fwd, name=f"region{len(self.regions)}", times=times)
        budget = parse_budget(self.budget, jg.graph)
        target, tries, best = budget, [], None
        for _ in range(TRIES):
            try:
                p = make_plan(jg.graph, target, self.solver, swap=False, time_limit=self.time_limit,
                              executor="compiled", **self.options)
            except InfeasibleBudgetError:
                if not tries:
                    raise
                break
            names = set(p.predicted.get("recomputed", []))
            recompute = {v.id for v in jg.graph.nodes if v.name in names}
            tag(jg, recompute)
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)
            prog = program(fw, bw, num_fwd, times)
            tries.append({"budget_bytes": target, "planned_peak_bytes": p.predicted["peak_bytes"],
                          "peak_bytes": prog.peak_bytes})
            if best is None or prog.peak_bytes < best[3].peak_bytes or prog.peak_bytes <= budget:
                best = (p, recompute, (fw, bw), prog)
            if prog.peak_bytes <= budget:
                break
            target -= prog.peak_bytes - budget
        p, recompute, graphs, prog = best
        if prog.peak_bytes > budget:
            raise InfeasibleBudgetError(
                f"remat.compiler: no partition found within {format_bytes_exact(budget)} ({len(tries)} tries; the "
                f"closest peaks at {format_bytes_exact(prog.peak_bytes)}): raise the budget",
                budget_bytes=budget, min_feasible_bytes=prog.peak_bytes)
        note = ""
        if self.regions:
            note = ("graph break: this region is planned against the whole budget too; regions whose activations "
                    "coexist add up (compile with fullgraph=True to plan the step as one region)")
            log.warning("remat.compiler: %s", note)
        ops = [n.name for v in jg.graph.nodes if v.id in recompute for n in jg.members[v.id]]
        self.regions.append(Region(jg.graph, p, ops, prog, budget, tries, note))
        log.info("remat.compiler: region %d: %d nodes, %d ops recomputed, predicted peak %d bytes (budget %d)",
                 len(self.regions) - 1, jg.graph.n, len(ops), prog.peak_bytes, budget)
        return graphs

    # -- the backend -------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx
            # (no FX graph cache: a plan depends on the budget, which the cache key does not hold)
            return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": _partitioner(self),
                                                                  "fx_graph_cache": False})
        import torch._functorch.config as functorch_config
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        # (boxed: the backward graph drops each saved tensor after its last use, as inductor's code
        # does; an unboxed call would hold every saved tensor to the backward's end)
        if self.backend == "aot_eager":
            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=self.partition,
                                keep_inference_input_mutations=True)(gm, example_inputs)
        # aot_eager_decomp_partition: inductor's decompositions, no code generation (as PyTorch's
        # backend of that name, with remat's partition)
        from torch._inductor.compile_fx import select_decomp_table
        with functorch_config.patch(unlift_effect_tokens=True):
            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, decompositions=select_decomp_table(),
                                partition_fn=self.partition)(gm, example_inputs)

    def report(self) -> str:
        """A line per compiled region: nodes, ops recomputed, predicted peak within the budget,
        the plan's time overhead and status."""
        lines = []
        for k, r in enumerate(self.regions):
            lines.append(f"region {k}: {r.graph.n} nodes, {len(r.recomputed_ops)} ops recomputed, predicted peak "
                         f"{format_bytes_exact(r.program.peak_bytes)} within {format_bytes_exact(r.budget_bytes)}, "
                         f"overhead {r.predicted['overhead']:.3f}x, {r.plan.solver.get('status')}"
                         + (f" ({r.note})" if r.note else ""))
        return "\n".join(lines) or "no region compiled yet"


def _partitioner(owner: RematCompiler):
    """Inductor's partitioner hook (`CustomPartitionerFn`) calling ``owner.partition``."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return owner.partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None   # (plans depend on the budget and the graph: nothing to cache by)
    return Partitioner()


def compiler(budget: "str | int", backend: str = "inductor", solver: str = "ilp", **options: Any) -> RematCompiler:
    """``remat.compiler(budget, backend="inductor", solver="ilp", time_limit=30, profile="measure")``: a
    ``torch.compile`` backend whose partitioner follows remat's plan of each region's joint graph
    at `budget` (bytes, ``"6GiB"``, or ``"0.5x"`` of the region's own keep-all peak).  `backend`:
    ``"inductor"`` (code generation), ``"aot_eager"`` (the joint graph's ops as they are, run
    eagerly) or ``"aot_eager_decomp_partition"`` (inductor's decompositions, run eagerly).
    `profile`: op times measured on the device (``"measure"``, each distinct op once) or from
    FLOP and byte counts (``"flops"``)."""
    return RematCompiler(budget, backend, solver, **options)


__all__ = ["compiler", "RematCompiler", "Region"]
