"""Context-parallel runtime primitives (runtime/context_parallel.py) on 2 and 4 gloo ranks.

Every rank builds the same seeded whole tensors, takes its zig-zag shard and runs the op; the parent
puts the shards' outputs and gradients back by :func:`seq_positions` and compares them with
``F.scaled_dot_product_attention`` on the whole sequence (fp32, 1e-5, against the default dispatch,
the kernel one device runs: :func:`_reference`). World 4 runs
cp=4 and, on the subgroups (0, 1) and (2, 3), cp=2 (ring peers are then global ranks != group ranks).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from galvatron_fx.runtime.context_parallel import (
    boundary_gather,
    boundary_take,
    cp_attention,
    gather_seq,
    gather_seq_of,
    local_seq,
    local_seq_of,
    ring_block_pairs,
    seq_positions,
)
from tests.dist_utils import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
B, H, D = 2, 4, 8
CASES = ("plain", "causal", "window", "padding", "padding_causal", "alibi", "gqa", "gqa_alibi", "short", "nobatch",
         "bf16", "bf16_padding")
VARIANTS = {"ring": ("ring", None), "ring-tiles": ("ring", "tiles"), "ring-eager": ("ring", "eager"),
            "ulysses": ("ulysses", None)}
"""``ring-tiles``: masked blocks cut into tiles of 3 query rows (chunks of 4 split off-diagonal);
``ring-eager``: torch's math backend only, so ring runs its eager kernel."""


# ------------------------------------------------------------------------------ single process
def test_seq_positions_zig_zag_contiguous_and_errors():
    assert seq_positions(16, 2, 0) == (0, 1, 2, 3, 12, 13, 14, 15)
    assert seq_positions(16, 2, 1) == tuple(range(4, 12))
    assert seq_positions(16, 4, 1) == (2, 3, 12, 13)
    assert seq_positions(6, 2, 1) == (3, 4, 5)                         # 6 % 4 != 0: contiguous
    assert seq_positions(5, 1, 0) == tuple(range(5))
    assert seq_positions(16, 4, 2) is seq_positions(16, 4, 2)            # cached
    for seq, cp in ((16, 2), (16, 4), (12, 4), (24, 3)):
        assert sorted(p for i in range(cp) for p in seq_positions(seq, cp, i)) == list(range(seq))
    with pytest.raises(ValueError, match=r"7 positions .* cp=2.*multiple of cp"):
        seq_positions(7, 2, 0)
    with pytest.raises(ValueError, match="7 positions"):
        local_seq(torch.zeros(2, 7), 1, 2, 0)


def test_ring_block_pairs_balanced_under_causal_zig_zag():
    for cp in (2, 4, 8):
        assert [ring_block_pairs(16 * cp, cp, i, True) for i in range(cp)] == [2 * cp + 1] * cp
        assert ring_block_pairs(16 * cp, cp, 0, False) == 4 * cp
    assert [ring_block_pairs(12, 4, i, True) for i in range(4)] == [1, 2, 3, 4]   # contiguous


def test_attention_errors():
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match="dropout.*set the attention dropout to 0 or use cp=1"):
        cp_attention(q, q, q, dropout_p=0.1, ranks=(0, 1), index=0)
    with pytest.raises(ValueError, match=r"3 attention heads .* cp=2 .*kind='ring'"):
        cp_attention(q, q, q, ranks=(0, 1), index=0, kind="ulysses")
    with pytest.raises(ValueError, match="kind"):
        cp_attention(q, q, q, ranks=(0, 1), index=0, kind="tree")


