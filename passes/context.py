"""What the rewrite passes of one ``gfx.transform`` share: the plan, this rank, and what they built.

:class:`ParallelContext` is created once per transform (see :mod:`galvatron_fx.parallelize`) and
handed to every rewrite pass. Inputs (set before the first pass): the whole plan, this rank, the
world size, the capture front end, the captured global batch, the DP bucket size, the loss and
the names of the whole model's parameters.
Products live in one mapping keyed by the dimension or pass that builds them
(``products[owner][name]``; the named attributes below are views of it, :class:`Product`): the
passes after their builder and the code generator read them; nothing else carries state between
passes. A chunk of a multi-chunk schedule starts with none (:meth:`ParallelContext.for_chunk`
starts an empty mapping).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ..plan import Plan
from ..runtime.data_parallel import DEFAULT_BUCKET_BYTES
from ..runtime.groups import Layout, batch_layout, input_layout
from ..runtime.precision import Precision
from ..sharding.sequence import is_sequence_activation
from .base import GraphPass, check
from .split_layers import is_split


class Product:
    """A product one dimension or pass builds per chunk: the view of ``ctx.products[owner][name]``,
    ``default`` (a value, or a factory such as ``dict``) until its builder sets it."""

    def __init__(self, owner: str, default: Any = None):
        self.owner, self.default = owner, default

    def __set_name__(self, cls, name: str) -> None:
        self.name = name

    def __get__(self, ctx, cls=None):
        if ctx is None:
            return self
        built = ctx.products.setdefault(self.owner, {})
        if self.name not in built:
            built[self.name] = self.default() if callable(self.default) else self.default
        return built[self.name]

    def __set__(self, ctx, value) -> None:
        ctx.products.setdefault(self.owner, {})[self.name] = value


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
    products: dict = field(default_factory=dict)  # owner (dimension or pass) -> its products, by name

    # the products, each a view of products[owner] (built per chunk by the owner named first)
    token_loss = Product("token_loss")              # TokenLoss (count graph, scale buffer)
    stage_info = Product("stage_split")             # StageInfo
    tp_shards = Product("tensor", dict)             # tensor_parallel: fqn -> (ShardInfo, TP ranks)
    expert_params = Product("experts", dict)        # expert_parallel: layer -> fqns split by expert
    held_experts = Product("experts", dict)         # expert_parallel, loop form: fqn -> held by this rank
    stores = Product("data", list)                  # data_parallel: this rank's FlatParams, layer order
    output_layout = Product("resharding")           # Layout of the graph output
    input_layout = Product("resharding")            # Layout the graph inputs arrive in

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
        return dataclasses.replace(self, chunk=chunk, products={})

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
