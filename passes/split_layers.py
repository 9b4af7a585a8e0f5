"""Split layers pass: the flat captured graph -> a top graph calling one submodule per layer.

Input: a captured, layer-grouped GraphModule (``node.meta["galvatron"].layer`` on every node,
``gm.meta["galvatron"].layers`` in execution order; a layer reads only earlier layers' values).

Output: a new GraphModule whose graph has the same placeholders and output and, for each layer
``i`` in order, one ``call_module`` of the submodule ``layers_<i>`` (a GraphModule of its own):

* the submodule's placeholders are the values it reads from graph inputs or earlier layers (named
  after the producing node), its output the values later layers or the graph output read (bare
  when there is one, else a tuple unpacked in the top graph by ``getitem`` nodes named after the
  producing node);
* a parameter (trainable or frozen) lives in exactly one submodule, its owner layer's (the layer of
  its first user), as a ``get_attr`` whose target is its original fully qualified name (so
  ``dist_model.layers_3.get_parameter("blocks.2.attn.q.weight")`` holds it); a later layer that
  shares it (tied weights) receives it as an input from the owner's output;
* buffers and constants are duplicated into every layer that reads them;
* every top-graph value node carries ``meta["val"]`` and ``meta["galvatron"]`` (a NodeInfo whose
  ``layer`` is the producing layer; ``None`` for graph inputs); each submodule's
  ``meta["galvatron"]`` is its :class:`~galvatron_fx.ir.LayerRecord`, and the top module's is the
  input's :class:`~galvatron_fx.ir.GraphInfo`.

Semantics are unchanged: the top module computes what the input did.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import CaptureError
from ..ir import META_KEY, GraphInfo, NodeInfo, layer_module_name
from .base import GraphPass, check


def layer_calls(top: torch.fx.GraphModule) -> dict[int, torch.fx.Node]:
    """Layer index -> the top-graph node that runs it: a ``call_module`` of ``layers_<i>``, or a
    runner a dimension's pass puts in its place, ``runner(self.layers_<i>, *inputs)`` (e.g. the
    checkpointing pass's ``checkpoint_layer``)."""
    calls = {}
    for n in top.graph.nodes:
        if n.op == "call_module" and n.target.startswith("layers_"):
            calls[int(n.target.split("_")[1])] = n
        elif n.op == "call_function" and n.args and _runs_layer(n.args[0]):
            calls[int(n.args[0].target.split("_")[1])] = n
    return calls


def run_layers_under(top: torch.fx.GraphModule, runner_of) -> bool:
    """Make each layer ``i`` for which ``runner_of(i)`` names a function run as ``runner(self.layers_<i>,
    *inputs)`` (under the call's old node name) instead of its ``call_module``; a layer already
    under a runner is left alone. Returns whether any call changed (the graph is recompiled)."""
    modified = False
    for i, call in layer_calls(top).items():
        runner = runner_of(i)
        if runner is None or call.op != "call_module":
            continue
        with top.graph.inserting_before(call):
            mod = top.graph.get_attr(call.target)
            new = top.graph.call_function(runner, (mod, *call.args))
        new.meta = dict(call.meta)
        call.replace_all_uses_with(new)
        top.graph.erase_node(call)
        new.name = call.target
        modified = True
    top.recompile()
    return modified


def _runs_layer(arg) -> bool:
    """Whether a call's first argument is a layer submodule (``get_attr`` of ``layers_<i>``)."""
    return (isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and isinstance(arg.target, str)
            and arg.target.startswith("layers_") and arg.target.split("_")[1].isdigit())


def layer_outputs(graph: torch.fx.Graph) -> tuple[torch.fx.Node, tuple]:
    """A layer graph's output node and its values as a tuple (one bare value -> a 1-tuple)."""
    out = next(n for n in graph.nodes if n.op == "output")
    outs = out.args[0]
    return out, (outs,) if not isinstance(outs, (tuple, list)) else tuple(outs)


def route_outputs(graph: torch.fx.Graph, fn, *lead_args) -> None:
    """Make a layer graph return ``fn(*lead_args, outputs)[i]`` instead of each output ``i``
    (``fn`` returns the outputs, e.g. after releasing a buffer or leaving autocast)."""
    out, outs_t = layer_outputs(graph)
    single = not isinstance(out.args[0], (tuple, list))
    with graph.inserting_before(out):
        done = graph.call_function(fn, (*lead_args, outs_t))
        new = [graph.call_function(operator.getitem, (done, i)) for i in range(len(outs_t))]
    out.args = (new[0] if single else tuple(new),)


