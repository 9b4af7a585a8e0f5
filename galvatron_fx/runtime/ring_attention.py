"""Ring attention: context-parallel SDPA over torch's fused attention kernels.

Every CP rank holds ``s = S / cp`` query, key and value rows in the zig-zag layout of
:func:`.context_parallel.seq_positions`. The key / value shards travel around the ring (``cp - 1``
shifts, ``batch_isend_irecv``, each started before the current source's blocks and waited for
after them). Against each source the rank runs *blocks*, each one call of a fused SDPA kernel on
(a span of its query rows, a span of the source's key rows) that returns the block's output and
log-sum-exp (LSE).

* **Plan** (:func:`ring_plan`). Under ``is_causal`` a (query chunk, key chunk) pair is wholly
  visible, wholly masked (skipped) or a diagonal pair. The rank's shard against itself is one block
  with the kernel's ``is_causal`` (top-left aligned; exact because a rank's positions increase with
  its rows, which covers both diagonal pairs and the visible pair between them); against an earlier
  source all its queries meet the source's first chunk, against a later one its second chunk meets
  the whole source. So ``cp`` kernel calls cover the ``2 cp + 1`` chunk pairs of
  :func:`.context_parallel.ring_block_pairs`, the same on every rank (the zig-zag's balance).
  Without ``is_causal`` each source is one block.
* **Explicit masks** (bool or additive: padding, sliding windows, ALiBi). Blocks are cut at chunk
  boundaries and into tiles of :data:`TILE_ROWS` query rows, so each block's mask slice is a view
  of the caller's mask, in the dtype the kernel takes it (:func:`_mask_dtype`, as single-device SDPA
  does); a bool one is converted to an additive bias one tile at a time where a kernel needs that. A
  tile on its chunk's diagonal splits into the keys before it (visible) and its own square
  (``is_causal``). Blocks whose slice masks everything are skipped. A mask and ``is_causal`` are
  both applied, as SDPA does.
* **Kernel** (:func:`choose_kernel`, from torch's own pick for the call, ``_fused_sdp_choice``).
  On CPU it is ``_scaled_dot_product_flash_attention_for_cpu``, which takes the mask and grouped
  key / value heads. On CUDA it is ``_scaled_dot_product_flash_attention`` (fp16 / bf16, no mask,
  grouped heads natively) or ``_scaled_dot_product_efficient_attention`` (a mask as an aligned
  ``attn_bias``, or fp32; key / value heads repeated for the query heads, their gradients summed
  back). Anything else, where torch would run its math backend (e.g. a value head dim unlike the
  query's on CPU, a backend disabled by ``sdpa_kernel``, another device), uses an eager kernel
  over tiles of :data:`TILE_ROWS` query rows (:func:`_tiled_forward`). Every kernel runs in q's
  dtype, on q's device. NOTE: the CUDA calls follow torch's own ring
  (``torch.distributed.tensor.experimental._context_parallel``) and the ops' schemas; this
  repository's tests run the CPU and eager kernels only.
* **Merge**. Blocks merge exactly by their LSEs, in fp32 (fp64 for fp64 inputs):
  ``out = sum_i exp(lse_i - lse) out_i`` and ``lse = logsumexp_i lse_i``, kept as the running
  ``out += sigmoid(lse_b - lse) (out_b - out)``. A row a block masks entirely gets no weight from
  it: the mask identifies such rows, since the CPU kernel reports them as ``lse = 0``. A row masked
  everywhere gives 0, as SDPA.
* **Backward**. Each block runs its kernel's backward with the *global* output and LSE, as
  flash-attention rings do: the block's probabilities are then ``exp(scores - lse)`` over all keys.
  Rows masked everywhere get ``lse = +inf``, so no gradient. The k / v shards circulate again; each
  source's fp32 k / v gradients travel with it, ``cp`` shifts in all, back home. Each shift
  overlaps the next source's blocks.

Memory is linear in ``s``. Autograd keeps q, k, v, the output and the LSE (and the caller's
mask). The largest tensor a call allocates is ``s`` rows tall (the fp32 accumulators), or with a
mask a tile's converted slice (``TILE_ROWS`` x a chunk's keys). No ``[s, S]`` score matrix is
built: the kernels tile internally.

This is the home implementation, not torch's own ring, which runs only under DTensor dispatch over
a DeviceMesh with its own load balancer, passes no mask (``attn_bias`` is refused) and has no CPU
kernel. Here the ring runs on the project's rank groups (:func:`.groups.group`), in the project's
layout, with masks and on every device.

Exact up to float rounding against the kernel that single-device SDPA picks (on CPU the same flash
kernel): 1e-5 in fp32. NOTE (HF's additive ``finfo.min`` masks): where a row's only keys carry
``finfo.min`` its LSE rounds to ``finfo.min`` in fp32 and loses its ``+ log(sum)``. torch's CPU
flash kernel then returns gradients scaled by that sum (its backward rebuilds unnormalised
probabilities from the LSE). This is still so in torch 2.13, so single-device SDPA has the same
flaw; the math backend does not. Ring attention shares the flaw, since its backward is the
kernel's. Where such a row meets several blocks, its output is the mean of those blocks' outputs
rather than the mean over all its keys, because equal saturated LSEs weigh the blocks equally.
Such rows are padding queries, whose outputs no loss reads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from .groups import Ranks
from .seq_layout import _causal_skip, _chunks, _expand, _fold, _Shift, _spans

__all__ = ["KERNELS", "TILE_ROWS", "choose_kernel", "ring_attention", "ring_plan", "ring_tiles"]

aten = torch.ops.aten
_INF = float("inf")
_MATH, _FLASH = int(SDPBackend.MATH), int(SDPBackend.FLASH_ATTENTION)
_EFFICIENT, _CUDNN = int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)

KERNELS = ("cpu_flash", "flash", "efficient", "tiled")
TILE_ROWS = 2048
"""Query rows per tile: of a masked block (its mask slice converted at most this many rows at a
time) and of the eager kernel's scores (``TILE_ROWS`` x the block's keys, fp32)."""
BIAS_ALIGN = 16
"""The memory-efficient kernel reads ``attn_bias`` rows aligned to 16 elements (torch pads them)."""
LSE_ALIGN = 32
"""The memory-efficient kernel's LSE rows are padded to a multiple of 32."""


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class _Block:
    """One kernel call: local query rows ``q`` and source key rows ``k`` (``(offset, length)``);
    ``causal``: the kernel's top-left ``is_causal`` (a square of the same positions); ``at``: the
    global positions of the first query and key (blocks of one chunk each: the mask slice)."""

    q: tuple[int, int]
    k: tuple[int, int]
    causal: bool = False
    at: tuple[int, int] | None = None


