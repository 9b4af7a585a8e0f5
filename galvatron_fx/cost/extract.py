"""One layer of a captured graph as a standalone GraphModule, with its tensor-parallel roles.

:func:`extract_layer` copies the nodes of layer ``i`` into a new graph whose placeholders are, in
order, the parameters and buffers it reads (its own and tied ones owned by other layers), the
activations it reads from earlier layers and the graph inputs it reads; its outputs are the values
later layers (or the graph output) consume.

:func:`roles_from_analysis` marks which of its ops and parameters tensor parallelism shards, from
the tensor-parallel pass's own analysis (:func:`galvatron_fx.sharding.analyze`), so the
cost model prices exactly what the rewrite does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..ir import META_KEY, LayerRecord


@dataclass(frozen=True)
class LayerInput:
    """One placeholder of an extracted layer.

    ``kind``: ``"param"`` | ``"buffer"`` | ``"activation"`` | ``"graph_input"``; ``owned``: a param or
    buffer whose memory this layer holds (False for a tied weight owned by an earlier layer);
    ``batched``: dim 0 is the batch dimension; ``requires_grad``: gets a gradient in training.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    owned: bool = False
    batched: bool = False
    requires_grad: bool = False
    fqn: str = ""


@dataclass
class LayerGraph:
    """A layer extracted by :func:`extract_layer` (see the module docstring)."""

    index: int
    signature: str
    gm: torch.fx.GraphModule
    inputs: list[LayerInput]
    outputs: list[str]
    batch: int                                   # batch size the graph was captured with
    roles: dict[str, str] = field(default_factory=dict)        # node -> column|row|vocab
    gathered: set = field(default_factory=set)                 # consumers the rewrite feeds a gathered (whole) input
    out_sharded: dict[str, bool] = field(default_factory=dict)  # node -> output sharded under TP
    in_sharded: dict[str, bool] = field(default_factory=dict)   # node -> some activation input sharded
    param_shard_dim: dict[str, int | None] = field(default_factory=dict)  # placeholder -> TP-split dim


def capture_batch(gm: torch.fx.GraphModule) -> int:
    """Batch size of the capture: dim 0 of the first graph input with at least one dimension."""
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() >= 1:
                return int(val.shape[0])
    return 1


def needs_grad(gm: torch.fx.GraphModule) -> set[str]:
    """Names of nodes whose value depends on a trainable parameter (so gets a gradient)."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        info = n.meta.get(META_KEY)
        val = n.meta.get("val")
        if n.op == "get_attr":
            if info is not None and info.param is not None and info.param.is_param and info.param.requires_grad:
                out.add(n.name)
        elif n.op in ("call_function", "call_method", "call_module"):
            floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
            if floating and any(a.name in out for a in n.all_input_nodes):
                out.add(n.name)
    return out


def extract_layer(gm: torch.fx.GraphModule, rec: LayerRecord, grad_nodes: set[str] | None = None,
                  batch: int | None = None) -> LayerGraph:
    """Layer ``rec`` of ``gm`` as a standalone :class:`LayerGraph` (see the module docstring)."""
    grad_nodes = needs_grad(gm) if grad_nodes is None else grad_nodes
    batch = capture_batch(gm) if batch is None else batch
    by_name = {n.name: n for n in gm.graph.nodes}
    own = [by_name[name] for name in rec.nodes]
    compute = [n for n in own if n.op not in ("get_attr", "placeholder")]
    own_set = set(compute)
    external: list[torch.fx.Node] = []
    for n in compute:
        for a in n.all_input_nodes:
            if a not in own_set and a not in external:
                external.append(a)
    order = {"get_attr": 0, "call_function": 1, "call_method": 1, "call_module": 1, "placeholder": 2}
    external.sort(key=lambda a: order[a.op])

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[LayerInput] = []
    for a in external:
        val = a.meta["val"]
        ph = graph.placeholder(a.name)
        ph.meta["val"] = val
        info = a.meta.get(META_KEY)
        if a.op == "get_attr":
            p = info.param if info is not None else None
            kind = "param" if p is not None and p.is_param else "buffer"
            inputs.append(LayerInput(a.name, kind, tuple(val.shape), val.dtype, val.device,
                                     owned=info is not None and info.layer == rec.index,
                                     requires_grad=a.name in grad_nodes, fqn=p.fqn if p else str(a.target)))
        else:
            kind = "graph_input" if a.op == "placeholder" else "activation"
            batched = val.dim() >= 1 and int(val.shape[0]) == batch
            inputs.append(LayerInput(a.name, kind, tuple(val.shape), val.dtype, val.device, batched=batched,
                                     requires_grad=a.name in grad_nodes))
        env[a] = ph
    for n in compute:
        env[n] = graph.node_copy(n, lambda x: env[x])
        env[n].meta = {k: v for k, v in n.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
    outs = [n for n in compute
            if any(u not in own_set for u in n.users) and isinstance(n.meta.get("val"), torch.Tensor)]
    graph.output(tuple(env[n] for n in outs))
    layer = LayerGraph(rec.index, rec.signature, torch.fx.GraphModule(torch.nn.Module(), graph), inputs,
                       [n.name for n in outs], batch)
    roles_from_analysis(layer, None)  # replicated until the cost model applies the TP analysis
    return layer


def roles_from_analysis(layer: LayerGraph, analysis) -> None:
    """Set ``layer``'s TP roles from the tensor-parallel pass's own analysis of the layer
    (:class:`galvatron_fx.sharding.LayerTP`, node names shared with ``layer.gm``), or
    mark everything replicated when ``analysis`` is ``None`` (the layer cannot take TP). This is
    what the cost model uses, so it prices exactly what the rewrite will do."""
    from ..sharding import TP, Sharded

    def sharded(state) -> bool:
        states = state if isinstance(state, (tuple, list)) else (state,)
        return any(isinstance(x, Sharded) and x.kind == TP for x in states)

    layer.roles.clear()
    layer.out_sharded.clear()
    layer.in_sharded.clear()
    layer.gathered = set()
    layer.param_shard_dim = {i.name: None for i in layer.inputs if i.kind == "param"}
    if analysis is None:
        return
    for kind, names in (("column", analysis.column), ("row", analysis.row), ("vocab", analysis.vocab_embeddings)):
        for name in names:
            layer.roles[name] = kind
    for name, state in analysis.states.items():
        layer.out_sharded[name] = sharded(state)
    for n in layer.gm.graph.nodes:
        if n.op not in ("placeholder", "output"):
            layer.in_sharded[n.name] = any(layer.out_sharded.get(a.name, False) for a in n.all_input_nodes)
    for node_name, shard in analysis.param_shards.items():
        if node_name in layer.param_shard_dim:
            layer.param_shard_dim[node_name] = shard.dim
    # a sharded value the rewrite gathers before a consumer (the logits before the loss) reaches
    # that consumer whole: what the consumer saves for backward is not sharded
    layer.gathered = {consumer for (consumer, _producer), op in analysis.conversions.items()
                      if op and op[0] == "gather"}
