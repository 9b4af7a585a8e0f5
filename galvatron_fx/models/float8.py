"""Float8 training of ``nn.Linear`` layers, as torchao's tensorwise recipe runs it.

Runs such as torchtitan's published Float8 tables convert every ``nn.Linear`` of the transformer
blocks (not the output projection) so that its three matmuls run on fp8 tensor cores: the forward
``x @ w.T`` with ``x`` and ``w`` cast to ``float8_e4m3fn``, and the backward's ``grad @ w`` and
``grad.T @ x`` with the gradient cast to ``float8_e5m2``. Each cast scales its tensor by
``fp8_max / amax(|t|)`` (one scale per tensor, computed from the live values: dynamic scaling),
and ``torch._scaled_mm`` multiplies with the inverse scales, accumulating and returning the
high-precision dtype. The inputs are saved in high precision and cast again in the backward (the
recipe's default: what the memory figures of such runs hold), with the scales the forward took.
A plan that splits the batch over ranks or micro-batches scales each share by its own amax, as
torchao does under FSDP: it trains
to fp8's noise against one device with the whole batch, not bit for bit; a pipeline of whole
batches scales what one device scales.

Here it is the model a capture sees: the cost model prices each ``torch._scaled_mm`` at the
device's fp8 matmul rate (:meth:`galvatron_fx.cluster.Cluster.gemm_time`) and the casts as the
memory traffic they are, so a plan for a Float8 run is priced as that run computes. It executes
wherever ``torch._scaled_mm`` does (CUDA devices with fp8 tensor cores, and the CPU), captured by
dynamo or fx (torch.export inlines an autograd.Function's forward and drops its backward: refused
with the reason; fx would too, but :func:`float8_matmul` is a leaf it records as one call). Tensor
parallelism shards a :class:`Float8Linear` as a linear (column or row parallel); its casts then
take their largest magnitude over the tensor-parallel ranks (:func:`float8_matmul`'s
``amax_group``), so every rank scales as one device does.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..errors import CaptureError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12


def _scale(t: torch.Tensor, dtype: torch.dtype, group: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1 / scale)`` of tensorwise dynamic scaling (module docstring): ``fp8_max / amax(|t|)``,
    one pass reading ``t``. ``group``: the tensor-parallel group key of a sharded linear, whose ranks
    take the largest magnitude over all of them (each scales its shard as one device scales the whole
    tensor)."""
    amax = torch.linalg.vector_norm(t.detach(), ord=float("inf")).float()
    if group is not None:
        from ..runtime.tp_ops import tp_max

        amax = tp_max(amax, group)
    scale = torch.finfo(dtype).max / amax.clamp(min=_EPS)
    return scale, scale.reciprocal()


