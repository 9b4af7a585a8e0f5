"""Vocabulary-parallel cross entropy and vocabulary-sharded graph outputs (run time).

A column-parallel LM head leaves each rank of a TP group the logits of its contiguous vocabulary
slice ``[vocab_start, vocab_start + V / tp)``. :func:`vocab_parallel_cross_entropy` computes
``F.cross_entropy`` of the *whole* logits from those slices, without ever materialising them
(Megatron's ``vocab_parallel_cross_entropy``), per token ``i`` with target ``t_i``:

* ``m_i = max_c x_ic``: local max, all-reduced with MAX (a stabiliser: no gradient flows through it);
* ``z_ic = x_ic - m_i``; local ``sum_c exp(z_ic)``, the target logit ``z_it`` (0 on the ranks whose
  slice does not hold ``t_i``) and, with label smoothing, ``sum_c z_ic``: one SUM all-reduce of
  those two or three ``[tokens]`` vectors (stacked);
* ``loss_i = log sum_c exp(z_ic) - z_it``; with label smoothing ``e``,
  ``(1 - e) loss_i + e / V * (V log sum_c exp(z_ic) - sum_c z_ic)`` (torch's definition);
  tokens whose target is ``ignore_index`` give 0;
* reductions as torch: ``"none"`` (per token), ``"sum"``, ``"mean"`` (over the non-ignored tokens).

Saved for backward: the local softmax ``[tokens, V / tp]`` in the logits' dtype and one
``[tokens]`` index tensor of the target's dtype (what ``F.cross_entropy`` saves: its log-softmax,
divided by ``tp``, and the target; the cost model counts exactly that); the backward is local (``softmax - (1 - e) onehot - e / V``, times the incoming gradient):
no collective.

:func:`vocab_shard_output` marks a vocabulary shard that leaves the graph as an output (HF models
return their logits beside the loss): training keeps only this rank's slice (full logits are never
materialised); :func:`assemble_output` all-gathers a marked output into the whole tensor, which
``eval_step(return_outputs=True)`` does (:func:`galvatron_fx.runtime.module.gather_outputs`).

On fake or meta tensors nothing is communicated (shapes only), as in :mod:`.tp_ops`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import all_gather_single
from .tp_ops import _is_fake, group_of

__all__ = ["vocab_parallel_cross_entropy", "vocab_shard_output", "assemble_output", "shard_of", "REDUCTIONS"]

REDUCTIONS = ("none", "mean", "sum")
SHARD_ATTR = "_galvatron_vocab_shard"
_OUTSIDE, _IGNORED = -1, -2


def _check_targets(target: torch.Tensor, valid: torch.Tensor, num_classes: int) -> None:
    bad = valid & ((target < 0) | (target >= num_classes))
    msg = f"cross entropy: a target is outside [0, {num_classes}) and not the ignore_index"
    if target.device.type == "cpu":
        if bool(bad.any()):
            raise IndexError(msg)
    else:   # NOTE: no host sync on accelerators
        torch._assert_async(~bad.any(), msg)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, num_classes, key, ignore_index, reduction, label_smoothing):
        group, size = group_of(key)
        comm = size > 1 and not _is_fake(logits)
        x = logits.movedim(1, -1)                        # [..., V_local]: classes last
        n_local = x.shape[-1]
        stat_dtype = torch.promote_types(x.dtype, torch.float32)
        valid = target != ignore_index
        if not _is_fake(target):
            _check_targets(target, valid, num_classes)
        inside = (target >= vocab_start) & (target < vocab_start + n_local)
        local_t = (target - vocab_start).masked_fill(~inside, 0)
        # one index tensor for backward (the bytes torch saves for its target): the local column,
        # OUTSIDE where another rank holds the target, IGNORED where it is the ignore_index
        code = local_t.masked_fill(~inside, _OUTSIDE).masked_fill(~valid, _IGNORED)

        m = x.detach().amax(dim=-1).to(stat_dtype)
        if comm:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = x.to(stat_dtype) - m.unsqueeze(-1)           # a new tensor: exp'd and normalised in place below
        stats = [None, z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)]
        if label_smoothing:
            stats.append(z.sum(dim=-1))
        e = z.exp_()
        stats[0] = e.sum(dim=-1)
        packed = torch.stack(stats)
        if comm:
            dist.all_reduce(packed, group=group)
        sum_exp, picked = packed[0], packed[1]
        lse = sum_exp.log()
        loss = lse - picked
        if label_smoothing:
            smooth = num_classes * lse - packed[2]       # -sum_c log p_c
            loss = (1.0 - label_smoothing) * loss + (label_smoothing / num_classes) * smooth
        loss = loss.masked_fill(~valid, 0.0)

        softmax = e.div_(sum_exp.unsqueeze(-1)).to(logits.dtype)
        ctx.save_for_backward(softmax, code)
        ctx.smoothing, ctx.num_classes, ctx.reduction = float(label_smoothing), int(num_classes), reduction
        if reduction == "none":
            return loss.to(logits.dtype)
        total = loss.sum()
        if reduction == "sum":
            return total.to(logits.dtype)
        count = valid.sum()
        ctx.count = count
        return (total / count).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, code = ctx.saved_tensors
        inside, valid, local_t = code >= 0, code != _IGNORED, code.clamp(min=0)
        eps, n = ctx.smoothing, ctx.num_classes
        g = grad.to(torch.promote_types(softmax.dtype, torch.float32))
        if ctx.reduction == "mean":
            g = g / ctx.count
        weight = g * valid.to(g.dtype)                   # [...]: per token
        out = softmax.to(weight.dtype)
        if eps:
            out = out - eps / n
        out = out.scatter_add(-1, local_t.unsqueeze(-1), (-(1.0 - eps) * inside.to(out.dtype)).unsqueeze(-1))
        out = (out * weight.unsqueeze(-1)).to(softmax.dtype).movedim(-1, 1)
        return out, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, num_classes: int,
                                 key: str, ignore_index: int = -100, reduction: str = "mean",
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ignore_index=..., reduction=..., label_smoothing=...)``
    from this rank's vocabulary slice ``logits`` (classes along dim 1 as torch's, or dim 0 of a 1-D
    input; columns ``[vocab_start, vocab_start + logits.shape[1])`` of ``num_classes``), over the TP
    group ``key``; the same value on every rank of the group. See the module docstring."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross entropy reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.dim() == 1:   # one sample: (C,) with a 0-dim target
        out = vocab_parallel_cross_entropy(logits.unsqueeze(0), target.reshape(1), vocab_start, num_classes, key,
                                           ignore_index, reduction, label_smoothing)
        return out.reshape(()) if reduction == "none" else out
    return _VocabParallelCrossEntropy.apply(logits, target, int(vocab_start), int(num_classes), key,
                                            int(ignore_index), reduction, float(label_smoothing))


def vocab_shard_output(x: torch.Tensor, dim: int, key: str) -> torch.Tensor:
    """``x``, this rank's contiguous slice along ``dim`` of a graph output, marked so that
    :func:`assemble_output` can gather it (a view: autograd and the value are untouched)."""
    out = x.view_as(x)
    setattr(out, SHARD_ATTR, (dim, key))
    return out


def shard_of(t) -> tuple[int, str] | None:
    """``(dim, TP group key)`` of an output marked by :func:`vocab_shard_output`, else None."""
    return getattr(t, SHARD_ATTR, None) if isinstance(t, torch.Tensor) else None


@torch.no_grad()
def assemble_output(t):
    """The whole tensor of an output marked by :func:`vocab_shard_output` (all-gather over its TP
    group: collective, every rank of the group must call it); anything else as it is."""
    mark = shard_of(t)
    if mark is None:
        return t
    dim, key = mark
    group, size = group_of(key)
    dim = dim % t.dim()
    if size == 1 or _is_fake(t):
        return t.detach().clone() if size == 1 else t.new_empty(
            (*t.shape[:dim], t.shape[dim] * size, *t.shape[dim + 1:]))
    front = t.detach().movedim(dim, 0).contiguous()
    flat = front.new_empty((size * front.shape[0],) + tuple(front.shape[1:]))
    all_gather_single(flat, front, group=group)
    return flat.movedim(0, dim).contiguous()