@functools.lru_cache(maxsize=1024)
def ring_plan(seq: int, cp: int, index: int, src: int, causal: bool) -> tuple[_Block, ...]:
    """The blocks rank ``index`` runs against source ``src``'s keys without an explicit mask
    (module docstring): the own shard under ``is_causal`` as one causal block, else query chunks
    needing the same key chunks share a block (adjacent rows merged)."""
    if causal and src == index:
        rows = seq // cp
        return (_Block((0, rows), (0, rows), True),)
    by_keys: dict[tuple, list] = {}
    for a in _chunks(seq, cp, index):
        keys = tuple(b for b in _chunks(seq, cp, src) if not (causal and _causal_skip(a, b)))
        if keys:
            by_keys.setdefault(keys, []).append(a)
    return tuple(_Block(qs, ks) for keys, qcs in by_keys.items() for qs in _spans(qcs) for ks in _spans(keys))


def _mask_view(mask: torch.Tensor, qa: int, qn: int, ka: int, kn: int) -> torch.Tensor:
    """The mask's rows ``qa .. qa + qn`` and columns ``ka .. ka + kn`` (a view; broadcast dims kept)."""
    if mask.shape[-2] != 1:
        mask = mask.narrow(-2, qa, qn)
    return mask.narrow(-1, ka, kn) if mask.shape[-1] != 1 else mask


