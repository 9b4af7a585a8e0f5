"""Normalise pass: any front end's graph -> galvatron_fx's one canonical form.

Input: the raw GraphModule from a capture front end (fx, dynamo or export) of the flattening
wrapper around the user's model, plus the original model and the example input tensors.

Output (a new GraphModule), whatever the front end:

* placeholders are exactly the input tensors, in order, named after the forward() arguments;
* every parameter and buffer of the model is one ``get_attr`` node whose target is its fully
  qualified name in the original model (tied weights: the first name); the GraphModule holds the
  *original* tensor objects, so an optimizer built from ``model.parameters()`` updates them;
* ``node.meta["nn_module_stack"]`` maps clean module paths (``"layers.0.attn"``) to
  ``(path, "module.ClassName")``; ``node.meta["galvatron"]`` is a :class:`NodeInfo` with the
  innermost module path, and for parameters a :class:`ParamInfo`;
* ``node.meta["val"]`` holds fake tensors from a FakeTensorProp run (no real memory is touched,
  so models on the meta device work);
* ``gm.meta["galvatron"]`` is a :class:`GraphInfo` (layers still empty; see layer_grouping);
* dropout calls follow the step (:mod:`galvatron_fx.runtime.dropout`: off in ``eval_step``);
* ``histc`` runs on integer input on every device (:func:`galvatron_fx.runtime.experts.histc`);
* a loop over experts (``torch.where(one_hot(ids, E)...[e])``, a data-dependent row count) calls
  :func:`galvatron_fx.runtime.experts.routed_rows`, whose fake value has a uniform router's count,
  and an accumulation into a fresh buffer (``out.index_add_(0, rows, y)`` after
  ``out = torch.zeros_like(x)``) is functional (``out_e = torch.index_add(out_{e-1}, ...)``), as
  export writes it: :mod:`galvatron_fx.sharding.experts` then reads one graph of it from every
  front end.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx
import torch.nn as nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.infra.pass_base import PassResult

from ..batch_symbol import annotate, batch_symbols, factor
from ..errors import CaptureError
from ..ir import META_KEY, GraphInfo, NodeInfo, ParamInfo
from ..runtime.dropout import dropout, scaled_dot_product_attention
from ..runtime.experts import histc, routed_rows
from ..sharding.experts import find_one_hot, one_hot_classes
from .base import GraphPass, check

CONSTANTS_PREFIX = "_constants"


def clean_module_path(raw: str, prefix: str = "") -> str:
    """``"L['self'].inner._modules['layers'][0]"`` -> ``"layers.0"`` (with ``prefix="inner"``)."""
    # NOTE: a decorated forward (transformers' ``@can_return_tuple``-style ``wrapper(*args,
    # **kwargs)``) sees the module as ``L['args'][0]``
    s = re.sub(r"^L\['args'\]\[\d+\]|^L\['[^']*'\]", "", raw)
    s = re.sub(r"^L__self__", "", s)
    s = re.sub(r"\._modules\['([^']*)'\]", r".\1", s)
    s = re.sub(r"\['([^']*)'\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    # NOTE: a module reached through ``self.__dict__["_modules"]`` (peft's ``__getattr__`` forwarding)
    s = re.sub(r"(^|\.)__dict__\._modules(?=\.)", "", s)
    s = s.strip(".")
    if prefix:
        if s == prefix:
            return ""
        if s.startswith(prefix + "."):
            s = s[len(prefix) + 1:]
    return s


def type_name(t) -> str:
    if isinstance(t, str):
        return t
    return f"{t.__module__}.{t.__qualname__}"


def clean_module_stack(stack: dict | None, prefix: str) -> dict[str, tuple[str, str]]:
    """A torch ``nn_module_stack`` with clean paths (outermost first); the wrapper itself is dropped."""
    out: dict[str, tuple[str, str]] = {}
    for _key, value in (stack or {}).items():
        path, typ = value[0], value[1]
        path = clean_module_path(path, prefix)
        if path:
            out[path] = (path, type_name(typ))
    return out


def model_tensors(model: nn.Module) -> dict[int, ParamInfo]:
    """id(tensor) -> ParamInfo for every parameter and buffer of ``model`` (tied names as aliases)."""
    names: dict[int, list[str]] = {}
    objs: dict[int, tuple[torch.Tensor, bool]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
        objs[id(p)] = (p, True)
    for fqn, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), []).append(fqn)
        objs[id(b)] = (b, False)
    infos = {}
    for key, fqns in names.items():
        t, is_param = objs[key]
        infos[key] = ParamInfo(fqn=fqns[0], shape=tuple(t.shape), dtype=t.dtype, is_param=is_param,
                               requires_grad=bool(t.requires_grad), aliases=tuple(fqns[1:]))
    return infos


class NormalizePass(GraphPass):
    """See the module docstring. ``sources`` maps dynamo placeholder names to the tensors bound to them."""

    name = "normalize"

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor], input_names: list[str],
                 sources: dict[str, torch.Tensor] | None = None, method: str = "graph", prefix: str = ""):
        super().__init__()
        self.model = model
        self.inputs = list(inputs)
        self.input_names = list(input_names)
        self.sources = dict(sources or {})
        self.method = method
        self.prefix = prefix

    def requires(self, graph_module: torch.fx.GraphModule) -> None:
        if len(self.inputs) != len(self.input_names):
            raise CaptureError("internal: one name per input tensor is required")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        # NOTE: one function (102 lines): the normalising rewrites in their required order over one graph walk
        raw = graph_module
        known = model_tensors(self.model)
        by_fqn = {info.fqn: key for key, info in known.items()}
        tensor_of = {id(t): t for t in list(self.model.parameters()) + list(self.model.buffers())}
        input_pos = {id(t): i for i, t in enumerate(self.inputs)}

        graph = torch.fx.Graph()
        root: dict[str, object] = {}
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        new_inputs = [graph.placeholder(name) for name in self.input_names]
        for i, ph in enumerate(new_inputs):
            ph.meta[META_KEY] = NodeInfo(input_index=i)
        attr_nodes: dict[str, torch.fx.Node] = {}
        raw_vals: dict[torch.fx.Node, object] = {}   # new node -> the front end's (symbolic) value
        sizes = _InputSizes()

        def param_node(key: int, meta: dict) -> torch.fx.Node:
            info = known[key]
            if info.fqn not in attr_nodes:
                node = graph.get_attr(info.fqn)
                node.meta.update({k: v for k, v in meta.items() if k == "nn_module_stack"})
                node.meta[META_KEY] = NodeInfo(param=info)
                attr_nodes[info.fqn] = node
                root[info.fqn] = tensor_of[key]
            return attr_nodes[info.fqn]

        def constant_node(name: str, value: object) -> torch.fx.Node:
            target = f"{CONSTANTS_PREFIX}.{re.sub(r'[^0-9a-zA-Z_]', '_', name)}"
            if target not in attr_nodes:
                attr_nodes[target] = graph.get_attr(target)
                attr_nodes[target].meta[META_KEY] = NodeInfo()
                root[target] = value
            return attr_nodes[target]

        for node in raw.graph.nodes:
            if node.op not in ("placeholder", "get_attr"):
                sizes.resolve(graph, env)
            if node.op == "placeholder" and isinstance(_raw_val(node), torch.SymInt):
                sizes.pending.append(node)   # dynamo's size input: read from the tensor that has it
            elif node.op == "placeholder":
                t = self.sources.get(node.name)
                if t is None:  # fx / export: placeholders are the wrapper's inputs, in order
                    idx = sum(1 for n in env if n.op == "placeholder")
                    env[node] = new_inputs[idx]
                elif id(t) in known:
                    env[node] = param_node(id(t), node.meta)
                elif id(t) in input_pos:
                    env[node] = new_inputs[input_pos[id(t)]]
                else:
                    raise CaptureError(f"graph input {node.name!r} is neither a model parameter/buffer "
                                       "nor an example input; capture with method='export' or 'fx'")
                if env[node].op == "placeholder":
                    sizes.inputs.append((node, env[node]))
            elif node.op == "get_attr":
                value = _fetch_attr(raw, node.target)
                fqn = clean_module_path(node.target, self.prefix)
                if isinstance(value, torch.Tensor) and id(value) in known:
                    env[node] = param_node(id(value), node.meta)
                elif fqn in by_fqn:
                    env[node] = param_node(by_fqn[fqn], node.meta)
                else:  # a tensor constant or a submodule/graph the front end created
                    env[node] = constant_node(node.target, value)
            elif node.op == "call_module" and not node.users and node.target.startswith("_guards"):
                continue  # export's input guard: no outputs, checks only shapes we already fixed
            elif node.target in _SHAPE_ASSERTS and not node.users:
                continue  # the symbolic batch's range checks: true of every batch a plan runs
            elif node.target in _METADATA_ASSERTS and not node.users:
                # NOTE: export's dtype / device checks of intermediate values: true of the captured
                # graph, false once a plan computes in bf16 (mixed precision) or on another device
                continue
            elif node.op == "output":
                graph.output(_flatten_output(node.args[0], env))
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
                raw_vals[env[node]] = _raw_val(node)
                if node.target in _DROPOUTS:
                    _follow_the_step(env[node])
                elif node.target in _ATTENTIONS and _attention_dropout(env[node]):
                    env[node].target = scaled_dot_product_attention
                elif node.target in _HISTCS:   # a device branch baked at capture (runtime/experts.py)
                    env[node].target = histc

        _route_expert_rows(graph, raw_vals)
        _functional_accumulation(graph, raw_vals)
        _unpack_sizes(graph, raw_vals)
        for node in graph.nodes:
            if "nn_module_stack" in node.meta:
                node.meta["nn_module_stack"] = clean_module_stack(node.meta["nn_module_stack"], self.prefix)
            info = node.meta.get(META_KEY)
            if info is None:
                info = node.meta[META_KEY] = NodeInfo()
            stack = node.meta.get("nn_module_stack") or {}
            info.module_path = next(reversed(stack)) if stack else ""
            if node in raw_vals:
                annotate(info, raw_vals[node], sizes.symbols)

        gm = torch.fx.GraphModule(root, graph, class_name="GalvatronGraph")
        _propagate_fake(gm, self.inputs)   # NOTE: concrete shapes at the captured batch
        gm.meta[META_KEY] = GraphInfo(method=self.method, input_names=list(self.input_names),
                                      symbolic_batch=bool(sizes.symbols))
        return PassResult(gm, True)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        for node in graph_module.graph.nodes:
            if node.op == "get_attr" and not node.target.startswith(CONSTANTS_PREFIX):
                check(node.meta[META_KEY].param is not None,
                      f"get_attr {node.target} must hold a parameter or buffer of the model")


_METADATA_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}
_SHAPE_ASSERTS = {torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
                  torch.ops.aten.sym_constrain_range.default}


def _is_size_tuple(val) -> bool:
    return isinstance(val, (tuple, list)) and bool(val) and all(
        isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) for x in val)


def _substitute(node: torch.fx.Node, value) -> None:
    """Every use of ``node`` reads ``value`` (a constant) instead."""
    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, lambda a: value if a is node else a)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)


def _unpack_sizes(graph: torch.fx.Graph, raw_vals: dict) -> None:
    """Sizes a symbolic-batch graph computes as tuples (dynamo's ``x.size()``) become per-element
    arguments: the static elements integer constants, as a static capture has them (rules that
    rewrite a size, e.g. TP's head split, find them), the symbolic ones ``getitem`` nodes."""
    for n in list(graph.nodes):
        val = raw_vals.get(n)
        if n.op not in ("call_function", "call_method") or not _is_size_tuple(val):
            continue
        if not any(isinstance(x, torch.SymInt) for x in val):
            _substitute(n, tuple(int(x) for x in val))
            graph.erase_node(n)
            continue
        for user in list(n.users):
            if user.target is operator.getitem and user.args[0] is n:
                i = user.args[1]
                if isinstance(i, int) and not isinstance(val[i], torch.SymInt):
                    _substitute(user, int(val[i]))
                    graph.erase_node(user)
                continue   # NOTE: a slice is a size tuple of its own, unpacked in its turn
            elements = []
            with graph.inserting_before(user):
                for i, x in enumerate(val):
                    if isinstance(x, torch.SymInt):
                        item = graph.call_function(operator.getitem, (n, i))
                        item.meta.update({k: v for k, v in user.meta.items() if k == "nn_module_stack"})
                        raw_vals[item] = x
                        elements.append(item)
                    else:
                        elements.append(int(x))
            new = type(val)(elements) if isinstance(val, list) else tuple(elements)
            user.args = torch.fx.node.map_arg(user.args, lambda a: new if a is n else a)
            user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: new if a is n else a)
        if not n.users:
            graph.erase_node(n)


_DROPOUTS = {torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default}
_HISTCS = {torch.histc, torch.ops.aten.histc.default}


_ATTENTIONS = {torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


_NONZEROS = {torch.nonzero: False, torch.ops.aten.nonzero.default: False, torch.argwhere: False,
             torch.where: True, torch.ops.aten.where.default: True, torch.ops.aten.nonzero_numpy.default: True}
"""Data-dependent row lookups -> whether they return a tuple of index vectors (``torch.where(cond)``)."""
_FRESH = {torch.zeros_like, torch.zeros, torch.ops.aten.zeros_like.default, torch.ops.aten.zeros.default,
          torch.ops.aten.new_zeros.default, "new_zeros"}
_ACCUMULATE = {"index_add_", torch.ops.aten.index_add_.default}


def _route_expert_rows(graph: torch.fx.Graph, raw_vals: dict) -> None:
    """``torch.where(mask[e])`` / ``nonzero`` over a one-hot expert mask ->
    :func:`~galvatron_fx.runtime.experts.routed_rows` (a static fake row count); other
    data-dependent lookups stay (shape propagation then says where)."""
    for n in list(graph.nodes):
        if n.op == "call_method" and n.target == "nonzero":
            as_tuple = bool(n.kwargs.get("as_tuple", False))
        elif n.op == "call_function" and n.target in _NONZEROS and len(n.args) == 1:
            as_tuple = bool(n.kwargs.get("as_tuple", _NONZEROS[n.target]))
        else:
            continue
        one_hot = find_one_hot(n.args[0])
        classes = one_hot_classes(one_hot) if one_hot is not None else None
        if classes is None:
            continue
        with graph.inserting_before(n):
            new = graph.call_function(routed_rows, (n.args[0], classes, as_tuple))
        # NOTE: the front end's unbacked symbols are no part of the static propagation
        new.meta = {k: v for k, v in n.meta.items() if k != "unbacked_bindings"}
        if n in raw_vals:
            raw_vals[new] = raw_vals[n]
        n.replace_all_uses_with(new)
        graph.erase_node(n)


def _target(n: torch.fx.Node):
    return n.target if n.op in ("call_function", "call_method") else None


def _functional_accumulation(graph: torch.fx.Graph, raw_vals: dict) -> None:
    """``buf.index_add_(dim, rows, y)`` into a fresh buffer (``zeros_like`` ...) whose other uses
    all come after its last accumulation -> ``torch.index_add(prev, dim, rows, y)``, later uses
    reading the last one (export's functional form)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for buf in list(graph.nodes):
        if _target(buf) not in _FRESH:
            continue
        adds = sorted((u for u in buf.users if _target(u) in _ACCUMULATE and u.args and u.args[0] is buf),
                      key=order.__getitem__)
        if not adds or any(order[u] < order[adds[-1]] for u in buf.users if u not in adds) \
                or any(a is buf for u in adds for a in u.args[1:]):
            continue
        prev = buf
        for u in adds:
            with graph.inserting_before(u):
                new = graph.call_function(torch.index_add, (prev, *u.args[1:]), dict(u.kwargs))
            new.meta = dict(u.meta)
            if u in raw_vals:
                raw_vals[new] = raw_vals[u]
            u.replace_all_uses_with(new)
            graph.erase_node(u)
            prev = new
        for user in [u for u in buf.users if u in order and order[u] > order[adds[-1]]]:
            user.args = torch.fx.node.map_arg(user.args, lambda a: prev if a is buf else a)
            user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: prev if a is buf else a)


def _attention_dropout(node: torch.fx.Node) -> bool:
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return not (isinstance(p, (int, float)) and p == 0)


def _follow_the_step(node: torch.fx.Node) -> None:
    """A dropout call -> :func:`galvatron_fx.runtime.dropout.dropout` (off in ``eval_step``)."""
    args, kw = list(node.args), dict(node.kwargs)
    p = args[1] if len(args) > 1 else kw.get("p", 0.5)
    train = args[2] if len(args) > 2 else kw.get("training", kw.get("train", True))
    node.target, node.args, node.kwargs = dropout, (args[0], p, train), {}


def _raw_val(node: torch.fx.Node):
    """A front end's value of ``node``: export's ``val``, dynamo's ``example_value``."""
    return node.meta.get("val", node.meta.get("example_value"))


class _InputSizes:
    """The symbolic batch of the raw graph: its symbols (dim 0 of the batched inputs), and
    dynamo's size placeholders (``s0``), each rewritten to ``sym_size(input, dim)`` of an input
    tensor that has it, so the graph's only inputs are tensors."""

    def __init__(self):
        self.inputs: list[tuple[torch.fx.Node, torch.fx.Node]] = []   # (raw placeholder, new placeholder)
        self.pending: list[torch.fx.Node] = []
        self.symbols: set = set()
        self.done = False

    def resolve(self, graph: torch.fx.Graph, env: dict) -> None:
        if self.done:
            return
        self.done = True
        self.symbols = batch_symbols(_raw_val(raw) for raw, _new in self.inputs)
        for sym in self.pending:
            expr = _raw_val(sym).node.expr
            found = next(((new, d) for raw, new in self.inputs if isinstance(_raw_val(raw), torch.Tensor)
                          for d, size in enumerate(_raw_val(raw).shape)
                          if isinstance(size, torch.SymInt) and size.node.expr == expr), None)
            if found is None:
                raise CaptureError(f"the captured graph takes a size input {sym.name!r} that no input tensor "
                                   "has; capture with method='export'")
            env[sym] = graph.call_function(torch.ops.aten.sym_size.int, found)
            env[sym].meta[META_KEY] = NodeInfo(batch_factor=factor(_raw_val(sym), self.symbols))


def _fetch_attr(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _flatten_output(arg, env):
    """Graph output: the tensor leaves, in order; a single leaf is returned bare."""
    leaves = [env[a] for a in _leaves(arg)]
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def _leaves(arg) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg(arg, lambda n: out.append(n) or n)
    return out


def _propagate_fake(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> None:
    """Fill ``node.meta['val']`` with fake tensors (static shapes), touching no real memory."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [mode.from_tensor(t, static_shapes=True) for t in inputs]
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
    except DynamicOutputShapeException as exc:
        raise CaptureError(
            f"the captured graph computes a data-dependent shape ({exc.func}): galvatron_fx plans with static "
            "shapes and estimates only the rows of one expert in a loop over experts, "
            "rows = torch.where(F.one_hot(top_k_ids, num_classes=E).permute(2, 1, 0)[e]); fix: write the "
            "expert mask that way, or compute the value with static shapes (grouped experts, a mask "
            "multiply)") from exc
    except Exception as exc:  # noqa: BLE001
        raise CaptureError(f"shape propagation of the captured graph failed: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
