"""Norms over the ranks that hold a parameter's pieces: what ``torch.nn.utils.clip_grad_norm_`` needs.

A :class:`~.params.ShardedParameter` or :class:`~.params.ShardedGrad` holds this rank's part of one
parameter (its TP slice, its ZeRO rows, or a replica of the whole). Its ``__torch_function__`` sends
the norm functions (:data:`HANDLERS`: ``torch._foreach_norm``, ``torch.linalg.vector_norm``,
``torch.norm``, ``Tensor.norm`` over all elements) here, so that they return the norm of the *whole*
parameter, as DTensor's do, and everything built on them (``clip_grad_norm_``, ``get_total_norm``,
a logged per-parameter gradient norm) is the single-device figure:

* each rank takes ``|x|_p^p`` of its part (``max |x|`` for ``p = inf``, the count for ``p = 0``) for
  the parameters it *owns* (one replica of every element counts: the first DP rank of a replicated
  layer, the first TP rank of a parameter TP keeps whole);
* one all-reduce over the world (SUM; MAX for ``inf``) of a vector with one slot per parameter of
  the whole model (every pipeline stage's; ``ParamRegistry.slots``) and a second half marking which
  slots some rank asked for;
* each asked parameter's norm is its slot's ``1/p``-th power, the same value on every rank, as a
  plain 0-dim tensor. The norm of one tensor (``vector_norm``, ``.norm()``) is reduced over its
  pipeline stage only, so stages may ask for their own parameters' norms one by one.

Pipelines (``pp > 1``): a rank holds one stage's parameters, so ``torch.nn.utils.get_total_norm``
would see only those. When ``torch._foreach_norm`` is called by torch's ``_get_total_norm`` (the
default ``foreach`` path of ``clip_grad_norm_`` and ``get_total_norm``), the returned list ends with
the norms of the parameters other stages asked for, so the total torch computes from it is the
whole model's (torchtitan does the same with one extra all-reduce over its PP mesh). Its
``foreach=False`` path (one ``vector_norm`` per gradient) cannot be completed that way and raises,
naming ``dist_model.clip_grad_norm_``, which computes the total itself for every plan.

Tensors of other types in the same list (a parameter outside the distributed model) are taken as
replicated on every rank: their norms are local. NOTE: every rank must make the same calls in the
same order (the all-reduce is collective over the world, or the stage), as with DTensor.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch
import torch.distributed as dist

from ..errors import ConfigError

_TOTAL_NORM_CODE: list = []


def _called_by_total_norm(depth: int = 6) -> bool:
    """Whether torch's ``clip_grad._get_total_norm`` is among the callers (a few frames up)."""
    if not _TOTAL_NORM_CODE:
        try:
            from torch.nn.utils import clip_grad

            _TOTAL_NORM_CODE.append(inspect.unwrap(clip_grad._get_total_norm).__code__)
        except (ImportError, AttributeError):   # a torch without it: nothing to recognise
            _TOTAL_NORM_CODE.append(None)
    code = _TOTAL_NORM_CODE[0]
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _order(norm_type) -> float:
    p = 2.0 if norm_type in (None, "fro") else float(norm_type)
    if p < 0 or math.isnan(p):
        raise ConfigError(f"norm of order {norm_type} over sharded parameters is not supported; use p >= 0 or inf")
    return p