def _scan(m: torch.Tensor, diag: bool, top: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of mask block ``m`` (``[..., rows]``): its largest allowed value (a bool mask: 0, or
    -inf where none), or with ``top`` given how many allowed keys reach ``top``; ``diag``: under the
    top-left causal mask too (a square, scanned ``TILE_ROWS`` rows at a time)."""
    def reduce(t, top):
        if top is not None:
            return (t == top.unsqueeze(-1)).sum(-1)
        return t.any(-1).float().log_() if t.dtype == torch.bool else t.amax(-1)
    if not diag:
        return reduce(m, top)
    n, out = m.shape[-1], []
    for r in range(0, n, TILE_ROWS):
        t = min(TILE_ROWS, n - r)
        sub = (m.narrow(-2, r, t) if m.shape[-2] != 1 else m).narrow(-1, 0, r + t)
        above = torch.ones(t, r + t, dtype=torch.bool, device=m.device).triu_(r + 1)
        sub = sub & ~above if sub.dtype == torch.bool else sub.masked_fill(above, -_INF)
        out.append(reduce(sub, None if top is None else top.narrow(-1, r, t)))
    return torch.cat(out, -1) if len(out) > 1 else out[0]


SATURATED = -(2.0 ** 64)
"""A row's largest allowed mask value at or below this (HF's ``finfo.min``) absorbs every score
into the mask value in fp32 and leaves no room for ``log(sum)`` in the LSE: the plan counts the
keys reaching it instead (module docstring)."""


@functools.lru_cache(maxsize=1024)
def ring_tiles(seq: int, cp: int, index: int, src: int, causal: bool, tile: int) -> tuple[_Block, ...]:
    """The blocks rank ``index`` may run against ``src``'s keys with an explicit mask, before the
    mask's own skips (module docstring): ``tile`` query rows of one chunk against each key chunk,
    under ``is_causal`` the keys before the tile and, on its own chunk, the tile's square."""
    out = []
    for qa, qn, qoff in _chunks(seq, cp, index):
        for r in range(0, qn, tile):
            g, n = qa + r, min(tile, qn - r)
            for ka, kn, koff in _chunks(seq, cp, src):
                before = min(kn, g - ka) if causal else kn
                if before > 0:
                    out.append(_Block((qoff + r, n), (koff, before), False, (g, ka)))
                if causal and ka <= g < ka + kn:
                    out.append(_Block((qoff + r, n), (koff + g - ka, n), True, (g, g)))
    return tuple(out)


def _masked_plan(seq: int, cp: int, index: int, src: int, causal: bool, mask: torch.Tensor,
                 dtype: torch.dtype) -> list:
    """``[(block, dead rows or None, log-count of saturated rows or None)]``: the :func:`ring_tiles`
    blocks whose mask slice, in the ``dtype`` the kernel takes it (:func:`_mask_dtype`), allows some
    entry."""
    out = []
    for blk in ring_tiles(seq, cp, index, src, causal, TILE_ROWS):
        m = _mask_view(mask, blk.at[0], blk.q[1], blk.at[1], blk.k[1]).to(dtype)
        top = _scan(m, blk.causal)
        alive, sat = top > -_INF, (top <= SATURATED) & (top > -_INF)
        some, every, saturated = torch.stack([alive.any(), alive.all(), sat.any()]).tolist()
        if some:
            lo = torch.where(sat, _scan(m, blk.causal, top).float().log_(), 0.0) if saturated else None
            out.append((blk, None if every else alive.logical_not(), lo))
    return out


# --------------------------------------------------------------------------------- kernels
def choose_kernel(device_type: str, dtype: torch.dtype, masked: bool, head_dim: int, v_head_dim: int,
                  choice: int) -> str:
    """The block kernel (:data:`KERNELS`) for a call on ``device_type`` in ``dtype``, with or without
    a mask, given ``choice``: the SDPA backend torch itself picks for the call (``SDPBackend``
    value of ``aten._fused_sdp_choice``; hardware, build and ``sdpa_kernel`` limits are its).
    CUDA: flash where torch picks flash or cuDNN for fp16 / bf16 without a mask (equal head dims
    up to 256), the memory-efficient kernel for the rest it picks fused (cuDNN is not called); the
    eager tiles wherever torch would run its math backend or head dims are not multiples of 8."""
    if device_type == "cpu":
        return "cpu_flash" if choice == _FLASH and head_dim == v_head_dim else "tiled"
    if device_type != "cuda" or choice not in (_FLASH, _EFFICIENT, _CUDNN) or head_dim % 8 or v_head_dim % 8:
        return "tiled"
    if (choice != _EFFICIENT and not masked and dtype in (torch.float16, torch.bfloat16)
            and head_dim == v_head_dim <= 256):
        return "flash"
    return "efficient"


def _kernel(q, k, v, mask, causal: bool, scale: float, groups: int) -> str:
    """:func:`choose_kernel` for 4-d ``q, k, v`` and a block-shaped mask view (or None)."""
    choice = _MATH
    if q.device.type in ("cpu", "cuda"):
        choice = aten._fused_sdp_choice(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=groups > 1)
    return choose_kernel(q.device.type, q.dtype, mask is not None, q.shape[-1], v.shape[-1], choice)


