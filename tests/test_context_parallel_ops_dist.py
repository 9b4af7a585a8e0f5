"""Context-parallel runtime primitives (runtime/context_parallel.py) on 2 and 4 gloo ranks.

Every rank builds the same seeded whole tensors, takes its zig-zag shard and runs the op; the parent
puts the shards' outputs and gradients back by :func:`seq_positions` and compares them with
``F.scaled_dot_product_attention`` on the whole sequence (fp32, 1e-5; ring against SDPA's math
backend, ulysses against the default dispatch it runs itself, see :func:`_reference`). World 4 runs
cp=4 and, on the subgroups (0, 1) and (2, 3), cp=2 (ring peers are then global ranks != group ranks).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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
CASES = ("plain", "causal", "window", "padding", "padding_causal", "alibi", "gqa", "short", "nobatch", "bf16")


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
    lead, hkv, dv = ((), H, 6) if name == "nobatch" else ((B,), 2 if name == "gqa" else H, D)
    q = torch.randn(*lead, H, seq, D, generator=g)
    k, v = torch.randn(*lead, hkv, seq, D, generator=g), torch.randn(*lead, hkv, seq, dv, generator=g)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)
    mask = None
    if name in ("window", "nobatch"):                         # Mistral's sliding window of 8
        mask = (j <= i) & (i - j < 8)
    elif name.startswith("padding"):                          # keys padded: HF's min, and -inf
        mask = torch.zeros(B, 1, seq, seq)
        mask[0, ..., :3] = torch.finfo(torch.float32).min
        mask[1, ..., :3 if name == "padding_causal" else -3:] = float("-inf")   # + causal: rows all masked
    elif name == "alibi":
        slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])[:, None, None]
        mask = torch.where(j <= i, slopes * (j - i), float("-inf"))[None]
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), mask=mask, w=torch.randn(*q.shape[:-1], dv, generator=g),
                causal=name in ("causal", "padding_causal", "gqa", "short", "bf16"), gqa=name == "gqa")


def _groups(world: int, cp: int):
    from galvatron_fx.runtime.groups import GROUPS

    sets = [tuple(range(b, b + cp)) for b in range(0, world, cp)]
    GROUPS.ensure(sets)
    return sets


def _attention(rank, world, kind, cps):
    """Per (cp, case): this rank's output and q / k / v gradients."""
    out = {}
    for cp in cps:
        ranks = next(s for s in _groups(world, cp) if rank in s)
        index = ranks.index(rank)
        for name in CASES:
            c = _case(name, cp)
            q, k, v = (local_seq(c[t], -2, cp, index).requires_grad_() for t in "qkv")
            o = cp_attention(q, k, v, c["mask"], is_causal=c["causal"], enable_gqa=c["gqa"], ranks=ranks, index=index,
                             kind=kind)
            assert o.dtype == q.dtype and o.shape == (*q.shape[:-1], v.shape[-1]), (name, o.dtype, o.shape)
            (o.float() * local_seq(c["w"], -2, cp, index)).sum().backward()
            out[cp, name] = (ranks, index, o.detach(), q.grad, k.grad, v.grad)
    return out


def _reference(name: str, cp: int, kind: str):
    """SDPA on the whole sequence, fp32: for ring its math backend (the definition; it rejects a mask
    with ``is_causal``, so the causal part goes into the mask), for ulysses the default dispatch
    (ulysses runs SDPA itself, so it shares that kernel's rounding)."""
    c = _case(name, cp)
    q, k, v = (c[t].float().requires_grad_() for t in "qkv")
    mask, causal = c["mask"], c["causal"]
    if kind == "ring" and mask is not None and causal:
        above = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
        mask, causal = (mask & ~above if mask.dtype == torch.bool else mask.masked_fill(above, float("-inf"))), False
    with sdpa_kernel(SDPBackend.MATH) if kind == "ring" else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=c["gqa"])
    (o * c["w"]).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


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
@pytest.mark.parametrize("kind", ["ring", "ulysses"])
@pytest.mark.parametrize("world,cps", [(2, (2,)), pytest.param(4, (4, 2), marks=pytest.mark.matrix)],
                         ids=["world2", "world4"])
def test_attention_matches_sdpa(world, cps, kind):
    results = run_distributed(_attention, world, kind, cps)
    for cp in cps:
        for name in CASES:
            ref = _reference(name, cp, kind)
            assert all(torch.isfinite(t).all() for t in ref), name
            tol = dict(rtol=2e-2, atol=2e-2) if name == "bf16" else TOL
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
def _saved(rank, world):
    """Per mask: the largest tensor ring attention saves for backward (elements; the caller's mask
    excluded) and how many it saves."""
    seq, cp = 64, world
    ranks = _groups(world, cp)[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (local_seq(torch.randn(1, 2, seq, 4, generator=g), -2, cp, rank).requires_grad_() for _ in range(3))
    i, j = torch.arange(seq)[:, None], torch.arange(seq)
    out = {}
    for name, mask in (("causal", None), ("window", (j <= i) & (i - j < 16))):
        sizes = []

        def pack(t):
            if mask is None or t.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr():
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = cp_attention(q, k, v, mask, is_causal=mask is None, ranks=ranks, index=rank)
        o.sum().backward()
        out[name] = max(sizes), len(sizes)
    return out


@pytest.mark.dist
def test_ring_keeps_no_score_matrix_for_backward():
    """S = 64 over cp = 2, D = 4, 2 heads: a block's scores are >= 2 * 16 * 16 elements (a run of
    16 queries by a run of 16 keys); what ring attention keeps is ``s``-row sized (q: 2 * 32 * 4)."""
    for r in run_distributed(_saved, 2):
        for name, (largest, count) in r.items():
            assert count >= 5 and largest <= 2 * 32 * 4 < 2 * 16 * 16, (name, largest, count)
