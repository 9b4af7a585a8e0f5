"""Context-parallel pass: each layer with ``cp > 1`` computes this rank's part of the sequence.

Takes SPLIT (after :mod:`.local_batch`, so the batch sizes are this rank's), leaves SPLIT. For every
layer whose plan entry has ``cp > 1`` (:class:`~galvatron_fx.runtime.groups.Layout`: its CP group is
``cp`` consecutive members of its DP group), :func:`galvatron_fx.sharding.sequence.analyze_layer`
says what changes and this pass writes it, with the calls of
:mod:`galvatron_fx.runtime.context_parallel`:

* whole operands meeting sequence shards -> ``local_seq`` (this rank's positions, no communication);
* shards an op needs whole -> ``gather_seq`` (all-gather; backward reduce-scatter);
* scaled-dot-product attention -> ``cp_attention`` of the layer's ``cp_kind`` (ring or Ulysses);
* shape constants written for the captured sequence ``S`` -> ``S / cp``;
* sequence activations leaving the layer whole -> sliced, other shards leaving it -> gathered
  (``boundary_gather``), so the layer keeps the boundary convention of
  :mod:`galvatron_fx.sharding.sequence` (the resharding pass moves them between layouts).

With ``sp`` on the layer the tensor-parallel pass ran first: the layer's sequence-parallel regions
hold TP chunks of this rank's CP shard (the analysis slices whole values before the TP scatter
makes chunks of them, and writes the gathers' whole length as the shard's).

Refused with the reason (:class:`ConfigError`): a layer the analysis cannot prove exact, ``cp``
with ``ep`` on the same layer, a layer mixing the samples of a batch, ``cp`` on the last
layer with a ``loss_fn`` outside the graph (the loss must be computed on the sequence shards). A
layer with ``cp > 1`` and no sequence activation runs whole on every rank of its CP group (logged).
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import ConfigError
from ..ir import META_KEY, NodeInfo, layer_module_name, node_info
from ..runtime import context_parallel as cp_ops
from ..sharding.sequence import LayerSequence, SeqShard, Unsupported, analyze_layer
from ..sharding.state import node_arg, set_arg
from .base import check
from .context import ContextPass

log = logging.getLogger(__name__)

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, 0.0, False, None, False)


class ContextParallelPass(ContextPass):
    """See the module docstring. ``rewritten``: layer index -> its :class:`LayerSequence`."""

    needs_split = True
    name = "context_parallel"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx = self.ctx
        self.rewritten: dict[int, LayerSequence] = {}
        layouts = ctx.layouts()
        last = len(ctx.stage_plan.layers) - 1
        for i, lp in enumerate(ctx.stage_plan.layers):
            if lp.cp == 1:
                continue
            self._refuse(i, lp, last)
            layer = getattr(graph_module, layer_module_name(i))
            try:
                res = analyze_layer(layer, ctx.seq_len, lp.cp, lp.name, lp.tp if lp.sp else 1)
            except Unsupported as why:
                raise ConfigError(f"layer {lp.name}: cp={lp.cp} cannot split its sequence exactly: {why}; "
                                  "use cp=1 for this layer") from None
            if not (res.out_slices or any(isinstance(s, SeqShard) for s in res.states.values())):
                log.info("layer %s: cp=%d finds no sequence activation; it runs whole on each CP rank", lp.name, lp.cp)
            lay = layouts[i]
            _Writer(layer, i, res, lp.cp, lp.cp_kind, lay.cp_ranks(ctx.rank), lay.cp_index(ctx.rank)).write()
            self.rewritten[i] = res
        return PassResult(graph_module, bool(self.rewritten))

    def _refuse(self, i: int, lp, last: int) -> None:
        ctx = self.ctx
        if not ctx.seq_len:
            raise ConfigError(f"layer {lp.name}: cp={lp.cp} needs inputs with a sequence dim (dim 1 of the first "
                              "input); use cp=1")
        if ctx.seq_len % lp.cp:
            raise ConfigError(f"layer {lp.name}: the sequence of {ctx.seq_len} tokens does not split into cp={lp.cp} "
                              "shards; use a sequence length divisible by cp (by 2 * cp to balance causal masks)")
        if lp.ep != 1:
            raise ConfigError(f"layer {lp.name}: cp={lp.cp} together with expert parallelism (ep={lp.ep}) is not "
                              "supported yet; set ep off on this layer or cp=1")
        if ctx.holds_whole_batch(i):
            raise ConfigError(f"layer {lp.name}: cp={lp.cp} on a layer mixing the samples of a batch is not supported; "
                              "use cp=1 there")
        if i == last and ctx.loss_fn is not None and (ctx.stage_info is None or ctx.stage_info.is_last):
            raise ConfigError(f"layer {lp.name}: cp={lp.cp} on the last layer needs the loss inside the model (e.g. "
                              "labels=... for transformers models), not a loss_fn; use cp=1 on the last layer")

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for i, res in getattr(self, "rewritten", {}).items():
            layer = getattr(graph_module, layer_module_name(i))
            left = [n.name for n in layer.graph.nodes if n in res.attention]
            check(not left, f"context_parallel left attention on sequence shards unconverted: {left}")


class _Writer:
    """Applies one layer's :class:`LayerSequence` to its graph."""

    def __init__(self, layer, index, res: LayerSequence, cp, kind, ranks, shard):
        self.layer, self.index, self.res = layer, index, res
        self.graph = layer.graph
        self.cp, self.kind, self.ranks, self.shard = cp, kind, tuple(ranks), shard

    def write(self) -> None:
        res, seq = self.res, self.res.seq
        for (user, a), (dim, post) in res.slices.items():
            self._replace_input(user, a, cp_ops.local_seq_of, (a, dim, seq, post, self.cp, self.shard))
        for (user, a), (dim, post) in res.gathers.items():
            self._replace_input(user, a, cp_ops.gather_seq_of, (a, dim, seq, post, self.ranks, self.shard))
        for node, path, value in res.shape_args:
            if path == (len(node.args),):       # an optional argument not written yet (a gather's length)
                node.args = (*node.args, value)
            else:
                set_arg(node, path, value)
        for node in res.attention:
            self._attention(node)
        out = next(n for n in self.graph.nodes if n.op == "output")
        for v in res.out_slices:
            self._replace_input(out, v, cp_ops.local_seq_of, (v, 1, seq, 1, self.cp, self.shard))
        for v, dim in res.out_gathers:
            self._replace_input(out, v, cp_ops.boundary_gather, (v, self.ranks, self.shard, dim))
        self.graph.lint()
        self.layer.recompile()

    def _new(self, fn, args, like: torch.fx.Node, kwargs=None) -> torch.fx.Node:
        node = self.graph.call_function(fn, args, kwargs or {})
        info = like.meta.get(META_KEY)
        node.meta[META_KEY] = NodeInfo(module_path=node_info(like).module_path if info else "", layer=self.index)
        if "val" in like.meta:
            node.meta["val"] = like.meta["val"]
        return node

    def _replace_input(self, user, a, fn, args) -> None:
        with self.graph.inserting_before(user):
            new = self._new(fn, args, a if a.op != "placeholder" else user)
        if "val" in a.meta:
            new.meta["val"] = a.meta["val"]
        user.replace_input_with(a, new)

    def _attention(self, node) -> None:
        q, k, v = node.args[:3]
        rest = tuple(node_arg(node, 3 + j, name, default) for j, (name, default) in enumerate(zip(_SDPA_ARGS,
                                                                                               _SDPA_DEFAULTS)))
        with self.graph.inserting_before(node):
            new = self._new(cp_ops.cp_attention, (q, k, v, *rest), node,
                            {"ranks": self.ranks, "index": self.shard, "kind": self.kind})
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
