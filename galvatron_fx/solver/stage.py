"""Exact per-stage solve, in bytes: the best strategy of every layer of one pipeline stage.

Problem. For the layers ``l = 0..n-1`` of a stage and candidate strategies ``s``::

    minimise    sum_l T[l, s_l]  +  sum_l R_l(g(s_l), g(s_l+1))  +  P[s_n-1]
    subject to  sum_l M[l, s_l]  +  max_l X[l, s_l]  <=  budget

and, where a host budget is given (CPU offload), ``sum_l H[l, s_l] <= host_budget``.

``T`` seconds per layer, ``M`` additive bytes per device (states and in-flight activations),
``X`` transient bytes (the layer's largest temporary buffer: only the largest one *among the chosen
strategies* counts), ``R_l`` resharding seconds between the layout groups ``g(s)`` of consecutive
layers (strategies with the same activation layout share a group), ``P`` seconds to hand the last
layer's output to the next stage, ``H`` bytes kept in host memory.

:func:`solve_stage_exact` returns the optimum of exactly this problem: nothing is rounded in the
answer, memory is compared in bytes. How:

1. **Transient thresholds.** For every distinct transient value ``t`` let ``F(t)`` be the best cost
   using only strategies with ``X <= t`` under the additive budget ``budget - t``. The optimum is
   ``min_t F(t)``: each ``F(t)``'s solution fits (its largest transient is at most ``t``), and the
   optimum, whose largest transient is some ``t*``, is a candidate of ``F(t*)``.
2. **Bounds.** ``V(t)``, the best cost with ``X <= t`` ignoring memory (a Viterbi pass for all
   thresholds at once; a threshold whose Viterbi path fits is solved by it), and ``D(t)``, the
   Lagrangian bound ``min_path(cost + lam * bytes) - lam * (budget - t)`` on a grid of ``lam``, are
   lower bounds of ``F(t)``. Thresholds closer than ``room / BAND_DIVISOR`` form a *band*, searched
   once over the sequences whose largest transient lies in it (those below it are another band's, or
   have a bound showing they cannot win); bands go in ascending bound order and stop once the bound
   reaches the best cost found (or the caller's ``cutoff``).
3. **One band** is a resource-constrained shortest path on the layered graph. A dynamic programme
   over layers x strategies x memory units of ``g`` bytes solves a *relaxation* exactly: each layer's
   bytes above its cheapest allowed strategy are rounded **down** to units, the budget up
   (``sum floor <= floor sum``, so every sequence that fits in bytes fits in units; the table is a
   lower bound of the cost of layers ``0..l`` ending on ``s`` within ``e`` units). If the
   relaxation's optimum fits in bytes it is the answer; the same DP rounded **up** gives a sequence
   that surely fits (a cutoff). Otherwise an A* search runs from the last layer backwards over labels
   (layer, strategy, bytes, largest transient, cost) with the table as its admissible heuristic (the
   cost-to-come of the remaining layers within the remaining bytes); a label no better in bytes,
   transient and cost than another at the same (layer, layout group) is dropped (:func:`_astar`).
   The first complete label popped is the optimum. After ``ASTAR_EXPANSIONS`` expansions the
   relaxation is rebuilt 8x finer (up to ``MAX_TABLE_BYTES``) and the search restarts: the answer
   does not depend on it, only the time.
4. **The host budget** (:func:`binding_host`). Every bound above ignores it (relaxing a constraint
   only lowers the optimum), so they stay lower bounds; every *acceptance* (a Viterbi path, the
   relaxation's optimum, the rounded-up cutoff sequence) also checks ``sum H``, and the A* labels
   carry the host bytes of their layers, dropped when those plus the least host bytes of the layers
   before exceed the budget; dominance then also needs no more host bytes. When even the hungriest
   allowed sequence fits the host budget it cannot bind: the solve is the one without it.

Work: the Viterbi pass is ``O(n * Q * S * G)`` for ``Q`` thresholds and ``G`` layout groups; each
relaxation ``O(n * (S + G^2) * E)`` for ``E`` units (``units``, by default ``32 n`` clamped to
256..2048); the A* search visits only labels whose bound is below the optimum. Costs are summed
layer by layer from the first as :func:`galvatron_fx.solver.objective.estimate_plan` does; bounds,
summed otherwise, are compared with a relative slack of 1e-12 so that round-off never prunes a
solution. Ties: the Viterbi and relaxation walks take the lowest strategy index among equal
minima; results are deterministic.

Pure: numpy arrays in, a dataclass out.

Size: one file, over 500 lines: the exact per-stage solver and its optimality argument (the
relaxation, the A* walk and the Viterbi fallback share one bound and one cost order) read top to
bottom here.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

DEFAULT_UNITS = 256
"""Least memory units of the relaxation (its resolution, not the answer's: the answer is exact in
bytes). By default a stage of ``n`` layers gets ``clamp(32 n, 256, 2048)`` units, so the
relaxation's rounding loss (at most ``n`` units) stays near 1/32 of the room it rounds."""

