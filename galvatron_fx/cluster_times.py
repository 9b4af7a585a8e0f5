"""What work costs on a cluster: a matmul, memory traffic, attention, a collective over a group, a
point-to-point transfer, the ranks' drift at a sync, the overlap of communication with compute, and
the one-line summary (:class:`ClusterTimes`, a part of :class:`~galvatron_fx.cluster.Cluster`, whose
fields it reads)."""

from __future__ import annotations

import functools
import math
import numbers
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .errors import ConfigError
from .units import DTYPES, FP8, ITEMSIZE, format_bytes, matmul_dtype, normalize_dtype


def expected_max_normal(n: int) -> float:
    """The expected largest of ``n`` independent standard normal draws (0 for one draw), by
    numerical integration of ``x · n · Φ(x)^(n-1) · φ(x)``."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -8.0, 8.0 + math.sqrt(2 * math.log(n))
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        total += (0.5 if i in (0, steps) else 1.0) * x * n * cdf ** (n - 1) * pdf
    return total * h


@functools.cache
def _slowest_device_speed(spread: float, n: int) -> float:
    """:meth:`ClusterTimes.straggler_factor` of ``n`` devices whose speeds spread by ``spread``
    over 8 (cached: the integrals run once per cluster shape, not per priced kernel)."""
    if not spread or n <= 1:
        return 1.0
    sigma = spread / (2 * expected_max_normal(8))
    return 1.0 - expected_max_normal(n) * sigma


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
P2P = "p2p"
"""The link kinds priced here, measured by :mod:`galvatron_fx.cluster_profile` (which sits above the
cluster model and imports them)."""

class ClusterTimes:
    """The time model of :class:`~galvatron_fx.cluster.Cluster` (the ring / tree formulas of its
    module docstring)."""

    def achievable_flops(self, dtype: Any = "fp32") -> float:
        """Sustained FLOP/s of the cluster's slowest device in ``dtype`` (peak × efficiency ×
        :meth:`straggler_factor`)."""
        return self.peak_flops[normalize_dtype(dtype)] * self.efficiency * self.straggler_factor()

    def straggler_factor(self) -> float:
        """The speed of the slowest of the cluster's devices over one device's (1 when
        ``device_speed_spread`` is 0 or there is one device): a synchronous step waits for its
        slowest device. The devices' speeds are taken as normal, their spread over 8 devices
        (``device_speed_spread``) as 8 draws' expected range (2 × 1.4236 σ), and the slowest of
        ``N`` as ``mean - E[max of N] σ``: 0.975 of one device's speed for 8 devices, 0.955 for 128
        and 0.943 for 1024 at the presets' 0.05 (:data:`galvatron_fx.devices.NODE_SPEED_SPREAD`)."""
        return _slowest_device_speed(getattr(self, "device_speed_spread", 0.0), self.world_size)

    def compute_time(self, flops: float, dtype: Any = "fp32") -> float:
        """Seconds one device needs for ``flops`` floating-point operations in ``dtype``."""
        return float(flops) / self.achievable_flops(dtype)

    def gemm_time(self, batch: float, m: float, n: float, k: float, dtype: Any = "fp32") -> float:
        """Seconds for ``batch`` matmuls of ``m x k`` by ``k x n`` in ``dtype``: the FLOPs of the
        tiles they occupy (``m`` and ``n`` rounded up to ``gemm_tile``) in whole waves of
        ``gemm_wave`` tiles (a last, partial wave takes a whole one's time) at the compute rate, or,
        for a GEMM too thin for that, its operands' and result's bytes at the memory rate (roofline).
        ``"fp8"``: fp8 operands (``torch._scaled_mm``) at ``peak_flops["fp8"]`` times
        ``fp8_efficiency``, a 16-bit result."""
        dtype = matmul_dtype(dtype)
        if dtype == FP8:
            rate = self.fp8_matmul_flops()
            nbytes = batch * (m * k + k * n + 2 * m * n)
        else:
            rate = self.achievable_flops(dtype)
            nbytes = batch * (m * k + k * n + m * n) * ITEMSIZE[dtype]
        t, wave = self.gemm_tile, self.gemm_wave
        rows, cols = math.ceil(m / t), math.ceil(n / t)   # tiles along m and n
        tiles = batch * rows * cols
        waves = math.ceil(tiles / wave) * wave / tiles if wave and tiles else 1.0
        if t > 1:
            m, n = rows * t, cols * t
        return max(2.0 * batch * m * n * k * waves / rate, self.memory_time(nbytes))

    def fp8_matmul_flops(self) -> float:
        """Sustained FLOP/s of one device's fp8 matmuls; a :class:`ConfigError` where the cluster
        prices none (no fp8 tensor cores: A100, V100, the CPU)."""
        if FP8 not in self.peak_flops:
            raise ConfigError(f"cluster {self.name!r} has no fp8 matmul rate, but the model runs fp8 matmuls "
                              "(torch._scaled_mm): plan it for a device with fp8 tensor cores (an H100 / H200 "
                              "preset) or give the cluster peak_flops['fp8']")
        return self.peak_flops[FP8] * (self.fp8_efficiency or self.efficiency) * self.straggler_factor()

    def memory_time(self, nbytes: float) -> float:
        """Seconds for an op that reads and writes ``nbytes`` in all (element-wise, reductions,
        copies): at the rate of the runtime's copies, which write each byte they read
        (``copy_s_per_byte`` per byte written; 0 when that is not priced)."""
        return nbytes * self.copy_s_per_byte / 2

    def attention_time(self, flops: float, dtype: Any = "fp32", backward: bool = False,
                       seq: float | None = None, head_dim: float | None = None) -> float:
        """Seconds one device's fused attention kernel (flash / memory-efficient SDPA) needs for
        ``flops`` FLOPs in ``dtype``, counted as the kernel runs them (a causal kernel skips the
        blocks above the diagonal); ``backward``: the backward kernel (the same rate: the benchmarks
        behind it time forward + backward). At ``attention_efficiency`` of the peak (else
        ``efficiency``) on the slowest device (:meth:`straggler_factor`), times
        ``seq / (seq + attention_half_rate_seq)`` for ``seq`` keys and
        ``(d / (d + 16)) / (128 / 144)`` for head dim ``d`` where the cluster has that curve
        (:mod:`galvatron_fx.devices`)."""
        rate = (self.peak_flops[normalize_dtype(dtype)] * (self.attention_efficiency or self.efficiency)
                * self.straggler_factor())
        half = self.attention_half_rate_seq
        if half and seq:
            rate *= seq / (seq + half)
        if half and head_dim:
            rate *= (head_dim / (head_dim + 16)) / (128 / 144)
        return float(flops) / rate

    def _group(self, ranks: Sequence[int] | int) -> list[int]:
        if isinstance(ranks, numbers.Integral):
            return self._group(range(int(ranks)))
        group = sorted({int(r) for r in ranks})
        bad = [r for r in group if not 0 <= r < self.world_size]
        if bad:
            raise ConfigError(f"ranks {bad} lie outside this cluster of {self.world_size} devices")
        return group

    def group_link(self, ranks: Sequence[int] | int) -> tuple[float, float]:
        """``(bandwidth bytes/s, latency s)`` of the link that bounds a ring over ``ranks``."""
        per_node = Counter(self.node_of(r) for r in self._group(ranks))
        if len(per_node) <= 1:
            return self.intra_bandwidth, self.intra_latency
        k = max(per_node.values())
        return min(self.intra_bandwidth, self.inter_bandwidth * k), self.inter_latency

    def _measured_link(self, kind: str, group: list[int]) -> tuple[float, float] | None:
        fig = self.fits.get(kind, {}).get(str(len(group)))
        if fig is None:
            return None
        # A fit applies to groups laid out like the measured one: consecutive ranks from 0, i.e. the
        # same number of nodes with the same number of ranks on the busiest one.
        if sorted(Counter(map(self.node_of, group)).values()) != sorted(
            Counter(map(self.node_of, range(len(group)))).values()
        ):
            return None
        return fig["bandwidth"], fig["latency"]

    def collective_time(self, kind: str, nbytes: float, ranks: Sequence[int] | int, calls: float = 1.0) -> float:
        """Seconds for collective ``kind`` of ``nbytes`` bytes over the global ``ranks``.

        ``kind`` is one of ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``.
        ``nbytes`` is the full size: the all-reduced buffer, the all-gather **output**, the
        reduce-scatter **input**, or each rank's all-to-all send buffer. ``ranks`` is a sequence of
        global ranks (an int ``n`` means ``range(n)``). A group of one rank, or 0 bytes, costs 0.
        ``calls`` is how many calls the message takes (``collective_latency_s`` each): 1, or a
        fraction when the runtime packs it into a bucket shared with other messages.
        """
        if kind not in COLLECTIVES:
            raise ConfigError(f"unknown collective {kind!r}; use one of {', '.join(COLLECTIVES)}")
        key = (kind, ranks if isinstance(ranks, numbers.Integral) else tuple(ranks))
        links = self.__dict__.setdefault("_links", {})  # NOTE: the search asks for the same groups often
        if key not in links:
            group = self._group(ranks)
            links[key] = (len(group), *(self._measured_link(kind, group) or self.group_link(group)))
        n, bandwidth, latency = links[key]
        if n <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        return steps / n * nbytes / bandwidth + steps * latency + calls * self.collective_latency_s

    def sync_wait(self, stretch_s: float) -> float:
        """Seconds a blocking collective waits for the other ranks after ``stretch_s`` seconds of
        compute since the last sync, beyond what ``collective_latency_s`` holds (the wait after the
        profile's own stretch ``sync_stretch_s``): ``c * (sqrt(S) - sqrt(S0))``, at least 0."""
        c = self.sync_drift_sqrt_s
        if c <= 0 or stretch_s <= self.sync_stretch_s:
            return 0.0
        return c * (math.sqrt(stretch_s) - math.sqrt(self.sync_stretch_s))

    def door_time(self, tensors: int) -> float:
        """Seconds per step the torch.compile door adds for a model of ``tensors`` trainable
        parameter tensors (dynamo's frame, the backend's call, routing each gradient in
        ``loss.backward()``, the user's ``zero_grad``): ``door_call_s + tensors * door_param_s``."""
        return self.door_call_s + tensors * self.door_param_s

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` bytes from global rank ``src`` to ``dst`` (0 when equal)."""
        group = self._group([src, dst])
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        bandwidth, latency = self._measured_link(P2P, group) or self.group_link(group)
        return nbytes / bandwidth + latency + self.collective_latency_s

    def overlap_time(self, compute_s: float, comm_s: float) -> float:
        """Seconds for ``compute_s`` of compute overlapped with ``comm_s`` of communication.

        While both run, both are slowed by ``overlap_slowdown``: the overlapped stretch takes
        ``overlap_slowdown × min(compute_s, comm_s)``, the rest of the longer one runs alone. Never
        more than ``compute_s + comm_s`` (running them one after the other).

        NOTE: the cap matters where compute and communication share CPU cores (gloo on a busy
        host measures slowdowns above 2, which would make overlapping worse than not overlapping).
        """
        short, long = sorted((float(compute_s), float(comm_s)))
        return min(long + (self.overlap_slowdown - 1.0) * short, long + short)

    def summary(self) -> str:
        """One line per figure, human-readable."""
        flops = ", ".join(f"{d} {self.peak_flops[d] / 1e12:.3g}" for d in DTYPES)
        return "\n".join([
            f"cluster {self.name}: {self.nodes} node(s) x {self.devices_per_node} device(s), "
            f"{format_bytes(self.memory_bytes)} each",
            f"  peak TFLOP/s: {flops}; efficiency {self.efficiency:.2f}"
            + (f", matmul tiles {self.gemm_tile} in waves of {self.gemm_wave}" if self.gemm_wave else "")
            + (f"; the slowest device at {self.straggler_factor():.3f} of one device's speed"
               if self.device_speed_spread else ""),
            f"  intra-node {self.intra_bandwidth / 1e9:.3g} GB/s, {self.intra_latency * 1e6:.3g} us; "
            f"inter-node {self.inter_bandwidth / 1e9:.3g} GB/s/device, {self.inter_latency * 1e6:.3g} us",
            f"  overlap slowdown {self.overlap_slowdown:.2f}",
            f"  overheads: op {self.op_launch_s * 1e6:.3g} + {self.op_launch_bwd_s * 1e6:.3g} us (fwd + bwd), "
            f"collective {self.collective_latency_s * 1e6:.3g} us, layer {self.layer_overhead_s * 1e6:.3g} us, "
            f"micro-batch {self.microbatch_overhead_s * 1e6:.3g} us, optimizer "
            f"{self.optimizer_s_per_byte * 1e12:.3g} ps/byte + {self.optimizer_overhead_s * 1e6:.3g} us/tensor, "
            f"checkpointing {self.checkpoint_op_s * 1e6:.3g} us/op, copies {self.copy_s_per_byte * 1e12:.3g} ps/byte, "
            f"split backward {self.split_backward_op_s * 1e6:.3g} us/op, drift "
            f"{self.sync_drift_sqrt_s * 1e3:.3g} ms/sqrt(s) beyond {self.sync_stretch_s * 1e3:.3g} ms, "
            f"p2p wake-up {self.p2p_wakeup_s * 1e3:.3g} ms",
        ] + ([f"  torch.compile door: {self.door_call_s * 1e3:.3g} ms per step + {self.door_param_s * 1e6:.3g} us "
              "per parameter tensor"] if self.door_call_s or self.door_param_s else [])
           + ([f"  calibrated by measured steps: stage time x {self.time_scale:.3g} (pipelined x "
              f"{self.pipeline_time_scale:.3g} more), + {self.step_overhead_s * 1e3:.3g} ms per step "
              f"(pipelined + {self.pipeline_step_s * 1e3:.3g} ms)"] if self.is_calibrated else []))
