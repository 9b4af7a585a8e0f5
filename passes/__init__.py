"""The graph passes of galvatron_fx, one per module, each with a checked ``requires`` / ``ensures``
contract (:mod:`.base`), chained by one :class:`~.base.PassManager`.

Capture side (:func:`galvatron_fx.capture`): ``normalize`` -> ``layer_grouping``; then
``cost_annotation`` for the planner. Rewrite side (:func:`galvatron_fx.parallelize.parallelize_passes`,
the same list for every plan, each pass present when the plan needs it): :data:`REWRITE_ORDER`, the
one declaration of their order, which the :class:`~.base.PassManager` checks. The rewrite passes
share one :class:`~.context.ParallelContext`.
"""

from .. import dims

REWRITE_SKELETON = ("token_loss", "stage_split", "split_layers", "local_batch", "stage_outputs", "mixed_precision",
                    "resharding", "stage_inputs", "meta_device", "codegen", "bind_parameters")
"""The rewrite passes every program needs whatever its parallel dimensions (each still only when the
plan needs it: the stage passes under pp > 1, mixed precision under a mixed plan)."""

REWRITE_ORDER = dims.rewrite_order(REWRITE_SKELETON)
"""The rewrite passes in the order they run (each only when the plan needs it): the skeleton with
each dimension's passes after the pass its :class:`~galvatron_fx.dims.PassSpec` names
(``tensor_parallel`` after ``stage_split``, ``context_parallel`` and ``expert_parallel`` after
``local_batch``, ``checkpointing`` after ``stage_outputs``, ``data_parallel`` after it). Why this order: the
loss's token count reads the whole graph's labels (first); the stage split makes every later pass
see one stage as a whole model; TP rewrites the flat graph, so the layer submodules, the DP buffers
and the ZeRO shards are built from TP-local shards; checkpointing wraps whole layer calls before
data parallelism rewrites them (a ZeRO-3 gather is redone inside the recompute); resharding leaves
received values alone, so the stage inputs come after it; the meta-device rewrite is the last
rewrite (the passes before propagate fake tensors), then codegen and the parameter binding."""