_DOWN = 1.0 - 1e-12  # round the relaxation's layer memory down, its budget up, past float noise
_UP = 1.0 + 1e-12
_SLACK = 1.0 + 1e-12  # bounds summed in another order may exceed the cost they bound by round-off


@dataclass(frozen=True)
class ExactStage:
    """Result of :func:`solve_stage_exact`.

    ``feasible``: a sequence fits the budget and costs less than ``cutoff``. ``cost``: its cost in
    seconds (``inf`` when not feasible). ``strategies``: per-layer strategy indices. ``memory_bytes``:
    the solution's ``sum M + max X``; ``transient_bytes`` its ``max X``. ``min_memory_bytes``: the
    least ``sum M + max X`` of any allowed sequence (``inf`` when a layer allows nothing): with
    ``min_memory_bytes <= budget`` but not ``feasible``, everything that fits (the host budget too)
    costs at least ``cutoff``. ``cutoff``: echoed. ``fits``: some allowed sequence may fit (whatever
    its cost); ``False`` when none fits the budget, or none also fits the host budget (``min_memory_bytes``
    ignores the host). ``host_bytes``: the solution's ``sum H`` (0 without ``host``).
    """

    feasible: bool
    cost: float
    strategies: tuple[int, ...]
    memory_bytes: float
    transient_bytes: float
    min_memory_bytes: float
    cutoff: float
    fits: bool
    host_bytes: float = 0.0


def _check(time, mem, transient, reshard, groups, final):
    T = np.asarray(time, dtype=np.float64)
    if T.ndim != 2 or T.shape[0] < 1 or T.shape[1] < 1:
        raise ConfigError(f"time must be a non-empty [n, S] array, got shape {T.shape}")
    n, S = T.shape
    M = np.asarray(mem, dtype=np.float64)
    X = np.asarray(transient, dtype=np.float64) if transient is not None else np.zeros((n, S))
    for name, a in (("mem", M), ("transient", X)):
        if a.shape != (n, S):
            raise ConfigError(f"{name} must have the shape of time {(n, S)}, got {a.shape}")
    for name, a in (("time", T), ("mem", M), ("transient", X)):
        if np.isnan(a).any() or (a < 0).any():
            raise ConfigError(f"{name} must be >= 0 (inf = strategy not allowed), got NaN or < 0")
    gid = np.arange(S) if groups is None else np.asarray(groups, dtype=np.int64)
    if gid.shape != (S,) or (gid < 0).any():
        raise ConfigError(f"groups must give one group index >= 0 per strategy ({S}), got {gid}")
    G = int(gid.max()) + 1
    used, dense = np.unique(gid, return_inverse=True)  # renumber the groups present as 0..G'-1
    if reshard is None:
        R = np.zeros((max(n - 1, 0), G, G))
    else:
        R = np.asarray(reshard, dtype=np.float64)
        if R.shape == (G, G):
            R = np.broadcast_to(R, (max(n - 1, 0), G, G))
    if R.shape != (max(n - 1, 0), G, G):
        raise ConfigError(f"reshard must have shape {(max(n - 1, 0), G, G)} or {(G, G)}, got {R.shape}")
    if not np.isfinite(R).all() or (R < 0).any():
        raise ConfigError("reshard must be finite seconds >= 0 between every pair of layout groups")
    R, gid = R[:, used][:, :, used], dense.astype(np.int64)
    P = np.zeros(S) if final is None else np.asarray(final, dtype=np.float64)
    if P.shape != (S,) or not np.isfinite(P).all() or (P < 0).any():
        raise ConfigError(f"final must be {S} finite seconds >= 0, got {P}")
    return T, M, X, R, gid, P


