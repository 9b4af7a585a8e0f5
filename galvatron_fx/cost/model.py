"""The cost model the search consumes: per-layer time and memory for a strategy and micro-batch.

:class:`CostModel` assembles a layer's :class:`~.records.LayerCost` here (``layer_cost``: the layer's
compute, states, activations and overheads plus each registered dimension's terms,
:mod:`galvatron_fx.dims`; experts' dispatch, context parallelism, a layout change, the symbolic
form); what each layer is comes from :class:`~.layer_queries.LayerQueries`, its compute, TP and
overhead times from :class:`~.time_terms.TimeTerms`, the records and rank groups from
:mod:`.records`.

``micro_batch_size`` ``b`` is the samples of one micro-batch across the whole stage (all ``dp``
ranks together, as :attr:`galvatron_fx.plan.Plan.micro_batch_size`); one device runs ``n = b / dp``.

Scaling rules (per device, per micro-batch unless noted), from the fake-tensor measurement
(:mod:`.measure`) and the TP roles (:mod:`.extract`):

* **FLOPs**: sharded ops (column/row-parallel matmuls, attention between them) ``/ tp``; the rest
  replicated, ``/ tp`` too with SP (sequence split). ``fwd_s``/``bwd_s`` via
  :meth:`Cluster.compute_time`; checkpointing adds the forward to the backward.
  Backward FLOPs are split sharded/replicated in the forward's proportion. The ops outside
  matmuls and attention cost the bytes they move at the memory rate: each op's own, as eager
  PyTorch (and this runtime) runs them, or with ``fused_pointwise=True`` what torch.compile's
  fused kernels move (:mod:`.fusion`), for pricing runs that compile.
* **Saved activations**: tensors produced by sharded ops ``/ tp``, others ``/ tp`` only with SP;
  with checkpointing only the layer's activation inputs (``/ tp`` with SP), and the full saved
  set becomes a transient of the recomputation.
* **TP communication** (``tp_comm_s``, not overlappable): an all-reduce of each row-/vocab-parallel
  output in forward and of each replicated column-parallel input in backward (Megatron: 2 + 2 per
  block); with SP each is an all-gather plus a reduce-scatter of the same size; checkpointing
  repeats the forward ones. TP group: ``tp`` consecutive ranks. Each collective adds the runtime's
  own work at its site (:mod:`galvatron_fx.runtime.tp_ops`): its autograd Function
  (``op_launch_s`` + ``op_launch_bwd_s``) and its copies (``copy_s_per_byte``: the all-reduced copy;
  under SP the chunk and the whole on each side); and, being a blocking sync after a stretch of the
  layer's compute, the ranks' drift over that stretch (:meth:`Cluster.sync_wait`, 0 on presets).
  With ``async_tp=True`` (for pricing runs with torch's async TP, which this runtime does not run:
  its collectives block) each SP site's all-gather and reduce-scatter are pipelined against the
  matmuls of their Megatron region in ``tp`` row chunks (:func:`.time_terms.micro_pipelined`, and the
  chunked matmuls' lost efficiency).
* **Data parallel**: DP all-reduces the layer's gradients (``/ tp``) once per step
  (``grad_sync_s``); ZeRO-2 and ZeRO-3 reduce-scatter every micro-batch's (``reduce_scatter_s``);
  ZeRO-2 all-gathers the updated parameters once per step (``regather_s``, beside the next
  forward); ZeRO-3 (``zero3_gather_s``, per micro-batch) all-gathers the parameters in forward and
  in backward.
  DP group: ``dp`` ranks strided by ``tp``. How these overlap with compute, and how layers add up
  to a step and a device's memory, is :mod:`galvatron_fx.solver.objective` (one place for both).
* **Context parallelism** (``cp > 1``, :mod:`.context`): a rank runs ``n = b / dp`` samples' tokens
  as at ``cp = 1`` (``n`` may be a fraction of a sample), so FLOPs, activations, TP traffic and
  states are ``cp = 1``'s at ``n``, except the attention: the ring's eager fp32 blocks (or Ulysses'
  reshuffling copies) replace the attention cores in ``fwd_s`` / ``bwd_s`` (:meth:`CostModel.cp_compute`);
  the ring shifts or Ulysses all-to-alls over the CP group join ``tp_comm_s`` (not overlapped unless
  ``cp_overlap``), their launches ``overhead_s``, their buffers (and the ring's score blocks) the
  transient; :meth:`CostModel.reshard_time` gathers a ``cp`` layer's sequence at a layout boundary.
* **Overheads** (the cluster's fixed costs, :data:`galvatron_fx.cluster.OVERHEAD_FIELDS`): in
  analytic mode ``overhead_s`` adds ``op_launch_s`` + ``op_launch_bwd_s`` per op of the layer graph
  (the forward's twice under checkpointing; ``fwd_s``/``bwd_s`` stay FLOPs over the compute rate;
  profiled layer times already hold the launches); a checkpointed layer adds ``checkpoint_op_s``
  per op in both modes; every collective call adds
  ``collective_latency_s`` (DP gradients packed into ``bucket_bytes`` buckets pay their share of a
  call, and the last bucket's share, ``exposed_sync_s``, overlaps no backward); ``overhead_s`` (per
  micro-batch) is ``layer_overhead_s``, plus ``microbatch_overhead_s`` on the first layer (slicing,
  loss, starting backward); ``optimizer_s`` (per step) is ``optimizer_s_per_byte`` x the fp32
  parameter bytes the device updates (its shard under ZeRO) + ``optimizer_overhead_s`` for the
  layer's flat buffer, and on the first layer one collective call (the step's loss all-reduce).
  The runtime's copies (gradients flattened every pass, ZeRO-3's parameters copied out of the
  gather staging, DP's buckets and ZeRO-2's re-gather once per step) cost ``copy_s_per_byte`` per
  byte written, in ``overhead_s`` and ``optimizer_s`` (:func:`galvatron_fx.dims.data.copy_times`).
* **Memory**: :mod:`.memory` for states; transients are ZeRO-3's gathered parameters of the layer,
  its neighbours' prefetched ones (the layer before it in backward, after it in forward, each at
  its own size) with their ``[dp, S]`` all-gather staging buffer, and the buffer's gradient or its
  reduce-scatter staging,
  the gradient bucket (``bucket_bytes``, full gradients for ZeRO-3's reduce-scatter) and the
  recomputed activations under checkpointing.
* **Precision** (``precision``): ``"fp32"`` computes and stores everything in fp32;
  ``"bf16-mixed"`` / ``"fp16-mixed"`` compute at the device's bf16 / fp16 peak (:meth:`Cluster.compute_time`),
  keep activations and the working parameters in 2-byte elements (TP traffic, pipeline sends and
  ZeRO's parameter gathers move 2 bytes per element), gradients in fp32 (reduced over DP in 4-byte
  elements unless ``reduce_dtype`` is the compute dtype) and fp32 masters and optimizer moments
  (:mod:`.memory` has the per-precision table, as :mod:`galvatron_fx.runtime.precision` runs it).
  The legacy ``dtype`` / ``mixed_precision`` arguments are the same thing spelled apart.
"""

