"""Tensor-parallel (+ sequence-parallel) rewrite pass: Megatron-style sharding found in the graph.

Input: a captured, layer-grouped GraphModule (see :mod:`galvatron_fx.frontend`) and, per layer with
``tp > 1``, its degree and sequence-parallel flag. Which ops shard is decided by
:mod:`galvatron_fx.sharding` from the ops and shapes alone (no module names).

Output (the same GraphModule, edited in place), for every such layer:

* column-parallel linears hold this rank's rows of the weight (and bias); fused projections split
  along their output are sharded per block (each rank its q, k and v heads); row-parallel linears
  hold this rank's columns, their partial output is summed, then the (whole) bias is added once;
  embeddings whose rows divide by ``tp`` are vocab parallel (out-of-range ids give zero rows, then
  the sum); shards are new ``nn.Parameter`` objects registered under the *same* fully qualified
  names, and their get_attr nodes carry :class:`~galvatron_fx.ir.ShardInfo`;
* size arguments of view / reshape / unflatten / expand / split that carry a sharded extent
  (number of heads, width, sequence length under sp) are divided by ``tp``;
* conjugate collectives from :mod:`galvatron_fx.runtime.tp_ops` sit on the edges:
  ``tp_copy_to_region`` before a sharded region (f), ``tp_reduce_from_region`` after it (g);
  under sp ``tp_all_gather_sequence`` / ``tp_reduce_scatter_sequence`` instead;
* the LM head is column parallel over the vocabulary and a cross entropy of its logits becomes
  :func:`~galvatron_fx.runtime.vocab_parallel.vocab_parallel_cross_entropy` on the shards (full
  logits never exist); other losses of vocab-sharded logits (class weights, ``mse_loss``, ...)
  all-gather them first (``tp_gather_from_region``);
* logits that also leave the graph as an output (HF models return them beside the loss) stay this
  rank's vocabulary slice, marked by ``vocab_shard_output``: ``train_step`` never materialises
  them, ``eval_step(return_outputs=True)`` assembles them; with ``gather_outputs`` (a ``loss_fn``
  that reads the outputs) they are all-gathered at the output instead;
* ``node.meta["val"]`` is recomputed (FakeTensorProp), so later passes see local shapes.

Layout contract at layer boundaries: a value leaves and enters a layer with ``sp`` *sequence
sharded* (dim 1, this rank's contiguous chunk in its TP group) when it is a 3-D floating tensor
(``[batch, seq, hidden]``); every other boundary value (and every value of a layer without sp) is
*replicated* in the TP group. Where producer and consumer layouts differ (e.g. a non-sp embedding
feeding an sp block, or an sp block feeding the loss) the pass inserts ``tp_scatter_to_region`` /
``tp_gather_from_region`` on the edge, so graph inputs and outputs stay replicated and the caller
only reshards the batch (DP). Norms, dropout and residual adds of an sp layer run on sequence
shards; replicated parameters used on shards receive their full gradient through
``tp_copy_to_region`` (its backward all-reduce), so no extra gradient sync is needed inside TP.

Anything of a tp > 1 layer that cannot be sharded runs replicated in the TP group; the pass logs it
and :func:`tensor_parallel_report` lists, per layer, the sharded and replicated parameters.

NOTE: dropout is not given per-rank RNG streams (Megatron's RNG tracker): on head / sequence shards
every rank draws from the same generator state, which is statistically correlated across shards.
The zoo models have no dropout; a model that trains with dropout under TP should be revisited.

Size: one file, over 500 lines: the TP rewrite of a layer's ops (``_Rewriter``, one method per op
family of the sharding rules) and the pass around it share the size bookkeeping each rewrite
updates.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable

import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import ConfigError
from ..ir import META_KEY, NodeInfo, ShardInfo, graph_info, node_info
from ..runtime import tp_ops, vocab_parallel
from ..runtime.groups import group as process_group
from ..sharding import (  # noqa: F401 (unshard: re-exported, it used to live here)
    LayerTP,
    Sharded,
    analyze,
    boundary_layout,
    op_name,
    set_arg,
    shard_tensor,
    unshard,
)
from ..sharding.experts import keep_whole, split_blocks
from ..sharding.linear import ADAPTER_WHY
from ..sharding.report import layer_report
from .context import ContextPass
from .split_layers import fetch_attr, fresh_copy

log = logging.getLogger(__name__)

REPORT_KEY = "galvatron.tp"

_CONVERSION_OPS = {
    "copy": tp_ops.tp_copy_to_region,
    "scatter": tp_ops.tp_scatter_to_region,
    "gather": tp_ops.tp_gather_from_region,
    "all_gather_seq": tp_ops.tp_all_gather_sequence,
    "all_reduce": tp_ops.tp_reduce_from_region,
    "reduce_scatter": tp_ops.tp_reduce_scatter_sequence,
    "scatter_outer": tp_ops.tp_scatter_outer,
    "mark": vocab_parallel.vocab_shard_output,
}


_MM = {torch.addmm: torch.mm, torch.ops.aten.addmm.default: torch.ops.aten.mm.default}
"""addmm -> mm of a row-parallel Conv1D (its bias is added once, after the partial sums)."""


def apply_tensor_parallel(gm: torch.fx.GraphModule, layer_tp: dict[int, tuple[int, bool]], *,
                          tp_rank_of: Callable[[int], int],
                          tp_group_of: Callable[[int], object],
                          gather_outputs: bool = False,
                          layer_ep: dict[int, int] | None = None,
                          layer_cp: dict[int, int] | None = None,
                          expert_tp: frozenset[int] | set[int] = frozenset()) -> torch.fx.GraphModule:
    """Shard the layers of ``layer_tp`` (layer index -> (tp degree, sp flag)); see the module docstring.

    ``tp_rank_of(layer)`` is this rank's index in the layer's TP group, ``tp_group_of(layer)`` the
    ProcessGroup (None = the default group). ``gather_outputs``: all-gather vocab-sharded graph
    outputs (for a ``loss_fn`` reading them) instead of leaving them marked shards. Edits ``gm`` in
    place and returns it. ``layer_ep`` (layer index -> ep): the experts of layers with ``ep > 1``
    stay whole (expert parallelism splits them by expert instead, :mod:`.expert_parallel`), except
    in the layers of ``expert_tp`` (expert tensor parallelism: their grouped expert weights are
    sharded along their width here, then split by expert there; the routers stay whole).
    ``layer_cp`` (layer index -> cp): sequence-parallel chunks cross a boundary only between layers
    of the same cp (they are chunks of a CP shard); elsewhere they are gathered and re-scattered.

    Raises:
        ConfigError: heads / key-value heads / ffn width of a block (or the sequence length under
            sp) not divisible by its tp, or ranks inconsistent with the groups.
    """
    layer_tp = {int(k): (int(v[0]), bool(v[1])) for k, v in layer_tp.items() if int(v[0]) > 1}
    split = split_blocks(gm, layer_ep or {})
    keep = keep_whole(split, layer_ep or {}, expert_tp)
    plans = analyze(gm, layer_tp, keep)
    _mark_expert_tokens(split, plans)
    _warn_shards_nothing(gm, plans)
    keys = {}
    for idx, (tp, _sp) in layer_tp.items():
        group = tp_group_of(idx)
        keys[idx] = tp_ops.register_group(group, tp)
        rank = int(tp_rank_of(idx))
        if not 0 <= rank < tp:
            raise ConfigError(f"layer {plans[idx].name}: tp rank {rank} out of range for tp={tp}")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            size = torch.distributed.get_world_size(group)
            if size != tp or torch.distributed.get_rank(group) != rank:
                raise ConfigError(f"layer {plans[idx].name}: its TP group has {size} ranks (this one is "
                                  f"{torch.distributed.get_rank(group)}), but tp={tp}, tp_rank={rank}")
    _Rewriter(gm, plans, keys, tp_rank_of, layer_tp, gather_outputs, layer_cp or {}).run()
    gm.meta[REPORT_KEY] = {idx: _report(p) for idx, p in plans.items()}
    for p in plans.values():
        if p.sharded_outputs and not gather_outputs:
            # NOTE: documented, not warned: it is what training wants (the loss is computed on the shards)
            log.info("layer %s (tp=%d): output(s) %s leave as this rank's vocabulary slice (not materialised "
                     "in training); eval_step(return_outputs=True) assembles them", p.name, p.tp,
                     ", ".join(p.sharded_outputs))
    kinds = {r.index: r.kind for r in graph_info(gm).layers}
    for idx, p in plans.items():
        # NOTE: a low-rank adapter's A runs replicated by design (sharding/linear.py: adapter_down)
        forced = [n for n in p.replicated_linears if n not in keep
                  and not p.why_replicated.get(n, "").startswith(ADAPTER_WHY[:20])]
        if forced:
            # NOTE: a block that cannot shard some projection is worth a warning (it costs memory and
            # time the cost model may not expect); replicated embedding / head parts are routine.
            (log.warning if kinds[idx] == "block" else log.info)(
                "layer %s (tp=%d): %s run replicated in the TP group", p.name, p.tp, ", ".join(forced))
    return gm


TOKENS_KEY = "galvatron.ep_tokens"
"""Node meta key on an experts block's tokens under TP: ``"replicated"`` (every TP rank holds them
all: expert parallelism splits them over the TP ranks) or ``"sharded"`` (sequence-parallel shards)."""


def _mark_expert_tokens(split: dict[int, list], plans: dict[int, LayerTP]) -> None:
    """Record how the TP analysis leaves each expert-parallel block's tokens (:data:`TOKENS_KEY`)."""
    for idx, blocks in split.items():
        for b in blocks if idx in plans else ():
            b.x.meta[TOKENS_KEY] = "replicated" if plans[idx].states.get(b.x.name) is None else "sharded"


