"""The search objective: how per-layer costs combine into step time and per-device memory.

One place defines the arithmetic that both the search and :func:`estimate_plan` use, so a searched
plan re-estimated from its JSON gives the same figures, and hand-made plans and baselines are judged
by the same model. Units: seconds and bytes.

For a pipeline of ``p`` stages and ``m`` micro-batches (stage ``k`` on devices ``k*N/p ..``):

* a layer's time per micro-batch ``t_mb = overlap(fwd + bwd, zero3_gather + reduce_scatter) +
  tp_comm + overhead + reshard_in``: ZeRO-3's parameter gathers (forward and backward) and ZeRO-2/3's
  per-micro-batch gradient reduce-scatter overlap compute (the runtime prefetches the next layer's
  gather in forward, the previous one's in backward, and reduce-scatters asynchronously, each beside
  a neighbour's compute, priced as the layer's own); TP collectives and the framework's fixed
  per-layer / per-micro-batch costs sit on the critical path;
* its per-step gradient synchronisation is exposed only beyond the last backward it overlaps (but
  the share in the last gradient bucket, ``exposed_sync``, overlaps nothing), and its share of the
  optimizer step follows, and ZeRO-2's re-gather of the updated shards overlaps the next forward
  (prefetched by the layer before): ``sync = overlap(bwd, grad_sync - exposed_sync) - bwd +
  exposed_sync + overlap(fwd, regather) - fwd + optimizer``;
* stage ``k`` takes ``T_k = slots * sum(t_mb) + sum(sync) + slots * p2p_k`` per step with
  ``slots = m + p - 1`` (GPipe and 1F1B have the same bubble) and the step time is ``max_k T_k``
  (the slowest stage paces the pipeline) plus, pipelined, the ranks' drift waited out at its
  receives and a wake-up per input asked for while its sender computes (:func:`pipeline_wait`,
  increasing in ``max_k T_k``: :func:`step_time`), scaled by the
  cluster's calibration, plus the per-step constant (:func:`step_constant`);
* a device of stage ``k`` holds ``sum(states) + inflight_k * (sum(activations) + tied) +
  max(transient) + reserve`` bytes (``tied``: the copies of tied weights crossing the stage's
  bounds, one with every micro-batch, received or sent: :func:`tied_copies`), with ``inflight_k = m`` for GPipe and
  ``min(m, p - k)`` for 1F1B, and keeps ``sum(host) + inflight_k * sum(host activations)`` bytes
  in host memory (CPU offload's states: once per step; offloaded activations: per micro-batch in
  flight) within its share of the host, :func:`host_budget`.

Under ``interleaved-1f1b`` with ``v`` virtual stages the ``p * v`` chunks go round-robin over the
stages (:mod:`.schedules`): a stage's sums run over its ``v`` chunks, ``slots = m + (p - 1) / v``,
every chunk but the last sends (``p2p`` at each of its boundaries), and each chunk's activations
count ``inflight`` times with its own peak (:func:`~.schedules.chunk_peaks`). The zero-bubble
schedules take their ``slots`` and peaks from torch's action lists (a micro-batch is held from
its forward to its weight-gradient pass) and each layer's split terms (:meth:`LayerTerms.split`:
a checkpointed layer's second recomputation, ZeRO-3's buffer held between the two passes, and
``wgrad_bytes`` per micro-batch between them, times the chunk's peak of such micro-batches,
:func:`~.schedules.chunk_wgrad_peaks`).

The cost source (:class:`CostSource`) is duck-typed: the cost model of :mod:`galvatron_fx.cost`, or
a synthetic one in tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .schedules import ZERO_BUBBLE, chunk_peaks, chunk_rank, chunk_wgrad_peaks, late_transfers, step_slots
from .strategy import Strategy


class CostSource(Protocol):
    def layer_cost(self, index: int, strategy: Strategy, micro_batch_size: int) -> Any:
        """Costs of layer ``index`` under ``strategy`` for a micro-batch of ``micro_batch_size``
        samples (over the whole data-parallel group); fields as :class:`LayerTerms` reads them."""

    def reshard_time(self, index: int, prev: Strategy, nxt: Strategy, micro_batch_size: int) -> float:
        """Seconds (forward + backward, per micro-batch) to move the activation leaving layer
        ``index`` from its layout under ``prev`` to the layout layer ``index + 1`` needs under ``nxt``."""

    def boundary_bytes(self, index: int, micro_batch_size: int) -> float:
        """Bytes of the activation(s) leaving layer ``index`` for the next layers, per micro-batch."""

    # optional: tied_copy_bytes(first, last) -> float, the bytes of the tied-weight copies a
    # pipeline chunk of layers first..last holds per micro-batch until its backward (a weight one
    # side of its bounds owns and the other reads); a cost source without it holds none


def tied_copies(costs: Any, first: int, last: int) -> float:
    """:meth:`CostSource.tied_copy_bytes` of the chunk ``first..last`` (0 for a cost source without it)."""
    fn = getattr(costs, "tied_copy_bytes", None)
    return float(fn(first, last)) if fn is not None else 0.0


@dataclass(frozen=True)
class LayerTerms:
    """One layer under one strategy, reduced to what the objective needs."""

    time_per_microbatch_s: float
    step_sync_s: float
    states_bytes: float
    activation_bytes: float
    transient_bytes: float
    split_time_s: float = 0.0     # more per micro-batch under a split (zero-bubble) backward
    split_bytes: float = 0.0      # more held under a split backward
    wgrad_bytes: float = 0.0      # held per micro-batch between its input- and weight-gradient passes
    host_bytes: float = 0.0       # kept in host memory (CPU offload), per step: against the host budget
    host_activation_bytes: float = 0.0   # kept in host memory per micro-batch in flight (offloaded activations)

    def split(self) -> LayerTerms:
        """These terms under a split (zero-bubble) backward (:data:`~.schedules.ZERO_BUBBLE`), the held
        bytes counted as states (the search's additive bytes; :func:`estimate_plan` reports them
        apart, as ``per_device["split_held_bytes"]``)."""
        return LayerTerms(self.time_per_microbatch_s + self.split_time_s, self.step_sync_s,
                          self.states_bytes + self.split_bytes, self.activation_bytes, self.transient_bytes,
                          host_bytes=self.host_bytes, host_activation_bytes=self.host_activation_bytes)


def layer_terms(cost: Any, cluster: Any) -> LayerTerms:
    """Reduce a cost model ``LayerCost`` to :class:`LayerTerms` with the cluster's overlap model."""
    compute = cost.fwd_s + cost.bwd_s
    zero = cost.zero3_gather_s + getattr(cost, "reduce_scatter_s", 0.0)
    t_mb = cluster.overlap_time(compute, zero) + cost.tp_comm_s + getattr(cost, "overhead_s", 0.0)
    exposed = getattr(cost, "exposed_sync_s", 0.0)
    regather = getattr(cost, "regather_s", 0.0)
    sync = (cluster.overlap_time(cost.bwd_s, cost.grad_sync_s - exposed) - cost.bwd_s + exposed
            + cluster.overlap_time(cost.fwd_s, regather) - cost.fwd_s + getattr(cost, "optimizer_s", 0.0))
    states = cost.states_bytes
    return LayerTerms(t_mb, sync, states, cost.activation_bytes, cost.transient_bytes,
                      getattr(cost, "split_extra_s", 0.0), getattr(cost, "split_held_bytes", 0.0),
                      getattr(cost, "split_wgrad_bytes", 0.0), getattr(cost, "host_bytes", 0.0),
                      getattr(cost, "host_activation_bytes", 0.0))


