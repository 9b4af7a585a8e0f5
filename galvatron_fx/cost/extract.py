"""One layer of a captured graph as a standalone GraphModule, with its tensor-parallel roles.

:func:`extract_layer` copies the nodes of layer ``i`` into a new graph whose placeholders are, in
order, the parameters and buffers it reads (its own and tied ones owned by other layers), the
activations it reads from earlier layers and the graph inputs it reads; its outputs are the values
later layers (or the graph output) consume. Non-tensor attributes the layer reads (the forward and
backward bodies of a dynamo ``autograd_function_apply``) stay ``get_attr`` nodes of the new graph.

:meth:`LayerGraph.on_device` is the layer ready to run on one device: the device constants the
front end baked in (``arange(..., device=meta)``, ``.to(meta)``, ``_to_copy(device=...)``) point to
that device and ``_assert_tensor_metadata`` checks are dropped, so a layer of a model captured on
the meta device runs on CPU fake tensors (and a profiled layer on the local accelerator).

:func:`roles_from_analysis` marks which of its ops and parameters tensor parallelism shards, from
the tensor-parallel pass's own analysis (:func:`galvatron_fx.sharding.analyze`), so the
cost model prices exactly what the rewrite does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.node import map_aggregate

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
    roles: dict[str, str] = field(default_factory=dict)        # node -> column|row|vocab|vocab_loss
    gathered: set = field(default_factory=set)                 # consumers the rewrite feeds a gathered (whole) input
    out_sharded: dict[str, bool] = field(default_factory=dict)  # node -> output sharded under TP
    in_sharded: dict[str, bool] = field(default_factory=dict)   # node -> some activation input sharded
    param_shard_dim: dict[str, int | None] = field(default_factory=dict)  # placeholder -> TP-split dim
    expert_nodes: frozenset = frozenset()                      # nodes of its experts blocks (sharding/experts.py)
    _on: dict = field(default_factory=dict, repr=False)     # device -> retargeted copy of gm

    @property
    def device(self) -> torch.device:
        """Where the layer runs by default: its inputs' device (the first one not on the CPU), the
        CPU for a model on the meta device."""
        return home_device(i.device for i in self.inputs)

    def on_device(self, device: torch.device | str | None = None) -> torch.fx.GraphModule:
        """``gm`` with its baked device constants retargeted to ``device`` (default :attr:`device`)
        and its metadata asserts dropped (see the module docstring); cached per device."""
        device = torch.device(device) if device is not None else self.device
        if device not in self._on:
            self._on[device] = retarget_devices(self.gm, device)
        return self._on[device]


def home_device(devices) -> torch.device:
    """The device a layer with inputs on ``devices`` runs on: the first accelerator among them,
    else the CPU (meta tensors are measured on CPU fake tensors)."""
    for d in devices:
        if d.type not in ("cpu", "meta"):
            return d
    return torch.device("cpu")


ASSERT_OPS = (torch.ops.aten._assert_tensor_metadata.default,)
"""Metadata checks :func:`retarget_devices` drops (they name the capture's device and dtypes)."""
CPU_FLOAT_ONLY = (torch.histc, torch.ops.aten.histc.default)
"""Ops whose CPU kernels take only floating inputs: a graph captured for another device may feed
them integers (transformers' MoE load-balancing loss counts experts with an int32 ``histc`` off
the CPU); :func:`retarget_devices` casts to float32 and back for a CPU run."""


def _is_device_string(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return False
    return True


def retarget_devices(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A copy of ``gm`` (and of the graph modules it holds as attributes) where every baked device
    constant names ``device`` and every ``_assert_tensor_metadata`` check is gone."""
    device = torch.device(device)
    graph = copy.deepcopy(gm.graph)
    root: dict[str, object] = {}

    def swap(v):
        return device if isinstance(v, torch.device) else v

    for n in list(graph.nodes):
        if n.op == "call_function" and n.target in ASSERT_OPS and not n.users:
            graph.erase_node(n)
            continue
        if n.op in ("call_function", "call_method"):
            n.args = map_aggregate(n.args, swap)
            kwargs = dict(map_aggregate(n.kwargs, swap))
            if _is_device_string(kwargs.get("device")):
                kwargs["device"] = device
            n.kwargs = kwargs
            if n.op == "call_method" and n.target == "to":
                n.args = tuple(device if i and _is_device_string(a) else a for i, a in enumerate(n.args))
            elif n.op == "call_method" and n.target in ("cpu", "cuda"):
                n.target, n.args, n.kwargs = "to", (n.args[0], device), {}
            if device.type == "cpu" and n.target in CPU_FLOAT_ONLY:
                _through_float(graph, n)
        elif n.op in ("get_attr", "call_module"):
            value = _fetch(gm, n.target)
            root[n.target] = retarget_devices(value, device) if isinstance(value, torch.fx.GraphModule) else value
    return torch.fx.GraphModule(root, graph)


def _through_float(graph: torch.fx.Graph, n: torch.fx.Node) -> None:
    """Run ``n`` on a float32 copy of its integer first input and cast its result back."""
    x = n.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point:
        return
    cast = torch.ops.aten._to_copy.default
    with graph.inserting_before(n):
        n.update_arg(0, graph.call_function(cast, (x,), {"dtype": torch.float32}))
    with graph.inserting_after(n):
        back = graph.call_function(cast, (n,), {"dtype": val.dtype})
    n.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def _fetch(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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
    attrs: list[torch.fx.Node] = []  # non-tensor attributes (autograd_function_apply bodies)
    for n in compute:
        for a in n.all_input_nodes:
            if a in own_set or a in external or a in attrs:
                continue
            (external if a.op != "get_attr" or isinstance(a.meta.get("val"), torch.Tensor) else attrs).append(a)
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
    root = {}
    for a in attrs:
        env[a] = graph.get_attr(a.target)
        root[a.target] = _fetch(gm, a.target)
    for n in compute:
        env[n] = graph.node_copy(n, lambda x: env[x])
        env[n].meta = {k: v for k, v in n.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
    outs = [n for n in compute
            if any(u not in own_set for u in n.users) and isinstance(n.meta.get("val"), torch.Tensor)]
    graph.output(tuple(env[n] for n in outs))
    layer = LayerGraph(rec.index, rec.signature, torch.fx.GraphModule(root, graph), inputs,
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
    for kind, names in (("column", analysis.column), ("row", analysis.row), ("vocab", analysis.vocab_embeddings),
                        ("vocab_loss", analysis.vocab_losses)):
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
    # a sharded value the rewrite gathers before a consumer (logits before a loss without a shard
    # rule, e.g. class weights) reaches that consumer whole: what it saves for backward is not
    # sharded. NOTE: a vocab-parallel cross entropy (role vocab_loss) reads sharded logits, so what
    # it saves (torch's log-softmax; the rewrite's softmax, the same size) is sharded
    layer.gathered = {consumer for (consumer, _producer), op in analysis.conversions.items()
                      if op and op[0] == "gather"}