from __future__ import annotations

import dataclasses
import math

import sympy
import torch
import torch.fx

from .. import dims
from ..cluster import Cluster, normalize_dtype
from ..dims import CostTerms
from ..dims.base import layer_elems
from ..dims.data import buffer_terms, copy_times
from ..errors import ConfigError
from ..ir import META_KEY, TORCH_DTYPES
from ..solver.strategy import Strategy
from ..units import parse_bytes
from .context import (
    SplitIntercepts,
    attention_flops,
    cp_attention_ops,
    cp_attention_time,
    cp_compute_time,
    cp_group,
    cp_transient_bytes,
    layout_time,
)
from .extract import LayerGraph, capture_batch, extract_layer, needs_grad, roles_from_analysis
from .layer_queries import LayerQueries
from .measure import LayerMeasure, measure_layer
from .records import (
    CALL_OPS,
    FREE_TARGETS,
    ITEMSIZE,
    PRECISION_DTYPES,
    PROFILE_MAX_PARAM_BYTES,
    B,
    LayerCost,
    LayerParams,
    ep_group,
    expert_dp_group,
    tp_group,
)
from .selective import selective_bytes
from .time_terms import TimeTerms


def default_mode(cluster: Cluster, cost: CostModel) -> str:
    """``"profiled"`` on a measured cluster (:attr:`Cluster.profiled`) when every layer's
    parameters fit in :data:`PROFILE_MAX_PARAM_BYTES` (timing them here is quick and prices this
    machine), else ``"analytic"`` (datasheet presets; models too large to run here).

    NOTE: profiled layer times hold this device's real per-op costs and kernel efficiencies, which
    FLOPs over a matmul rate miss (on the 2-core CPU: LayerNorm, softmax and GELU cost as much as
    the matmuls); ``benchmarks/cost_model_accuracy.py --mode`` compares the two."""
    if not cluster.profiled:
        return "analytic"
    biggest = max((sum(cost._owned_params(r.index).values()) for r in cost.layers), default=0)
    return "profiled" if 4 * biggest <= PROFILE_MAX_PARAM_BYTES else "analytic"