def host_budget(cluster: Any) -> float:
    """Host bytes one device may keep (CPU offload), in whole bytes: its share of its node's host
    memory (``cluster.host_memory_per_device``), ``inf`` without a host apart from the devices
    (``cluster.has_host``; duck-typed clusters without it have none)."""
    per = float(getattr(cluster, "host_memory_per_device", math.inf)) if getattr(cluster, "has_host", False) else math.inf
    return float(math.floor(per)) if math.isfinite(per) else math.inf


def layer_step_time(terms: LayerTerms, slots: float) -> float:
    """A layer's contribution to its stage's step time (seconds), ``slots`` micro-batch times per
    step (:func:`~.schedules.step_slots`: ``m + p - 1`` for GPipe and 1F1B)."""
    return slots * terms.time_per_microbatch_s + terms.step_sync_s


def p2p_time_per_microbatch(costs: CostSource, cluster: Any, last_layer: int, strategy: Strategy,
                            micro_batch_size: int, src: int, dst: int) -> float:
    """Seconds per micro-batch to send stage outputs forward and their gradients back, and the
    receiving stage's per-micro-batch bookkeeping (the cluster's ``microbatch_overhead_s``).

    Each of the stage's ``dp`` batch slices (sequence-sharded by ``tp`` under SP) travels once.
    """
    nbytes = costs.boundary_bytes(last_layer, micro_batch_size) / strategy.dp
    if strategy.sp:
        nbytes /= strategy.tp
    return 2 * cluster.p2p_time(nbytes, src, dst) + getattr(cluster, "microbatch_overhead_s", 0.0)