# --------------------------------------------------------------------------------- attention
def _case(name: str, cp: int) -> dict:
    """Whole inputs of one case, the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(sum(map(ord, name)) + cp)
    seq = 3 * cp if name == "short" else 16                  # "short": S % (2 cp) != 0
    gqa = name.startswith("gqa")
    lead, hkv, dv = ((), H, 6) if name == "nobatch" else ((B,), 2 if gqa else H, D)
    q = torch.randn(*lead, H, seq, D, generator=g)
    k, v = torch.randn(*lead, hkv, seq, D, generator=g), torch.randn(*lead, hkv, seq, dv, generator=g)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)
    mask = None
    if name in ("window", "nobatch"):                         # Mistral's sliding window of 8
        mask = (j <= i) & (i - j < 8)
    elif "padding" in name:                                   # keys padded: HF's min, and -inf
        mask = torch.zeros(B, 1, seq, seq)
        mask[0, ..., :3] = torch.finfo(torch.float32).min     # beside bf16 operands too
        mask[1, ..., slice(-3, None) if name == "padding" else slice(3)] = float("-inf")   # + causal: rows all masked
    elif name.endswith("alibi"):
        slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])[:, None, None]
        mask = torch.where(j <= i, slopes * (j - i), float("-inf"))[None]
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), mask=mask, w=torch.randn(*q.shape[:-1], dv, generator=g),
                causal=name in ("causal", "padding_causal", "gqa", "gqa_alibi", "short", "bf16", "bf16_padding"),
                gqa=gqa)


def _groups(world: int, cp: int):
    from galvatron_fx.runtime.groups import GROUPS

    sets = [tuple(range(b, b + cp)) for b in range(0, world, cp)]
    GROUPS.ensure(sets)
    return sets


def _attention(rank, world, variant, cps):
    """Per (cp, case): this rank's output and q / k / v gradients."""
    from galvatron_fx.runtime import ring_attention

    kind, how = VARIANTS[variant]
    ring_attention.TILE_ROWS = 3 if how == "tiles" else ring_attention.TILE_ROWS
    out = {}
    for cp in cps:
        ranks = next(s for s in _groups(world, cp) if rank in s)
        index = ranks.index(rank)
        for name in CASES:
            c = _case(name, cp)
            q, k, v = (local_seq(c[t], -2, cp, index).requires_grad_() for t in "qkv")
            with sdpa_kernel(SDPBackend.MATH) if how == "eager" else contextlib.nullcontext():
                o = cp_attention(q, k, v, c["mask"], is_causal=c["causal"], enable_gqa=c["gqa"], ranks=ranks,
                                 index=index, kind=kind)
                assert o.dtype == q.dtype and o.shape == (*q.shape[:-1], v.shape[-1]), (name, o.dtype, o.shape)
                (o.float() * local_seq(c["w"], -2, cp, index)).sum().backward()
            out[cp, name] = (ranks, index, o.detach(), q.grad, k.grad, v.grad)
    return out


def _reference(name: str, cp: int, kind: str):
    """SDPA on the whole sequence, fp32 operands, the default dispatch: what one device runs (on CPU
    the flash kernel, which takes a mask with ``is_causal``, or the math backend where flash refuses
    the shapes). Both kinds run that kernel on their blocks / head shards, so they share its
    rounding (and its ``finfo.min`` flaw: :func:`test_cpu_flash_kernel_finfo_min_gradient`)."""
    c = _case(name, cp)
    q, k, v = (c[t].float().requires_grad_() for t in "qkv")
    if name == "bf16_padding":   # the mask as one device applies it to bf16 operands
        q, k, v = (c[t].detach().requires_grad_() for t in "qkv")
    o = F.scaled_dot_product_attention(q, k, v, c["mask"], is_causal=c["causal"], enable_gqa=c["gqa"])
    (o.float() * c["w"]).sum().backward()
    return o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()


def _assemble(parts, cp: int) -> list[torch.Tensor]:
    """Whole tensors from ``[(index, (out, dq, dk, dv))]`` of one CP group, by the layout."""
    seq = parts[0][1][0].shape[-2] * cp
    whole = [t.new_empty((*t.shape[:-2], seq, t.shape[-1])).float() for t in parts[0][1]]
    for index, tensors in parts:
        pos = list(seq_positions(seq, cp, index))
        for w, t in zip(whole, tensors):
            w[..., pos, :] = t.float()
    return whole


@pytest.mark.dist
@pytest.mark.parametrize("kind", list(VARIANTS))
@pytest.mark.parametrize("world,cps", [(2, (2,)), pytest.param(4, (4, 2), marks=pytest.mark.matrix)],
                         ids=["world2", "world4"])
def test_attention_matches_sdpa(world, cps, kind):
    results = run_distributed(_attention, world, kind, cps)
    for cp in cps:
        for name in CASES:
            ref = _reference(name, cp, kind)
            assert all(torch.isfinite(t).all() for t in ref), name
            tol = dict(rtol=2e-2, atol=2e-2) if name.startswith("bf16") else TOL
            for ranks in {r[cp, name][0] for r in results}:
                got = _assemble([(results[g][cp, name][1], results[g][cp, name][2:]) for g in ranks], cp)
                for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{kind} cp={cp} {ranks} {name} {what}: {m}")


