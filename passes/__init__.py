"""The graph passes of galvatron_fx, one per module, each with a checked ``requires`` / ``ensures``
contract (:mod:`.base`), chained by one :class:`~.base.PassManager`.

Capture side (:func:`galvatron_fx.capture`): ``normalize`` -> ``layer_grouping``; then
``cost_annotation`` for the planner. Rewrite side (:func:`galvatron_fx.parallelize.parallelize_passes`,
the same list for every plan): ``stage_split`` (pp > 1) -> ``tensor_parallel`` -> ``split_layers``
-> ``local_batch`` -> ``stage_boundaries`` (outputs) -> ``checkpointing`` -> ``data_parallel`` ->
``resharding`` -> ``stage_boundaries`` (inputs) -> ``codegen`` -> ``bind_parameters`` (backend).
The rewrite passes share one :class:`~.context.ParallelContext`.
"""
