"""The outer search: pipeline degree, micro-batches, stage partition and per-layer strategies.

For every candidate configuration (pipeline degree ``p`` dividing the device count, micro-batch
count ``m``, schedule, global batch size) the engine

1. builds per-layer tables from the cost source: step time ``T[l, s]`` and memory ``M_k[l, s]``
   for stage ``k`` (in-flight activations depend on the stage), see :mod:`.objective`;
2. partitions the layers into ``p`` contiguous stages: first exactly (min-max, via
   :func:`partition_stages`) on each layer's best time among the strategies that fit alone, then
   by local moves of boundary layers that lower the slowest stage's *exact* DP cost
   (Galvatron-BMW's bi-objective balancing: time subject to every stage fitting);
3. solves each stage exactly with :func:`solve_stage` (dynamic programming over layers and a
   discretised per-device memory budget, with real resharding costs between adjacent layers);
4. re-estimates the assembled plan with :func:`estimate_plan` (the same arithmetic).

The best plan over all configurations and over every *uniform* plan (the baselines are inside the
space, so the result is never worse than any of them under the cost model) wins; ties break
deterministically (lower memory, then fewer stages, fewer micro-batches, then strategy order).

Pure: strategies, numbers and a duck-typed cost source in; plain data out.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, InfeasibleError
from ..units import format_bytes
from .dp import solve_stage
from .objective import (
    CostSource,
    LayerTerms,
    estimate_plan,
    layer_step_time,
    layer_terms,
    p2p_time_per_microbatch,
)
from .pipeline import even_split, in_flight_microbatches
from .strategy import Strategy, strategy_space

DEFAULT_MEMORY_UNITS = 256
"""Default discretisation of the memory budget: ``granularity = budget / 256`` bytes per unit."""


@dataclass
class SearchOptions:
    """What the search may choose. ``None`` means "search it"; a value pins it.

    ``pp``/``micro_batches``/``schedule``/``global_batch_size`` pin the outer loop (a free global
    batch is searched over powers of two up to ``max_global_batch_size``); ``space`` holds
    :func:`strategy_space` keyword arguments (``ckpt``, ``sp``, ``zero2``, ``zero3``, ``max_tp``,
    ``allow_cross_node_tp``, ``power_of_two``, ``devices_per_node``); ``strategy_filter`` drops
    per-layer strategies (e.g. the baselines' "DP only"). GPipe is searched only when pinned: under
    the cost model it has 1F1B's time and at least its memory, so it can never win.
    """

    pp: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    global_batch_size: int | None = None
    space: dict = field(default_factory=dict)
    strategy_filter: Callable[[Strategy], bool] | None = None
    max_micro_batches: int = 64
    max_global_batch_size: int = 4096
    granularity: int | None = None
    reserve_bytes: float = 0.0
    include_uniform: bool = True
    uniform_only: bool = False


@dataclass
class SearchResult:
    strategies: list[Strategy]
    stages: list[tuple[int, int]]
    pp: int
    micro_batches: int
    schedule: str
    global_batch_size: int
    estimate: dict
    configs_tried: int = 0


def _pow2_divisors(n: int, limit: int | None = None) -> list[int]:
    out = [d for d in (2**i for i in range(int(math.log2(max(n, 1))) + 1)) if n % d == 0]
    return [d for d in out if limit is None or d <= limit]


class CachedCosts:
    """A :class:`CostSource` that memoises by layer *signature* (identical layers cost the same),
    strategy and micro-batch size, and builds resharding matrices per layout class."""

    def __init__(self, costs: CostSource, cluster: Any, signatures: list[str]):
        self.costs, self.cluster, self.signatures = costs, cluster, signatures
        self._cost: dict[tuple, Any] = {}
        self._terms: dict[tuple, LayerTerms] = {}
        self._reshard: dict[tuple, float] = {}
        self._matrix: dict[tuple, np.ndarray] = {}
        self._boundary: dict[tuple, float] = {}

    def layer_cost(self, layer: int, s: Strategy, b: int):
        key = (self.signatures[layer], s, b)
        if key not in self._cost:
            self._cost[key] = self.costs.layer_cost(layer, s, b)
        return self._cost[key]

    def terms(self, layer: int, s: Strategy, b: int) -> LayerTerms:
        key = (self.signatures[layer], s, b)
        if key not in self._terms:
            self._terms[key] = layer_terms(self.layer_cost(layer, s, b), self.cluster)
        return self._terms[key]

    def reshard_time(self, layer: int, prev: Strategy, nxt: Strategy, b: int) -> float:
        # NOTE: resharding moves the activation between layouts; only (tp, dp, sp) matter.
        key = (self.signatures[layer], (prev.tp, prev.dp, prev.sp), (nxt.tp, nxt.dp, nxt.sp), b)
        if key not in self._reshard:
            self._reshard[key] = self.costs.reshard_time(layer, prev, nxt, b)
        return self._reshard[key]

    def boundary_bytes(self, layer: int, b: int) -> float:
        key = (self.signatures[layer], b)
        if key not in self._boundary:
            self._boundary[key] = self.costs.boundary_bytes(layer, b)
        return self._boundary[key]

    def reshard_matrix(self, layer: int, space: list[Strategy], b: int) -> np.ndarray:
        """[S, S] seconds per micro-batch from ``layer``'s output under ``space[i]`` to ``space[j]``."""
        key = (self.signatures[layer], tuple(space), b)
        if key not in self._matrix:
            self._matrix[key] = np.array([[self.reshard_time(layer, a, c, b) for c in space] for a in space])
        return self._matrix[key]


class Engine:
    """Searches one model (``signatures`` per layer) on one cluster. See the module docstring."""

    def __init__(self, costs: CostSource, cluster: Any, signatures: list[str], world_size: int,
                 budget_bytes: float, options: SearchOptions | None = None,
                 allowed_tp: Callable[[int, int], bool] | None = None,
                 tied_layers: Iterable[int] = (),
                 progress: Callable[[str], None] | None = None):
        self.costs, self.cluster = costs, cluster
        self.L = len(signatures)
        self.N = world_size
        self.budget = float(budget_bytes)
        self.opt = options or SearchOptions()
        self.allowed_tp = functools.lru_cache(maxsize=None)(allowed_tp or (lambda layer, tp: True))
        self.tied_layers = frozenset(tied_layers)
        self.tables = CachedCosts(costs, cluster, signatures)
        self.progress = progress or (lambda msg: None)
        self.min_memory_seen = math.inf
        self._tables_memo: dict = {}

    # ------------------------------------------------------------------ spaces
    def configs(self) -> Iterable[tuple[int, int, str, int]]:
        o = self.opt
        pps = [o.pp] if o.pp else [p for p in _pow2_divisors(self.N) if p <= self.L]
        gbss = [o.global_batch_size] if o.global_batch_size else [
            g for g in (2**i for i in range(0, 31)) if self.N // max(pps) <= g <= o.max_global_batch_size]
        schedules = [o.schedule] if o.schedule else ["1f1b"]
        for gbs in gbss:
            for p in pps:
                # NOTE: a pipeline needs at least one micro-batch per stage (torch.distributed.pipelining
                # refuses fewer, and fewer would leave stages idle anyway)
                ms = [m for m in ([o.micro_batches] if o.micro_batches else
                                  _pow2_divisors(gbs, o.max_micro_batches)) if m >= p]
                for m in ms:
                    for sched in schedules:
                        yield p, m, sched, gbs

    def space(self, p: int, b: int) -> list[Strategy]:
        kw = {"devices_per_node": getattr(self.cluster, "devices_per_node", 8), **self.opt.space}
        out = [s for s in strategy_space(self.N // p, **kw) if b % s.dp == 0]
        if self.opt.strategy_filter:
            out = [s for s in out if self.opt.strategy_filter(s)]
        return out

    # ------------------------------------------------------------------ tables
    def _layer_tables(self, p: int, m: int, b: int, space: list[Strategy]):
        """[L, S] arrays: step time, states, activations per micro-batch, transient (inf = not allowed).
        Built once per distinct layer signature, then gathered per layer; memoised per configuration."""
        key = (p, m, b, tuple(space))
        if key not in self._tables_memo:
            self._tables_memo = {key: self._build_tables(p, m, b, space)}
        return self._tables_memo[key]

    def _build_tables(self, p: int, m: int, b: int, space: list[Strategy]):
        rows: dict[str, np.ndarray] = {}
        out = np.empty((4, self.L, len(space)))
        for i in range(self.L):
            sig = self.tables.signatures[i]
            allowed = np.array([self.allowed_tp(i, s.tp) and self._pipeline_allows(i, s, p) for s in space])
            if sig not in rows:
                terms = [self.tables.terms(i, s, b) for s in space]
                rows[sig] = np.array([[layer_step_time(x, m, p) for x in terms],
                                      [x.states_bytes for x in terms],
                                      [x.activation_bytes for x in terms],
                                      [x.transient_bytes for x in terms]])
            out[:, i, :] = np.where(allowed[None, :], rows[sig], np.inf)
        return out[0], out[1], out[2], out[3]

    def _pipeline_allows(self, layer: int, s: Strategy, p: int) -> bool:
        """NOTE: a weight tied across layers (embedding / LM head) may cross pipeline stages, where
        the runtime sends it whole: with pp > 1 its layers run without TP and not as ZeRO-3 with
        checkpointing (see galvatron_fx/runtime/pipeline.py). Conservative: applies whatever the split."""
        return p == 1 or layer not in self.tied_layers or (s.tp == 1 and not (s.sdp == "zero3" and s.ckpt))

    def _granularity(self) -> int:
        return int(self.opt.granularity or max(1, self.budget // DEFAULT_MEMORY_UNITS))

    def _solve(self, i: int, j: int, k: int, ctx) -> tuple[float, list[int] | None]:
        """Exact DP for layers i..j on stage k: (stage step time, strategy indices) or (inf, None)."""
        key = (i, j, k)
        if key in ctx["memo"]:
            return ctx["memo"][key]
        p, m, b, space, sched = ctx["p"], ctx["m"], ctx["b"], ctx["space"], ctx["schedule"]
        t, states, act, trans = ctx["tables"]
        inflight = in_flight_microbatches(sched, m, p, k)
        mem = np.where(np.isfinite(t[i:j + 1]), states[i:j + 1] + inflight * act[i:j + 1], np.inf)
        keep = _undominated(t[i:j + 1], mem, trans[i:j + 1], space)
        tt, mem, tr = t[i:j + 1][:, keep], mem[:, keep], trans[i:j + 1][:, keep]
        transient = float(np.max(np.where(np.isfinite(tr), tr, 0.0)))
        budget = self.budget - self.opt.reserve_bytes - transient
        sub = [space[x] for x in keep]
        reshard = (np.stack([self.tables.reshard_matrix(layer, sub, b) * (m + p - 1) for layer in range(i, j)])
                   if j > i else None)
        sol = solve_stage(tt, mem, reshard, budget, self._granularity())
        ctx["min_memory"][key] = sol.min_memory_bytes + self.opt.reserve_bytes + transient
        if not sol.feasible:
            out = (math.inf, None)
        else:
            cost = sol.objective_s
            if k < p - 1:
                per_stage = self.N // p
                cost += (m + p - 1) * p2p_time_per_microbatch(
                    self.tables, self.cluster, j, sub[sol.strategies[-1]], b, k * per_stage, (k + 1) * per_stage)
            out = (cost, [int(keep[x]) for x in sol.strategies])
        ctx["memo"][key] = out
        return out

    # ------------------------------------------------------------------ search
    def search_config(self, p: int, m: int, sched: str, gbs: int) -> SearchResult | None:
        b = gbs // m
        if gbs % m or b < 1:
            return None
        space = self.space(p, b)
        if not space:
            return None
        tables = self._layer_tables(p, m, b, space)
        ctx = {"p": p, "m": m, "b": b, "space": space, "schedule": sched, "tables": tables, "memo": {},
               "min_memory": {}}
        stages = self._initial_partition(ctx)
        if stages is None:
            return None
        stages = self._refine(stages, ctx)
        strategies: list[Strategy] = []
        solved = [self._solve(i, j, k, ctx) for k, (i, j) in enumerate(stages)]
        # the least memory this configuration's partition needs: its hungriest stage's minimum
        self.min_memory_seen = min(self.min_memory_seen,
                                   max(ctx["min_memory"][(i, j, k)] for k, (i, j) in enumerate(stages)))
        for _cost, idx in solved:
            if idx is None:
                return None
            strategies += [space[x] for x in idx]
        return self._result(strategies, stages, p, m, sched, gbs)

    def _result(self, strategies, stages, p, m, sched, gbs) -> SearchResult:
        est = estimate_plan(self.tables, self.cluster, strategies=strategies, stages=stages, micro_batches=m,
                            global_batch_size=gbs, schedule=sched, world_size=self.N,
                            reserve_bytes=self.opt.reserve_bytes)
        return SearchResult(strategies, list(stages), p, m, sched, gbs, est)

    def _initial_partition(self, ctx) -> list[tuple[int, int]] | None:
        """Min-max split on each layer's best stand-alone time, every stage within its least memory.

        Additive costs: binary search on the bottleneck over all range sums, greedy packing as the
        feasibility test (exact for min-max contiguous partitioning with monotone constraints).
        """
        p = ctx["p"]
        if p == 1:
            return [(0, self.L - 1)]
        t, states, act, _ = ctx["tables"]
        best_t = np.min(t, axis=1)
        cap = self.budget - self.opt.reserve_bytes
        least = [np.min(states + in_flight_microbatches(ctx["schedule"], ctx["m"], p, k) * act, axis=1)
                 for k in range(p)]
        if not np.all(np.isfinite(best_t)):
            return None
        prefix = np.concatenate([[0.0], np.cumsum(best_t)])
        sums = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(self.L + 1, 1)])

        def pack(limit: float) -> list[tuple[int, int]] | None:
            stages, i = [], 0
            for k in range(p):
                if i >= self.L:
                    break
                j, used, mem = i, 0.0, 0.0
                while j < self.L and used + best_t[j] <= limit and mem + least[k][j] <= cap \
                        and self.L - (j + 1) >= p - k - 1:
                    used, mem, j = used + best_t[j], mem + least[k][j], j + 1
                if j == i:
                    return None
                stages.append((i, j - 1))
                i = j
            return stages if i >= self.L and len(stages) == p else None

        lo, hi = 0, len(sums) - 1
        if pack(sums[hi]) is None:
            return even_split(self.L, p)
        while lo < hi:
            mid = (lo + hi) // 2
            if pack(sums[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
        return pack(sums[lo])

    def _refine(self, stages: list[tuple[int, int]], ctx, max_moves: int | None = None) -> list[tuple[int, int]]:
        """Move single boundary layers off the slowest (or an infeasible) stage while that helps."""
        p = ctx["p"]
        if p == 1:
            return stages
        stages = list(stages)
        for _ in range(max_moves or 2 * self.L):
            times = [self._solve(i, j, k, ctx)[0] for k, (i, j) in enumerate(stages)]
            worst = max(range(p), key=lambda k: (times[k], -k))
            best_move, best_val = None, times[worst]
            for nb in (worst - 1, worst + 1):
                if not 0 <= nb < p:
                    continue
                cand = list(stages)
                (i, j), (a, c) = cand[worst], cand[nb]
                if i == j:
                    continue
                if nb < worst:
                    cand[nb], cand[worst] = (a, c + 1), (i + 1, j)
                else:
                    cand[worst], cand[nb] = (i, j - 1), (a - 1, c)
                val = max(self._solve(*cand[k], k, ctx)[0] for k in (worst, nb))
                if val < best_val:
                    best_move, best_val = cand, val
            if best_move is None:
                break
            stages = best_move
        return stages

    def uniform_candidates(self, p: int, m: int, sched: str, gbs: int) -> Iterable[SearchResult]:
        """The best uniform plans of this configuration (even stage split).

        Every uniform strategy is screened with the tables (vectorised over strategies); the ones
        that fit and tie for the best screened throughput are then estimated exactly.
        """
        b = gbs // m
        space = self.space(p, b)
        if not space or gbs % m:
            return
        t, states, act, trans = self._layer_tables(p, m, b, space)
        stages = even_split(self.L, p)
        per_stage = self.N // p
        step = np.zeros(len(space))
        peak = np.zeros(len(space))
        for k, (i, j) in enumerate(stages):
            inflight = in_flight_microbatches(sched, m, p, k)
            time_k = t[i:j + 1].sum(axis=0)
            if k < p - 1:
                time_k = time_k + (m + p - 1) * np.array([
                    p2p_time_per_microbatch(self.tables, self.cluster, j, s, b, k * per_stage, (k + 1) * per_stage)
                    for s in space])
            mem_k = (states[i:j + 1].sum(axis=0) + inflight * act[i:j + 1].sum(axis=0)
                     + trans[i:j + 1].max(axis=0) + self.opt.reserve_bytes)
            step, peak = np.maximum(step, time_k), np.maximum(peak, mem_k)
        ok = np.isfinite(step) & (peak <= self.budget * (1 + 1e-9))
        if np.isfinite(peak).any():
            self.min_memory_seen = min(self.min_memory_seen, float(peak[np.isfinite(peak)].min()))
        if ok.any():
            best = step[ok].min()
            for j in np.flatnonzero(ok & (step <= best * (1 + 1e-9))):
                yield self._result([space[j]] * self.L, stages, p, m, sched, gbs)

    def _step_time_bound(self, p: int, m: int, gbs: int) -> float:
        """A lower bound on the step time of any plan of this configuration: the slowest stage takes
        at least the average of the layers' fastest strategies (resharding and p2p only add)."""
        b = gbs // m
        space = self.space(p, b) if gbs % m == 0 else []
        if not space:
            return math.inf
        t = self._layer_tables(p, m, b, space)[0]
        return float(np.sum(np.min(t, axis=1))) / p

    def fits(self, r: SearchResult) -> bool:
        return max(r.estimate["memory_bytes_per_device"]) <= self.budget

    def run(self) -> SearchResult:
        best: SearchResult | None = None
        tried = 0
        configs = list(self.configs())
        for n, (p, m, sched, gbs) in enumerate(configs):
            if n % 8 == 0:
                self.progress(f"search: configuration {n + 1}/{len(configs)} (pp={p}, m={m}, gbs={gbs})")
            if best is not None and gbs / self._step_time_bound(p, m, gbs) < best.estimate["throughput_samples_s"]:
                continue  # cannot beat the best plan so far (the bound is strict: ties are still searched)
            cands = [] if self.opt.uniform_only else [self.search_config(p, m, sched, gbs)]
            if self.opt.include_uniform or self.opt.uniform_only:
                cands += list(self.uniform_candidates(p, m, sched, gbs))
            for r in cands:
                tried += 1
                if r is not None and self.fits(r) and (best is None or is_better(r, best)):
                    best = r
        if best is None:
            raise self.infeasible()
        best.configs_tried = tried
        return best

    def infeasible(self) -> InfeasibleError:
        need = self.min_memory_seen
        msg = (f"no parallel plan fits the per-device memory budget of {format_bytes(self.budget)} on "
               f"{self.N} devices")
        if math.isfinite(need):
            msg += (f"; the least memory any searched plan needs is {need / 2**30:.3f} GiB "
                    f"({int(math.ceil(need))} bytes) per device")
        hints = ["raise memory_budget", "use more devices"]
        if self.opt.global_batch_size and self.opt.global_batch_size > 1:
            hints.append(f"use a smaller global_batch_size (e.g. {self.opt.global_batch_size // 2})")
        if self.opt.space.get("ckpt") is False:
            hints.append("allow activation checkpointing (ckpt)")
        err = InfeasibleError(msg + "; fix: " + ", or ".join(hints))
        err.min_memory_bytes = need
        return err


def _undominated(t: np.ndarray, mem: np.ndarray, trans: np.ndarray, space: list[Strategy]) -> np.ndarray:
    """Indices of the strategies worth keeping for these layers.

    A strategy is dropped when another of the same activation layout (tp, dp, sp: so resharding
    costs are identical) is no slower, needs no more memory and no larger transient at every layer,
    and is strictly better somewhere or earlier in the list: swapping it in never hurts, so the DP
    stays exact and keeps its lowest-index tie rule.
    """
    groups: dict[tuple, list[int]] = {}
    for idx, st in enumerate(space):
        groups.setdefault((st.tp, st.dp, st.sp), []).append(idx)
    stacked = np.stack([t, mem, trans])  # [3, L, S]
    keep = []
    for members in groups.values():
        x = stacked[:, :, members]                               # [3, L, g]
        le = np.all(x[:, :, :, None] <= x[:, :, None, :], axis=(0, 1))  # le[c, a]: c no worse than a
        lt = np.any(x[:, :, :, None] < x[:, :, None, :], axis=(0, 1))
        order = np.arange(len(members))
        beats = le & (lt | (order[:, None] < order[None, :]))
        np.fill_diagonal(beats, False)
        keep += [members[a] for a in range(len(members)) if not beats[:, a].any()]
    keep.sort()
    return np.array(keep, dtype=int)


def is_better(a: SearchResult, b: SearchResult) -> bool:
    """Higher throughput; ties: less peak memory, fewer stages, fewer micro-batches."""
    ka = (-a.estimate["throughput_samples_s"], max(a.estimate["memory_bytes_per_device"]), a.pp, a.micro_batches)
    kb = (-b.estimate["throughput_samples_s"], max(b.estimate["memory_bytes_per_device"]), b.pp, b.micro_batches)
    return ka < kb


def stderr_progress(msg: str) -> None:
    print(f"[galvatron-fx] {msg}", file=sys.stderr, flush=True)


__all__ = ["Engine", "SearchOptions", "SearchResult", "ConfigError", "stderr_progress"]
