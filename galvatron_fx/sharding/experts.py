"""Mixture-of-experts blocks of a captured graph: the routed experts, their inputs and their output.

An *experts block* is the code of one module holding grouped expert weights (3-D parameters
``[E, ...]`` read by ``grouped_mm``: transformers 5.x ``MixtralExperts``, ``Qwen2MoeExperts``,
``DeepseekV2Experts``...). The block is every node whose module path is that module (or inside it:
``act_fn``); its external tensor inputs are exactly three:

* ``x``: the tokens ``[T, H]`` (floating point, two dims),
* ``index``: the router's top-k expert ids ``[T, k]`` (integer),
* ``weights``: the router's top-k weights ``[T, k]`` (floating point, the shape of ``index``),

plus sizes computed outside (the batch symbol), and its output is one tensor ``[T, H]``: for
every token, the sum over its ``k`` experts of weight x expert(token). The router (the gate linear,
softmax / sigmoid, top-k) and shared experts (Qwen2-MoE, DeepSeek) lie outside the block: they are
dense layers. Expert parallelism (:mod:`galvatron_fx.runtime.experts`) runs the block on other
ranks' tokens with this rank's experts only; the cost model reads ``params`` (the expert weights)
and ``top_k``.

A loop over an ``nn.ModuleList`` of expert modules (data-dependent control flow) does not capture
as one graph; :func:`moe_blocks` finds none there and ``ep > 1`` is refused with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..ir import META_KEY
from .operands import GROUPED_MM, weight_param
from .state import is_param, op_name, tensor_val


@dataclass
class MoEBlock:
    """One experts block (see the module docstring). Node lists are in graph order."""

    path: str                        # module path of the experts module
    nodes: list[torch.fx.Node]       # the block's nodes, parameters excluded
    params: list[torch.fx.Node]      # the expert weights' get_attr nodes ([E, ...] parameters)
    grouped: list[torch.fx.Node]     # its grouped matmuls
    x: torch.fx.Node
    index: torch.fx.Node
    weights: torch.fx.Node
    sizes: list[torch.fx.Node]       # other external inputs (sizes derived from the batch)
    output: torch.fx.Node
    num_experts: int
    top_k: int

    def routers(self, depth: int = 8) -> list[torch.fx.Node]:
        """The linears computing the router's logits (within ``depth`` ops of the top-k outputs)."""
        out, frontier, seen = [], [self.index, self.weights], set()
        for _ in range(depth):
            nxt = []
            for n in frontier:
                if n in seen or not isinstance(n, torch.fx.Node):
                    continue
                seen.add(n)
                if op_name(n) in ("linear", "matmul", "mm", "addmm"):
                    out.append(n)
                else:
                    nxt.extend(n.all_input_nodes)
            frontier = nxt
        return out

    @property
    def inputs(self) -> list[torch.fx.Node]:
        """The block's inputs in the order :mod:`galvatron_fx.runtime.experts` passes them."""
        return [self.x, self.index, self.weights, *self.params, *self.sizes]

    def compactable(self) -> bool:
        """Whether the block's token count enters only through its ``sizes`` inputs, each a multiple
        of it (a symbolic batch): it may then run on any number of tokens."""
        def info(n):
            return n.meta.get(META_KEY)

        kx = dict(getattr(info(self.x), "batch_dims", ()) or ()).get(0)
        return kx is not None and all(
            (f := getattr(info(s), "batch_factor", None)) is not None and f % kx == 0 for s in self.sizes)


class NotAnExpertsBlock(Exception):
    """Why a module with grouped expert weights cannot run expert-parallel."""


def _path(node: torch.fx.Node) -> str:
    """The module a node belongs to (a parameter: its owner, which export does not record)."""
    info = node.meta.get(META_KEY)
    if is_param(node):
        return info.param.fqn.rpartition(".")[0]
    return getattr(info, "module_path", "") or ""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def expert_modules(nodes) -> dict[str, int]:
    """Module path -> number of experts, for every module whose 3-D parameter a grouped matmul reads."""
    out: dict[str, int] = {}
    for n in nodes:
        if n.op != "call_function" or op_name(n) not in GROUPED_MM or len(n.args) < 2:
            continue
        found = weight_param(n.args[1])
        if found is not None and tensor_val(found[0]).dim() == 3:
            out.setdefault(_path(found[0]), int(tensor_val(found[0]).shape[0]))
    return out


def moe_blocks(graph: torch.fx.Graph, nodes=None) -> list[MoEBlock | NotAnExpertsBlock]:
    """The experts blocks among ``nodes`` (default: the whole graph), in graph order; a module with
    grouped expert weights whose code does not have the expected shape gives a
    :class:`NotAnExpertsBlock` saying why instead."""
    nodes = list(graph.nodes) if nodes is None else list(nodes)
    return [_block(nodes, path, e) for path, e in expert_modules(nodes).items()]


