"""One layer of a captured graph as a standalone GraphModule, with its tensor-parallel roles.

:func:`extract_layer` copies the nodes of layer ``i`` into a new graph whose placeholders are, in
order, the parameters and buffers it reads (its own and tied ones owned by other layers), the
activations it reads from earlier layers and the graph inputs it reads; its outputs are the values
later layers (or the graph output) consume.

:func:`tp_roles` decides, from the graph alone, what Megatron-style tensor parallelism shards:

* a ``linear`` (or ``x @ W``) whose weight is a >=2-D parameter is **column-parallel** when its
  activation input is replicated (weight split on the output dim, bias split, output sharded) and
  **row-parallel** when its input is sharded (weight split on the input dim, bias whole, output
  replicated after an all-reduce);
* an ``embedding`` with a 2-D weight is **vocab-parallel** (weight split on rows, output all-reduced);
* any other op is sharded when one of its activation inputs is (attention between column- and
  row-parallel linears runs on ``heads / tp`` heads), else replicated (norms, residual adds).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F

from ..ir import META_KEY, LayerRecord

LINEAR_TARGETS = {F.linear, torch._C._nn.linear, torch.ops.aten.linear.default, "linear"}
MATMUL_TARGETS = {torch.matmul, operator.matmul, "matmul", "__matmul__"}
EMBEDDING_TARGETS = {F.embedding, torch.ops.aten.embedding.default, "embedding"}


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
    tp_roles(layer)
    return layer


def roles_from_analysis(layer: LayerGraph, analysis) -> None:
    """Set ``layer``'s TP roles from the tensor-parallel pass's own analysis of the layer
    (:class:`galvatron_fx.passes.tp_patterns.LayerTP`, node names shared with ``layer.gm``), or
    mark everything replicated when ``analysis`` is ``None`` (the layer cannot take TP). This is
    what the cost model uses, so it prices exactly what the rewrite will do."""
    from ..passes.tp_patterns import TP, Sharded

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


def _param_arg(node: torch.fx.Node, params: set[str], pos: int, key: str) -> torch.fx.Node | None:
    arg = node.args[pos] if len(node.args) > pos else node.kwargs.get(key)
    return arg if isinstance(arg, torch.fx.Node) and arg.name in params else None


def _ndim(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


NORM_TARGETS = {F.layer_norm, torch.layer_norm, F.group_norm, F.batch_norm, "layer_norm", "group_norm",
                getattr(F, "rms_norm", F.layer_norm)}
REDUCE_TARGETS = {torch.mean, torch.sum, torch.var, torch.std, torch.amax, "mean", "sum", "var", "std", "amax"}


def _reduces_last_dim(node: torch.fx.Node) -> bool:
    """A norm, or a reduction over the last dim: it cannot run on a hidden-sharded tensor."""
    if node.target in NORM_TARGETS:
        return True
    if node.target in REDUCE_TARGETS:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return any(d == -1 or (isinstance(d, int) and d == _ndim(node.args[0]) - 1) for d in dims)
    return False


def tp_roles(layer: LayerGraph) -> None:
    """Fill ``layer.roles``, ``out_sharded``, ``in_sharded`` and ``param_shard_dim`` (module docstring).

    A column-parallel candidate whose sharded outputs reach a norm or a last-dim reduction before
    a row-parallel op (e.g. BERT's MLM head: dense, GELU, LayerNorm) stays replicated; the
    propagation is repeated until no such conflict is left.
    """
    replicated: set[str] = set()
    for _ in range(len(layer.gm.graph.nodes) + 1):
        origin = _propagate(layer, replicated)
        conflicts = {o for n in layer.gm.graph.nodes
                     if layer.in_sharded.get(n.name) and _reduces_last_dim(n) for o in origin[n.name]}
        if not conflicts:
            return
        replicated |= conflicts


def _propagate(layer: LayerGraph, replicated: set[str]) -> dict[str, set[str]]:
    """One pass of the propagation; returns, per node, the column-parallel ops its sharding comes from."""
    params = {i.name for i in layer.inputs if i.kind == "param"}
    graph_inputs = {i.name for i in layer.inputs if i.kind == "graph_input"}
    shard_dim: dict[str, int | None] = {p: None for p in params}
    sharded: dict[str, bool] = {}
    origin: dict[str, set[str]] = {}
    layer.roles.clear()
    layer.in_sharded.clear()
    layer.out_sharded.clear()
    for n in layer.gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            sharded[n.name], origin[n.name] = False, set()
            continue
        acts = [a for a in n.all_input_nodes if a.name not in params]
        in_sh = any(sharded[a.name] for a in acts)
        origin[n.name] = set().union(*(origin[a.name] for a in acts)) if acts else set()
        layer.in_sharded[n.name] = in_sh
        out_sh = in_sh
        role = None
        if n.target in LINEAR_TARGETS or n.target in MATMUL_TARGETS:
            is_linear = n.target in LINEAR_TARGETS
            weight = _param_arg(n, params, 1, "weight" if is_linear else "other")
            if weight is not None and _ndim(weight) >= 2 and (in_sh or n.name not in replicated):
                role = "row" if in_sh else "column"
                k = _ndim(weight)
                if is_linear:
                    shard_dim[weight.name] = k - 1 if role == "row" else 0
                    bias = _param_arg(n, params, 2, "bias")
                    if bias is not None and role == "column":
                        shard_dim[bias.name] = 0
                else:
                    shard_dim[weight.name] = k - 2 if role == "row" else k - 1
                out_sh = role == "column"
                origin[n.name] = {n.name} if role == "column" else set()
        elif n.target in EMBEDDING_TARGETS:
            weight = _param_arg(n, params, 1, "weight")
            index = n.args[0] if n.args else n.kwargs.get("input")
            # NOTE: only token embeddings (indices straight from the data) are vocab-parallel;
            # position tables indexed by an arange stay replicated, as in Megatron.
            if weight is not None and _ndim(weight) == 2 and getattr(index, "name", None) in graph_inputs:
                role = "vocab"
                shard_dim[weight.name] = 0
                out_sh = False
        if role is not None:
            layer.roles[n.name] = role
        if not out_sh:
            origin[n.name] = set()
        sharded[n.name] = out_sh
        layer.out_sharded[n.name] = out_sh
    layer.param_shard_dim = shard_dim
    return origin
