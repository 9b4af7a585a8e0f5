"""Per-configuration tables the search reads: what every layer costs under every strategy.

A *configuration* fixes the pipeline degree ``p``, the micro-batch count ``m``, the schedule and the
global batch; :class:`ConfigTables` then holds, for layers ``l`` and the configuration's strategies
``s`` (``[L, S]`` arrays, ``inf`` where a strategy is not allowed for a layer):

* ``t``: the layer's share of its stage's step time, :func:`~.objective.layer_step_time`;
* ``states`` / ``act`` / ``trans``: bytes per device of model states, of one micro-batch's saved
  activations, and of the layer's largest transient buffer; ``host``: bytes per device kept in
  host memory (CPU offload), budgeted apart (:func:`~.objective.host_budget`);
* ``gid``: each strategy's activation layout group (``(tp, dp, sp, cp)``: resharding depends on
  nothing else), with the resharding (:meth:`reshard`) and stage-boundary send (:meth:`p2p`) times per group.

Every figure is the same float the objective (:func:`~.objective.estimate_plan`) computes, so a
solved stage's cost equals the estimate of the plan it belongs to. :func:`least_memory` is the
least memory any plan of a configuration needs (what an infeasible search reports), and
:func:`least_host` its least host bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .objective import CostSource, LayerTerms, Pipe, layer_terms, p2p_time_per_microbatch, tied_copies
from .pipeline import balanced_split, even_split
from .schedules import chunk_peaks, chunk_rank, chunk_wgrad_peaks, rank_chunks, step_slots
from .strategy import Strategy


class CachedCosts:
    """A :class:`CostSource` that memoises by layer *signature* (identical layers cost the same),
    strategy and micro-batch size."""

    def __init__(self, costs: CostSource, cluster: Any, signatures: list[str]):
        self.costs, self.cluster, self.signatures = costs, cluster, signatures
        self._cost: dict[tuple, Any] = {}
        self._terms: dict[tuple, LayerTerms] = {}
        self._rows: dict[tuple, np.ndarray] = {}
        self._reshard: dict[tuple, float] = {}
        self._boundary: dict[tuple, float] = {}
        self._tied_copies: dict[tuple[int, int], float] = {}

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

    def rows(self, layer: int, space: tuple[Strategy, ...], b: int) -> np.ndarray:
        """``[10, S]``: time per micro-batch, per-step sync, states, activations, transient, the
        split-backward extra time per micro-batch, held bytes and per-micro-batch held bytes
        (:meth:`~.objective.LayerTerms.split`), the host bytes (CPU offload) and the host bytes per
        micro-batch in flight (offloaded activations)."""
        key = (self.signatures[layer], space, b)
        if key not in self._rows:
            terms = [self.terms(layer, s, b) for s in space]
            self._rows[key] = np.array([[x.time_per_microbatch_s for x in terms], [x.step_sync_s for x in terms],
                                        [x.states_bytes for x in terms], [x.activation_bytes for x in terms],
                                        [x.transient_bytes for x in terms], [x.split_time_s for x in terms],
                                        [x.split_bytes for x in terms], [x.wgrad_bytes for x in terms],
                                        [x.host_bytes for x in terms], [x.host_activation_bytes for x in terms]],
                                       dtype=np.float64).reshape(10, len(space))
        return self._rows[key]

    def reshard_time(self, layer: int, prev: Strategy, nxt: Strategy, b: int) -> float:
        # NOTE: resharding moves the activation between layouts; only (tp, dp, sp, cp) matter.
        key = (self.signatures[layer], (prev.tp, prev.dp, prev.sp, prev.cp), (nxt.tp, nxt.dp, nxt.sp, nxt.cp), b)
        if key not in self._reshard:
            self._reshard[key] = self.costs.reshard_time(layer, prev, nxt, b)
        return self._reshard[key]

    def tied_copy_bytes(self, first: int, last: int) -> float:
        """Bytes of the tied-weight copies a pipeline chunk of layers ``first..last`` holds per
        micro-batch (:func:`~.objective.tied_copies`)."""
        key = (first, last)
        if key not in self._tied_copies:
            self._tied_copies[key] = tied_copies(self.costs, first, last)
        return self._tied_copies[key]

    def boundary_bytes(self, layer: int, b: int) -> float:
        key = (self.signatures[layer], b)
        if key not in self._boundary:
            self._boundary[key] = self.costs.boundary_bytes(layer, b)
        return self._boundary[key]


@dataclass
class ConfigTables:
    """One configuration's tables (module docstring). Built by :meth:`Engine.config`."""

    p: int
    m: int
    schedule: str
    gbs: int
    space: list[Strategy]
    t: np.ndarray
    states: np.ndarray
    act: np.ndarray
    trans: np.ndarray
    gid: np.ndarray
    layouts: list[Strategy]
    sig_ids: np.ndarray
    costs: CachedCosts
    cluster: Any
    world_size: int
    bound: float = 0.0
    v: int = 1                  # virtual stages: chunks per pipeline rank (interleaved 1F1B)
    wg: np.ndarray | None = None  # zero-bubble: [L, S] bytes held per micro-batch from I to W
    host: np.ndarray | None = None  # [L, S] host bytes per device (CPU offload; None: all zero)
    host_act: np.ndarray | None = None  # [L, S] host bytes per micro-batch in flight (None: all zero)
    memo: dict = field(default_factory=dict)
    _reshard: dict = field(default_factory=dict)
    _p2p: dict = field(default_factory=dict)
    _chunks: list | None = None

    @property
    def b(self) -> int:
        """Samples per micro-batch (all data-parallel ranks together)."""
        return self.gbs // self.m

    @property
    def pipe(self) -> Pipe:
        """The configuration's schedule shape (the ranks' drift at its transfers: :func:`~.objective.step_time`)."""
        return Pipe(self.schedule, self.v, self.m)

    @property
    def slots(self) -> float:
        """Micro-batch slots of a step, the pipeline bubble included (:func:`~.schedules.step_slots`:
        ``m + p - 1`` for GPipe and 1F1B)."""
        return step_slots(self.schedule, self.p, self.v, self.m)

    def inflight(self, k: int) -> int:
        """Micro-batches in flight at stage ``k``'s peak (one chunk per stage)."""
        return self.chunk_peaks()[k]

    def chunks(self) -> list[tuple[int, int]]:
        """The fixed split into ``p * v`` chunks of a configuration: with one chunk per stage the
        even split (the uniform plans' stages); with several, the split balancing each layer's
        fastest time over its allowed strategies (:func:`~.pipeline.balanced_split`)."""
        if self.v == 1:
            return even_split(len(self.sig_ids), self.p)
        if self._chunks is None:
            self._chunks = balanced_split(self.t.min(axis=1), self.p * self.v)
        return self._chunks

    def chunk_peaks(self) -> tuple[int, ...]:
        """Every chunk's micro-batches in flight at its peak (:func:`~.schedules.chunk_peaks`)."""
        return chunk_peaks(self.schedule, self.p, self.v, self.m)

    def rank_chunks(self, k: int) -> list[int]:
        """The chunks stage ``k`` runs (:func:`~.schedules.rank_chunks`)."""
        return rank_chunks(self.schedule, k, self.p, self.v)

    def rank_rows(self, k: int) -> tuple[list[int], np.ndarray]:
        """Stage ``k``'s layers (its chunks' in chunk order) and their ``[n, S]`` additive bytes,
        each layer's activations times its chunk's in-flight peak."""
        chunks = self.chunks()
        mine = self.rank_chunks(k)
        rows = [self.with_tied_copies(self.chunk_memory(ch, *chunks[ch]), ch, *chunks[ch]) for ch in mine]
        return [i for ch in mine for i in range(chunks[ch][0], chunks[ch][1] + 1)], np.concatenate(rows)

    def wgrad_peak(self, ch: int) -> int:
        """Chunk ``ch``'s most micro-batches between I and W (:func:`~.schedules.chunk_wgrad_peaks`)."""
        return chunk_wgrad_peaks(self.schedule, self.p, self.v, self.m)[ch] if self.wg is not None else 0

    def chunk_memory(self, ch: int, i: int, j: int) -> np.ndarray:
        """``[j-i+1, S]`` additive bytes per device of layers ``i..j`` in chunk ``ch``: states and
        the chunk's in-flight activations (zero-bubble: and the gradients held from I to W)."""
        out = self.states[i:j + 1] + self.chunk_peaks()[ch] * self.act[i:j + 1]
        q = self.wgrad_peak(ch)
        if q:   # (0 * inf would be NaN where a strategy is not allowed)
            out = out + q * self.wg[i:j + 1]
        return out

    def chunk_host(self, ch: int, i: int, j: int) -> np.ndarray:
        """``[j-i+1, S]`` host bytes per device of layers ``i..j`` in chunk ``ch`` (only where
        :attr:`host` is set): CPU offload's per step, offloaded activations per micro-batch in flight."""
        out = self.host[i:j + 1]
        if self.host_act is not None:
            out = out + self.chunk_peaks()[ch] * self.host_act[i:j + 1]
        return out

    def rank_host(self, k: int) -> np.ndarray:
        """:meth:`chunk_host` of stage ``k``'s chunks, in :meth:`rank_rows`' layer order."""
        chunks = self.chunks()
        return np.concatenate([self.chunk_host(ch, *chunks[ch]) for ch in self.rank_chunks(k)])

    def chunk_send(self, ch: int) -> np.ndarray:
        """``[G]`` seconds per step chunk ``ch`` spends sending to the next chunk, per layout group of
        its last layer (zeros for the model's last chunk or a next chunk on the same stage)."""
        k, j = chunk_rank(self.schedule, ch, self.p), self.chunks()[ch][1]
        dst = chunk_rank(self.schedule, ch + 1, self.p) if ch + 1 < self.p * self.v else k
        return self.p2p_groups(j, k, dst) if dst != k else np.zeros(len(self.layouts))

    def least_inflight(self) -> int:
        """The fewest micro-batches any stage (chunk) holds at its peak."""
        return min(self.chunk_peaks())

    def memory(self, i: int, j: int, k: int) -> np.ndarray:
        """``[j-i+1, S]`` additive bytes per device of layers ``i..j`` on stage ``k`` (one chunk per
        stage), the tied weights the stage receives counted on its first layer."""
        return self.with_tied_copies(self.chunk_memory(k, i, j), k, i, j)

    def with_tied_copies(self, rows: np.ndarray, ch: int, i: int, j: int) -> np.ndarray:
        """``rows`` (chunk ``ch``'s layers ``i..j``) with the tied-weight copies the chunk holds per
        micro-batch in flight (:meth:`CachedCosts.tied_copy_bytes`) added to its first row."""
        if self.p * self.v == 1:
            return rows
        extra = self.chunk_peaks()[ch] * self.costs.tied_copy_bytes(i, j)
        if extra:
            rows = rows.copy()
            rows[0] += extra
        return rows

    def reshard(self, layer: int) -> np.ndarray:
        """``[G, G]`` seconds per step to reshard ``layer``'s output between layout groups."""
        key = self.sig_ids[layer]
        if key not in self._reshard:
            rs = self.costs.reshard_time
            self._reshard[key] = np.array([[self.slots * rs(layer, a, c, self.b) for c in self.layouts]
                                           for a in self.layouts])
        return self._reshard[key]

    def p2p(self, layer: int, k: int, dst: int | None = None) -> np.ndarray:
        """``[S]`` seconds per step to send ``layer``'s output from stage ``k`` to ``dst`` (default
        ``k + 1``)."""
        return self.p2p_groups(layer, k, dst)[self.gid]

    def p2p_groups(self, layer: int, k: int, dst: int | None = None) -> np.ndarray:
        """:meth:`p2p` per layout group (``[G]``)."""
        dst = k + 1 if dst is None else dst
        key = (self.sig_ids[layer], k, dst)
        if key not in self._p2p:
            d = self.world_size // self.p
            self._p2p[key] = np.array([self.slots * p2p_time_per_microbatch(self.costs, self.cluster, layer, s,
                                                                            self.b, k * d, dst * d)
                                       for s in self.layouts])
        return self._p2p[key]


