"""Per-layer data parallelism and ZeRO-2/3 on one flat parameter buffer per layer.

Every layer's trainable parameters are packed, in graph order, into one flat 1-D buffer (the *full*
buffer, :class:`FlatParams`: the parameters back to back, padded at the end to ``dp * S``), sharded
in FSDP2's per-parameter dim-0 layout (:class:`~.zero_layout.ZeroLayout`): each parameter is padded along dim 0
to a multiple of ``dp`` rows, and rank ``r``'s *shard* (``S`` elements) is, for every parameter in
turn, its rows ``[r * R, (r + 1) * R)`` (``R`` rows per rank; a 1-D or 0-D
parameter counts its elements as rows). So a rank's part of each parameter is a rectangular dim-0
slice of it (sharded checkpoints store it as one chunk with its global offset, :mod:`.chunks`).
The layer's graph reads its parameters as views of the full buffer's chunks; one call at the top of
the layer graph produces them (:class:`_LayerParams`) and decides what its backward does:

=========  ==========================  ==========================  ============================
``sdp``    rank holds at rest          forward                     backward (gradient of buffer)
=========  ==========================  ==========================  ============================
"none"     whole buffer (a Parameter)  ``dp_params``: nothing      accumulate; last micro-batch:
                                                                   into the DP group's buckets
                                                                   (:class:`GradBuckets`), async
                                                                   all-reduce per full bucket
"zero2"    whole buffer and its shard  ``zero2_params``: after an   async reduce-scatter each
           (the Parameter, a copy)     optimizer step, all-gather   micro-batch, shards summed
                                       the shards (prefetched)
"zero3"    its shard only              ``zero3_all_gather``         free the re-gathered buffer,
                                       (prefetched by the previous  async reduce-scatter each
                                       layer); ``zero3_release``    micro-batch, shards summed
                                       frees it after the layer
=========  ==========================  ==========================  ============================

Collectives (FSDP2's copy-in / copy-out): a gather is *one* all-gather of the shard into a
``[dp, S]`` staging buffer, then a copy of each parameter's ``[dp, seg]`` columns into its place in
the full buffer (parameters back to back, padding at the end); a gradient is copied the other way
into a ``[dp, S]`` staging buffer and reduce-scattered once. NOTE: measured on 2 gloo ranks (gpt-tiny block, hidden 128 / 256), one
collective plus the copies is 2-5x faster than one collective per parameter (per-call latency
dominates); the price is the staging buffer, one whole-layer buffer, which the cost model counts
as transient bytes (:mod:`galvatron_fx.cost.model`).

Prefetch (FSDP2's order): the ZeRO-2 and ZeRO-3 layers of a stage are chained in forward order
(``prev_gather`` / ``next_gather``); a gather in forward starts the next layer's all-gather
asynchronously (ZeRO-3: its buffer; ZeRO-2: its re-gather after an optimizer step), a ZeRO-3
gather in backward (the re-gather, or a checkpointed layer's recomputation) the previous layer's,
so the collective runs beside the current layer's compute. At most two ZeRO-3 layers' buffers
are gathered at once, plus the prefetched one's staging buffer (priced as transient bytes).

The optimizer sees one Parameter per layer (``FlatParams.flat_param``: the whole buffer, or this
rank's shard), whose ``.grad`` :func:`finish_grad_sync` fills with the gradient of the global-batch
loss. After ``optimizer.step()``, the next forward re-gathers ZeRO-2 shards into the whole buffer
(layer by layer, prefetched; ``DistributedModel.sync_params`` does all at once). NOTE: ZeRO-2's shard is no longer a view of its replicated buffer (its rows are scattered
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

Size: one file, over 500 lines: ``FlatParams`` owns a layer's storages under DP, ZeRO-2 and ZeRO-3
(gather, release, reduce, the optimizer's views); the three kinds share its buffers and hooks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import pick_device
from .groups import Ranks, all_gather_single, group, reduce_scatter_single
from .zero_layout import buffer_parts, zero_layout

SDP_MODES = ("none", "zero2", "zero3")
DEFAULT_BUCKET_BYTES = 25 * 2**20


class FlatParams(nn.Module):
    """One layer's trainable parameters as one flat buffer (see the module docstring).

    ``fqns``, ``shapes`` and ``offsets`` (elements) locate each original parameter in the full
    buffer; ``layout`` (:class:`~.zero_layout.ZeroLayout`) also in each rank's shard. ``numel`` is the unpadded
    size, ``padded`` the full buffer's (every parameter padded along dim 0 to a multiple of ``dp``
    rows), ``shard_numel`` a shard's (``padded / dp``).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], mode: str, dp_ranks: Ranks, rank: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, trainable: bool = True, offload: bool = False):
        # NOTE: one function (84 lines): lays out the layer's storages (flat buffer, shards, gradients, views) in one pass
        super().__init__()
        if mode not in SDP_MODES:
            raise ValueError(f"sdp mode must be one of {SDP_MODES}, got {mode!r}")
        if offload and (mode == "none" or not trainable):
            raise ValueError("CPU offload needs trainable parameters under sdp 'zero2' or 'zero3' (the host "
                             "holds each rank's shard of the optimizer states)")
        if not trainable and mode == "zero2":
            raise ValueError("frozen parameters have no gradients or optimizer states to shard: use sdp "
                             "'none' (ZeRO-2 keeps parameters whole) or 'zero3'")
        self.mode, self.dp_ranks, self.bucket_bytes = mode, tuple(dp_ranks), int(bucket_bytes)
        self.trainable = bool(trainable)   # False: frozen parameters (no gradient, no reduction)
        self.layer: int | None = None      # stage-local layer index (set by the data-parallel pass)
        self.tp_ranks: Ranks = (rank,)     # the layer's TP group (set by the data-parallel pass)
        self.held_over: Ranks = ()         # a loop's experts: the EP group holding the others (same pass)
        self.replica_ranks: Ranks = (rank,)  # HSDP: the ranks holding this rank's shard (same pass)
        self.dp = len(self.dp_ranks)
        self.dp_index = self.dp_ranks.index(rank)
        self.fqns = list(tensors)
        self.shapes = [tuple(t.shape) for t in tensors.values()]
        self.layout = zero_layout(self.shapes, self.dp)   # the cost model predicts the same
        self.offsets = list(self.layout.offsets)
        self.numel = sum(t.numel() for t in tensors.values())
        self.padded, self.shard_numel = self.layout.padded, self.layout.shard
        # the layer reads parameter i as chunk part_index[i] of its buffer cut in part_sizes,
        # handed out in part_shapes (the parameter's shape; padding gaps 1-D)
        self.part_sizes, self.part_index = buffer_parts(self.layout)
        self.part_shapes = [(n,) for n in self.part_sizes]
        for i, j in enumerate(self.part_index):
            self.part_shapes[j] = self.shapes[i]
        self._zeros: dict = {}   # (chunk, dtype) -> a zero gradient for a chunk nothing read
        first = next(iter(tensors.values()), torch.empty(0))
        # mixed precision (runtime/precision.py): the Parameter is the fp32 master, the layer reads
        # a working copy in ``compute_dtype``; gradients are reduced in ``reduce_dtype``
        self.compute_dtype = compute_dtype if compute_dtype not in (None, first.dtype) else None
        self.reduce_dtype = reduce_dtype or first.dtype
        # NOTE: a model built on the meta device gets real, zeroed buffers on this process's device
        # and no values: runtime/materialize.py fills this rank's parts (init_weights, loads)
        self.initialized = first.device.type != "meta"
        device = first.device if self.initialized else pick_device()
        self.device = device   # where the layer computes (its buffers; with offload, not its masters)
        self.offload = bool(offload)
        full = torch.zeros(self.padded, dtype=first.dtype, device=device)
        if self.initialized:
            with torch.no_grad():
                for t, off in zip(tensors.values(), self.offsets):
                    full[off:off + t.numel()].copy_(t.reshape(-1))
        # NOTE: ``flat_param`` is storage, not an ``nn.Parameter``: the user's parameters are
        # per-parameter views of it under their original names (runtime/params.py), and the module
        # tree holds no Parameter of its own
        # CPU offload (dims/offload.py): the masters live on the host; the device keeps the shard the
        # all-gathers start from (``source``, in the compute dtype; ZeRO-2 on one rank copies the
        # masters into its buffer directly), refreshed from the host after an optimizer step
        self.source: torch.Tensor | None = None
        self._host_newer = False   # offload: the host masters changed since ``source`` was copied
        if self.offload:
            shard = self.layout.shard_of(full, self.dp_index)
            if mode == "zero3" or self.dp > 1:
                self.source = shard.to(self.compute_dtype or full.dtype, copy=True)
            self.flat_param = _host_copy(shard, wait=True).requires_grad_(True)   # written by loads next
            self.full = full.to(self.compute_dtype) if self.mixed else full
            if mode == "zero3":
                _free(self.full)
        elif mode == "none":
            self.flat_param = full.requires_grad_(self.trainable)
            self.full = full.detach().to(self.compute_dtype) if self.mixed else None
        elif mode == "zero2" and not self.mixed and self.dp == 1:
            self.full = full
            self.flat_param = full.requires_grad_(self.trainable)   # dp = 1: the shard is the whole buffer
        else:
            self.flat_param = self.layout.shard_of(full, self.dp_index).requires_grad_(self.trainable)
            self.full = full.to(self.compute_dtype) if self.mixed else full
            if mode == "zero3":
                _free(self.full)
        # zero3: set when a view of the buffer leaves the layer (tied weight): the buffer then
        # stays gathered from the layer's forward until its backward
        self.keep_gathered = False
        self.regather_in_backward = True  # zero3: False under checkpointing (recompute gathers)
        # zero3 under a split (zero-bubble) backward: micro-batches past their input-gradient pass
        # whose weight-gradient pass is to come; their saved views of the buffer must stay backed
        self.pins = 0
        # split backward: this micro-batch's per-parameter views of the layer's chunks are appended
        # here (one autograd node per parameter, so the weight-gradient pass can stop at each)
        self.split_views: list | None = None
        # prefetch (FSDP2's): the ZeRO-2/3 layers of this stage before / after this one in forward
        # order (DataParallelPass links them); a gather in forward starts the next one's, a
        # ZeRO-3 gather in backward the previous one's
        # NOTE: plain attributes (link_prefetch sets them with object.__setattr__), not submodules
        self.prev_gather: FlatParams | None = None
        self.next_gather: FlatParams | None = None
        self._prefetch: tuple | None = None   # (work, staging, shard) of an async all-gather
        self._acc: torch.Tensor | None = None     # DP: the whole-buffer gradient over micro-batches
        self._rs: tuple | None = None             # ZeRO: (work, staging, shard) of the reduce-scatter in flight
        self._rs_sum: torch.Tensor | None = None  # ZeRO: the shards of earlier micro-batches, summed
        self._pending: list = []
        self.stale = False   # the optimizer may have updated the masters since the working copy was made
        self.last_micro_batch = True
        self.grad_scale = 1.0   # 1 / dp for a layer whose every DP rank computes the whole batch
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

    def local_shape(self, i: int) -> tuple[int, ...]:
        """Shape of this rank's part of parameter ``i``: its (TP-local) shape under ``sdp="none"``,
        else its held dim-0 rows (a 0-D or 1-D parameter: its held elements, 1-D)."""
        shape = self.shapes[i]
        if self.mode == "none":
            return tuple(shape)
        a, b = self.layout.held_rows(i, self.dp_index)
        return (b - a, *shape[1:]) if len(shape) > 1 else (b - a,)

    def local_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of ``flat`` (``flat_param`` or its gradient) in :meth:`local_shape`."""
        lo, hi = self.shard_span(i)
        return flat[lo:hi].view(self.local_shape(i))

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, dp_ranks={self.dp_ranks}, params={len(self.fqns)}, "
                f"numel={self.numel}, padded={self.padded}{'' if self.trainable else ', frozen'}")

    # ------------------------------------------------------------------ buffer
    def working(self) -> torch.Tensor:
        """The whole buffer the layer computes with (``_LayerParams``): the masters (fp32 DP),
        the replicated buffer (ZeRO-2, re-gathered here after an optimizer step: prefetched by
        the previous layer or now), the low-precision copy (mixed DP) or, gathered now, ZeRO-3's."""
        if self.mode == "zero3":
            return self.gather_full()
        if self.stale:
            self.sync_after_step()
            self._prefetch_neighbour()
        return self.full if self.full is not None else self.flat_param.data

    def gather_full(self) -> torch.Tensor:
        """zero3: the whole buffer in ``self.full`` (allocating its storage): the prefetched
        all-gather if one is in flight, else one now (mixed: the shards are cast first, so the
        gather moves low-precision bytes). Then start the neighbour's gather: the next ZeRO-2/3
        layer's in forward, the previous one's in backward (checkpoint recomputation included)."""
        if self._prefetch is not None:
            self._finish_prefetch()
        elif self.full.untyped_storage().size() == 0:
            self._alloc_full()
            with torch.no_grad():
                self._gather_into(self.full.data)
        self._prefetch_neighbour()
        return self.full

    def _prefetch_neighbour(self) -> None:
        backward = torch._C._current_graph_task_id() != -1
        neighbour = self.prev_gather if backward else self.next_gather
        if neighbour is not None:
            neighbour.prefetch()

    def prefetch(self) -> None:
        """Start an asynchronous all-gather of the whole buffer: ZeRO-3's when it is not gathered,
        ZeRO-2's when the masters changed since (a no-op otherwise, or when one is in flight).
        Transient: the ``[dp, S]`` staging buffer (ZeRO-3: and the buffer) until it is used."""
        if self._prefetch is not None:
            return
        if self.mode == "zero3":
            if self.full.untyped_storage().size():
                return
            self._alloc_full()
        elif not (self.mode == "zero2" and self.stale):
            return
        with torch.no_grad():
            self._prefetch = self._start_gather(self.full.data)
        if self._prefetch is None:   # dp = 1: copied already
            self.stale = False

    def _finish_prefetch(self) -> None:
        pending, self._prefetch = self._prefetch, None
        with torch.no_grad():
            self._finish_gather(pending, self.full.data)
        self.stale = False

    def _drop_prefetch(self) -> None:
        """Complete and discard a prefetch in flight (every rank of the group still runs it)."""
        if self._prefetch is not None:
            work = self._prefetch[0]
            self._prefetch = None
            work.wait()

    def _alloc_full(self) -> None:
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())

    def _gather_into(self, full: torch.Tensor) -> None:
        """Fill ``full`` (a whole buffer) from every rank's masters: cast this rank's shard to
        ``full``'s dtype, all-gather into a ``[dp, S]`` staging buffer, copy out per parameter
        (collective over DP; ``dp = 1``: a copy, shard and buffer share the layout)."""
        pending = self._start_gather(full)
        if pending is not None:
            self._finish_gather(pending, full)

    def _start_gather(self, full: torch.Tensor) -> tuple | None:
        """Launch the all-gather filling ``full`` asynchronously: ``(work, staging, shard)`` (the
        cast shard kept alive until it completes); ``dp = 1``: copy now, ``None``."""
        shard = self._source(full.dtype)
        if self.dp == 1:
            full.copy_(shard)
            return None
        staging = full.new_empty(self.padded)
        work = all_gather_single(staging, shard.contiguous(), group=group(self.dp_ranks), async_op=True)
        return work, staging, shard

    def _source(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of the masters in ``dtype`` on the device, for an all-gather. Offload:
        the device copy in the compute dtype (copied from the host first when the masters changed),
        or the host masters themselves moved over (another dtype, or ZeRO-2 on one rank)."""
        if self.source is not None and dtype == self.source.dtype:
            if self._host_newer:
                with torch.no_grad():
                    self.source.copy_(self.flat_param.data, non_blocking=True)
                self._host_newer = False
            return self.source
        return self.flat_param.data.to(device=self.device, dtype=dtype, non_blocking=True)

    def _finish_gather(self, pending: tuple, full: torch.Tensor) -> None:
        work, staging, _shard = pending
        work.wait()
        self.layout.copy_out(staging, full)

    def free_full(self) -> None:
        """zero3: drop the gathered buffer (its storage shrinks to 0 bytes; a prefetch in flight
        is completed first, so every rank of the group runs the same collectives). Not while
        :attr:`pins` holds it (a weight-gradient pass to come reads its saved views)."""
        if self.mode == "zero3" and not self.pins:
            self._drop_prefetch()
            _free(self.full)

    def unsharded(self) -> dict[str, torch.Tensor]:
        """fqn -> a copy of this rank's whole parameter, from the masters (ZeRO gathers the
        shards unless ZeRO-2's fp32 buffer already holds them: collective over DP)."""
        if self.mode == "none":
            full = self.flat_param.data.clone()
        elif self.mode == "zero2" and not self.mixed:
            full = self.full.clone()
        else:
            full = torch.empty(self.padded, dtype=self.flat_param.dtype, device=self.device)
            self._gather_into(full)
        return {fqn: full[off:off + math.prod(shape)].view(shape)
                for fqn, off, shape in zip(self.fqns, self.offsets, self.shapes)}

    def masters_changed(self) -> None:
        """The masters (``flat_param``) were or may be overwritten in place (an optimizer step to
        come, a checkpoint load): drop ZeRO-3's gathered buffer and mark a working copy that is not
        the masters themselves stale (:meth:`sync_after_step` rebuilds it; collective over DP for
        ZeRO-2)."""
        self.free_full()
        self._drop_prefetch()   # ZeRO-2: a re-gather of the old masters
        self.stale = ((self.mode == "zero2" and (self.dp > 1 or self.mixed or self.offload))
                      or (self.mode == "none" and self.mixed))
        self._host_newer = self.offload

    # --------------------------------------------------------------- gradients
    def on_grad(self, grads: tuple) -> None:
        """Backward of the layer-entry call: ``grads`` are the gradients of one pass for each chunk
        of the buffer (``part_sizes``; ``None`` for a chunk nothing read, padding), in the working
        copy's dtype; accumulation over micro-batches is in the masters' dtype. DP concatenates the
        first pass's chunks straight into the accumulator (no whole-buffer gradient to copy); ZeRO-2
        and ZeRO-3 copy them into a reduce-scatter staging buffer every pass and accumulate shards,
        so no whole-buffer gradient outlives the pass (NOTE: accumulating whole-buffer gradients
        over micro-batches would hold ``P - S`` elements per layer the memory model does not)."""
        if self.grad_scale != 1.0:   # a layer computing the whole batch on every DP rank (passes/data_parallel.py)
            grads = tuple(None if g is None else g * self.grad_scale for g in grads)
        if self.mode in ("zero2", "zero3"):
            if self.mode == "zero3":
                self.free_full()   # the layer's backward is done with its parameters
            self._launch_reduce_scatter(grads)
            if self.last_micro_batch and len(self.replica_ranks) > 1:
                self._launch_replica_all_reduce()
            return
        if self._acc is None:
            self._acc = self._flat(grads).to(self.flat_param.dtype)   # fp32: the concatenation itself
        else:
            self._acc.add_(self._flat(grads))   # NOTE: one concatenation + one add beat a loop or _foreach_add_ on CPU
        if not self.last_micro_batch:
            return
        acc, self._acc = self._acc, None
        if self.dp == 1:
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

    def _flat(self, grads: tuple) -> torch.Tensor:
        """The whole-buffer gradient (a new tensor) from the chunks' (``None`` chunks: zeros)."""
        return torch._C._nn.flatten_dense_tensors([g if g is not None else self._zero(j, grads)
                                                   for j, g in enumerate(grads)])

    def _zero(self, j: int, grads: tuple) -> torch.Tensor:
        dtype = next((g.dtype for g in grads if g is not None), self.flat_param.dtype)
        key = (j, dtype)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros(self.part_shapes[j], dtype=dtype, device=self.device)
        return self._zeros[key]

    def _launch_reduce_scatter(self, grads: tuple) -> None:
        """Reduce-scatter one pass's whole-buffer gradient (given as its chunks, ``grads``)
        asynchronously into a shard; the previous pass's shard is folded into the running sum
        first (:meth:`_fold_reduce_scatter`), so one layer holds at most two shards and one
        staging buffer."""
        self._fold_reduce_scatter()
        if self.dp == 1:
            self._rs = (None, None, self._flat(grads))
            return
        # copy-in: each parameter's rows into its [dp, seg] columns of a [dp, S] staging buffer
        staging = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.device)
        params = [grads[j] for j in self.part_index]
        self.layout.copy_in_params([None if g is None else g.reshape(-1) for g in params], staging)
        out = staging.new_empty(self.shard_numel)
        work = reduce_scatter_single(out, staging, group=group(self.dp_ranks), async_op=True)
        self._rs = (work, staging, out)   # the staging buffer stays alive until the op completes

    def _launch_replica_all_reduce(self) -> None:
        """HSDP: once the step's last reduce-scatter lands, all-reduce the summed shard over the
        ranks holding the same shard (asynchronously; :meth:`finish_grad_sync` waits)."""
        self._fold_reduce_scatter()
        shard, self._rs_sum = self._rs_sum, None
        work = dist.all_reduce(shard, group=group(self.replica_ranks), async_op=True)
        self._pending += [(work, None), (None, shard)]

    def _fold_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter in flight (if any) and add its shard to the running sum (in
        the masters' dtype)."""
        if self._rs is None:
            return
        (work, _staging, out), self._rs = self._rs, None
        if work is not None:
            work.wait()
        out = out.to(self.flat_param.dtype)
        self._rs_sum = out if self._rs_sum is None else self._rs_sum.add_(out)

    def finish_grad_sync(self) -> None:
        """Wait for this layer's collectives and set ``flat_param.grad`` (sum of the results, in the
        masters' dtype). Frozen parameters: only ZeRO-3's gathered buffer is dropped."""
        if not self.trainable:
            self.free_full()
            return
        if self.buckets is not None:
            self.buckets.finish()   # the first store to finish hands every store of its buckets its part
        self._fold_reduce_scatter()
        if self._rs_sum is not None:
            self._pending.append((None, self._rs_sum))
            self._rs_sum = None
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
            # offload: the reduced shard moves to the host (pinned memory on CUDA: asynchronously;
            # DistributedModel.finish_grad_sync waits before the optimizer reads it)
            self.flat_param.grad = _host_copy(total.detach()) if self.offload else total.detach()
        # NOTE: whatever optimizer the user built may now update the masters; the working copy
        # (ZeRO-2's whole buffer, a mixed DP copy) is rebuilt before it is read next
        # (sync_after_step), so no hook on the user's optimizer is needed.
        self.masters_changed()

    def zero_grad_state(self) -> None:
        """Start of a step: no gradient, no pending op, no stale gathered buffer."""
        self._fold_reduce_scatter()   # an interrupted step's collective still completes on every rank
        self._pending, self._acc, self._rs_sum = [], None, None
        self.pins = 0
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
        if self._prefetch is not None:
            self._finish_prefetch()
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


def _host_copy(t: torch.Tensor, wait: bool = False) -> torch.Tensor:
    """A copy of ``t`` in host memory: pinned when ``t`` is on an accelerator, a clone on the CPU.
    Unless ``wait``, the copy runs asynchronously (:func:`wait_for_host_copies` before the host reads
    it): the masters copied at construction wait, as the host writes them (loads, init) next."""
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t, non_blocking=not wait)
    return out


