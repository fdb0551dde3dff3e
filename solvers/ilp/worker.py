r"""Step 0c of the scalable mode, and the process that runs it beside the rest of the search.

`instant_step` is the instant IP (`instant.solve`), then, where it does not prove its optimum
(recompute only, on a graph with tight backward instants), the split bound
(`windows.split_bound`) and, with HiGHS and time enough, the coupling of the split's start
(`windows.couple_split`); a proven optimum whose plan overflows in every rebuild order gets
rebuild-moment rows where it does (`instant.solve_on_demand`).  With the coupling the order is
the split first, the whole model (given up, through HiGHS's interrupt, where its bound is still
below the split's after `WHOLE_GIVE_UP_SHARE` of its time: then the coupling gets the rest), the
coupling last.

`InstantWorker` runs `instant_step` in a fresh interpreter (`sys.executable -c`, the parent's
`sys.path`), the task and the result as pickles in a temporary folder, so that with two cores the
bound gets the whole time and the search is not paused for it.  Not a thread: HiGHS releases the
GIL, but `mip.run` resets HiGHS's process-wide scheduler before each solve, which a second HiGHS
in the same process would not survive.  Nor multiprocessing: "spawn" re-imports the caller's main
script (a user's script without a ``__main__`` guard would run again), and "fork" copies a process
whose solver threads may hold locks.  The worker writes the whole model's bound as an *interim*
result as soon as it has one, before its later steps, so the search can use it at once.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time as _time
from typing import Callable

from remat.core.graph import Graph

from . import instant, mip, windows

# with a limit, the split keeps this share of step 0c's time, or SPLIT_MIN_S up to 60 % of it
SPLIT_SHARE = 0.35
SPLIT_MIN_S = 25.0          # (its first window needs a root LP and cuts)
SPLIT_WHOLE_MAX_S = 150.0   # where the split follows, the whole model runs at most this long (its bound plateaus)
COUPLE_SHARE = 0.4          # with HiGHS: of step 0c's time, for coupling the split's start (`windows.couple_split`),
COUPLE_MIN_S = 30.0         # where that is at least this long (a shorter coupling gives nothing over the split)
COUPLE_MAX_S = 300.0        # and at most this long (a long limit's rest goes to the split, which runs first)
SPLIT_COUPLED_SHARE = 0.15  # the split then runs first, for this share (more gives it little), the whole model after
WHOLE_GIVE_UP_SHARE = 0.3   # which gives up, for the coupling, where its bound is still below the split's after this
#                             share of its time


def instant_step(graph: Graph, budget_bytes: int, *, time_limit: float | None, swap: bool = False,
                 threads: int | None = None, backend: str = "cbc", interim: Callable[[dict], None] | None = None,
                 **options) -> dict:
    """Step 0c (module docstring): the instant IP (`instant.solve`, `options` passed on); when it
    proves an optimum whose plan peaks over in every rebuild order, rebuild-moment rows where it
    does (`instant.solve_on_demand`); and when it does not prove its optimum, recompute only, on a
    graph with tight backward instants, the split bound (`windows.split_bound`) for the rest of
    the time: with a limit, the split bound keeps `SPLIT_SHARE` of it, or `SPLIT_MIN_S` up to 60 %
    of it, and all but `SPLIT_WHOLE_MAX_S` of a long one.  With HiGHS and a limit whose
    `COUPLE_SHARE` is at least `COUPLE_MIN_S`, the order changes: the split first
    (`SPLIT_COUPLED_SHARE` of the limit, or what a long one leaves), then the whole model
    (1 - `SPLIT_COUPLED_SHARE` - `COUPLE_SHARE` of it, at most `SPLIT_WHOLE_MAX_S`), which gives up
    where its bound is still below the split's after `WHOLE_GIVE_UP_SHARE` of its time, then,
    where neither proved its optimum, the coupling of the split's start (`windows.couple_split`)
    with the rest (`COUPLE_SHARE`, at most `COUPLE_MAX_S`).  Returns `instant.solve`'s dict with
    "split": `split_bound`'s dict or None, and "coupled": `couple_split`'s dict or None.
    `interim`, when given, gets the whole model's result (its bound; no schedule, "split" and
    "coupled" None) as soon as it has one, before the steps after it (which can take long)."""
    t0 = _time.perf_counter()
    cuts = [] if swap else windows.split_candidates(graph, budget_bytes)
    couple = bool(cuts) and time_limit is not None and COUPLE_SHARE * time_limit >= COUPLE_MIN_S \
        and backend == "highs" and mip.highs_available()
    split = give_up = None
    if couple:  # the split first, the whole model (given up where it stays below the split), the coupling
        coupled_s = min(COUPLE_SHARE * time_limit, COUPLE_MAX_S)
        whole_s = min(SPLIT_WHOLE_MAX_S, (1 - SPLIT_COUPLED_SHARE - COUPLE_SHARE) * time_limit)
        split_s = max(SPLIT_COUPLED_SHARE * time_limit, time_limit - coupled_s - whole_s)
        split = windows.split_bound(graph, budget_bytes, threads=threads, backend=backend, cuts=cuts,
                                    time_limit=split_s)
        first = min(SPLIT_WHOLE_MAX_S, max(1.0, time_limit - (_time.perf_counter() - t0) - coupled_s))
        if split is not None:
            target, check = split["bound"], WHOLE_GIVE_UP_SHARE * first
            give_up = lambda elapsed, bound: elapsed >= check and (bound is None or bound < target)  # noqa: E731
    else:
        first = time_limit if time_limit is None or not cuts else min(SPLIT_WHOLE_MAX_S, max(
            1.0, time_limit - max(SPLIT_SHARE * time_limit, min(SPLIT_MIN_S, 0.6 * time_limit))))
    out = instant.solve(graph, budget_bytes, swap=swap, threads=threads, backend=backend, time_limit=first,
                           give_up=give_up, **options)
    if interim is not None and out["bound"] is not None and not out["infeasible"]:
        interim(dict(out, split=None, coupled=None, schedule=None))
    if not swap and out["proven"] and out["schedule"] is not None:
        # a proven optimum that peaks over in every rebuild order: rows where it does, as the exact
        # mode does (instant "Rebuild moments on demand", which returns at once when the plan fits
        # in some order)
        rest = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
        out = instant.solve_on_demand(graph, budget_bytes, out, time_limit=rest, threads=threads,
                                      start=options.get("start"), backend=backend)
    out["split"] = out["coupled"] = None
    if cuts and not out["proven"] and not out["infeasible"]:
        if not couple:
            rest = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
            split = windows.split_bound(graph, budget_bytes, threads=threads, backend=backend, time_limit=rest,
                                        cuts=cuts)
        out["split"] = split
        rest = None if time_limit is None else time_limit - (_time.perf_counter() - t0)
        if couple and split is not None and not split["proven"] and rest >= 1.0:
            out["coupled"] = windows.couple_split(graph, budget_bytes, split, time_limit=rest, threads=threads)
    return out


def worker_main(task: str, result: str) -> None:
    """The worker process's body (`python -c`): `instant_step` on the pickled (graph, budget,
    options) in `task`, its result dict (or {"error": ...}) pickled to `result`, and its interim
    result (the whole model's bound) to `result` + ".interim" when there is one."""
    def write(out: dict, path: str) -> None:
        with open(path + ".part", "wb") as fh:
            pickle.dump(out, fh)
        os.replace(path + ".part", path)

    try:
        with open(task, "rb") as fh:
            graph, budget_bytes, options = pickle.load(fh)
        out = instant_step(graph, budget_bytes, interim=lambda early: write(early, result + ".interim"), **options)
    except BaseException as e:  # noqa: BLE001 - whatever it was, the parent must hear of it
        out = {"error": f"{type(e).__name__}: {e}"}
    write(out, result)


class InstantWorker:
    """`instant_step` in a process of its own (module docstring).  `poll(wait)` returns its dict
    once the worker has ended ({"error": ...} when it failed or died), None before; `interim()`
    its interim result, once; `close()` stops the process and removes the folder."""

    def __init__(self, graph: Graph, budget_bytes: int, time_limit: float | None, **options) -> None:
        self._dir = tempfile.mkdtemp(prefix="remat_worker_")
        task, self._result = os.path.join(self._dir, "task.pkl"), os.path.join(self._dir, "result.pkl")
        with open(task, "wb") as fh:
            pickle.dump((graph, budget_bytes, dict(options, time_limit=time_limit)), fh)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._errors = open(os.path.join(self._dir, "stderr.txt"), "wb")
        code = f"from remat.solvers.ilp.worker import worker_main; worker_main({task!r}, {self._result!r})"
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=self._errors)
        except OSError:
            self._errors.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.result: dict | None = None
        self._interim_taken = False

    def poll(self, wait: float = 0.0) -> dict | None:
        if self.result is not None:
            return self.result
        try:
            self._proc.wait(timeout=max(0.0, wait))
        except subprocess.TimeoutExpired:
            return None
        try:
            with open(self._result, "rb") as fh:
                self.result = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            self._errors.flush()
            with open(self._errors.name, "rb") as fh:
                tail = fh.read()[-300:].decode(errors="replace").strip()
            self.result = {"error": f"the worker exited with code {self._proc.returncode} ({tail or 'no message'})"}
        return self.result

    def interim(self) -> dict | None:
        """`instant_step`'s interim result (the whole model's bound), once, when the worker has
        written one and not yet ended; None otherwise."""
        if self.result is not None or self._interim_taken:
            return None
        try:
            with open(self._result + ".interim", "rb") as fh:
                early = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        self._interim_taken = True
        return early

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._errors.close()
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["instant_step", "worker_main", "InstantWorker", "SPLIT_SHARE", "SPLIT_MIN_S", "SPLIT_WHOLE_MAX_S",
           "COUPLE_SHARE", "COUPLE_MIN_S", "COUPLE_MAX_S", "SPLIT_COUPLED_SHARE", "WHOLE_GIVE_UP_SHARE"]
