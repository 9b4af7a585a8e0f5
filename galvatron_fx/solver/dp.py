"""Exact per-stage dynamic programme over layers, strategies and discretised memory.

For the layers ``l = 0..L-1`` of one pipeline stage and candidate strategies ``s = 0..S-1``::

    C(l, s, e) = T(l, s) + min_{s'} [ C(l-1, s', e - M(l, s)) + R(l-1; s', s) ]
    C(0, s, e) = T(0, s)                       for e >= M(0, s)   (inf otherwise)

where ``C(l, s, e)`` is the least time (seconds) of layers ``0..l`` with layer ``l`` on strategy ``s``
using *at most* ``e`` memory units, ``T`` the per-layer time, ``M`` the per-layer memory in units of
``granularity`` bytes **rounded up** (so a returned solution truly fits in bytes), and ``R`` the
resharding time between consecutive layers. The answer is ``min_s C(L-1, s, E)`` with
``E = floor(budget / granularity)``.

Exactness: the DP's value equals the minimum over all strategy sequences of the path cost evaluated
in the same order (``((T0 + R0) + T1) + R1 ...``, i.e. ``acc = (acc + R) + T``); floating-point
addition is monotone, so no path is lost to rounding. Work: ``O(L * S^2 * E)`` numpy element
operations, with no Python loop over memory states (nor over strategies); memory: the ``[L, S, E+1]``
float64 tables, kept so the walk back can recompute each argmin.

Tie-breaking (deterministic): at the last layer the lowest strategy index among the optimal ones;
walking back, at each layer the lowest previous-strategy index among the optimal predecessors
(``numpy.argmin`` returns the first minimum) for the memory state the later choices leave.

This module is pure: numpy arrays in, a dataclass out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, InfeasibleError

MAX_MEMORY_UNITS = 1 << 22
"""Upper bound on ``budget / granularity`` (memory states); raise the granularity above that."""

MAX_TABLE_BYTES = 1 << 30
"""Upper bound on the DP tables (``8 * L * S * (E + 1)`` bytes, kept for the walk back)."""


@dataclass(frozen=True)
class StageSolution:
    """Result of :func:`solve_stage`.

    ``feasible``: whether some strategy sequence fits the budget. ``objective_s``: the least stage
    time in seconds (sum of layer times and resharding times; ``inf`` when infeasible).
    ``strategies``: per-layer strategy indices (empty when infeasible). ``memory_units`` /
    ``memory_bytes``: the solution's memory in units and in rounded-up bytes (``units *
    granularity``); ``memory_bytes_exact``: the sum of the raw per-layer bytes. ``min_memory_bytes``:
    the least budget (bytes, a multiple of ``granularity``) for which *some* allowed sequence fits,
    computed exactly on the same discretisation; ``inf`` when no sequence is allowed at any budget
    (a layer with every strategy disallowed, or resharding forbidding every path).
    ``granularity_bytes`` and ``budget_bytes`` echo the inputs.
    """

    feasible: bool
    objective_s: float
    strategies: tuple[int, ...]
    memory_units: int
    memory_bytes: int
    memory_bytes_exact: float
    min_memory_bytes: float
    budget_bytes: float
    granularity_bytes: int

    def raise_if_infeasible(self, what: str = "this stage") -> StageSolution:
        """Return self, or raise :class:`InfeasibleError` saying how much memory would be needed."""
        if self.feasible:
            return self
        if np.isinf(self.min_memory_bytes):
            raise InfeasibleError(
                f"{what}: no allowed strategy sequence at any memory budget (some layer has every "
                "strategy disallowed, or resharding forbids every path); widen the strategy space")
        raise InfeasibleError(
            f"{what}: needs at least {int(self.min_memory_bytes)} bytes per device but the budget is "
            f"{int(self.budget_bytes)} bytes; raise the memory budget, add devices or allow more "
            "strategies (ZeRO-3, checkpointing, more TP/PP)")


def memory_units(mem: np.ndarray, granularity: int) -> np.ndarray:
    """``mem`` (bytes, >= 0, ``inf`` allowed) in units of ``granularity`` bytes, rounded **up** so
    that ``units * granularity >= mem`` holds exactly. Returns int64 with ``-1`` where ``mem`` is
    ``inf`` (disallowed)."""
    mem = np.asarray(mem)
    g = int(granularity)
    if np.issubdtype(mem.dtype, np.integer):
        return -(-mem.astype(np.int64) // g)
    finite = np.isfinite(mem)
    safe = np.where(finite, mem, 0.0).astype(np.float64)
    units = np.ceil(safe / g).astype(np.int64)
    units += (units.astype(np.float64) * g < safe)  # guard against the division rounding down
    return np.where(finite, units, -1)


def _check_inputs(time, mem, reshard, budget_bytes, granularity):
    time = np.asarray(time, dtype=np.float64)
    if time.ndim != 2 or time.shape[0] < 1 or time.shape[1] < 1:
        raise ConfigError(f"time must be a non-empty [L, S] array, got shape {time.shape}")
    L, S = time.shape
    mem = np.asarray(mem)
    if mem.shape != (L, S):
        raise ConfigError(f"mem must have the shape of time {(L, S)}, got {mem.shape}")
    if np.isnan(time).any() or (time < 0).any():
        raise ConfigError("time must be >= 0 seconds (use inf for a disallowed strategy), got NaN or < 0")
    if np.isnan(mem.astype(np.float64)).any() or (mem < 0).any():
        raise ConfigError("mem must be >= 0 bytes (use inf for a disallowed strategy), got NaN or < 0")
    if reshard is None:
        reshard = np.zeros((max(L - 1, 0), S, S))
    reshard = np.asarray(reshard, dtype=np.float64)
    if reshard.shape == (S, S):
        reshard = np.broadcast_to(reshard, (max(L - 1, 0), S, S))
    if reshard.shape != (max(L - 1, 0), S, S):
        raise ConfigError(f"reshard must have shape {(max(L - 1, 0), S, S)} or {(S, S)}, got {reshard.shape}")
    if np.isnan(reshard).any() or (reshard < 0).any():
        raise ConfigError("reshard must be >= 0 seconds (inf = transition forbidden), got NaN or < 0")
    if isinstance(granularity, bool) or int(granularity) != granularity or granularity < 1:
        raise ConfigError(f"granularity must be a positive whole number of bytes, got {granularity!r}")
    if not np.isfinite(budget_bytes):
        raise ConfigError(f"budget_bytes must be finite, got {budget_bytes!r}")
    return time, mem, reshard


def min_memory_units(units: np.ndarray, allowed: np.ndarray, reshard: np.ndarray) -> float:
    """Least total memory units of any allowed sequence (``allowed[l, s]`` and finite resharding
    between consecutive choices); ``inf`` if none. Exact (integer DP over strategies)."""
    big = np.where(allowed, units, np.iinfo(np.int64).max // 4).astype(np.int64)
    inf = np.iinfo(np.int64).max // 4
    best = big[0].copy()
    for l in range(1, units.shape[0]):
        ok = np.isfinite(reshard[l - 1])  # [s', s]
        cand = np.where(ok, best[:, None], inf).min(axis=0)
        best = np.minimum(cand + big[l], inf)
    m = best.min()
    return float("inf") if m >= inf else float(m)


def solve_stage(
    time: np.ndarray,
    mem: np.ndarray,
    reshard: np.ndarray | None,
    budget_bytes: float,
    granularity: int,
) -> StageSolution:
    """Best per-layer strategies for one pipeline stage under a per-device memory budget.

    ``time[L, S]``: seconds of layer ``l`` under strategy ``s`` (``inf`` = not allowed).
    ``mem[L, S]``: bytes per device (``inf`` = not allowed). ``reshard[L-1, S, S]`` (or one
    ``[S, S]`` shared by all boundaries, or ``None`` for zeros): seconds to go from strategy ``s'`` at
    layer ``l`` to ``s`` at layer ``l+1`` (``inf`` = forbidden). ``budget_bytes``: per-device budget
    for these layers. ``granularity``: bytes per memory unit; memories are rounded up to it and the
    budget down (``E = floor(budget / granularity)`` units).

    Returns a :class:`StageSolution`; infeasibility is reported, not raised (call
    ``.raise_if_infeasible()``). See the module docstring for the recurrence and the tie rule.
    """
    time, mem, reshard = _check_inputs(time, mem, reshard, budget_bytes, granularity)
    L, S = time.shape
    g = int(granularity)
    units = memory_units(mem, g)
    allowed = np.isfinite(time) & (units >= 0)
    units = np.where(allowed, units, 0)
    min_units = min_memory_units(units, allowed, reshard)
    min_bytes = min_units * g
    E = int(np.floor(budget_bytes / g)) if budget_bytes >= 0 else -1
    if E < 0 or min_units > E:
        return StageSolution(False, float("inf"), (), 0, 0, 0.0, min_bytes, float(budget_bytes), g)
    # Memory beyond what any sequence can use adds nothing: cap the state count at the largest total.
    max_units = int(np.where(allowed, units, 0).max(axis=1).sum())
    E = min(E, max_units)
    if E + 1 > MAX_MEMORY_UNITS:
        raise ConfigError(
            f"{E + 1} memory states exceed {MAX_MEMORY_UNITS}; use a coarser granularity "
            f"(e.g. {int(np.ceil(budget_bytes / (MAX_MEMORY_UNITS // 2)))} bytes)")

    if L * S * (E + 1) * 8 > MAX_TABLE_BYTES:
        raise ConfigError(
            f"the DP tables would take {L * S * (E + 1) * 8} bytes (> {MAX_TABLE_BYTES}); use a coarser "
            "granularity or fewer candidate strategies")

    e_idx = np.arange(E + 1)
    t = np.where(allowed, time, np.inf)
    # Gather index of the shift by M(l, s): shifted[s, e] = best[s, e - M(l, s)] (inf below 0).
    rows = np.arange(S)[:, None]
    # tables[l, s, e]: best time of layers 0..l with layer l on s using at most e units.
    tables = np.empty((L, S, E + 1))
    tables[0] = np.where(e_idx[None, :] >= units[0][:, None], t[0][:, None], np.inf)
    via = np.empty((S, S, E + 1))
    for l in range(1, L):
        # via[s', s, e] = C(l-1, s', e) + R(s', s); best[s, e] = min over s' (before the shift).
        np.add(tables[l - 1][:, None, :], reshard[l - 1][:, :, None], out=via)
        best = via.min(axis=0)
        src = e_idx[None, :] - units[l][:, None]
        shifted = np.where(src >= 0, best[rows, np.maximum(src, 0)], np.inf)
        tables[l] = shifted + t[l][:, None]

    final = tables[L - 1][:, E]
    s = int(np.argmin(final))
    objective = float(final[s])
    if not np.isfinite(objective):  # every fitting path is blocked (cannot happen if min_units <= E)
        return StageSolution(False, float("inf"), (), 0, 0, 0.0, min_bytes, float(budget_bytes), g)
    # Walk back, recomputing the argmin for the one state on the path (same float operations, so the
    # minimum is found exactly); lowest predecessor index on ties.
    choice = [0] * L
    e = E
    for l in range(L - 1, -1, -1):
        choice[l] = s
        if l > 0:
            e -= int(units[l, s])
            s = int(np.argmin(tables[l - 1][:, e] + reshard[l - 1][:, s]))
    used = int(sum(int(units[l, c]) for l, c in enumerate(choice)))
    exact = float(sum(float(mem[l, c]) for l, c in enumerate(choice)))
    return StageSolution(True, objective, tuple(choice), used, used * g, exact, min_bytes,
                         float(budget_bytes), g)
