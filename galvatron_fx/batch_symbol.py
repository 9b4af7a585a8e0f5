"""Symbolic batch: the batch is captured as a symbol, so every batch-dependent shape is computed.

``capture`` (dynamo and export) marks dim 0 of the batched inputs (:func:`batch_positions`) as
dynamic: the graph computes ``view(x, [sym_size(x, 0), 16, -1, 16])`` instead of baking the
captured batch ``B`` into ``view(x, [16, 16, -1, 16])``. A layer then runs on whatever rows it is
given (a DP shard, a micro-batch, a smaller last batch), and nothing has to tell the batch from a
sequence length that happens to equal it. The normalised graph keeps concrete ``meta["val"]``
shapes (at the captured batch: the cost model and the analyses see numbers); what was symbolic is
recorded per node (:func:`annotate`): ``NodeInfo.batch_dims`` for tensors, ``batch_factor`` for
sizes. Where the batch cannot stay symbolic (the model branches on it; a batch of 1), capture
falls back to a static batch with a one-line note (``GraphInfo.static_batch_reason``).
"""

from __future__ import annotations

import torch

from .ir import META_KEY


def batch_positions(inputs: list) -> list[int]:
    """Positions of the tensor inputs whose dim 0 is the batch: the first input's dim 0, when it is
    at least 2 (a batch of 1 cannot be symbolic: tracers specialise sizes 0 and 1)."""
    tensors = [(i, t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not tensors or int(tensors[0][1].shape[0]) < 2:
        return []
    batch = int(tensors[0][1].shape[0])
    return [i for i, t in tensors if int(t.shape[0]) == batch]


def batch_symbols(values) -> set:
    """The symbols of dim 0 of ``values`` (the batched inputs' fake tensors)."""
    out = set()
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], torch.SymInt):
            expr = v.shape[0].node.expr
            if getattr(expr, "is_Symbol", False):
                out.add(expr)
    return out


def factor(size, symbols: set) -> int | None:
    """``k`` when ``size`` (an int or SymInt) is ``k x`` one of the batch ``symbols``, else None."""
    if not isinstance(size, torch.SymInt) or not symbols:
        return None
    expr = size.node.expr
    for s in symbols:
        q = expr / s
        if getattr(q, "is_Integer", False) and int(q) > 0:
            return int(q)
    return None


def annotate(info, raw_val, symbols: set) -> None:
    """Record on ``info`` (a NodeInfo) which parts of a node's symbolic value are the batch."""
    if isinstance(raw_val, torch.SymInt):
        info.batch_factor = factor(raw_val, symbols)
    elif isinstance(raw_val, torch.Tensor):
        info.batch_dims = tuple((d, k) for d, size in enumerate(raw_val.shape)
                                if (k := factor(size, symbols)) is not None)


def coupling(node) -> str | None:
    """Why ``node`` mixes the samples of a batch, or None: a value with the batch on two dims
    (a ``[B, B]`` similarity matrix: in-batch negatives, CLIP's logits), or batch norm in training
    mode (statistics over the batch). Split over ranks or micro-batches such a node computes
    something else than on the whole batch."""
    info = node.meta.get(META_KEY)
    dims = sorted({d for d, _k in getattr(info, "batch_dims", ())})
    val = node.meta.get("val")
    shape = list(val.shape) if isinstance(val, torch.Tensor) else "?"
    if len(dims) >= 2:
        return f"{node.name} ({_op(node)}) gives a {shape} value with the batch on dims {dims}"
    if "batch_norm" in _op(node) and "no_training" not in _op(node) and getattr(info, "batch_dims", ()):
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        if training is True:
            return f"{node.name} ({_op(node)}) normalises with statistics over the batch (training mode)"
    if node.op != "placeholder" and _base_op(node) in _PRODUCTS and sum(_batch_reduced(a) for a in set(node.all_input_nodes)) >= 2:
        return (f"{node.name} ({_op(node)}) multiplies two statistics over the whole batch (a router's "
                "load-balancing loss: token fractions x mean probabilities)")
    return None


_PRODUCTS = ("mul", "mul_", "matmul", "mm", "bmm", "einsum")


def _base_op(node) -> str:
    """The op's name without overload (``aten.mul.Tensor`` -> ``mul``)."""
    t = node.target
    return t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else _op(node)
_REDUCED = "galvatron.batch_reduced"


def _batch_reduced(node) -> bool:
    """Whether ``node`` is a tensor computed from batched values but no longer indexed by the
    batch (a mean or sum over it, or something computed from one): a statistic of the batch.
    Products of two such are not sums over samples, so shards cannot add them up."""
    if _REDUCED in node.meta:
        return node.meta[_REDUCED]
    info = node.meta.get(META_KEY)
    val = node.meta.get("val")
    out = (isinstance(val, torch.Tensor) and val.is_floating_point() and not getattr(info, "batch_dims", ())
           and not _routed(node)
           and any(getattr(a.meta.get(META_KEY), "batch_dims", ()) or _batch_reduced(a) for a in node.all_input_nodes))
    node.meta[_REDUCED] = bool(out)
    return node.meta[_REDUCED]


_ROUTED = "galvatron.routed"


def _routed(node) -> bool:
    """Whether ``node`` holds rows a loop over experts picked (``x[torch.where(mask[e])]``: the
    normalise pass's ``routed_rows``), or values computed from them until the batch is a dim
    again (their sum into ``[T, H]``): some of the batch's tokens, not a statistic of it."""
    if _ROUTED not in node.meta:
        from .sharding.experts import is_routed_rows

        node.meta[_ROUTED] = is_routed_rows(node) or (
            not getattr(node.meta.get(META_KEY), "batch_dims", ()) and any(
                _routed(a) for a in node.all_input_nodes if a.op != "placeholder"))
    return node.meta[_ROUTED]


def _op(node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))