def path_cost(T: np.ndarray, R: np.ndarray, gid: np.ndarray, P: np.ndarray, path) -> float:
    """Cost of a strategy sequence, summed as :func:`~galvatron_fx.solver.objective.estimate_plan`
    does: ``t = 0; t += T[0]; t += T[l] + R[l-1]; ...; t += P``."""
    t = 0.0
    for l, s in enumerate(path):
        lt = float(T[l, s])
        if l:
            lt += float(R[l - 1, gid[path[l - 1]], gid[s]])
        t += lt
    return t + float(P[path[-1]])


def _memory_dp(T, u, allowed, R, gid, starts, E: int):
    """Forward DP over memory units (layer memories ``u``, inf ``T`` = not allowed):
    ``pre[l, g, e]``, the least cost of layers ``0..l-1`` within ``e`` units plus the resharding
    into group ``g`` at layer ``l`` (``pre[0] = 0``), and ``last[s, e]``, the least cost of every
    layer ending on ``s`` within ``e`` units. ``C(l, s, e) = pre[l, g(s), e - u[l, s]] + T[l, s]``
    (see :func:`_cost_at`), so only ``pre`` is kept."""
    n, S = T.shape
    G = len(starts)
    ends = list(starts[1:]) + [S]
    pre = np.zeros((n, G, E + 1))
    prev = np.full((S, E + 1), np.inf)
    for s in np.flatnonzero(allowed[0]):
        if u[0, s] <= E:
            prev[s, u[0, s]:] = T[0, s]
    for l in range(1, n):
        gmin = np.stack([prev[a:b].min(axis=0) for a, b in zip(starts, ends)])   # [G, E+1]
        pre[l] = (gmin[:, None, :] + R[l - 1][:, :, None]).min(axis=0)          # into group g
        cur = np.full((S, E + 1), np.inf)
        for s in np.flatnonzero(allowed[l]):
            k = int(u[l, s])
            if k <= E:
                np.add(pre[l][gid[s], :E + 1 - k], T[l, s], out=cur[s, k:])
        prev = cur
    return pre, prev


def _cost_at(pre, T, u, allowed, gid, l: int, e: int) -> np.ndarray:
    """``[S]``: the least cost of layers ``0..l`` ending on each strategy within ``e`` units."""
    src = e - u[l]
    if l == 0:
        return np.where(allowed[0] & (src >= 0), T[0], np.inf)
    return np.where(allowed[l] & (src >= 0), pre[l][gid, np.clip(src, 0, pre.shape[2] - 1)] + T[l], np.inf)


def _walk(pre, last, T, u, allowed, R, gid, P, e: int) -> list[int] | None:
    """The optimal sequence of a :func:`_memory_dp` within ``e`` units (lowest indices on ties)."""
    final = last[:, e] + P
    s = int(np.argmin(final))
    if not np.isfinite(final[s]):
        return None
    path = [s]
    for l in range(len(pre) - 1, 0, -1):
        e -= int(u[l, s])
        s = int(np.argmin(_cost_at(pre, T, u, allowed, gid, l - 1, e) + R[l - 1][gid, gid[s]]))
        path.append(s)
    return path[::-1]