def wait_for_host_copies(stores) -> None:
    """Wait until the gradient shards offloaded stores copied to the host have landed (the
    optimizer reads them next); a no-op without offload or on the CPU."""
    devices = {s.device for s in stores if s.offload and s.device.type != "cpu"}
    for device in devices:
        torch.get_device_module(device).current_stream(device).synchronize()


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


# ------------------------------------------------------------------------------ graph calls
class _LayerParams(torch.autograd.Function):
    """Entry of a layer: the whole buffer as its chunks (``store.part_sizes``), each parameter's
    already in its shape; backward hands the chunks' gradients to ``store`` (NOTE: not one buffer
    the graph splits and views: per micro-batch, the split's backward concatenated a whole-buffer
    gradient that was then copied, and every view added an autograd node)."""

    @staticmethod
    def forward(ctx, flat_param, store: FlatParams):
        ctx.store = store
        parts = store.working().data.split_with_sizes(store.part_sizes)
        return tuple(p.view(shape) for p, shape in zip(parts, store.part_shapes))

    @staticmethod
    def backward(ctx, *grads):
        ctx.store.on_grad(grads)
        return None, None


class _Release(torch.autograd.Function):
    """Exit of a ZeRO-3 layer: free the gathered buffer; re-gather it before the layer's backward.
    An output nothing differentiates (the logits beside the loss) gets no gradient: autograd would
    otherwise hand backward a tensor of zeros of its size (``[tokens, vocab]`` at the head)."""

    @staticmethod
    def forward(ctx, store: FlatParams, *outs):
        ctx.set_materialize_grads(False)
        ctx.store = store
        store.free_full()
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.store.regather_in_backward:
            ctx.store.gather_full()
        return (None, *grads)


