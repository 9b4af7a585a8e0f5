"""Sharding rule of the cross entropy: vocabulary-parallel logits give a vocabulary-parallel loss.

A cross entropy whose logits are tp-sharded along their class dim (dim 1, torch's convention; the
last dim of HF's ``logits.view(-1, V)``), with a replicated target and no class ``weight``, runs on
the shards: the tensor-parallel pass replaces it by
:func:`galvatron_fx.runtime.vocab_parallel.vocab_parallel_cross_entropy` (``ignore_index``,
``reduction`` and ``label_smoothing`` kept), so the logits are never gathered. Its result (the loss)
is replicated. Any other cross entropy of sharded logits is Unsupported here; the analyzer then
all-gathers the logits before it (:data:`galvatron_fx.sharding.analysis.LOSSES`).

:func:`bind_cross_entropy` reads a cross-entropy node of any capture flavour
(``F.cross_entropy`` from fx / dynamo, ``aten.cross_entropy_loss`` from export) into one record;
:mod:`galvatron_fx.passes.token_loss` uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from .registry import register_rule
from .state import TP, Sharded, Unsupported, op_name, shape_of, tensor_val

REDUCTIONS = ("none", "mean", "sum")
"""at::Reduction by number (``aten.cross_entropy_loss`` takes 0, 1, 2)."""


@dataclass(frozen=True)
class CrossEntropyArgs:
    """A cross-entropy node's arguments (``reduction`` as a string; ``legacy``: ``size_average`` /
    ``reduce`` were given, which override ``reduction``)."""

    input: torch.fx.Node
    target: object
    weight: object
    ignore_index: int
    reduction: str
    label_smoothing: float
    legacy: bool
    aten: bool

    @property
    def reduction_slot(self) -> tuple[int, str]:
        """``(positional index, keyword)`` of the reduction argument in this flavour."""
        return (3, "reduction") if self.aten else (6, "reduction")


_FUNCTION_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                  "label_smoothing")
_ATEN_ARGS = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")


def bind_cross_entropy(node) -> CrossEntropyArgs | None:
    """The arguments of a cross-entropy node (``F.cross_entropy`` or ``aten.cross_entropy_loss``), or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    name = op_name(node)
    if node.target is F.cross_entropy:
        names, aten = _FUNCTION_ARGS, False
    elif name == "cross_entropy_loss":
        names, aten = _ATEN_ARGS, True
    else:
        return None
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    reduction = bound.get("reduction", 1 if aten else "mean")
    if isinstance(reduction, int):
        reduction = REDUCTIONS[reduction]
    return CrossEntropyArgs(
        input=bound.get("input", bound.get("self")), target=bound.get("target"), weight=bound.get("weight"),
        ignore_index=int(bound.get("ignore_index", -100)), reduction=reduction,
        label_smoothing=float(bound.get("label_smoothing", 0.0)),
        legacy=bound.get("size_average") is not None or bound.get("reduce") is not None, aten=aten)


@dataclass(frozen=True)
class VocabLoss:
    """A cross entropy the tensor-parallel pass runs on vocabulary shards: ``num_classes`` (global
    vocabulary), ``dim`` (the logits' class dim) and ``origins`` (the column linears of the logits)."""

    num_classes: int
    dim: int
    origins: frozenset


@register_rule("cross_entropy", "cross_entropy_loss")
def cross_entropy(an, node, ins, states):
    ce = bind_cross_entropy(node)
    if ce is None or ce.weight is not None or ce.legacy or not isinstance(ce.input, torch.fx.Node):
        raise Unsupported
    s = an.st(ce.input)
    # NOTE: contiguous equal chunks only (this rank's columns are [rank * V/tp, (rank + 1) * V/tp))
    if not (isinstance(s, Sharded) and s.kind == TP and getattr(s, "plain", True)) or an.st(ce.target) is not None:
        raise Unsupported
    val = tensor_val(ce.input)
    class_dim = 1 if val.dim() > 1 else 0
    if s.dim % val.dim() != class_dim:
        raise Unsupported
    classes = shape_of(ce.input)[class_dim]
    if classes % an.tp:
        raise Unsupported
    an.res.vocab_losses[node.name] = VocabLoss(classes, class_dim, frozenset(s.origins))
    return None