# ------------------------------------------------------------------------------- layout ops
def _layout(rank, world):
    from torch.testing import assert_close

    cp, ranks = world, _groups(world, world)[0]
    for seq in (16, 3 * cp):                                         # zig-zag and contiguous
        g = torch.Generator().manual_seed(seq)
        full, w = torch.randn(B, seq, 3, generator=g), torch.randn(B, seq, 3, generator=g)
        pos = list(seq_positions(seq, cp, rank))
        mine = full[:, pos]

        # local_seq: plain, a flattened [B * S] label vector (pre), a [B, S * 3] view (post); backward scatters
        labels = torch.arange(B * seq)
        assert torch.equal(local_seq(labels, 0, cp, rank, pre=B), labels.view(B, seq)[:, pos].reshape(-1))
        assert torch.equal(local_seq(full.flatten(1), -1, cp, rank, post=3), mine.flatten(1))
        assert torch.equal(local_seq_of(full.flatten(0, 1), 0, seq, 1, cp, rank), mine.flatten(0, 1))   # pre read
        assert torch.equal(gather_seq_of(mine.flatten(1), 1, seq, 3, ranks, rank), full.flatten(1))
        x = full.clone().requires_grad_()
        y = local_seq(x, -2, cp, rank)
        assert torch.equal(y, mine) and y.is_contiguous()
        (y * w[:, pos]).sum().backward()
        want = torch.zeros_like(w)
        want[:, pos] = w[:, pos]
        assert torch.equal(x.grad, want)

        # gather_seq (pre = B over a flattened [B * s, 3]): the whole value; backward sums over the ranks
        x = local_seq(full.flatten(0, 1), 0, cp, rank, pre=B).requires_grad_()
        y = gather_seq(x, 0, ranks, rank, pre=B)
        assert torch.equal(y, full.flatten(0, 1))
        (y * w.flatten(0, 1) * (rank + 1)).sum().backward()          # each rank's partial gradient
        assert_close(x.grad, local_seq(w.flatten(0, 1), 0, cp, rank, pre=B) * (cp * (cp + 1) / 2))

        # boundary_take: a copy; backward all-gathers the pieces (no sum)
        x = full.clone().requires_grad_()
        y = boundary_take(x, ranks, rank, -2)
        assert torch.equal(y, mine) and y._base is None and y.is_contiguous()
        (y * w[:, pos]).sum().backward()
        assert torch.equal(x.grad, w)

        # boundary_gather: natural order; backward keeps this rank's positions (no sum); round trips
        x = mine.clone().requires_grad_()
        y = boundary_gather(x, ranks, rank, 1)
        assert torch.equal(y, full) and y._base is None
        (y * w).sum().backward()
        assert torch.equal(x.grad, w[:, pos])
        assert torch.equal(boundary_take(boundary_gather(mine, ranks, rank, 1), ranks, rank, 1), mine)
        assert torch.equal(boundary_gather(boundary_take(full, ranks, rank, 1), ranks, rank, 1), full)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_layout_ops(world):
    run_distributed(_layout, world)


