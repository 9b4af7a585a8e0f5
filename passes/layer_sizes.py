"""Layer-local batch sizes: every batch size a layer reads is computed inside that layer.

A graph captured with a symbolic batch (:mod:`galvatron_fx.batch_symbol`) computes its batch once,
``s = sym_size(input_ids, 0)``, and every layer's views read ``s``. Split into layers (pipeline
stages, layers with their own DP degree, a layer profiled alone) a layer must not depend on an
integer computed elsewhere: it would cross a stage boundary as a non-tensor, and it would be the
wrong batch where the layer runs on another share of the samples.

:func:`localize_sizes` (run by layer grouping, before the layer records are built) gives each layer
its own copy, read from a tensor the layer already has, in this order of preference: an activation
it receives, one of its own earlier values, a graph input it reads, and only then another graph
input. A dim that is the batch itself (factor 1) is preferred to a flattened ``batch x seq`` one,
which sequence parallelism would shard. ``s' = sym_size(x, d) * (k_s / k_x)`` where ``k`` are the
batch factors (``NodeInfo.batch_factor``, ``batch_dims``). Sizes with no such source stay as they
are (and then cross as they did before).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..ir import META_KEY, NodeInfo


def _is_batch_size(node: torch.fx.Node) -> bool:
    info = node.meta.get(META_KEY)
    return info is not None and info.batch_factor is not None


def _pick(candidates: list[torch.fx.Node], want: int) -> tuple[torch.fx.Node, int, int] | None:
    """``(tensor, dim, factor)`` of the first candidate dim that is the batch itself, else of the
    first whose factor divides ``want`` or is divisible by it."""
    for exact in (True, False):
        for x in candidates:
            for d, k in getattr(x.meta.get(META_KEY), "batch_dims", ()):
                if (k == 1) if exact else (want % k == 0 or k % want == 0):
                    return x, d, k
    return None


def localize_sizes(gm: torch.fx.GraphModule, segments: list[tuple[str, str, list]]) -> int:
    """Rewrite ``gm`` so that no segment reads a batch size computed in another (module
    docstring); the new nodes join their segment's node list. Returns the number of rewrites."""
    owner = {n: i for i, (_name, _kind, nodes) in enumerate(segments) for n in nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    count = 0
    for idx, (_name, _kind, nodes) in enumerate(segments):
        local: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in list(nodes):
            external = [a for a in n.all_input_nodes if owner.get(a, idx) != idx and _is_batch_size(a)]
            for a in external:
                if a not in local:
                    new = _local_copy(gm, a, n, nodes, owner, idx, placeholders)
                    if new is None:
                        continue
                    local[a] = new
                    count += 1
                n.replace_input_with(a, local[a])
    for _name, _kind, nodes in segments:   # sizes no layer reads any more
        for n in [n for n in nodes if _is_batch_size(n) and not n.users]:
            nodes.remove(n)
            gm.graph.erase_node(n)
    return count


def _local_copy(gm, size: torch.fx.Node, user: torch.fx.Node, nodes: list, owner: dict, idx: int,
                placeholders: list) -> torch.fx.Node | None:
    before = nodes[:nodes.index(user)]
    received, read = [], []
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "placeholder":
                read.append(a)
            elif owner.get(a, idx) != idx and a.op != "get_attr":
                received.append(a)
    want = size.meta[META_KEY].batch_factor
    found = _pick(list(dict.fromkeys(received + before + read + placeholders)), want)
    if found is None:
        return None
    x, d, k = found
    info = user.meta.get(META_KEY)
    with gm.graph.inserting_before(user):
        out = gm.graph.call_function(torch.ops.aten.sym_size.int, (x, d))
        made = [out]
        if k != want:
            op, c = (operator.mul, want // k) if want % k == 0 else (operator.floordiv, k // want)
            out = gm.graph.call_function(op, (out, c))
            made.append(out)
    for m in made:
        m.meta["val"] = size.meta.get("val")
        m.meta[META_KEY] = NodeInfo(module_path=getattr(info, "module_path", ""), batch_factor=want)
    made[0].meta["val"] = int(x.meta["val"].shape[d]) if isinstance(x.meta.get("val"), torch.Tensor) else None
    made[0].meta[META_KEY].batch_factor = k
    at = nodes.index(user)
    nodes[at:at] = made
    for m in made:
        owner[m] = idx
    return out
