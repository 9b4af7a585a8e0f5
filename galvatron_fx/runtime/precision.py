"""Mixed precision at run time: the policy a plan's ``precision`` names, and its graph calls.

=============  ============  ===========================  =====================================
precision      compute       master weights, optimizer    gradient reduction (default)
=============  ============  ===========================  =====================================
"fp32"         fp32          the parameters themselves     fp32
"bf16-mixed"   bf16          fp32                          fp32 (``reduce_dtype``: bf16 on request)
"fp16-mixed"   fp16          fp32, dynamic loss scaling    fp32 (``reduce_dtype``: fp16 on request)
=============  ============  ===========================  =====================================

How a mixed plan runs (the passes of :mod:`galvatron_fx.passes.mixed_precision` and the flat buffers
of :mod:`.data_parallel`):

* every layer's flat buffer keeps its **fp32 master** (the Parameter the user's optimizer holds:
  the whole buffer under DP, this rank's shard under ZeRO) and a **low-precision working copy**
  the layer reads its weights from: persistent for DP and ZeRO-2 (refreshed from the masters after
  each optimizer step: a local cast for DP, an all-gather of low-precision shards for ZeRO-2),
  gathered per use for ZeRO-3 (the all-gather moves low-precision shards: half the bytes);
* every layer graph runs under ``torch.autocast(device, dtype)`` (:func:`enter_autocast` /
  :func:`exit_autocast` nodes; PyTorch's own op policy keeps softmax, norms and losses in fp32
  where it says so) and casts its floating-point inputs to the compute dtype
  (:func:`cast_input`), so activations, TP collectives and pipeline sends are low precision;
* gradients of the working copy are accumulated over micro-batches in fp32, reduced over DP in
  ``reduce_dtype`` and land in the masters' ``.grad`` in fp32; the loss is reduced in fp32;
* ``fp16-mixed`` scales the loss (:class:`DynamicLossScaler`, the policy of
  ``torch.amp.GradScaler``): gradients are unscaled before they reach ``.grad``, and a step with an
  inf/NaN gradient on *any* rank leaves every rank's ``.grad`` at ``None`` (every torch optimizer
  then skips every parameter) and halves the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..ir import TORCH_DTYPES

COMPUTE_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class Precision:
    """One run's precision policy (module docstring). ``compute_dtype`` ``None``: the model's own."""

    name: str = "fp32"
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None   # None: the master dtype

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None

    @property
    def loss_scaling(self) -> bool:
        return self.compute_dtype == torch.float16


def precision_policy(name: str = "fp32", reduce_dtype: str | torch.dtype | None = None) -> Precision:
    """The :class:`Precision` of a plan's ``precision`` (``reduce_dtype``: ``"fp32"`` (default for
    mixed plans), or the compute dtype's name to reduce gradients in low precision)."""
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"precision must be one of {list(COMPUTE_DTYPES)}, got {name!r}")
    compute = COMPUTE_DTYPES[name]
    if isinstance(reduce_dtype, str):
        if reduce_dtype not in TORCH_DTYPES:
            raise ConfigError(f"reduce_dtype must be one of {list(TORCH_DTYPES)}, got {reduce_dtype!r}")
        reduce_dtype = TORCH_DTYPES[reduce_dtype]
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, compute):
        raise ConfigError(f"reduce_dtype {reduce_dtype} does not fit precision {name!r}: reduce in fp32 "
                          "or in the compute dtype")
    return Precision(name, compute, reduce_dtype)


# ------------------------------------------------------------------------------ graph calls
def cast_input(x, dtype: torch.dtype):
    """A layer's input in the compute dtype: floating-point tensors are cast (differentiably),
    everything else (token ids, masks, sizes) is returned unchanged."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def enter_autocast(device_type: str, dtype: torch.dtype):
    """Start of a layer graph: enter ``torch.autocast(device_type, dtype)``; returns the context
    :func:`exit_autocast` closes. NOTE: a graph node, so checkpoint recomputation re-enters it."""
    ctx = torch.autocast(device_type, dtype=dtype)
    ctx.__enter__()
    return ctx


def exit_autocast(ctx, outputs):
    """End of a layer graph: leave the autocast context; returns ``outputs`` unchanged (the data
    dependency keeps the node after every op of the layer)."""
    ctx.__exit__(None, None, None)
    return outputs


# ------------------------------------------------------------------------------ loss scaling
class DynamicLossScaler:
    """Dynamic loss scaling for fp16 (``torch.amp.GradScaler``'s policy: start at ``init_scale``,
    halve on an overflowing step, double after ``growth_interval`` clean steps in a row)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.clean_steps = 0
        self.skipped_steps = 0
        self.last_skipped = False

    def unscale_or_skip(self, stores) -> bool:
        """After the gradient reduction: check every rank's master gradients for inf/NaN
        (collective over the world, so every rank decides the same); unscale them, or on an
        overflow drop them (``.grad = None``). Returns whether this step is skipped."""
        grads = [s.flat_param.grad for s in stores if s.flat_param.grad is not None]
        # NOTE: the stores' compute device (an offloaded store's gradient is in host memory)
        device = next((s.device for s in stores), torch.device("cpu"))
        bad = torch.zeros((), device=device)
        for g in grads:
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float().to(device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.last_skipped = bool(bad.item())
        if self.last_skipped:
            for s in stores:
                s.flat_param.grad = None
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return True
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state.get("clean_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