class _Relaxation:
    """The memory DPs of one allowed set (module docstring, step 3): bytes above each layer's
    cheapest strategy in units of ``g``, rounded down (the relaxation: a lower bound) and, on
    request, up (a restriction: a sequence that surely fits)."""

    def __init__(self, T, M, R, gid, starts, P, allowed, cap_max: float, units: int,
                 granularity: float | None):
        n, S = T.shape
        Ma = np.where(allowed, M, np.inf)
        self.base = Ma.min(axis=1)
        self.excess = np.where(allowed, Ma - self.base[:, None], np.inf)
        room = cap_max - float(self.base.sum())
        self.ok = room >= 0 and np.isfinite(room)
        self.units = units
        if not self.ok:
            return
        g = float(granularity) if granularity else (room / units if room > 0 else 1.0)
        self.g = g
        ex = np.where(allowed, self.excess, 0.0)
        self.u = np.where(allowed, np.maximum(np.floor(ex / g * _DOWN), 0), -1).astype(np.int64)
        self.u_up = np.where(allowed, np.ceil(ex / g * _UP), -1).astype(np.int64)
        self.E = min(self.units_for(room), int(np.where(allowed, self.u, 0).max(axis=1).sum()))
        self.allowed = allowed
        Ta = np.where(allowed, T, np.inf)
        self.pre, self.last = _memory_dp(Ta, self.u, allowed, R, gid, starts, self.E)
        self.T, self.R, self.gid, self.P, self.starts = Ta, R, gid, P, starts

    def units_for(self, room: float) -> int:
        """Relaxed units for ``room`` bytes above the layers' cheapest strategies (rounded up)."""
        return int(np.floor(room / self.g * _UP))

    def lower_bound(self, room: float) -> float:
        """The relaxation's optimum (a lower bound of the exact one) within ``room`` bytes."""
        if not self.ok or room < 0:
            return math.inf
        e = min(self.units_for(room), self.E)
        return float(np.min(self.last[:, e] + self.P))

    def walk(self, room: float) -> list[int] | None:
        """The relaxation's optimal sequence within ``room`` bytes."""
        return _walk(self.pre, self.last, self.T, self.u, self.allowed, self.R, self.gid, self.P,
                     min(self.units_for(room), self.E))

    def restricted(self, room: float, allowed: np.ndarray | None = None) -> list[int] | None:
        """The best sequence (of ``allowed``, default all) with every layer's bytes rounded *up* to
        units: it fits in ``room`` bytes."""
        allowed = self.allowed if allowed is None else allowed & self.allowed
        if not allowed.any(axis=1).all():
            return None
        e = int(np.floor(room / self.g * _DOWN))
        top = int(np.where(allowed, self.u_up, 0).max(axis=1).sum())
        e = min(e, top)
        if e < 0:
            return None
        T = np.where(allowed, self.T, np.inf)
        pre, last = _memory_dp(T, self.u_up, allowed, self.R, self.gid, self.starts, e)
        return _walk(pre, last, T, self.u_up, allowed, self.R, self.gid, self.P, e)

    def bound_before(self, l: int, s: int, room: float) -> float:
        """Least relaxed cost of layers ``0..l-1`` feeding strategy ``s`` at layer ``l`` within
        ``room`` bytes (0 for ``l == 0``)."""
        if l == 0:
            return 0.0
        return float(self.pre[l][self.gid[s], min(self.units_for(room), self.E)])


_LIMIT = object()


class _Key(tuple):
    """An A* label's ``(largest transient, host bytes)`` under a binding host budget, ordered
    component-wise: ``a <= b`` reads "no larger transient and no more host bytes" (dominance), as a
    float transient alone does without a host budget."""

    __slots__ = ()

    def __le__(self, other) -> bool:
        return self[0] <= other[0] and self[1] <= other[1]


def _host_fits(host, path) -> bool:
    """Whether ``path`` keeps within the host budget (``host``: ``(H, budget)``; ``None``: no bound)."""
    return host is None or float(host[0][np.arange(len(path)), path].sum()) <= host[1]


def binding_host(host, allowed: np.ndarray, host_budget: float) -> np.ndarray | None:
    """``host`` as ``[n, S]`` floats where the host budget may bind, else ``None``: no allowed
    strategy keeps host bytes, or even the hungriest allowed sequence (each layer's most) fits
    (module docstring, step 4: the solve is then exactly the one without a host budget)."""
    if host is None:
        return None
    H = np.asarray(host, dtype=np.float64)
    worst = np.where(allowed, H, 0.0)
    if not (worst > 0).any() or float(worst.max(axis=1).sum()) <= host_budget:
        return None
    return H


