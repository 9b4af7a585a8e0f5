"""Layer grouping pass: assign every node of a normalised graph to one layer.

Input: a GraphModule in the normalised form (see :mod:`galvatron_fx.passes.normalize`); only
``node.meta["nn_module_stack"]`` and ``node.meta["val"]`` are read, so any fx graph works.

Output: the same GraphModule with ``node.meta["galvatron"].layer`` set on every node and
``gm.meta["galvatron"].layers`` the ordered :class:`LayerRecord` list:

* **modules** (the normal case): the repeated blocks are the elements of the *innermost*
  integer-indexed containers (``ModuleList``/``Sequential``) whose elements are all of one class
  and are not leaf modules (so ``blocks.3`` is a block, but ``heads.0`` = an ``nn.Linear`` is not,
  and Swin's ``stages.1`` gives way to its ``stages.1.blocks.*``). A module is a leaf when no module
  below it runs, at any depth: containers are never called themselves, so HF T5's ``block.0``, whose
  only child is the list ``layer`` of mixed sub-layers, is a block. Nodes before the first block form
  the ``pre`` layer, after the last block the ``post`` layer, and code between two block lists an
  ``other`` layer (Swin's patch merging, T5's encoder final norm); glue between two blocks of the
  same list is folded into the preceding block. The experts of a loop over a module list
  (:func:`galvatron_fx.sharding.experts.expert_lists`: elements running on routed rows) are no
  blocks: they stay in the layer that loops over them.
* **cut-points** (no module information): the graph is cut wherever a single activation tensor
  crosses (graph inputs and parameters are available everywhere and do not count); segments without
  parameters are merged into their successor; the longest periodic run of segment signatures
  (attention half, MLP half, ...) gives one block per period, with what precedes it as pre and
  what follows as post.

Parameters and graph inputs belong to the layer of their first user. Structurally identical layers
get equal ``signature`` strings (a hash of ops, shapes, dtypes and constants, not of names).
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..batch_symbol import coupling
from ..ir import META_KEY, GraphInfo, LayerRecord, NodeInfo, short_hash, tensor_meta
from ..sharding.experts import expert_lists
from .base import GraphPass, check
from .layer_sizes import localize_sizes

_STRUCTURAL_OPS = ("placeholder", "get_attr", "output")


class LayerGroupingPass(GraphPass):
    """See the module docstring."""

    name = "layer_grouping"

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        gm = graph_module
        info = gm.meta.get(META_KEY)
        if not isinstance(info, GraphInfo):
            info = gm.meta[META_KEY] = GraphInfo(method="graph",
                                                 input_names=[n.name for n in gm.graph.nodes if n.op == "placeholder"])
        for node in gm.graph.nodes:
            if not isinstance(node.meta.get(META_KEY), NodeInfo):
                node.meta[META_KEY] = NodeInfo()

        blocks = block_paths(gm)
        if blocks:
            segments, grouping = module_segments(gm, blocks), "modules"
        else:
            segments, grouping = cut_point_segments(gm), "cut-points"
        if len(segments) <= 1:
            compute = [n for n in gm.graph.nodes if n.op not in _STRUCTURAL_OPS]
            segments, grouping = [("model", "other", compute)], "single"
            warnings.warn("galvatron_fx found no repeated layers in this graph; it is one layer, so only "
                          "whole-model strategies (DP, ZeRO, checkpointing) apply", stacklevel=2)

        if info.symbolic_batch:
            localize_sizes(gm, segments)
            gm.recompile()
        info.layers = _records(gm, segments)
        info.grouping = grouping
        info.fingerprint = _fingerprint(gm, info.layers)
        return PassResult(gm, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for node in graph_module.graph.nodes:
            if node.op != "output":
                check(node.meta[META_KEY].layer is not None, f"node {node.name} has no layer")


# ---------------------------------------------------------------------------------------------
# module-based grouping


def _module_types(gm: torch.fx.GraphModule) -> dict[str, str]:
    types: dict[str, str] = {}
    for node in gm.graph.nodes:
        for path, typ in (node.meta.get("nn_module_stack") or {}).values():
            types[path] = typ if isinstance(typ, str) else f"{typ.__module__}.{typ.__qualname__}"
    return types


def block_list_elements(types: dict[str, str]) -> dict[str, list[str]]:
    """container path -> its element paths (in index order), for the innermost block lists.

    ``types`` maps every module path seen in the graph to its class name.
    """
    # A module is a leaf when no module below it runs. Count every ancestor, not just the parent:
    # containers are never called themselves (a ModuleList has no forward), so a block whose only
    # child is a list (HF T5Block -> layer: ModuleList[T5LayerSelfAttention, ..., T5LayerFF]) has
    # no direct child in ``types``, only grandchildren.
    has_children = {path[:i] for path in types for i, c in enumerate(path) if c == "."}
    lists: dict[str, dict[int, str]] = defaultdict(dict)
    for path in types:
        parent, _, last = path.rpartition(".")
        if last.isdigit():
            lists[parent][int(last)] = path
    qualifying = {
        parent: [elems[i] for i in sorted(elems)]
        for parent, elems in lists.items()
        if len({types[p] for p in elems.values()}) == 1 and all(p in has_children for p in elems.values())
    }
    return {
        parent: elems for parent, elems in qualifying.items()
        if not any(other != parent and other.startswith(e + ".") for other in qualifying for e in elems)
    }


def block_paths(gm: torch.fx.GraphModule) -> dict[str, str]:
    """block element path -> its container path, for every block found in ``gm``."""
    routed = expert_lists(gm.graph)   # NOTE: a loop's experts are no blocks: they run on routed rows
    types = {p: t for p, t in _module_types(gm).items() if not any(p.startswith(e + ".") for e in routed)}
    lists = block_list_elements(types)
    return {elem: parent for parent, elems in lists.items() for elem in elems}


def _block_of(node: torch.fx.Node, blocks: dict[str, str]) -> str | None:
    for path in reversed(list((node.meta.get("nn_module_stack") or {}).keys())):
        if path in blocks:
            return path
    return None


def module_segments(gm: torch.fx.GraphModule, blocks: dict[str, str]) -> list[tuple[str, str, list]]:
    """Ordered (name, kind, compute nodes) segments from the module hierarchy."""
    segs: list[list] = []  # [name, kind, nodes]
    index_of: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op in _STRUCTURAL_OPS:
            continue
        block = _block_of(node, blocks)
        if block is None:
            if not segs:
                segs.append(["pre", "pre", []])
            elif segs[-1][1] == "block":
                segs.append([None, "gap", []])
        elif block in index_of and index_of[block] != len(segs) - 1:
            # The block resumes after glue: fold everything since its start back into it.
            first = index_of[block]
            for seg in segs[first + 1:]:
                segs[first][2].extend(seg[2])
            del segs[first + 1:]
        elif block not in index_of:
            index_of[block] = len(segs)
            segs.append([block, "block", []])
        segs[-1][2].append(node)

    out: list[tuple[str, str, list]] = []
    for i, (name, kind, nodes) in enumerate(segs):
        if kind != "gap":
            out.append((name, kind, nodes))
            continue
        prev_block = segs[i - 1][0]
        next_block = segs[i + 1][0] if i + 1 < len(segs) else None
        if next_block is None:
            out.append(("post", "post", nodes))
        elif blocks[prev_block] == blocks[next_block]:
            out[-1][2].extend(nodes)  # glue between two blocks of one list
        else:
            out.append((_common_path(nodes) or f"between.{prev_block}", "other", nodes))
    return out


def _common_path(nodes: list[torch.fx.Node]) -> str:
    paths = [n.meta[META_KEY].module_path for n in nodes if n.meta[META_KEY].module_path]
    if not paths:
        return ""
    parts = paths[0].split(".")
    for p in paths[1:]:
        q = p.split(".")
        k = 0
        while k < min(len(parts), len(q)) and parts[k] == q[k]:
            k += 1
        parts = parts[:k]
    return ".".join(parts)


# ---------------------------------------------------------------------------------------------
# cut-point fallback


def cut_point_segments(gm: torch.fx.GraphModule) -> list[tuple[str, str, list]]:
    """Segments between the points where exactly one activation tensor is live."""
    compute = [n for n in gm.graph.nodes if n.op not in _STRUCTURAL_OPS]
    if not compute:
        return []
    pos = {n: i for i, n in enumerate(compute)}
    end = len(compute)
    alive = [0] * (end + 1)
    last_use = {}
    for n in compute:
        if tensor_meta(n) is None:
            continue
        last = max((pos.get(u, end) for u in n.users), default=pos[n])
        last_use[n] = last
        alive[pos[n]] += 1
        alive[last] -= 1
    segments: list[list] = [[]]
    running = 0
    for i, n in enumerate(compute):
        running += alive[i]
        segments[-1].append(n)
        if running == 1 and last_use.get(n, i) > i and i < end - 1:
            segments.append([])
    segments = _merge_parameterless([s for s in segments if s])
    pre, blocks, post = _periodic_blocks(segments)
    out = [("pre", "pre", pre)] if pre else []
    out += [(f"segment.{i}", "block", nodes) for i, nodes in enumerate(blocks)]
    return out + ([("post", "post", post)] if post else [])


def _uses_param(nodes: list[torch.fx.Node]) -> bool:
    return any(a.op == "get_attr" for n in nodes for a in n.all_input_nodes)


def _merge_parameterless(segments: list[list]) -> list[list]:
    merged: list[list] = []
    carry: list = []
    for seg in segments:
        carry = carry + seg
        if _uses_param(carry):
            merged.append(carry)
            carry = []
    if carry:
        if merged:
            merged[-1].extend(carry)
        else:
            merged.append(carry)
    return merged


def _periodic_blocks(segments: list[list]) -> tuple[list, list[list], list]:
    if not segments:
        return [], [], []
    """Split segments into (pre, blocks, post) around the longest periodic run.

    The most frequent segment signature (earliest first on ties) marks the period: the distance
    between its occurrences (e.g. 2 for an attention half followed by an MLP half). Consecutive
    periods with the same signature sequence become blocks; what precedes is pre, the rest post.
    """
    sigs = [_signature(nodes) for nodes in segments]
    counts = {s: sigs.count(s) for s in sigs}
    best = max(sigs, key=lambda s: (counts[s], -sigs.index(s)))
    where = [i for i, s in enumerate(sigs) if s == best]
    steps = {b - a for a, b in zip(where, where[1:])}
    if counts[best] < 2 or len(steps) != 1:
        return [], [], []  # nothing repeats: the caller falls back to one layer
    k, first = steps.pop(), where[0]
    period = sigs[first:first + k]
    n = 0
    while first + (n + 1) * k <= len(sigs) and sigs[first + n * k:first + (n + 1) * k] == period:
        n += 1
    blocks = [sum(segments[first + i * k:first + (i + 1) * k], []) for i in range(n)]
    return sum(segments[:first], []), blocks, sum(segments[first + n * k:], [])


# ---------------------------------------------------------------------------------------------
# records and signatures


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", None) or ""
    return f"{mod}.{getattr(t, '__qualname__', None) or getattr(t, '__name__', None) or str(t)}"


def _signature(nodes: list[torch.fx.Node]) -> str:
    """Structural hash: ops, constants, shapes and dtypes, with nodes numbered locally."""
    local: dict[torch.fx.Node, int] = {}
    external: dict[torch.fx.Node, int] = {}
    items = []

    def ref(a):
        if a in local:
            return ("l", local[a])
        if a not in external:
            external[a] = len(external)
        meta = tensor_meta(a)
        return ("x", external[a], meta, a.op == "get_attr")

    for n in nodes:
        args = torch.fx.node.map_arg((n.args, n.kwargs), ref)
        target = "param" if n.op == "get_attr" else _target_name(n)  # names differ per layer; shapes don't
        items.append((n.op, target, repr(args), tensor_meta(n)))
        local[n] = len(local)
    return short_hash(*items)


def _records(gm: torch.fx.GraphModule, segments: list[tuple[str, str, list]]) -> list[LayerRecord]:
    layer_of: dict[torch.fx.Node, int] = {}
    for idx, (_name, _kind, nodes) in enumerate(segments):
        for n in nodes:
            layer_of[n] = idx
    # Parameters and inputs go with their first user.
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            users = sorted(layer_of[u] for u in node.users if u in layer_of)
            layer_of[node] = users[0] if users else (len(segments) - 1 if node.op == "placeholder" else 0)

    records = []
    for idx, (name, kind, nodes) in enumerate(segments):
        own = set(nodes)
        attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and layer_of[n] == idx]
        inputs: list[str] = []
        graph_inputs: list[str] = []
        params: list[str] = []
        producers: set[int] = set()
        for n in nodes:
            for a in n.all_input_nodes:
                if a in own:
                    continue
                if a.op == "placeholder":
                    if a.name not in graph_inputs:
                        graph_inputs.append(a.name)
                elif a.op == "get_attr":
                    p = a.meta[META_KEY].param
                    if p is not None and p.fqn not in params:
                        params.append(p.fqn)
                elif a.name not in inputs:
                    inputs.append(a.name)
                    producers.add(layer_of[a])
        records.append(LayerRecord(
            index=idx, name=name, kind=kind, signature=_signature(attrs + nodes),
            nodes=[n.name for n in attrs + nodes], params=params, inputs=inputs,
            consumes_from=sorted(producers), graph_inputs=graph_inputs,
            batch_coupled=[c for n in nodes if (c := coupling(n))]))
    for node, idx in layer_of.items():
        node.meta[META_KEY].layer = idx
    return records


def _fingerprint(gm: torch.fx.GraphModule, layers: list[LayerRecord]) -> str:
    """Identity of a model for plan checks, the same whatever the capture front end and call
    convention: its parameters (fully qualified name, shape, dtype) and its layers (name, kind, the
    parameters each holds). Node names, op spellings, buffers (export keeps unused ones) and inputs
    do not enter.
    NOTE: the batch a plan is for is checked apart (``plan.global_batch_size``)."""
    params = sorted({(n.meta[META_KEY].param.fqn, n.meta[META_KEY].param.shape, str(n.meta[META_KEY].param.dtype))
                     for n in gm.graph.nodes if n.op == "get_attr" and getattr(n.meta[META_KEY].param, "is_param", False)})
    return short_hash([(la.name, la.kind, sorted(la.params)) for la in layers], params, n=32)