def layout_groups(space: list[Strategy]) -> tuple[np.ndarray, list[Strategy]]:
    """Group index of each strategy by activation layout ``(tp, dp, sp, cp)`` (the context-parallel
    kind changes no layout), and one strategy per group."""
    index: dict[tuple, int] = {}
    reps: list[Strategy] = []
    gid = []
    for s in space:
        key = (s.tp, s.dp, s.sp, s.cp)
        if key not in index:
            index[key] = len(reps)
            reps.append(s)
        gid.append(index[key])
    return np.array(gid, dtype=np.int64), reps


def undominated(t: np.ndarray, mem: np.ndarray, trans: np.ndarray, gid: np.ndarray,
                host: np.ndarray | None = None) -> np.ndarray:
    """Indices of the strategies worth keeping for these layers.

    A strategy is dropped when another of the same layout group (so resharding and stage sends cost
    the same) is no slower, needs no more memory, no larger transient and (``host``, where the host
    budget may bind) no more host bytes at every layer, and is strictly better somewhere or earlier
    in the list: swapping it in never hurts, so the stage's optimum is unchanged.
    """
    keep = []
    stacked = np.stack([t, mem, trans] if host is None else [t, mem, trans, host])  # [3 or 4, n, S]
    for g in np.unique(gid):
        members = np.flatnonzero(gid == g)
        if len(members) == 1:
            keep.append(int(members[0]))
            continue
        x = stacked[:, :, members]
        le = np.all(x[:, :, :, None] <= x[:, :, None, :], axis=(0, 1))  # le[c, a]: c no worse than a
        lt = np.any(x[:, :, :, None] < x[:, :, None, :], axis=(0, 1))
        order = np.arange(len(members))
        beats = le & (lt | (order[:, None] < order[None, :]))
        np.fill_diagonal(beats, False)
        keep += [int(members[a]) for a in range(len(members)) if not beats[:, a].any()]
    keep.sort()
    return np.array(keep, dtype=np.int64)


