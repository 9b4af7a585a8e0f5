"""What the generated distributed program calls at run time.

``groups`` (rank layout, process groups), ``data_parallel`` (per-layer flat buffers: DP, ZeRO-2,
ZeRO-3), ``reshard`` (batch / sequence slices between layouts), ``tp_ops`` (Megatron's conjugate
collectives), ``checkpointing``, ``module`` (:class:`DistributedModel`, ``train_step``) and
``pipeline`` (:class:`PipelineModel` on ``torch.distributed.pipelining``).

NOTE: nothing here imports ``passes/`` or ``cost/``: the graph rewrites sit above the runtime and
the cost model beside them (imports point one way; docs/architecture.md).
"""
