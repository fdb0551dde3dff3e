"""Solving a PuLP model with CBC or HiGHS, and reading honestly what the solver proved.

`run(model, backend, time_limit, gap, threads, warm, msg, ...)` solves any model that carries a
PuLP problem ``prob`` and a ``time_unit`` (seconds per model time unit) and returns
{"sol_status", "objective", "bound", "proven", "result", "infeasible", "watchdog"} in model units.

* CBC (PuLP's bundled binary) runs through a small wrapper script that records its pid, so that
  remat can signal it: a *watchdog* interrupts it (SIGINT: CBC stops and writes its incumbent)
  at `WATCHDOG_GRACE` past its time limit and kills it `WATCHDOG_KILL_S` later, because CBC does
  not honour its limit inside preprocessing and infeasibility proofs; `stop_at` interrupts it as
  soon as its log shows an incumbent at a bound known from elsewhere (then that bound proves it).
  Its log is followed live (`progress`), and its own result line and bound are read from it:
  PuLP reports a time-limited run with an incumbent as "Optimal", so ``proven`` is True only
  when CBC's log says "Optimal solution found" with no gap tolerance.  A CBC stopped inside its
  root cut loop prints its incumbent as its lower bound; such a bound is dropped.  CBC 2.10 can
  crash when its time limit runs out while it evaluates a MIP start: the solve is retried
  without it.
* HiGHS (highspy, the ``highs`` extra) gets what PuLP does not pass through: the variables'
  current values as a MIP start, and `give_up(elapsed, bound)`, asked at HiGHS's interrupt
  checks, which stops a solve that is not worth its time ("Interrupted by user": nothing
  proven).  Its process-wide thread pool is reset before each solve and its banner kept off
  stdout (`highs_ready`).
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time as _time
from typing import Any, Callable

import pulp

from remat.core.errors import InvalidInputError, SolverError

log = logging.getLogger(__name__)


_CBC_RESULT = re.compile(r"^Result - (.*)$", re.M)


_CBC_OBJ = re.compile(r"^Objective value:\s*([-+0-9.eE]+)", re.M)


_CBC_BOUND = re.compile(r"^Lower bound:\s*([-+0-9.eE]+)", re.M)


_CBC_EARLY_END = re.compile(r"^(Problem is infeasible.*|Pre-processing says infeasible.*)$", re.M)


def parse_cbc_log(text: str) -> dict:
    out: dict = {}
    m = _CBC_RESULT.findall(text)
    if m:
        out["result"] = m[-1].strip()
    m = _CBC_OBJ.findall(text)
    if m:
        out["objective"] = float(m[-1])
    m = _CBC_BOUND.findall(text)
    if m:
        out["lower_bound"] = float(m[-1])
    if "result" not in out:
        # presolve can end the run before the summary: "Problem is infeasible - 0.00 seconds",
        # "Pre-processing says infeasible or unbounded"
        m = _CBC_EARLY_END.findall(text)
        if m:
            out["result"] = m[-1].strip()
    return out


_CBC_INCUMBENT = re.compile(r"(?:Integer solution of|best solution,?)\s*([-+0-9.eE]+)")


_CBC_PROGRESS = re.compile(r"([-+0-9.eE]+) best solution, best possible ([-+0-9.eE]+)")


_CBC_CONTINUOUS = re.compile(r"Continuous objective value is ([-+0-9.eE]+)")


class _LogWatcher(threading.Thread):
    """Tails CBC's log while it runs and reports (elapsed s, incumbent, bound) in model units."""

    def __init__(self, path: str, callback: Callable[[float, float | None, float | None], None]):
        super().__init__(daemon=True)
        self.path, self.callback = path, callback
        self.done = threading.Event()
        self.incumbent: float | None = None
        self.bound: float | None = None

    def run(self) -> None:
        t0 = _time.perf_counter()
        pos = 0
        while not self.done.wait(0.5):
            try:
                with open(self.path) as fh:
                    fh.seek(pos)
                    chunk = fh.read()
                    pos = fh.tell()
            except OSError:
                continue
            changed = False
            for line in chunk.splitlines():
                for rx, key in ((_CBC_CONTINUOUS, "bound"), (_CBC_PROGRESS, "both"), (_CBC_INCUMBENT, "inc")):
                    mt = rx.search(line)
                    if not mt:
                        continue
                    if key == "bound":
                        self.bound = float(mt.group(1))
                    elif key == "both":
                        self.incumbent, self.bound = float(mt.group(1)), float(mt.group(2))
                    else:
                        self.incumbent = float(mt.group(1))
                    changed = True
                    break
            if changed:
                self.callback(_time.perf_counter() - t0, self.incumbent, self.bound)


