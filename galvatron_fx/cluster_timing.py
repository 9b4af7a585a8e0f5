"""Timing on a live world, shared by the cluster profile and its probes: :class:`Timer` (each
rank's runs, the slowest rank's time, differences of two timings run by run), a barrier that
works on any backend, and :func:`stable_figures` (rounds of a measurement until two agree)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist

from .distributed import synchronize

# Latencies fitted below this are measurement noise; floor them so that every figure stays positive.
MIN_LATENCY = 1e-6  # s


def barrier(pg, device: torch.device) -> None:
    """Wait for every rank of ``pg``."""
    # NOTE: a tiny all-reduce instead of dist.barrier(): NCCL's barrier has to guess the device.
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
    synchronize(device)


class Timer:
    """Times operations on the ranks of ``pg``, each run the slowest rank's seconds (``pg=None``: this
    rank alone, device synchronised)."""

    def __init__(self, device: torch.device, pg, repeats: int, warmup: int) -> None:
        self.device, self.pg, self.repeats, self.warmup = device, pg, repeats, warmup

    def __call__(self, op: Callable[[], object]) -> float:
        """The median over runs of ``op``."""
        return statistics.median(self.interleaved({"op": op})["op"])

    def excess(self, base: Callable[[], object], ops: dict[str, Callable[[], object]],
               stat: Callable = statistics.median) -> dict[str, float]:
        """Per op, ``stat`` (the median) over runs of its time minus ``base``'s in the same run."""
        runs = self.interleaved({"": base, **ops})
        return {k: stat([t - b for t, b in zip(runs[k], runs[""])]) for k in ops}

    def interleaved(self, ops: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        """``repeats`` timed runs of every op in turn (after ``warmup`` untimed ones): a slow spell of
        the host lands on one run of all of them, so that a difference within a run cancels it."""
        for _ in range(self.warmup):
            for op in ops.values():
                op()
        synchronize(self.device)
        times = []
        for _ in range(self.repeats):
            for op in ops.values():
                if self.pg is not None:
                    barrier(self.pg, self.device)
                t0 = time.perf_counter()
                op()
                synchronize(self.device)
                times.append(time.perf_counter() - t0)
        if self.pg is not None:
            slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.pg)
            times = slowest.tolist()
        return {k: times[i::len(ops)] for i, k in enumerate(ops)}


def stable_figures(measure_round: Callable[[], dict[str, float]], tol: float = 0.10, max_rounds: int = 5,
                   min_rounds: int = 2, pick=min, noise: Collection[str] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """Repeat ``measure_round()`` (figures, each a median of its runs), at least ``min_rounds`` times,
    until the last two rounds agree within ``tol`` (relative) on every figure, or ``max_rounds``;
    returns each figure's ``pick`` over the rounds (default the minimum, the min of medians:
    interference only ever adds time, so the quietest round is the reproducible one; the link
    timings use the median, which fits steps under contention better) and its spread,
    ``(max - min) / min``, with ``"rounds"``. Figures named in ``noise`` measure interference
    itself: they take the median over the rounds and need not agree. Deterministic in the figures,
    so ranks that measure the same (all-reduced) figures stop together."""
    rounds: list[dict[str, float]] = []
    agreed = False
    while len(rounds) < max(max_rounds, min_rounds, 2) and not agreed:
        rounds.append(measure_round())
        agreed = len(rounds) >= max(min_rounds, 2) and all(_close(rounds[-1][k], rounds[-2][k], tol)
                                                           for k in rounds[-1] if k not in noise)
    best = {k: (statistics.median if k in noise else pick)([r[k] for r in rounds]) for k in rounds[0]}
    low = {k: min(r[k] for r in rounds) for k in rounds[0]}
    spread = {k: (max(r[k] for r in rounds) - low[k]) / low[k] if low[k] > 0 else 0.0 for k in best}
    return best, {**spread, "rounds": float(len(rounds))}


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(min(abs(a), abs(b)), 1e-30)
