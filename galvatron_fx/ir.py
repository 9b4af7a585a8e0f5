"""The metadata galvatron_fx attaches to captured graphs.

Everything lives under one namespaced key, :data:`META_KEY` (``"galvatron"``):

* ``node.meta["galvatron"]`` is a :class:`NodeInfo`: the node's layer and module path, and for
  parameter/buffer nodes a :class:`ParamInfo` (fully qualified name in the original module, shape,
  dtype, parameter or buffer).
* ``gm.meta["galvatron"]`` is a :class:`GraphInfo`: how the graph was captured, its inputs, its
  ordered :class:`LayerRecord` list and a model fingerprint.

Shapes of activations are in ``node.meta["val"]`` (fake tensors), torch's own convention.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx

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
    of every block, concatenated. :func:`galvatron_fx.passes.tensor_parallel.unshard` reassembles.
    """

    dim: int
    tp: int
    rank: int
    blocks: tuple[int, ...]


@dataclass
class NodeInfo:
    """Per-node record: which layer the node belongs to and where it came from."""

    module_path: str = ""          # innermost module of the original model ('' = top level / unknown)
    layer: int | None = None       # index into GraphInfo.layers
    param: ParamInfo | None = None  # set on get_attr nodes of parameters and buffers
    input_index: int | None = None  # set on placeholders: position among the graph inputs
    shard: ShardInfo | None = None  # set on get_attr nodes of tensor-parallel parameter shards


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

    def __repr__(self) -> str:
        return (f"LayerRecord({self.index}, {self.name!r}, kind={self.kind!r}, "
                f"signature={self.signature[:8]!r}, nodes={len(self.nodes)}, params={len(self.params)})")


@dataclass
class GraphInfo:
    """Graph-level record stored in ``gm.meta["galvatron"]``."""

    method: str                                   # "fx" | "dynamo" | "export" | "graph"
    input_names: list[str] = field(default_factory=list)
    layers: list[LayerRecord] = field(default_factory=list)
    grouping: str = ""                            # "modules" | "cut-points" | "single"
    fingerprint: str = ""

    def layer_by_name(self, name: str) -> LayerRecord:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r}; layers are {[lay.name for lay in self.layers]}")


def node_info(node: torch.fx.Node) -> NodeInfo:
    """Return (creating if needed) the galvatron record of ``node``."""
    info = node.meta.get(META_KEY)
    if info is None:
        info = node.meta[META_KEY] = NodeInfo()
    return info


def graph_info(gm: torch.fx.GraphModule) -> GraphInfo | None:
    return gm.meta.get(META_KEY)


def param_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes that hold parameters or buffers of the original model."""
    return [n for n in gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].param is not None]


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


def short_hash(*parts: object, n: int = 16) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return h.hexdigest()[:n]
