"""Per-layer data parallelism and ZeRO-2/3 on one flat parameter buffer per layer.

Every layer's trainable parameters are packed, in graph order, into one flat 1-D buffer (the *full*
buffer, :class:`FlatParams`: the parameters back to back, padded at the end to ``dp * S``), sharded
in FSDP2's per-parameter dim-0 layout (:class:`ZeroLayout`): each parameter is padded along dim 0
to a multiple of ``dp`` rows, and rank ``r``'s *shard* (``S`` elements) is, for every parameter in
turn, its rows ``[r * R, (r + 1) * R)`` (``R`` rows per rank; a 1-D or 0-D
parameter counts its elements as rows). So a rank's part of each parameter is a rectangular dim-0
slice of it (sharded checkpoints store it as one chunk with its global offset, :mod:`.chunks`).
The layer's graph reads its parameters as views of the full buffer (``param_view``); one call at the
top of the layer graph produces the buffer and decides what its backward does:

=========  ==========================  ==========================  ============================
``sdp``    rank holds at rest          forward                     backward (gradient of buffer)
=========  ==========================  ==========================  ============================
"none"     whole buffer (a Parameter)  ``dp_params``: nothing      accumulate; last micro-batch:
                                                                   into the DP group's buckets
                                                                   (:class:`GradBuckets`), async
                                                                   all-reduce per full bucket
"zero2"    whole buffer and its shard  ``zero2_params``: nothing    accumulate; last micro-batch:
           (the Parameter, a copy)                                  async reduce-scatter
"zero3"    its shard only              ``zero3_all_gather``;        async reduce-scatter each
                                       ``zero3_release`` frees the micro-batch, then free
                                       buffer after the layer      the re-gathered buffer
=========  ==========================  ==========================  ============================

Collectives (FSDP2's copy-in / copy-out): a gather is *one* all-gather of the shard into a
``[dp, S]`` staging buffer, then a copy of each parameter's ``[dp, seg]`` columns into its place in
the full buffer (parameters back to back, padding at the end); a gradient is copied the other way
into a ``[dp, S]`` staging buffer and reduce-scattered once. NOTE: measured on 2 gloo ranks (gpt-tiny block, hidden 128 / 256), one
collective plus the copies is 2-5x faster than one collective per parameter (per-call latency
dominates); the price is the staging buffer, one whole-layer buffer, which the cost model counts
as transient bytes (:mod:`galvatron_fx.cost.model`).

The optimizer sees one Parameter per layer (``FlatParams.flat_param``: the whole buffer, or this
rank's shard), whose ``.grad`` :func:`finish_grad_sync` fills with the gradient of the global-batch
loss. After ``optimizer.step()``, :func:`sync_params` all-gathers ZeRO-2 shards into the whole
buffer. NOTE: ZeRO-2's shard is no longer a view of its replicated buffer (its rows are scattered
over the parameters' blocks), so fp32 ZeRO-2 with ``dp > 1`` holds the shard as a copy: ``S``
elements (1/dp of the layer) more than a flat-range shard did; mixed precision already kept its
fp32 masters apart from the low-precision buffer and pays nothing more.

NOTE: why not DDP / FSDP2. Layers here are fx submodules that share the default world with
per-layer DP groups, tied weights cross layers (BERT's decoder reads the embedding) and the cost
model predicts state bytes from storages. One autograd Function at the entry of each layer fires
exactly once per layer per backward, when the layer's whole gradient is complete; DP layers then
fill DDP-style cross-layer buckets of ``bucket_bytes`` (in reverse layer order, overlapped with the
rest of the backward). Owning the storages makes ZeRO-2 (replicated params, sharded grads and optimizer
states) exact, which FSDP2 has no mode for, and keeps the measured bytes equal to the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .groups import Ranks, all_gather_single, group, reduce_scatter_single

SDP_MODES = ("none", "zero2", "zero3")
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class ZeroLayout:
    """Where each parameter of a layer sits in the full buffer and in a rank's shard (elements).

    Parameter ``i`` has ``rows[i]`` rows of ``row[i]`` elements (dim 0 of an n-D shape; a 1-D or
    0-D parameter is ``numel`` rows of one element), padded to ``dp * per_rank[i]`` rows:

    * full buffer: the parameters back to back (row-major, at ``offsets[i]``, as the layer graph
      reads them), then padding up to ``padded = dp * shard`` elements;
    * rank ``r``'s shard: parameter ``i``'s rows ``[r * per_rank[i], (r + 1) * per_rank[i])`` at
      ``shard_offsets[i]``, ``seg(i) = per_rank[i] * row[i]`` elements (zero rows past the
      parameter's end); ``shard`` elements in all.

    A ``[dp, shard]`` staging buffer (row ``r``: rank ``r``'s shard, what one all-gather gives) and
    the full buffer convert into each other with at most two copies per parameter
    (:meth:`copy_out`, :meth:`copy_in`).
    """

    dp: int
    rows: tuple[int, ...]
    row: tuple[int, ...]
    per_rank: tuple[int, ...]
    offsets: tuple[int, ...]
    shard_offsets: tuple[int, ...]
    shard: int

    @property
    def padded(self) -> int:
        return self.dp * self.shard

    def seg(self, i: int) -> int:
        """Elements of parameter ``i`` in one rank's shard (padding rows included)."""
        return self.per_rank[i] * self.row[i]

    def held_rows(self, i: int, rank: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of parameter ``i`` that rank ``rank`` holds (padding excluded; may be empty)."""
        lo = min(rank * self.per_rank[i], self.rows[i])
        return lo, min(lo + self.per_rank[i], self.rows[i])

    def _pairs(self, full: torch.Tensor, staging: torch.Tensor):
        """Per parameter: (its elements in ``full``, its ``[dp, seg]`` columns of ``staging``, the
        ranks ``k`` holding ``per_rank`` whole rows, the elements of rank ``k``'s partial part)."""
        st = staging.view(self.dp, self.shard)
        for i, (o, so) in enumerate(zip(self.offsets, self.shard_offsets)):
            seg = self.seg(i)
            if seg == 0:
                continue
            k = self.rows[i] // self.per_rank[i]
            rem = (self.rows[i] - k * self.per_rank[i]) * self.row[i]
            yield full[o:o + self.rows[i] * self.row[i]], st[:, so:so + seg], k, rem

    def copy_out(self, staging: torch.Tensor, full: torch.Tensor) -> None:
        """``full`` (the whole buffer) from a ``[dp, shard]`` staging buffer of every rank's shard."""
        for dst, cols, k, rem in self._pairs(full, staging):
            seg = cols.shape[1]
            if k:
                dst[:k * seg].view(k, seg).copy_(cols[:k])
            if rem:
                dst[k * seg:].copy_(cols[k, :rem])

    def copy_in(self, full: torch.Tensor, staging: torch.Tensor) -> None:
        """A ``[dp, shard]`` staging buffer from ``full`` (padding rows zeroed)."""
        for src, cols, k, rem in self._pairs(full, staging):
            seg = cols.shape[1]
            if k:
                cols[:k].copy_(src[:k * seg].view(k, seg))
            if k < self.dp:
                cols[k, :rem].copy_(src[k * seg:])
                cols[k, rem:].zero_()
                cols[k + 1:].zero_()

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of rank ``rank``'s shard of the full buffer ``full`` (padding rows zero)."""
        out = full.new_zeros(self.shard)
        for i, (o, so) in enumerate(zip(self.offsets, self.shard_offsets)):
            a, b = self.held_rows(i, rank)
            w = self.row[i]
            out[so:so + (b - a) * w].copy_(full[o + a * w:o + b * w])
        return out


def zero_layout(shapes, dp: int) -> ZeroLayout:
    """The :class:`ZeroLayout` of parameters of ``shapes`` (TP-local) over ``dp`` ranks; the cost
    model prices the same (:func:`galvatron_fx.cost.memory.states_bytes`)."""
    rows, row = [], []
    for shape in shapes:
        shape = tuple(shape)
        rows.append(shape[0] if len(shape) > 1 else math.prod(shape))
        row.append(math.prod(shape[1:]) if len(shape) > 1 else 1)
    per_rank = [math.ceil(r / dp) for r in rows]
    offsets, shard_offsets, n, m = [], [], 0, 0
    for r, w, pr in zip(rows, row, per_rank):
        offsets.append(m)
        shard_offsets.append(n)
        m += r * w
        n += pr * w
    return ZeroLayout(dp, tuple(rows), tuple(row), tuple(per_rank), tuple(offsets), tuple(shard_offsets), n)


class FlatParams(nn.Module):
    """One layer's trainable parameters as one flat buffer (see the module docstring).

    ``fqns``, ``shapes`` and ``offsets`` (elements) locate each original parameter in the full
    buffer; ``layout`` (:class:`ZeroLayout`) also in each rank's shard. ``numel`` is the unpadded
    size, ``padded`` the full buffer's (every parameter padded along dim 0 to a multiple of ``dp``
    rows), ``shard_numel`` a shard's (``padded / dp``).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], mode: str, dp_ranks: Ranks, rank: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__()
        if mode not in SDP_MODES:
            raise ValueError(f"sdp mode must be one of {SDP_MODES}, got {mode!r}")
        self.mode, self.dp_ranks, self.bucket_bytes = mode, tuple(dp_ranks), int(bucket_bytes)
        self.dp = len(self.dp_ranks)
        self.dp_index = self.dp_ranks.index(rank)
        self.fqns = list(tensors)
        self.shapes = [tuple(t.shape) for t in tensors.values()]
        self.layout = zero_layout(self.shapes, self.dp)   # the cost model predicts the same
        self.offsets = list(self.layout.offsets)
        self.numel = sum(t.numel() for t in tensors.values())
        self.padded, self.shard_numel = self.layout.padded, self.layout.shard
        first = next(iter(tensors.values()), torch.empty(0))
        # mixed precision (runtime/precision.py): the Parameter is the fp32 master, the layer reads
        # a working copy in ``compute_dtype``; gradients are reduced in ``reduce_dtype``
        self.compute_dtype = compute_dtype if compute_dtype not in (None, first.dtype) else None
        self.reduce_dtype = reduce_dtype or first.dtype
        full = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for t, off in zip(tensors.values(), self.offsets):
                full[off:off + t.numel()].copy_(t.reshape(-1))
        if mode == "none":
            self.flat_param = nn.Parameter(full)
            self.full = full.to(self.compute_dtype) if self.mixed else None
        elif mode == "zero2" and not self.mixed and self.dp == 1:
            self.full = full
            self.flat_param = nn.Parameter(full)   # dp = 1: the shard is the whole buffer (shared storage)
        else:
            self.flat_param = nn.Parameter(self.layout.shard_of(full, self.dp_index))
            self.full = full.to(self.compute_dtype) if self.mixed else full
            if mode == "zero3":
                _free(self.full)
        # zero3: set when a view of the buffer leaves the layer (tied weight): the buffer then
        # stays gathered from the layer's forward until its backward
        self.keep_gathered = False
        self.regather_in_backward = True  # zero3: False under checkpointing (recompute gathers)
        self._acc: torch.Tensor | None = None
        self._pending: list = []
        self.stale = False   # the optimizer may have updated the masters since the working copy was made
        self.last_micro_batch = True
        # sdp="none", dp > 1: the DDP-style buckets shared with the other layers of this DP group
        # (GradBuckets); None: one all-reduce per layer (split in bucket_bytes pieces)
        self.buckets: GradBuckets | None = None

    @property
    def mixed(self) -> bool:
        """The layer computes on a low-precision working copy of fp32 masters."""
        return self.compute_dtype is not None

    def shard_span(self, i: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of ``flat_param`` holding parameter ``i``'s rows on this rank
        (ZeRO: its dim-0 slice, padding excluded, possibly empty; ``sdp="none"``: the whole parameter)."""
        if self.mode == "none":
            return self.offsets[i], self.offsets[i] + math.prod(self.shapes[i])
        a, b = self.layout.held_rows(i, self.dp_index)
        lo = self.layout.shard_offsets[i]
        return lo, lo + (b - a) * self.layout.row[i]

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, dp_ranks={self.dp_ranks}, params={len(self.fqns)}, "
                f"numel={self.numel}, padded={self.padded}")

    # ------------------------------------------------------------------ buffer
    def working(self) -> torch.Tensor:
        """The whole buffer the layer computes with (``_LayerParams``): the masters (fp32 DP),
        the replicated buffer (ZeRO-2), the low-precision copy (mixed DP) or, gathered now, ZeRO-3's."""
        if self.mode == "zero3":
            return self.gather_full()
        return self.full if self.full is not None else self.flat_param.data

    def gather_full(self) -> torch.Tensor:
        """zero3: all-gather the whole buffer into ``self.full``'s storage (allocating it); mixed:
        the shards are cast first, so the gather moves low-precision bytes."""
        if self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            with torch.no_grad():
                self._gather_into(self.full.data)
        return self.full

    def _gather_into(self, full: torch.Tensor) -> None:
        """Fill ``full`` (a whole buffer) from every rank's masters: cast this rank's shard to
        ``full``'s dtype, all-gather into a ``[dp, S]`` staging buffer, copy out per parameter
        (collective over DP; ``dp = 1``: a copy, shard and buffer share the layout)."""
        shard = self.flat_param.data.to(full.dtype)
        if self.dp == 1:
            full.copy_(shard)
            return
        staging = full.new_empty(self.padded)
        all_gather_single(staging, shard.contiguous(), group=group(self.dp_ranks))
        self.layout.copy_out(staging, full)

    def free_full(self) -> None:
        """zero3: drop the gathered buffer (its storage shrinks to 0 bytes)."""
        if self.mode == "zero3":
            _free(self.full)

    def unsharded(self) -> dict[str, torch.Tensor]:
        """fqn -> a copy of this rank's whole parameter, from the masters (ZeRO gathers the
        shards unless ZeRO-2's fp32 buffer already holds them: collective over DP)."""
        if self.mode == "none":
            full = self.flat_param.data.clone()
        elif self.mode == "zero2" and not self.mixed:
            full = self.full.clone()
        else:
            full = self.flat_param.data.new_empty(self.padded)
            self._gather_into(full)
        return {fqn: full[off:off + math.prod(shape)].view(shape)
                for fqn, off, shape in zip(self.fqns, self.offsets, self.shapes)}

    def masters_changed(self) -> None:
        """The masters (``flat_param``) were or may be overwritten in place (an optimizer step to
        come, a checkpoint load): drop ZeRO-3's gathered buffer and mark a working copy that is not
        the masters themselves stale (:meth:`sync_after_step` rebuilds it; collective over DP for
        ZeRO-2)."""
        self.free_full()
        self.stale = (self.mode == "zero2" and (self.dp > 1 or self.mixed)) or (self.mode == "none" and self.mixed)

    # --------------------------------------------------------------- gradients
    def on_grad(self, grad: torch.Tensor) -> None:
        """Backward of the layer-entry call: ``grad`` is the whole-buffer gradient of one pass (in
        the working copy's dtype); accumulation over micro-batches is in the masters' dtype."""
        if self.mode == "zero3":
            self._launch_reduce_scatter(grad)
            self.free_full()
            return
        if self._acc is None:
            self._acc = grad.detach().to(self.flat_param.dtype, copy=True)
        else:
            self._acc.add_(grad)
        if not self.last_micro_batch:
            return
        acc, self._acc = self._acc, None
        if self.mode == "zero2":
            self._launch_reduce_scatter(acc)
        elif self.dp == 1:
            self._pending.append((None, acc))
        elif self.buckets is not None:
            self.buckets.add(self, acc.to(self.reduce_dtype))
        else:
            acc = acc.to(self.reduce_dtype)
            step = max(1, self.bucket_bytes // acc.element_size())
            for lo in range(0, acc.numel(), step):
                bucket = acc[lo:lo + step]
                self._pending.append((dist.all_reduce(bucket, group=group(self.dp_ranks), async_op=True), None))
            self._pending.append((None, acc))

    def _launch_reduce_scatter(self, grad: torch.Tensor) -> None:
        if self.dp == 1:
            self._pending.append((None, grad.detach().to(self.flat_param.dtype, copy=True)))
            return
        # copy-in: each parameter's rows into its [dp, seg] columns of a [dp, S] staging buffer
        staging = grad.new_empty(self.padded, dtype=self.reduce_dtype)
        self.layout.copy_in(grad.detach(), staging)
        out = staging.new_empty(self.shard_numel)
        work = reduce_scatter_single(out, staging, group=group(self.dp_ranks), async_op=True)
        self._pending.append((work, staging))   # keep the input alive until the op completes
        self._pending.append((None, out))

    def finish_grad_sync(self) -> None:
        """Wait for this layer's collectives and set ``flat_param.grad`` (sum of the results, in the
        masters' dtype)."""
        if self.buckets is not None:
            self.buckets.finish()   # the first store to finish hands every store of its buckets its part
        total = None
        for work, _value in self._pending:
            if work is not None:
                work.wait()
        for work, value in self._pending:
            if work is None:
                value = value.to(self.flat_param.dtype)
                total = value if total is None else total + value
        self._pending = []
        self._acc = None
        if total is not None:
            self.flat_param.grad = total.detach()
        # NOTE: whatever optimizer the user built may now update the masters; the working copy
        # (ZeRO-2's whole buffer, a mixed DP copy) is rebuilt before it is read next
        # (sync_after_step), so no hook on the user's optimizer is needed.
        self.masters_changed()

    def zero_grad_state(self) -> None:
        """Start of a step: no gradient, no pending op, no stale gathered buffer."""
        self._pending, self._acc = [], None
        if self.buckets is not None:
            self.buckets.reset()
        self.flat_param.grad = None
        self.free_full()

    def sync_after_step(self) -> None:
        """Rebuild the working copy when the masters may have changed since it was made (an
        optimizer step, a checkpoint load): ZeRO-2 all-gathers the (low-precision) shards
        (collective over DP), mixed DP casts locally; a no-op otherwise."""
        if not self.stale:
            return
        with torch.no_grad():
            if self.mode == "none":
                self.full.copy_(self.flat_param.data)
            else:
                self._gather_into(self.full)
        self.stale = False


class GradBuckets:
    """DDP-style gradient buckets across the ``sdp="none"`` layers of one DP group.

    Layers hand their finished (accumulated) gradients over in backward order (:meth:`add`); once
    ``bucket_bytes`` are collected they are concatenated into one buffer and all-reduced
    asynchronously (overlapping the rest of the backward); :meth:`finish` launches the last partial
    bucket, waits, and gives each layer its slice of the reduced buffers. Every rank of the group
    sees the same layers in the same order, so all form the same buckets. Transient memory: one
    bucket (the concatenated copy) per bucket in flight.
    """

    def __init__(self, ranks: Ranks, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.ranks, self.bucket_bytes = tuple(ranks), int(bucket_bytes)
        self._open: list[tuple[FlatParams, torch.Tensor]] = []
        self._open_bytes = 0
        self._in_flight: list[tuple[object, torch.Tensor, list[tuple[FlatParams, int]]]] = []

    def add(self, store: FlatParams, grad: torch.Tensor) -> None:
        self._open.append((store, grad))
        self._open_bytes += grad.numel() * grad.element_size()
        if self._open_bytes >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        if not self._open:
            return
        parts = [(st, g.numel()) for st, g in self._open]
        flat = torch.cat([g.reshape(-1) for _, g in self._open]) if len(self._open) > 1 else self._open[0][1]
        work = dist.all_reduce(flat, group=group(self.ranks), async_op=True)
        self._in_flight.append((work, flat, parts))
        self._open, self._open_bytes = [], 0

    def finish(self) -> None:
        """Launch the open bucket, wait for all, append each layer's reduced slice to its pending list."""
        self._launch()
        for work, flat, parts in self._in_flight:
            work.wait()
            off = 0
            for st, n in parts:
                st._pending.append((None, flat[off:off + n]))
                off += n
        self._in_flight = []

    def reset(self) -> None:
        self._open, self._open_bytes, self._in_flight = [], 0, []


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


# ------------------------------------------------------------------------------ graph calls
class _LayerParams(torch.autograd.Function):
    """Entry of a layer: returns the whole buffer; backward hands its gradient to ``store``."""

    @staticmethod
    def forward(ctx, flat_param, store: FlatParams):
        ctx.store = store
        return store.working().data

    @staticmethod
    def backward(ctx, grad):
        ctx.store.on_grad(grad)
        return None, None


class _Release(torch.autograd.Function):
    """Exit of a ZeRO-3 layer: free the gathered buffer; re-gather it before the layer's backward."""

    @staticmethod
    def forward(ctx, store: FlatParams, *outs):
        ctx.store = store
        store.free_full()
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.store.regather_in_backward:
            ctx.store.gather_full()
        return (None, *grads)


def dp_params(store: FlatParams) -> torch.Tensor:
    """Data parallel: the whole parameter buffer; backward all-reduces its gradient over DP."""
    return _LayerParams.apply(store.flat_param, store)


def zero2_params(store: FlatParams) -> torch.Tensor:
    """ZeRO-2: the whole (replicated) buffer; backward reduce-scatters its gradient over DP."""
    return _LayerParams.apply(store.flat_param, store)


def zero3_all_gather(store: FlatParams) -> torch.Tensor:
    """ZeRO-3: all-gather the buffer over DP; backward reduce-scatters its gradient."""
    return _LayerParams.apply(store.flat_param, store)


def zero3_release(store: FlatParams, outs: tuple) -> tuple:
    """ZeRO-3: free the gathered buffer after the layer; re-gather before its backward."""
    if torch._C._current_graph_task_id() != -1:  # checkpoint recomputation inside backward
        return tuple(outs)
    diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not diff:
        store.free_full()
        return tuple(outs)
    released = _Release.apply(store, *[outs[i] for i in diff])
    out = list(outs)
    for i, r in zip(diff, released):
        out[i] = r
    return tuple(out)


def param_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter ``shape`` at element ``offset`` of a layer's buffer (a differentiable view)."""
    return flat[offset:offset + math.prod(shape)].view(shape)


ENTRY = {"none": dp_params, "zero2": zero2_params, "zero3": zero3_all_gather}