# CBC overruns its own limit in preprocessing and infeasibility proofs: it is interrupted at
# limit * 1.1 + 3 s (SIGINT: it stops and writes its incumbent) and killed 5 s later (SIGINT does
# not stop its preprocessing)
WATCHDOG_GRACE = (1.1, 3.0)
WATCHDOG_KILL_S = 5.0


def cbc_limit_within(seconds: float) -> float:
    """The CBC time limit whose worst case (run to the watchdog's interrupt, then to its kill)
    ends within `seconds`: for a step that must end by then."""
    return (seconds - WATCHDOG_GRACE[1] - WATCHDOG_KILL_S) / WATCHDOG_GRACE[0]


class HiGHSRun(pulp.HiGHS):
    """PuLP's HiGHS solver with two things PuLP does not pass through highspy: with `start`, the
    variables' current values as a MIP start (highspy's setSolution; HiGHS ignores an infeasible
    one), and `give_up(running seconds, dual bound in model units or None)`, asked at HiGHS's MIP
    interrupt checks (its root cut loop included), which stops the solve when it returns True (the
    status is then "Interrupted by user": the incumbent and the bound stand, nothing is proven)."""

    def __init__(self, *args, start: bool = False, give_up: Callable[[float, float | None], bool] | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start, self.give_up = start, give_up

    def callSolver(self, lp):
        import highspy
        if self.start:
            start = highspy.HighsSolution()
            start.col_value = [float(v.varValue) if v.varValue is not None else 0.0 for v in lp.variables()]
            start.value_valid = True
            lp.solverModel.setSolution(start)  # columns are lp.variables() in order (buildSolverModel)
        if self.give_up is not None:
            def check(event) -> None:
                out = event.data_out
                bound = out.mip_dual_bound if math.isfinite(out.mip_dual_bound) else None
                if self.give_up(out.running_time, bound):
                    event.interrupt()
            lp.solverModel.cbMipInterrupt.subscribe(check)
        super().callSolver(lp)


_highs_banner_shown = False


def _swallow_highs_banner() -> None:
    """HiGHS writes its banner ("Running HiGHS ...: Copyright ...") to the C-level stdout once per
    process, at the first `Highs()`, before any option can turn it off: in `remat plan`'s output
    it landed between the progress lines, and in anything a caller prints to stdout.  That first
    `Highs()` is made here with file descriptor 1 pointed at /dev/null; where there is no such
    descriptor to redirect, the banner shows as before."""
    global _highs_banner_shown
    if _highs_banner_shown:
        return
    _highs_banner_shown = True
    import highspy
    try:
        sys.stdout.flush()  # (what Python holds for fd 1 goes out before fd 1 is swapped)
    except (ValueError, AttributeError):  # (a closed or missing sys.stdout)
        pass
    try:
        saved = os.dup(1)
    except OSError:  # (no descriptor 1)
        highspy.Highs()
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        os.close(saved)
        highspy.Highs()
        return
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(devnull)
        os.close(saved)


def highs_available() -> bool:
    """Whether the optional HiGHS backend (highspy, the `highs` extra) is installed."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def cbc_binary() -> str:
    return pulp.PULP_CBC_CMD().path


def _cbc_wrapper(pidfile: str, line_buffered: bool) -> str:
    """A script that records its pid in `pidfile` and execs pulp's CBC (line-buffered when asked
    and `stdbuf` exists, so its log can be followed live)."""
    stdbuf = shutil.which("stdbuf") if line_buffered else None
    run = f'"{stdbuf}" -oL "{cbc_binary()}"' if stdbuf else f'"{cbc_binary()}"'
    path = os.path.join(os.path.dirname(pidfile), "cbc.sh")
    with open(path, "w") as fh:
        fh.write(f'#!/bin/sh\necho $$ > "{pidfile}"\nexec {run} "$@"\n')
    os.chmod(path, 0o755)
    return path


def _signal_cbc(pidfile: str, sig: int) -> bool:
    """Send `sig` to the CBC that `_cbc_wrapper` started; False if it is not (yet) known."""
    try:
        with open(pidfile) as fh:
            os.kill(int(fh.read().strip()), sig)
        return True
    except (OSError, ValueError):
        return False


class _Watchdog(threading.Thread):
    """Interrupts CBC (SIGINT: it stops and writes its incumbent) when it runs well past its
    time limit, and kills it if that does not end it."""

    def __init__(self, pidfile: str, time_limit: float):
        super().__init__(daemon=True)
        self.pidfile, self.deadline = pidfile, time_limit * WATCHDOG_GRACE[0] + WATCHDOG_GRACE[1]
        self.done = threading.Event()
        self.fired: str | None = None

    def _signal(self, sig: int) -> bool:
        if not _signal_cbc(self.pidfile, sig):
            return False
        self.fired = "interrupted" if sig == signal.SIGINT else "killed"
        return True

    def run(self) -> None:
        if self.done.wait(self.deadline):
            return
        # (information: the caller gets CBC's incumbent, or its own fallback, and says what came of it)
        log.info("CBC is still running %.0f s after its start (time limit %.0f s); interrupting it",
                 self.deadline, (self.deadline - WATCHDOG_GRACE[1]) / WATCHDOG_GRACE[0])
        self._signal(signal.SIGINT)
        if not self.done.wait(WATCHDOG_KILL_S):
            self._signal(signal.SIGKILL)


def run_cbc(m: Any, time_limit: float | None, gap: float, threads: int | None, warm: bool,
             msg: bool, options: list[str] | None = None,
             progress: Callable[[float, float | None, float | None], None] | None = None,
             stop_at: float | None = None) -> dict:
    workdir = tempfile.mkdtemp(prefix="remat_cbc_")
    logpath = os.path.join(workdir, "cbc.log")
    pidfile = os.path.join(workdir, "pid")
    watcher = None
    guard = _Watchdog(pidfile, time_limit) if time_limit else None
    met = []
    if stop_at is not None:
        # an incumbent at a bound known from elsewhere is optimal: stop CBC there (SIGINT: it
        # writes its incumbent) instead of letting it try to prove what is already proven
        inner = progress

        def progress(elapsed: float, inc: float | None, bnd: float | None) -> None:
            if inner is not None:
                inner(elapsed, inc, bnd)
            if inc is not None and inc <= stop_at and not met:
                met.append(inc)
                _signal_cbc(pidfile, signal.SIGINT)
    try:
        # A MIP start under an elapsed-time limit crashes CBC more often than under a CPU-time
        # limit (the same with one thread, shorter with more).
        kw = dict(msg=msg, timeLimit=time_limit, gapRel=gap if gap > 0 else None, threads=threads,
                  warmStart=warm, logPath=logpath, timeMode="cpu" if warm and time_limit else "elapsed",
                  options=options or [])
        solver = pulp.COIN_CMD(path=_cbc_wrapper(pidfile, progress is not None), **kw)
        if progress is not None:
            watcher = _LogWatcher(logpath, progress)
            watcher.start()
        if guard is not None:
            guard.start()
        try:
            m.prob.solve(solver)
        except pulp.PulpSolverError:
            if guard is None or guard.fired is None:
                raise
        text = open(logpath).read() if os.path.exists(logpath) else ""
        info = parse_cbc_log(text)
        if met:
            info["result"] = "Stopped by remat (the incumbent meets a lower bound known from a relaxation)"
        if guard is not None and guard.fired is not None:
            info["watchdog"] = guard.fired
            info.setdefault("result", f"Stopped by remat ({guard.fired} {guard.deadline:.0f} s after the start, past "
                                      f"CBC's time limit)")
        return info
    finally:
        if guard is not None:
            guard.done.set()
        if watcher is not None:
            watcher.done.set()
            watcher.join()
        shutil.rmtree(workdir, ignore_errors=True)


def highs_ready() -> None:
    """Before any HiGHS solve in this process: a fresh thread pool (HiGHS fixes its pool at the
    first solve of the process and fails later solves that ask for another thread count: "Not
    Set") and its banner swallowed (`_swallow_highs_banner`)."""
    import highspy
    highspy.Highs.resetGlobalScheduler(True)
    _swallow_highs_banner()


def run(m: Any, backend: str, time_limit: float | None, gap: float, threads: int | None,
         warm: bool, msg: bool, options: list[str] | None = None,
         progress: Callable[[dict], None] | None = None, stop_at: float | None = None,
         give_up: Callable[[float, float | None], bool] | None = None) -> dict:
    """Solve `m` (anything with ``prob``, a PuLP problem, and ``time_unit``, seconds per model unit)
    with `backend` ("cbc" or "highs"); return {'sol_status', 'objective', 'bound', 'proven',
    'result', 'infeasible'} in model units (module docstring).

    `progress`, if given, is called with {"elapsed", "incumbent", "lower_bound", "gap"} (seconds
    of the schedule, not of the solve) whenever CBC's log shows a new incumbent or bound.
    `stop_at` (seconds of the schedule; CBC only): stop once an incumbent is that fast.
    `give_up(elapsed seconds of the solve, lower bound in seconds of the schedule or None)` (HiGHS
    only; `HiGHSRun`): stop the solve when it returns True.
    """
    offset = m.prob.objective.constant or 0.0  # solvers report objectives without the constant

    def seconds(value: float | None) -> float | None:  # a solver's objective value, in seconds of the schedule
        return None if value is None else (value + offset) * m.time_unit

    cb = None
    if progress is not None:
        def _cb(elapsed: float, inc: float | None, bnd: float | None) -> None:
            inc_s, bnd_s = seconds(inc), seconds(bnd)
            g = (inc_s - bnd_s) / inc_s if inc_s and bnd_s is not None and inc_s > 0 else None
            progress({"elapsed": elapsed, "incumbent": inc_s, "lower_bound": bnd_s, "gap": g})
        cb = _cb
    if backend == "cbc":
        t0 = _time.perf_counter()
        try:
            stop = None if stop_at is None else stop_at / m.time_unit - offset + 1e-9 * abs(stop_at / m.time_unit)
            info = run_cbc(m, time_limit, gap, threads, warm, msg, options, cb, stop)
        except pulp.PulpSolverError:
            # CBC 2.10 (the binary pulp ships) can crash when the time limit runs out while it
            # is still evaluating the MIP start; solve again without it (the caller keeps the
            # warm start as a fallback incumbent).
            left = None if time_limit is None else max(1.0, time_limit - (_time.perf_counter() - t0))
            log.info("CBC crashed while using the warm start; solving again without it (%s s)", left)
            try:
                info = run_cbc(m, left, gap, threads, False, msg, options, cb, stop)
            except pulp.PulpSolverError as e:
                raise SolverError(f"CBC failed: {e}") from None
        for key in ("objective", "lower_bound"):
            if key in info:
                info[key] += offset
        obj = pulp.value(m.prob.objective) if m.prob.sol_status in (1, 2) else None
        result = info.get("result", "")
        proven = m.prob.sol_status == 1 and result.startswith("Optimal solution found") and gap <= 0
        bound = info.get("lower_bound")
        if bound is not None and obj is not None and not proven and result.startswith("Stopped") \
                and bound >= obj - 1e-9 * max(1.0, abs(obj)):
            # CBC stopped inside its root cut loop prints a garbage "best possible" and then the
            # incumbent as its lower bound; a bound that met the incumbent would have ended the
            # search as optimal, so this one is no bound
            log.info("CBC stopped with its bound at its incumbent (%s): no bound", result)
            bound = None
        if bound is None and proven:
            bound = obj
        if bound is None and result.startswith("Optimal solution found") and obj is not None:
            # stopped by the gap tolerance: CBC's bound is within gap of the incumbent
            bound = obj / (1 + gap) if gap > 0 else obj
        return {"sol_status": m.prob.sol_status, "objective": obj, "bound": bound, "proven": proven,
                "result": result, "infeasible": "infeasible" in result.lower(), "watchdog": info.get("watchdog")}
    if backend == "highs":
        try:
            asked = None if give_up is None else (lambda elapsed, bnd: give_up(elapsed, seconds(bnd)))
            solver = HiGHSRun(msg=msg, timeLimit=time_limit, gapRel=gap if gap > 0 else None, threads=threads,
                               start=warm, give_up=asked)
        except Exception as e:  # pragma: no cover
            raise SolverError(f"HiGHS backend unavailable ({e}); install highspy or use --backend cbc")
        if not solver.available():
            raise SolverError("HiGHS backend unavailable: pip install highspy, or use --backend cbc")
        highs_ready()
        m.prob.solve(solver)
        h = m.prob.solverModel
        info = h.getInfo()
        status = h.modelStatusToString(h.getModelStatus())
        obj = pulp.value(m.prob.objective) if m.prob.sol_status in (1, 2) else None
        bound = getattr(info, "mip_dual_bound", None)
        if bound is not None and not math.isfinite(bound):
            bound = None
        if bound is not None:
            bound += offset
        proven = status == "Optimal" and (info.mip_gap <= 1e-9 if hasattr(info, "mip_gap") else True)
        if proven and obj is not None:
            # HiGHS rounds its dual bound up when the objective is integral and reports the
            # unrounded one (an optimum of 47 with a dual bound of 46, say)
            bound = obj if bound is None else max(bound, obj)
        return {"sol_status": m.prob.sol_status, "objective": obj, "bound": bound, "proven": proven,
                "result": status, "infeasible": status == "Infeasible"}
    raise InvalidInputError(f"--backend: unknown backend {backend!r}; use 'cbc' or 'highs'")


__all__ = ["run", "run_cbc", "parse_cbc_log", "cbc_limit_within", "highs_available", "highs_ready", "cbc_binary",
           "WATCHDOG_GRACE", "WATCHDOG_KILL_S"]