def _warn_shards_nothing(gm: torch.fx.GraphModule, plans: dict[int, LayerTP]) -> None:
    """A plan pinned ``tp > 1`` on a layer where TP shards no parameter: say so, with the reasons."""
    for idx, p in plans.items():
        if p.sharded_params:
            continue
        whole = "; ".join(f"{fqn}: {why}" for fqn, why in list(layer_report(gm, p, idx, p.tp).notable_whole().items())[:3])
        warnings.warn(f"layer {p.name}: tp={p.tp} shards none of its parameters ({whole or 'it has none'}), "
                      f"so its {p.tp} TP ranks each repeat the whole layer; give it tp=1 (the search never "
                      f"does this; `galvatron-fx layers MODEL --tp {p.tp}` lists the reasons)", stacklevel=3)


def tensor_parallel_report(gm: torch.fx.GraphModule) -> dict[int, dict]:
    """Per tp layer: ``column`` / ``row`` / ``vocab_parallel`` ops, ``vocab_losses`` (cross entropies run
    on vocabulary shards), ``sharded_outputs`` (graph outputs left vocab-sharded), ``replicated_ops``, ``sharded`` and
    ``replicated`` parameter fqns, ``shape_args`` rewritten (for the cost model and for logs)."""
    return dict(gm.meta.get(REPORT_KEY, {}))


