"""Data-parallel rewrite of one layer submodule: parameters -> views of one flat buffer.

Input: a layer GraphModule from :mod:`.split_layers` (trainable parameters are ``get_attr``
nodes with their original FQN targets) and the layer's ``sdp`` mode and DP ranks.

Output (in place): the layer holds a :class:`~galvatron_fx.runtime.data_parallel.FlatParams`
submodule ``flat_params``; its graph starts with ``params = dp_params(flat_params)`` /
``zero2_params`` / ``zero3_all_gather`` and reads each parameter as
``param_view(params, offset, shape)`` under the parameter's old node name; a ZeRO-3 layer ends with
``zero3_release(flat_params, outputs)`` (unless a view of its buffer is itself an output, a tied
weight, which keeps the buffer gathered). The original parameter attributes are removed, so
the layer's only parameter is ``flat_params.flat_param``. Returns the store, or ``None`` when the
layer has no trainable parameter.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..runtime.data_parallel import ENTRY, FlatParams, param_view, zero3_release
from .split_layers import is_trainable_param


def _fetch_owner(root: torch.nn.Module, target: str):
    *path, name = target.split(".")
    owner = root
    for atom in path:
        owner = getattr(owner, atom)
    return owner, name


def flatten_layer_params(layer: torch.fx.GraphModule, mode: str, dp_ranks, rank: int,
                         bucket_bytes: int, ckpt: bool = False) -> FlatParams | None:
    graph = layer.graph
    nodes = [n for n in graph.nodes if is_trainable_param(n)]
    if not nodes:
        return None
    tensors = {}
    for n in nodes:
        owner, name = _fetch_owner(layer, n.target)
        tensors[n.target] = getattr(owner, name)
    store = FlatParams(tensors, mode, dp_ranks, rank, bucket_bytes)
    layer.add_submodule("flat_params", store)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        fp = graph.get_attr("flat_params")
        params = graph.call_function(ENTRY[mode], (fp,))
        params.name = "params" if "params" not in {n.name for n in graph.nodes} else params.name
    views = set()
    for n, off, shape in zip(nodes, store.offsets, store.shapes):
        with graph.inserting_before(n):
            view = graph.call_function(param_view, (params, off, shape))
        view.meta = dict(n.meta)
        n.replace_all_uses_with(view)
        old = n.name
        graph.erase_node(n)
        view.name = old
        views.add(view)
        owner, name = _fetch_owner(layer, n.target)
        delattr(owner, name)
    out = next(n for n in graph.nodes if n.op == "output")
    outs = out.args[0]
    single = not isinstance(outs, (tuple, list))
    outs_t = (outs,) if single else tuple(outs)
    if mode == "zero3":
        if any(o in views for o in outs_t):
            store.keep_gathered = True   # a tied weight leaves the layer: keep it until backward
        else:
            store.regather_in_backward = not ckpt
            with graph.inserting_before(out):
                rel = graph.call_function(zero3_release, (fp, outs_t))
                new = [graph.call_function(operator.getitem, (rel, i)) for i in range(len(outs_t))]
            out.args = (new[0] if single else tuple(new),)
    layer.delete_all_unused_submodules()
    graph.lint()
    layer.recompile()
    return store