def _astar(rel: _Relaxation, X: np.ndarray, room: float, cutoff: float, limit: int | None = None,
           floor: float = 0.0, host=None):
    """Exact search of step 3 (module docstring): the cheapest sequence whose bytes above the
    cheapest strategies plus its largest transient ``X`` are within ``room``, if one costs less than
    ``cutoff`` (else ``None``); ``_LIMIT`` after ``limit`` expansions. Sequences whose largest
    transient is below ``floor`` need not be found (the caller has them already): bounds assume the
    largest transient is at least ``floor``.

    A label (layer ``l``, strategy ``s``, bytes ``mu`` of layers ``l..``, largest transient ``tau``
    of layers ``l..``, cost ``k``) is completed by layers ``0..l-1`` within ``room - mu - tau`` bytes
    at best, so ``k`` plus the relaxation's cost-to-come there is a lower bound of every completion.
    Dominance: what completes a label depends on its strategy only through its layout group ``g``
    (the resharding into it), so a label at group ``g`` is dropped when one at group ``h`` has no
    more bytes, no larger transient and a cost ``k_h + D(h, g) <= k``, with
    ``D(h, g) = max_f R(f, h) - R(f, g)`` the most the resharding into ``h`` can cost beyond that
    into ``g`` (0 for ``h = g``): whatever completes it completes the other at no higher cost.
    ``host`` (``(H, budget)``, module docstring step 4): labels also carry ``H`` of layers ``l..``.
    """
    # NOTE: one function (93 lines): one best-first search loop; its pruning steps share the frontier and the bound
    T, R, gid, P, ex = rel.T, rel.R, rel.gid, rel.P, rel.excess
    n = T.shape[0]
    G = int(gid.max()) + 1
    # D[l][h, g]: the largest extra resharding into layer l on group h over group g
    D = [np.zeros((G, G))] + [(R[l - 1][:, :, None] - R[l - 1][:, None, :]).max(axis=0) for l in range(1, n)]
    heap: list = []
    fronts: list[list[dict[float, tuple[list, list, list]]]] = [[{} for _ in range(G)] for _ in range(n)]
    counter = 0
    pre, g, E = rel.pre, rel.g, rel.E
    H, hcap = host if host is not None else (None, math.inf)
    if H is not None:   # the least host bytes of layers 0..l-1
        before = np.r_[0.0, np.cumsum(np.where(rel.allowed, H, np.inf).min(axis=1))]

    def push(l: int, s: int, mu: float, tau: float, k: float, b: float, parent, hs=None) -> None:
        nonlocal counter
        grp = int(gid[s])
        key = tau if hs is None else _Key((tau, hs))   # fronts keyed by transient (and host bytes)
        here, offset = fronts[l], D[l][:, grp]
        for h in range(G):
            kk = k - offset[h]
            for t2, (mus, ks, _) in here[h].items():
                if t2 <= key:
                    i = bisect.bisect_right(mus, mu) - 1
                    if i >= 0 and ks[i] <= kk + 1e-12 * abs(k):
                        return  # dominated (see the docstring)
        mus, ks, nodes = here[grp].setdefault(key, ([], [], []))
        node = [l, s, mu, tau, k, parent, True, hs]
        pos = bisect.bisect_left(mus, mu)
        while pos < len(mus) and ks[pos] >= k:
            nodes[pos][6] = False  # now dominated by the new label
            del mus[pos], ks[pos], nodes[pos]
        mus.insert(pos, mu)
        ks.insert(pos, k)
        nodes.insert(pos, node)
        counter += 1
        heapq.heappush(heap, (b, counter, node))

    def expand(l: int, mus: np.ndarray, taus: np.ndarray, ks: np.ndarray, parent, hss=None) -> None:
        """Push the labels of layer ``l`` (per strategy: bytes, transient, cost, host bytes) that may win."""
        left = room - mus - taus
        ok = np.isfinite(ks) & (left >= 0)
        if hss is not None:
            ok &= hss + before[l] <= hcap
        if l:
            left = np.maximum(room - mus - np.maximum(taus, floor), 0.0)
            e = np.minimum((np.where(ok, left, 0.0) / g * _UP).astype(np.int64), E)
            bs = ks + pre[l][gid, e]
        else:
            bs = ks
        for s2 in np.flatnonzero(ok & (bs < cutoff)):
            push(l, int(s2), float(mus[s2]), float(taus[s2]), float(ks[s2]), float(bs[s2]), parent,
                 None if hss is None else float(hss[s2]))

    expand(n - 1, ex[n - 1].copy(), X[n - 1].copy(), T[n - 1] + P, None, None if H is None else H[n - 1].copy())
    pops = 0
    while heap:
        b, _, node = heapq.heappop(heap)
        if not node[6]:
            continue
        if b >= cutoff:
            return None
        l, s, mu, tau, k = node[0], node[1], node[2], node[3], node[4]
        if l == 0:
            path = []
            while node is not None:
                path.append(node[1])
                node = node[5]
            return k, path
        pops += 1
        if limit is not None and pops > limit:
            return _LIMIT
        expand(l - 1, mu + ex[l - 1], np.maximum(tau, X[l - 1]), k + R[l - 1][gid, gid[s]] + T[l - 1], node,
               None if H is None else node[7] + H[l - 1])
    return None