def param_shards(gm: torch.fx.GraphModule) -> dict[str, ShardInfo]:
    """fqn -> :class:`ShardInfo` of every tensor-parallel parameter shard in ``gm`` (for gathering a
    full state dict: ``unshard([shard of rank 0, ..., shard of rank tp-1], info)``)."""
    return {n.target: n.meta[META_KEY].shard for n in gm.graph.nodes
            if n.op == "get_attr" and META_KEY in n.meta and n.meta[META_KEY].shard is not None}


def _report(p: LayerTP) -> dict:
    return {"name": p.name, "tp": p.tp, "sp": p.sp, "column": list(p.column), "row": list(p.row),
            "vocab_parallel": list(p.vocab_embeddings), "vocab_losses": list(p.vocab_losses),
            "sharded_outputs": list(p.sharded_outputs), "replicated_ops": list(p.replicated_linears),
            "sharded": list(p.sharded_params), "replicated": list(p.replicated_params),
            "shape_args": dict(p.shape_args)}


class _Rewriter:
    def __init__(self, gm, plans: dict[int, LayerTP], keys, tp_rank_of, layer_tp, gather_outputs=False,
                 layer_cp=None):
        self.gm, self.plans, self.keys, self.rank_of, self.layer_tp = gm, plans, keys, tp_rank_of, layer_tp
        self.gather_outputs, self.layer_cp = gather_outputs, layer_cp or {}
        self.graph = gm.graph
        self.by_name = {n.name: n for n in gm.graph.nodes}
        self.cache: dict[tuple, torch.fx.Node] = {}
        self.new_nodes: dict[int, list[str]] = {}
        self.alias: dict[str, str] = {}   # replacement node -> name of the node it stands for

    def run(self):
        self.shard_params()
        for idx, plan in self.plans.items():
            self.rewrite_layer(idx, plan)
        self.convert_boundaries()
        self.graph.lint()
        self.gm.recompile()
        self.refresh_meta()

    # --- parameters
    def shard_params(self):
        done = set()
        for idx, plan in self.plans.items():
            rank = int(self.rank_of(idx))
            for node_name, shard in plan.param_shards.items():
                if node_name in done:
                    continue
                done.add(node_name)
                node = self.by_name[node_name]
                full = self.gm.get_parameter(node.target) if _is_parameter(self.gm, node.target) \
                    else fetch_attr(self.gm, node.target)
                with torch.no_grad():
                    local = shard_tensor(full.detach(), shard, rank).clone()
                _set_param(self.gm, node.target, nn.Parameter(local, requires_grad=full.requires_grad))
                node_info(node).shard = ShardInfo(shard.dim, shard.tp, rank, tuple(shard.blocks))

    # --- one layer
    def new_node(self, layer, fn, args, like: torch.fx.Node):
        node = self.graph.call_function(fn, args)
        node.meta[META_KEY] = NodeInfo(module_path=node_info(like).module_path if META_KEY in like.meta else "",
                                       layer=layer)
        if "nn_module_stack" in like.meta:
            node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
        self.new_nodes.setdefault(layer, []).append(node.name)
        return node

    def tp_of(self, layer) -> int:
        return int(self.layer_tp[layer][0])

    def converted(self, layer, x, op, key, before, *, after=None):
        cache_key = (layer, x, op, key)
        if cache_key not in self.cache:
            fn = _CONVERSION_OPS[op[0]]
            args = (x, *op[1:], key)
            v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if op[0] in ("gather", "all_gather_seq") and isinstance(v, torch.Tensor) and v.shape[op[1]] % self.tp_of(layer):
                args = (*args, int(v.shape[op[1]]))   # uneven chunks (17 tokens over 2 ranks): the whole length
            with self.graph.inserting_after(after) if after is not None else self.graph.inserting_before(before):
                self.cache[cache_key] = self.new_node(layer, fn, args, before)
        return self.cache[cache_key]

    def rewrite_layer(self, idx, plan: LayerTP):
        key = self.keys[idx]
        sharded_linears = set(plan.column) | set(plan.row)
        by_consumer: dict[str, dict[str, tuple]] = {}
        for (consumer, inp), op in plan.conversions.items():
            by_consumer.setdefault(consumer, {})[inp] = op
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr", "output") or node_info(node).layer != idx:
                continue
            convs = by_consumer.get(node.name)
            if convs:
                def sub(a, node=node, convs=convs):
                    op = convs.get(self.alias.get(a.name, a.name))
                    return self.converted(idx, a, op, key, node) if op else a
                node.args = torch.fx.node.map_arg(node.args, sub)
                node.kwargs = torch.fx.node.map_arg(node.kwargs, sub)
            if node.name in sharded_linears and op_name(node) == "float8_matmul":
                node.kwargs = {**node.kwargs, "amax_group": key}   # its casts scale as one device's
            if node.name in plan.shape_args:
                _set_size(node, *_divided_size(self.graph, node, *plan.shape_args[node.name]))
            if node.name in plan.split_sizes:
                _set_split_sizes(node, plan.split_sizes[node.name][1])
            for path, value in plan.const_args.get(node.name, {}).items():
                set_arg(node, path, value)      # slice bounds / indices of a fused output's blocks
            if node.name in plan.regather:
                self.regather(idx, node, *plan.regather[node.name], key)
            if node.name in plan.vocab_embeddings:
                node = self.vocab_embedding(idx, node)
            if node.name in plan.vocab_losses:
                node = self.vocab_loss(idx, node, plan.vocab_losses[node.name])
            if node.name in plan.reduce_after or node.meta.get("_tp_reduce"):
                self.reduce(idx, node, plan.reduce_after[node.meta.get("_tp_reduce", node.name)], key)

    def vocab_embedding(self, idx, node):
        from ..sharding import embedding_operands

        ids, w, pad = embedding_operands(node)
        start = int(self.rank_of(idx)) * (_local_rows(w))
        with self.graph.inserting_before(node):
            new = self.new_node(idx, tp_ops.vocab_parallel_embedding, (ids, w, start, pad), node)
        new.meta["_tp_reduce"] = node.name
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return new

    def vocab_loss(self, idx, node, spec):
        """The cross entropy ``node`` of vocab-sharded logits -> the vocabulary-parallel one."""
        from ..sharding.losses import bind_cross_entropy

        ce = bind_cross_entropy(node)
        start = int(self.rank_of(idx)) * (spec.num_classes // self.plans[idx].tp)
        with self.graph.inserting_before(node):
            new = self.new_node(idx, vocab_parallel.vocab_parallel_cross_entropy,
                                (ce.input, ce.target, start, spec.num_classes, self.keys[idx], ce.ignore_index,
                                 ce.reduction, ce.label_smoothing), node)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.alias[new.name] = node.name
        return new

    def regather(self, idx, node, dim, local_sizes, modes, key):
        """All-gather the ``"full"`` blocks of column linear ``node``'s local output (its chunk of
        every block): split, ``tp_all_gather_sequence`` (backward: reduce-scatter of the partial
        gradients), cat, so that those blocks are whole on every rank (Falcon's key / value head)."""
        users = list(node.users)
        with self.graph.inserting_after(node):
            parts = self.new_node(idx, torch.split, (node, list(local_sizes), dim), node)
        last, pieces = parts, []
        for k, mode in enumerate(modes):
            with self.graph.inserting_after(last):
                last = self.new_node(idx, operator.getitem, (parts, k), node)
            if mode == "full":
                with self.graph.inserting_after(last):
                    last = self.new_node(idx, tp_ops.tp_all_gather_sequence, (last, dim, key), node)
            pieces.append(last)
        with self.graph.inserting_after(last):
            cat = self.new_node(idx, torch.cat, (pieces, dim), node)
        for u in users:
            u.replace_input_with(node, cat)
        self.alias[cat.name] = node.name

    def reduce(self, idx, node, how, key):
        """Sum a partial result (row-parallel linear, vocab-parallel lookup), then add the bias."""
        bias = None
        if op_name(node) == "linear":
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if bias is not None:
                if len(node.args) > 2:
                    node.args = node.args[:2]
                else:
                    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        elif op_name(node) == "addmm":   # addmm(bias, x, W) -> mm(x, W) + bias after the sum
            bias, node.args = node.args[0], node.args[1:]
            node.target = _MM[node.target]
        with self.graph.inserting_after(node):
            red = self.new_node(idx, _CONVERSION_OPS[how[0]], (node, *how[1:], key), node)
        last = red
        if bias is not None:
            if how[0] == "reduce_scatter":
                with self.graph.inserting_after(red):
                    bias = self.new_node(idx, tp_ops.tp_copy_to_region, (bias, key), node)
                    last = bias
            with self.graph.inserting_after(last):
                last = self.new_node(idx, operator.add, (red, bias), node)
        node.replace_all_uses_with(last, delete_user_cb=lambda u: u is not red)
        self.alias[last.name] = node.meta.pop("_tp_reduce", node.name)

    # --- layer boundaries
    def layout_out(self, node) -> tuple[Sharded | None, int | None]:
        layer = node_info(node).layer if node.op != "placeholder" else None
        plan = self.plans.get(layer)
        if plan is None or node.op == "get_attr":
            return None, None
        return plan.outputs.get(self.original(node).name), layer

    def original(self, node) -> torch.fx.Node:
        """The analysed node a replacement stands for (a reduce's sum for its linear or lookup)."""
        name = self.alias.get(node.name)
        return self.by_name.get(name, node) if name is not None else node

    def same_chunks(self, src: int, dst: int) -> bool:
        """Whether sequence-parallel chunks made in layer ``src`` are the ones layer ``dst`` expects:
        the same TP group and the same cp (they are chunks of the rank's CP shard)."""
        return self.keys[src] == self.keys[dst] and self.layer_cp.get(src, 1) == self.layer_cp.get(dst, 1)

    def convert_boundaries(self):
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in list(self.graph.nodes):
            if node.op == "get_attr" or META_KEY not in node.meta:
                continue
            src_layout, src_layer = self.layout_out(node)
            # NOTE: users in graph order: a conversion shared by several users of a layer is
            # inserted before the first of them (OPT's residual reads the block input after its norm)
            for user in sorted(node.users, key=lambda u: order.get(u, len(order))):
                dst_layer = None if user.op == "output" else node_info(user).layer
                if dst_layer == node_info(node).layer and node.op != "placeholder":
                    continue
                if user.op != "output" and node_info(user).layer is None:
                    continue
                want = boundary_layout(self.gm, self.original(node), dst_layer, self.layer_tp)
                x, before = node, user
                same = src_layout == want and (want is None or self.same_chunks(src_layer, dst_layer))
                producer = self.plans.get(src_layer)
                marked = (user.op == "output" and not self.gather_outputs and producer is not None
                          and node.name in producer.sharded_outputs)
                if not same and marked:                            # logits left this rank's vocabulary slice
                    x = self.converted(src_layer, x, ("mark", src_layout.dim), self.keys[src_layer], before,
                                       after=node)
                elif not same and isinstance(src_layout, Sharded):   # to replicated, in the producer's group
                    # NOTE: the gather belongs to the producer's layer (right after the value): the
                    # caller's batch resharding between the layers must see the whole sequence.
                    x = self.converted(src_layer, x, ("gather", src_layout.dim), self.keys[src_layer], before,
                                       after=node)
                if not same and isinstance(want, Sharded):         # replicated to this rank's chunk
                    x = self.converted(dst_layer, x, ("scatter", want.dim), self.keys[dst_layer], before)
                if x is not node:
                    user.args = torch.fx.node.map_arg(user.args, lambda a: x if a is node else a)
                    user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: x if a is node else a)

    # --- metadata
    def refresh_meta(self):
        info = graph_info(self.gm)
        names = {n.name for n in self.graph.nodes}
        for record in info.layers:
            record.nodes = [n for n in record.nodes if n in names] + self.new_nodes.get(record.index, [])
        _propagate_fake(self.gm)


