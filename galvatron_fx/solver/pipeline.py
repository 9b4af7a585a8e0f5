"""Pipeline stage partitioning and pipeline timing formulas (pure, no torch).

A partition splits ``L`` layers into ``p`` contiguous non-empty stages minimising the slowest stage,
every stage fitting in memory (Galvatron-BMW's bi-objective partition: minimise the maximum, not an
even split). The caller supplies the stage cost: the best time of layers ``i..j`` (inclusive) on
stage ``k``, or ``inf`` when they do not fit (a per-stage solve whose memory depends on ``k`` through
the number of in-flight micro-batches).

* :func:`partition_stages` evaluates every ``(i, j, k)`` (at most ``p * L * (L + 1) / 2`` calls) in
  two exact DPs over stage boundaries.
* :func:`partition_min_max` is the same DP with lazy, pruned evaluation, for expensive stage costs:
  it takes a lower bound of each stage cost and a cutoff, and evaluates a stage only where the bound
  says it could matter; provably the same optimum (its docstring has the argument).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import ConfigError, InfeasibleError
from .schedules import SCHEDULES, chunk_in_flight

StageCost = Callable[[int, int, int], float]


class BoundedCost(Protocol):
    def __call__(self, i: int, j: int, k: int, cutoff: float) -> float:
        """Seconds of layers ``i..j`` on stage ``k``; ``inf`` when they do not fit or cost at
        least ``cutoff`` (the caller needs nothing at or above it)."""


@dataclass(frozen=True)
class Partition:
    """Result of :func:`partition_stages`.

    ``feasible``: some split fits. ``stages``: inclusive ``(first, last)`` layer ranges, one per stage
    (empty when infeasible). ``stage_times_s``: each stage's time per micro-batch (seconds).
    ``bottleneck_s``: the slowest stage's time (``inf`` when infeasible). ``cost_calls``: distinct
    ``stage_cost`` evaluations made.
    """

    feasible: bool
    stages: tuple[tuple[int, int], ...]
    stage_times_s: tuple[float, ...]
    bottleneck_s: float
    cost_calls: int

    def raise_if_infeasible(self, what: str = "the model") -> Partition:
        """Return self, or raise :class:`InfeasibleError`."""
        if not self.feasible:
            raise InfeasibleError(
                f"no split of {what} into pipeline stages fits the memory budget; raise the budget, "
                "use more pipeline stages or allow more memory-saving strategies")
        return self


def even_split(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """``pp`` contiguous inclusive ``(first, last)`` ranges covering ``num_layers`` layers, sizes
    differing by at most one; the first ``num_layers % pp`` stages get the extra layer."""
    if pp < 1 or num_layers < pp:
        raise ConfigError(f"cannot split {num_layers} layers into {pp} non-empty stages; use pp <= {num_layers}")
    q, r = divmod(num_layers, pp)
    out, start = [], 0
    for k in range(pp):
        size = q + (1 if k < r else 0)
        out.append((start, start + size - 1))
        start += size
    return out


def greedy_pack(layers: int, parts: int, window: Callable[[int, int], float],
                limit: float) -> list[tuple[int, int]] | None:
    """``parts`` contiguous inclusive ``(first, last)`` ranges over ``layers`` layers, in order, each
    taking as many layers as it can while ``window(first, last)`` stays within ``limit`` and one
    layer is left for each range after it; None when a range exceeds ``limit`` all the same."""
    out, i = [], 0
    for k in range(parts):
        j = i
        while j + 1 <= layers - (parts - k) and window(i, j + 1) <= limit:
            j += 1
        if k == parts - 1:
            j = layers - 1
        if window(i, j) > limit:
            return None
        out.append((i, j))
        i = j + 1
    return out


def balanced_split(times, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous inclusive ``(first, last)`` ranges covering ``len(times)`` layers whose
    largest sum of ``times`` (seconds per layer) is least; among splits within a relative ``1e-9``
    of that least largest sum, each range takes as many layers as it can, in order (deterministic).
    Layer times that are not all finite and positive in sum give :func:`even_split`.

    Interleaved and V-shaped schedules run every chunk in turn, so a heavy chunk beside a light one
    on the same rank idles the other ranks (measured: docs/measurements.md, "Figures behind the design")."""
    t = np.asarray(times, dtype=np.float64)
    L = len(t)
    if parts < 1 or L < parts:
        raise ConfigError(f"cannot split {L} layers into {parts} non-empty stages; use pp <= {L}")
    if not np.isfinite(t).all() or t.sum() <= 0:
        return even_split(L, parts)
    prefix = np.concatenate([[0.0], np.cumsum(t)])

    def pack(limit: float) -> list[tuple[int, int]] | None:
        return greedy_pack(L, parts, lambda i, j: prefix[j + 1] - prefix[i], limit)

    windows = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(L + 1, 1)])
    lo, hi = 0, len(windows) - 1   # the least window sum that some split does not exceed
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pack(windows[mid] * (1 + 1e-9)) is not None else (mid + 1, hi)
    return pack(windows[lo] * (1 + 1e-9))


