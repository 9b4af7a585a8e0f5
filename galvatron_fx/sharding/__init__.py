"""Tensor-parallel sharding analysis: which ops of a layer can run sharded, found from the graph.

This package sits below :mod:`galvatron_fx.passes`, :mod:`galvatron_fx.cost` and
:mod:`galvatron_fx.runtime` (it imports only torch, :mod:`galvatron_fx.errors` and
:mod:`galvatron_fx.ir`): the tensor-parallel pass applies its result, the cost model prices it and
the runtime reassembles shards with :func:`unshard`.

No module names are read. Inside each layer with ``tp > 1`` a *sharding state* is propagated
through the ops in graph order (on the global shapes of ``node.meta["val"]``):

* ``None``: replicated in the TP group (every rank holds the same full value);
* :class:`Sharded` ``(dim, "tp")``: split into ``tp`` contiguous chunks along ``dim`` (heads / features);
* :class:`Sharded` ``(dim, "seq")``: sequence parallel, split along the sequence (dim 1 of a layer's
  ``[batch, seq, hidden]`` boundary activations).

Every op is handled by the rule registered for its name (:func:`register_rule`, one rule per op
family in :mod:`.pointwise`, :mod:`.linear`, :mod:`.views`, :mod:`.attention`, :mod:`.reductions`);
an op without a rule cannot run on shards.

A linear op (``linear`` of any capture flavour, or ``matmul``) with a parameter weight and a
replicated (or sequence-sharded) input is *column parallel*: its output is ``Sharded(-1, "tp")``.
That state flows through head splits (view / reshape / unflatten, whose size arguments are then
rewritten), transposes, elementwise ops (activations, SwiGLU's product, rotary embeddings),
``repeat_interleave`` of GQA key/value heads and scaled-dot-product attention, up to the linear that
consumes a feature-sharded input: the *row-parallel* linear, whose partial output is summed
(all-reduce, or reduce-scatter along the sequence with ``sp``). An embedding whose table rows divide
by ``tp`` is vocab parallel. A fused q/k/v output that is ``split`` along its sharded dim records the
block sizes, so the weight is sharded per block.

Where a tp-sharded value reaches an op that cannot work on shards (a norm over the sharded dim,
the layer boundary, ...), the column linears it came from are *demoted* (run replicated) and the
layer is analysed again; before a loss (cross entropy of vocab-parallel logits) the value is
all-gathered instead. A sequence-sharded value reaching such an op is all-gathered.

The result, :class:`LayerTP`, is plain data: roles of nodes, per-edge conversions, new shape
arguments, parameter shards. :mod:`galvatron_fx.passes.tensor_parallel` applies it.
"""

from .analysis import LOSSES, LayerAnalyzer, analyze, boundary_layout
from .linear import parallel_linear
from .pointwise import ACTIVATIONS, POINTWISE
from .reductions import DIMWISE, REDUCTIONS
from .registry import Rule, default_rule, lookup, register_rule, registered_ops
from .shards import shard_tensor, unshard
from .state import (
    SEQ,
    TP,
    Demote,
    LayerTP,
    ParamShard,
    Sharded,
    Unsupported,
    embedding_operands,
    is_param,
    is_sharded,
    linear_operands,
    op_name,
)
from .views import VIEWS

__all__ = [
    "ACTIVATIONS", "DIMWISE", "LOSSES", "POINTWISE", "REDUCTIONS", "SEQ", "TP", "VIEWS",
    "Demote", "LayerAnalyzer", "LayerTP", "ParamShard", "Rule", "Sharded", "Unsupported",
    "analyze", "boundary_layout", "default_rule", "embedding_operands", "is_param", "is_sharded",
    "linear_operands", "lookup", "op_name", "parallel_linear", "register_rule", "registered_ops",
    "shard_tensor", "unshard",
]
