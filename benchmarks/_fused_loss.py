"""A stand-in for flash-attn's fused cross-entropy, which llm-foundry's MPT runs call by default
(``loss_fn: fused_crossentropy``: ``flash_attn.losses.cross_entropy.CrossEntropyLoss``, its
backward written into the logits' storage).

What it keeps is what that kernel keeps: the logits and one fp32 log-sum-exp per token; the
backward turns the kept logits into their gradient in place (no ``[tokens, vocab]`` buffer beside
them, no fp32 copy). What it moves is a little more: the forward reads the logits once, as the
kernel does, but the backward makes three read-write passes over them (subtract, exponentiate,
scale) where the kernel makes one, so its time is priced above the kernel's. torch's own ``cross_entropy`` (transformers' loss) keeps an fp32
log-softmax and makes two fp32 ``[tokens, vocab]`` gradients in its backward. The FLOPs of either
are element-wise (none counted). Run as written inside a captured graph (``torch.fx.wrap``,
``torch.compiler.allow_in_graph``), as the Float8 matmul is.
"""

from __future__ import annotations

import torch
import torch.fx

IGNORE = -100


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        lse = torch.logsumexp(logits, dim=-1).float()
        valid = target != IGNORE
        picked = logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1).float()
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(logits, lse, target, count)
        return ((lse - picked) * valid).sum() / count

    @staticmethod
    def backward(ctx, grad):
        logits, lse, target, count = ctx.saved_tensors
        valid = target != IGNORE
        scale = ((grad / count) * valid).unsqueeze(-1).to(logits.dtype)
        out = logits.sub_(lse.unsqueeze(-1).to(logits.dtype)).exp_().mul_(scale)   # softmax x scale, in place
        out.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), -scale)
        return out, None


@torch.fx.wrap
def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits[tokens, vocab]`` against ``target[tokens]`` (-100: ignored)."""
    return _FusedCrossEntropy.apply(logits, target)


torch.compiler.allow_in_graph(fused_cross_entropy)


class FusedLossLM(torch.nn.Module):
    """A causal LM whose loss is :func:`fused_cross_entropy` of its logits (labels shifted left)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids=input_ids).logits
        target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        return fused_cross_entropy(logits.flatten(0, 1), target.flatten())
