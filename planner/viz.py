"""Pictures of schedules, memory and sweeps (matplotlib).

Three kinds of figure, each a function that returns a `matplotlib.figure.Figure` and never
touches pyplot's global state (no ``plt.show()``, no ``matplotlib.use``): save it with
``fig.savefig("x.png")``, or let a notebook display it.

* `plot_matrices`: the stage matrices in the style of Checkmate's figures, stages x nodes:
  compute R (first computation and recomputation in different colours), resident at the stage
  start S, swap-out starting (a subset of S) and swap-in, with the forward, loss and backward
  regions marked.  A bare op list (``schedule.stages`` None) is drawn the same way with one row
  per ``compute`` op instead of one per stage.
* `plot_memory`: device bytes over the schedule, stacked by category, with the budget line; host
  bytes under it; and the compute and transfer streams' activity at the bottom.
* `plot_sweep`: budget against overhead, one curve per solver of a sweep, the solvers' lower
  bounds dashed, and the budgets no solver could fit shaded as infeasible.

`plot_plan` draws a saved `Plan` (matrices, memory or both side by side); `memory_breakdown`
is the per-op category replay that `plot_memory` draws; `read_sweep_csv` reads the CSV of
``remat sweep``.

Memory categories are how each resident copy got there, as the simulator's state records it
(`remat.core.simulate.SimState`):

=================  ==========================================================================
``fixed``          the graph's ``fixed_bytes`` (parameters, inputs, optimizer state, gradients a
                   loop keeps)
``gradients``      persistent bytes of the nodes computed so far (parameter gradients,
                   allocated at their first accumulation)
``kept``           outputs resident after their first ``compute``
``recomputed``     outputs resident after a ``compute`` of a node that was computed before
``swapped in``     outputs resident because a ``swap_in`` brought them back
``workspace``      the running node's ``workspace_bytes``, during its ``compute`` only
=================  ==========================================================================

Their sum is the simulator's device bytes at every op (checked: a mismatch is a bug and raises).
Byte axes pick their unit by magnitude (B, KiB, MiB, GiB, TiB: synthetic graphs stay in bytes);
time axes likewise pick s, ms or us.  Graphs from `remat.generators` are in abstract units, so
their "seconds" and "bytes" are units of work and size.

Importing this module imports matplotlib; ``import remat`` does not import this module.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from .budget import format_bytes
from remat.core.errors import InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Schedule
from remat.core.simulate import SimState, simulate

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import SubFigure

    from remat.core.plan import Plan

__all__ = ["CATEGORIES", "COLORS", "MemoryBreakdown", "memory_breakdown", "plot_matrices", "plot_memory",
           "plot_sweep", "plot_plan", "read_sweep_csv", "byte_unit", "time_unit"]

# ---- style ---------------------------------------------------------------------------
# Okabe-Ito colours (distinguishable with the common colour-vision deficiencies); one meaning
# each across every figure: blue computes/keeps, vermillion recomputes, orange goes to the host,
# green comes back from it.
COLORS = {
    "fixed": "#9a9a9a",
    "gradients": "#F0E442",
    "kept": "#0072B2",
    "recomputed": "#D55E00",
    "swapped in": "#009E73",
    "workspace": "#CC79A7",
    "resident": "#A6CEE3",
    "swap out": "#E69F00",
    "host": "#E69F00",
    "budget": "#C00000",
    "forward": "#DCE9F5",
    "loss": "#F5E6C8",
    "backward": "#F3D9D3",
}
CATEGORIES = ("fixed", "gradients", "kept", "recomputed", "swapped in", "workspace")
_CATEGORY_LABELS = {
    "fixed": "fixed (params, inputs, ...)",
    "gradients": "parameter gradients",
    "kept": "kept activations / grads",
    "recomputed": "recomputed",
    "swapped in": "swapped in",
    "workspace": "workspace",
}
_KIND_LABELS = {"forward": "forward", "loss": "loss", "backward": "backward"}


# ---- units ---------------------------------------------------------------------------
def byte_unit(max_bytes: float) -> tuple[float, str]:
    """(divisor, name) for an axis whose largest value is `max_bytes`: B below 10 KiB (synthetic
    graphs), KiB below 1 MiB, then MiB, GiB, TiB (powers of 1024)."""
    for name, size in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2)):
        if max_bytes >= size:
            return float(size), name
    return (1024.0, "KiB") if max_bytes >= 10 * 1024 else (1.0, "B")


def time_unit(max_seconds: float) -> tuple[float, str]:
    """(divisor, name) for a time axis: s from 1 s up, ms from 1 ms, else us."""
    if max_seconds >= 1.0 or max_seconds <= 0:
        return 1.0, "s"
    if max_seconds >= 1e-3:
        return 1e-3, "ms"
    return 1e-6, "\u00b5s"


def _fmt_bytes(n: float) -> str:
    return format_bytes(n)


def _new_figure(fig: "Figure | SubFigure | None", size: tuple[float, float]) -> "Figure | SubFigure":
    return Figure(figsize=size, layout="constrained") if fig is None else fig


def _root(fig: "Figure | SubFigure") -> Figure:
    """The top-level Figure of a Figure or SubFigure."""
    while not isinstance(fig, Figure):
        fig = fig.figure
    return fig


def _unpack(source: "Plan | Graph", schedule: "Schedule | None") -> tuple[Graph, Schedule, "Plan | None"]:
    """Accept ``(plan)`` or ``(graph, schedule)``."""
    if isinstance(source, Graph):
        if schedule is None:
            raise InvalidInputError("viz: a graph needs its schedule: plot_...(graph, schedule)")
        return source, schedule, None
    if hasattr(source, "graph") and hasattr(source, "schedule"):
        return source.graph, source.schedule, source  # a Plan
    raise InvalidInputError(f"viz: expected a Plan or a Graph and a Schedule, got {type(source).__name__}")


def _describe(graph: Graph, plan: "Plan | None", schedule: Schedule) -> str:
    model = graph.meta.get("model") or "graph"
    rep = plan.solver if plan is not None else schedule.report
    solver = rep.get("name") if rep else None
    text = f"{model}, {graph.n} nodes"
    if solver:
        status = rep.get("status")
        text += f"; {solver}" + (f" ({status})" if status else "")
    if plan is not None:
        text += f", budget {_fmt_bytes(plan.budget_bytes)}"
    return text


# ---- memory replay -------------------------------------------------------------------
@dataclass
class MemoryBreakdown:
    """Per op of a schedule (index k): device bytes by category during the op, host bytes after
    it, and the times the op starts and ends.

    ``during[c][k]`` is the bytes of category c while op k runs (for a ``compute``: its inputs,
    its output and its workspace); ``after[c][k]`` is what remains once op k is done.
    ``issue[k]`` is the compute stream's clock when op k is issued; ``start[k]``/``end[k]`` are
    the simulator's (a transfer's on the transfer stream).  Times are simulated seconds.
    """
    ops: list
    during: dict[str, np.ndarray]
    after: dict[str, np.ndarray]
    host: np.ndarray
    issue: np.ndarray
    start: np.ndarray
    end: np.ndarray
    first_compute: np.ndarray          # bool per op: a compute that is the node's first
    total_time: float
    peak_bytes: int
    peak_op: int
    host_peak_bytes: int
    recomputed_nodes: set = field(default_factory=set)

    @property
    def device_bytes(self) -> np.ndarray:
        return sum(self.during[c] for c in CATEGORIES)


def memory_breakdown(graph: Graph, schedule: "Schedule | list", bandwidth: float | None = None) -> MemoryBreakdown:
    """Replay `schedule` in the simulator (`SimState`) and split the device bytes at every op into
    `CATEGORIES` (how each resident copy got there: `SimState.bytes_by_origin`).

    An invalid schedule raises `InvalidInputError` naming the simulator's violation.
    """
    ops = schedule.ops if isinstance(schedule, Schedule) else list(schedule)
    res = simulate(graph, ops, bandwidth)
    if not res.valid:
        raise InvalidInputError(f"viz: the schedule is invalid for this graph: {res.violation}")
    state = SimState(graph, bandwidth)
    K = len(ops)
    during = {c: np.zeros(K, dtype=np.int64) for c in CATEGORIES}
    after = {c: np.zeros(K, dtype=np.int64) for c in CATEGORIES}
    host = np.zeros(K, dtype=np.int64)
    issue, start, end = np.zeros(K), np.zeros(K), np.zeros(K)
    first = np.zeros(K, dtype=bool)
    recomputed: set[int] = set()
    category = {"computed": "kept", "recomputed": "recomputed", "swapped in": "swapped in", "persistent": "gradients"}
    fixed = graph.fixed_bytes
    for k, op in enumerate(ops):
        issued = state.clock  # the compute stream's clock when the op is issued
        before = dict(state.bytes_by_origin)
        state.apply(op)
        now = state.bytes_by_origin
        seen = before if op.op == "free" else now  # a free's bytes go after it
        for origin, c in category.items():
            during[c][k] = seen[origin]
            after[c][k] = now[origin]
        during["fixed"][k] = after["fixed"][k] = fixed
        if op.op == "compute":
            during["workspace"][k] = graph.nodes[op.node].workspace_bytes
            first[k] = state.counts[op.node] == 1
            if not first[k]:
                recomputed.add(op.node)
            issue[k] = state.last_start
        else:
            issue[k] = issued
        host[k] = state.host
        start[k], end[k] = state.last_start, state.last_end
        # the categories are a split of the simulator's figure, never a second opinion
        if sum(int(during[c][k]) for c in CATEGORIES) != state.during + fixed or \
                sum(int(after[c][k]) for c in CATEGORIES) != state.live + fixed:
            raise AssertionError(f"viz: category replay disagrees with the simulator at op {k} ({op})")
    dev = sum(during[c] for c in CATEGORIES) if K else np.zeros(0)
    peak_op = int(np.argmax(dev)) if K else 0
    return MemoryBreakdown(
        ops=ops, during=during, after=after, host=host, issue=issue, start=start, end=end,
        first_compute=first, total_time=res.time, peak_bytes=res.peak_bytes, peak_op=peak_op,
        host_peak_bytes=res.host_peak_bytes, recomputed_nodes=recomputed)


# ---- stage matrices ------------------------------------------------------------------
def _rows_from_ops(graph: Graph, ops: Sequence) -> list[dict[str, list[int]]]:
    """Stage-like rows for a bare op list: one per compute op, with what is resident just
    before it and the transfers issued since the previous row."""
    rows: list[dict[str, list[int]]] = []
    on_device: set[int] = set()
    out_pending: list[int] = []
    in_pending: list[int] = []
    for op in ops:
        if op.op == "compute":
            rows.append({"compute": [op.node], "keep": sorted(on_device - set(in_pending)),
                         "swap_out": sorted(out_pending), "swap_in": sorted(in_pending)})
            out_pending, in_pending = [], []
            on_device.add(op.node)
        elif op.op == "free":
            on_device.discard(op.node)
        elif op.op == "swap_out":
            out_pending.append(op.node)
        elif op.op == "swap_in":
            in_pending.append(op.node)
            on_device.add(op.node)
    return rows


def _cells(entries: Iterable[tuple[int, int]]) -> np.ndarray:
    """Unit squares centred on (node, row) as PolyCollection vertices, shape (m, 4, 2)."""
    pts = np.array(list(entries), dtype=float).reshape(-1, 2)
    off = np.array([[-0.5, -0.5], [0.5, -0.5], [0.5, 0.5], [-0.5, 0.5]])
    return pts[:, None, :] + off[None, :, :]


def plot_matrices(source: "Plan | Graph", schedule: Schedule | None = None, *, title: str | None = None,
                  fig: "Figure | SubFigure | None" = None) -> Figure:
    """Stage matrices of a schedule: ``plot_matrices(plan)`` or ``plot_matrices(graph, schedule)``.

    One cell per entry: R (compute; first computations blue, recomputations vermillion), S
    (resident at the stage start, light blue), swap-out starting (orange, drawn over its S
    cell: a value being copied out is still resident) and swap-in (green; the value is usable
    from the next stage).  Each kind is one `PolyCollection` whose ``gid`` is ``"R"``, ``"S"``,
    ``"SO"`` or ``"SI"``, with one path per entry.  Rows are stages (a bare op list: compute
    ops), columns nodes in topological order; the forward, loss and backward regions are marked
    along both axes.  Draws into `fig` (a Figure or SubFigure) when given; returns the Figure.
    """
    graph, schedule, plan = _unpack(source, schedule)
    n = graph.n
    if schedule.stages is not None:
        rows = [s.to_dict() for s in schedule.stages]
        row_label = "stage t (computes node t for the first time)"
    else:
        rows = _rows_from_ops(graph, schedule.ops)
        row_label = "compute op (bare op list: one row per compute)"
    T = len(rows)
    first_seen: set[int] = set()
    r_cells, r_colors, s_cells, so_cells, si_cells = [], [], [], [], []
    for t, row in enumerate(rows):
        for i in row["compute"]:
            r_cells.append((i, t))
            r_colors.append(COLORS["kept"] if i not in first_seen else COLORS["recomputed"])
            first_seen.add(i)
        s_cells.extend((i, t) for i in row["keep"])
        so_cells.extend((i, t) for i in row["swap_out"])
        si_cells.extend((i, t) for i in row["swap_in"])

    size = min(10.0, max(5.0, 3.0 + 0.035 * n))
    out = _new_figure(fig, (size + 2.6, size))
    ax = out.add_subplot()
    lw = 0.0 if n > 60 else 0.3
    for gid, cells, color in (("S", s_cells, COLORS["resident"]), ("SO", so_cells, COLORS["swap out"]),
                              ("SI", si_cells, COLORS["swapped in"]), ("R", r_cells, r_colors)):
        coll = PolyCollection(_cells(cells), facecolors=color, edgecolors="white", linewidths=lw)
        coll.set_gid(gid)
        ax.add_collection(coll)
    _mark_regions(ax, graph, T, stages=schedule.stages is not None)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(T - 0.5, -0.5)
    ax.set_aspect("equal" if schedule.stages is not None else "auto")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=10))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=10))
    ax.set_xlabel("node i (topological order)")
    ax.set_ylabel(row_label)
    staged = schedule.stages is not None
    n_first = sum(1 for c in r_colors if c == COLORS["kept"])
    handles = [Patch(color=COLORS["kept"], label=f"compute, first (R): {n_first}"),
               Patch(color=COLORS["recomputed"], label=f"recompute (R): {len(r_cells) - n_first}"),
               Patch(color=COLORS["resident"], label=f"resident at start (S): {len(s_cells)}" if staged
                     else f"resident before the compute: {len(s_cells)}"),
               Patch(color=COLORS["swap out"], label=f"swap-out starts (in S): {len(so_cells)}" if staged
                     else f"swap-out issued since the last row: {len(so_cells)}"),
               Patch(color=COLORS["swapped in"], label=f"swap-in (usable next row): {len(si_cells)}" if staged
                     else f"swap-in issued since the last row: {len(si_cells)}")]
    out.legend(handles=handles, loc="outside right center", frameon=False, title="cells (count)",
               alignment="left")
    out.suptitle(title if title is not None else "Schedule: " + _describe(graph, plan, schedule),
                 fontsize="medium")
    return _root(out)


def _kind_spans(graph: Graph) -> list[tuple[str, int, int]]:
    """Maximal runs of one node kind: (kind, first id, last id)."""
    spans: list[tuple[str, int, int]] = []
    for v in graph.nodes:
        if spans and spans[-1][0] == v.kind and spans[-1][2] == v.id - 1:
            spans[-1] = (v.kind, spans[-1][1], v.id)
        else:
            spans.append((v.kind, v.id, v.id))
    return spans


def _mark_regions(ax: "Axes", graph: Graph, T: int, stages: bool) -> None:
    """Forward / loss / backward regions: dashed lines between them, named on a top axis (and,
    for stages, on a right axis: stage t computes node t, so the row regions match)."""
    spans = _kind_spans(graph)
    wide = [(k, a, b) for k, a, b in spans if b - a + 1 >= max(2, graph.n // 12)]
    top = ax.secondary_xaxis("top")
    top.set_xticks([(a + b) / 2 for _, a, b in wide], [_KIND_LABELS[k] for k, _, _ in wide])
    top.tick_params(axis="x", length=0)
    if stages:
        right = ax.secondary_yaxis("right")
        right.set_yticks([(a + b) / 2 for _, a, b in wide if a < T],
                         [_KIND_LABELS[k] for k, a, _ in wide if a < T], rotation=90, va="center")
        right.tick_params(axis="y", length=0)
    for _, a, _ in spans:
        if a > 0:
            ax.axvline(a - 0.5, color="0.35", lw=0.7, ls="--", zorder=3)
            if stages and a - 0.5 < T:
                ax.axhline(a - 0.5, color="0.35", lw=0.7, ls="--", zorder=3)


# ---- memory over time ----------------------------------------------------------------
def plot_memory(source: "Plan | Graph", schedule: Schedule | None = None, *, budget_bytes: int | None = None,
                x: str = "time", bandwidth: float | None = None, zoom: bool | None = None,
                title: str | None = None, fig: "Figure | SubFigure | None" = None) -> Figure:
    """Device memory over a schedule: ``plot_memory(plan)`` or ``plot_memory(graph, schedule)``.

    Top: device bytes stacked by category (`CATEGORIES`, from `memory_breakdown`), the budget as
    a red line (the plan's, or `budget_bytes`), the peak marked.  Middle: host bytes held by
    swap-outs.  Bottom: the compute stream (first computes blue, recomputes vermillion) above
    the transfer stream (swap-outs orange, swap-ins green).  `x` is ``"time"`` (simulated
    seconds; the axis picks s/ms/us) or ``"op"`` (op index).  `zoom` starts the memory axis just
    below the fixed bytes instead of at 0 (the y label says so); by default it does when the
    fixed bytes are more than half the top of the axis, as on small models whose parameters
    outweigh their activations.  The stacked areas are
    `PolyCollection`s whose ``gid`` is the category; the stream bars are collections from
    ``broken_barh`` (gid ``"compute"``, ``"recompute"``, ``"swap out"``, ``"swap in"``), one path per op.
    """
    graph, schedule, plan = _unpack(source, schedule)
    if x not in ("time", "op"):
        raise InvalidInputError(f"viz: x must be 'time' or 'op', got {x!r}")
    if budget_bytes is None and plan is not None:
        budget_bytes = plan.budget_bytes
    mb = memory_breakdown(graph, schedule, bandwidth)
    K = len(mb.ops)
    if x == "time":
        tdiv, tname = time_unit(mb.total_time)
        # each op: its "during" figure from when it is issued, then its "after" figure from when it
        # ends on the compute stream (zero-length ops only step)
        done = np.where([o.op in ("compute", "free", "wait") for o in mb.ops], mb.end, mb.issue)
        xs = np.empty(2 * K + 1)
        xs[0:2 * K:2] = mb.issue
        xs[1:2 * K:2] = done
        xs[-1] = mb.total_time
        xs /= tdiv
        ys = {c: np.empty(2 * K + 1) for c in CATEGORIES}
        for c in CATEGORIES:
            ys[c][0:2 * K:2] = mb.during[c]
            ys[c][1:2 * K:2] = mb.after[c]
            ys[c][-1] = mb.after[c][-1] if K else 0
        host_x = np.concatenate([xs[1:2 * K:2], [xs[-1]]])
        host_y = np.concatenate([mb.host, mb.host[-1:]]) if K else np.zeros(1)
        xlabel = f"simulated time ({tname}): compute stream"
        peak_x = mb.issue[mb.peak_op] / tdiv
    else:
        xs = np.arange(K + 1, dtype=float)
        ys = {c: np.concatenate([mb.during[c], mb.during[c][-1:]]) for c in CATEGORIES}
        host_x, host_y = xs, np.concatenate([mb.host, mb.host[-1:]])
        xlabel = "op index (ops of the schedule in order)"
        peak_x = mb.peak_op + 0.5
        tdiv = 1.0

    top = max([mb.peak_bytes] + ([budget_bytes] if budget_bytes else []))
    bdiv, bname = byte_unit(top)
    out = _new_figure(fig, (11.0, 7.0))
    axes = out.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [4.2, 1.3, 1.1]})
    ax, axh, axs = axes
    present = [c for c in CATEGORIES if np.any(mb.during[c])]
    polys = ax.stackplot(xs, *[ys[c] / bdiv for c in present], step="post", colors=[COLORS[c] for c in present],
                         labels=[_CATEGORY_LABELS[c] + (f" {_fmt_bytes(graph.fixed_bytes)}" if c == "fixed" else "")
                                 for c in present], linewidth=0)
    for c, p in zip(present, polys):
        p.set_gid(c)
    if budget_bytes:
        ax.axhline(budget_bytes / bdiv, color=COLORS["budget"], ls="--", lw=1.4,
                   label=f"budget {_fmt_bytes(budget_bytes)}")
    ax.plot([peak_x], [mb.peak_bytes / bdiv], marker="v", color="black", ms=7, ls="none",
            label=f"peak {_fmt_bytes(mb.peak_bytes)}")
    if zoom is None:
        zoom = graph.fixed_bytes > 0.5 * top
    bottom = 0.0
    if zoom and graph.fixed_bytes:
        bottom = max(0.0, graph.fixed_bytes - 0.08 * (top - graph.fixed_bytes))
    ax.set_ylim(bottom / bdiv, (top + 0.12 * (top - bottom)) / bdiv)
    ax.set_ylabel(f"device memory ({bname})" + (f"\naxis starts at {_fmt_bytes(bottom)}" if bottom else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    out.suptitle(title if title is not None else "Memory: " + _describe(graph, plan, schedule),
                 fontsize="medium")

    hdiv, hname = byte_unit(max(1, mb.host_peak_bytes))
    axh.fill_between(host_x, host_y / hdiv, step="post", color=COLORS["host"], alpha=0.45, lw=0)
    axh.step(host_x, host_y / hdiv, where="post", color=COLORS["host"], lw=1.0,
             label=f"host (peak {_fmt_bytes(mb.host_peak_bytes)})")
    axh.set_ylim(0, max(1, mb.host_peak_bytes) / hdiv * 1.25)
    if not mb.host_peak_bytes:
        axh.text(0.5, 0.5, "no swapping", transform=axh.transAxes, ha="center", va="center", color="0.4")
    axh.set_ylabel(f"host ({hname})")
    axh.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
    axh.grid(axis="y", alpha=0.3)

    _draw_streams(axs, mb, x, tdiv)
    axs.set_xlabel(xlabel)
    axs.set_xlim(xs[0] if K else 0, xs[-1] if K else 1)
    return _root(out)


def _draw_streams(ax: "Axes", mb: MemoryBreakdown, x: str, tdiv: float) -> None:
    bars: dict[str, list[tuple[float, float]]] = {"compute": [], "recompute": [], "swap out": [], "swap in": []}
    for k, op in enumerate(mb.ops):
        if op.op == "compute":
            key = "compute" if mb.first_compute[k] else "recompute"
        elif op.op == "swap_out":
            key = "swap out"
        elif op.op == "swap_in":
            key = "swap in"
        else:
            continue
        if x == "time":
            bars[key].append((mb.start[k] / tdiv, (mb.end[k] - mb.start[k]) / tdiv))
        else:
            bars[key].append((k, 1.0))
    lanes = {"compute": (1.05, 0.8), "recompute": (1.05, 0.8), "swap out": (0.05, 0.8), "swap in": (0.05, 0.8)}
    colors = {"compute": COLORS["kept"], "recompute": COLORS["recomputed"], "swap out": COLORS["swap out"],
              "swap in": COLORS["swapped in"]}
    handles = []
    for key, spans in bars.items():
        if key in ("swap out", "swap in"):  # an edge of its own colour keeps short copies visible
            coll = ax.broken_barh(spans, lanes[key], facecolors=colors[key], edgecolors=colors[key],
                                  linewidth=0.8)
        else:  # white edges part consecutive computes
            coll = ax.broken_barh(spans, lanes[key], facecolors=colors[key], edgecolors="white",
                                  linewidth=0.3 if len(spans) < 150 else 0)
        coll.set_gid(key)
        handles.append(Patch(color=colors[key], label=f"{key} ({len(spans)})"))
    ax.set_ylim(0, 1.9)
    ax.set_yticks([0.45, 1.45], ["transfer", "compute"])
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small",
              title="streams (ops)", alignment="left")


# ---- sweeps --------------------------------------------------------------------------
_FLOATS = ("budget_ratio", "time", "overhead", "lower_bound", "gap", "wall_time")
_INTS = ("budget_bytes", "peak_bytes")


def read_sweep_csv(path: str | Path) -> list[dict]:
    """Rows of the CSV that ``remat sweep`` writes, with numbers parsed and empty cells None."""
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"sweep file {str(p)!r} does not exist")
    with open(p, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"budget_bytes", "solver", "status", "overhead"} - set(reader.fieldnames or [])
        if missing:
            raise InvalidInputError(f"sweep file {str(p)!r}: missing columns {sorted(missing)} "
                                    "(expected the CSV of `remat sweep`)")
        rows = []
        for line, raw in enumerate(reader, start=2):
            row: dict[str, Any] = dict(raw)
            for key in _FLOATS + _INTS:
                val = row.get(key)
                if val is None or val == "":
                    row[key] = None
                    continue
                try:
                    row[key] = int(float(val)) if key in _INTS else float(val)
                except ValueError:
                    raise InvalidInputError(f"sweep file {str(p)!r}, line {line}: {key} is not a number: "
                                            f"{val!r}") from None
            rows.append(row)
    return rows


def plot_sweep(rows: "Iterable[Mapping] | Mapping[str, Iterable[Mapping]] | str | Path", *,
               base_time: float | None = None, x: str = "ratio", title: str | None = None,
               ax: "Axes | None" = None) -> Figure:
    """Budget against overhead from the rows of `remat.planning.sweep` (or its CSV's path).

    One solid curve per solver, markers filled where the solver proved optimality and hollow
    where it did not (a time limit, or a heuristic); a dashed "lower bound" curve: at each budget
    the best ``lower_bound`` (seconds) any solver proved (the ILP's bound, the LP relaxation's)
    divided by the no-recompute time; the budgets at which every solver was infeasible shaded
    and hatched, with a dotted line at the smallest budget any solver fitted.  `rows` may also
    map a label to a sweep's rows, to draw several sweeps on one axis (with and without swap,
    several bandwidths): curves are named "label: solver" (just "label" for a one-solver sweep)
    and each sweep gets its own bound, drawn only where it is below that sweep's best curve
    (a sweep proven optimal at every budget needs no bound line).  ``base_time`` is the no-recompute time
    (``graph.total_time``); by default it is read off the rows (time / overhead).  `x` is
    ``"ratio"`` (budget / checkpoint-all peak) or ``"bytes"``.  Draws into `ax` when given.
    Solver curves are `Line2D`s with ``gid`` ``"overhead:<curve name>"``; the bound's gid is
    ``"bound"`` (``"bound:<label>"`` per sweep of a mapping); the shading's is ``"infeasible"``.
    """
    if isinstance(rows, (str, Path)):
        rows = read_sweep_csv(rows)
    groups: dict[str, list[Mapping]] = {}
    if isinstance(rows, Mapping):
        for label, rs in rows.items():
            for r in rs:
                groups.setdefault(f"{label}: {r['solver']}" if _many_solvers(rs) else str(label), []).append(r)
        all_rows = [r for rs in groups.values() for r in rs]
    else:
        all_rows = list(rows)
        for r in all_rows:
            groups.setdefault(str(r["solver"]), []).append(r)
    if not all_rows:
        raise InvalidInputError("viz: the sweep has no rows")
    if x not in ("ratio", "bytes"):
        raise InvalidInputError(f"viz: x must be 'ratio' or 'bytes', got {x!r}")
    if x == "ratio" and any(r.get("budget_ratio") is None for r in all_rows):
        x = "bytes"
    if base_time is None:
        bases = [r["time"] / r["overhead"] for r in all_rows if r.get("time") and r.get("overhead")]
        base_time = float(np.median(bases)) if bases else None

    bmax = max(r["budget_bytes"] for r in all_rows)
    bdiv, bname = byte_unit(bmax)

    def xval(r: Mapping) -> float:
        return float(r["budget_ratio"]) if x == "ratio" else r["budget_bytes"] / bdiv

    if ax is None:
        out = Figure(figsize=(9.0, 5.0), layout="constrained")
        ax = out.add_subplot()
    else:
        out = ax.figure
    ok = ("optimal", "feasible", "heuristic")
    markers = "osD^v<>pPX*h"
    top = 1.0
    for idx, (label, rs) in enumerate(groups.items()):
        solved = sorted((r for r in rs if r.get("status") in ok and r.get("overhead") is not None), key=xval)
        color = f"C{idx % 10}"
        marker = markers[idx % len(markers)]
        if solved:
            xs = [xval(r) for r in solved]
            ys = [r["overhead"] for r in solved]
            top = max(top, max(ys))
            line, = ax.plot(xs, ys, color=color, marker=marker, ms=5.5, lw=1.6, label=label, zorder=3)
            line.set_gid(f"overhead:{label}")
            open_pts = [(a, b) for a, b, r in zip(xs, ys, solved) if r.get("status") != "optimal"]
            if open_pts:
                ax.plot(*zip(*open_pts), color=color, marker=marker, ms=5.5, mfc="white", ls="none", zorder=4)
        errors = [r for r in rs if r.get("status") == "error"]
        if errors:
            ax.scatter([xval(r) for r in errors], [1.0] * len(errors), color=color, marker="x", s=40,
                       zorder=4, label=f"{label}: solver error")
    # the best proven bound at each budget (the ILP's and the LP relaxation's), one curve per sweep
    sweeps = rows.items() if isinstance(rows, Mapping) else [(None, all_rows)]
    for idx, (label, rs) in enumerate(sweeps):
        best: dict[float, float] = {}
        for r in rs:
            if r.get("status") in ok and r.get("lower_bound") is not None and base_time:
                best[xval(r)] = max(best.get(xval(r), 0.0), r["lower_bound"] / base_time)
        if label is not None:  # of several sweeps, draw only bounds that say more than the curves
            solved_best: dict[float, float] = {}
            for r in rs:
                if r.get("status") in ok and r.get("overhead") is not None:
                    solved_best[xval(r)] = min(solved_best.get(xval(r), math.inf), r["overhead"])
            if all(v >= solved_best.get(b, math.inf) - 1e-9 for b, v in best.items()):
                continue
        if best:
            xs = sorted(best)
            color = "black" if label is None else _group_color(groups, label)
            name = "lower bound (best of ILP / LP)" if label is None else f"{label}: lower bound"
            line, = ax.plot(xs, [best[v] for v in xs], color=color, ls="--", lw=1.2, label=name, zorder=5)
            line.set_gid("bound" if label is None else f"bound:{label}")

    # budgets where nothing fitted: every row at that budget infeasible (errors do not count)
    by_budget: dict[float, list[Mapping]] = {}
    for r in all_rows:
        by_budget.setdefault(xval(r), []).append(r)
    infeasible = [b for b, rs in by_budget.items() if all(r.get("status") == "infeasible" for r in rs)]
    feasible = [b for b, rs in by_budget.items() if any(r.get("status") in ok for r in rs)]
    lo_edge = min(by_budget)
    span = (max(by_budget) - lo_edge) or 1.0
    left = lo_edge - 0.04 * span
    ax.set_xlim(left, max(by_budget) + 0.04 * span)
    if infeasible:
        edge = max(b for b in infeasible if not feasible or b < min(feasible)) if feasible and \
            any(b < min(feasible) for b in infeasible) else (max(infeasible) if not feasible else None)
        if edge is not None:
            shade = ax.axvspan(left, edge, facecolor="0.88", edgecolor="0.6", hatch="//", lw=0, zorder=0,
                               label="infeasible (no solver fits)")
            shade.set_gid("infeasible")
            if feasible:
                ax.axvline(min(feasible), color="0.4", lw=0.8, ls=":", zorder=1)
    ax.axhline(1.0, color="0.5", lw=0.8, zorder=1)
    ax.set_ylim(min(0.95, ax.get_ylim()[0]), top * 1.06 + 0.02)
    ax.set_xlabel("budget (x of the checkpoint-all peak)" if x == "ratio" else f"budget ({bname})")
    ax.set_ylabel("overhead (time / no-recompute time)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2f}x"))
    if x == "ratio":
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}x"))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="0.3", marker="o", ls="none", label="proven optimal"),
                Line2D([], [], color="0.3", marker="o", mfc="white", ls="none", label="not proven / heuristic")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    if title is not None:
        ax.set_title(title, fontsize="medium")
    return _root(out)


def _group_color(groups: Mapping[str, Any], label: str) -> str:
    """Colour of the first curve of sweep `label` in `groups`."""
    for idx, key in enumerate(groups):
        if key == label or key.startswith(f"{label}: "):
            return f"C{idx % 10}"
    return "black"


def _many_solvers(rows: Iterable[Mapping]) -> bool:
    return len({r["solver"] for r in rows}) > 1


# ---- plans ---------------------------------------------------------------------------
def plot_plan(plan: "Plan", kind: str = "both", *, x: str = "time") -> Figure:
    """A plan's matrices (``kind="matrices"``), memory (``"memory"``) or both side by side."""
    if kind == "matrices":
        return plot_matrices(plan)
    if kind == "memory":
        return plot_memory(plan, x=x)
    if kind != "both":
        raise InvalidInputError(f"--kind: expected matrices, memory or both, got {kind!r}")
    fig = Figure(figsize=(22.0, 9.0), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=[1.0, 1.25])
    plot_matrices(plan, fig=left)
    plot_memory(plan, x=x, fig=right)
    return fig