def _bias(mask, blk: _Block, q: torch.Tensor, kernel: str):
    """The mask slice a block's kernel takes (module docstring, :func:`_mask_dtype`): a view where
    the kernel takes the mask as it is, else a converted copy (aligned and expanded for the
    memory-efficient kernel)."""
    if mask is None:
        return None
    m = _mask_view(mask, blk.at[0], blk.q[1], blk.at[1], blk.k[1])
    if kernel == "tiled":
        return m.to(_mask_dtype(kernel, m.dtype, q.dtype))
    if m.dtype == torch.bool:
        m = torch.where(m, 0.0, -_INF)
    if kernel == "efficient":
        cols = m.shape[-1]
        buf = m.new_empty((*m.shape[:-1], cols + (-cols % BIAS_ALIGN)), dtype=q.dtype)
        return buf.narrow(-1, 0, cols).copy_(m).expand(q.shape[0], q.shape[1], blk.q[1], cols)
    return m.to(_mask_dtype(kernel, m.dtype, q.dtype))


def _mask_dtype(kernel: str, mask: torch.dtype, q: torch.dtype) -> torch.dtype:
    """The dtype a kernel takes a mask in: a bool one is converted (where needed, to q's dtype); a
    float one the CPU flash kernel and the eager tiles take in q's dtype or the fp32 accumulation
    dtype as given, the CUDA kernels in q's dtype (HF's fp32 ``finfo.min`` is ``-inf`` in bf16)."""
    if mask == torch.bool or (kernel in ("cpu_flash", "tiled") and mask in (q, _acc(q))):
        return mask
    return q


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The merge's and the accumulators' dtype: fp32, or fp64 for fp64 operands."""
    return torch.promote_types(dtype, torch.float32)


def _tile_scores(q, kt, mask, causal: bool, scale: float, r: int, n: int) -> torch.Tensor:
    """Scores of query rows ``r .. r + n`` against ``kt`` (keys transposed, accumulator dtype), the
    mask and the top-left causal mask applied."""
    s = torch.matmul(q.narrow(-2, r, n).to(kt.dtype), kt).mul_(scale)
    if mask is not None:
        m = mask.narrow(-2, r, n) if mask.shape[-2] != 1 else mask
        s = s.masked_fill_(m.logical_not(), -_INF) if m.dtype == torch.bool else s.add_(m)
    if causal:
        s.masked_fill_(torch.ones(n, s.shape[-1], dtype=torch.bool, device=s.device).triu_(r + 1), -_INF)
    return s


def _tiled_forward(q, k, v, mask, causal: bool, scale: float):
    """The eager kernel: ``(out in q's dtype, lse)`` of one block, ``TILE_ROWS`` query rows at a time.
    Rows without an allowed key give 0 and ``lse = -inf``."""
    acc = _acc(q.dtype)
    kt, vf = k.to(acc).transpose(-1, -2), v.to(acc)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=acc)
    for r in range(0, q.shape[-2], TILE_ROWS):
        n = min(TILE_ROWS, q.shape[-2] - r)
        s = _tile_scores(q, kt, mask, causal, scale, r, n)
        top = s.amax(-1, keepdim=True)
        top.masked_fill_(top == -_INF, 0.0)
        p = s.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        out.narrow(-2, r, n).copy_(torch.matmul(p, vf).div_(total.clamp_min(torch.finfo(acc).tiny)))
        lse.narrow(-1, r, n).copy_(total.log_().add_(top).squeeze(-1))
    return out, lse


def _tiled_backward(grad, q, k, v, out, lse, mask, causal: bool, scale: float):
    """The eager kernel's backward with the global ``out`` and ``lse`` (accumulator dtype grads)."""
    acc = lse.dtype
    kf, vf = k.to(acc), v.to(acc)
    delta = (grad.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    dq, dk, dv = torch.empty_like(q, dtype=acc), torch.zeros_like(kf), torch.zeros_like(vf)
    for r in range(0, q.shape[-2], TILE_ROWS):
        n = min(TILE_ROWS, q.shape[-2] - r)
        p = _tile_scores(q, kf.transpose(-1, -2), mask, causal, scale, r, n)
        p = p.sub_(lse.narrow(-1, r, n).unsqueeze(-1)).exp_()
        g = grad.narrow(-2, r, n).to(acc)
        dv.add_(torch.matmul(p.transpose(-1, -2), g))
        ds = p.mul_(torch.matmul(g, vf.transpose(-1, -2)).sub_(delta.narrow(-2, r, n))).mul_(scale)
        dq.narrow(-2, r, n).copy_(torch.matmul(ds, kf))
        dk.add_(torch.matmul(ds.transpose(-1, -2), q.narrow(-2, r, n).to(acc)))
    return dq, dk, dv


def _forward_kernel(kernel: str, q, k, v, bias, causal: bool, scale: float, groups: int):
    """``(out in q's dtype, lse [B, H, rows], rng)`` of one block; ``rng``: the fused CUDA kernels'
    philox seed / offset, which their backward takes (dropout is 0: never read)."""
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse, None
    if kernel == "flash":
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return r[0], r[1], (r[6], r[7])
    k, v = _expand(k, groups), _expand(v, groups)
    if kernel == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse.narrow(-1, 0, q.shape[-2]), (seed, offset)
    return (*_tiled_forward(q, k, v, bias, causal, scale), None)


def _backward_kernel(kernel: str, grad, q, k, v, bias, out, lse, causal: bool, scale: float, groups: int, rng):
    """``(dq, dk, dv)`` of one block from the global ``out`` / ``lse`` rows; ``dk``, ``dv`` at
    ``k``'s heads."""
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                          attn_mask=bias, scale=scale)
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, *rng, scale=scale)
    ke, ve = _expand(k, groups), _expand(v, groups)
    if kernel == "efficient":
        lse = F.pad(lse, (0, -lse.shape[-1] % LSE_ALIGN))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, ke, ve, bias, out, lse, *rng, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        dq, dk, dv = _tiled_backward(grad, q, ke, ve, out, lse, bias, causal, scale)
    return dq, _fold(dk, groups, k.shape), _fold(dv, groups, v.shape)