def _to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` as a row-major ``dtype`` tensor, in one pass writing fp8 (``torch.mul`` into an
    fp8 ``out``; a value at the largest magnitude lands on the fp8 maximum, none beyond it). No
    gradient flows through a cast: the Function's backward gives them."""
    out = torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)
    torch.mul(t.detach(), scale, out=out)
    return out


class _Float8Matmul(torch.autograd.Function):
    """``x @ w.T`` and its two gradients on fp8 operands, over ``x``'s last dim (its leading dims
    flattened into the matmul's rows inside, so a captured graph shows one call on ``x`` itself:
    the linears reading one input share it, and tensor parallelism's conversion of it).
    ``torch._scaled_mm`` takes its first operand row-major and its second column-major: each cast
    writes the layout its matmul reads. The backward casts ``x`` and ``w`` again with the scales
    the forward took (the same values: their largest magnitudes have not changed), and the
    gradient once scaled for both of its layouts, so no tensor's largest magnitude is read twice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: str | None = None):
        x2d = x.reshape(-1, x.shape[-1])
        x_scale, x_inv = _scale(x2d, E4M3, group)
        w_scale, w_inv = _scale(weight, E4M3, group)
        ctx.save_for_backward(x, weight, x_scale, x_inv, w_scale, w_inv)
        ctx.group = group
        out = torch._scaled_mm(_to_fp8(x2d, x_scale, E4M3), _to_fp8(weight, w_scale, E4M3).t(), x_inv, w_inv,
                               out_dtype=x.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Only the gradients autograd asks for: a frozen weight (LoRA's base, a frozen block) skips
        the weight-gradient matmul and its two casts, as a 16-bit linear's backward would."""
        x, weight, x_scale, x_inv, w_scale, w_inv = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        grad2d, x2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_w = None
        if not (need_x or need_w):
            return None, None, None
        g_scale, g_inv = _scale(grad2d, E5M2, ctx.group)
        # NOTE: both layouts of the gradient, cast back to back: one read of it where a compiler fuses them
        g8 = _to_fp8(grad2d, g_scale, E5M2) if need_x else None
        gt8 = _to_fp8(grad2d.t(), g_scale, E5M2) if need_w else None
        if need_x:
            wt8 = _to_fp8(weight.t(), w_scale, E4M3)
            grad_x = torch._scaled_mm(g8, wt8.t(), g_inv, w_inv, out_dtype=grad.dtype).view(x.shape)
        if need_w:
            xt8 = _to_fp8(x2d.t(), x_scale, E4M3)
            grad_w = torch._scaled_mm(gt8, xt8.t(), g_inv, x_inv, out_dtype=weight.dtype)
        return grad_x, grad_w, None


def float8_matmul(x: torch.Tensor, weight: torch.Tensor, amax_group: str | None = None) -> torch.Tensor:
    """``x @ weight.T`` in fp8 with the fp8 backward; under ``torch.autocast`` (mixed precision)
    from the autocast dtype, which its output takes, as torchao's Float8 linear. One opaque call in
    a captured graph (``torch.fx.wrap``, ``torch.compiler.allow_in_graph``): run as written when the
    graph runs, so the autocast the runtime (or the cost measurement) enters applies, and neither
    tracer inlines the autograd.Function's forward without its backward. ``amax_group``: written
    by the tensor-parallel pass on a column- or row-parallel one (its group key): every cast
    takes the largest magnitude over the group's ranks, as torchao's Float8 tensor parallelism
    does (an amax over a DTensor), so each rank's fp8 operands are one device's, sliced."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    return _Float8Matmul.apply(x, weight, amax_group)


torch.fx.wrap("float8_matmul")
torch.compiler.allow_in_graph(float8_matmul)


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in fp8 (module docstring); the bias is added in high precision.
    Under ``torch.autocast`` (mixed precision) its output comes in the autocast dtype, as a 16-bit
    linear's would (:func:`float8_matmul`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            raise CaptureError("a Float8Linear's backward is a custom autograd.Function, which torch.export "
                               "inlines and drops (its graph would train on another backward); capture this "
                               "model with method='dynamo' or 'fx'")
        out = float8_matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


def float8_count(model: nn.Module) -> int:
    """How many :class:`Float8Linear` modules ``model`` holds."""
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def convert_to_float8(model: nn.Module, skip: tuple[str, ...] = ("lm_head", "output")) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` whose qualified name does not end with a name in ``skip``
    (the output projection stays in high precision, as torchtitan converts) for a
    :class:`Float8Linear` sharing its parameters, in place; returns ``model``. A linear whose
    dimensions are not multiples of 16 (what fp8 tensor cores take) stays too. Warns (one line)
    when it converts nothing: the model's matmuls are not ``nn.Linear`` modules (GPT-2's ``Conv1D``,
    grouped expert weights) or none has such dimensions, and a plan for it would price no fp8."""
    converted, odd = 0, []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            qual = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or qual.split(".")[-1] in skip:
                continue
            if child.in_features % 16 or child.out_features % 16:
                odd.append(qual)
                continue
            new = Float8Linear.__new__(Float8Linear)
            new.__dict__.update(child.__dict__)
            setattr(module, child_name, new)
            converted += 1
    if not converted:
        why = (f"its {len(odd)} nn.Linear layers have dimensions that are not multiples of 16 ({odd[0]}, ...)"
               if odd else "it has no nn.Linear layer outside the output projection (other matmul modules, "
                           "such as GPT-2's Conv1D, are not converted)")
        warnings.warn(f"convert_to_float8 converted no linear of {type(model).__name__}: {why}; it trains and is "
                      "priced in its own precision", stacklevel=2)
    return model
