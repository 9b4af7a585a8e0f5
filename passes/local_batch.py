"""Local batch pass: shape constants written for the captured global batch -> this rank's batch.

The fallback for graphs captured with a static batch (``GraphInfo.static_batch_reason`` says why;
see :mod:`galvatron_fx.batch_symbol`): a graph with a symbolic batch computes its sizes and is left
as it is, like an fx graph. Graphs from dynamo and export with static shapes bake the captured batch ``B`` into shape arguments
(``x.view(4, 8, 96)``, ``aten.expand(mask, [4, 1, 8, 8])``, ``x.view(32, 32)`` for ``B * S``);
fx graphs compute them from ``x.size(0)`` and need nothing. A layer that runs on ``b`` samples
(``b = B / (micro_batches * dp)``) must use ``b``.

Takes SPLIT, leaves SPLIT. Input: the top module of :mod:`.split_layers` (``meta["val"]`` of every
node still describes the captured global batch) and, per layer, its local batch ``b``. fx graphs
(``x.size(0)`` is computed at run time) are left as they are.

Output (in place): in every layer graph, the *first* integer of a shape argument (a list/tuple
argument, or the integer varargs of ``view``/``reshape``/``expand``/``repeat``-style method calls) is
scaled by ``b / B`` when it equals dim 0 of the node's output, that dim is a multiple of ``B`` and
the node is

* *batched*: it depends on a layer input whose dim 0 is ``B`` (activations, graph inputs), or
* *batch-shaped constant*: it depends on no trainable parameter (or broadcasts one: ``expand``,
  ``repeat``) and no batched value, its output's dim 0 is ``B`` exactly and a later node combines
  it with a batched value or it leaves the layer (ViT's ``cls_token.expand(B, -1, -1)``, HF's expanded ``token_type_ids`` buffer, masks built from ``torch.arange(B)``). Such a value
  crossing to a layer with another ``dp`` keeps the producer's batch (a known limitation).

Convention (the runtime's, see :mod:`galvatron_fx.runtime.reshard`): batch on dim 0; flattening
keeps the batch outermost (``[B, S, H] -> [B*S, H]``). Returns the number of rewritten constants.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import ConfigError
from ..ir import META_KEY, carries_batch, layer_module_name
from .context import ContextPass
from .split_layers import is_param_node

BAKED_SHAPE_METHODS = ("dynamo", "export")
"""Front ends whose graphs bake the captured batch into shape arguments."""


class LocalBatchPass(ContextPass):
    """Each layer of a dynamo / export graph computes on its own ``B / (micro_batches * dp)``
    samples (see the module docstring). ``rewritten``: the number of constants changed."""

    needs_split = True
    name = "local_batch"
    rewritten = 0

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        ctx, plan = self.ctx, self.ctx.stage_plan
        batch = ctx.global_batch
        if not batch or ctx.method not in BAKED_SHAPE_METHODS or ctx.symbolic_batch:
            return PassResult(graph_module, False)
        local = [batch // (plan.micro_batches * (lp.dp // lp.cp)) for lp in plan.layers]
        if any(b != batch for b in local):
            _refuse_if_ambiguous(graph_module, batch)
            _refuse_if_mixing(graph_module, batch, local)
        self.rewritten = localize_batch(graph_module, batch, local)
        return PassResult(graph_module, self.rewritten > 0)


def _refuse_if_mixing(top: torch.fx.GraphModule, batch: int, local: list[int]) -> None:
    """Refuse when a layer computes a ``[B, B]`` value (``B`` the captured batch: CLIP's similarity
    logits, in-batch negatives): with a static batch the coupling cannot be told for
    sure (:func:`galvatron_fx.batch_symbol.coupling` needs the symbol), and splitting such a value's
    batch trains something else. Conservative: no input has another extent equal to ``B`` here
    (:func:`_refuse_if_ambiguous` ran first)."""
    for i, b in enumerate(local):
        layer = getattr(top, layer_module_name(i), None)
        if b == batch or layer is None:
            continue
        for n in layer.graph.nodes:
            val = n.meta.get("val")
            # NOTE: 2-D only: a [B, heads, S, S] attention score with heads == B mixes nothing
            if n.op == "call_function" and isinstance(val, torch.Tensor) and list(val.shape) == [batch, batch]:
                raise ConfigError(f"{n.name} gives a {list(val.shape)} value: the captured batch of {batch} on both dims, "
                                  "so it may mix the samples of a batch (a similarity matrix), and this graph's batch is "
                                  "static, so a plan that splits the batch cannot keep it exact; capture with "
                                  "gfx.capture(method='dynamo') (a symbolic batch: such layers then all-gather it) or "
                                  "use a plan with dp=1 and micro_batches=1 there")


def _refuse_if_ambiguous(top: torch.fx.GraphModule, batch: int) -> None:
    """Refuse when the captured batch also appears as another extent of a graph input (a sequence
    length): a baked constant built from that extent (``arange(S)``) cannot be told from one of the
    batch, and rescaling the wrong one trains something else or fails inside torch."""
    extents = {int(d) for n in top.graph.nodes if n.op == "placeholder"
               for d in (getattr(n.meta.get("val"), "shape", ()) or ())[1:]}
    if batch in extents:
        raise ConfigError(f"this graph bakes in its global batch of {batch}, which is also a length of its inputs "
                          "(e.g. the sequence), so a plan that splits the batch cannot tell their shape constants "
                          "apart; capture it with gfx.capture (dynamo or export keep the batch symbolic by default) and "
                          "gfx.transform, or use a global batch that differs from the inputs' other dimensions")


def localize_batch(top: torch.fx.GraphModule, global_batch: int, local_batches: list[int]) -> int:
    """Rewrite every ``layers_<i>`` of ``top`` for ``local_batches[i]`` samples (see module docstring)."""
    count = 0
    for i, b in enumerate(local_batches):
        layer = getattr(top, layer_module_name(i), None)
        if layer is None or b == global_batch:
            continue
        n = _localize_layer(layer, global_batch, b)
        if n:
            layer.recompile()
        count += n
    return count


def _localize_layer(layer: torch.fx.GraphModule, B: int, b: int) -> int:
    batched: dict[torch.fx.Node, bool] = {}
    has_param: dict[torch.fx.Node, bool] = {}
    for n in layer.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder":
            batched[n] = isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B
            # NOTE: a tied weight received from its owner layer keeps the owner's parameter record
            from_param = getattr(n.meta.get(META_KEY), "param", None) is not None
            has_param[n] = not batched[n] and (bool(getattr(v, "requires_grad", False)) or from_param)
        elif n.op == "get_attr":
            batched[n], has_param[n] = False, is_param_node(n)
        else:
            ins = n.all_input_nodes
            batched[n] = carries_batch(n) and any(batched.get(x, False) for x in ins)
            has_param[n] = any(has_param.get(x, False) for x in ins)
    count = 0
    for n in layer.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        v = n.meta.get("val")
        if not (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] % B == 0 and v.shape[0] > 0):
            continue
        # NOTE: a parameter broadcast to the batch (ViT's ``cls_token.expand(B, -1, -1)``) is
        # batch-shaped too, though it depends on a parameter
        constant = not has_param[n] or _op_name(n) in BROADCAST_OPS
        if not batched[n] and not (constant and v.shape[0] == B and _meets_batched(n, batched)):
            continue
        count += _rewrite_first_shape_int(n, int(v.shape[0]), B, b)
    return count


def _meets_batched(n: torch.fx.Node, batched: dict) -> bool:
    """Some later node reads a value derived from ``n`` together with a batched value."""
    seen, todo = set(), [n]
    while todo:
        x = todo.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "output":
                return True  # NOTE: leaves the layer (a mask for the blocks): assume it meets the batch there
            if any(batched.get(y, False) for y in u.all_input_nodes if y is not x):
                return True
            todo.append(u)
    return False


SHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "expand", "broadcast_to", "repeat", "tile",
                       "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full",
                       "rand", "randn", "empty_strided", "arange"})
"""Ops whose integer list / integer varargs are a shape (by name: method, function or aten packet)."""
BROADCAST_OPS = frozenset({"expand", "broadcast_to", "repeat", "tile"})
"""Shape ops that can broadcast a parameter to the batch."""


def _op_name(n: torch.fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    name = getattr(n.target, "__name__", "")
    return name.split(".")[0]


def _rewrite_first_shape_int(n: torch.fx.Node, dim0: int, B: int, b: int) -> int:
    if _op_name(n) not in SHAPE_OPS:
        return 0

    def scaled(c: int) -> int:
        if (c * b) % B:
            raise ConfigError(f"cannot localise the batch in {n.format_node()}: {c} x {b} / {B} is not whole")
        return c * b // B

    args = list(n.args)
    for j, a in enumerate(args):
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], int) and not isinstance(a[0], bool):
            if a[0] == dim0:
                args[j] = type(a)([scaled(a[0]), *a[1:]])
                n.args = tuple(args)
                return 1
            return 0
    ints = [j for j, a in enumerate(args) if isinstance(a, int) and not isinstance(a, bool)]
    first = 1 if n.op == "call_method" else 0
    if _op_name(n) == "arange" and len(args) != 1:
        return 0
    if ints and ints[0] == first and args[first] == dim0:
        args[first] = scaled(args[first])
        n.args = tuple(args)
        return 1
    size = n.kwargs.get("size")
    if isinstance(size, (list, tuple)) and size and size[0] == dim0:
        n.kwargs = {**n.kwargs, "size": type(size)([scaled(size[0]), *size[1:]])}
        return 1
    return 0