class Pipe(NamedTuple):
    """A pipelined plan's schedule, virtual stages per rank and micro-batches (what the ranks'
    drift at its transfers depends on: :func:`pipeline_wait`)."""

    schedule: str
    virtual_stages: int
    micro_batches: int

    @classmethod
    def of(cls, plan: Any) -> Pipe:
        """A :class:`~galvatron_fx.plan.Plan`'s."""
        return cls(plan.schedule, plan.virtual_stages, plan.micro_batches)

    def receives(self) -> int:
        """Blocking receives per step on an end stage: each of its ``v`` chunks receives every
        micro-batch's activation and its gradient, but the first stage's first chunk reads the
        batch and the last stage's last chunk computes the loss: ``(2 v - 1) m``."""
        return (2 * self.virtual_stages - 1) * self.micro_batches

    def wakeups(self, cluster: Any, pp: int) -> float:
        """Seconds per step its late-asked inputs wait for their senders' communication threads
        (:func:`~.schedules.late_transfers` x the cluster's ``p2p_wakeup_s``; 0 unpipelined)."""
        wake = getattr(cluster, "p2p_wakeup_s", 0.0)
        if pp <= 1 or not wake:
            return 0.0
        return late_transfers(self.schedule, pp, self.virtual_stages, self.micro_batches) * wake

    def compute_share(self, pp: int) -> float:
        """The share of the slowest stage's time that is compute (``m`` of its ``slots``)."""
        return self.micro_batches / step_slots(self.schedule, pp, self.virtual_stages, self.micro_batches)


def _receives(cluster: Any, pp: int, pipe: Pipe | None) -> tuple[int, float] | None:
    """``(receives per step, share of the slowest stage's time computed before each)`` where a
    pipelined plan waits out the ranks' drift; ``None`` unpipelined or without a drift figure."""
    if pp <= 1 or pipe is None or not getattr(cluster, "sync_drift_sqrt_s", 0.0):
        return None
    n = pipe.receives()
    return n, pipe.compute_share(pp) / n


def pipeline_wait(cluster: Any, pp: int, slowest_stage_s: float, pipe: Pipe | None) -> float:
    """Seconds a pipelined stage waits at its transfers (a PP2 step's time beyond its stages'
    compute, transfers and bubble: docs/measurements.md, "Figures behind the design"): for the
    ranks' drift, each receive ``cluster.sync_wait`` of the compute since the previous one (the
    stage's compute over its receives), and for the senders' wake-ups, :meth:`Pipe.wakeups`. 0
    unpipelined or without the figures. Increasing in ``slowest_stage_s``."""
    if pp <= 1 or pipe is None:
        return 0.0
    shape = _receives(cluster, pp, pipe)
    drift = 0.0 if shape is None else shape[0] * cluster.sync_wait(slowest_stage_s * shape[1])
    return drift + pipe.wakeups(cluster, pp)


