"""Graph normalisation for the galvatron backend (step 1 of the package docstring).

Takes the GraphModule and example inputs dynamo hands the backend (parameters, buffers and inputs
all as placeholders); gives each placeholder's role and name (:func:`_classify_placeholders`), the
index of the scalar loss output (:func:`_loss_output`), the graph in ``gfx.capture(method="dynamo")``'s
normalised, layer-grouped form with the loss moved to output 0 (:func:`_normalised_graph`), and the
global batch size of the inputs (:func:`_batch_size`).

Dynamo hands the backend a graph specialised to the call's batch (``dynamic=False``, or a first
call). :func:`recaptured` therefore captures the traced module again, from the call's own
arguments, exactly as ``gfx.capture(model, args, kwargs, method="dynamo")`` does: with a symbolic
batch (:mod:`galvatron_fx.batch_symbol`), so the program runs on shards, micro-batches and
batches of any size, and the plan is the one ``galvatron-fx plan`` makes. Where that is not
possible (the traced frame is not a module's forward; an input of the capture is not a graph
input of dynamo's graph; the model specialises its batch) the backend keeps dynamo's static graph.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from ..errors import ConfigError
from ..ir import META_KEY, batch_size_of


@dataclass
class _Role:
    kind: str           # "param" | "buffer" | "input"
    name: str           # fqn (param/buffer) or input name
    source: Any = None  # dynamo Source, for guard removal


def _source_name(node: torch.fx.Node) -> str:
    arg = node.meta.get("grapharg")
    src = getattr(arg, "source", None)
    if src is None:
        return ""
    name = src.name
    return name() if callable(name) else str(name)


def _root_frame():
    """The frame dynamo is tracing (its code and initial locals), or None outside a trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - private API; callers fall back to dynamo's sources
        return None


def traced_modules() -> list[nn.Module]:
    """The modules among the locals of the frame dynamo is tracing (``self`` of ``forward``)."""
    tx = _root_frame()
    local_vars = dict(getattr(tx, "f_locals", {}) or {})
    # NOTE: a decorated forward (``wrapper(*args, **kwargs)``) holds the module in ``args``
    found = [v for v in local_vars.values() if isinstance(v, nn.Module)]
    found += [x for v in local_vars.values() if isinstance(v, (tuple, list)) for x in v if isinstance(x, nn.Module)]
    return found


def frame_call() -> tuple[nn.Module, tuple, dict] | None:
    """``(module, args, kwargs)`` of the call dynamo is tracing: the arguments of its root frame
    (a module's ``forward``, or a decorator's ``wrapper(self, *args, **kwargs)`` around it), read
    from the frame's initial locals; None when its first argument is not a module."""
    tx = _root_frame()
    code, local_vars = getattr(tx, "f_code", None), dict(getattr(tx, "f_locals", {}) or {})
    if code is None:
        return None
    names, n_pos, n_kw = code.co_varnames, code.co_argcount, code.co_kwonlyargcount
    try:
        positional = [local_vars[v] for v in names[:n_pos]]
        k = n_pos + n_kw
        if code.co_flags & inspect.CO_VARARGS:
            positional += list(local_vars[names[k]])
            k += 1
        kwargs = {v: local_vars[v] for v in names[n_pos:n_pos + n_kw]}
        if code.co_flags & inspect.CO_VARKEYWORDS:
            kwargs.update(local_vars[names[k]])
    except (KeyError, TypeError):
        return None
    if not positional or not isinstance(positional[0], nn.Module):
        return None
    return positional[0], tuple(positional[1:]), kwargs


@dataclass
class Recaptured:
    """The module's graph captured with a symbolic batch, and how dynamo's graph maps onto it."""

    graph: torch.fx.GraphModule
    module: nn.Module
    data_pos: list[int]           # per graph input: its placeholder index in dynamo's graph
    out_pos: list[int | None]     # per output of dynamo's graph: its index in ``graph``'s outputs
    tuple_out: bool = True        # dynamo's graph returns a tuple (else one bare value)