def least_host(c: ConfigTables) -> float:
    """The least host bytes per device (CPU offload) of any plan of ``c``, to a relative 1e-9 (0 when
    nothing offloads): each layer's least host bytes, summed per stage over the split balancing them
    (:func:`~.pipeline.balanced_split`; CPU offload's host bytes do not depend on the stage;
    offloaded activations are counted at the fewest micro-batches in flight of any chunk: then a
    lower bound), or over the
    fixed chunks of a multi-chunk configuration."""
    if c.host is None:
        return 0.0
    host = c.host if c.host_act is None else c.host + min(c.chunk_peaks()) * c.host_act
    per = np.where(np.isfinite(c.t), host, np.inf).min(axis=1)
    parts = [c.rank_rows(k)[0] for k in range(c.p)] if c.v > 1 else \
        [list(range(i, j + 1)) for i, j in balanced_split(per, c.p)]
    return max(float(per[rows].sum()) for rows in parts)


def least_memory_chunks(c: ConfigTables, reserve_bytes: float = 0.0) -> float:
    """:func:`least_memory` of a multi-chunk configuration (its split is fixed): per stage, the
    least over transient thresholds of the threshold plus each layer's least additive bytes."""
    allowed = np.isfinite(c.t)
    ths = np.unique(c.trans[allowed])
    A = allowed[None] & (c.trans[None] <= ths[:, None, None])            # [Q, L, S]
    worst = 0.0
    for k in range(c.p):
        idx, M = c.rank_rows(k)
        per = np.where(A[:, idx], M[None], np.inf).min(axis=2).sum(axis=1)   # [Q]
        worst = max(worst, float((per + ths).min()))
    return worst + reserve_bytes


