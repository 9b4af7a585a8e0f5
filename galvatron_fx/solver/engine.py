"""The outer search: the best plan of the whole space under the cost model, exactly.

**The space.** A plan is a configuration and per-layer strategies:

* pipeline degree ``p``: every divisor of the device count ``N`` with ``p <= L`` layers;
* global batch: the given one, or (free) every ``2^i`` and ``2^i * q`` (``q`` the odd part of ``N``)
  up to ``max_global_batch_size``;
* micro-batch count ``m``: every divisor of the global batch (``m >= p`` when ``p > 1``: a pipeline
  needs a micro-batch per stage), up to ``max_micro_batches`` when given;
* schedule (:data:`~.configs.SEARCHED_SCHEDULES`): 1F1B (GPipe when pinned: under the cost model GPipe has
  1F1B's time and at least its memory, ``m >= min(m, p - k)`` micro-batches in flight, so it never
  beats 1F1B), interleaved 1F1B with ``v = 2 .. min(L / p, 8)`` virtual stages
  (:data:`~.configs.MAX_VIRTUAL_STAGES`), interleaved zero-bubble with ``v = 1 .. min(L / p, 8)`` (``v = 1``:
  ZB-H1), ZB-V and DualPipeV (``v = 2``), ``m`` as torch's schedule accepts it
  (:func:`~.schedules.check_schedule`); with ``p = 1`` only 1F1B (nothing to schedule);
* stages: every split of the layers into ``p`` contiguous non-empty stages; with ``v > 1`` the split
  into ``p * v`` chunks balancing each layer's fastest time (:func:`~.pipeline.balanced_split`;
  Megatron-LM and torchtitan cut by layer count), chunk ``c`` on stage
  ``c % p`` (the V shapes: ``c`` or ``2p - 1 - c``);
* per layer, every strategy of :func:`~.strategy.strategy_space` for ``N / p`` devices (TP degrees
  dividing the node's devices and the layer's heads and widths, any DP degree, DP / ZeRO-2 / ZeRO-3,
  SP, checkpointing; the expert- and context-parallel degrees where the engine is given them) whose
  batch slices (``dp / cp``: a CP group shares its samples) divide the micro-batch, minus what the
  constraints exclude.

A plan fits when every stage's ``sum(states + in-flight activations) + max(transient) + reserve``
is at most the budget, in bytes, and its ``sum(host)`` (kept in host memory: CPU offload) at most the
host budget (:func:`~.objective.host_budget`); its step time is :func:`~.objective.estimate_plan`'s.

**Exactness.** The search returns a fitting plan of least step time (ties: less memory, fewer
stages, fewer micro-batches), because every shortcut only skips what provably cannot win:

1. Configurations are visited best bound first. A configuration's step time is at least
   ``max(sum_l min_s t[l, s] / p, max_l min_s t[l, s])`` (resharding and sends only add), and, by
   Lagrangian relaxation of every stage's memory (``sum_l M[l, s_l] <= p * cap`` over the whole
   model, in-flight counts at their least), at least ``(sum_l min_s (t + lam * M)[l, s] - lam * p * cap) / p``
   for any ``lam >= 0``; once a bound gives no more samples/s than the best plan found, that
   configuration and every later one are skipped.
2. Within a configuration, :func:`~.pipeline.partition_min_max` is the DP over stage boundaries with
   lazily evaluated stages (its docstring proves it equals the full DP); a stage of the same layer
   signatures, in-flight count and send costs is solved once.
3. Each stage is :func:`~.stage.solve_stage_exact`: exact in bytes, the largest transient of the
   *chosen* strategies; strategies dominated within their layout group are dropped first
   (:func:`~.tables.undominated`). Under interleaved 1F1B a stage's chunks are solved as one
   sequence of layers whose chunk ends pay their sends (the stages do not interact: a chunk's
   send depends on its own last layer only).
4. Every uniform plan (all layers one strategy, even split; balanced with several chunks) is screened first: it is in the space,
   so it only sharpens the bounds.
5. The host budget: bounds ignore it (still lower bounds); every acceptance checks it (stage solves,
   the uniform screen, :meth:`Engine.fits`); where it may bind (:func:`~.stage.binding_host`) the
   dominance filter keeps fewer host bytes. Nothing offloaded (``ConfigTables.host`` None): no change.

Pure: strategies, numbers and a duck-typed cost source in; plain data out.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import ConfigError, InfeasibleError
from ..units import format_bytes
from .configs import ConfigSpace, divisors
from .objective import CostSource, estimate_plan, host_budget, stage_limit
from .pipeline import greedy_pack, partition_min_max
from .schedules import chunk_rank
from .stage import ExactStage, binding_host, solve_stage_exact
from .strategy import Strategy
from .tables import CachedCosts, ConfigTables, least_host, least_memory, least_memory_chunks, undominated

_MARGIN = 1.0 - 1e-12  # lower bounds are scaled by this: round-off never lifts them past what they bound
_SLACK = 1.0 + 1e-12


@dataclass
class SearchOptions:
    """What the search may choose. ``None`` means "search it"; a value pins it.

    ``pp``/``micro_batches``/``schedule``/``global_batch_size`` pin the outer loop; ``space`` holds
    :func:`strategy_space` keyword arguments (``ckpt``, ``sp``, ``zero2``, ``zero3``, ``max_tp``,
    ``allow_cross_node_tp``, ``power_of_two`` (default off), ``devices_per_node``);
    ``strategy_filter`` drops per-layer strategies (e.g. the baselines' "DP only");
    ``max_micro_batch_size`` caps the samples one device runs per micro-batch (``b / dp``);
    ``granularity`` is the bytes per unit of the memory relaxation (speed only).
    """

    pp: int | None = None
    micro_batches: int | None = None
    schedule: str | list[str] | None = None   # a list: those schedules only
    virtual_stages: int | None = None
    global_batch_size: int | None = None
    space: dict = field(default_factory=dict)
    strategy_filter: Callable[[Strategy], bool] | None = None
    max_micro_batches: int | None = None
    max_micro_batch_size: int | None = None
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
    virtual_stages: int = 1


class Engine(ConfigSpace):
    """Searches one model (``signatures`` per layer) on one cluster. See the module docstring."""

    def __init__(self, costs: CostSource, cluster: Any, signatures: list[str], world_size: int,
                 budget_bytes: float, options: SearchOptions | None = None,
                 admits: Callable[[int, Strategy], bool] | None = None,
                 prefers: Callable[[int, Strategy], bool] | None = None,
                 ep_degrees: Iterable[int] = (1,),
                 cp_degrees: Iterable[int] = (1,),
                 cp_kinds: Iterable[str] = ("ring",),
                 tied_layers: Iterable[int] = (),
                 batch_coupled: Iterable[int] = (),
                 progress: Callable[[str], None] | None = None,
                 layer_names: list[str] | None = None):
        self.costs, self.cluster = costs, cluster
        self.L = len(signatures)
        self.N = world_size
        self.budget = float(budget_bytes)
        self.host_budget = host_budget(cluster)   # bytes per device kept in host memory (CPU offload)
        self.opt = options or SearchOptions()
        # NOTE: one answer per (layer, strategy), every registered dimension's (galvatron_fx.dims.admission):
        # without one, every layer admits the ep = 1, cp = 1 strategies
        self.admits = admits or (lambda layer, s: s.ep == 1 and s.cp == 1)
        self.prefers = prefers or (lambda layer, s: True)
        self.ep_degrees = tuple(sorted(set(ep_degrees) | {1}))   # the degrees the space offers
        self.cp_degrees = tuple(sorted(set(cp_degrees) | {1}))
        self.cp_kinds = tuple(cp_kinds)
        self.tied_layers = frozenset(tied_layers)
        # NOTE: layers mixing the samples of a batch run on the whole batch: one micro-batch (under
        # dp > 1 replicated over the DP group, priced by the cost model)
        self.batch_coupled = frozenset(batch_coupled)
        self.tables = CachedCosts(costs, cluster, signatures)
        self.progress = progress or (lambda msg: None)
        self.names = layer_names or [f"layer {i}" for i in range(self.L)]
        ids: dict[str, int] = {}
        self.sig_ids = np.array([ids.setdefault(s, len(ids)) for s in signatures], dtype=np.int64)
        self.min_memory_seen = math.inf
        self.exclusions: dict[str, int] = {}
        self._tables_memo: dict = {}
        self._adm: dict = {}

    @property
    def cap(self) -> float:
        """Bytes per device for additive memory and transients: the budget less the reserve."""
        return self.budget - self.opt.reserve_bytes

    # ------------------------------------------------------------------ spaces
    def _exclude(self, why: str) -> None:
        self.exclusions[why] = self.exclusions.get(why, 0) + 1

    def _step_bound(self, c: ConfigTables) -> float:
        """A lower bound of the step time of every plan of ``c`` (module docstring, step 1)."""
        lb = c.t.min(axis=1)
        bound = max(float(lb.sum()) / c.p, float(lb.max())) * _MARGIN
        if c.v > 1:   # the chunks are fixed: every stage's own layers and sends bound it
            bound = max(bound, self._chunk_bound(c, lb))
        least = c.states + c.least_inflight() * c.act  # the fewest in-flight micro-batches of any stage
        if float(np.where(np.isfinite(c.t), least + c.trans, np.inf).min(axis=1).max()) > self.cap * _SLACK + 1:
            return math.inf  # some layer fits no stage on its own
        if not math.isfinite(bound) or self.cap <= 0 or lb.sum() <= 0:
            return bound
        mem = np.where(np.isfinite(c.t), least, np.inf)
        return max(bound, _lagrangian(c.t, mem, self.cap, c.p)) * _MARGIN

    def _chunk_bound(self, c: ConfigTables, lb: np.ndarray) -> float:
        """A multi-chunk configuration's step time is at least each stage's: its layers' least
        times plus the least send at each of its chunk ends, and the Lagrangian bound of its own
        layers under the budget (their memory with their chunks' in-flight counts)."""
        chunks = c.chunks()
        worst = 0.0
        for k in range(c.p):
            sends = sum(float(np.min(np.where(np.isfinite(c.t[chunks[ch][1]]), c.chunk_send(ch)[c.gid], np.inf)))
                        for ch in c.rank_chunks(k))
            rows, M = c.rank_rows(k)
            T = c.t[rows]
            layers = float(T.min(axis=1).sum())
            if self.cap > 0 and layers > 0 and math.isfinite(layers):
                layers = max(layers, _lagrangian(T, np.where(np.isfinite(T), M, np.inf), self.cap, 1))
            worst = max(worst, sends + layers)
        return worst * _MARGIN

    # ------------------------------------------------------------------ one configuration
    def _stage(self, c: ConfigTables, i: int, j: int, k: int, cutoff: float) -> ExactStage:
        """Exact solve of layers ``i..j`` on stage ``k`` (memoised by signatures, in-flight count and
        send costs); strategy indices refer to ``c.space``."""
        last = k == c.p - 1
        P = None if last else c.p2p(j, k)
        key = (c.sig_ids[i:j + 1].tobytes(), c.inflight(k), c.wgrad_peak(k), b"" if last else P.tobytes(),
               c.costs.tied_copy_bytes(i, j) if c.p > 1 else 0.0)
        hit = c.memo.get(key)
        if hit is not None and (hit.feasible or not hit.fits or hit.cutoff >= cutoff):
            return hit
        T, M, X = c.t[i:j + 1], c.memory(i, j, k), c.trans[i:j + 1]
        H = None if c.host is None else binding_host(c.chunk_host(k, i, j), np.isfinite(T), self.host_budget)
        keep = undominated(T, M, X, c.gid, H)
        R = np.stack([c.reshard(l) for l in range(i, j)]) if j > i else None
        sol = solve_stage_exact(T[:, keep], M[:, keep], X[:, keep], R, self.cap, groups=c.gid[keep],
                                final=None if last else P[keep], cutoff=cutoff,
                                granularity=self.opt.granularity, host=None if H is None else H[:, keep],
                                host_budget=self.host_budget)
        if sol.feasible:
            sol = replace(sol, strategies=tuple(int(keep[s]) for s in sol.strategies))
        c.memo[key] = sol
        return sol

    def solve(self, c: ConfigTables, cutoff: float = math.inf) -> SearchResult | None:
        """The best plan of configuration ``c`` whose step time is below ``cutoff`` (``None`` if none)."""
        L, p = self.L, c.p
        if c.v > 1:
            return self._solve_chunks(c, cutoff)
        if p == 1:
            sol = self._stage(c, 0, L - 1, 0, cutoff)
            if not sol.feasible or not sol.cost < cutoff:
                return None
            return self._result([c.space[s] for s in sol.strategies], [(0, L - 1)], c)
        prefix = np.concatenate([[0.0], np.cumsum(c.t.min(axis=1))])
        mem_lb = [np.concatenate([[0.0], np.cumsum(np.where(np.isfinite(c.t), c.memory(0, L - 1, k), np.inf)
                                                   .min(axis=1))]) for k in range(p)]
        loosest = mem_lb[p - 1]

        # NOTE: prefix sums round differently from a stage's own sum: bounds keep a relative margin
        # (and memory a byte) so that round-off never lifts them above what they bound
        def window_lower(i: int, j: int) -> float:
            if loosest[j + 1] - loosest[i] > self.cap * _SLACK + 1:
                return math.inf
            return (prefix[j + 1] - prefix[i]) * _MARGIN

        def lower(i: int, j: int, k: int) -> float:
            if mem_lb[k][j + 1] - mem_lb[k][i] > self.cap * _SLACK + 1:
                return math.inf
            send = 0.0 if k == p - 1 else float(np.min(np.where(np.isfinite(c.t[j]), c.p2p(j, k), np.inf)))
            return (prefix[j + 1] - prefix[i] + send) * _MARGIN

        def cost(i: int, j: int, k: int, cut: float) -> float:
            sol = self._stage(c, i, j, k, cut)
            return sol.cost if sol.feasible else math.inf

        seed = self._seed_split(c, prefix, window_lower)
        if seed is not None:
            times = []
            for k, (i, j) in enumerate(seed):  # stop at the first stage that cannot beat the cutoff
                times.append(cost(i, j, k, cutoff))
                if times[-1] == math.inf:
                    break
            if max(times) < cutoff:
                cutoff = max(times) * _SLACK  # the DP may find this split again
        part = partition_min_max(L, p, cost, lower=lower, window_lower=window_lower, cutoff=cutoff)
        if not part.feasible:
            return None
        strategies = []
        for k, (i, j) in enumerate(part.stages):
            strategies += [c.space[s] for s in self._stage(c, i, j, k, math.inf).strategies]
        return self._result(strategies, list(part.stages), c)

    def _solve_chunks(self, c: ConfigTables, cutoff: float) -> SearchResult | None:
        """A multi-chunk configuration (fixed balanced split, module docstring): each stage's chunks
        solved exactly as one sequence of layers, a chunk's end paying its send."""
        chunks = c.chunks()
        strategies: list = [None] * self.L
        for k in range(c.p):
            mine = c.rank_chunks(k)
            layers, M = c.rank_rows(k)
            R = []
            for ch in mine:
                i, j = chunks[ch]
                R += [c.reshard(l) for l in range(i, j)]
                if ch != mine[-1]:   # the next chunk of this stage follows: the send sits between them
                    R.append(np.repeat(c.chunk_send(ch)[:, None], len(c.layouts), axis=1))
            final = c.chunk_send(mine[-1])[c.gid]
            T, X = c.t[layers], c.trans[layers]
            H = None if c.host is None else binding_host(c.rank_host(k), np.isfinite(T), self.host_budget)
            keep = undominated(T, M, X, c.gid, H)
            sol = solve_stage_exact(T[:, keep], M[:, keep], X[:, keep], np.stack(R) if R else None, self.cap,
                                    groups=c.gid[keep], final=final[keep], cutoff=cutoff,
                                    granularity=self.opt.granularity, host=None if H is None else H[:, keep],
                                    host_budget=self.host_budget)
            if not sol.feasible or not sol.cost < cutoff:
                return None
            for i, s in zip(layers, sol.strategies):
                strategies[i] = c.space[int(keep[s])]
        return self._result(strategies, chunks, c)

    def _seed_split(self, c: ConfigTables, prefix: np.ndarray, window_lower) -> list[tuple[int, int]] | None:
        """A good split to start from: min-max on each layer's fastest time, each stage's least
        memory within the budget (bisection on the bottleneck, greedy packing)."""
        def pack(limit: float) -> list[tuple[int, int]] | None:
            return greedy_pack(self.L, c.p, window_lower, limit)

        lo, hi = 0.0, float(prefix[-1])
        if pack(hi) is None:
            return None
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pack(mid) is not None else (mid, hi)
        return pack(hi)

    def _result(self, strategies, stages, c: ConfigTables) -> SearchResult:
        est = estimate_plan(self.tables, self.cluster, strategies=strategies, stages=stages, micro_batches=c.m,
                            global_batch_size=c.gbs, schedule=c.schedule, world_size=self.N,
                            reserve_bytes=self.opt.reserve_bytes, virtual_stages=c.v)
        return SearchResult(strategies, list(stages), c.p, c.m, c.schedule, c.gbs, est, virtual_stages=c.v)

    def uniform_candidates(self, c: ConfigTables) -> Iterable[SearchResult]:
        """The best uniform plans of configuration ``c`` (every layer one strategy, the configuration's fixed split).

        Every uniform strategy is screened with the tables (vectorised over strategies); the ones
        that fit and tie for the best screened step time are then estimated exactly.
        """
        stages = c.chunks()
        time = np.zeros((c.p, len(c.space)))
        mem = np.zeros((c.p, len(c.space)))
        trans = np.zeros((c.p, len(c.space)))
        host = None if c.host is None else np.zeros((c.p, len(c.space)))   # per rank (CPU offload)
        for ch, (i, j) in enumerate(stages):
            k = chunk_rank(c.schedule, ch, c.p)
            time[k] += c.t[i:j + 1].sum(axis=0) + c.chunk_send(ch)[c.gid]
            if j > i:
                time[k] += sum(np.diag(c.reshard(l)) for l in range(i, j))[c.gid]
            mem[k] += c.with_tied_copies(c.chunk_memory(ch, i, j), ch, i, j).sum(axis=0)
            trans[k] = np.maximum(trans[k], c.trans[i:j + 1].max(axis=0))
            if host is not None:
                host[k] += c.chunk_host(ch, i, j).sum(axis=0)
        step = time.max(axis=0)
        peak = (mem + trans).max(axis=0) + self.opt.reserve_bytes
        if np.isfinite(peak).any():
            self.min_memory_seen = min(self.min_memory_seen, float(peak[np.isfinite(peak)].min()))
        ok = np.isfinite(step) & (peak <= self.budget * (1 + 1e-9))
        if host is not None:
            ok &= host.max(axis=0) <= self.host_budget
        if ok.any():
            best = step[ok].min()
            for s in np.flatnonzero(ok & (step <= best * (1 + 1e-9))):
                yield self._result([c.space[s]] * self.L, stages, c)

    def fits(self, r: SearchResult) -> bool:
        est = r.estimate   # every stage within the memory budget and the host budget
        return max(est["memory_bytes_per_device"]) <= self.budget and \
            max(est.get("host_bytes_per_device") or [0]) <= self.host_budget

    # ------------------------------------------------------------------ search
    def run(self) -> SearchResult:
        configs = self.configs()
        tabled = [c for c in (self.config(*cfg) for cfg in configs) if c is not None]
        order = sorted(tabled, key=lambda c: (-(c.gbs / c.bound) if c.bound > 0 else -math.inf, c.p, c.m))
        best: SearchResult | None = None

        self.best_by_schedule: dict[str, SearchResult] = {}

        def consider(r: SearchResult | None) -> None:
            nonlocal best
            if r is None or not self.fits(r):
                return
            if best is None or is_better(r, best):
                best = r
            kept = self.best_by_schedule.get(r.schedule)
            if kept is None or is_better(r, kept):
                self.best_by_schedule[r.schedule] = r

        def beaten(c: ConfigTables) -> bool:  # no plan of c can beat the best so far
            return not c.bound < math.inf or (best is not None
                                              and c.gbs / c.bound <= best.estimate["throughput_samples_s"])

        # uniform plans first (cheap, vectorised): they sharpen the cutoff of every exact solve
        if self.opt.include_uniform or self.opt.uniform_only:
            for c in order:
                if beaten(c):
                    break
                for r in self.uniform_candidates(c):
                    consider(r)
        tried = 0
        if not self.opt.uniform_only:
            for n, c in enumerate(order):
                if beaten(c):
                    break  # sorted by bound: nothing later can beat the best plan
                if n % 16 == 0:
                    self.progress(f"search: configuration {n + 1}/{len(order)} (pp={c.p}, m={c.m}, gbs={c.gbs})")
                tried += 1
                thr = best.estimate["throughput_samples_s"] if best else 0.0
                # NOTE: solve bounds the slowest stage; the step scales it and adds a constant (step_time)
                consider(self.solve(c, stage_limit(self.cluster, c.p, self.N, c.gbs / thr, c.pipe) if thr > 0 else math.inf))
        if best is None:
            raise self.infeasible(tabled)
        best.configs_tried = tried
        # NOTE: a schedule none of whose plans was solved lost on its bound: the most samples/s any
        # of its configurations could reach
        self.schedule_bounds = {}
        for c in tabled:
            if c.schedule not in self.best_by_schedule and c.bound > 0 and math.isfinite(c.bound):
                self.schedule_bounds[c.schedule] = max(self.schedule_bounds.get(c.schedule, 0.0), c.gbs / c.bound)
        return best

    # ------------------------------------------------------------------ nothing fits
    def infeasible(self, tabled: list[ConfigTables]) -> InfeasibleError:
        if not tabled:
            reasons = sorted(self.exclusions, key=lambda w: -self.exclusions[w])
            err = InfeasibleError(
                f"no plan on {self.N} devices satisfies the restrictions: " + "; ".join(reasons[:3])
                + "; fix: relax the constraints (pp, micro_batches, tp, sdp, ckpt, max_tp, ...) or change "
                "the global batch size")
            err.min_memory_bytes = math.inf
            return err
        need = self.min_memory_seen
        if not self.opt.uniform_only:
            for c in sorted(tabled, key=lambda c: (-c.p, -c.m)):
                least = least_memory(c, self.opt.reserve_bytes) if c.v == 1 else \
                    least_memory_chunks(c, self.opt.reserve_bytes)
                need = min(need, least)
        if need <= self.budget and any(c.host is not None for c in tabled) and math.isfinite(self.host_budget):
            return self._host_infeasible(tabled, need)   # the host budget binds
        msg = (f"no parallel plan fits the per-device memory budget of {format_bytes(self.budget)} on "
               f"{self.N} devices")
        if math.isfinite(need):
            need = math.ceil(need)
            msg += (f"; the least memory any searched plan needs is {need / 2**30:.3f} GiB "
                    f"({int(need)} bytes) per device")
        hints = ["raise memory_budget", "use more devices"]
        if self.opt.global_batch_size and self.opt.global_batch_size > 1:
            hints.append(f"use a smaller global_batch_size (e.g. {self.opt.global_batch_size // 2})")
        if self.opt.space.get("ckpt") is False:
            hints.append("allow activation checkpointing (ckpt)")
        err = InfeasibleError(msg + "; fix: " + ", or ".join(hints))
        err.min_memory_bytes = need
        return err

    def _host_infeasible(self, tabled: list[ConfigTables], need: float) -> InfeasibleError:
        """Some plan fits the memory budget, none also the host budget (CPU offload): alone (the least
        host bytes of any plan exceed it: :func:`~.tables.least_host`) or with the memory budget."""
        host = math.ceil(min(least_host(c) for c in tabled))
        msg = (f"no parallel plan fits the host memory budget of {format_bytes(self.host_budget)} per device "
               f"(its share of the node's host memory, for offloaded optimizer states) on {self.N} devices")
        msg += (f"; the least host memory any searched plan needs is {host / 2**30:.3f} GiB ({host} bytes) per "
                "device" if host > self.host_budget else f" within the per-device memory budget of "
                f"{format_bytes(self.budget)}: the plans within it keep more in host memory")
        err = InfeasibleError(msg + "; fix: offload fewer layers, or raise memory_budget, or use more devices, or "
                              "use nodes with more host memory")
        err.min_memory_bytes, err.min_host_bytes = math.ceil(need), host
        return err


def _lagrangian(t: np.ndarray, mem: np.ndarray, cap: float, parts: int) -> float:
    """``max over lam >= 0`` of ``(sum_l min_s (t + lam * mem)[l, s] - lam * parts * cap) / parts``: a
    lower bound of the slowest of ``parts`` stages sharing the layers of ``t`` / ``mem`` ([L, S])
    under ``cap`` bytes each (Lagrangian relaxation of their memory). The dual is concave in
    ``lam``: golden-section search on ``log(lam)`` around the time / byte scale."""
    scale = float(t.min(axis=1).sum())

    def dual(lam: float) -> float:
        return (float(np.min(t + lam * mem, axis=1).sum()) - lam * parts * cap) / parts

    lo, hi = math.log(1e-6 * scale / cap), math.log(1e3 * scale / cap)
    r = (math.sqrt(5) - 1) / 2
    a, b = hi - r * (hi - lo), lo + r * (hi - lo)
    fa, fb = dual(math.exp(a)), dual(math.exp(b))
    for _ in range(24):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + r * (hi - lo)
            fb = dual(math.exp(b))
        else:
            hi, b, fb = b, a, fa
            a = hi - r * (hi - lo)
            fa = dual(math.exp(a))
    return max(fa, fb)


def is_better(a: SearchResult, b: SearchResult) -> bool:
    """Higher throughput; ties: less peak memory, fewer stages, fewer micro-batches, fewer chunks."""
    ka = (-a.estimate["throughput_samples_s"], max(a.estimate["memory_bytes_per_device"]), a.pp, a.micro_batches,
          a.virtual_stages)
    kb = (-b.estimate["throughput_samples_s"], max(b.estimate["memory_bytes_per_device"]), b.pp, b.micro_batches,
          b.virtual_stages)
    return ka < kb


def stderr_progress(msg: str) -> None:
    print(f"[galvatron-fx] {msg}", file=sys.stderr, flush=True)


__all__ = ["Engine", "SearchOptions", "SearchResult", "ConfigError", "divisors",
           "is_better", "stderr_progress"]