def _saved_floats(m: LayerMeasure, n: float, tp: int, rep_div: int) -> float:
    """Floating elements one rank keeps of what the layer saves for backward at ``n`` samples: the
    TP-sharded ones over ``tp``, the replicated ones over ``rep_div`` (``tp`` under sequence
    parallelism, else 1), the ones gathered whole for a column-parallel op in full."""
    return m.saved_sharded_elems(n) / tp + m.saved_rep_elems(n) / rep_div + m.saved_gathered_elems(n)


class CostModel(LayerQueries, TimeTerms):
    """Per-layer costs of a captured graph on a cluster (module docstring for the rules).

    ``mode="analytic"`` prices FLOPs with the cluster's compute rate; ``"profiled"`` times the
    layers on the local device (:mod:`.profile`, cached in ``cache_dir``); ``None`` (the default)
    is :func:`default_mode`: profiled on a measured cluster (``Cluster.profile()`` /
    ``Cluster.preset("local")``) for layers small enough to run here, analytic otherwise.
    Structurally identical layers (equal signatures) are measured once.
    """

    def __init__(self, gm: torch.fx.GraphModule, cluster: Cluster, dtype: str = "fp32", mode: str | None = None,
                 optimizer: str = "adam", mixed_precision: bool = False, reserve_bytes: int | str = "1GiB",
                 bucket_bytes: int | str = "25MiB", cache_dir=None, profile_sizes: tuple[int, ...] | None = None,
                 precision: str | None = None, reduce_dtype: str = "fp32", profile_repeats: int = 5,
                 moe_imbalance: float = 1.0, cp_overlap: bool = False, attention_target: str | None = None,
                 fused_pointwise: bool = False, async_tp: bool = False):
        if mode not in ("analytic", "profiled", None):
            raise ConfigError(f"cost mode must be 'analytic' or 'profiled', got {mode!r}")
        if precision is not None:
            if precision not in PRECISION_DTYPES:
                raise ConfigError(f"precision must be one of {list(PRECISION_DTYPES)}, got {precision!r}")
            dtype, mixed_precision = PRECISION_DTYPES[precision]
        self.gm, self.cluster, self.mode = gm, cluster, mode
        self.dtype = normalize_dtype(dtype)
        self.itemsize = ITEMSIZE[self.dtype]
        if mixed_precision and self.dtype == "fp32":
            raise ConfigError("mixed_precision=True needs dtype='bf16' or 'fp16' (the low-precision copy)")
        self.optimizer, self.mixed_precision = optimizer, mixed_precision
        self.precision = f"{self.dtype}-mixed" if mixed_precision else self.dtype
        # gradients are reduced over DP in fp32 unless asked for the compute dtype (the runtime's
        # ``reduce_dtype``); parameters, activations and TP traffic move in the compute dtype
        self.compute_dtype = TORCH_DTYPES[self.dtype] if mixed_precision else None
        self.reduce_itemsize = ITEMSIZE[normalize_dtype(reduce_dtype)] if mixed_precision else self.itemsize
        # NOTE: 0 (or "0", as a command line passes it) means no reserve; parse_bytes rejects zero sizes
        self.reserve_bytes = parse_bytes(reserve_bytes, "reserve") if reserve_bytes not in (0, "0", None) else 0
        self.bucket_bytes = parse_bytes(bucket_bytes, "bucket_bytes") if bucket_bytes else 0
        self.cache_dir, self.profile_sizes, self.profile_repeats = cache_dir, profile_sizes, profile_repeats
        if not isinstance(moe_imbalance, (int, float)) or moe_imbalance < 1:
            raise ConfigError(f"moe_imbalance must be a number >= 1 (the busiest expert-parallel rank's expert "
                              f"work over the mean; 1 = a uniform router), got {moe_imbalance!r}")
        self.moe_imbalance = float(moe_imbalance)
        for name, value, what in (
                ("cp_overlap", cp_overlap, "whether the ring's key / value exchanges overlap the attention compute"),
                ("fused_pointwise", fused_pointwise, "whether the ops outside matmuls and attention run fused, "
                                                     "as torch.compile runs them"),
                ("async_tp", async_tp, "whether the sequence-parallel collectives run micro-pipelined with their "
                                       "matmuls, as torch's async TP runs them")):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false ({what}), got {value!r}")
        self.cp_overlap, self.fused_pointwise, self.async_tp = cp_overlap, fused_pointwise, async_tp
        from .attention_kernels import TARGETS
        if attention_target not in (None,) + TARGETS:
            raise ConfigError(f"attention_target must be one of {list(TARGETS)} (the device family whose SDPA "
                              f"kernels price attention; default the cluster's), got {attention_target!r}")
        self.attention_target = attention_target or cluster.attention_target
        info = gm.meta.get(META_KEY)
        if info is None or not info.layers:
            raise ConfigError("the cost model needs a layer-grouped graph: capture the model with gfx.capture() "
                              "(or run gfx.layers(gm) on a graph of your own) first")
        self.layers = info.layers
        grad_nodes, batch = needs_grad(gm), capture_batch(gm)
        self.graphs: dict[str, LayerGraph] = {}
        self.measures: dict[str, LayerMeasure] = {}
        self._tp: dict[tuple, object] = {}
        self._params: dict[tuple, LayerParams] = {}
        self._owned: list[dict[str, int]] | None = None
        self._tied_copies: dict[tuple[int, int], float] = {}   # (first, last) -> tied_copy_bytes
        self._param_numel: dict[str, int] | None = None      # fqn -> elements, every layer's owned parameters
        self._frozen: set[str] = set()   # fqns of frozen parameters (requires_grad=False at capture)
        self._shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in info.layers]
        self._local_shapes: dict[tuple, list[tuple[int, ...]]] = {}
        for rec in self.layers:
            if rec.signature in self.graphs:
                continue
            graph = extract_layer(gm, rec, grad_nodes, batch)
            graph.expert_nodes = self._moe()[1].get(rec.index, frozenset())
            # NOTE: which ops TP shards comes from the tensor-parallel pass's own analysis (at degree
            # 2, representative of any degree the layer admits), so FLOPs, activations and TP
            # traffic are priced for exactly what the rewrite does
            analysis = self.tp_analysis(rec.index, 2)
            roles_from_analysis(graph, None if isinstance(analysis, Exception) else analysis)
            self.graphs[rec.signature] = graph
            self.measures[rec.signature] = measure_layer(graph, compute_dtype=self.compute_dtype,
                                                         attention=self.attention_target)
        self.op_counts = {sig: sum(n.op in CALL_OPS and n.target not in FREE_TARGETS for n in g.gm.graph.nodes)
                          for sig, g in self.graphs.items()}
        """Ops (fx call nodes, getitem excluded) per layer signature: what ``op_launch_s`` prices."""
        if self.mode is None:
            self.mode = default_mode(cluster, self)
        self._profiles: dict[tuple, dict] = {}

    # ------------------------------------------------------------------ inputs


    # ------------------------------------------------------------------ public figures


    def activation_bytes(self, index: int, strategy: Strategy, micro_batch_size: float) -> float:
        """Bytes saved for backward per micro-batch per device (see the module docstring)."""
        return self._activations(self.measure(index), micro_batch_size / strategy.dp, strategy,
                                 self.ep_of(index, strategy), index)[0]

    def _activations(self, m: LayerMeasure, n: float, s: Strategy, ep: int = 1,
                     index: int | None = None) -> tuple[float, float]:
        """(saved bytes kept until backward, saved bytes without checkpointing). Under expert
        parallelism a rank's experts blocks run on the tokens of its EP group that need one of its
        experts (:meth:`LayerExperts.needing_fraction`), its TP rank's share of them."""
        rep_div = s.tp if s.sp else 1
        if s.cp > 1:
            m = SplitIntercepts(m, s.cp)
        # NOTE: integer tensors (token ids, labels, masks) are saved whole: the runtime does not
        # split them along the sequence
        full = _saved_floats(m, n, s.tp, rep_div) * self.itemsize + m.saved_other_bytes(n)
        if ep > 1:   # the busiest rank serves moe_imbalance x the mean
            f = ep * self.experts(index).needing_fraction(ep) * self.moe_imbalance
            full += (f - 1) * m.saved_expert_elems(n) * self.itemsize / s.tp
        if index is not None and s.cp > 1:
            # NOTE: the ring keeps the whole mask of its b = n * cp samples (cp - 1 samples' more)
            full += (s.cp - 1) * n * self.attention(index).mask_bytes
        if s.ckpt:
            extra = (s.cp - 1) * n * self.attention(index).mask_bytes if index is not None and s.cp > 1 else 0.0
            kept = m.input_elems(n) * self.itemsize / rep_div + m.input_other_bytes(n) + extra
            if s.ckpt in ("selective", "selective-op"):   # and the outputs of its matmuls and attention kernels
                kept += selective_bytes(m, n, s, self.itemsize)
            return kept, full
        return full, full

    def backward_excess_bytes(self, m: LayerMeasure, n: float, s: Strategy) -> float:
        """Bytes the layer's backward holds at its peak beyond its saved activations
        (:mod:`.backward_peak`: the gradients of its intermediate tensors, e.g. the loss's two
        ``[tokens, vocab]`` ones), split over the ranks as its saved floating tensors are."""
        if s.cp > 1:
            m = SplitIntercepts(m, s.cp)
        whole = _saved_floats(m, n, 1, 1)
        split = _saved_floats(m, n, s.tp, s.tp if s.sp else 1)
        return m.bwd_excess_elems(n) * self.itemsize * (split / whole if whole > 0 else 1.0)

    def layer_cost(self, index: int, strategy: Strategy, micro_batch_size: float) -> LayerCost:
        """Costs of layer ``index`` under ``strategy`` for a micro-batch of ``micro_batch_size`` samples:
        the layer's compute, states, saved activations and fixed overheads, plus each registered
        dimension's own (:mod:`galvatron_fx.dims`: its ``compute_terms`` on the forward and backward,
        then its ``cost_terms``: tensor parallelism's collectives, data parallelism's reductions and
        gathers, checkpointing's recomputed buffers, the experts', the context's, ...)."""
        s, m = strategy, self.measure(index)
        whole = s.dp > 1 and bool(self.layers[index].batch_coupled)
        # NOTE: a layer mixing the samples of a batch computes on the whole micro-batch, replicated
        # over its DP group (galvatron_fx/batch_symbol.py): activations and FLOPs of all its samples
        n = micro_batch_size if whole else micro_batch_size / s.dp
        fwd, bwd = self._compute_times(index, n, s)
        for d in dims.DIMENSIONS:
            if d.compute_terms is not None:
                df, db = d.compute_terms(self, index, n, s)
                fwd, bwd = fwd + df, bwd + db
        st = self.states_bytes(index, s)
        train_tp = layer_elems(self, index, s)[1]
        overhead, optimizer = self._overheads(index, train_tp, s, fwd + bwd)
        act, saved = self._activations(m, n, s, self.ep_of(index, s), index)
        out = m.output_elems(n) * self.itemsize / (s.tp if s.sp else 1)
        work = dims.LayerWork(fwd, bwd, self.recompute_time(index, n, s, fwd), saved, act)
        # a split backward (zero-bubble) runs the split's own work per op
        split = self.op_counts[self.layers[index].signature] * getattr(self.cluster, "split_backward_op_s", 0.0)
        terms = CostTerms(overhead_s=overhead, optimizer_s=optimizer, split_extra_s=split)
        for d in dims.DIMENSIONS:
            if d.cost_terms is not None:
                terms = terms + d.cost_terms(self, index, n, s, work)
        terms = terms + CostTerms(transient_bytes=self.backward_excess_bytes(m, n, s))
        rep_div = s.tp if s.sp else 1
        wgrad = (m.wgrad_sharded_elems(n) / s.tp + m.wgrad_rep_elems(n) / rep_div
                 + m.wgrad_whole_elems(n) + (m.wgrad_row_bias_elems(n) / rep_div if s.tp > 1 else 0.0)
                 ) * self.itemsize if train_tp else 0.0
        return LayerCost(fwd, bwd, terms.tp_comm_s, terms.sync_s, terms.gather_s, st.params, st.grads, st.optimizer,
                         act + terms.activation_bytes, terms.transient_bytes, out, st.masters, terms.overhead_s,
                         terms.optimizer_s, terms.exposed_s, terms.regather_s, terms.reduce_scatter_s,
                         terms.split_extra_s, terms.held_bytes, wgrad, st.host, terms.host_activation_bytes)

    def expert_terms(self, index: int, n: float, s: Strategy) -> CostTerms:
        """The experts dimension's terms of layer ``index`` (``ep > 1`` on a layer with experts):
        the expert buffers' own data-parallel group and ZeRO layout (their states are in
        ``states_bytes``), their optimizer step and copies, the token dispatch and its ops."""
        ep = self.ep_of(index, s)
        if ep == 1:
            return CostTerms()
        xtp = self.expert_tp_of(index, s)
        train, frozen = self.expert_shapes(index, ep, xtp)
        xs, xt = self._expert_strategy(s, xtp > 1), sum(math.prod(x) for x in train)
        xe = xt + sum(math.prod(x) for x in frozen)
        buffer = buffer_terms(self, xs, xe, xt, expert_dp_group(s, xtp > 1), False) + copy_times(self, xe, xt, xs)
        held_x = xt if xs.sdp == "none" else math.ceil(xt / xs.dp)
        # NOTE: the dispatch's own ops (pads, slices, per-source id masks and row selections,
        # index copies), counted from runtime/experts.py's all-gather path: 24 + 12 per source
        c = self.cluster
        ops = len(self.experts(index).num_experts) * (24 + 12 * s.ep)
        overhead = ops * (c.op_launch_s * (2 if s.ckpt else 1) + c.op_launch_bwd_s)
        return dataclasses.replace(buffer, tp_comm_s=self.ep_dispatch(index, n, s)[1],
                                   overhead_s=overhead + buffer.overhead_s,
                                   optimizer_s=held_x * 4 * c.optimizer_s_per_byte + buffer.optimizer_s)

    def context_compute(self, index: int, n: float, s: Strategy) -> tuple[float, float]:
        """The context dimension's device seconds beyond cp = 1's attention cores (:mod:`.context`:
        the ring's blocks or Ulysses' copies; a checkpointed layer runs the forward's again)."""
        if s.cp == 1:
            return 0.0, 0.0
        cf, cb = self.cp_compute(index, n, s)
        return cf, cb + (cf if s.ckpt else 0.0)

    def context_terms(self, index: int, n: float, s: Strategy) -> CostTerms:
        """The context dimension's terms: the attention exchanges over the CP group (:mod:`.context`),
        their ops (plain eager ops inside autograd Functions: ``op_launch_s`` each) and buffers, and
        under a split backward a checkpointed layer's second set of forward exchanges."""
        if s.cp == 1:
            return CostTerms()
        cp_comm, ops, cp_buffers = self.cp_terms(index, n, s)
        overhead = (ops[0] * (2 if s.ckpt else 1) + ops[1]) * self.cluster.op_launch_s
        split_extra = cp_comm - self.cp_terms(index, n, dataclasses.replace(s, ckpt=False))[0] if s.ckpt else 0.0
        return CostTerms(tp_comm_s=cp_comm, transient_bytes=cp_buffers, overhead_s=overhead, split_extra_s=split_extra)

    def ep_dispatch(self, index: int, n: float, s: Strategy) -> tuple[str, float]:
        """``(dispatch, seconds per micro-batch)`` of expert parallelism's token exchange for layer
        ``index`` with ``n`` samples per device (:mod:`galvatron_fx.runtime.experts`), the cheaper of

        * ``"allgather"``: forward all-gathers the EP group's tokens (``ep * T * H``), top-k weights
          and ids and reduce-scatters the outputs; backward the reverse;
        * ``"alltoall"``: a count exchange, then each rank sends each EP rank only the tokens of its
          TP rank's chunk that need one of that rank's experts, and gets their outputs back (two
          all-to-alls each way per pass).

        Plus, with ``tp > 1``, the TP all-reduce of the combined tokens (forward) and of their
        gradient (backward); checkpointing repeats the forward's. Under expert tensor parallelism
        (:meth:`expert_tp_of`) every TP rank sends and serves all its tokens instead, and the
        experts' own TP all-reduces (forward: their outputs, backward: their inputs' gradient, of
        ``k`` rows per token served; the measure prices ``T * k`` rows of each, ``ep = 1``'s) grow
        with the tokens a rank serves."""
        ex = self.experts(index)
        ep, ct = s.ep, self.cluster.collective_time
        T = n * ex.tokens_per_sample
        row = ex.hidden * self.itemsize
        meta = ex.top_k * (4 + 8)   # fp32 weights + int64 ids per token
        group = ep_group(s)
        etp = self.expert_tp_of(index, s) > 1
        served = ep * ex.needing_fraction(ep) * T * self.moe_imbalance
        if etp:
            tp = ct("all_reduce", max(served - T, 0.0) * ex.top_k * row, tp_group(s))
        else:
            tp = ct("all_reduce", T * row, tp_group(s)) if s.tp > 1 else 0.0
        fwd_rep = 2 if s.ckpt else 1
        gather = ct("all_gather", ep * T * (row + meta), group, calls=3) + ct("reduce_scatter", ep * T * row, group)
        allgather = gather * (fwd_rep + 1) + ct("all_gather", 8 * ep, group) * fwd_rep
        # NOTE: the busiest rank (moe_imbalance x the mean) receives that many more tokens
        sent = served / (1 if etp else s.tp) * (row + meta + 8)
        a2a = ct("all_to_all", sent, group, calls=4) + ct("all_to_all", sent * row / (row + meta + 8), group)
        alltoall = a2a * (fwd_rep + 1) + ct("all_to_all", 16 * ep, group) * fwd_rep
        best = min((allgather, "allgather"), (alltoall, "alltoall"))
        return best[1], best[0] + tp * (fwd_rep + 1)

    def cp_terms(self, index: int, n: float, s: Strategy) -> tuple[float, tuple[int, int], float]:
        """``(seconds per micro-batch, (forward ops, backward ops), transient bytes)`` of context
        parallelism's attention exchanges in layer ``index`` under ``s`` with ``n`` samples' tokens
        per rank (:mod:`.context`; 0 without attention or with ``cp == 1``)."""
        att = self.attention(index)
        core = 0.0
        if self.cp_overlap and att.calls:   # what the shifts hide behind: the attention's compute, both passes
            core = (3 * self.cluster.compute_time(attention_flops(att, n, s.tp), self.dtype)
                    + sum(self.cp_compute(index, n, s)))
        t = cp_attention_time(self.cluster, att, n, s, self.itemsize, core, self.cp_overlap)
        # the analysis' gathers: shards an op needs whole (forward all-gather, backward reduce-scatter;
        # checkpointing repeats the forward) and shards leaving the layer whole (forward all-gather)
        seq = self.cp_sequence(index, s.cp)
        ct, group = self.cluster.collective_time, cp_group(s)
        whole = n * s.cp   # samples a CP rank holds whole after a gather: b / (dp / cp)
        inner = (seq.gather_elems * self.itemsize + seq.gather_other_bytes) * whole
        leaving = (seq.out_elems * self.itemsize + seq.out_other_bytes) * whole
        t += (ct("all_gather", inner, group) * (2 if s.ckpt else 1) + ct("reduce_scatter", inner, group)
              + ct("all_gather", leaving, group) * (2 if s.ckpt else 1))
        return t, cp_attention_ops(att, s, self.itemsize), cp_transient_bytes(att, n, s, self.itemsize) + inner

    def cp_compute(self, index: int, n: float, s: Strategy) -> tuple[float, float]:
        """``(forward, backward)`` seconds per micro-batch that context parallelism's attention computes
        in layer ``index`` under ``s`` beyond ``cp = 1``'s attention cores (:func:`.context.cp_compute_time`:
        the ring's eager fp32 blocks, Ulysses' reshuffling copies), checkpointing's repeat not included."""
        return cp_compute_time(self.cluster, self.attention(index), n, s, self.itemsize, self.dtype)

    def whole_batch_gather_time(self, m: LayerMeasure, n: float, s: Strategy) -> float:
        """Seconds per micro-batch of ``n`` samples for a batch-coupled layer under ``s`` (dp > 1)
        to all-gather its inputs over its DP group (forward) and its outputs' gradients (backward:
        the layers after it hold slices)."""
        whole = Strategy(s.tp * s.dp, 1)
        nbytes = (m.input_elems(n) + m.output_elems(n)) * self.itemsize
        return self._gather_time(nbytes, dataclasses.replace(s, sp=False), whole)

    def model_grad_bytes(self) -> float:
        """Bytes of the whole model's gradients as DP reduces them (no TP): what the buckets hold."""
        if not hasattr(self, "_grad_bytes"):
            self._grad_bytes = sum(n for r in self.layers for f, n in self._owned_params(r.index).items()
                                   if f not in self._frozen) * self.reduce_itemsize
        return self._grad_bytes


    # ------------------------------------------------------------------ resharding

    def reshard_time(self, index: int, prev: Strategy, next: Strategy, micro_batch_size: float) -> float:
        """Seconds per micro-batch to move the activation after layer ``index`` from ``prev``'s layout
        (batch split over its ``dp`` groups, replicated or sequence-split in its TP groups) to
        ``next``'s: an all-gather where ``next`` needs data ``prev`` spread out, a local slice
        otherwise; the backward moves the gradient the other way. 0 when the layouts match. Context
        parallelism: :func:`.context.layout_time` (a ``cp`` layer's sequence shards gathered over its
        CP group on the way out, sliced on the way in)."""
        if (prev.tp, prev.dp, prev.sp, prev.cp) == (next.tp, next.dp, next.sp, next.cp):
            return 0.0
        nbytes = self.boundary_bytes(index, micro_batch_size)
        return layout_time(self, nbytes, prev, next) + layout_time(self, nbytes, next, prev)

    # ------------------------------------------------------------------ symbolic form
    def symbolic(self, index: int, strategy: Strategy) -> dict[str, sympy.Expr]:
        """Every :class:`LayerCost` field as an affine sympy expression in :data:`B` (micro-batch size)."""
        d = strategy.dp
        c1, c2 = self.layer_cost(index, strategy, d).to_dict(), self.layer_cost(index, strategy, 2 * d).to_dict()
        out = {}
        for k, y1 in c1.items():
            a = (c2[k] - y1) / d
            out[k] = sympy.Float(a) * B + sympy.Float(y1 - a * d)
        return out

    def lambdified(self, index: int, strategy: Strategy) -> dict:
        """:meth:`symbolic` as numpy functions of ``b`` (arrays welcome)."""
        return {k: sympy.lambdify(B, e, "numpy") for k, e in self.symbolic(index, strategy).items()}