def recaptured(example_inputs, roles: list[_Role], out_node: torch.fx.Node, loss_index: int) -> Recaptured | None:
    """The traced module captured again with a symbolic batch (module docstring), or None."""
    from ..frontend import capture, input_names

    call = frame_call()
    if call is None:
        return None
    module, args, kwargs = call
    leaves, _spec, tensor_pos, _names = input_names(module, args, kwargs)
    where = {id(v): i for i, (v, r) in enumerate(zip(example_inputs, roles)) if r.kind == "input"}
    if any(id(leaves[p]) not in where for p in tensor_pos):
        return None   # a tensor argument dynamo's graph does not take (unused, or read as a constant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a static fallback keeps dynamo's own graph instead
        try:
            graph = capture(module, args, kwargs, method="dynamo")
        except Exception:  # noqa: BLE001 - dynamo's own graph traced: keep it
            return None
    if not graph.meta[META_KEY].symbolic_batch:
        return None
    outs = _outputs(graph.graph)
    inner = {o.name: (k, _value_meta(o)) for k, o in enumerate(outs) if isinstance(o, torch.fx.Node)}
    # NOTE: the same code traced twice names its nodes alike; the values must agree too
    out_pos = [k if (k := inner.get(getattr(o, "name", None), (None, None))[0]) is not None
               and inner[o.name][1] == _value_meta(o) else None for o in _outputs(out_node.graph)]
    if out_pos[loss_index] is None:   # the loss: the capture's first scalar (its output may be renamed)
        out_pos[loss_index] = next((k for k, o in enumerate(outs) if _is_loss(o)), None)
    if out_pos[loss_index] is None:
        return None
    _loss_to_front(graph, out_pos[loss_index])
    moved = _loss_first_positions(len(outs), out_pos[loss_index])
    return Recaptured(graph, module, [where[id(leaves[p])] for p in tensor_pos],
                      [None if k is None else moved[k] for k in out_pos], isinstance(out_node.args[0], (tuple, list)))


def dynamo_graph(gm: torch.fx.GraphModule, example_inputs, roles: list[_Role], out_node: torch.fx.Node,
                 loss_index: int) -> Recaptured:
    """Dynamo's own graph, normalised (:func:`_normalised_graph`; its batch static): the fallback
    where :func:`recaptured` is not possible."""
    modules = traced_modules()
    return Recaptured(_normalised_graph(gm, example_inputs, roles, loss_index), modules[0] if modules else None,
                      [i for i, r in enumerate(roles) if r.kind == "input"],
                      _loss_first_positions(len(_outputs(out_node.graph)), loss_index),
                      isinstance(out_node.args[0], (tuple, list)))


def _loss_first_positions(n: int, front: int) -> list[int]:
    """Where each of ``n`` outputs lands when output ``front`` (the loss) moves to 0."""
    return [0 if k == front else k + (k < front) for k in range(n)]


def _is_loss(node) -> bool:
    meta = _value_meta(node)
    return meta is not None and meta[0] == () and meta[1].is_floating_point


def _outputs(graph: torch.fx.Graph) -> list:
    outs = next(n for n in graph.nodes if n.op == "output").args[0]
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def _value_meta(node) -> tuple | None:
    """(shape, dtype) of a node's example value, sizes as ints (the symbolic batch at its hint)."""
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return tuple(optimization_hint(s, fallback=-1) for s in val.shape), val.dtype


def _loss_to_front(gm: torch.fx.GraphModule, index: int) -> None:
    """Move output ``index`` (the loss) to output 0, in place (train_step reads output 0)."""
    if index == 0:
        return
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    outs.insert(0, outs.pop(index))
    out.args = (tuple(outs),)
    gm.recompile()


def _traced_names() -> dict[int, str]:
    """id(tensor) -> first FQN in the module(s) being traced (``named_parameters`` order, so tied
    weights get the name ``gfx.capture`` gives them), from dynamo's current frame's locals."""
    from ..passes.normalize import model_tensors

    names: dict[int, str] = {}
    for value in traced_modules():
        if isinstance(value, nn.Module):
            for key, info in model_tensors(value).items():
                names.setdefault(key, info.fqn)
    return names