# ------------------------------------------------------------------------------------ ring
def _merge(out, lse, o_b, l_b, rows: tuple[int, int], dead, lo=None) -> None:
    """Merge block output ``o_b`` / LSE ``l_b`` into rows ``rows`` of the running ``out`` / ``lse``
    (module docstring); ``dead``: the block's rows without an allowed key (or None); ``lo``: with
    saturated rows, ``(running, block)`` log-counts that the LSEs carry beside them (or None)."""
    o, l = out.narrow(-2, *rows), lse.narrow(-1, *rows)
    if dead is not None:
        l_b = l_b.masked_fill(dead, -_INF)
        o_b = o_b.masked_fill(dead.unsqueeze(-1), 0.0)
    d = l_b - l
    if lo is not None:
        run, blk = lo[0].narrow(-1, *rows), lo[1]
        d = d.add_(blk - run)
    w = d.nan_to_num_(0.0).sigmoid_().unsqueeze(-1)   # -inf - -inf: rows dead so far, o = o_b = 0
    o.add_((o_b - o).mul_(w))
    if lo is None:
        l.copy_(torch.logaddexp(l, l_b))
        return
    top = torch.maximum(l, l_b)
    ref = top.masked_fill(top == -_INF, 0.0)
    run.copy_(torch.logaddexp(l.sub(ref).add_(run), l_b.sub(ref).add_(blk)))
    l.copy_(top)