def _local_rows(w: torch.fx.Node) -> int:
    return int(w.meta["val"].shape[0]) // w.meta[META_KEY].shard.tp


def _divided_size(graph, node, slot, old, new):
    """``(slot, old, new)`` for :func:`_set_size`; ``new = ("floordiv", k)``: a size the graph
    computes (``old`` its node's name), divided by ``k`` in a node inserted before ``node``."""
    if not isinstance(new, tuple):
        return slot, old, new
    size = next(n for n in node.all_input_nodes if n.name == old)
    with graph.inserting_before(node):
        out = graph.call_function(operator.floordiv, (size, new[1]))
    out.meta["val"] = size.meta["val"] // new[1]
    out.meta[META_KEY] = NodeInfo(module_path=node_info(node).module_path, layer=node_info(node).layer)
    return slot, size, out


def _set_size(node, slot, old, new):
    name = op_name(node)
    if name == "unflatten":
        if len(node.args) > 2:
            sizes = list(node.args[2])
            sizes[slot] = new
            node.args = (*node.args[:2], type(node.args[2])(sizes), *node.args[3:])
        else:
            sizes = list(node.kwargs["sizes"])
            sizes[slot] = new
            node.kwargs = {**node.kwargs, "sizes": sizes}
        return
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        sizes = list(rest[0])
        sizes[slot] = new
        node.args = (node.args[0], type(rest[0])(sizes))
    elif rest:
        args = list(node.args)
        args[1 + slot] = new
        node.args = tuple(args)
    else:
        k = "size" if "size" in node.kwargs else "shape"
        sizes = list(node.kwargs[k])
        sizes[slot] = new
        node.kwargs = {**node.kwargs, k: sizes}