def _without_pipeline_wait(cluster: Any, pp: int, total_s: float, pipe: Pipe | None) -> float:
    """The slowest stage ``x`` with ``x + pipeline_wait(x) = total_s`` (the wait is continuous and
    increasing in ``x``: the wake-ups' constant plus ``n c (sqrt(f x) - sqrt(S0))`` beyond
    ``x = S0 / f``, a quadratic in ``sqrt(x)``)."""
    if pp > 1 and pipe is not None:
        total_s -= pipe.wakeups(cluster, pp)
    shape = _receives(cluster, pp, pipe)
    if shape is None:
        return total_s
    (n, f), c, s0 = shape, cluster.sync_drift_sqrt_s, cluster.sync_stretch_s
    if total_s * f <= s0:
        return total_s
    b = n * c * math.sqrt(f)
    root = (-b + math.sqrt(b * b + 4 * (total_s + n * c * math.sqrt(s0)))) / 2
    return root * root


def step_scale(cluster: Any, pp: int) -> float:
    """The cluster's calibration factor on a ``pp``-stage plan's slowest stage: ``time_scale``
    (x ``pipeline_time_scale`` when pipelined; 1 unless set, galvatron_fx.cluster.CALIBRATION_FIELDS)."""
    scale = getattr(cluster, "time_scale", 1.0)
    return scale * getattr(cluster, "pipeline_time_scale", 1.0) if pp > 1 else scale


def step_time(cluster: Any, pp: int, world_size: int, slowest_stage_s: float, pipe: Pipe | None = None) -> float:
    """Seconds per step of a ``pp``-stage plan whose slowest stage takes ``slowest_stage_s``:
    ``step_scale * (slowest + pipeline_wait) + step_constant`` (increasing in the stage time, so a
    search minimising the slowest stage of one configuration minimises its step). ``pipe``: the
    pipelined plan's schedule (without it, no drift at the transfers is priced)."""
    stage = slowest_stage_s + pipeline_wait(cluster, pp, slowest_stage_s, pipe)
    return step_scale(cluster, pp) * stage + step_constant(cluster, pp, world_size)


def stage_limit(cluster: Any, pp: int, world_size: int, step_s: float, pipe: Pipe | None = None) -> float:
    """The slowest stage's seconds at which a ``pp``-stage plan's step takes ``step_s`` (the
    inverse of :func:`step_time`)."""
    return _without_pipeline_wait(cluster, pp, stage_total(cluster, pp, world_size, step_s), pipe)


def stage_total(cluster: Any, pp: int, world_size: int, step_s: float) -> float:
    """The slowest stage's seconds, its wait at the transfers included, at which a ``pp``-stage
    plan's step takes ``step_s``: what the cluster's time scales multiply."""
    return (step_s - step_constant(cluster, pp, world_size)) / step_scale(cluster, pp)