def _entry(store: FlatParams) -> tuple[torch.Tensor, ...]:
    """The layer's chunks (:class:`_LayerParams`); under a split backward (``store.split_views``
    set) each parameter's chunk leaves through its own view, recorded for the weight-gradient pass."""
    parts = _LayerParams.apply(store.flat_param, store)
    if store.split_views is None or not store.trainable or torch._C._current_graph_task_id() != -1:
        return parts   # (not in a checkpointed layer's recomputation: its forward recorded them)
    parts = list(parts)
    for j in store.part_index:
        parts[j] = parts[j].view_as(parts[j])
    store.split_views.append({j: parts[j] for j in store.part_index})
    return tuple(parts)


def dp_params(store: FlatParams) -> tuple[torch.Tensor, ...]:
    """Data parallel: the buffer's chunks; backward all-reduces its gradient over DP."""
    return _entry(store)


def zero2_params(store: FlatParams) -> tuple[torch.Tensor, ...]:
    """ZeRO-2: the (replicated) buffer's chunks; backward reduce-scatters its gradient over DP."""
    return _entry(store)


def zero3_all_gather(store: FlatParams) -> tuple[torch.Tensor, ...]:
    """ZeRO-3: all-gather the buffer over DP, its chunks; backward reduce-scatters its gradient."""
    return _entry(store)


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


ENTRY = {"none": dp_params, "zero2": zero2_params, "zero3": zero3_all_gather}