BAND_DIVISOR = 128
"""Transient thresholds closer than ``room / BAND_DIVISOR`` (the stage's bytes above its leanest
strategies) are searched together."""

ASTAR_EXPANSIONS = 512
"""Expansions before the A* search refines its relaxation (8x the units) and starts again."""

MAX_TABLE_BYTES = 1 << 28
"""Largest memory-DP table (``pre``: layers x groups x units, float64) a refinement may build."""


def _solve_memory(make, rel: _Relaxation, X: np.ndarray, cap: float, cutoff: float, n: int, S: int,
                  refine: bool = True, floor: float = 0.0, host=None):
    """Exact steps 2-3 over the allowed strategies: ``(cost, path)`` of the best sequence with
    ``sum M + max X <= cap`` (and within ``host``, ``(H, budget)``: step 4) costing less than
    ``cutoff``, or ``None``; sequences whose largest transient is below ``floor`` need not be found.
    ``make(units)`` builds a finer relaxation (used when ``refine``)."""
    best = None
    rows = np.arange(n)
    Xa = np.where(rel.allowed, X, np.inf)
    least_x, most_x = float(Xa.min(axis=1).max()), float(np.where(rel.allowed, X, 0.0).max())
    least_x = max(least_x, floor)
    while True:
        if not rel.ok:
            return best
        room = cap - float(rel.base.sum())  # for bytes above the cheapest strategies and the transient
        if rel.lower_bound(room - least_x) >= cutoff:
            return best
        path = rel.walk(room - least_x)
        in_bytes = path is not None and float(rel.excess[rows, path].sum() + X[rows, path].max()) <= room
        if in_bytes and _host_fits(host, path):
            cost = path_cost(rel.T, rel.R, rel.gid, rel.P, path)  # the relaxation's optimum fits
            return (cost, path) if cost < cutoff else best
        # a sequence that surely fits, for a cutoff: rounded up, with the relaxed optimum's largest
        # transient (strategies with larger ones left out), else with the largest of all
        tau = float(X[rows, path].max()) if path is not None else most_x
        up = rel.restricted(room - tau, X <= tau)
        if up is None:
            up = rel.restricted(room - most_x)
        if up is not None and float(rel.excess[rows, up].sum() + X[rows, up].max()) <= room and _host_fits(host, up):
            cost = path_cost(rel.T, rel.R, rel.gid, rel.P, up)
            if cost < cutoff:
                best, cutoff = (cost, up), cost * _SLACK
                if cost <= rel.lower_bound(room - least_x) * (1 + 1e-12):
                    return best
        finer = rel.units * 8
        # (refine only where the relaxation's rounding fails its optimum; not where the host does)
        last = not refine or in_bytes or 8 * n * (int(rel.gid.max()) + 1) * (finer + 1) > MAX_TABLE_BYTES
        found = _astar(rel, X, room, cutoff, None if last else ASTAR_EXPANSIONS, floor, host)
        if found is not _LIMIT:
            if found is None:
                return best
            cost = path_cost(rel.T, rel.R, rel.gid, rel.P, found[1])
            return (cost, found[1]) if best is None or cost < best[0] else best
        rel = make(finer)


def _viterbi(Tq: np.ndarray, R: np.ndarray, gid: np.ndarray, P: np.ndarray):
    """Least cost ignoring memory for each threshold's allowed set (``Tq[q, l, s]``, inf = not
    allowed): ``(cost[q], path[q, n])``."""
    Q, n, S = Tq.shape
    cur = Tq[:, 0, :]
    preds = np.zeros((max(n - 1, 0), Q, S), dtype=np.int64)
    for l in range(1, n):
        via = cur[:, :, None] + R[l - 1][gid][None, :, :]            # [Q, S', G]
        arg = via.argmin(axis=1)                                     # [Q, G]
        best = np.take_along_axis(via, arg[:, None, :], axis=1)[:, 0, :]
        preds[l - 1] = arg[:, gid]
        cur = best[:, gid] + Tq[:, l, :]
    tot = cur + P[None, :]
    s = tot.argmin(axis=1)
    cost = tot[np.arange(Q), s]
    path = np.empty((Q, n), dtype=np.int64)
    path[:, n - 1] = s
    for l in range(n - 1, 0, -1):
        s = preds[l - 1][np.arange(Q), s]
        path[:, l - 1] = s
    return cost, path