def step_constant(cluster: Any, pp: int, world_size: int) -> float:
    """Seconds every step of a ``pp``-stage plan on ``world_size`` devices costs beyond its stages'
    terms: the runtime's per-step collectives (the loss all-reduced over the world; a pipeline's
    stages agreeing on the batch by one small all-gather, galvatron_fx/runtime/pipeline.py) and
    the cluster's ``step_overhead_s`` (+ ``pipeline_step_s`` when pipelined; 0 unless set)."""
    ct = getattr(cluster, "collective_time", None)
    sync = ct("all_reduce", 4, world_size) if ct is not None else 0.0
    if pp > 1 and ct is not None:
        sync += ct("all_gather", 8 * pp, list(range(0, world_size, world_size // pp)))
        sync += getattr(cluster, "pipeline_step_s", 0.0)
    return sync + getattr(cluster, "step_overhead_s", 0.0)


def estimate_plan(costs: CostSource, cluster: Any, *, strategies: list[Strategy], stages: list[tuple[int, int]],
                  micro_batches: int, global_batch_size: int, schedule: str, world_size: int,
                  reserve_bytes: float = 0.0, virtual_stages: int = 1) -> dict:
    """The cost model's figures for one plan (the Plan JSON's ``estimate`` plus a breakdown).

    ``stages`` are the plan's ``pp * virtual_stages`` chunks. ``layers`` gives each layer's
    step-time share (seconds, resharding into it included) and its bytes per device (states,
    in-flight activations, transient). ``memory_bytes_per_device``, ``host_bytes_per_device`` (what
    a device keeps in host memory: CPU offload) and ``stage_time_s`` have one entry per pipeline
    stage: every device of a stage holds the same amount under galvatron_fx's rank layout.
    ``host_budget_bytes``: the host bytes a device may keep (:func:`host_budget`; ``None`` without
    a host); a plan fits when both lists are within their budgets.
    """
    v = virtual_stages
    pp = len(stages) // v
    per_stage = world_size // pp
    b = global_batch_size // micro_batches
    slots = step_slots(schedule, pp, v, micro_batches)
    stage_time, states, acts, transient, held_bytes, host = ([0.0] * pp for _ in range(6))
    per_layer: list[dict] = []
    held = chunk_peaks(schedule, pp, v, micro_batches)   # chunk -> micro-batches in flight at its peak
    split = schedule in ZERO_BUBBLE
    wpeaks = chunk_wgrad_peaks(schedule, pp, v, micro_batches)   # chunk -> micro-batches between I and W
    for c, (first, last) in enumerate(stages):
        k, inflight = chunk_rank(schedule, c, pp), held[c]
        t = 0.0
        for i in range(first, last + 1):
            terms = layer_terms(costs.layer_cost(i, strategies[i], b), cluster)
            if split:   # the split time counts as the layer's; what it holds apart from states
                held_bytes[k] += terms.split_bytes + wpeaks[c] * terms.wgrad_bytes
                terms = LayerTerms(terms.time_per_microbatch_s + terms.split_time_s, terms.step_sync_s,
                                   terms.states_bytes, terms.activation_bytes, terms.transient_bytes,
                                   host_bytes=terms.host_bytes, host_activation_bytes=terms.host_activation_bytes)
            lt = layer_step_time(terms, slots)
            if i > first:
                lt += slots * costs.reshard_time(i - 1, strategies[i - 1], strategies[i], b)
            t += lt
            per_layer.append({"time_s": lt, "states_bytes": int(round(terms.states_bytes)),
                              "activation_bytes": int(round(inflight * terms.activation_bytes)),
                              "transient_bytes": int(round(terms.transient_bytes)),
                              "host_bytes": int(round(terms.host_bytes + inflight * terms.host_activation_bytes))})
            states[k] += terms.states_bytes
            acts[k] += inflight * terms.activation_bytes
            transient[k] = max(transient[k], terms.transient_bytes)
            # per step (CPU offload's states), and per micro-batch in flight (offloaded activations)
            host[k] += terms.host_bytes + inflight * terms.host_activation_bytes
        if len(stages) > 1:   # tied weights crossing the chunk's bounds: one copy per micro-batch in flight
            extra = inflight * tied_copies(costs, first, last)
            acts[k] += extra
            per_layer[-(last - first + 1)]["activation_bytes"] += int(round(extra))
        nxt = chunk_rank(schedule, c + 1, pp) if c + 1 < len(stages) else k
        if nxt != k:
            t += slots * p2p_time_per_microbatch(costs, cluster, last, strategies[last], b,
                                                 k * per_stage, nxt * per_stage)
        stage_time[k] += t
    mem = [st + ac + tr + hd + reserve_bytes for st, ac, tr, hd in zip(states, acts, transient, held_bytes)]
    step = step_time(cluster, pp, world_size, max(stage_time), Pipe(schedule, v, micro_batches))
    hb = host_budget(cluster)
    return {
        "step_time_s": step,
        "throughput_samples_s": global_batch_size / step if step > 0 else float("inf"),
        "memory_bytes_per_device": [int(round(x)) for x in mem],
        "host_bytes_per_device": [int(round(x)) for x in host],
        "host_budget_bytes": int(hb) if math.isfinite(hb) else None,
        "stage_time_s": stage_time,
        "layers": per_layer,
        "per_device": {
            "states_bytes": [int(round(x)) for x in states],
            "activation_bytes": [int(round(x)) for x in acts],
            "transient_bytes": [int(round(x)) for x in transient],
            # zero-bubble: ZeRO-3 buffers and the weight pass's output gradients held from I to W
            "split_held_bytes": [int(round(x)) for x in held_bytes],
            "reserve_bytes": int(reserve_bytes),
        },
    }