def _as_cost_fn(stage_cost: StageCost | np.ndarray) -> StageCost:
    if callable(stage_cost):
        return stage_cost
    arr = np.asarray(stage_cost, dtype=np.float64)
    if arr.ndim != 3:
        raise ConfigError(f"stage_cost must be a callable or a [p, L, L] array, got shape {arr.shape}")
    return lambda i, j, k: float(arr[k, i, j])


def partition_stages(num_layers: int, pp: int, stage_cost: StageCost | np.ndarray) -> Partition:
    """Contiguous split of layers ``0..num_layers-1`` into ``pp`` non-empty stages minimising the
    slowest stage, every stage fitting.

    ``stage_cost(i, j, k) -> seconds`` (``inf`` = layers ``i..j`` do not fit on stage ``k``), or an
    array ``cost[k, i, j]``. Values must be ``>= 0``.

    Ties (several splits with the same slowest stage) prefer the most balanced split: the least sum
    of squared stage times; remaining ties take the split whose last stage starts earliest, then
    whose second-to-last stage starts earliest, and so on. Both phases are exact DPs over boundaries:

    1. ``B(k, j)`` = least bottleneck of layers ``0..j`` on stages ``0..k``:
       ``min_i max(B(k-1, i-1), cost(i, j, k))``; the optimum is ``T* = B(p-1, L-1)``.
    2. Among the splits with every stage ``<= T*`` (exactly the optimal ones), minimise the sum of
       squared stage times, again by a DP over boundaries.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"num_layers must be an int >= 1, got {num_layers!r}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or pp > num_layers:
        raise ConfigError(f"pp must be an int in 1..num_layers={num_layers}, got {pp!r}")
    fn = _as_cost_fn(stage_cost)
    memo: dict[tuple[int, int, int], float] = {}

    def cost(i: int, j: int, k: int) -> float:
        key = (i, j, k)
        v = memo.get(key)
        if v is None:
            v = float(fn(i, j, k))
            if math.isnan(v) or v < 0:
                raise ConfigError(f"stage_cost({i}, {j}, {k}) returned {v!r}; expected seconds >= 0 or inf")
            memo[key] = v
        return v

    L, inf = num_layers, math.inf
    # Stage k covers layers i..j with k <= i and (pp - 1 - k) layers left after j.
    # Phase 1: bottleneck[k][j].
    bott = [[inf] * L for _ in range(pp)]
    for j in range(L - pp + 1):
        bott[0][j] = cost(0, j, 0)
    for k in range(1, pp):
        for j in range(k, L - (pp - 1 - k)):
            best = inf
            for i in range(k, j + 1):
                prev = bott[k - 1][i - 1]
                if prev < inf:
                    best = min(best, max(prev, cost(i, j, k)))
            bott[k][j] = best
    target = bott[pp - 1][L - 1]
    if target == inf:
        return Partition(False, (), (), inf, len(memo))

    # Phase 2: least sum of squares (summed stage 0 first) over splits with every stage <= target;
    # ties: earliest start of each stage, last stage first (scan i ascending, strict improvement only).
    sq = [[inf] * L for _ in range(pp)]
    start = [[-1] * L for _ in range(pp)]
    for j in range(L - pp + 1):
        c = cost(0, j, 0)
        if c <= target:
            sq[0][j], start[0][j] = c * c, 0
    for k in range(1, pp):
        for j in range(k, L - (pp - 1 - k)):
            for i in range(k, j + 1):
                prev = sq[k - 1][i - 1]
                if prev == inf:
                    continue
                c = cost(i, j, k)
                if c <= target and prev + c * c < sq[k][j]:
                    sq[k][j], start[k][j] = prev + c * c, i
    stages = []
    j = L - 1
    for k in range(pp - 1, -1, -1):
        i = start[k][j]
        stages.append((i, j))
        j = i - 1
    stages.reverse()
    times = tuple(cost(i, j, k) for k, (i, j) in enumerate(stages))
    return Partition(True, tuple(stages), times, max(times), len(memo))


def _windows(L: int, p: int, window_lower: Callable[[int, int], float], cutoff: float):
    """``(lo, hi)``: stage ``k`` of any partition whose stages all have ``window_lower < cutoff``
    ends at a layer in ``lo[k]..hi[k]``; ``None`` when there is no such partition.

    ``window_lower(i, j)`` must not depend on the stage and must not decrease when the range grows.
    Greedy from the front (each stage as long as it may, leaving a layer per later stage) bounds
    every such partition's stage ends from above, by induction: a stage starting no earlier than
    the other partition's, and so inside a range it knows to pass, reaches at least as far.
    Greedy from the back bounds the starts from below in the same way.
    """
    def ok(i: int, j: int) -> bool:
        return window_lower(i, j) < cutoff

    hi, i = [], 0
    for k in range(p):
        j = i - 1
        while j + 1 <= L - (p - k) and ok(i, j + 1):
            j += 1
        if j < i:
            return None
        hi.append(j)
        i = j + 1
    if hi[-1] != L - 1:
        return None
    start, j = [0] * p, L - 1
    for k in range(p - 1, -1, -1):
        i = j + 1
        while i - 1 >= k and ok(i - 1, j):
            i -= 1
        if i > j:
            return None
        start[k] = i
        j = i - 1
    if start[0] != 0:
        return None
    lo = [start[k + 1] - 1 for k in range(p - 1)] + [L - 1]
    return lo, hi


def partition_min_max(num_layers: int, pp: int, stage_cost: BoundedCost, *,
                      lower: Callable[[int, int, int], float] | None = None,
                      window_lower: Callable[[int, int], float] | None = None,
                      cutoff: float = math.inf) -> Partition:
    """The contiguous split of layers ``0..num_layers-1`` into ``pp`` stages with the least slowest
    stage below ``cutoff`` (ties: least sum of squared stage times, then the DP's scan order), with
    ``stage_cost`` evaluated lazily.

    ``stage_cost(i, j, k, cutoff)`` (see :class:`BoundedCost`); ``lower(i, j, k)`` a lower bound of
    it (default 0); ``window_lower(i, j)`` a lower bound of every stage's cost on that range that
    does not decrease when the range grows (default 0). Returns an infeasible :class:`Partition`
    when no split has every stage below ``cutoff``.

    Same optimum as the full DP ``B(k, j) = min_i max(B(k-1, i-1), cost(i, j, k))``, because only
    evaluations that cannot change it are skipped:

    * stage ends outside :func:`_windows` (computed from ``window_lower`` and ``cutoff``) belong to no
      split whose stages all cost less than ``cutoff``;
    * a candidate ``i`` for ``B(k, j)`` is skipped when ``max(B(k-1, i-1), lower(i, j, k))`` exceeds
      the best candidate found so far or reaches ``cutoff`` (its value could only be larger), and a
      stage is evaluated with the cutoff ``min(cutoff, best so far)`` (anything above cannot win);
      candidates that could *tie* the best are evaluated, so the sum-of-squares tie rule holds.
    """
    # NOTE: one function (85 lines): one dynamic program with its bounds; the pruning steps refer to each other
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"num_layers must be an int >= 1, got {num_layers!r}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or pp > num_layers:
        raise ConfigError(f"pp must be an int in 1..num_layers={num_layers}, got {pp!r}")
    L, inf = num_layers, math.inf
    lower = lower or (lambda i, j, k: 0.0)
    calls = 0

    def cost(i: int, j: int, k: int, cut: float) -> float:
        nonlocal calls
        calls += 1
        v = float(stage_cost(i, j, k, cut))
        if math.isnan(v) or v < 0:
            raise ConfigError(f"stage_cost({i}, {j}, {k}) returned {v!r}; expected seconds >= 0 or inf")
        return v if v < cut else inf

    win = _windows(L, pp, window_lower or (lambda i, j: 0.0), cutoff)
    if win is None:
        return Partition(False, (), (), inf, 0)
    lo, hi = win
    # best[k][j] = (slowest, sum of squares, start of stage k, its time) over layers 0..j on stages 0..k
    best: list[dict[int, tuple[float, float, int, float]]] = [{} for _ in range(pp)]
    for j in range(lo[0], hi[0] + 1):
        if lower(0, j, 0) < cutoff:
            c = cost(0, j, 0, cutoff)
            if c < inf:
                best[0][j] = (c, c * c, 0, c)
    for k in range(1, pp):
        prev = best[k - 1]
        for j in range(lo[k], hi[k] + 1):
            cands = []
            for i in range(max(k, lo[k - 1] + 1), min(hi[k - 1] + 1, j) + 1):
                if i - 1 in prev:
                    bound = max(prev[i - 1][0], lower(i, j, k))
                    if bound < cutoff:
                        cands.append((bound, -i, i))
            cands.sort()
            top: tuple[float, float, int, float] | None = None
            for bound, _, i in cands:
                if top is not None and bound > top[0]:
                    break
                cut = cutoff if top is None else min(cutoff, math.nextafter(top[0], inf))
                c = cost(i, j, k, cut)
                if c == inf:
                    continue
                p_slow, p_sq = prev[i - 1][0], prev[i - 1][1]
                val = (max(p_slow, c), p_sq + c * c, i, c)
                if top is None or val[:2] < top[:2]:
                    top = val
            if top is not None:
                best[k][j] = top
    if L - 1 not in best[pp - 1]:
        return Partition(False, (), (), inf, calls)
    stages, times, j = [], [], L - 1
    for k in range(pp - 1, -1, -1):
        _, _, i, c = best[k][j]
        stages.append((i, j))
        times.append(c)
        j = i - 1
    stages.reverse()
    times.reverse()
    return Partition(True, tuple(stages), tuple(times), max(times), calls)


def pipeline_step_time(slowest_stage_s: float, micro_batches: int, pp: int,
                       grad_sync_s: float = 0.0, p2p_s: float = 0.0) -> float:
    """Seconds per training step of a synchronous pipeline (GPipe or 1F1B, same bubble):
    ``(m + p - 1) * slowest_stage_s + grad_sync_s + p2p_s``.

    ``slowest_stage_s``: forward+backward seconds per micro-batch of the slowest stage;
    ``grad_sync_s``: gradient synchronisation not overlapped with compute; ``p2p_s``: total
    stage-to-stage activation transfer time not overlapped with compute, per step.
    """
    if micro_batches < 1 or pp < 1:
        raise ConfigError(f"micro_batches and pp must be >= 1, got {micro_batches}, {pp}")
    return (micro_batches + pp - 1) * slowest_stage_s + grad_sync_s + p2p_s


def in_flight_microbatches(schedule: str, micro_batches: int, pp: int, stage_index: int) -> int:
    """Micro-batches whose activations a stage holds at its peak under a one-chunk-per-stage schedule:
    GPipe keeps all ``m``; 1F1B keeps ``min(m, p - stage_index)`` (the first stage the most); the
    rest as torch's action lists say (:func:`~.schedules.chunk_in_flight`)."""
    if not 0 <= stage_index < pp:
        raise ConfigError(f"stage_index must be in 0..{pp - 1}, got {stage_index}")
    if micro_batches < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {micro_batches}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return chunk_in_flight(schedule, pp, 1, micro_batches, stage_index)[0]
