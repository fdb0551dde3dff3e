"""Exhaustive search over every frontier-advancing schedule of a tiny graph.

Written independently of solvers/ilp.py, schedule.ops_from_stages and simulate, from the
semantics in schedule.py's docstring: per stage t a resident set S[t], swap-outs SO[t] of
resident values, swap-ins SI[t] of host copies (usable from t+1), fetches SF[t] of host copies
(waited for, usable in t), the minimal recomputation R[t]
that the next resident set needs, Checkmate's release rule, and stage time = max(compute,
transfer, plus fetches before both); a node's persistent bytes count from the stage after the
one that computes it first (stage t computes t) on, and all of them at the step's end.  A dynamic program over the exact state (resident set, host set) per stage: every
schedule is a path through it, so its minimum is the true optimum of the model.
"""
from __future__ import annotations

import itertools
from functools import lru_cache


def _subsets(items):
    items = sorted(items)
    for r in range(len(items) + 1):
        yield from itertools.combinations(items, r)


def exhaustive_optimum(graph, budget_bytes: int, swap: bool, bandwidth: float | None = None,
                       recompute_backward: bool = False):
    """Minimal total time of a schedule whose device peak (fixed bytes included) fits, or None."""
    n = graph.n
    M = [v.bytes for v in graph.nodes]
    W = [v.workspace_bytes for v in graph.nodes]
    C = [v.time for v in graph.nodes]
    CR = graph.recompute_times  # (stage t computes t for the first time; any other compute in it is a recomputation)
    P = [v.persistent_bytes for v in graph.nodes]  # allocated at a node's first compute, kept
    bw = bandwidth if bandwidth is not None else graph.bandwidth
    preds, succs = graph.preds, graph.succs
    B = budget_bytes - graph.fixed_bytes

    # an op with several parts (graph.py): recomputed whole; the stages of its later parts
    # compute their part and nothing else, and bring nothing back
    op = {}
    for v in graph.nodes:
        if v.part_of is not None:
            op.setdefault(v.part_of, [v.part_of]).append(v.id)
    member_of = {m: ms for ms in op.values() for m in ms}
    part_stage = {m for ms in op.values() for m in ms[1:]}

    def closure(targets, resident, t):
        R = set()
        stack = list(targets)
        while stack:
            x = stack.pop()
            if x in R:
                continue
            R.add(x)
            if x in member_of and member_of[x][-1] < t:
                stack.extend(member_of[x])
            stack.extend(u for u in preds[x] if u not in resident and u not in R)
        return R

    def stage(t, S, SO, SI, SF, R, nxt):
        mem = sum(P[:t]) + sum(M[i] for i in S) + sum(M[i] for i in SI) + sum(M[i] for i in SF)
        peak = mem
        for k in sorted(R):
            peak = max(peak, mem + M[k] + W[k])
            mem += M[k]
            for i in set(preds[k]):
                if i in nxt or i in SO:
                    continue
                if any(j > k and j in R for j in succs[i]):
                    continue
                mem -= M[i]
        if t == n - 1:
            peak = max(peak, sum(P))  # the step's end: every other value freed, every persistent byte there
        fetch = sum(M[i] / bw for i in SF)
        time = fetch + max(sum(C[k] if k == t else CR[k] for k in R), sum(M[i] / bw for i in SO | SI))
        return peak, time

    @lru_cache(maxsize=None)
    def best(t, S, H):
        if t == n:
            return 0.0
        S_set, H_set = set(S), set(H)
        result = None
        # dominated choices left out: keeping a value nothing ever reads (a sink), swapping out a
        # value no later stage can read, fetching a value the stage neither reads nor keeps
        nxt_choices = list(_subsets([i for i in range(t + 1) if succs[i]])) if t + 1 < n else [()]
        for SF in (_subsets(H_set - S_set) if swap and t not in part_stage else [()]):
            SF_set = set(SF)
            resident = S_set | SF_set
            for nxt in nxt_choices:
                nxt_set = set(nxt)
                fresh = [i for i in nxt_set if i not in resident and i != t]
                swappable = [i for i in fresh if i in H_set] if swap and t not in part_stage else []
                for SI in _subsets(swappable):
                    SI_set = set(SI)
                    R = closure({t} | (set(fresh) - SI_set), resident, t)
                    if R & (SI_set | SF_set | S_set):
                        continue  # recomputed anyway: dominated by the choice without the swap-in (or keep)
                    if t in part_stage and R != {t}:
                        continue
                    if not recompute_backward and any(k != t and graph.nodes[k].kind != "forward" for k in R):
                        continue  # autograd runs each backward node (and the loss) exactly once
                    if any(i not in nxt_set and not any(k in R for k in succs[i]) for i in SF_set):
                        continue
                    so_choices = (_subsets([i for i in S_set - H_set if max(succs[i]) > t
                                            and (recompute_backward or graph.nodes[i].kind == "forward")])
                                  if (swap and t + 1 < n) else [()])
                    for SO in so_choices:
                        SO_set = set(SO)
                        peak, time = stage(t, S_set, SO_set, SI_set, SF_set, R, nxt_set)
                        if peak > B:
                            continue
                        rest = best(t + 1, tuple(sorted(nxt_set)), tuple(sorted(H_set | SO_set)))
                        if rest is None:
                            continue
                        if result is None or time + rest < result:
                            result = time + rest
        return result

    return best(0, (), ())
