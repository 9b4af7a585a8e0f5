"""Stage split pass: the flat captured graph -> one flat GraphModule per pipeline stage.

Input: a captured, layer-grouped GraphModule (``node.meta["galvatron"].layer`` on every node,
``gm.meta["galvatron"].layers`` in execution order) and the plan's stages (inclusive layer ranges,
contiguous, covering every layer).

Output (:class:`StageSplitPass` ``(stages, index)`` -> ``PassResult(stage_gm, True)``): the graph of
stage ``index`` alone, itself a captured-like graph, so the pp = 1 rewrites (tensor parallel, layer
split, checkpointing, data parallel, resharding) run on it unchanged:

* placeholders: first the original graph inputs the stage reads (``local inputs``: every rank of
  every stage is handed the whole global batch, so graph inputs such as the labels of the last
  stage's loss are read locally and never sent), then the **received** values: every value
  computed by an earlier stage that this stage or a later one reads, in original graph order;
* nodes: the nodes of the stage's layers, with ``meta["galvatron"].layer`` renumbered from 0 and
  ``meta["galvatron"]`` of the module a :class:`~galvatron_fx.ir.GraphInfo` listing only the stage's
  layer records (re-indexed from 0);
* output: the last stage returns the original output; any other stage returns the tuple of its
  **sent** values: every value computed here or received that a later stage reads (a value
  crossing several stages is passed on by the stages in between; e.g. T5's encoder output is
  read by every decoder block);
* a parameter (trainable or frozen) lives only in the stage of its layer (the layer of its first
  user); a later stage that reads it (a tied weight: LM head tied to the embedding) *receives* a
  copy of it (``torch.clone`` in the owner's layer) like an activation, and a trainable one's
  gradient travels back the same way, so the owner's gradient holds every use
  (:func:`cross_stage_params` lists such weights);
* buffers and constants are copied into every stage that reads them.

``stage_gm.meta["galvatron"].stage`` is the :class:`~galvatron_fx.ir.StageInfo` describing the cut (which local
inputs, which values received / sent, whether each is batched or needs a gradient).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import ConfigError
from ..ir import META_KEY, CrossingValue, GraphInfo, NodeInfo, StageInfo, graph_batch_size
from .base import GraphPass, check
from .split_layers import fetch_attr, is_param_node, is_trainable_param


def _flags(gm: torch.fx.GraphModule) -> tuple[dict, dict, dict]:
    """node -> depends on a batched graph input; on a trainable parameter; on any parameter."""
    from_input: dict[torch.fx.Node, bool] = {}
    from_param: dict[torch.fx.Node, bool] = {}
    from_any: dict[torch.fx.Node, bool] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder":
            from_input[n] = isinstance(v, torch.Tensor) and v.dim() >= 1
            from_param[n] = from_any[n] = False
        elif n.op == "get_attr":
            from_input[n], from_param[n], from_any[n] = False, is_trainable_param(n), is_param_node(n)
        else:
            ins = n.all_input_nodes
            from_input[n] = any(from_input[a] for a in ins)
            from_param[n] = any(from_param[a] for a in ins)
            from_any[n] = any(from_any[a] for a in ins)
    return from_input, from_param, from_any


class StageSplitPass(GraphPass):
    """Cut stage ``index`` of ``stages`` (see the module docstring). Takes GROUPED, leaves STAGE;
    with a :class:`~.context.ParallelContext` it also records the cut in ``ctx.stage_info``."""

    name = "stage_split"

    def __init__(self, stages: list[tuple[int, int]], index: int, ctx=None):
        super().__init__()
        self.stages = [tuple(s) for s in stages]
        self.index = index
        self.ctx = ctx

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        info = graph_module.meta.get(META_KEY)
        if not isinstance(info, GraphInfo) or not info.layers:
            raise ConfigError("stage_split needs a layer-grouped graph; capture it with gfx.capture()")
        expect = 0
        for first, last in self.stages:
            if first != expect or last < first:
                raise ConfigError(f"stages {self.stages} must be contiguous non-empty [first, last] ranges from 0")
            expect = last + 1
        if expect != len(info.layers):
            raise ConfigError(f"stages {self.stages} cover {expect} layers, the graph has {len(info.layers)}")
        if not 0 <= self.index < len(self.stages):
            raise ConfigError(f"stage index {self.index} is outside the {len(self.stages)} stages")

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        info = graph_module.meta[META_KEY]
        first, last = self.stages[self.index]
        check(info.stage is not None and info.stage.index == self.index,
              "stage_split must record its StageInfo in meta['galvatron'].stage")
        check(len(info.layers) == last - first + 1,
              f"stage {self.index} must hold layers {first}..{last}, holds {len(info.layers)} layers")
        check(all(n.meta[META_KEY].layer in range(len(info.layers)) for n in graph_module.graph.nodes
                  if n.op not in ("placeholder", "output")), "every stage node must belong to one of its layers")
        if self.ctx is not None:
            self.ctx.stage_info = info.stage

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        # NOTE: one function (93 lines): one walk over the graph assigning each node to its stage and wiring the boundaries
        gm, k = graph_module, self.index
        info: GraphInfo = gm.meta[META_KEY]
        first, last = self.stages[k]
        stage_of_layer = {i: s for s, (a, b) in enumerate(self.stages) for i in range(a, b + 1)}
        nodes = list(gm.graph.nodes)
        out_node = next(n for n in nodes if n.op == "output")
        placeholders = [n for n in nodes if n.op == "placeholder"]
        last_stage = len(self.stages) - 1

        def shared(n):
            return n.op == "get_attr" and not is_param_node(n)

        def stage_of(n) -> int:
            return last_stage if n.op == "output" else stage_of_layer[n.meta[META_KEY].layer]

        computed = [n for n in nodes if n.op not in ("placeholder", "output") and not shared(n)]
        from_input, from_param, from_any = _flags(gm)
        batch = graph_batch_size(gm)

        def crossing(n) -> CrossingValue:
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise ConfigError(f"value {n.name} crosses a pipeline stage boundary but is not a tensor "
                                  f"({type(v).__name__}); move the stage boundary")
            # NOTE: batch-shaped constants (HF's causal mask expanded to the batch, built from no
            # input) are batched too: the local-batch pass cuts them to the producer's slice like
            # the activations they meet (see passes/local_batch.py)
            # NOTE: a symbolic batch may sit on dim 0 times k (Bloom's ALiBi: [batch * heads, 1, S])
            rows = dict(getattr(n.meta[META_KEY], "batch_dims", ())).get(0, 1)
            batched = bool((from_input[n] or not from_any[n]) and v.dim() >= 1 and batch is not None
                           and v.shape[0] == batch * rows)
            rg = bool(from_param[n] and v.is_floating_point())
            return CrossingValue(n.name, tuple(v.shape), v.dtype, batched, rg, n.meta[META_KEY].layer, rows)

        def needed_after(n, s) -> bool:   # some user of n runs in a stage later than s
            return any(stage_of(u) > s for u in n.users)

        received = [n for n in computed if stage_of(n) < k and needed_after(n, k - 1)]
        sent = [n for n in computed if stage_of(n) <= k and needed_after(n, k)] if k < last_stage else []
        own = [n for n in computed if stage_of(n) == k]
        own_set = set(own)
        local = [p for p in placeholders
                 if any(u in own_set or (u.op == "output" and k == last_stage) for u in p.users)]

        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        attrs: dict[str, object] = {}
        for p in local:
            env[p] = graph.placeholder(p.name)
            env[p].meta = dict(p.meta)
        for n in received:
            env[n] = graph.placeholder(n.name)
            env[n].meta = {"val": n.meta.get("val"), META_KEY: NodeInfo()}
        for n in own:
            for a in n.all_input_nodes:
                if shared(a) and a not in env:
                    env[a] = graph.get_attr(a.target)
                    env[a].meta = dict(a.meta)
                    env[a].meta[META_KEY] = dataclasses.replace(a.meta[META_KEY], layer=n.meta[META_KEY].layer - first)
                    attrs[a.target] = fetch_attr(gm, a.target)
            if n.op == "get_attr":
                attrs[n.target] = fetch_attr(gm, n.target)
            new = graph.node_copy(n, lambda x: env[x])
            new.meta = dict(n.meta)
            new.meta[META_KEY] = dataclasses.replace(n.meta[META_KEY], layer=n.meta[META_KEY].layer - first)
            env[n] = new
        if k == last_stage:
            out = graph.output(torch.fx.node.map_arg(out_node.args[0], lambda x: env[x]))
            out.meta = dict(out_node.meta)
        else:
            values = []
            for n in sent:
                v = env[n]
                if n.op == "get_attr" and n in own_set:
                    # NOTE: a tied weight leaves as a copy (one per micro-batch), not as the parameter
                    # itself: later rewrites may free or re-gather a parameter buffer (ZeRO-3) while
                    # the p2p send still reads it, and no pass must see the graph output as its user.
                    v = graph.call_function(torch.clone, (v,))
                    v.meta = {"val": n.meta.get("val"),
                              META_KEY: NodeInfo(layer=n.meta[META_KEY].layer - first)}
                values.append(v)
            out = graph.output(tuple(values))
        out.meta.setdefault(META_KEY, NodeInfo())   # passes read the layer of every user
        stage_gm = torch.fx.GraphModule(attrs, graph, class_name=f"Stage{k}")
        records = [dataclasses.replace(copy.copy(rec), index=rec.index - first,
                                       consumes_from=[c - first for c in rec.consumes_from])
                   for rec in info.layers[first:last + 1]]
        stage_gm.meta[META_KEY] = dataclasses.replace(
            info, layers=records, input_names=[p.name for p in local] + [n.name for n in received],
            stage=StageInfo(k, len(self.stages), first, last, local_inputs=[placeholders.index(p) for p in local],
                            received=[crossing(n) for n in received], sent=[crossing(n) for n in sent]))
        return PassResult(stage_gm, True)


def stage_split(gm: torch.fx.GraphModule, stages, index: int) -> torch.fx.GraphModule:
    """Run :class:`StageSplitPass` and return stage ``index``'s GraphModule (``meta["galvatron"].stage``
    holds its :class:`~galvatron_fx.ir.StageInfo`)."""
    return StageSplitPass(stages, index)(gm).graph_module


def cross_stage_params(gm: torch.fx.GraphModule, stages) -> dict[str, list[int]]:
    """Parameters read by layers of more than one stage (tied weights): target ->
    the sorted global indices of the layers reading it (the first one owns it)."""
    stage_of = {i: s for s, (a, b) in enumerate(stages) for i in range(a, b + 1)}
    out = {}
    for n in gm.graph.nodes:
        if is_param_node(n):
            layers = sorted({u.meta[META_KEY].layer for u in n.users if u.op != "output"}
                            | {n.meta[META_KEY].layer})
            if len({stage_of[i] for i in layers}) > 1:
                out[n.target] = layers
    return out


def stage_info(stage_gm: torch.fx.GraphModule) -> StageInfo:
    return stage_gm.meta[META_KEY].stage