def least_memory(c: ConfigTables, reserve_bytes: float = 0.0) -> float:
    """The least per-device memory of any plan of ``c`` (bytes, reserve included, exact to a byte):
    the min over splits of the hungriest stage's least memory. Bisection on that value; per trial a
    DP over stage ends in which each stage starts as late as the previous ones allow (a stage's
    least memory only grows with its range, so the latest start is the best). Where a stage holds
    copies of tied weights (:meth:`CachedCosts.tied_copy_bytes`, which change as its range takes in
    or leaves out their owner and readers) :func:`_least_memory_tied` tries every start instead, up to
    :data:`_EXACT_RECEIVED_WORK`; beyond it they are left out (then a lower bound)."""
    L, p = c.t.shape[0], c.p
    allowed = np.isfinite(c.t)
    ths = np.unique(c.trans[allowed])
    A = allowed[None] & (c.trans[None] <= ths[:, None, None])            # [Q, L, S]
    sums, holes = [], []
    for k in range(p):
        per = np.where(A, c.memory(0, L - 1, k)[None], np.inf).min(axis=2)  # [Q, L]
        zero = np.zeros((len(ths), 1))
        # NOTE: layers a threshold leaves without a strategy are counted apart (inf would poison
        # every later prefix difference)
        sums.append(np.concatenate([zero, np.cumsum(np.where(np.isfinite(per), per, 0.0), axis=1)], axis=1))
        holes.append(np.concatenate([zero, np.cumsum(~np.isfinite(per), axis=1)], axis=1))

    def stage(k: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        v = sums[k][:, j + 1] - sums[k][:, i] + ths[:, None]
        v = np.where(holes[k][:, j + 1] - holes[k][:, i] > 0, np.inf, v)
        return v.min(axis=0) + reserve_bytes

    js = np.arange(L)
    # a tied weight crosses between any chunk holding its owner and one holding a reader
    tied = p > 1 and any(c.costs.tied_copy_bytes(i, i) > 0 for i in range(L))
    if tied and p * len(ths) * L * L <= _EXACT_RECEIVED_WORK:
        received = np.array([[c.costs.tied_copy_bytes(i, j) if i <= j else 0.0 for j in range(L)]
                             for i in range(L)])
        return _least_memory_tied(c, stage, received, len(ths))

    def feasible(tau: float) -> bool:
        reach = stage(0, np.zeros(L, dtype=np.int64), js) <= tau
        for k in range(1, p):
            last = np.maximum.accumulate(np.where(reach, js, -1))
            prev = np.r_[-1, last[:-1]]
            ok = prev >= 0
            i = np.where(ok, prev + 1, 0)
            reach = ok & (stage(k, i, js) <= tau)
        return bool(reach[L - 1])

    return _bisect(feasible, max(float(stage(k, np.array([i]), np.array([j]))[0])
                                 for k, (i, j) in enumerate(even_split(L, p))))


def _bisect(feasible, hi: float) -> float:
    """The least ``tau`` (to half a byte) with ``feasible(tau)``, ``hi`` feasible (inf: none)."""
    if not math.isfinite(hi):
        return math.inf
    lo = 0.0
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


_EXACT_RECEIVED_WORK = 4e8
"""Stages x transient thresholds x layers² up to which :func:`least_memory` tries every stage start
(time ~ that many element operations, memory bounded by blocks); larger searches report the bound."""


def _least_memory_tied(c: ConfigTables, stage, received: np.ndarray, thresholds: int) -> float:
    """:func:`least_memory` where stages hold copies of tied weights: a stage's memory is no longer
    monotone in its range, so each trial's DP tries every start of every stage (``stage(k, i, j)``:
    the least memory of layers ``i..j`` on stage ``k``; ``received[i, j]``: the bytes of the tied
    copies a chunk ``i..j`` holds per micro-batch in flight)."""
    L, p = received.shape[0], c.p
    block = max(1, int(2e7 // max(1, thresholds * L)))   # columns per call: bounded temporaries
    full = []
    for k in range(p):
        f = np.full((L, L), np.inf)
        for j0 in range(0, L, block):
            J = np.arange(j0, min(L, j0 + block))
            I, JJ = np.meshgrid(np.arange(L), J, indexing="ij")
            upper = I <= JJ
            vals = stage(k, np.where(upper, I, 0).ravel(), JJ.ravel()).reshape(I.shape)
            f[:, J] = np.where(upper, vals + c.chunk_peaks()[k] * received[:, J], np.inf)
        full.append(f)

    def feasible(tau: float) -> bool:
        reach = full[0][0] <= tau                      # reach[j]: layers 0..j on the stages so far
        for k in range(1, p):
            covered = np.r_[False, reach[:-1]]         # covered[i]: layers 0..i-1
            reach = ((full[k] <= tau) & covered[:, None]).any(axis=0)
        return bool(reach[L - 1])

    return _bisect(feasible, max(float(full[k][i, j]) for k, (i, j) in enumerate(even_split(L, p))))