def _set_split_sizes(node, new_sizes):
    arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections", node.kwargs.get("split_size"))
    new = new_sizes[0] if isinstance(arg, int) else list(new_sizes)
    if len(node.args) > 1:
        node.args = (node.args[0], new, *node.args[2:])
    else:
        k = "split_size_or_sections" if "split_size_or_sections" in node.kwargs else "split_size"
        node.kwargs = {**node.kwargs, k: new}


def _is_parameter(gm, target: str) -> bool:
    return isinstance(fetch_attr(gm, target), nn.Parameter)


def _set_param(gm: torch.fx.GraphModule, target: str, value: nn.Parameter) -> None:
    prefix, _, name = target.rpartition(".")
    owner = gm.get_submodule(prefix) if prefix else gm
    if name in owner._parameters:
        owner._parameters[name] = value
    else:
        if hasattr(owner, name):
            delattr(owner, name)
        owner.register_parameter(name, value)


def _propagate_fake(gm: torch.fx.GraphModule) -> None:
    """Recompute ``node.meta['val']`` from the placeholders' fake values (static shapes)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    with mode:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta["val"]
                inputs.append(torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


class TensorParallelPass(ContextPass):
    """Shard the layers with ``tp > 1`` of ``ctx``'s (stage) plan; see the module docstring.

    Takes GROUPED or STAGE (a flat graph), leaves TP_SHARDED. The input graph is not modified: the
    pass rewrites a copy (its own graph, node records and module tree over the same tensors).
    ``ctx.tp_shards`` gets ``fqn -> (ShardInfo, TP ranks)`` of every sharded parameter.
    """

    name = "tensor_parallel"

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        info = graph_info(graph_module)
        n = len(self.ctx.stage_plan.layers)
        if info is None or len(info.layers) != n:
            raise ConfigError(f"tensor_parallel needs a layer-grouped graph of the plan's {n} layers")
        if any(m.startswith("layers_") for m, _ in graph_module.named_children()):
            raise ConfigError("tensor_parallel needs a flat graph (run it before split_layers)")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx = self.ctx
        layer_tp = {i: (lp.tp, lp.sp) for i, lp in enumerate(ctx.stage_plan.layers) if lp.tp > 1}
        if not layer_tp:
            return PassResult(graph_module, False)
        layouts, rank = ctx.tp_layouts(), ctx.rank
        # NOTE: a loss_fn computes the loss from the outputs, so it gets whole logits
        gm = apply_tensor_parallel(fresh_copy(graph_module), layer_tp,
                                   tp_rank_of=lambda i: layouts[i].tp_index(rank),
                                   tp_group_of=lambda i: process_group(layouts[i].tp_ranks(rank)),
                                   gather_outputs=ctx.loss_fn is not None,
                                   layer_ep={i: lp.ep for i, lp in enumerate(ctx.stage_plan.layers)},
                                   layer_cp={i: lp.cp for i, lp in enumerate(ctx.stage_plan.layers)},
                                   expert_tp={i for i, lp in enumerate(ctx.stage_plan.layers) if lp.expert_tp})
        ctx.tp_shards = {fqn: (shard, layouts[layer].tp_ranks(rank))
                         for fqn, (shard, layer) in _shards(gm).items()}
        return PassResult(gm, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        layers = self.ctx.stage_plan.layers
        for fqn, (shard, layer) in _shards(graph_module).items():
            if shard.tp != layers[layer].tp:
                raise ConfigError(f"internal: {fqn} is sharded {shard.tp} ways in a layer with tp={layers[layer].tp}")


def _shards(gm: torch.fx.GraphModule) -> dict[str, tuple[ShardInfo, int]]:
    """fqn -> (ShardInfo, layer) of the parameters the pass sharded (their get_attr records)."""
    out = {}
    for n in gm.graph.nodes:
        info = n.meta.get(META_KEY)
        if n.op == "get_attr" and getattr(info, "shard", None) is not None and info.layer is not None:
            out[n.target] = (info.shard, info.layer)
    return out
