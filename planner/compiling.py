"""``remat.compiler``: the ``torch.compile`` backend of `remat.frontends.compiled` (what it does
and its limits are there): plans each region's joint graph with `remat.plan(...,
executor="compiled")` and hands the plan to AOTAutograd's partitioner as its tags.

Graph breaks.  A step torch.compile splits into regions runs them one after another: while
region k runs, the regions before it whose backward has not run yet hold what they saved for it,
their parameters and the outputs they returned (region k's inputs among them).  Region k is
compiled just before its first run, so those regions are known then: region k is planned within
its share of the budget, the budget less what they hold (`held`: the storages of their inputs
and outputs still alive, less region k's own inputs, plus what their programs save).  Which
regions are active is followed at run time: a region is active from its forward to its backward
(a pre-hook on its outputs' ``grad_fn``), and one that runs again while active starts a new step.  A
relative budget (``"0.6x"``) is resolved against the keep-all peak of the region that starts the
step (with nothing held: the program of its compiled class that recomputes nothing) and shared
in bytes by the regions after it.  A later region's parameters, buffers and batch tensors are
resident through the earlier regions too, and its parameters' gradients, made in its backward,
through theirs: the earlier plans were made first, so these bytes are added to the earlier
regions' peaks when the later region is compiled (`Region.step_peak`), and a step they take
over the budget fails there, naming the reserve that makes the first region leave room.
`RematCompiler.report` names each region's share and the step's predicted peak
(`RematCompiler.step_peak_bytes`).

Inductor's code.  With inductor the region's prediction (`Region.program`) is read off the code
inductor generated from the partitioner's graphs (`RematCompiler.code_program`,
`remat.frontends.inductor_code`), which holds what the graphs do not say (its fusions across
layers, its reordering; per graph the larger of its reading and the replay's); the replay of the
graphs stays as `Region.replay`.  Where that is over the region's budget, the region is planned
again under the budget by the excess (and by at least what the code held over the plan's
replay) and compiled again; where a compile fits after one that did not but leaves more than
`SLACK` of the budget unused, once more between the two; the fastest compile that fits is kept
(`CODE_TRIES` compiles at most; none fitting: `InfeasibleBudgetError`).

Code outside the regions.  A region whose results (wanting a gradient, not a scalar) no later
region takes is read by the caller's own code, a loss computed eagerly on the logits, say, whose
bytes no plan holds: found when the region's backward starts, said once (a warning, and a line
of `RematCompiler.report`; `read_outside` holds those regions).  The region's results are planned
alive to the step's end (the caller's ``out``) unless ``keep_outputs=False`` says the caller drops
them once its loss is computed; results still alive at the backward's start then are said once
(`outputs_kept`).
"""
from __future__ import annotations

import logging
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from remat.core.compiled import program as compiled_program
from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.graph import Graph
from remat.core.units import format_bytes_exact
from remat.frontends.compiled import (BACKENDS, OpTimes, Program, aten_op, inductor_channels_last, joint_graph,
                                     knapsack_sets, layout_copies, program, region_device, tag)
from remat.frontends.inductor_code import UnreadableCode, step_bytes
from remat.frontends.measuring import storage_key
from remat.frontends.profile import FlopsModel
from remat import solvers

from .budget import parse_budget
from .planning import plan as make_plan

log = logging.getLogger("remat.compiled")


TRIES = 4   # plans per region until the partitioner's graphs fit the budget
CODE_TRIES = 3   # inductor compiles per region, searching for the fastest whose generated code fits the budget
SLACK = 0.01     # the part of the budget a fitting compile may leave unused before a compile nearer the budget is tried
# activation_memory_budget values whose sets (what PyTorch's partitioner recomputes: at 1, its
# default min cut; below, its knapsack) the plan's search also fits from (`knapsack_sets`)
KNAPSACK = (1.0, 0.9, 0.7, 0.5, 0.3)