# ------------------------------------------------------------------------------------ memory
class _Allocations(TorchDispatchMode):
    """Every op's outputs: the largest new tensor (elements; views excluded, they allocate nothing)
    and the launches (ops that run a kernel or allocate, as the cost model counts them)."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if tensors and not func.is_view:
            self.ops += 1
            self.largest = max(self.largest, *(t.numel() for t in tensors))
        return out


def _memory(rank, world, seq):
    """Per mask at ``seq`` positions over cp = 2: the largest tensor ring attention saves for backward
    (the caller's mask excluded), how many it saves, and the largest tensor any op of its forward and
    backward allocates (mask tiles of 8 query rows)."""
    from galvatron_fx.runtime import ring_attention

    ring_attention.TILE_ROWS = 8
    ranks = _groups(world, world)[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (local_seq(torch.randn(1, 2, seq, 4, generator=g), -2, world, rank).requires_grad_() for _ in range(3))
    i, j = torch.arange(seq)[:, None], torch.arange(seq)
    out = {}
    for name, mask in (("causal", None), ("window", (j <= i) & (i - j < seq // 4))):
        sizes = []

        def pack(t, mask=mask):
            if mask is None or t.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr():
                sizes.append(t.numel())
            return t

        with _Allocations() as seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = cp_attention(q, k, v, mask, is_causal=mask is None, ranks=ranks, index=rank)
            o.sum().backward()
        out[name] = max(sizes), len(sizes), seen.largest
    return out


@pytest.mark.dist
def test_ring_keeps_no_score_matrix_for_backward():
    """S = 64 over cp = 2, D = 4, 2 heads: a block's scores are >= 2 * 16 * 16 elements (a run of
    16 queries by a run of 16 keys); what ring attention keeps is ``s``-row sized (q: 2 * 32 * 4).
    At S = 64 and 256 every tensor it allocates, forward and backward, is ``s``-row sized too (the
    fp32 accumulators; with a mask the tiles' slices, 8 rows by a chunk's keys): it grows with ``s``,
    not with ``s * S``."""
    short, long = run_distributed(_memory, 2, 64)[0], run_distributed(_memory, 2, 256)[0]
    for name in short:
        (saved, count, largest), (saved4, _count, largest4) = short[name], long[name]
        assert count >= 5 and saved <= 2 * 32 * 4 < 2 * 16 * 16, (name, saved, count)
        assert saved4 == 4 * saved and largest <= 2 * 32 * 4 < largest4 + 1, (name, saved4, largest)
        assert largest4 <= 4 * largest < 2 * 128 * 256, (name, largest, largest4)   # linear in s


# ------------------------------------------------------------------------------------ launches
def _launches(rank, world, case):
    """Launches of one ring call, forward and backward; the blocks this rank ran, those whose rows
    are not all its rows, and (with the mask) the tiles its plan scanned."""
    from galvatron_fx.runtime import ring_attention as ra

    cp, seq = world, 16 * world
    ranks = _groups(world, cp)[0]
    g = torch.Generator().manual_seed(0)
    dtype, hkv = (torch.bfloat16, 2) if case == "bf16-gqa" else (torch.float32, 4)
    q, k, v = (local_seq(torch.randn(2, h, seq, 8, generator=g), -2, cp, rank).to(dtype).requires_grad_()
               for h in (4, hkv, hkv))
    i, j = torch.arange(seq)[:, None], torch.arange(seq)
    mask = (i - j < seq // 2) if case == "mask" else None
    with _Allocations() as fwd:
        o = cp_attention(q, k, v, mask, is_causal=True, enable_gqa=hkv != 4, ranks=ranks, index=rank)
    grad = torch.ones_like(o)
    with _Allocations() as bwd:
        torch.autograd.grad(o, (q, k, v), grad)
    if mask is None:
        blocks, scanned = [b for src in range(cp) for b in ra.ring_plan(seq, cp, rank, src, True)], 0
    else:
        m4 = mask.view(1, 1, seq, seq)
        blocks = [x[0] for src in range(cp) for x in ra._masked_plan(seq, cp, rank, src, True, m4, torch.bool)]
        scanned = sum(len(ra.ring_tiles(seq, cp, rank, src, True, ra.TILE_ROWS)) for src in range(cp))
    return fwd.ops, bwd.ops, len(blocks), sum(b.q[1] < seq // cp for b in blocks), scanned


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.matrix)])
@pytest.mark.parametrize("case", ["fp32", "bf16-gqa", "mask"])
def test_ring_launches_match_the_cost_model(world, case):
    """The cost model's launch counts (:mod:`galvatron_fx.cost.context`) are the runtime's, per rank:
    exact without a mask; with one within a quarter (its scans depend on the mask's content)."""
    from galvatron_fx.cost.ring import (
        RING_BLOCK_OPS,
        RING_CALL_OPS,
        RING_CAST_OPS,
        RING_MASK_OPS,
        RING_ROWS_OPS,
        RING_SHIFT_OPS,
    )

    for rank, (fwd, bwd, blocks, partial, scanned) in enumerate(run_distributed(_launches, world, case)):
        cast = case == "bf16-gqa"
        want = [blocks * RING_BLOCK_OPS["fwd"] + (world - 1) * RING_SHIFT_OPS + RING_CALL_OPS["fwd"]
                + cast * RING_CAST_OPS["fwd"],
                blocks * RING_BLOCK_OPS["bwd"] + partial * RING_ROWS_OPS + (2 * world - 1) * RING_SHIFT_OPS
                + RING_CALL_OPS["bwd"] + cast * RING_CAST_OPS["bwd"]]
        if case != "mask":
            assert (fwd, bwd) == tuple(want), (rank, fwd, bwd, want)
            continue
        want[0] += scanned * RING_MASK_OPS["fwd"]
        want[1] += blocks * RING_MASK_OPS["bwd"]
        assert abs(fwd - want[0]) <= 0.25 * want[0] and abs(bwd - want[1]) <= 0.25 * want[1], (rank, fwd, bwd, want)


# ------------------------------------------------------------------------------- kernel choice
def test_kernel_choice_by_device_dtype_and_mask():
    """The block kernel from torch's own pick (``_fused_sdp_choice``): CUDA flash for fp16 / bf16
    without a mask, the memory-efficient kernel with one or in fp32, the eager tiles where torch
    would run math; on CPU its flash kernel (equal head dims). Runs on CPU; the CUDA calls
    themselves are not executed here."""
    from galvatron_fx.runtime.ring_attention import _kernel, choose_kernel

    flash, eff, cudnn, math_ = (int(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                 SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH))
    bf16, f32 = torch.bfloat16, torch.float32
    assert choose_kernel("cuda", bf16, False, 128, 128, flash) == "flash"
    assert choose_kernel("cuda", bf16, False, 128, 128, cudnn) == "flash"          # cuDNN is not called
    assert choose_kernel("cuda", bf16, True, 128, 128, eff) == "efficient"         # a mask: attn_bias
    assert choose_kernel("cuda", bf16, True, 128, 128, cudnn) == "efficient"
    assert choose_kernel("cuda", f32, False, 128, 128, eff) == "efficient"         # fp32
    assert choose_kernel("cuda", bf16, False, 192, 128, eff) == "efficient"        # value head dim differs
    assert choose_kernel("cuda", bf16, False, 100, 100, flash) == "tiled"          # not a multiple of 8
    assert choose_kernel("cuda", bf16, False, 128, 128, math_) == "tiled"
    assert choose_kernel("xpu", bf16, False, 128, 128, flash) == "tiled"
    assert choose_kernel("cpu", f32, True, 64, 64, flash) == "cpu_flash"
    assert choose_kernel("cpu", f32, False, 8, 6, math_) == "tiled"
    q = torch.zeros(2, 4, 8, 16)
    for dtype in (torch.float32, torch.bfloat16):
        x = q.to(dtype)
        assert _kernel(x, x[:, :2], x[:, :2], None, True, 0.25, 2) == "cpu_flash"
        assert _kernel(x, x, x, torch.ones(8, 8, dtype=torch.bool), False, 0.25, 1) == "cpu_flash"
    assert _kernel(q, q, q[..., :6], None, False, 0.25, 1) == "tiled"
    with sdpa_kernel(SDPBackend.MATH):
        assert _kernel(q, q, q, None, True, 0.25, 1) == "tiled"


def test_cpu_flash_kernel_finfo_min_gradient():
    """The ring attention docstring's NOTE: where a row's only keys carry HF's ``finfo.min``, torch's
    CPU flash kernel (what one device runs) returns the math backend's output but not its gradient
    (its LSE lost the row's ``log(sum)``). Ring attention shares the kernel, so it matches the
    kernel (``padding_causal`` above, also over several blocks at cp = 4). If this starts failing,
    torch fixed the kernel: update the NOTE."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., :3] = torch.finfo(torch.float32).min
    mask = mask.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))   # rows 0-2: min only
    runs = {}
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(*x, mask)
        o.backward(torch.ones_like(o))
        runs[backend] = o.detach(), x[2].grad
    (o_math, dv_math), (o_flash, dv_flash) = runs[SDPBackend.MATH], runs[SDPBackend.FLASH_ATTENTION]
    torch.testing.assert_close(o_flash, o_math)
    torch.testing.assert_close(dv_flash[..., 3:, :], dv_math[..., 3:, :])      # keys only normal rows reach
    assert not torch.allclose(dv_flash[..., :3, :], dv_math[..., :3, :])       # the min-only rows' keys
