"""What the rewrite passes of one ``gfx.transform`` share: the plan, this rank, and what they built.

:class:`ParallelContext` is created once per transform (see :mod:`galvatron_fx.parallelize`) and
handed to every rewrite pass. Inputs (set before the first pass): the whole plan, this rank, the
world size, the capture front end, the captured global batch, the DP bucket size, the loss and
the names of the whole model's parameters.
Products (set by the pass named beside each field; ``products`` holds any other dimension's, by
its name) are read by the passes after it and by the code generator; nothing else carries state
between passes. A chunk of a multi-chunk schedule starts with none (:meth:`ParallelContext.for_chunk`
resets every field marked as a product).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ..ir import StageInfo
from ..plan import Plan
from ..runtime.data_parallel import DEFAULT_BUCKET_BYTES
from ..runtime.groups import Layout, batch_layout, input_layout
from ..runtime.precision import Precision
from ..sharding.sequence import is_sequence_activation
from .base import GraphPass, check
from .split_layers import is_split


def _product(default: Any):
    """A field the passes build per chunk: ``default`` is the value (``None``) or a factory
    (``dict``, ``list``) a new chunk starts from (:meth:`ParallelContext.for_chunk`)."""
    if callable(default):
        return field(default_factory=default, metadata={"product": True})
    return field(default=default, metadata={"product": True})


@dataclass
class ParallelContext:
    """One rank's view of a plan while its program is built (see the module docstring)."""

    plan: Plan
    rank: int
    world_size: int
    method: str = "fx"                  # capture front end: "fx" | "dynamo" | "export" | "graph"
    global_batch: int | None = None     # dim 0 of the captured graph inputs, in samples
    symbolic_batch: bool = False        # the graph computes its batch sizes (galvatron_fx/batch_symbol.py)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    loss_fn: Any = None
    precision: Precision = field(default_factory=Precision)  # runtime/precision.py: the plan's policy
    param_fqns: list = field(default_factory=list)  # every parameter of the whole model, graph order
    whole_batch: frozenset = frozenset()  # (global) layers mixing the samples of a batch (batch_symbol.coupling)
    seq_len: int | None = None          # the captured sequence (sharding/sequence.py: what cp > 1 splits)
    chunk: int | None = None            # the chunk of plan.stages built (None: this rank's stage; for_chunk)
    # products: built per chunk (for_chunk starts a chunk with none), each set by the pass named beside it
    token_loss: Any = _product(None)                  # token_loss: TokenLoss (count graph, scale buffer)
    stage_info: StageInfo | None = _product(None)     # stage_split
    tp_shards: dict = _product(dict)                  # tensor_parallel: fqn -> (ShardInfo, TP ranks)
    expert_params: dict = _product(dict)              # expert_parallel: layer -> fqns split by expert
    held_experts: dict = _product(dict)               # expert_parallel, loop form: fqn -> held by this rank
    stores: list = _product(list)                     # data_parallel: this rank's FlatParams, layer order
    output_layout: Layout | None = _product(None)     # resharding: layout of the graph output
    input_layout: Layout | None = _product(None)      # resharding: layout the graph inputs arrive in
    products: dict = _product(dict)                   # any other pass's, by dimension name (galvatron_fx.dims)

    @property
    def stage_size(self) -> int:
        """Devices per pipeline stage (``world_size / pp``)."""
        return self.world_size // self.plan.pp

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank // self.stage_size

    @property
    def chunk_index(self) -> int:
        """The chunk of ``plan.stages`` this program runs (this rank's stage unless ``chunk`` says)."""
        return self.stage if self.chunk is None else self.chunk

    def for_chunk(self, chunk: int) -> ParallelContext:
        """The same inputs, no products, building chunk ``chunk`` (a multi-chunk schedule runs
        several per rank: :mod:`galvatron_fx.solver.schedules`)."""
        fresh = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                 for f in dataclasses.fields(self) if f.metadata.get("product")}
        return dataclasses.replace(self, chunk=chunk, **fresh)

    @property
    def base(self) -> int:
        """The first global rank of this rank's stage."""
        return self.stage * self.stage_size

    @functools.cached_property
    def stage_plan(self) -> Plan:
        """The pp = 1 plan of this rank's chunk alone (its layers, ``world_size / pp`` devices)."""
        plan = self.plan
        if plan.pp == 1:
            return plan
        k = self.stage
        first, last = plan.stages[self.chunk_index]
        est = dict(plan.estimate)
        mem = est.get("memory_bytes_per_device")
        est["memory_bytes_per_device"] = [mem[k]] if isinstance(mem, list) and len(mem) > k else None
        return dataclasses.replace(plan, world_size=self.stage_size, pp=1, stages=[(0, last - first)],
                                   schedule="1f1b", virtual_stages=1,
                                   layers=[dataclasses.replace(lp) for lp in plan.layers[first:last + 1]],
                                   estimate=est)

    def layouts(self) -> list[Layout]:
        """Where every layer of this rank's stage holds its batched values (stage-local layer order;
        :func:`~galvatron_fx.runtime.groups.batch_layout`: a layer mixing the samples of a batch
        holds all of them)."""
        return [batch_layout(lp.tp, lp.dp, lp.sp, self.base, whole_batch=self.holds_whole_batch(i), cp=lp.cp)
                for i, lp in enumerate(self.stage_plan.layers)]

    def holds_whole_batch(self, i: int) -> bool:
        """Whether stage-local layer ``i`` mixes the samples of a batch over DP ranks (``whole_batch``)."""
        first = self.plan.stages[self.chunk_index][0] if self.plan.pp > 1 else 0
        return first + i in self.whole_batch

    def tp_layouts(self) -> list[Layout]:
        """Every layer's ``tp x dp`` layout as planned: its TP groups (stage-local layer order)."""
        return [Layout(lp.tp, lp.dp, lp.sp, self.base) for lp in self.stage_plan.layers]

    def is_sequence(self, node: torch.fx.Node) -> bool:
        """Whether ``node``'s value crosses layer boundaries in sequence shards under cp > 1."""
        return is_sequence_activation(node.meta.get("val"), self.seq_len)

    def boundary_layout(self) -> Layout:
        """The layout batched values cross a stage boundary in (see
        :mod:`galvatron_fx.passes.stage_boundaries`) and graph inputs arrive in:
        :func:`~galvatron_fx.runtime.groups.input_layout` (``tp=1, dp=N`` over the stage's N ranks
        unless the micro-batch has fewer samples than N)."""
        return input_layout(self.stage_size, self.plan.global_batch_size // self.plan.micro_batches, self.base)


class ContextPass(GraphPass):
    """A rewrite pass configured by a :class:`ParallelContext`. With ``needs_split`` it takes the
    split top graph of :mod:`.split_layers` (its ``requires`` checks that)."""

    needs_split = False

    def __init__(self, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        if self.needs_split:
            check(is_split(graph_module), f"{self.pass_name()} needs the split top graph (run split_layers first)")
