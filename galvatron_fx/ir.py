"""The metadata galvatron_fx attaches to captured graphs.

Everything lives under one namespaced key, :data:`META_KEY` (``"galvatron"``):

* ``node.meta["galvatron"]`` is a :class:`NodeInfo`: the node's layer and module path, and for
  parameter/buffer nodes a :class:`ParamInfo` (fully qualified name in the original module, shape,
  dtype, parameter or buffer).
* ``gm.meta["galvatron"]`` is a :class:`GraphInfo`: how the graph was captured, its inputs, its
  ordered :class:`LayerRecord` list, a model fingerprint and, on a pipeline stage's graph, the
  :class:`StageInfo` of the cut.

Shapes of activations are in ``node.meta["val"]`` (fake tensors), torch's own convention.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Short dtype names (as in plans, clusters and the cost model) -> torch dtypes."""

META_KEY = "galvatron"

LAYER_KINDS = ("pre", "block", "post", "other")


@dataclass(frozen=True)
class ParamInfo:
    """A parameter or buffer of the original module, as seen by one graph node.

    ``fqn`` is the fully qualified name in the original module (the first one when tied);
    ``aliases`` lists every other name the same tensor has there (tied weights).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    requires_grad: bool
    aliases: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ShardInfo:
    """Set on the get_attr node of a tensor-parallel parameter shard (``ParamInfo`` keeps the full shape).

    Along ``dim`` the full tensor is a sequence of ``blocks`` (global sizes; one block unless a fused
    projection such as q/k/v is sharded per block); rank ``r`` of the ``tp`` ranks holds chunk ``r``
    of every block, concatenated. :func:`galvatron_fx.sharding.unshard` reassembles.

    ``inner``: a further split of that chunk (expert tensor parallelism: a dim-0 shard of ``[E, ...]``
    expert weights over the EP group, ``inner`` each expert's TP shard); the parameter then spans
    :attr:`parts` ranks, ordered outer-major (rank ``r * inner.parts + i`` holds chunk ``i`` of
    outer chunk ``r``).
    """

    dim: int
    tp: int
    rank: int
    blocks: tuple[int, ...]
    inner: ShardInfo | None = None

    @property
    def parts(self) -> int:
        """How many ranks hold distinct pieces: ``tp`` times the inner split's."""
        return self.tp * (self.inner.parts if self.inner is not None else 1)


@dataclass
class NodeInfo:
    """Per-node record: which layer the node belongs to and where it came from."""

    module_path: str = ""          # innermost module of the original model ('' = top level / unknown)
    layer: int | None = None       # index into GraphInfo.layers
    param: ParamInfo | None = None  # set on get_attr nodes of parameters and buffers
    input_index: int | None = None  # set on placeholders: position among the graph inputs
    shard: ShardInfo | None = None  # set on get_attr nodes of tensor-parallel parameter shards
    # symbolic batch (galvatron_fx/batch_symbol.py): a tensor's dims that are ``k x batch`` as
    # ``((dim, k), ...)``; a size (int) value that is ``k x batch``: ``k``
    batch_dims: tuple = ()
    batch_factor: int | None = None


@dataclass
class LayerRecord:
    """One layer of the captured model, in execution order.

    ``kind`` is "pre" (embeddings, everything before the first block), "block" (an element of a
    repeated block list), "post" (final norm, head, loss) or "other" (code between block lists,
    e.g. Swin's patch merging or T5's encoder final norm). Structurally identical layers share
    ``signature``. ``consumes_from`` lists the indices of earlier layers whose outputs this layer
    reads: usually just the previous one, but e.g. every T5 decoder block reads the encoder output.
    """

    index: int
    name: str
    kind: str
    signature: str
    nodes: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)     # activation nodes from other layers
    consumes_from: list[int] = field(default_factory=list)
    graph_inputs: list[str] = field(default_factory=list)  # placeholders read by this layer
    batch_coupled: list[str] = field(default_factory=list)  # ops mixing samples (batch_symbol.coupling)

    def __repr__(self) -> str:
        return (f"LayerRecord({self.index}, {self.name!r}, kind={self.kind!r}, "
                f"signature={self.signature[:8]!r}, nodes={len(self.nodes)}, params={len(self.params)})")