def _dual_bounds(T, M, R, gid, P, A, caps, steps: int = 13) -> np.ndarray:
    """Lagrangian lower bounds of each threshold's additive problem (``A[q]`` allowed, budget
    ``caps[q]``): for any ``lam >= 0`` no sequence within the budget costs less than
    ``min_path (cost + lam * bytes) - lam * budget``; the best of a geometric grid of ``lam``."""
    base = np.where(A, M[None], np.inf).min(axis=2)                     # [Q, n]
    ex = np.where(A, M[None] - base[:, :, None], 0.0)
    room = caps - base.sum(axis=1)                                       # [Q]
    Ta = np.where(A, T[None], np.inf)
    spread = np.where(A, Ta, np.nan)
    with np.errstate(invalid="ignore"):
        dt = np.nan_to_num(np.nanmax(spread, axis=2) - np.nanmin(spread, axis=2)).sum()
        dm = float(ex.max(axis=2).sum(axis=1).max())
    best = np.full(len(caps), -np.inf)
    if dt <= 0 or dm <= 0:
        return best
    lam0 = dt / dm  # the time per byte of trading every layer's fastest strategy for its leanest
    for lam in lam0 * np.geomspace(1 / 64, 4, steps):
        c, _ = _viterbi(Ta + lam * ex, R, gid, P)
        best = np.maximum(best, c - lam * room)
    return best


def stage_min_memory(mem: np.ndarray, transient: np.ndarray, allowed: np.ndarray) -> float:
    """Least ``sum_l M[l, s_l] + max_l X[l, s_l]`` over the allowed sequences (``inf`` if a layer
    allows nothing): the minimum over transient thresholds ``t`` of ``t + sum_l min_{X <= t} M``."""
    M, X = np.asarray(mem, dtype=np.float64), np.asarray(transient, dtype=np.float64)
    ths = np.unique(X[allowed])
    if ths.size == 0:
        return math.inf
    A = allowed[None] & (X[None] <= ths[:, None, None])
    per = np.where(A, M[None], np.inf).min(axis=2).sum(axis=1)
    return float(np.min(ths + per))