def _local(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """``|t|_p`` of each tensor as it is on this rank (empty tensors: 0), in fp32 or better."""
    out = [None] * len(tensors)
    live = [i for i, t in enumerate(tensors) if t.numel()]
    with torch._C.DisableTorchFunctionSubclass():
        if live:
            for i, n in zip(live, torch._foreach_norm([tensors[i] for i in live], p)):
                out[i] = n.double() if n.dtype == torch.float64 else n.float()
    return [n if n is not None else torch.zeros((), device=t.device) for n, t in zip(out, tensors)]


def reduce_slots(registry, slots: list[int], owners: list[bool], tensors: list[torch.Tensor],
                 p: float, stage_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce the owned contributions of ``tensors`` (at ``slots`` of ``registry``) over the
    world (``stage_only``: over this rank's pipeline stage); returns ``(per-slot sums of |x|^p
    (max for inf, counts for 0), per-slot asked flags)``, float64, identical on every rank."""
    n = registry.slots
    device = registry.device
    vec = torch.zeros(2 * n, dtype=torch.float64, device=device)
    if tensors:
        norms = torch.stack(_local(tensors, p)).to(device=device, dtype=torch.float64)
        if math.isinf(p) or p == 0:
            contrib = norms
        else:
            contrib = norms.pow(p)
        keep = torch.tensor(owners, device=device)
        idx = torch.tensor(slots, device=device, dtype=torch.long)
        vec[idx] = torch.where(keep, contrib, torch.zeros_like(contrib))
        vec[n + idx] = 1.0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shared, group = registry.stage_group() if stage_only else (True, None)
        if shared:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=group)
    return vec[:n], vec[n:]


def _root(value: torch.Tensor, p: float) -> torch.Tensor:
    return value if (math.isinf(p) or p == 0) else value.pow(1.0 / p)


def global_norms(tensors, norm_type=2.0, *, others: bool = False, dtype=None,
                 stage_only: bool = False) -> list[torch.Tensor]:
    """The whole-parameter ``norm_type``-norm of each of ``tensors`` (module docstring), same on
    every rank; with ``others`` (torch's total, which only stacks them), the plain tensors' norms
    then those of every parameter some rank asked for (other pipeline stages', other EP ranks'
    experts), in slot order: the same list, so the same total, on every rank. ``stage_only``:
    reduce over this rank's pipeline stage, not the world (a single tensor's norm: the stages call
    it for different parameters)."""
    p = _order(norm_type)
    tensors = list(tensors)
    out: list = [None] * len(tensors)
    groups: dict[int, tuple] = {}
    plain = []
    for pos, t in enumerate(tensors):
        spec = getattr(t, "_gfx", None)
        if spec is None:
            plain.append(pos)
        else:
            groups.setdefault(id(spec.registry), (spec.registry, []))[1].append((pos, spec, t))
    if plain:
        for pos, n in zip(plain, _local([tensors[i] for i in plain], p)):
            out[pos] = n
    extra = []
    for registry, items in groups.values():
        sums, asked = reduce_slots(registry, [s.slot for _, s, _ in items], [s.owner for _, s, _ in items],
                                   [t for _, _, t in items], p, stage_only)
        norms = _root(sums, p)
        for pos, spec, _t in items:
            out[pos] = norms[spec.slot]
        if others:
            extra += list(norms[asked > 0])
    if others:
        out, tensors = [out[i] for i in plain], [tensors[i] for i in plain] + [tensors[0]] * len(extra)
    result = []
    for n, t in zip(out + extra, tensors + [None] * len(extra)):
        want = dtype or (t.dtype if t is not None and t.is_floating_point() else torch.float32)
        result.append(n.to(want))
    return result


def total_norm(registry, tensors, norm_type=2.0) -> torch.Tensor:
    """The ``norm_type``-norm of every parameter some rank passes in ``tensors`` (each rank its own:
    its stage's gradients), as one vector over the whole model; collective over the world (every
    rank calls it, also with an empty list). fp32, the same on every rank."""
    p = _order(norm_type)
    tensors = list(tensors)
    specs = [t._gfx for t in tensors]
    sums, asked = reduce_slots(registry, [s.slot for s in specs], [s.owner for s in specs], tensors, p)
    picked = sums[asked > 0]
    if not picked.numel():
        return torch.zeros((), device=registry.device)
    if p == 0:   # torch's total of 0-norms: the number of tensors with a nonzero element
        return (picked > 0).sum().float()
    total = picked.max() if math.isinf(p) else picked.sum()
    return _root(total, p).float()


# ------------------------------------------------------------------ __torch_function__ handlers
def _foreach_norm(func, args, kwargs):
    tensors = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    pipelined = any(getattr(getattr(t, "_gfx", None), "registry", None) is not None
                    and t._gfx.registry.pipelined for t in tensors)
    return global_norms(tensors, ord_, dtype=dtype, others=pipelined and _called_by_total_norm())


def _whole_norm(x, ord_, dim, dtype, fallback):
    if dim is not None or ord_ == "nuc" or getattr(x, "_gfx", None) is None:
        with torch._C.DisableTorchFunctionSubclass():
            return fallback()
    if x._gfx.registry.pipelined and _called_by_total_norm():
        raise ConfigError("torch.nn.utils.clip_grad_norm_(..., foreach=False) sees only this rank's gradients (its "
                          "pipeline stage's, its experts'); use dist_model.clip_grad_norm_(max_norm), which covers "
                          "every parameter")
    return global_norms([x], ord_, dtype=dtype, stage_only=True)[0]


def _vector_norm(func, args, kwargs):
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    return _whole_norm(x, ord_, dim, kwargs.get("dtype"), lambda: func(*args, **kwargs))


def _norm(func, args, kwargs):
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", "fro")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if kwargs.get("keepdim") or kwargs.get("out") is not None:
        dim = dim if dim is not None else ()
    return _whole_norm(x, p, dim, kwargs.get("dtype"), lambda: func(*args, **kwargs))


HANDLERS = {
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _vector_norm,
    torch.norm: _norm,
    torch.Tensor.norm: _norm,
}
"""torch functions whose result on a sharded parameter or gradient is the whole parameter's."""