def _classify_placeholders(gm: torch.fx.GraphModule, example_inputs) -> list[_Role]:
    roles, used = [], set()
    traced = _traced_names()
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        src = _source_name(node)
        source = getattr(node.meta.get("grapharg"), "source", None)
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"the graph input {node.name!r} ({src or type(value).__name__}) is not a tensor "
                              "(dynamic shapes?): compile with torch.compile(..., dynamic=False)")
        state = re.findall(r"\._(modules|parameters|buffers)\['([^']*)'\]", src)
        if isinstance(value, nn.Parameter) or (state and state[-1][0] in ("parameters", "buffers")):
            fqn = traced.get(id(value)) or ".".join(name for _kind, name in state) or node.name
            roles.append(_Role("param" if isinstance(value, nn.Parameter) else "buffer", fqn, source))
        elif src.startswith("L["):
            tokens = re.findall(r"\[(?:'([^']*)'|(\d+))\]", src)
            parts = [k or i for k, i in tokens if k != "kwargs"] or [node.name]
            name = _unique("_".join(parts), used)
            roles.append(_Role("input", name, source))
        else:  # a tensor captured from a global or closure: treat it as a (constant) buffer
            roles.append(_Role("buffer", _unique(f"_captured_{node.name}", used), source))
    return roles


def _unique(name: str, used: set) -> str:
    from ..frontend import _identifier

    base, k = _identifier(name), 1
    name = base
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name


def _loss_output(gm: torch.fx.GraphModule, out_node: torch.fx.Node) -> int:
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    for i, o in enumerate(outs):
        val = o.meta.get("example_value", o.meta.get("val")) if isinstance(o, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point():
            return i
    last = [n for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method"]
    trace = (last[-1].meta.get("stack_trace") or "").strip().splitlines() if last else []
    where = next((line.strip() for line in reversed(trace) if line.strip().startswith("File")), "")
    # NOTE: dynamo breaks the graph at ops whose output shape depends on the data unless told otherwise
    dynamic = "" if torch._dynamo.config.capture_dynamic_output_shape_ops else (
        "; a data-dependent op (torch.where(mask) / nonzero, as in a loop over expert modules) breaks it "
        "unless torch._dynamo.config.capture_dynamic_output_shape_ops = True is set before torch.compile")
    raise ConfigError(
        "the graph torch.compile handed the galvatron backend returns no scalar loss: either the model's "
        "output is not its training loss, or a graph break cut the forward before the loss"
        + (f" (the graph ends at {where})" if where else "")
        + "; compile with fullgraph=True to see dynamo's reason for the break and make that code traceable"
        + dynamic)


def _holder(gm, example_inputs, roles) -> nn.Module:
    """A module tree holding the graph's parameters and buffers under their FQNs (for NormalizePass)."""
    root = nn.Module()
    for value, role in zip(example_inputs, roles):
        if role.kind == "input":
            continue
        *path, leaf = role.name.split(".")
        mod = root
        for atom in path:
            if not hasattr(mod, atom):
                mod.add_module(atom, nn.Module())
            mod = getattr(mod, atom)
        if role.kind == "param":
            mod.register_parameter(leaf, value)
        else:
            mod.register_buffer(leaf, value)
    return root


def _normalised_graph(gm, example_inputs, roles, loss_index: int) -> torch.fx.GraphModule:
    from ..frontend import normalise

    raw = torch.fx.GraphModule(gm, _loss_first(gm.graph, loss_index))
    placeholders = [n for n in raw.graph.nodes if n.op == "placeholder"]
    sources = {n.name: t for n, t in zip(placeholders, example_inputs)}
    data = [t for t, r in zip(example_inputs, roles) if r.kind == "input"]
    names = [r.name for r in roles if r.kind == "input"]
    return normalise(raw, _holder(gm, example_inputs, roles), data, names, sources, method="dynamo")


def _loss_first(graph: torch.fx.Graph, loss_index: int) -> torch.fx.Graph:
    """A copy of ``graph`` whose output is ``(loss, *others)`` (train_step reads output 0)."""
    new = torch.fx.Graph()
    env: dict = {}
    out = new.graph_copy(graph, env)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    outs.insert(0, outs.pop(loss_index))
    new.output(tuple(outs) if len(outs) > 1 else outs[0])
    return new


def _batch_size(data: list[torch.Tensor]) -> int:
    batch = batch_size_of(data)
    if batch is None:
        raise ConfigError("the compiled model got no batched tensor input; the galvatron backend needs "
                          "the global batch along dim 0 of its tensor arguments")
    return batch