def _as4(t: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """``t`` (``[..., H, rows, D]``) as ``[prod(lead), H, rows, D]`` (a view where it can be)."""
    return t.expand(*lead, *t.shape[-3:]).reshape(-1, *t.shape[-3:])


def _mask4(mask: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """The whole mask as 4-d ``[prod(lead) or 1, H or 1, S or 1, S]`` (a view, but for several
    batch dims, which are merged)."""
    if mask.ndim <= 2:
        return mask.view(*(1,) * (4 - mask.ndim), *mask.shape)
    mask = mask.view(*(1,) * (len(lead) + 3 - mask.ndim), *mask.shape)
    if len(lead) == 1:
        return mask
    return mask.expand(*lead, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:]) if lead else mask.unsqueeze(0)


class _RingAttention(torch.autograd.Function):
    """Ring attention (module docstring): saves ``q, k, v``, the output and its LSE."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, groups, ranks, index):
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        q4, k4, v4 = (_as4(t, lead) for t in (q, k, v))
        mask4 = None if mask is None else _mask4(mask, lead)
        cp, rows = len(ranks), q.shape[-2]
        seq = rows * cp
        probe = None if mask4 is None else _mask_view(mask4, 0, rows, 0, rows)
        kernel = _kernel(q4, k4, v4, probe, causal, scale, groups)
        mdt = None if mask4 is None else _mask_dtype(kernel, mask4.dtype, q.dtype)
        plan = [_masked_plan(seq, cp, index, src, causal, mask4, mdt) if mask4 is not None else
                [(b, None, None) for b in ring_plan(seq, cp, index, src, causal)]
                for src in ((index - t) % cp for t in range(cp))]
        out = q.new_zeros((*lead, q.shape[-3], rows, v.shape[-1]), dtype=_acc(q.dtype))
        out4 = out.view(-1, *out.shape[-3:])
        lse = q.new_full(out4.shape[:-1], -_INF, dtype=out.dtype)
        kv, rng = [k4, v4], None
        # saturated rows (HF's finfo.min): the LSE as (largest score, log-count) pairs
        run = torch.zeros_like(lse) if any(x[2] is not None for blocks in plan for x in blocks) else None
        for t, blocks in enumerate(plan):
            shift = _Shift(kv, ranks, index) if t < cp - 1 else None
            for blk, dead, lo in blocks:
                o_b, l_b, r = _forward_kernel(kernel, q4.narrow(-2, *blk.q), kv[0].narrow(-2, *blk.k),
                                              kv[1].narrow(-2, *blk.k), _bias(mask4, blk, q4, kernel),
                                              blk.causal, scale, groups)
                rng = r if rng is None else rng
                _merge(out4, lse, o_b, l_b, blk.q, dead, None if run is None else (run, 0.0 if lo is None else lo))
            if shift is not None:
                kv = shift.wait()
        if run is not None:
            lse.add_(run)
        res = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, res, lse)
        ctx.args = [[x[0] for x in blocks] for blocks in plan], kernel, scale, groups, ranks, index, rng, lead
        return res

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, res, lse = ctx.saved_tensors
        plan, kernel, scale, groups, ranks, index, rng, lead = ctx.args
        q4, k4, v4, o4 = (_as4(t, lead) for t in (q, k, v, res))
        g4 = _as4(grad, lead).contiguous()
        mask4 = None if mask is None else _mask4(mask, lead)
        lse = lse.masked_fill(lse == -_INF, _INF)           # rows masked everywhere: no gradient
        rows = q.shape[-2]

        def zeros():
            return [torch.zeros_like(k4, dtype=lse.dtype), torch.zeros_like(v4, dtype=lse.dtype)]

        dq = q4.new_zeros((*lead, *q.shape[-3:]), dtype=lse.dtype)
        dq4 = dq.view(q4.shape)
        kv, home = [k4, v4], None
        for t, blocks in enumerate(plan):
            shift = _Shift(kv, ranks, index) if t < len(plan) - 1 else None
            parts = []   # (key rows, dk, dv) to add once this source's gradients arrive
            for blk in blocks:
                dq_b, dk_b, dv_b = _backward_kernel(
                    kernel, g4.narrow(-2, *blk.q), q4.narrow(-2, *blk.q), kv[0].narrow(-2, *blk.k),
                    kv[1].narrow(-2, *blk.k), _bias(mask4, blk, q4, kernel), o4.narrow(-2, *blk.q),
                    lse.narrow(-1, *blk.q).contiguous(), blk.causal, scale, groups, rng)
                dq4.narrow(-2, *blk.q).add_(dq_b)
                if len(blocks) == 1:
                    parts.append((blk.k, dk_b, dv_b))
                    continue
                if not parts:   # several blocks (mask tiles): summed here, memory stays s rows
                    parts.append(((0, rows), *zeros()))
                parts[0][1].narrow(-2, *blk.k).add_(dk_b)
                parts[0][2].narrow(-2, *blk.k).add_(dv_b)
            if home is None:
                dkv = zeros()
            else:
                dkv = home.wait()                             # this source's gradients so far
            for span, dk_b, dv_b in parts:
                dkv[0].narrow(-2, *span).add_(dk_b)
                dkv[1].narrow(-2, *span).add_(dv_b)
            home = _Shift(dkv, ranks, index)                 # after cp shifts each source's is home
            if shift is not None:
                kv = shift.wait()
        dk, dv = home.wait()
        grads = [g.view(*lead, *t.shape[-3:]).to(t.dtype).sum_to_size(t.shape)
                 for g, t in ((dq, q), (dk, k), (dv, v))]
        return (*grads, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                   scale: float, groups: int, ranks: Ranks, index: int) -> torch.Tensor:
    """Ring attention for :func:`.context_parallel.cp_attention` (arguments checked there):
    ``groups`` query heads per key / value head, ``mask`` detached or None."""
    return _RingAttention.apply(q, k, v, mask, causal, scale, groups, ranks, index)
