"""Single-device reference training shared by the multi-process numerics tests."""

from __future__ import annotations

import torch

STEPS = 5  # AdamW steps per plan
LR = 1e-3
# NOTE: eps 1e-6 (not 1e-8): the attention key bias has a mathematically zero gradient (softmax
# is shift-invariant), so Adam would otherwise turn round-off noise into full-size updates.
EPS = 1e-6
TOL = 1e-5


def reference(model: torch.nn.Module, args: tuple, steps: int = STEPS, eps: float = EPS) -> tuple[list[float], dict]:
    """Train ``model`` eagerly ``steps`` AdamW steps; return the losses and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*args)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def apply_specs(plan, specs: list[dict]):
    """Set each layer's strategy fields from ``specs`` (cycled over the layers); validate the plan."""
    from galvatron_fx.plan import LAYER_ATTRIBUTES

    for i, layer in enumerate(plan.layers):
        for key, value in specs[i % len(specs)].items():
            if key in LAYER_ATTRIBUTES:
                setattr(layer, key, value)
            else:   # a dimension registered after the attributes (HSDP's shard): a JSON key
                layer.extra[key] = value
    return plan.validate()


def transform(gm, plan, real_tp: bool = True):
    """``gfx.transform``; with ``real_tp=False`` the tensor-parallel pass is an identity (each TP rank
    computes whole layers on its batch slice: mathematically the same), which tests the rank layout,
    the per-layer groups and the resharding on their own."""
    from torch.fx.passes.infra.pass_base import PassResult

    import galvatron_fx as gfx
    from galvatron_fx.passes.tensor_parallel import TensorParallelPass

    saved = TensorParallelPass.call
    if not real_tp:
        TensorParallelPass.call = lambda self, gm: PassResult(gm, False)
    try:
        return gfx.transform(gm, plan=plan)
    finally:
        TensorParallelPass.call = saved