@dataclass
class Region:
    """One compiled region: its graph, the plan, the recomputed fx ops, the replay of the graphs
    the partitioner built from the plan (`program`: the prediction), the tries that led there."""
    graph: Graph
    plan: Any
    recomputed_ops: list
    program: Program
    budget_bytes: int     # its share: the step's budget less `held_bytes`
    tries: list
    note: str = ""
    held_bytes: int = 0   # what the regions before it hold while it runs (module docstring)
    before: tuple = ()    # those regions
    # its parameters, buffers and batch tensors that no region before it takes (resident through
    # those regions), and those parameters' gradients (alive through their backward): `leaves`
    leaf_bytes: int = 0
    leaf_grad_bytes: int = 0
    # with inductor: the replay of the partitioner's graphs, where `program` is read off the code
    # inductor generated from them (`RematCompiler.code_program`)
    replay: Program | None = None
    # with inductor: each compile of the region, in order (`RematCompiler._inductor`): the cut
    # (bytes its plan was made under the budget), its code's peak, its replay's peak, its time
    compiles: list = field(default_factory=list)

    def step_peak(self, later: list) -> int:
        """Its peak within the step, given the `later` regions that run while it is active: what
        the regions before it hold, plus its forward's peak with the later regions' leaves, or its
        backward's with their gradients too."""
        pr = self.program
        resident = sum(r.leaf_bytes for r in later)
        grads = sum(r.leaf_grad_bytes for r in later)
        return self.held_bytes + max(pr.forward_peak_bytes + resident, pr.backward_peak_bytes + resident + grads)

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
                 profile: str = "measure", flops_model: FlopsModel | None = None, reserve: "str | int" = 0,
                 knapsack: tuple = KNAPSACK, fused: bool | None = None, buffers: bool = False,
                 keep_outputs: bool = True, **options: Any):
        if backend not in BACKENDS:
            raise InvalidInputError(f"remat.compiler: backend must be one of {BACKENDS}, got {backend!r}")
        if options.get("swap"):
            raise NotImplementedError("remat.compiler: swap (activation offloading) plans are not implemented for "
                                      "compiled regions yet; plan with swap=False or use remat.apply")
        options.pop("swap", None)
        self.budget, self.backend, self.solver, self.time_limit = budget, backend, solver, time_limit
        self._absolute_budget()   # (a bad budget fails here, not inside the compile)
        if profile not in ("measure", "flops"):
            raise InvalidInputError(f"remat.compiler: profile must be 'measure' or 'flops', got {profile!r}")
        self.profile, self.flops_model, self.options = profile, flops_model, options
        self.reserve = parse_budget(reserve) if reserve else 0
        if any(not 0 <= b <= 1 for b in knapsack):
            raise InvalidInputError(f"remat.compiler: knapsack budgets must be in [0, 1], got {knapsack!r}")
        self.knapsack = tuple(knapsack)
        self.fused = backend == "inductor" if fused is None else bool(fused)
        if buffers and backend != "inductor":
            raise InvalidInputError(f"remat.compiler: buffers models inductor's buffer rewrites; backend is {backend!r}")
        self.buffers = bool(buffers)
        solvers.load_all()   # (not during the first call: `remat.solvers.load_all`)
        self.keep_outputs = bool(keep_outputs)
        self.regions: list[Region] = []
        self.step_budget: int | None = None   # bytes, once a relative budget is resolved
        self._active: list[int] = []          # regions between their forward and their backward
        self._touched: dict[int, tuple] = {}  # region -> (its inputs' storages, weak references to its outputs)
        self._ran_order: list[int] = []       # the step's regions in the order their forwards ran
        self._results: dict[int, set] = {}    # region -> storages of its results that want a gradient, not scalars
        self.read_outside: set[int] = set()   # regions whose results code outside the regions read (`_ran`)
        # regions whose results were still alive at their backward's start where the plan
        # (``keep_outputs=False``) had them dropped: region -> bytes (`_kept`)
        self.outputs_kept: dict[int, int] = {}
        self._held, self._held_from, self._passed = 0, [], 0   # for the region being compiled (`held`)
        self._leaves = (0, 0)   # its new resident bytes and gradient bytes (`leaves`)
        self._cut = 0           # bytes the region being compiled is planned under its budget (`_inductor`)
        self._graphs: tuple = ()   # the last partition's forward and backward graphs, outputs, op times

    # -- graph breaks: what the regions before a region hold ---------------------------------------
    def held(self, inputs: list) -> tuple[int, list[int], int]:
        """Bytes the active regions hold while a region with real `inputs` runs (module docstring),
        those regions, and the bytes of `inputs` they returned (in their peaks and in its own)."""
        own = {storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        alive: dict[int, int] = {}
        returned: dict[int, int] = {}
        for r in self._active:
            ins, outs = self._touched.get(r, ({}, []))
            alive.update(ins)
            for ref in outs:
                t = ref()
                if t is not None:
                    returned[storage_key(t)] = alive[storage_key(t)] = t.untyped_storage().nbytes()
        saved = sum(self.regions[r].program.saved_bytes for r in self._active)
        return (sum(b for k, b in alive.items() if k not in own) + saved, list(self._active),
                sum(b for k, b in returned.items() if k in own))

    def leaves(self, inputs: list) -> tuple[int, int]:
        """Bytes of the leaf tensors among a region's real `inputs` (parameters, buffers, the batch:
        resident through the step) that no active region takes as input, with the gradients they
        hold already, and of the gradients of those that require one and hold none (made in its
        backward, which runs before the earlier regions')."""
        seen = {k for r in self._active for k in self._touched.get(r, ({}, []))[0]}
        resident = grads = 0
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.is_leaf and storage_key(t) not in seen:
                seen.add(storage_key(t))
                nbytes = t.untyped_storage().nbytes()
                resident += nbytes
                if t.grad is not None:   # (a loop that keeps its gradients between steps)
                    resident += t.grad.untyped_storage().nbytes()
                elif t.requires_grad:
                    grads += nbytes
        return resident, grads

    def _absolute_budget(self) -> int | None:
        """The budget in bytes when it is not relative to a region's keep-all peak."""
        if isinstance(self.budget, str) and self.budget.strip().lower().endswith("x"):
            return None
        return parse_budget(self.budget)

    def _later(self, j: int, new: "Region | None" = None) -> list:
        """The regions compiled after region j that ran while it was active (and `new`, one being
        compiled)."""
        return [r for r in self.regions[j + 1:] + ([new] if new is not None else []) if j in r.before]

    def region_peak(self, j: int, new: "Region | None" = None) -> int:
        """Region j's peak within the step (`Region.step_peak`) with the regions `_later` than it."""
        return self.regions[j].step_peak(self._later(j, new))

    @property
    def step_peak_bytes(self) -> int:
        """The step's predicted peak: the largest `region_peak` (0 before a compile)."""
        return max((self.region_peak(j) for j in range(len(self.regions))), default=0)

    def _check_earlier(self, before: list, step_budget: int) -> None:
        """A region after a graph break brings parameters (resident from the step's start) and
        their gradients (alive through the earlier regions' backward), which the earlier regions'
        plans, made first, did not count (`region_peak` adds them): a step that no longer fits its
        budget fails here, naming the reserve that makes the first region leave room for them."""
        resident, grads = self._leaves
        if not (resident or grads):
            return
        new = Region(None, None, [], None, 0, [], before=tuple(before), leaf_bytes=resident, leaf_grad_bytes=grads)
        over = [(p, j) for j in before if (p := self.region_peak(j, new)) > step_budget]
        if over:
            peak, j = max(over)
            # (a reserve r keeps the first region's own peak within the budget less r, so its peak
            # within the step within the budget less r plus the later regions' leaves and gradients)
            need = max(self.reserve + peak - step_budget,
                       sum(r.leaf_bytes + r.leaf_grad_bytes for r in self._later(before[0], new)))
            fix = (f"pass reserve={need} to remat.compiler (the region that starts the step then leaves that much "
                   "free), " if j == before[0] and len(over) == 1 else "")
            raise InfeasibleBudgetError(
                f"remat.compiler: region {len(self.regions)} (after a graph break) brings "
                f"{format_bytes_exact(resident)} of parameters and inputs, resident through the regions before it, and "
                f"{format_bytes_exact(grads)} of gradients, alive through their backward; region {j}, planned "
                f"before it, then peaks at {format_bytes_exact(peak)}, over the budget "
                f"{format_bytes_exact(step_budget)}: raise the budget, {fix}or remove the graph break "
                "(fullgraph=True shows where)", budget_bytes=step_budget, min_feasible_bytes=peak)

    def _ran(self, index: int, args: Any, out: Any) -> None:
        """Region `index` ran its forward: it is active until its backward runs."""
        if not torch.is_grad_enabled():
            return
        if index in self._active:   # (it ran again before its backward: a new step)
            self._active.clear()
        if not self._active:        # (no region between its forward and its backward: a step starts)
            self._ran_order.clear()
        # (its inputs by storage: the tensors it is called with may be short-lived aliases of
        # parameters; its outputs by weak reference: held while the caller keeps them)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self._touched[index] = ({storage_key(t): t.untyped_storage().nbytes() for t in tree_flatten(args)[0]
                                 if isinstance(t, torch.Tensor)}, [weakref.ref(t) for t in outs])
        self._results[index] = {storage_key(t) for t in outs if t.requires_grad and t.dim() > 0}
        self._ran_order.append(index)
        fn = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
        if fn is None:
            return
        self._active.append(index)

        def done(*_: Any) -> None:
            self._outside(index)
            self._kept(index)
            if index in self._active:
                self._active.remove(index)
        # (a pre-hook: a hook that runs after the node would make the engine hold the region's
        # incoming gradients until the region's backward returns, to hand them to the hook,
        # where the region's program frees each at its last use: a transformers GPT-2 broken
        # before its loss measured 2.6 % over its prediction, the logits' gradient held)
        fn.register_prehook(done)

    def _outside(self, index: int) -> None:
        """Region `index`'s backward starts: where a result of it that wants a gradient and is not
        a scalar was taken by no region that ran after it, code outside the regions read it (a
        loss computed eagerly on the logits, say), and what that code allocates is not in any
        plan: said once per region (a warning, and a line of `report`)."""
        if index in self.read_outside or index not in self._ran_order:
            return
        later = self._ran_order[self._ran_order.index(index) + 1:]
        taken = {k for r in later for k in self._touched.get(r, ({}, []))[0]}
        if self._results.get(index, set()) - taken:
            self.read_outside.add(index)
            log.warning("remat.compiler: %s", self._outside_line(index))

    def _kept(self, index: int) -> None:
        """Region `index`'s backward starts: with ``keep_outputs=False`` its plan has the caller's
        references to its results gone by now; those still alive (the caller's ``out``) are bytes
        over the plan: said once per region (a warning, and a line of `report`)."""
        if self.keep_outputs or index in self.outputs_kept:
            return
        alive = {storage_key(t): t.untyped_storage().nbytes() for ref in self._touched.get(index, ({}, []))[1]
                 if (t := ref()) is not None and storage_key(t) in self._results.get(index, set())}
        if alive:
            self.outputs_kept[index] = sum(alive.values())
            log.warning("remat.compiler: %s", self._kept_line(index))

    def _kept_line(self, index: int) -> str:
        return (f"region {index}'s results ({format_bytes_exact(self.outputs_kept[index])}) are still held when its "
                "backward starts, where the plan (keep_outputs=False) had the caller drop them once its loss was "
                "computed: the step may peak that much over the plan; drop them before backward() or compile with "
                "keep_outputs=True")

    @staticmethod
    def _outside_line(index: int) -> str:
        return (f"region {index}'s results are read by code outside the compiled regions (a loss computed "
                "eagerly?): what that code allocates is not in the plan; compile it with the model, or leave room "
                "for it with reserve=")

    def _tracked(self, compiled: Any, index: int | None):
        """`compiled` (the backend's callable) calling `_ran` after each run of region `index`."""
        if index is None:
            return compiled
        boxed = getattr(compiled, "_boxed_call", False)

        def run(*args: Any):
            # (called with a list of inputs, which a boxed callee empties, or with the inputs)
            ins = list(args[0]) if len(args) == 1 and isinstance(args[0], list) else list(args)
            out = compiled(*args)
            self._ran(index, ins, out)
            return out
        run._boxed_call = boxed
        return run

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
        # (ops are timed during the step's first call: within the budget where it is known already)
        known = self.step_budget if self._held_from else self._absolute_budget()
        inductor = self.backend == "inductor"
        channels_last = inductor and inductor_channels_last(gm)
        times = OpTimes(region_device(gm), measure=self.profile == "measure", flops_model=self.flops_model,
                        limit_bytes=known, codegen=inductor, channels_last=channels_last, fused=self.fused)
        jg = joint_graph(gm, num_fwd, name=f"region{len(self.regions)}", times=times,
                         copies=layout_copies(gm, channels_last), buffers=self.buffers,
                         keep_outputs=self.keep_outputs)
        held, before = self._held, self._held_from
        if not before or self.step_budget is None:   # (a region that starts the step)
            # ("1x": the compiled step that saves every forward value the backward reads)
            self.step_budget = parse_budget(self.budget, jg.graph, base=compiled_program(jg.graph, set())[1].peak_bytes)
        step_budget = self.step_budget
        self._check_earlier(before, step_budget)
        # (the region that starts the step leaves `reserve` free for the regions after a graph
        # break: what it holds while they run is at most its own peak)
        budget = step_budget - held if before else step_budget - self.reserve
        if before and budget <= jg.graph.fixed_bytes:
            raise InfeasibleBudgetError(
                f"remat.compiler: region {len(self.regions)} (after a graph break) starts with "
                f"{format_bytes_exact(held)} of the budget {format_bytes_exact(step_budget)} held by region(s) "
                f"{', '.join(map(str, before))} before it, and its own parameters and inputs take "
                f"{format_bytes_exact(jg.graph.fixed_bytes)} more: raise the budget, or remove the graph break "
                "(fullgraph=True shows where)", budget_bytes=step_budget, min_feasible_bytes=held + jg.graph.fixed_bytes)
        # (`_cut`: what inductor's code held over the last compile's budget, `_inductor`)
        limit = budget - self._cut
        target, tries, best, joint = limit, [], None, gm.graph
        names = [v.name for v in jg.graph.nodes]
        made_here = jg.made_here if self.buffers else None
        starts = [[names[v] for v in sorted(R)] for R in knapsack_sets(gm, joint_inputs, jg, self.knapsack, **kwargs)]
        for _ in range(TRIES):
            try:
                p = make_plan(jg.graph, target, self.solver, swap=False, time_limit=self.time_limit,
                              executor="compiled", starts=starts, **self.options)
            except InfeasibleBudgetError as e:
                floor = e.min_feasible_bytes or 0
                if not tries and target < floor <= budget:
                    # (under a cut, below the lowest plan there is: that plan, whose code decides)
                    target = floor
                    continue
                if not tries:
                    if held:
                        # (a reserve r keeps the first region's peak, which holds what this region
                        # is handed, within the budget less r)
                        need = max(0, (e.min_feasible_bytes or 0) - self._passed)
                        raise InfeasibleBudgetError(
                            f"remat.compiler: region {len(self.regions)} (after a graph break) has "
                            f"{format_bytes_exact(budget)} of the budget {format_bytes_exact(step_budget)}: region(s) "
                            f"{', '.join(map(str, before))} before it hold {format_bytes_exact(held)} while it runs; "
                            f"it needs at least {format_bytes_exact(e.min_feasible_bytes or 0)} of its own, so the step "
                            f"needs {format_bytes_exact(held + (e.min_feasible_bytes or 0))}: raise the budget, pass "
                            f"reserve={need} to remat.compiler (the region that starts the step "
                            "then leaves that much free), or remove the graph break (fullgraph=True shows where)",
                            budget_bytes=step_budget, min_feasible_bytes=held + (e.min_feasible_bytes or 0)) from None
                    if self.reserve:
                        raise InfeasibleBudgetError(
                            f"remat.compiler: with reserve={self.reserve} the region that starts the step has "
                            f"{format_bytes_exact(budget)} of the budget {format_bytes_exact(step_budget)}, and it needs "
                            f"at least {format_bytes_exact(e.min_feasible_bytes or 0)}: raise the budget, or remove the "
                            "graph break that needs the reserve (fullgraph=True shows where)", budget_bytes=step_budget,
                            min_feasible_bytes=(e.min_feasible_bytes or 0) + self.reserve) from None
                    raise
                break
            names = set(p.predicted.get("recomputed", []))
            recompute = {v.id for v in jg.graph.nodes if v.name in names}
            tag(jg, recompute)
            # (the partitioner's common-subexpression pass puts a copy of the graph in `gm`, tagged
            # as this try tagged it: every try partitions the graph `jg` was made of)
            gm.graph = joint
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)
            prog = program(fw, bw, num_fwd, times, copies=layout_copies(fw) if inductor else None,
                           buffers=self.buffers, made_here=made_here, keep_outputs=self.keep_outputs)
            tries.append({"budget_bytes": target, "planned_peak_bytes": p.predicted["peak_bytes"],
                          "peak_bytes": prog.peak_bytes})
            if best is None or prog.peak_bytes < best[3].peak_bytes or prog.peak_bytes <= limit:
                best = (p, recompute, (fw, bw), prog)
            if prog.peak_bytes <= limit:
                break
            # (the next plan's budget: lower by the excess, and by at least the replay's excess
            # over this plan's own prediction, which the plan's model did not see)
            target = min(target - (prog.peak_bytes - limit), limit - (prog.peak_bytes - p.predicted["peak_bytes"]))
        p, recompute, graphs, prog = best
        # (under a cut, a replay between the limit and the budget stands: its code decides)
        if prog.peak_bytes > budget:
            raise InfeasibleBudgetError(
                f"remat.compiler: no partition found within {format_bytes_exact(budget)}"
                + (f" (the budget less reserve={self.reserve})" if self.reserve and not before else "")
                + (" (its share after a graph break)" if before else "")
                + f" ({len(tries)} tries; the closest peaks at {format_bytes_exact(prog.peak_bytes)}): raise the budget",
                budget_bytes=budget, min_feasible_bytes=prog.peak_bytes)
        note = f"leaves {format_bytes_exact(self.reserve)} free for the regions after it" if self.reserve and not before else ""
        if before:
            note = (f"after a graph break: its share is the budget {format_bytes_exact(step_budget)} less "
                    f"{format_bytes_exact(held)} that region(s) {', '.join(map(str, before))} hold while it runs")
            log.info("remat.compiler: region %d %s", len(self.regions), note)
        ops = [n.name for v in jg.graph.nodes if v.id in recompute for n in jg.members[v.id]]
        self._graphs = (*graphs, num_fwd, times)
        self.regions.append(Region(jg.graph, p, ops, prog, budget, tries, note, held, tuple(before), *self._leaves))
        log.info("remat.compiler: region %d: %d nodes, %d ops recomputed, predicted peak %d bytes (budget %d)",
                 len(self.regions) - 1, jg.graph.n, len(ops), prog.peak_bytes, budget)
        return graphs

    # -- the backend -------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        self._held, self._held_from, self._passed = self.held(example_inputs)
        self._leaves = self.leaves(example_inputs)
        n = len(self.regions)
        compiled = self._compile(gm, example_inputs)
        return self._tracked(compiled, n if len(self.regions) > n else None)

    def _compile(self, gm: fx.GraphModule, example_inputs: list):
        if self.backend == "inductor":
            return self._inductor(gm, example_inputs)
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

    def _inductor(self, gm: fx.GraphModule, example_inputs: list):
        """Compile with inductor, then read the region's peaks off the code it generated
        (`code_program`) and search the cut (bytes the plan is made under the region's budget)
        for the fastest compile whose code fits, up to `CODE_TRIES` compiles: where a code is
        over the budget, plan again under it by the excess (and by at least what the code held
        over the plan's replay), or between the cuts known over and under; where a code fits
        after one over it but leaves more than `SLACK` of the budget unused, plan again between
        the two cuts (interpolated on their codes' peaks).  The compile kept is the fitting one
        of least predicted time (`Region.compiles` lists them all)."""
        import torch._functorch.config as functorch_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        n, cut = len(self.regions), 0
        over_at: tuple | None = None    # (cut, bytes over the budget) of the highest cut found over
        under_at: tuple | None = None   # (cut, bytes under it) of the lowest cut found to fit
        best: tuple | None = None       # (compiled, region) that fits, of least predicted time
        last: tuple = ()
        compiles: list = []
        for _ in range(CODE_TRIES):
            codes: dict = {}

            def inner(g, inputs, *args, **kwargs):
                out = compile_fx_inner(g, inputs, *args, **kwargs)
                codes["backward" if kwargs.get("is_backward") else "forward"] = getattr(out, "source_code", None)
                return out
            self._cut = cut
            # (no FX graph cache: a plan depends on the budget, which the cache key does not hold;
            # the backward compiled with the forward, not at its first run, so its code is read now)
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                compiled = compile_fx(gm, example_inputs, inner_compile=inner,
                                      config_patches={"custom_partitioner_fn": _partitioner(self),
                                                      "fx_graph_cache": False})
            self._cut = 0
            if len(self.regions) == n:   # (no joint graph planned: an inference graph)
                return compiled
            code = self.code_program(self.regions[-1], codes)
            if code is None:   # (the replay stands)
                return compiled
            region = self.regions.pop()
            region.replay, region.program = region.program, code
            compiles.append({"cut_bytes": cut, "peak_bytes": code.peak_bytes, "replay_peak_bytes": region.replay.peak_bytes,
                             "time": code.time, "recomputed_ops": len(region.recomputed_ops)})
            region.compiles = compiles
            last = (compiled, region)
            gap = region.budget_bytes - code.peak_bytes
            if gap >= 0:
                if best is None or code.time < best[1].program.time:
                    best = last
                under_at = (cut, gap) if under_at is None or cut < under_at[0] else under_at
                if over_at is None or gap <= SLACK * region.budget_bytes:
                    break   # (at the budget itself, or close enough under it)
            else:
                over_at = (cut, -gap) if over_at is None or cut > over_at[0] else over_at
            if under_at is None:
                # (lower by the excess, and by at least what the code held over this plan's replay:
                # a plan whose replay lies under its target by some slack must not spend it again)
                cut = max(cut + over_at[1], code.peak_bytes - region.replay.peak_bytes)
            else:   # (between the cut over and the cut under, where the line through their codes meets the budget)
                (c0, b0), (c1, b1) = over_at, under_at
                cut = c0 + (c1 - c0) * b0 // (b0 + b1)
                if not c0 < cut < c1:
                    break
            log.info("remat.compiler: region %d: inductor's code peaks at %d bytes, budget %d: planning again %d bytes "
                     "under it", n, code.peak_bytes, region.budget_bytes, cut)
        if best is None:
            region = last[1]
            raise InfeasibleBudgetError(
                f"remat.compiler: inductor's code for region {n} peaks at {format_bytes_exact(region.program.peak_bytes)}, "
                f"over its budget {format_bytes_exact(region.budget_bytes)}, after {len(compiles)} plans each lower by "
                "what the code held over the last: raise the budget", budget_bytes=region.budget_bytes,
                min_feasible_bytes=region.program.peak_bytes)
        compiled, region = best
        self.regions.append(region)
        if len(compiles) > 1:
            log.info("remat.compiler: region %d: kept the compile %d bytes under the budget (%d ops recomputed) of %d",
                     n, region.budget_bytes - region.program.peak_bytes, len(region.recomputed_ops), len(compiles))
        return compiled

    def code_program(self, region: Region, codes: dict) -> Program | None:
        """The region's `Program` with its peaks read off inductor's generated code
        (`remat.frontends.inductor_code.step_bytes`: what its own fusion, buffer reuse and
        reordering hold), the replay's time; None (and a log line) where the code is not there
        or not readable, the replay standing."""
        fw, bw, num_fwd, times = self._graphs
        if not codes.get("forward") or not codes.get("backward"):
            log.info("remat.compiler: inductor's code was not handed back; the region's peak is the replay's")
            return None
        # (inductor's comments name a node by the node it was made from, where it has one -- the
        # forward's by the names of the graph dynamo captured -- else by its own name)
        nodes: dict = {"forward": {}, "backward": {}}
        graphs = {"forward": list(fw.graph.nodes), "backward": list(bw.graph.nodes)}
        for which, g in graphs.items():
            for n in g:
                for k in {n.name, *([n.meta["from_node"][0].name] if n.meta.get("from_node") else [])}:
                    nodes[which].setdefault(k, []).append(n)

        def tensors(n: fx.Node) -> list:
            return [t for t in tree_flatten(n.meta.get("val"))[0] if isinstance(t, torch.Tensor)]

        def named(which: str, names: list) -> list:
            return list({id(v): v for k in names for v in nodes[which].get(k, ())}.values())

        def part(v: fx.Node, path: tuple) -> Any:
            # (an op whose value is its ``getitem`` readers', a ``run_with_rng_state``'s)
            val = v.meta.get("val")
            if val is None and path:
                u = next((u for u in v.users if u.target is operator.getitem and u.args[1] == path[0]), None)
                return part(u, path[1:]) if u is not None else None
            for i in path:
                val = val[i] if isinstance(val, (tuple, list)) and isinstance(i, int) and -len(val) <= i < len(val) else None
            return val

        def runs(which: str, kernel: str) -> list:
            return [v for v in graphs[which] if v.op == "call_function" and aten_op(v) == kernel]

        def itemsize(which: str, names: list, size: list, path: tuple = (), kernel: str = "") -> int | None:
            # (a part of a tuple result by its indices in the op's value -- a dropout's output and
            # its mask have one size and two dtypes -- else the op's last value of that size; the
            # ops named first, then the graph's ops that run the statement's kernel: a statement's
            # comment may name only the ops fused before it, or none)
            fits = lambda t: isinstance(t, torch.Tensor) and list(t.shape) == list(size)  # noqa: E731
            places = (named(which, names), runs(which, kernel))
            for exact in ([[t for v in ops if fits(t := part(v, path))] for ops in places] if path else []) + \
                    [[t for v in ops for t in tensors(v) if fits(t)] for ops in places]:
                if exact:
                    return exact[-1].element_size()
            return None

        def input_itemsize(which: str, name: str) -> int | None:
            ts = [t for v in named(which, [name]) for t in tensors(v)]
            return ts[0].element_size() if ts else None

        def scratch(which: str, names: list, kernel: str) -> int:
            # (the ops named that the statement's kernel runs, where there are such: a name of the
            # graph dynamo captured stands for all the ops made of it, an attention's, say)
            ops = [v for v in named(which, names) if v.op == "call_function"]
            same = [v for v in ops if aten_op(v) == kernel] or runs(which, kernel)
            return max((times.scratch(v) for v in same or ops), default=0)

        def shape(which: str, names: list, path: tuple, kernel: str) -> tuple | None:
            # (the one value of that place among the ops named that run the kernel, else among
            # the graph's ops that run it; several sizes: None)
            for ops in ([v for v in named(which, names) if aten_op(v) == kernel], runs(which, kernel)):
                got = {(tuple(t.shape), tuple(t.stride())) for v in ops if isinstance(t := part(v, path), torch.Tensor)}
                if got:
                    return tuple(map(list, got.pop())) if len(got) == 1 else None
            return None
        tangents = {n.name: tensors(n) for n in bw.graph.nodes if n.op == "placeholder"}
        # (a scalar's gradient, a loss's: ``backward()`` holds it to the backward's end)
        roots = {k for k, ts in tangents.items() if ts and all(t.numel() == 1 for t in ts)}
        prog = region.program
        try:
            peaks = step_bytes(codes["forward"], codes["backward"], num_fwd, region_device(fw),
                               lambda names: [("fixed", k) for k in names],
                               lambda k: sum(t.untyped_storage().nbytes() for t in tangents.get(k, ())), roots,
                               itemsize=itemsize, input_itemsize=input_itemsize, scratch=scratch, shape=shape,
                               keep_outputs=self.keep_outputs)
        except (UnreadableCode, SyntaxError, ValueError) as e:
            log.info("remat.compiler: inductor's code not read (%s); the region's peak is the replay's", e)
            return None
        fixed = prog.fixed_bytes
        log.info("remat.compiler: inductor's code: forward peak %d bytes at %r, backward %d at %r (the replay: %d, %d)",
                 fixed + peaks.forward_bytes, peaks.forward_line, fixed + peaks.backward_bytes, peaks.backward_line,
                 prog.forward_peak_bytes, prog.backward_peak_bytes)
        # (per graph the larger of the code's and the replay's peak: the code reading prices an ATen
        # kernel's scratch as measured on made-up tensors of the graph's layouts, and the code
        # may pass it others -- a convolution's backward reading a weight that is not
        # channels-last -- whose kernel then allocates more)
        fwd = max(fixed + peaks.forward_bytes, prog.forward_peak_bytes)
        bwd = max(fixed + peaks.backward_bytes, prog.backward_peak_bytes)
        return Program(max(fwd, bwd), prog.time, fixed, peaks.saved_bytes, fwd, bwd, prog.recomputed_ops)

    def report(self) -> str:
        """A line per compiled region: nodes, ops recomputed, predicted peak within the budget,
        the plan's time overhead and status."""
        lines = []
        for k, r in enumerate(self.regions):
            lines.append(f"region {k}: {r.graph.n} nodes, {len(r.recomputed_ops)} ops recomputed, predicted peak "
                         f"{format_bytes_exact(r.program.peak_bytes)} within {format_bytes_exact(r.budget_bytes)}"
                         + (" (its share)" if r.held_bytes else "") + ", "
                         f"overhead {r.predicted['overhead']:.3f}x, {r.plan.solver.get('status')}"
                         + (f" ({r.note})" if r.note else ""))
        if len(self.regions) > 1:
            lines.append(f"the step: predicted peak {format_bytes_exact(self.step_peak_bytes)} (each region with what the "
                         "regions before it hold, and the later regions' parameters and gradients)")
        lines += [self._outside_line(k) for k in sorted(self.read_outside)]
        lines += [self._kept_line(k) for k in sorted(self.outputs_kept)]
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
    """``remat.compiler(budget, backend="inductor", solver="ilp", time_limit=30, profile="measure",
    reserve=0, knapsack=(1, 0.9, 0.7, 0.5, 0.3), fused=None, buffers=False, keep_outputs=True)``: a
    ``torch.compile`` backend whose partitioner follows remat's plan of each region's joint graph at `budget` (bytes, ``"6GiB"``,
    or ``"0.5x"`` of the keep-all peak of the region that starts the step), each region after a
    graph break within its share (module docstring).  `backend`: ``"inductor"`` (code
    generation), ``"aot_eager"`` (the joint graph's ops as they are, run eagerly) or
    ``"aot_eager_decomp_partition"`` (inductor's decompositions, run eagerly).  `profile`: op
    times measured on the device (``"measure"``, each distinct op once) or from FLOP and byte
    counts (``"flops"``).  `reserve`: bytes the region that starts the step leaves free for the
    regions after a graph break (the error of a region that does not fit its share names what it
    needs).  `knapsack`: the ``activation_memory_budget`` values at which
    PyTorch's own partitioner is asked what it would recompute (1: its default min cut, which
    recomputes cheap pointwise ops to save less), each a start of the plan's search
    (`remat.frontends.compiled.knapsack_sets`; ``()``: none).  `fused` (default: with inductor):
    the ops inductor generates kernels for are priced as parts of fused kernels
    (`remat.frontends.compiled.OpTimes`), not at their eager times.  `buffers` (inductor only; off
    by default: on transformers' GPT-2 124M with its loss outside the region, the 1.0x step
    measured 5.7 % over the prediction with it, 3.4 % under without; with the loss compiled in the
    region it is what reaches inductor's own peak there, measured as predicted): two buffer rewrites inductor
    makes, modelled in the plan and the replay beside its unstored and in-place kernels (always
    modelled): the backward's scatters into zeros (a
    max pool's, an embedding's backward) written in the zeros' buffer
    (`remat.frontends.compiled.inplace_source`), a matrix product folded into the sum that reads
    it (``addmm``: `remat.frontends.compiled.folds_into_addmm`).  `keep_outputs`: the caller holds
    what the compiled model returns through ``backward()`` (``out = model(x); loss = loss_fn(out,
    y)``: the default, which plans them alive to the step's end); false where it drops them once
    its loss is computed (``loss = loss_fn(model(x), y)``, or ``model(**batch).loss`` with the
    logits left behind): they are then planned free from the backward's start, and a region whose
    results are still alive there says so once (a warning and a line of `report`) with their bytes."""
    return RematCompiler(budget, backend, solver, **options)


__all__ = ["compiler", "RematCompiler", "Region"]