def solve_stage_exact(time, mem, transient=None, reshard=None, budget_bytes: float = math.inf, *,
                      groups=None, final=None, units: int | None = None, granularity: float | None = None,
                      cutoff: float = math.inf, host=None, host_budget: float = math.inf) -> ExactStage:
    """The best per-layer strategies of one stage, exact in bytes (module docstring).

    ``time[n, S]`` seconds (``inf`` = not allowed), ``mem[n, S]`` additive bytes, ``transient[n, S]``
    bytes (``None``: zeros), ``reshard`` seconds ``[n-1, G, G]`` (or one ``[G, G]``, or ``None`` for
    zeros) between the layout groups ``groups[S]`` (default: every strategy its own group) of layers
    ``l`` and ``l+1``, ``final[S]`` seconds added for the last layer's strategy, ``budget_bytes`` per
    device. ``units`` / ``granularity`` (bytes per unit) set the relaxation's resolution (speed
    only). Only solutions costing less than ``cutoff`` are sought. ``host[n, S]`` (``None``: zeros)
    bytes kept in host memory, at most ``host_budget`` in sum (module docstring, step 4).
    """
    # NOTE: one function (102 lines): the exact solve's stages (bounds, relaxation, walk, fallback) in order, sharing their tables
    T, M, X, R, gid, P = _check(time, mem, transient, reshard, groups, final)
    n, S = T.shape
    if units is None:
        units = min(max(DEFAULT_UNITS, 32 * n), 8 * DEFAULT_UNITS)
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ConfigError(f"units must be an int >= 1, got {units!r}")
    budget = float(budget_bytes)
    allowed = np.isfinite(T) & np.isfinite(M) & np.isfinite(X)
    if host is not None:
        host = np.asarray(host, dtype=np.float64)
        if host.shape != (n, S) or np.isnan(host).any() or (host < 0).any():
            raise ConfigError(f"host must be an [n, S] = {(n, S)} array of bytes >= 0, got shape {host.shape}")
        allowed &= np.isfinite(host)
    H = binding_host(host, allowed, float(host_budget))   # None: today's solve (step 4)

    def nothing(minmem: float = math.inf, fits: bool = False) -> ExactStage:
        return ExactStage(False, math.inf, (), 0.0, 0.0, minmem, cutoff, fits)

    ths = np.unique(X[allowed])
    if ths.size == 0 or not allowed.any(axis=1).all():
        return nothing()
    A = allowed[None] & (X[None] <= ths[:, None, None])               # [Q, n, S]
    minmem_q = np.where(A, M[None], np.inf).min(axis=2).sum(axis=1)    # [Q]
    minmem = float(np.min(ths + minmem_q))
    if not minmem <= budget:
        return nothing(minmem)
    # group-sorted strategy order inside (reduceat needs contiguous groups); mapped back at the end
    perm = np.argsort(gid, kind="stable")
    Tp, Mp, Xp, Pp, gp, A = T[:, perm], M[:, perm], X[:, perm], P[perm], gid[perm], A[:, :, perm]
    starts = np.flatnonzero(np.r_[True, gp[1:] != gp[:-1]])
    fit_q = ths + minmem_q <= budget
    hcap = None if H is None else (H[:, perm], float(host_budget))   # step 4: checked at every acceptance
    if hcap is not None:   # thresholds whose leanest host sum already exceeds the host budget
        fit_q &= np.where(A, hcap[0][None], np.inf).min(axis=2).sum(axis=1) <= hcap[1]
        if not fit_q.any():   # a fitting sequence's largest transient would pass both checks
            return nothing(minmem)
    V, vpath = _viterbi(np.where(A, Tp[None], np.inf), R, gp, Pp)
    best_val, best_path = math.inf, None

    def limit() -> float:  # prune bounds at or above this (round-off slack over the best so far)
        return min(cutoff, best_val) * _SLACK
    pending = []
    rows = np.arange(n)
    for q in np.flatnonzero(fit_q & np.isfinite(V) & (V < limit())):
        path = vpath[q]
        if float(Mp[rows, path].sum() + Xp[rows, path].max()) <= budget and _host_fits(hcap, path):
            # the memory-blind optimum of this threshold fits: it solves F(t)
            cost = path_cost(Tp, R, gp, Pp, path)
            if cost < best_val:
                best_val, best_path = cost, [int(s) for s in path]
        else:
            pending.append(int(q))
    pending = [q for q in pending if V[q] < limit()]
    if pending:
        bound = dict(zip(pending, np.maximum(V[pending], _dual_bounds(Tp, Mp, R, gp, Pp, A[pending],
                                                                      budget - ths[pending]))))
        # bands of nearby thresholds: one search per band covers the sequences whose largest
        # transient lies in it (it may skip those below: another band covers them, or its bound
        # shows they cannot win); the most promising band first
        width = (budget - float(np.where(A[-1], Mp, np.inf).min(axis=1).sum())) / BAND_DIVISOR
        bands: list[list[int]] = []
        for q in pending:
            if bands and ths[q] - ths[bands[-1][0]] <= width:
                bands[-1].append(q)
            else:
                bands.append([q])
        for band in sorted(bands, key=lambda band: min(bound[q] for q in band)):
            if min(bound[q] for q in band) >= limit():
                break
            lo, hi = float(ths[band[0]]), band[-1]

            def make(u: int, hi: int = hi, lo: float = lo) -> _Relaxation:
                return _Relaxation(Tp, Mp, R, gp, starts, Pp, A[hi], budget - lo, u, granularity)

            found = _solve_memory(make, make(units), Xp, budget, limit(), n, S, refine=not granularity,
                                  floor=lo, host=hcap)
            if found is not None and found[0] < best_val:
                best_val, best_path = found[0], [int(s) for s in found[1]]
    if best_path is None:
        return nothing(minmem, fits=True)
    orig = [int(perm[s]) for s in best_path]
    cost = path_cost(T, R, gid, P, orig)
    if not cost < cutoff:  # equal to the cutoff once summed in the estimate's order
        return nothing(minmem, fits=True)
    mb = float(sum(M[l, s] for l, s in enumerate(orig)))
    tb = float(max(X[l, s] for l, s in enumerate(orig)))
    hb = 0.0 if host is None else float(sum(host[l, s] for l, s in enumerate(orig)))
    return ExactStage(True, cost, tuple(orig), mb + tb, tb, minmem, cutoff, True, hb)