def _block(nodes, path: str, num_experts: int) -> MoEBlock | NotAnExpertsBlock:
    mine = [n for n in nodes if n.op != "placeholder" and _inside(_path(n), path)]
    params = [n for n in mine if is_param(n)]
    body = [n for n in mine if not is_param(n)]
    inside = set(params)
    for n in body:   # sizes computed from outside values only (``x.size(0) * 16``) stay outside
        if tensor_val(n) is not None or any(a in inside for a in n.all_input_nodes) \
                or not any(isinstance(a, torch.fx.Node) for a in n.all_input_nodes):
            inside.add(n)
    body = [n for n in body if n in inside]
    external: list[torch.fx.Node] = []
    for n in body:
        for a in n.all_input_nodes:
            if a not in inside and a not in external:
                external.append(a)
    leaving = [n for n in body if any(u not in inside for u in n.users)]
    if len(leaving) != 1:
        return NotAnExpertsBlock(f"{path}: {len(leaving)} values leave the experts module, expected one "
                                 f"(the combined tokens)")
    tensors = [a for a in external if tensor_val(a) is not None]
    sizes = [a for a in external if tensor_val(a) is None]
    ints = [a for a in tensors if not tensor_val(a).is_floating_point()]
    floats = [a for a in tensors if tensor_val(a).is_floating_point()]
    if len(ints) != 1 or len(floats) != 2:
        return NotAnExpertsBlock(f"{path}: its inputs are {[a.name for a in tensors]}, expected tokens, "
                                 f"top-k expert ids and top-k weights")
    index = ints[0]
    k_shape = tuple(tensor_val(index).shape)
    weights = [a for a in floats if tuple(tensor_val(a).shape) == k_shape]
    xs = [a for a in floats if a not in weights]
    if len(weights) != 1 or len(xs) != 1 or tensor_val(xs[0]).dim() != 2 or len(k_shape) != 2:
        return NotAnExpertsBlock(f"{path}: cannot tell the tokens [T, H] from the top-k ids and weights "
                                 f"[T, k] among {[a.name for a in tensors]}")
    out = leaving[0]
    if tuple(tensor_val(out).shape) != tuple(tensor_val(xs[0]).shape):
        return NotAnExpertsBlock(f"{path}: its output {tuple(tensor_val(out).shape)} is not shaped like its "
                                 f"tokens {tuple(tensor_val(xs[0]).shape)}")
    grouped = [n for n in body if n.op == "call_function" and op_name(n) in GROUPED_MM]
    for p in params:
        if tensor_val(p).dim() == 0 or int(tensor_val(p).shape[0]) != num_experts:
            return NotAnExpertsBlock(f"{path}: parameter {p.target} is not indexed by expert on dim 0")
    return MoEBlock(path, body, params, grouped, xs[0], index, weights[0], sizes, out, num_experts,
                    int(k_shape[1]))


def layer_blocks(gm: torch.fx.GraphModule) -> dict[int, list[MoEBlock | NotAnExpertsBlock]]:
    """Layer index -> its experts blocks, for the layers of a captured graph that have any."""
    by_layer: dict[int, list] = {}
    for n in gm.graph.nodes:
        layer = getattr(n.meta.get(META_KEY), "layer", None)
        if layer is not None:
            by_layer.setdefault(layer, []).append(n)
    return {i: found for i, nodes in sorted(by_layer.items()) if (found := moe_blocks(gm.graph, nodes))}


def expert_layers(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the layers of a captured graph with an experts block (where ``ep`` applies)."""
    from ..ir import graph_info

    layers = graph_info(gm).layers
    return {layers[i].name for i in layer_blocks(gm)}


def split_blocks(gm: torch.fx.GraphModule, layer_ep: dict[int, int]) -> dict[int, list[MoEBlock]]:
    """Layer index -> the experts blocks expert parallelism splits (layers with ``ep > 1``)."""
    if not any(ep > 1 for ep in layer_ep.values()):
        return {}
    return {idx: [b for b in blocks if isinstance(b, MoEBlock)] for idx, blocks in layer_blocks(gm).items()
            if layer_ep.get(idx, 1) > 1}


def keep_whole(blocks: dict[int, list[MoEBlock]], layer_ep: dict[int, int]) -> dict[str, str]:
    """Linear node name -> why tensor parallelism leaves it whole: the grouped matmuls and routers
    of ``blocks`` (:func:`split_blocks`: expert parallelism splits them by expert)."""
    keep: dict[str, str] = {}
    for idx, found in blocks.items():
        ep = layer_ep[idx]
        for b in found:
            keep.update({g.name: f"experts split over ep={ep} ranks by expert" for g in b.grouped})
            keep.update({r.name: f"router of experts split over ep={ep} ranks" for r in b.routers()})
    return keep


def describe(blocks: list) -> str:
    """One line for a layer's experts blocks: ``"8 experts top-2 (2 weights)"``, or why ep cannot split them."""
    parts = [f"{b.num_experts} experts top-{b.top_k} ({len(b.params)} weights)" if isinstance(b, MoEBlock)
             else f"experts ep cannot split: {b}" for b in blocks]
    return "; ".join(parts) or "-"
