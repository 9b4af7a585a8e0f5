"""Graph normalisation for the galvatron backend (step 1 of the package docstring).

Takes the GraphModule and example inputs dynamo hands the backend (parameters, buffers and inputs
all as placeholders); gives each placeholder's role and name (:func:`_classify_placeholders`), the
index of the scalar loss output (:func:`_loss_output`), the graph in ``gfx.capture(method="dynamo")``'s
normalised, layer-grouped form with the loss moved to output 0 (:func:`_normalised_graph`), and the
global batch size of the inputs (:func:`_batch_size`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from ..errors import ConfigError
from ..ir import batch_size_of


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


def traced_modules() -> list[nn.Module]:
    """The modules among the locals of the frame dynamo is tracing (``self`` of ``forward``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        local_vars = dict(getattr(tx, "f_locals", {}) or {})
    except Exception:  # noqa: BLE001 - private API; callers fall back to dynamo's sources
        return []
    # NOTE: a decorated forward (``wrapper(*args, **kwargs)``) holds the module in ``args``
    found = [v for v in local_vars.values() if isinstance(v, nn.Module)]
    found += [x for v in local_vars.values() if isinstance(v, (tuple, list)) for x in v if isinstance(x, nn.Module)]
    return found


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
    raise ConfigError(
        "the graph torch.compile handed the galvatron backend returns no scalar loss: either the model's "
        "output is not its training loss, or a graph break cut the forward before the loss"
        + (f" (the graph ends at {where})" if where else "")
        + "; compile with fullgraph=True to see dynamo's reason for the break and make that code traceable")


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