def is_split(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` is a top graph of this pass (it calls ``layers_<i>`` submodules)."""
    return bool(layer_calls(gm))


def is_param_node(node: torch.fx.Node) -> bool:
    """A get_attr node holding a parameter of the model (trainable or frozen)."""
    p = getattr(node.meta.get(META_KEY), "param", None)
    return node.op == "get_attr" and p is not None and p.is_param


def is_trainable_param(node: torch.fx.Node) -> bool:
    """A get_attr node holding a parameter that receives gradients."""
    return is_param_node(node) and node.meta[META_KEY].param.requires_grad


def _is_shared_constant(node: torch.fx.Node) -> bool:
    return node.op == "get_attr" and not is_param_node(node)


def fetch_attr(root: torch.nn.Module, target: str):
    """The attribute a ``get_attr`` target (a dotted path) names under ``root``."""
    obj = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


class SplitLayersPass(GraphPass):
    """See the module docstring. Takes GROUPED (or STAGE / TP_SHARDED), leaves SPLIT."""

    name = "split_layers"

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        info = graph_module.meta.get(META_KEY)
        if not isinstance(info, GraphInfo) or not info.layers:
            raise CaptureError("split_layers needs a layer-grouped graph; capture it with gfx.capture()")
        check(not is_split(graph_module), "split_layers needs a flat graph, got one already split into layers")

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        n_layers = len(graph_module.meta[META_KEY].layers)
        calls = layer_calls(graph_module)
        check(sorted(calls) == list(range(n_layers)),
              f"split_layers must call each of the {n_layers} layers once, calls {sorted(calls)}")
        for i in range(n_layers):
            check(isinstance(getattr(graph_module, layer_module_name(i), None), torch.fx.GraphModule),
                  f"layer submodule {layer_module_name(i)} is missing")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        gm = graph_module
        info: GraphInfo = gm.meta[META_KEY]
        n_layers = len(info.layers)
        layer_of = {n: n.meta[META_KEY].layer for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
        members: list[list[torch.fx.Node]] = [[] for _ in range(n_layers)]
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output") or _is_shared_constant(node):
                continue
            members[layer_of[node]].append(node)
            for a in node.all_input_nodes:
                if a.op != "placeholder" and not _is_shared_constant(a) and layer_of[a] > layer_of[node]:
                    raise CaptureError(f"node {node.name} of layer {layer_of[node]} reads {a.name} of the "
                                       f"later layer {layer_of[a]}; layers must be in execution order")

        top = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = top.placeholder(node.name)
                env[node].meta = {"val": node.meta.get("val"), META_KEY: copy.copy(node.meta[META_KEY])}
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        root: dict[str, torch.nn.Module] = {}
        for i, nodes in enumerate(members):
            own = set(nodes)
            sub, inputs, outputs = self._layer_graph(gm, nodes, own)
            sub_gm = torch.fx.GraphModule(sub[1], sub[0], class_name="Layer")
            sub_gm.meta[META_KEY] = info.layers[i]
            name = layer_module_name(i)
            root[name] = sub_gm
            call = top.call_module(name, tuple(env[a] for a in inputs))
            call.meta = {META_KEY: NodeInfo(layer=i)}
            if len(outputs) == 1:
                env[outputs[0]] = call
                call.meta["val"] = outputs[0].meta.get("val")
            else:
                for k, o in enumerate(outputs):
                    env[o] = top.create_node("call_function", operator.getitem, (call, k), name=o.name)
                    env[o].meta = {"val": o.meta.get("val"), META_KEY: NodeInfo(layer=i)}
        top.output(torch.fx.node.map_arg(out_node.args[0], lambda n: env[n]))
        result = torch.fx.GraphModule(root, top, class_name="GalvatronDistributed")
        result.meta[META_KEY] = info
        return PassResult(result, True)

    @staticmethod
    def _layer_graph(gm, nodes, own):
        sub = torch.fx.Graph()
        senv: dict[torch.fx.Node, torch.fx.Node] = {}
        attrs: dict[str, object] = {}
        inputs: list[torch.fx.Node] = []
        for node in nodes:
            for a in node.all_input_nodes:
                if a not in own and not _is_shared_constant(a) and a not in inputs:
                    inputs.append(a)
        for a in inputs:
            senv[a] = sub.placeholder(a.name)
            senv[a].meta = dict(a.meta)
        for node in nodes:
            for a in node.all_input_nodes:
                if _is_shared_constant(a) and a not in senv:
                    senv[a] = sub.get_attr(a.target)
                    senv[a].meta = dict(a.meta)
                    attrs[a.target] = fetch_attr(gm, a.target)
            if node.op == "get_attr":
                attrs[node.target] = fetch_attr(gm, node.target)
            senv[node] = sub.node_copy(node, lambda x: senv[x])
        outputs = [n for n in nodes if any(u not in own for u in n.users)]
        if len(outputs) == 1:
            sub.output(senv[outputs[0]])
        else:
            sub.output(tuple(senv[o] for o in outputs))
        return (sub, attrs), inputs, outputs


def split_layers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Run :class:`SplitLayersPass` and return the top GraphModule."""
    return SplitLayersPass()(gm).graph_module


def fresh_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with a copied graph, copied node records and its own module tree holding the
    same tensors (so rewriting it, or setting attributes on it, leaves ``gm`` unchanged)."""
    graph = torch.fx.Graph()
    env: dict = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        new.meta = dict(old.meta)
        if META_KEY in old.meta:
            new.meta[META_KEY] = copy.copy(old.meta[META_KEY])
    root = {n.target: fetch_attr(gm, n.target) for n in graph.nodes if n.op == "get_attr"}
    new_gm = torch.fx.GraphModule(root, graph, class_name=type(gm).__name__)
    new_gm.meta = dict(gm.meta)
    if META_KEY in gm.meta:  # NOTE: the TP pass rewrites its layer records' node lists
        new_gm.meta[META_KEY] = copy.deepcopy(gm.meta[META_KEY])
    return new_gm
