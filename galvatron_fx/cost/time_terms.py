"""The time terms of one layer under a strategy: FLOPs and compute time (analytic or profiled), TP
communication, fixed overheads, the runtime's copies and a layout change's gathers
(:class:`TimeTerms`, a part of :class:`~galvatron_fx.cost.model.CostModel`; the module docstring of
:mod:`galvatron_fx.cost.model` has the rules)."""

from __future__ import annotations

import math

from ..ir import TORCH_DTYPES
from ..solver.strategy import Strategy
from .measure import LayerMeasure
from .op_work import gemm_label
from .records import tp_group


def micro_pipelined(comm_s: float, matmul_s: float, tp: int) -> float:
    """Exposed seconds of a TP collective that torch's async TP fuses with its matmuls
    (``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``): the matmul
    runs in ``tp`` row chunks, each of the ``tp - 1`` remote chunks' transfers beside one chunk's
    matmul, so only a transfer longer than a chunk's matmul shows:
    ``(tp - 1) max(0, comm / (tp - 1) - matmul / tp)``."""
    return (tp - 1) * max(0.0, comm_s / (tp - 1) - matmul_s / tp) if tp > 1 else 0.0


class TimeTerms:
    """Compute, TP and overhead times of :class:`~galvatron_fx.cost.model.CostModel`."""

    def _fwd_flops(self, m: LayerMeasure, n: float, s: Strategy) -> tuple[float, float]:
        rep_div = s.tp if s.sp else 1
        fs, fr = m.fwd_flops_sharded(n), m.fwd_flops_rep(n)
        total = fs + fr
        fwd = fs / s.tp + fr / rep_div
        bwd = m.bwd_flops(n) * (fwd / total if total else 1.0)
        return fwd, bwd

    def tp_comm_time(self, m: LayerMeasure, n: float, s: Strategy, fwd_s: float = 0.0, bwd_s: float = 0.0) -> float:
        """Seconds per micro-batch of the layer's TP collectives, with the runtime's work at each site
        and the ranks' drift: each collective is a blocking sync after a stretch of the layer's
        compute (``fwd_s`` / ``bwd_s`` shared evenly by the pass's collectives), whose wait grows
        with the stretch (:meth:`Cluster.sync_wait`). With ``async_tp`` each SP site's collectives are
        pipelined against the matmuls of its region (:meth:`_tp_regions`, :func:`micro_pipelined`)."""
        if s.tp == 1:
            return 0.0
        group = tp_group(s)
        c = self.cluster
        site = c.op_launch_s + c.op_launch_bwd_s   # the site's autograd Function (forward + backward node)
        per_site = 2 if s.sp else 1   # collectives per site: all-gather and reduce-scatter under SP

        def drift(compute_s: float, sites: int) -> float:
            calls = sites * per_site
            return calls * c.sync_wait(compute_s / calls) if calls else 0.0

        regions = self._tp_regions(m, n, s) if self.async_tp and s.sp else None

        def one(i: int, elems: float) -> float:
            nbytes = elems * self.itemsize
            if s.sp:
                gather = c.collective_time("all_gather", nbytes, group)
                scatter = c.collective_time("reduce_scatter", nbytes, group)
                if regions is not None:
                    # torch's async TP: the all-gather into the site's region's column-parallel
                    # matmuls and the row-parallel matmul's reduce-scatter, pipelined against them
                    col, row, chunking = regions[i]
                    gather = micro_pipelined(gather, col, s.tp) + chunking
                    scatter = micro_pipelined(scatter, row, s.tp)
                # NOTE: runtime/tp_ops.py copies the chunk and the whole (movedim + contiguous on
                # each side of the all-gather and of the reduce-scatter)
                copies = 2 * (nbytes + nbytes / s.tp)
                return gather + scatter + copies * c.copy_s_per_byte + 2 * site
            # NOTE: the all-reduce runs on a copy of its input (the Function's output may not alias it)
            return c.collective_time("all_reduce", nbytes, group) + nbytes * c.copy_s_per_byte + site

        fwd = sum(one(i, f(n)) for i, f in enumerate(m.fwd_allreduce)) + drift(fwd_s, len(m.fwd_allreduce))
        bwd = sum(one(i, f(n)) for i, f in enumerate(m.bwd_allreduce)) + drift(bwd_s, len(m.bwd_allreduce))
        # NOTE: a sharded Float8 linear's casts each take their amax over the group (one fp32 value:
        # models/float8.py): two in forward, four in backward (two for a frozen weight: not told apart)
        fp8 = sum(1 for g in (gemm_label(k) for k, _ in m.fwd_gemms) if g.fp8 and g.split)
        amax = c.collective_time("all_reduce", 4, group) if fp8 else 0.0
        return (fwd + 2 * fp8 * amax) * (2 if s.ckpt else 1) + bwd + 4 * fp8 * amax

    def _tp_regions(self, m: LayerMeasure, n: float, s: Strategy) -> list[tuple[float, float, float]] | None:
        """Per TP site, its Megatron region's ``(column-parallel matmul seconds, row-parallel matmul
        seconds, extra seconds of running them in tp row chunks)``: the forward's matmuls in program
        order, a region's column-parallel ones (split ``n``) up to the row-parallel one (split ``k``)
        that closes it. None where the regions do not match the layer's sites one to one (an
        embedding's or a vocabulary-parallel loss's collectives feed or follow no matmul): those are
        priced blocking."""
        c, regions, col, extra = self.cluster, [], 0.0, 0.0
        for label, dims in m.fwd_gemms:
            fp8, _second, expert, split = gemm_label(label)
            if split not in ("n", "k") or expert:
                continue
            b, rows, cols, depth = (f(n) for f in dims)
            cols, depth = (cols / s.tp, depth) if split == "n" else (cols, depth / s.tp)
            dtype = "fp8" if fp8 else self.dtype
            t = c.gemm_time(b, rows, cols, depth, dtype)
            extra += s.tp * c.gemm_time(b, rows / s.tp, cols, depth, dtype) - t
            if split == "n":
                col += t
            else:
                regions.append((col, t, extra))
                col = extra = 0.0
        sites = len(m.fwd_allreduce)
        return regions if regions and len(regions) == sites == len(m.bwd_allreduce) else None

    def _compute_times(self, index: int, n: float, s: Strategy) -> tuple[float, float]:
        fwd, bwd = self._plain_compute_times(index, n, s)
        m = self.measure(index)
        if self.moe_imbalance > 1 and self.ep_of(index, s) > 1:
            # NOTE: the busiest EP rank sets the pace: its experts' share of the layer's work scaled
            total = m.fwd_flops_sharded(n) + m.fwd_flops_rep(n)
            k = 1 + (self.moe_imbalance - 1) * (m.fwd_flops_expert(n) / total if total else 0.0)
            fwd, bwd = fwd * k, bwd * k
        return fwd, bwd

    def _plain_compute_times(self, index: int, n: float, s: Strategy) -> tuple[float, float]:
        m = self.measure(index)
        if self.mode == "analytic":
            fwd, bwd = self._analytic_times(index, m, n, s)
            return fwd, bwd + self.recompute_time(index, n, s, fwd)
        # NOTE: checkpointing is priced as the analytic rule does (backward + a recomputed forward)
        # on the plain layer's profile: timed under torch.utils.checkpoint at the small profiling
        # sizes, the per-op saved-tensor hooks overstated the steps measured in training 1.3-2x
        prof = self.profile(index, s)
        fwd, bwd = prof["fwd"](n), prof["bwd"](n)
        return fwd, bwd + self.recompute_time(index, n, s, fwd)

    def recompute_time(self, index: int, n: float, s: Strategy, fwd: float) -> float:
        """Seconds the backward spends recomputing layer ``index``'s forward (``fwd`` seconds):
        all of it under full checkpointing; under selective checkpointing the share of the forward
        outside the ops it saves (matmuls, attention kernels: :mod:`.selective`), as the analytic
        rule splits the forward; none without checkpointing."""
        if not s.ckpt:
            return 0.0
        if s.ckpt is True:
            return fwd
        gemm, other, memory, attention, _, second = self._analytic_parts(index, self.measure(index), n, s)
        total = gemm + other + memory + attention
        again = other + memory + (second if s.ckpt == "selective-op" else 0.0)
        return fwd * again / total if total else 0.0

    def _analytic_times(self, index: int, m: LayerMeasure, n: float, s: Strategy) -> tuple[float, float]:
        """``(forward, backward)`` device seconds of layer ``index`` for ``n`` samples under ``s``
        from its measured work (module docstring, "FLOPs"): each forward matmul at its shape
        (:meth:`Cluster.gemm_time`, the dim TP splits divided), the backward's matmul FLOPs at the
        rate the forward's achieved (its matmuls are the forward's, transposed), the attention at the
        fused kernel's rate, the other ops' bytes at the memory rate (the backward's split between
        TP-sharded and replicated as the forward's)."""
        gemm, other, memory, attention, bwd, _ = self._analytic_parts(index, m, n, s)
        return gemm + other + memory + attention, bwd

    def _analytic_parts(self, index: int, m: LayerMeasure, n: float, s: Strategy) -> tuple[float, ...]:
        """:meth:`_analytic_times`'s forward in parts: ``(matmuls, FLOPs outside them, other ops'
        bytes, attention, backward, every second linear matmul (of the matmuls))`` seconds."""
        c, dtype = self.cluster, self.dtype
        rep_div = s.tp if s.sp else 1
        fwd_f, bwd_f = self._fwd_flops(m, n, s)
        gemm_s = gemm_f = second_s = 0.0
        ep = self.ep_of(index, s)
        for label, dims in m.fwd_gemms:
            b, rows, cols, depth = (f(n) for f in dims)
            # NOTE: an fp8 matmul at the fp8 rate (its backward's at the forward's)
            fp8, second, expert, split = gemm_label(label)
            if expert and ep > 1 and b > 1:   # under ep, 1/ep of the experts, ep x the rows each
                b, rows = b / ep, rows * ep
            if split:
                b, cols, depth = (b / s.tp if split == "b" else b, cols / s.tp if split == "n" else cols,
                                  depth / s.tp if split == "k" else depth)
            elif s.sp:
                rows /= s.tp
            t = c.gemm_time(b, rows, cols, depth, "fp8" if fp8 else dtype)
            gemm_s, second_s = gemm_s + t, second_s + (t if second else 0.0)
            gemm_f += 2 * b * rows * cols * depth
        rate = gemm_f / gemm_s if gemm_s else c.achievable_flops(dtype)
        # NOTE: FLOPs the matmul records miss (grouped expert matmuls) at the forward's rate too
        other = max(fwd_f - gemm_f, 0.0) / rate
        bwd = bwd_f / rate
        fused = "fused_" if self.fused_pointwise else ""   # torch.compile's kernels (.fusion)
        sharded, rep = getattr(m, fused + "fwd_traffic_sharded")(n), getattr(m, fused + "fwd_traffic_rep")(n)
        traffic = sharded / s.tp + rep / rep_div
        memory = c.memory_time(traffic)
        share = traffic / (sharded + rep) if sharded + rep else 1.0
        bwd += c.memory_time(getattr(m, fused + "bwd_traffic")(n) * share)
        att = self.attention(index)
        kw = dict(seq=att.kv_seq or None, head_dim=att.head_dim or None)
        # NOTE: the attention heads split over TP (and stay split under SP)
        attention = c.attention_time(m.attn_fwd_flops(n) / s.tp, dtype, **kw)
        bwd += c.attention_time(m.attn_bwd_flops(n) / s.tp, dtype, backward=True, **kw)
        return gemm_s, other, memory, attention, bwd, second_s

    def profile(self, index: int, s: Strategy) -> dict:
        """Profiled ``{"fwd": Affine, "bwd": Affine}`` seconds per sample count for layer ``index``
        under ``s``'s TP degree (without checkpointing: :meth:`_compute_times` adds the recompute)."""
        from .profile import PROFILE_SIZES, profile_layer

        sig = self.layers[index].signature
        key = (sig, s.tp, s.sp, False)
        if key not in self._profiles:
            m = self.measures[sig]
            fs, fr = m.fwd_flops_sharded(1), m.fwd_flops_rep(1)
            dtype = TORCH_DTYPES[self.dtype]
            self._profiles[key] = profile_layer(
                self.graphs[sig], tp=s.tp, sp=s.sp, ckpt=False, dtype=dtype,
                sharded_fraction=fs / (fs + fr) if fs + fr else 1.0,
                sizes=self.profile_sizes or PROFILE_SIZES, cache=self.cache_dir, repeats=self.profile_repeats)
        return self._profiles[key]

    def _overheads(self, index: int, elems_tp: int, s: Strategy, device_s: float = 0.0) -> tuple[float, float]:
        """``(overhead_s per micro-batch, optimizer_s per step)`` of layer ``index`` (module docstring).
        On a GPU priced analytically the host's launches and bookkeeping run ahead of the device,
        asynchronously: only what they take beyond the layer's ``device_s`` seconds is exposed."""
        c = self.cluster
        first = index == 0
        overhead = c.layer_overhead_s + (c.microbatch_overhead_s if first else 0.0)
        ops = self.op_counts[self.layers[index].signature]
        if self.mode == "analytic":
            overhead += ops * (c.op_launch_s * (2 if s.ckpt else 1) + c.op_launch_bwd_s)
        if s.ckpt:
            overhead += ops * getattr(c, "checkpoint_op_s", 0.0)
        if self.mode == "analytic" and self.attention_target != "cpu":
            overhead = max(0.0, overhead - device_s)
        held = elems_tp if s.sdp == "none" else math.ceil(elems_tp / s.shard)
        # NOTE: the user's optimizer steps one tensor per trainable parameter (runtime/params.py)
        tensors = sum(1 for f in self._owned_params(index) if f not in self._frozen)
        optimizer = (held * 4 * c.optimizer_s_per_byte + tensors * c.optimizer_overhead_s) if elems_tp else 0.0
        if first and self.cluster.world_size > 1:
            optimizer += c.collective_latency_s
        return overhead, optimizer

    def _gather_time(self, nbytes: float, have: Strategy, want: Strategy) -> float:
        """Seconds to give each rank of layout ``want`` its slice from layout ``have``."""
        sample_k = want.tp // have.tp if want.tp > have.tp else 1
        seq_k = have.tp if have.sp and (not want.sp or want.tp != have.tp) else 1
        if sample_k * seq_k == 1:
            return 0.0
        ranks = sorted({a + have.tp * k for a in range(seq_k) for k in range(sample_k)})
        need = nbytes / want.dp / (want.tp if want.sp else 1)
        return self.cluster.collective_time("all_gather", need, ranks)
