"""The cost model the search consumes: per-layer time and memory for a strategy and micro-batch.

``micro_batch_size`` ``b`` is the samples of one micro-batch across the whole stage (all ``dp``
ranks together, as :attr:`galvatron_fx.plan.Plan.micro_batch_size`); one device runs ``n = b / dp``.

Scaling rules (per device, per micro-batch unless noted), from the fake-tensor measurement
(:mod:`.measure`) and the TP roles (:mod:`.extract`):

* **FLOPs**: sharded ops (column/row-parallel matmuls, attention between them) ``/ tp``; the rest
  replicated, ``/ tp`` too with SP (sequence split). ``fwd_s``/``bwd_s`` via
  :meth:`Cluster.compute_time`; checkpointing adds the forward to the backward.
  Backward FLOPs are split sharded/replicated in the forward's proportion.
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
  byte written, in ``overhead_s`` and ``optimizer_s`` (:meth:`CostModel._copies`).
* **Memory**: :mod:`.memory` for states; transients are ZeRO-3's gathered parameters of the layer,
  its neighbour's prefetched ones with their ``[dp, S]`` all-gather staging buffer, and the buffer's
  gradient or its reduce-scatter staging,
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
import operator
from dataclasses import asdict, dataclass

import sympy
import torch
import torch.fx

from ..cluster import Cluster, normalize_dtype
from ..errors import ConfigError
from ..ir import META_KEY, TORCH_DTYPES
from ..layout import Layout
from ..sharding.experts import MoEBlock, layer_blocks
from ..sharding.state import tensor_val
from ..solver.strategy import Strategy
from ..units import parse_bytes
from .context import (
    NO_ATTENTION,
    LayerAttention,
    LayerSequenceTerms,
    SplitIntercepts,
    attention_flops,
    cp_attention_ops,
    cp_attention_time,
    cp_compute_time,
    cp_group,
    cp_transient_bytes,
    layer_attention,
    layer_sequence_terms,
    layout_time,
)
from .extract import LayerGraph, capture_batch, extract_layer, needs_grad, roles_from_analysis
from .measure import LayerMeasure, measure_layer
from .memory import StatesBytes, states_bytes

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
PRECISION_DTYPES = {"fp32": ("fp32", False), "bf16-mixed": ("bf16", True), "fp16-mixed": ("fp16", True)}
"""precision -> (compute / storage dtype of parameters, gradients and activations, fp32 masters)."""
B = sympy.Symbol("b", positive=True)
"""The micro-batch size symbol of :meth:`CostModel.symbolic`."""


@dataclass(frozen=True)
class LayerCost:
    """One layer under one strategy and micro-batch size, per device. Seconds and bytes.

    ``fwd_s``/``bwd_s``/``tp_comm_s``/``zero3_gather_s``/``reduce_scatter_s`` (ZeRO-2/3's gradient
    reduce-scatter)/``overhead_s``/``activation_bytes``/``output_bytes`` are per micro-batch; ``grad_sync_s``, ``optimizer_s``, ``exposed_sync_s`` (the
    part of ``grad_sync_s`` no backward can hide: the last gradient bucket's share) and
    ``regather_s`` (ZeRO-2's all-gather of the updated shards, beside the next forward) per step; ``param_bytes``/``grad_bytes``/``optimizer_bytes``/
    ``master_bytes`` (fp32 masters of a mixed plan)/``transient_bytes`` are resident (transient:
    the layer's largest temporary buffer). Under a split (zero-bubble) backward the layer also
    takes ``split_extra_s`` more per micro-batch (torch's split walks the graph and re-runs each
    parameter's consumer: the cluster's ``split_backward_op_s`` per op; a checkpointed layer
    recomputes its forward in both the input- and the weight-gradient pass) and holds
    ``split_held_bytes`` (ZeRO-3's gathered buffer, kept from a micro-batch's input-gradient pass to
    its weight-gradient pass) and, per micro-batch between those passes, ``split_wgrad_bytes`` (the
    gradients of the outputs where parameters meet activations, which the weight pass starts from).
    """

    fwd_s: float
    bwd_s: float
    tp_comm_s: float
    grad_sync_s: float
    zero3_gather_s: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float
    output_bytes: float
    master_bytes: float = 0.0
    overhead_s: float = 0.0
    optimizer_s: float = 0.0
    exposed_sync_s: float = 0.0
    regather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    split_extra_s: float = 0.0
    split_held_bytes: float = 0.0
    split_wgrad_bytes: float = 0.0

    @property
    def states_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.master_bytes

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerParams:
    """Element counts of the parameters a layer owns: TP-sharded and replicated."""

    sharded: int
    replicated: int


@dataclass(frozen=True)
class LayerExperts:
    """A layer's experts blocks (:mod:`galvatron_fx.sharding.experts`) as expert parallelism prices
    them: the expert weights' names, the experts per block (``ep`` must divide each), the router's
    ``top_k``, the tokens' width and the tokens per sample (sequence positions)."""

    fqns: frozenset
    num_experts: tuple[int, ...]
    top_k: int
    hidden: int
    tokens_per_sample: float
    loops: tuple = ()   # loop-form blocks: per block, per expert, its parameters' names (whole, not [E, ...])

    def held(self, ep: int) -> dict[str, bool]:
        """Loop experts' parameter name -> whether EP rank 0 of ``ep`` holds it (the first ``E / ep``
        experts; every EP rank holds as many of one shape)."""
        return {f: e < len(block) // ep for block in self.loops for e, names in enumerate(block) for f in names}

    def allows(self, ep: int) -> bool:
        return all(e % ep == 0 for e in self.num_experts)

    def needing_fraction(self, ep: int) -> float:
        """Share of a source's tokens one EP rank must see (uniform routing): those with at least
        one of their ``top_k`` experts among its ``E / ep``: ``1 - C(E - E/ep, k) / C(E, k)``."""
        e = min(self.num_experts)
        return 1.0 - math.comb(e - e // ep, self.top_k) / math.comb(e, self.top_k)


def expert_dp_group(strategy: Strategy, expert_tp: bool = False) -> list[int]:
    """Ranks holding the first EP rank's expert weights: every ``ep``-th DP rank, every TP rank
    (``expert_tp``: TP position 0 only, the others hold other slices)."""
    s = strategy
    return list(Layout(s.tp, s.dp, ep=s.ep, etp=expert_tp).expert_dp_ranks(0))


def ep_group(strategy: Strategy) -> list[int]:
    """Ranks of the first EP group: ``ep`` consecutive DP ranks (:class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(strategy.tp, strategy.dp, ep=strategy.ep).ep_ranks(0))


def tp_group(strategy: Strategy) -> list[int]:
    """Ranks of the first TP group of a stage (consecutive; :class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(strategy.tp, strategy.dp).tp_ranks(0))


def dp_group(strategy: Strategy) -> list[int]:
    """Ranks of the first data-parallel group of a stage (strided by ``tp``; :class:`~galvatron_fx.layout.Layout`)."""
    return list(Layout(strategy.tp, strategy.dp).dp_ranks(0))


_CALLS = ("call_function", "call_method", "call_module")
_FREE = (operator.getitem,)
PROFILE_MAX_PARAM_BYTES = 64 * 2**20
"""Largest layer (fp32 parameter bytes) :func:`default_mode` profiles on a measured cluster."""


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


class CostModel:
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
                 moe_imbalance: float = 1.0, cp_overlap: bool = False, attention_target: str | None = None):
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
        if not isinstance(cp_overlap, bool):
            raise ConfigError(f"cp_overlap must be true or false (whether the ring's key / value exchanges "
                              f"overlap the attention compute), got {cp_overlap!r}")
        self.cp_overlap = cp_overlap
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
        self.op_counts = {sig: sum(n.op in _CALLS and n.target not in _FREE for n in g.gm.graph.nodes)
                          for sig, g in self.graphs.items()}
        """Ops (fx call nodes, getitem excluded) per layer signature: what ``op_launch_s`` prices."""
        if self.mode is None:
            self.mode = default_mode(cluster, self)
        self._profiles: dict[tuple, dict] = {}

    # ------------------------------------------------------------------ inputs
    def _moe(self) -> tuple[dict, dict]:
        """``(layer -> LayerExperts, layer -> names of its experts blocks' nodes)``, cached.
        NOTE: no fx nodes are kept: the cost model lives in the graph's metadata, which the
        rewrite passes deep-copy."""
        if "_moe_info" not in self.__dict__:
            experts, names = {}, {}
            for i, blocks in layer_blocks(self.gm).items():
                if not all(isinstance(b, MoEBlock) for b in blocks):
                    continue
                x = tensor_val(blocks[0].x)
                loops = tuple(tuple(tuple(p.target for p in ps) for ps in b.loop.params) for b in blocks if b.loop)
                experts[i] = LayerExperts(frozenset(p.target for b in blocks for p in b.params),
                                          tuple(b.num_experts for b in blocks), blocks[0].top_k, int(x.shape[1]),
                                          int(x.shape[0]) / capture_batch(self.gm), loops)
                names[i] = frozenset(n.name for b in blocks for n in b.nodes)
            self._moe_info = (experts, names)
        return self._moe_info

    def experts(self, index: int) -> LayerExperts | None:
        """Layer ``index``'s experts, or None when it has none expert parallelism can split."""
        return self._moe()[0].get(index)

    def attention(self, index: int) -> LayerAttention:
        """Layer ``index``'s attention as context parallelism prices it (:mod:`.context`), cached
        for every layer at once (no fx nodes kept)."""
        if "_attention" not in self.__dict__:
            self._attention = layer_attention(self.gm, capture_batch(self.gm))
        return self._attention.get(index, NO_ATTENTION)

    def sequence_length(self) -> int:
        """The captured sequence length as the context-parallel pass reads it: dim 1 of the first
        graph input with two or more dims (0 when there is none)."""
        if "_seq_len" not in self.__dict__:
            from ..sharding.sequence import sequence_length

            self._seq_len = sequence_length(self.gm) or 0
        return self._seq_len

    def cp_sequence(self, index: int, cp: int) -> LayerSequenceTerms:
        """The context-parallel pass's analysis of layer ``index`` at degree ``cp``, as costs
        (:func:`.context.layer_sequence_terms`; cached per signature and degree)."""
        key = (self.layers[index].signature, cp)
        cache = self.__dict__.setdefault("_cp_seq", {})
        if key not in cache:
            graph = self.graphs[self.layers[index].signature]
            cache[key] = layer_sequence_terms(graph.gm, self.sequence_length(), cp, graph.batch,
                                              self.layers[index].name)
        return cache[key]

    def cp_refuses(self, index: int, cp: int, kind: str = "ring", tp: int = 1) -> str:
        """Why layer ``index`` cannot run at context-parallel degree ``cp`` with ``kind`` under TP
        degree ``tp`` ("" when it can), as the context-parallel pass would refuse it: no sequence
        to split or one ``cp`` does not divide, a layer mixing the samples of a batch (it runs on
        the whole batch), the sequence analysis' reason, or its attention's
        (:meth:`.context.LayerAttention.refuses`)."""
        if cp == 1:
            return ""
        seq = self.sequence_length()
        if seq < 2 or seq % cp:
            return f"its inputs' sequence of {seq} positions does not split into cp={cp} shards"
        if self.layers[index].batch_coupled:
            return "it mixes the samples of a batch (it runs on the whole batch)"
        refused = self.cp_sequence(index, cp).refused
        return refused or self.attention(index).refuses(cp, kind, tp)

    def expert_tp_of(self, index: int, strategy: Strategy) -> int:
        """The TP degree layer ``index``'s expert weights are sharded over under ``strategy``:
        ``tp`` under expert tensor parallelism (:attr:`Strategy.shards_experts`, grouped experts
        split by ``ep > 1``), else 1 (whole over TP: the TP ranks split the tokens)."""
        ex = self.experts(index)
        on = strategy.shards_experts and self.ep_of(index, strategy) > 1 and ex is not None and not ex.loops
        return strategy.tp if on else 1

    def ep_of(self, index: int, strategy: Strategy) -> int:
        """The expert-parallel degree layer ``index`` runs at under ``strategy`` (1 where it has no
        experts, or ``ep`` does not divide their number: the search never offers that)."""
        if strategy.ep == 1:
            return 1
        ex = self.experts(index)
        return strategy.ep if ex is not None and ex.allows(strategy.ep) else 1

    def _owned_params(self, index: int) -> dict[str, int]:
        """fqn -> elements of the parameters (trainable and frozen) layer ``index`` owns (tied
        weights: the first user)."""
        if self._owned is None:
            self._owned = [{} for _ in self.layers]
            for n in self.gm.graph.nodes:
                info = n.meta.get(META_KEY)
                if n.op == "get_attr" and info is not None and info.layer is not None \
                        and info.param is not None and info.param.is_param:
                    self._owned[info.layer][info.param.fqn] = info.param.numel
                    self._shapes[info.layer][info.param.fqn] = tuple(info.param.shape)
                    if not info.param.requires_grad:
                        self._frozen.add(info.param.fqn)
        return self._owned[index]

    def split_shapes(self, index: int, tp: int, ep: int = 1) -> tuple[list, list]:
        """:meth:`layer_shapes` split into the trainable parameters' and the frozen ones' (the
        runtime's two buffers per layer); with ``ep > 1`` the expert weights' are left out (their
        own buffers: :meth:`expert_shapes`)."""
        shapes = self.layer_shapes(index, tp, ep)
        experts = self.experts(index).fqns if ep > 1 else frozenset()
        fqns = list(self._owned_params(index))
        train = [s for f, s in zip(fqns, shapes) if f not in self._frozen and f not in experts]
        return train, [s for f, s in zip(fqns, shapes) if f in self._frozen and f not in experts]

    def expert_shapes(self, index: int, ep: int, tp: int = 1) -> tuple[list, list]:
        """This rank's expert weights of layer ``index`` under ``ep`` (``E / ep`` experts each, whole
        over TP, or with ``tp > 1`` (expert tensor parallelism) this TP rank's width slice of each),
        trainable and frozen: the shapes of its expert buffers."""
        ex = self.experts(index)
        held = ex.held(ep)   # a loop's experts: whole, E / ep of them
        local = dict(zip(self._owned_params(index), self.layer_shapes(index, tp, ep, expert_tp=tp > 1)))
        shapes = {f: s if f in held else (s[0] // ep, *s[1:]) for f, s in local.items()
                  if f in ex.fqns and held.get(f, True)}
        return ([s for f, s in shapes.items() if f not in self._frozen],
                [s for f, s in shapes.items() if f in self._frozen])

    def layer_shapes(self, index: int, tp: int, ep: int = 1, expert_tp: bool = False) -> list[tuple[int, ...]]:
        """TP-local shapes of the parameters layer ``index`` owns at degree ``tp``, as the runtime's
        flat buffer holds them (a sharded dim keeps ``block / tp`` of every block): the input of
        the buffer layout (:func:`galvatron_fx.runtime.zero_layout.zero_layout`). ``ep > 1``: the
        experts and their routers stay whole over TP (``expert_tp``: only the routers)."""
        key = (index, tp, ep > 1, expert_tp and ep > 1)
        if key not in self._local_shapes:
            owned = self._owned_params(index)
            shapes = [self._shapes[index][fqn] for fqn in owned]
            analysis = self.tp_analysis(index, tp, ep=ep, expert_tp=expert_tp) if tp > 1 else None
            if analysis is not None and not isinstance(analysis, Exception):
                rep = {shard.fqn: shard for shard in analysis.param_shards.values()}
                for i, fqn in enumerate(self._owned_params(analysis.layer)):   # same order (see below)
                    shard = rep.get(fqn)
                    if shard is not None and i < len(shapes):
                        shape = list(shapes[i])
                        shape[shard.dim] = sum(b // shard.tp for b in shard.blocks)
                        shapes[i] = tuple(shape)
            self._local_shapes[key] = shapes
        return self._local_shapes[key]

    def tp_analysis(self, index: int, tp: int, sp: bool = False, ep: int = 1, expert_tp: bool = False):
        """The tensor-parallel pass's own analysis of layer ``index`` at degree ``tp`` (with sequence
        parallelism: ``sp``; ``ep > 1``: experts split by expert, left whole unless ``expert_tp``;
        cached per signature),
        or the :class:`ConfigError` it raises when the layer cannot take that degree (heads, widths,
        or a sequence length not divisible by tp)."""
        key = (self.layers[index].signature, tp) + ((True,) if sp else ()) + (("ep",) if ep > 1 else ()) \
            + (("etp",) if ep > 1 and expert_tp else ())
        if key not in self._tp:
            from ..sharding.analysis import analyze_layer

            # with the layers sharing its weights
            self._tp[key] = analyze_layer(self.gm, index, tp, sp, ep, expert_tp)
        return self._tp[key]

    def layer_params(self, index: int, tp: int, trainable_only: bool = False, ep: int = 1) -> LayerParams:
        """Owned parameter elements of layer ``index`` (``trainable_only``: without the frozen
        ones), split by whether TP at degree ``tp`` shards them, exactly as
        :mod:`galvatron_fx.passes.tensor_parallel` will (vocabularies that do not divide, or
        linears feeding a norm, stay replicated); ``ep > 1``: without the expert weights (split by
        expert: :meth:`expert_shapes`)."""
        key = (index, tp, trainable_only, ep > 1)
        if key not in self._params:
            self._params[key] = self._layer_params(index, tp, trainable_only, ep)
        return self._params[key]

    def _layer_params(self, index: int, tp: int, trainable_only: bool, ep: int = 1) -> LayerParams:
        owned = self._owned_params(index)
        experts = self.experts(index).fqns if ep > 1 else frozenset()
        keep = [not (trainable_only and fqn in self._frozen) and fqn not in experts for fqn in owned]
        analysis = self.tp_analysis(index, tp, ep=ep) if tp > 1 else None
        if analysis is None or isinstance(analysis, Exception):
            return LayerParams(0, sum(n for k, n in zip(keep, owned.values()) if k))
        # NOTE: the analysis is cached per signature: it may come from another layer of the same
        # structure, whose parameters correspond to these one to one, in graph order.
        rep_owned = self._owned_params(analysis.layer)
        rep_sharded = {shard.fqn for shard in analysis.param_shards.values()}
        flags = [fqn in rep_sharded for fqn in rep_owned]
        sharded = sum(n for flag, k, n in zip(flags, keep, owned.values()) if flag and k)
        return LayerParams(sharded, sum(n for k, n in zip(keep, owned.values()) if k) - sharded)

    def measure(self, index: int) -> LayerMeasure:
        return self.measures[self.layers[index].signature]

    # ------------------------------------------------------------------ public figures
    def states_bytes(self, index: int, strategy: Strategy, dp_index: int = 0, tp_index: int = 0) -> StatesBytes:
        """Per-device parameter, gradient and optimizer-state bytes of layer ``index`` (frozen
        parameters: their weights only); ``dp_index``: which rank of the DP group (0, the default,
        holds the most: ZeRO shards are cut ``ceil(rows / dp)`` rows per rank). Under expert
        parallelism the expert weights are ``E / ep`` experts whole over TP (expert tensor
        parallelism: ``1 / tp`` of their width), sharded (ZeRO) over the ranks holding the same
        slice (``tp_index``: the rank's place in its TP group)."""
        ep = self.ep_of(index, strategy)
        p = self.layer_params(index, strategy.tp, trainable_only=True, ep=ep)
        train, frozen = self.split_shapes(index, strategy.tp, ep)
        kw = dict(itemsize=self.itemsize, mixed_precision=self.mixed_precision, optimizer=self.optimizer)
        st = states_bytes(p.sharded, p.replicated, strategy, shapes=train, frozen_shapes=frozen,
                          dp_index=dp_index, **kw)
        if ep == 1:
            return st
        xtp = self.expert_tp_of(index, strategy)
        train, frozen = self.expert_shapes(index, ep, xtp)
        slot = dp_index // ep if xtp > 1 else dp_index // ep * strategy.tp + tp_index
        ex = states_bytes(0, sum(math.prod(s) for s in train), self._expert_strategy(strategy, xtp > 1),
                          shapes=train, frozen_shapes=frozen, dp_index=slot, **kw)
        return StatesBytes(st.params + ex.params, st.grads + ex.grads, st.optimizer + ex.optimizer,
                           st.masters + ex.masters)

    @staticmethod
    def _expert_strategy(s: Strategy, expert_tp: bool = False) -> Strategy:
        """How a layer's expert buffers are held under ``s``: data-parallel (ZeRO as ``s``) over the
        ``tp * dp / ep`` ranks holding the same experts whole over TP, or (``expert_tp``) the
        ``dp / ep`` ranks holding the same width slice."""
        return Strategy(1, (1 if expert_tp else s.tp) * s.dp // s.ep, s.sdp, False, s.ckpt)

    def boundary_bytes(self, index: int, micro_batch_size: float) -> float:
        """Bytes of the activations layer ``index`` hands to later layers for ``micro_batch_size``
        samples (whole micro-batch, unsharded): what a pipeline boundary after it sends in total."""
        return self.measure(index).output_elems(micro_batch_size) * self.itemsize

    def _fwd_flops(self, m: LayerMeasure, n: float, s: Strategy) -> tuple[float, float]:
        rep_div = s.tp if s.sp else 1
        fs, fr = m.fwd_flops_sharded(n), m.fwd_flops_rep(n)
        total = fs + fr
        fwd = fs / s.tp + fr / rep_div
        bwd = m.bwd_flops(n) * (fwd / total if total else 1.0)
        return fwd, bwd

    def _tp_comm(self, m: LayerMeasure, n: float, s: Strategy, fwd_s: float = 0.0, bwd_s: float = 0.0) -> float:
        """Seconds per micro-batch of the layer's TP collectives, with the runtime's work at each site
        and the ranks' drift: each collective is a blocking sync after a stretch of the layer's
        compute (``fwd_s`` / ``bwd_s`` shared evenly by the pass's collectives), whose wait grows
        with the stretch (:meth:`Cluster.sync_wait`)."""
        if s.tp == 1:
            return 0.0
        group = tp_group(s)
        c = self.cluster
        site = c.op_launch_s + c.op_launch_bwd_s   # the site's autograd Function (forward + backward node)
        per_site = 2 if s.sp else 1   # collectives per site: all-gather and reduce-scatter under SP

        def drift(compute_s: float, sites: int) -> float:
            calls = sites * per_site
            return calls * c.sync_wait(compute_s / calls) if calls else 0.0

        def one(elems: float) -> float:
            nbytes = elems * self.itemsize
            if s.sp:
                # NOTE: runtime/tp_ops.py copies the chunk and the whole (movedim + contiguous on
                # each side of the all-gather and of the reduce-scatter)
                copies = 2 * (nbytes + nbytes / s.tp)
                return (c.collective_time("all_gather", nbytes, group)
                        + c.collective_time("reduce_scatter", nbytes, group)
                        + copies * c.copy_s_per_byte + 2 * site)
            # NOTE: the all-reduce runs on a copy of its input (the Function's output may not alias it)
            return c.collective_time("all_reduce", nbytes, group) + nbytes * c.copy_s_per_byte + site

        fwd = sum(one(f(n)) for f in m.fwd_allreduce) + drift(fwd_s, len(m.fwd_allreduce))
        bwd = sum(one(f(n)) for f in m.bwd_allreduce) + drift(bwd_s, len(m.bwd_allreduce))
        return fwd * (2 if s.ckpt else 1) + bwd

    def _compute_times(self, index: int, n: float, s: Strategy) -> tuple[float, float]:
        fwd, bwd = self._plain_compute_times(index, n, s)
        m = self.measure(index)
        if self.moe_imbalance > 1 and self.ep_of(index, s) > 1:
            # NOTE: the busiest EP rank sets the pace: its experts' share of the layer's work scaled
            total = m.fwd_flops_sharded(n) + m.fwd_flops_rep(n)
            k = 1 + (self.moe_imbalance - 1) * (m.fwd_flops_expert(n) / total if total else 0.0)
            fwd, bwd = fwd * k, bwd * k
        return fwd, bwd

    def _plain_compute_times(self, index: int, n: float, s: Strategy) -> tuple[float, float]:
        m = self.measure(index)
        if self.mode == "analytic":
            fwd, bwd = self._analytic_times(index, m, n, s)
            return fwd, bwd + (fwd if s.ckpt else 0.0)
        # NOTE: checkpointing is priced as the analytic rule does (backward + a recomputed forward)
        # on the plain layer's profile: timed under torch.utils.checkpoint at the small profiling
        # sizes, the per-op saved-tensor hooks overstated the steps measured in training 1.3-2x
        prof = self.profile(index, s)
        fwd, bwd = prof["fwd"](n), prof["bwd"](n)
        return fwd, bwd + (fwd if s.ckpt else 0.0)

    def _analytic_times(self, index: int, m: LayerMeasure, n: float, s: Strategy) -> tuple[float, float]:
        """``(forward, backward)`` device seconds of layer ``index`` for ``n`` samples under ``s``
        from its measured work (module docstring, "FLOPs"): each forward matmul at its shape
        (:meth:`Cluster.gemm_time`, the dim TP splits divided), the backward's matmul FLOPs at the
        rate the forward's achieved (its matmuls are the forward's, transposed), the attention at the
        fused kernel's rate, the other ops' bytes at the memory rate (the backward's split between
        TP-sharded and replicated as the forward's)."""
        c, dtype = self.cluster, self.dtype
        rep_div = s.tp if s.sp else 1
        fwd_f, bwd_f = self._fwd_flops(m, n, s)
        gemm_s = gemm_f = 0.0
        for split, dims in m.fwd_gemms:
            b, rows, cols, depth = (f(n) for f in dims)
            if split:
                b, cols, depth = (b / s.tp if split == "b" else b, cols / s.tp if split == "n" else cols,
                                  depth / s.tp if split == "k" else depth)
            elif s.sp:
                rows /= s.tp
            gemm_s += c.gemm_time(b, rows, cols, depth, dtype)
            gemm_f += 2 * b * rows * cols * depth
        rate = gemm_f / gemm_s if gemm_s else c.achievable_flops(dtype)
        # NOTE: FLOPs the matmul records miss (grouped expert matmuls) at the forward's rate too
        fwd = gemm_s + max(fwd_f - gemm_f, 0.0) / rate
        bwd = bwd_f / rate
        sharded, rep = m.fwd_traffic_sharded(n), m.fwd_traffic_rep(n)
        traffic = sharded / s.tp + rep / rep_div
        fwd += c.memory_time(traffic)
        bwd += c.memory_time(m.bwd_traffic(n) * (traffic / (sharded + rep) if sharded + rep else 1.0))
        att = self.attention(index)
        kw = dict(seq=att.kv_seq or None, head_dim=att.head_dim or None)
        # NOTE: the attention heads split over TP (and stay split under SP)
        fwd += c.attention_time(m.attn_fwd_flops(n) / s.tp, dtype, **kw)
        bwd += c.attention_time(m.attn_bwd_flops(n) / s.tp, dtype, backward=True, **kw)
        return fwd, bwd

    def profile(self, index: int, s: Strategy) -> dict:
        """Profiled ``{"fwd": Affine, "bwd": Affine}`` seconds per sample count for layer ``index``
        under ``s``'s TP degree (without checkpointing: :meth:`_compute_times` adds the recompute)."""
        from .profile import PROFILE_SIZES, profile_layer

        sig = self.layers[index].signature
        key = (sig, s.tp, s.sp, False)
        if key not in self._profiles:
            m = self.measures[sig]
            fs, fr = m.fwd_flops_sharded(1), m.fwd_flops_rep(1)
            dtype = TORCH_DTYPES[self.dtype]
            self._profiles[key] = profile_layer(
                self.graphs[sig], tp=s.tp, sp=s.sp, ckpt=False, dtype=dtype,
                sharded_fraction=fs / (fs + fr) if fs + fr else 1.0,
                sizes=self.profile_sizes or PROFILE_SIZES, cache=self.cache_dir, repeats=self.profile_repeats)
        return self._profiles[key]

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
        full = ((m.saved_sharded_elems(n) / s.tp + m.saved_rep_elems(n) / rep_div + m.saved_gathered_elems(n))
                * self.itemsize
                + m.saved_other_bytes(n))
        if ep > 1:   # the busiest rank serves moe_imbalance x the mean
            f = ep * self.experts(index).needing_fraction(ep) * self.moe_imbalance
            full += (f - 1) * m.saved_expert_elems(n) * self.itemsize / s.tp
        if index is not None and s.cp > 1:
            # NOTE: the ring keeps the whole mask of its b = n * cp samples (cp - 1 samples' more)
            full += (s.cp - 1) * n * self.attention(index).mask_bytes
        if s.ckpt:
            extra = (s.cp - 1) * n * self.attention(index).mask_bytes if index is not None and s.cp > 1 else 0.0
            return m.input_elems(n) * self.itemsize / rep_div + m.input_other_bytes(n) + extra, full
        return full, full

    def layer_cost(self, index: int, strategy: Strategy, micro_batch_size: float) -> LayerCost:
        """Costs of layer ``index`` under ``strategy`` for a micro-batch of ``micro_batch_size`` samples."""
        s, m = strategy, self.measure(index)
        whole = s.dp > 1 and bool(self.layers[index].batch_coupled)
        # NOTE: a layer mixing the samples of a batch computes on the whole micro-batch, replicated
        # over its DP group (galvatron_fx/batch_symbol.py): activations and FLOPs of all its samples
        n = micro_batch_size if whole else micro_batch_size / s.dp
        fwd, bwd = self._compute_times(index, n, s)
        if s.cp > 1:   # the CP attention's own work beyond cp = 1's cores (.context: ring blocks, Ulysses copies)
            cf, cb = self.cp_compute(index, n, s)
            fwd, bwd = fwd + cf, bwd + cb + (cf if s.ckpt else 0.0)
        st = self.states_bytes(index, s)
        ep = self.ep_of(index, s)
        p, t = self.layer_params(index, s.tp, ep=ep), self.layer_params(index, s.tp, trainable_only=True, ep=ep)
        elems_tp = math.ceil(p.sharded / s.tp) + p.replicated           # every parameter (ZeRO-3 gathers)
        train_tp = math.ceil(t.sharded / s.tp) + t.replicated           # trainable: gradients, updates
        sync, exposed, regather, reduce_scatter, gather, transient, held = self._param_terms(
            s, elems_tp, train_tp, dp_group(s), index == 0)
        overhead, optimizer = self._overheads(index, train_tp, s, fwd + bwd)
        pass_copy, step_copy = self._copies(elems_tp, train_tp, s)
        ep_comm = 0.0
        if ep > 1:   # the expert buffers: their own group and ZeRO layout (states_bytes above)
            xtp = self.expert_tp_of(index, s)
            train, frozen = self.expert_shapes(index, ep, xtp)
            xs, xt = self._expert_strategy(s, xtp > 1), sum(math.prod(x) for x in train)
            xe = xt + sum(math.prod(x) for x in frozen)
            terms = self._param_terms(xs, xe, xt, expert_dp_group(s, xtp > 1), False)
            sync, exposed, regather, reduce_scatter, gather, transient, held = (
                a + b for a, b in zip((sync, exposed, regather, reduce_scatter, gather, transient, held), terms))
            held_x = xt if xs.sdp == "none" else math.ceil(xt / xs.dp)
            optimizer += held_x * 4 * self.cluster.optimizer_s_per_byte
            copies = self._copies(xe, xt, xs)
            pass_copy, step_copy = pass_copy + copies[0], step_copy + copies[1]
            ep_comm = self.ep_dispatch(index, n, s)[1]
            # NOTE: the dispatch's own ops (pads, slices, per-source id masks and row selections,
            # index copies), counted from runtime/experts.py's all-gather path: 24 + 12 per source
            c = self.cluster
            ops = len(self.experts(index).num_experts) * (24 + 12 * s.ep)
            overhead += ops * (c.op_launch_s * (2 if s.ckpt else 1) + c.op_launch_bwd_s)
        act, recompute = self._activations(m, n, s, ep, index)
        if s.ckpt:
            transient += recompute
        cp_comm = 0.0
        if s.cp > 1:   # the attention exchanges over the CP group (.context); the rest is cp = 1's at n
            cp_comm, ops, cp_buffers = self.cp_terms(index, n, s)
            # NOTE: plain eager ops in both passes (inside autograd Functions): op_launch_s each
            overhead += (ops[0] * (2 if s.ckpt else 1) + ops[1]) * self.cluster.op_launch_s
            transient += cp_buffers
        out = m.output_elems(n) * self.itemsize / (s.tp if s.sp else 1)
        overhead, optimizer = overhead + pass_copy, optimizer + step_copy
        plain_bwd = bwd - (fwd if s.ckpt else 0.0)   # the recompute is priced as a second forward
        tp_sites = self._tp_comm(m, n, s, fwd, plain_bwd)
        tp_comm = (tp_sites + (self._whole_batch_gathers(m, n, s) if whole else 0.0) + ep_comm
                   + cp_comm)
        # split backward (zero-bubble): the split's own work per op, and a checkpointed layer's second
        # recomputation (its forward and forward TP collectives; the ZeRO-3 buffer is still held);
        # ZeRO-3's whole buffer held between the passes
        split_extra = self.op_counts[self.layers[index].signature] * getattr(self.cluster, "split_backward_op_s", 0.0)
        if s.ckpt:
            plain = dataclasses.replace(s, ckpt=False)
            split_extra += fwd + tp_sites - self._tp_comm(m, n, plain, fwd, plain_bwd)
            if s.cp > 1:   # and its attention's forward exchanges
                split_extra += cp_comm - self.cp_terms(index, n, plain)[0]
        rep_div = s.tp if s.sp else 1
        wgrad = (m.wgrad_sharded_elems(n) / s.tp + m.wgrad_rep_elems(n) / rep_div
                 + m.wgrad_whole_elems(n) + (m.wgrad_row_bias_elems(n) / rep_div if s.tp > 1 else 0.0)
                 ) * self.itemsize if train_tp else 0.0
        return LayerCost(fwd, bwd, tp_comm, sync, gather, st.params, st.grads, st.optimizer,
                         act, transient, out, st.masters, overhead, optimizer, exposed, regather, reduce_scatter,
                         split_extra, held, wgrad)

    def _param_terms(self, s: Strategy, elems_tp: int, train_tp: int, dpg: list[int], first: bool) -> tuple:
        """``(sync, exposed, regather, reduce_scatter, gather, transient, held)`` of one flat buffer
        of ``elems_tp`` parameter elements (``train_tp`` trainable) reduced over ``dpg`` under ``s``'s
        data-parallel kind (:class:`LayerCost` for each; ``first``: the stage's first layer)."""
        full_params, full_grads = elems_tp * self.itemsize, train_tp * self.reduce_itemsize
        ct = self.cluster.collective_time
        exposed = regather = reduce_scatter = 0.0
        if not train_tp:
            sync = 0.0   # a frozen layer reduces nothing
        elif s.sdp == "none":
            # NOTE: the runtime packs DP gradients into buckets of bucket_bytes (one call each),
            # filled in reverse layer order; the last bucket's all-reduce starts once backward is
            # over, so its share of every layer's sync is exposed (all of it for a model smaller
            # than one bucket)
            share = min(1.0, full_grads / self.bucket_bytes) if self.bucket_bytes else 1.0
            sync = ct("all_reduce", full_grads, dpg, calls=share)
            if self.bucket_bytes:
                exposed = sync * min(1.0, self.bucket_bytes / max(self._model_grad_bytes(), 1.0))
        else:
            # NOTE: ZeRO reduce-scatters every micro-batch's gradient (shards summed: no whole-buffer
            # gradient outlives a pass), beside the backward of the layers before it
            sync, reduce_scatter = 0.0, ct("reduce_scatter", full_grads, dpg)
            if s.sdp == "zero2":
                regather = ct("all_gather", train_tp * self.itemsize, dpg)   # frozen ones stay whole
                if first:
                    # NOTE: the first layer's re-gather has no layer before it to hide behind
                    # (prefetch starts from it): priced as exposed step sync
                    sync = exposed = regather
                    regather = 0.0
        gather = 2 * ct("all_gather", full_params, dpg) if s.sdp == "zero3" else 0.0
        transient = 0.0
        if s.sdp == "zero3" and s.dp > 1:
            # NOTE: in the layer's backward: its gathered buffer, the neighbour's prefetched buffer
            # and [dp, S] staging buffer (priced at this layer's size: exact inside a stack of
            # equal blocks), then the buffer's gradient, or (the own buffer freed) the gradient's
            # reduce-scatter staging; the forward peak (three buffers) is never larger
            transient = 3 * full_params + max(full_params, full_grads)
        elif s.sdp == "zero2" and s.dp > 1:
            transient = train_tp * self.itemsize + full_grads   # a pass's gradient and its reduce-scatter staging
        elif s.dp > 1 and train_tp:
            transient = min(self.bucket_bytes, full_grads)
        held = full_params if s.sdp == "zero3" and s.dp > 1 else 0.0
        return sync, exposed, regather, reduce_scatter, gather, transient, held

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

    def _whole_batch_gathers(self, m: LayerMeasure, n: float, s: Strategy) -> float:
        """Seconds per micro-batch of ``n`` samples for a batch-coupled layer under ``s`` (dp > 1)
        to all-gather its inputs over its DP group (forward) and its outputs' gradients (backward:
        the layers after it hold slices)."""
        whole = Strategy(s.tp * s.dp, 1)
        nbytes = (m.input_elems(n) + m.output_elems(n)) * self.itemsize
        return self._gather_time(nbytes, dataclasses.replace(s, sp=False), whole)

    def _model_grad_bytes(self) -> float:
        """Bytes of the whole model's gradients as DP reduces them (no TP): what the buckets hold."""
        if not hasattr(self, "_grad_bytes"):
            self._grad_bytes = sum(n for r in self.layers for f, n in self._owned_params(r.index).items()
                                   if f not in self._frozen) * self.reduce_itemsize
        return self._grad_bytes

    def _overheads(self, index: int, elems_tp: int, s: Strategy, device_s: float = 0.0) -> tuple[float, float]:
        """``(overhead_s per micro-batch, optimizer_s per step)`` of layer ``index`` (module docstring).
        On a GPU priced analytically the host's launches and bookkeeping run ahead of the device,
        asynchronously: only what they take beyond the layer's ``device_s`` seconds is exposed."""
        c = self.cluster
        first = index == 0
        overhead = c.layer_overhead_s + (c.microbatch_overhead_s if first else 0.0)
        ops = self.op_counts[self.layers[index].signature]
        if self.mode == "analytic":
            overhead += ops * (c.op_launch_s * (2 if s.ckpt else 1) + c.op_launch_bwd_s)
        if s.ckpt:
            overhead += ops * getattr(c, "checkpoint_op_s", 0.0)
        if self.mode == "analytic" and self.attention_target != "cpu":
            overhead = max(0.0, overhead - device_s)
        held = elems_tp if s.sdp == "none" else math.ceil(elems_tp / s.dp)
        # NOTE: the user's optimizer steps one tensor per trainable parameter (runtime/params.py)
        tensors = sum(1 for f in self._owned_params(index) if f not in self._frozen)
        optimizer = (held * 4 * c.optimizer_s_per_byte + tensors * c.optimizer_overhead_s) if elems_tp else 0.0
        if first and self.cluster.world_size > 1:
            optimizer += c.collective_latency_s
        return overhead, optimizer

    def _copies(self, elems_tp: int, train_tp: int, s: Strategy) -> tuple[float, float]:
        """``(seconds per micro-batch, seconds per step)`` of the runtime's copies around a layer
        (galvatron_fx/runtime/data_parallel.py) at the cluster's ``copy_s_per_byte``: every pass
        flattens the layer's gradients into one buffer (ZeRO: into the reduce-scatter staging) and
        ZeRO-3 copies its parameters out of the all-gather staging twice (forward and backward);
        once per step DP packs its gradients into buckets and ZeRO-2 copies out the re-gathered
        parameters."""
        per_byte = getattr(self.cluster, "copy_s_per_byte", 0.0)
        if not per_byte:
            return 0.0, 0.0
        grads = train_tp * (self.itemsize if s.sdp == "none" else self.reduce_itemsize)
        params = 2 * elems_tp * self.itemsize if s.sdp == "zero3" else 0.0
        step = 0.0
        if s.sdp == "none" and s.dp > 1 and self.bucket_bytes:
            step = train_tp * self.reduce_itemsize
        elif s.sdp == "zero2":
            step = train_tp * self.itemsize
        return (grads + params) * per_byte, step * per_byte

    # ------------------------------------------------------------------ resharding
    def _gather_time(self, nbytes: float, have: Strategy, want: Strategy) -> float:
        """Seconds to give each rank of layout ``want`` its slice from layout ``have``."""
        sample_k = want.tp // have.tp if want.tp > have.tp else 1
        seq_k = have.tp if have.sp and (not want.sp or want.tp != have.tp) else 1
        if sample_k * seq_k == 1:
            return 0.0
        ranks = sorted({a + have.tp * k for a in range(seq_k) for k in range(sample_k)})
        need = nbytes / want.dp / (want.tp if want.sp else 1)
        return self.cluster.collective_time("all_gather", need, ranks)

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
