"""Tensor-parallel sharding analysis: which ops of a layer can run sharded, found from the graph.

This package sits below :mod:`galvatron_fx.passes`, :mod:`galvatron_fx.cost` and
:mod:`galvatron_fx.runtime` (it imports only torch, :mod:`galvatron_fx.errors` and
:mod:`galvatron_fx.ir`): the tensor-parallel pass applies its result, the cost model prices it and
the runtime reassembles shards with :func:`unshard`.

No module names are read. Inside each layer with ``tp > 1`` a *sharding state* is propagated
through the ops in graph order (on the global shapes of ``node.meta["val"]``):

* ``None``: replicated in the TP group (every rank holds the same full value);
* :class:`Sharded` ``(dim, "tp")``: split into ``tp`` contiguous chunks along ``dim`` (heads / features);
  with ``outer`` > 1 the dim is ``[outer, inner]`` and only ``inner`` is chunked (Bloom's
  ``batch x heads``); with ``blocks`` it is a fused projection's output whose blocks are each
  chunked (``"tp"``) or whole on every rank (``"full"``);
* :class:`Sharded` ``(dim, "seq")``: sequence parallel, split along the sequence (dim 1 of a layer's
  ``[batch, seq, hidden]`` boundary activations);
* :class:`Duplicated`: whole on every rank, gradients partial sums (a ``"full"`` block taken out of
  a fused projection: Falcon's single key / value head). Any op of duplicated and replicated values
  is duplicated (the replicated ones copied in); it must not leave the layer.

Every op is handled by the rule registered for its name (:func:`register_rule`, one rule per op
family in :mod:`.pointwise`, :mod:`.linear`, :mod:`.views`, :mod:`.selections`, :mod:`.attention`,
:mod:`.reductions`, :mod:`.losses`); an op without a rule cannot run on shards.

A linear op with a parameter weight (every form of :mod:`.operands`: ``linear``, ``matmul`` also on
a transposed parameter, ``addmm``, batched and grouped expert weights, ``einsum``) and a replicated
(or sequence-sharded) input is *column parallel*: its output is sharded along its features.
That state flows through head splits (view / reshape / unflatten, whose size arguments are then
rewritten), transposes, elementwise ops (activations, SwiGLU's product, rotary embeddings),
``repeat_interleave`` of GQA key/value heads and scaled-dot-product attention, up to the linear that
consumes a feature-sharded input: the *row-parallel* linear, whose partial output is summed
(all-reduce, or reduce-scatter along the sequence with ``sp``). An embedding whose table rows divide
by ``tp`` is vocab parallel (a padding row too). A fused q/k/v (or gate/up) output taken apart along
its sharded dim (split, slices, indices: :mod:`.selections`) has its blocks found
(:class:`Reblock`), so the weight is sharded per block. A custom autograd function whose bodies
are elementwise is elementwise (Bloom's GELU), else opaque (``LayerTP.notes`` says why).

Where a tp-sharded value reaches an op that cannot work on shards (a norm over the sharded dim,
the layer boundary, ...), the column linears it came from are *demoted* (run replicated) and the
layer is analysed again. A cross entropy of logits sharded over the vocabulary runs on the shards
(:mod:`.losses`; those logits may also leave the graph sharded, as a marked output); before any
other loss the value is all-gathered instead. A sequence-sharded value reaching such an op is
all-gathered.

The result, :class:`LayerTP`, is plain data: roles of nodes, per-edge conversions, new shape
arguments, parameter shards. :mod:`galvatron_fx.passes.tensor_parallel` applies it.
"""

from .analysis import LOSSES, LayerAnalyzer, analyze, analyze_layer, boundary_layout
from .linear import parallel_linear
from .operands import LinearOperands, embedding_operands, linear_operands, weight_consumers, weight_param
from .pointwise import ACTIVATIONS, POINTWISE
from .reductions import DIMWISE, REDUCTIONS
from .registry import Rule, default_rule, lookup, register_rule, registered_ops
from .shards import full_shape, shard_tensor, unshard
from .state import (
    SEQ,
    TP,
    Demote,
    Duplicated,
    LayerTP,
    ParamShard,
    Reblock,
    Sharded,
    Unsupported,
    is_param,
    is_sharded,
    op_name,
    set_arg,
)
from .views import VIEWS

__all__ = [
    "ACTIVATIONS", "DIMWISE", "LOSSES", "POINTWISE", "REDUCTIONS", "SEQ", "TP", "VIEWS",
    "Demote", "Duplicated", "LayerAnalyzer", "LayerTP", "LinearOperands", "ParamShard", "Reblock", "Rule",
    "Sharded", "Unsupported", "analyze", "analyze_layer", "boundary_layout", "default_rule", "embedding_operands", "is_param",
    "is_sharded", "linear_operands", "lookup", "op_name", "parallel_linear", "register_rule", "registered_ops",
    "set_arg", "shard_tensor", "unshard", "full_shape", "weight_consumers", "weight_param",
]