@dataclass(frozen=True)
class CrossingValue:
    """A value crossing a stage boundary (received by one stage, sent by the previous one).

    ``name``: the producing node's name. ``shape``/``dtype``: from the capture (``shape[0]`` is
    the captured batch when ``batched``). ``batched``: computed from a graph input and carrying
    the batch on dim 0 (activations, masks); else replicated (a tied weight, T5's position bias).
    ``requires_grad``: floating point and computed from a trainable parameter. ``producer_layer``:
    global index of the layer computing it. ``rows``: dim-0 rows per sample of a batched value (1;
    ``heads`` for Bloom's ALiBi ``[batch * heads, 1, S]``: ``NodeInfo.batch_dims`` of a symbolic
    batch), sample-major, so a contiguous slice of dim 0 is a slice of the batch.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    batched: bool
    requires_grad: bool
    producer_layer: int
    rows: int = 1


@dataclass
class StageInfo:
    """How stage ``index`` (layers ``first..last``, inclusive, global indices) was cut out."""

    index: int
    num_stages: int
    first: int
    last: int
    local_inputs: list[int] = field(default_factory=list)   # positions among the graph inputs
    received: list[CrossingValue] = field(default_factory=list)
    sent: list[CrossingValue] = field(default_factory=list)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass
class GraphInfo:
    """Graph-level record stored in ``gm.meta["galvatron"]``."""

    method: str                                   # "fx" | "dynamo" | "export" | "graph"
    input_names: list[str] = field(default_factory=list)
    layers: list[LayerRecord] = field(default_factory=list)
    grouping: str = ""                            # "modules" | "cut-points" | "single"
    fingerprint: str = ""
    stage: StageInfo | None = None                # set on a pipeline stage's graph (passes/stage_split.py)
    baked_inputs: dict = field(default_factory=dict)  # non-tensor inputs given at capture (return_loss=True)
    model_ref: object = None                      # weakref to the captured model (meta-device initialisation)
    symbolic_batch: bool = False                  # batch-dependent shapes are computed from the inputs
    static_batch_reason: str = ""                 # why the batch is baked in instead (capture's note)

    def layer_by_name(self, name: str) -> LayerRecord:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r}; layers are {[lay.name for lay in self.layers]}")


def layer_module_name(index: int) -> str:
    """The submodule name of layer ``index`` in a split graph (``layers_3``)."""
    return f"layers_{index}"


def node_info(node: torch.fx.Node) -> NodeInfo:
    """Return (creating if needed) the galvatron record of ``node``."""
    info = node.meta.get(META_KEY)
    if info is None:
        info = node.meta[META_KEY] = NodeInfo()
    return info


def graph_info(gm: torch.fx.GraphModule) -> GraphInfo | None:
    return gm.meta.get(META_KEY)


def tensor_meta(node: torch.fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape, dtype) of a node's tensor value from ``node.meta['val']``, or None."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape), val.dtype
    return None


def carries_batch(node: torch.fx.Node) -> bool:
    """Whether a node computed from batched inputs carries the batch itself: tensors and sizes
    derived from them do; ``x.device`` / ``x.dtype`` do not (``torch.arange(S, device=x.device)``
    is the same on every rank). Uses ``meta['val']`` when present, else the ``getattr`` target."""
    val = node.meta.get("val")
    if isinstance(val, (torch.device, torch.dtype)):
        return False
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] not in ("device", "dtype", "is_cuda")
    return True


def batch_size_of(values) -> int | None:
    """Dim 0 of the first tensor of ``values`` with at least one dim (the batch convention: batch
    on dim 0), or ``None`` when there is none."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    return None


def graph_batch_size(gm: torch.fx.GraphModule) -> int | None:
    """The batch a graph was captured with: dim 0 of its first batched input (``meta["val"]``)."""
    return batch_size_of(n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder")


def short_hash(*parts: object, n: int = 16) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return h.hexdigest()[:n]
