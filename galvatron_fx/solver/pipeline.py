"""Pipeline stage partitioning and pipeline timing formulas (pure, no torch).

:func:`partition_stages` splits ``L`` layers into ``p`` contiguous stages minimising the slowest
stage's time per micro-batch, subject to every stage fitting in memory (Galvatron-BMW's bi-objective
partition: minimise the maximum, not an even split). The caller supplies ``stage_cost(i, j, k)``: the
best time per micro-batch (seconds) of layers ``i..j`` (inclusive) on stage ``k``, or ``inf`` when
they do not fit (typically a :func:`galvatron_fx.solver.dp.solve_stage` objective with the stage's
memory budget, which depends on ``k`` through the number of in-flight micro-batches).

Exact by dynamic programming over stage boundaries, with every ``stage_cost`` call memoised
(at most ``p * L * (L + 1) / 2`` distinct calls).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, InfeasibleError

SCHEDULES = ("gpipe", "1f1b")

StageCost = Callable[[int, int, int], float]


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
    """Micro-batches whose activations a stage holds at its peak: GPipe keeps all ``m``;
    1F1B keeps ``min(m, p - stage_index)`` (the first stage the most)."""
    if not 0 <= stage_index < pp:
        raise ConfigError(f"stage_index must be in 0..{pp - 1}, got {stage_index}")
    if micro_batches < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {micro_batches}")
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, pp - stage_index)
    raise ConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
