"""The GPU presets' device curves: datasheet peaks and the rates public measurements sustain.

One :class:`DeviceSpec` per device type, used by every plan on that device (never a factor chosen
per model or per measured row). Each figure carries its source in a comment. Units: FLOP/s,
bytes/s, seconds.

* **Peaks**: the vendor's dense (no sparsity) FLOP/s per dtype and HBM bandwidth.
* **Matmuls** (:meth:`galvatron_fx.cluster.Cluster.gemm_time`): ``mamf``, the maximum achievable
  matmul FLOP/s as a fraction of the bf16 peak, measured over shapes by ``mamf-finder.py``
  (stas00/ml-engineering, ``compute/accelerator/README.md``); a GEMM's rows and columns are rounded
  up to the ``gemm_tile`` cuBLAS computes them in (tile quantisation), its tiles run in waves of
  one per streaming multiprocessor (``sms``: a last, partial wave takes a whole wave's time: wave
  quantisation), and a GEMM too thin to be compute-bound is priced at the memory rate (roofline).
  Devices with fp8 tensor cores also carry their dense fp8 peak and ``mamf_fp8``, the same
  benchmark's fp8 (``float8_e4m3fn``) figure: the rate of a model's ``torch._scaled_mm`` matmuls
  (Float8 training, :mod:`galvatron_fx.models.float8`).
* **Memory traffic** (element-wise ops, reductions, copies: :meth:`Cluster.memory_time`):
  :data:`HBM_EFFICIENCY` of the datasheet bandwidth.
* **Fused attention** (:meth:`Cluster.attention_time`): ``attention`` is the long-sequence rate of
  the SDPA kernel torch dispatches to (FlashAttention-2 on sm80+), as a fraction of the bf16 peak,
  for head dim 128, causal, forward + backward; shorter sequences run at ``s / (s + 512)`` of it and
  other head dims at ``(d / (d + 16)) / (128 / 144)`` (module docstring of :mod:`.cluster`). A run
  whose model calls another attention kernel (:data:`ATTENTION_KERNELS`: FlashAttention-1, the
  Triton FlashAttention kernel that MPT-style models ship) is priced at that kernel's rate, read
  from the same benchmark plots (``Cluster.preset(name, attention_kernel=...)``).
* **The host** (CPU offload, :mod:`galvatron_fx.dims.offload`): ``host_memory`` per node,
  ``host_link`` bytes/s per direction between one device and the host (its PCIe generation's x16
  rate as measured by copies of pinned memory), ``host_memory_rate`` the node's DRAM bandwidth
  (channels x transfer rate of its CPUs), of which :data:`HOST_STREAM_EFFICIENCY` is sustained.
* **The slowest device** (:meth:`Cluster.straggler_factor`): devices of one type do not run at
  one speed (:data:`NODE_SPEED_SPREAD`), and a synchronous step waits for its slowest: the
  compute-bound rates (matmuls, fused attention) are those of the slowest of the cluster's devices.
* **Collectives** (:meth:`Cluster.collective_time`): ``intra_bandwidth`` is NCCL's bus bandwidth
  inside a node (nccl-tests ``busbw``, which the ring formulas of :mod:`.cluster` reproduce) and
  ``nic_bandwidth`` the bus bandwidth one inter-node NIC sustains.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .units import parse_bytes

_T = 1e12
_GB = 1e9

HBM_EFFICIENCY = 0.88
"""Achieved fraction of the datasheet memory bandwidth: an A100-80GB read kernel reaches 1.80 of
2.04 TB/s (88 %, confirmed by Nsight Compute), and ~90 % was the best any kernel reached in an
NVIDIA GTC talk (forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083)."""

ATTENTION_HALF_RATE_SEQ = 512
"""Sequence length at which the fused attention kernel runs at half its long-sequence rate: the
FlashAttention-2 forward + backward benchmarks (Dao-AILab/flash-attention, ``assets/flash2_a100_
fwd_bwd_benchmark.png`` and ``flash2_h100_...``, causal, head dim 128) rise as ``s / (s + 512)``
on both devices: A100 99 / 133 / 155 / 173 / 182 / 189 TFLOP/s and H100 163 / 221 / 265 / 294 /
308 / 328 at 0.5k .. 16k tokens (the curve gives 0.51 / 0.67 / 0.80 / 0.89 / 0.94 / 0.97 of its
limit; the plots 0.52 / 0.70 / 0.82 / 0.92 / 0.96 / 1 of their 16k value)."""

NODE_SPEED_SPREAD = 0.05
"""The spread (fastest - slowest) / mean of the sustained matmul speed over the 8 devices of one
node: "I have seen 5% and higher differences on an 8-gpu node" and "on the same 8-GPU node you can
see 5%+ MAMF spread between GPUs even when all of them pass the same factory binning" (silicon
lottery, uneven cooling: stas00/ml-engineering ``compute/accelerator/README.md``, "Not all
accelerators are created equal"). The MAMF figures are one device's; a synchronous step runs at its
slowest device's pace. NOTE: the speeds are taken as normally distributed (an assumption: the
source gives the spread, not the distribution); :meth:`Cluster.straggler_factor` has the curve."""

HOST_STREAM_EFFICIENCY = 0.7
"""Sustained fraction of a server's theoretical DRAM bandwidth for a streaming kernel (STREAM
triad on two-socket Xeon / EPYC servers reaches ~70-80 %): the host optimizer step streams at it.
NOTE: an assumption, not a measurement of torch.optim on these hosts; ``Cluster.profile`` measures
the local host's optimizer step."""

GEMM_TILE = 128
"""Rows and columns of a GEMM tile (cuBLAS's common 128 x 128 / 256 x 128 tiles for fp16 / bf16
on A100 and H100; NVIDIA's "Matrix Multiplication Background" guide, tile quantisation). The same
guide's wave quantisation: the tiles run in waves of one per SM (``DeviceSpec.sms``), so 109 tiles
on an A100's 108 SMs take two waves. With 128 x 128 tiles this follows NVIDIA's published A100
curve of cuBLAS fp16 / bf16 matmuls over m = n = k (the CUDA 11 features blog, Figure 6) from 2048
up, where a flat rate misses by up to a third (``tests/test_cluster.py``); the smaller tiles and
the split-K kernels cuBLAS picks for other shapes are not modelled (an assumption: the smallest
tile is the mildest penalty)."""


ATTENTION_KERNELS = ("sdpa", "flash-attn-2", "flash-attn-1", "flash-attn-triton")
"""Attention kernels a preset prices: ``sdpa`` (what ``F.scaled_dot_product_attention`` dispatches
to: FlashAttention-2 from sm80, the memory-efficient kernel on sm70; the default),
``flash-attn-2`` / ``flash-attn-1`` (the ``flash_attn`` 2.x / 1.x package; 2.x is SDPA's flash
kernel, from sm80) and ``flash-attn-triton`` (the Triton FlashAttention kernel of
``flash_attn_triton.py``, which MPT / llm-foundry models call with ``attn_impl: triton``)."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device type (module docstring). ``intra_bandwidth`` / ``nic_bandwidth``: NCCL bus
    bandwidth per direction; ``devices_per_nic``: devices sharing one NIC (None: one for the node);
    ``attention``: the SDPA kernel family (``"cuda"``: flash from sm80, ``"cuda-sm70"``:
    memory-efficient only); ``other_attention``: ``(kernel, long-sequence rate)`` of the
    :data:`ATTENTION_KERNELS` besides ``sdpa`` with a published figure on this device."""

    display: str          # canonical spelling in preset names
    memory: str           # device memory, parse_bytes syntax
    fp32: float           # peak FLOP/s per dtype
    bf16: float
    fp16: float
    hbm: float            # datasheet memory bandwidth, bytes/s
    mamf: float           # achievable matmul FLOP/s / bf16 (fp16) peak
    attention_rate: float  # fused attention's long-sequence FLOP/s / bf16 (fp16) peak
    intra_bandwidth: float
    intra_latency: float
    nic_bandwidth: float
    devices_per_nic: int | None
    inter_latency: float
    attention: str = "cuda"
    host_memory: str = "0"         # host memory per node (parse_bytes syntax)
    host_link: float = 0.0         # device <-> host bytes/s per direction, per device
    host_memory_rate: float = 0.0  # the node's DRAM bandwidth, bytes/s (datasheet)
    other_attention: tuple[tuple[str, float], ...] = ()
    fp8: float = 0.0               # dense fp8 tensor-core peak FLOP/s (0: no fp8 tensor cores)
    mamf_fp8: float = 0.0          # achievable fp8 matmul FLOP/s / the fp8 peak
    sms: int = 0                   # streaming multiprocessors: GEMM tiles per wave (datasheet)

    def attention_rate_of(self, kernel: str) -> float:
        """The long-sequence rate (fraction of the 16-bit peak) of attention ``kernel`` on this
        device; a :class:`ConfigError` where no public figure prices it."""
        rates = {"sdpa": self.attention_rate, **dict(self.other_attention)}
        if self.attention == "cuda":
            rates["flash-attn-2"] = self.attention_rate
        if kernel not in rates:
            known = ", ".join(k for k in ATTENTION_KERNELS if k in rates)
            raise ConfigError(f"no published rate prices attention kernel {kernel!r} on {self.display}; "
                              f"use one of: {known}")
        return rates[kernel]

    def inter_share(self, per_node: int) -> float:
        """Inter-node bytes/s per device when all ``per_node`` devices send across nodes at once."""
        sharing = per_node if self.devices_per_nic is None else min(self.devices_per_nic, per_node)
        return self.nic_bandwidth / sharing


# NOTE: the NCCL bus bandwidths are NVIDIA's (GTC24 session S62129, "Collective Communication
# Bandwidth", nccl-tests all-reduce busbw): NVLink2 (V100) 122 GB/s, NVLink3 (A100) 232, NVLink4
# (H100) 370 (480 with NVLink SHARP, which only all-reduce uses), a 200 Gb/s RDMA NIC 24, a 400 Gb/s
# one 48; DGX A100 across nodes 192 = 8 x 24 (NVIDIA/nccl#812: "8x200Gbit/s IB cards ... 192GB/s
# AllReduce BusBW"); NDR "46-48GB/s per NIC" (NVIDIA/nccl-tests#290); PCIe Gen4 24, so Gen3 12.
# MAMF (stas00/ml-engineering compute/accelerator/README.md): A100 SXM 271.2 of 312 TFLOP/s
# (86.9 %, 1024x10240x5120), H100 SXM 794.5 of 989 (80.3 %, 2048x2048x13312; "H200 is the same").
# SMs (GEMM_TILE's waves): A100 108, H100 SXM5 and H100 NVL 132 (NVIDIA A100 / H100 whitepapers
# and datasheets), H200 132 (the H100's GH100), V100 SXM2 80, TITAN RTX 72 (a full TU102).
# fp8 MAMF, same table (float8_e4m3fn): H100 SXM 1402.6 of 1979 (70.9 %, 1024x9216x14336), H200 SXM
# 1453.4 of 1979 (73.4 %, 1280x4096x12032).
# FlashAttention-2 causal hd128 forward + backward at 16k tokens: A100 189, H100 328 TFLOP/s
# (the plots of ATTENTION_HALF_RATE_SEQ): limits 189 / 0.97 = 195 (0.625 of 312) and 328 / 0.97 =
# 338 (0.342 of 989). V100 and TITAN RTX have no public MAMF or attention figure: the A100's
# fractions are assumed (their memory-efficient kernel is, if anything, slower).
# The other attention kernels, from the same plots (causal, head dim 128, forward + backward, 512 ..
# 16k tokens): FlashAttention-1 on A100 55 / 62 / 69 / 76 / 80 / 83 TFLOP/s, limit 83 / 0.97 = 86
# (0.274 of 312), on H100 98 / 109 / 108 / 126 / 135 / 137, limit 141 (0.143 of 989); the Triton
# FlashAttention kernel on A100 50 / 61 / 68 / 74 / 78 / 80, limit 82 (0.264 of 312). The H100 plot
# has no Triton bar: priced at FlashAttention-1's rate there, as the two run within 4 % of each
# other on the A100 (an assumption).
_A100_OTHER_ATTENTION = (("flash-attn-1", 0.274), ("flash-attn-triton", 0.264))
_H100_OTHER_ATTENTION = (("flash-attn-1", 0.143), ("flash-attn-triton", 0.143))
# The hosts (CPU offload): DGX A100 (2x AMD EPYC 7742, 8 channels DDR4-3200 each: 2 x 204.8 GB/s;
# 1 TB with the 40GB GPUs, 2 TB with the 80GB ones), DGX H100 / H200 (2x Xeon Platinum 8480C, 8
# channels DDR5-4800 each: 2 x 307.2 GB/s; 2 TB), DGX-1 (2x Xeon E5-2698 v4, 4 channels DDR4-2400
# each: 2 x 76.8 GB/s; 512 GB) from the DGX datasheets. Device <-> host: PCIe Gen3 / Gen4 / Gen5
# x16 move 12 / 24 / 48 GB/s of pinned memory per direction (the same links as the NIC figures
# above). The Grand Teton H100 host is taken as the DGX H100's and the Galvatron testbed's
# (RTX TITAN, unpublished) as a DGX-1's: assumptions. Shared PCIe switch uplinks are not modelled.
DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA A100 datasheet (SXM4): FP32 19.5, BF16/FP16 Tensor Core 312 TFLOPS dense; HBM2e
    # 2039 GB/s (80GB) / 1555 GB/s (40GB); DGX A100: 8x HDR 200 Gb/s, one per GPU.
    "a100-40gb": DeviceSpec("A100-40GB", "40GiB", 19.5 * _T, 312 * _T, 312 * _T, 1555 * _GB, 0.869, 0.625,
                            232 * _GB, 5e-6, 24 * _GB, 1, 1e-5,
                            host_memory="1TB", host_link=24 * _GB, host_memory_rate=2 * 204.8 * _GB,
                            other_attention=_A100_OTHER_ATTENTION, sms=108),
    "a100-80gb": DeviceSpec("A100-80GB", "80GiB", 19.5 * _T, 312 * _T, 312 * _T, 2039 * _GB, 0.869, 0.625,
                            232 * _GB, 5e-6, 24 * _GB, 1, 1e-5,
                            host_memory="2TB", host_link=24 * _GB, host_memory_rate=2 * 204.8 * _GB,
                            other_attention=_A100_OTHER_ATTENTION, sms=108),
    # NVIDIA H100 datasheet (SXM5): FP32 67, BF16/FP16 989 TFLOPS dense; HBM3 3350 GB/s;
    # DGX H100: 8x NDR 400 Gb/s.
    "h100-80gb": DeviceSpec("H100-80GB", "80GiB", 67 * _T, 989 * _T, 989 * _T, 3350 * _GB, 0.803, 0.342,
                            370 * _GB, 5e-6, 48 * _GB, 1, 1e-5,
                            host_memory="2TB", host_link=48 * _GB, host_memory_rate=2 * 307.2 * _GB,
                            other_attention=_H100_OTHER_ATTENTION, fp8=1979 * _T, mamf_fp8=0.709, sms=132),
    # The H100 of Meta's Grand Teton hosts that torchtitan's H100 benchmarks ran on
    # (benchmarks/llama3_h100_202412_torchtitan.md): "96GB HBM2e with 2.4 TB/sec peak memory
    # bandwidth", the "default 500W power limit", NVLink inside the host, "400 Gb/s per GPU" RDMA;
    # "the actual peak TFLOPs number is between SXM and NVL": the H100 NVL datasheet's 835 TFLOPS
    # BF16 dense (FP32 60; FP8 3341 with sparsity: 1671 dense), the lower bound the source names.
    # The H100 SXM's fractions.
    "h100-96gb": DeviceSpec("H100-96GB", "96GB", 60 * _T, 835 * _T, 835 * _T, 2400 * _GB, 0.803, 0.342,
                            370 * _GB, 5e-6, 48 * _GB, 1, 1e-5,
                            host_memory="2TB", host_link=48 * _GB, host_memory_rate=2 * 307.2 * _GB,
                            other_attention=_H100_OTHER_ATTENTION, fp8=1671 * _T, mamf_fp8=0.709, sms=132),
    # NVIDIA H200 (SXM): the H100's compute, 141 GB HBM3e at 4.8 TB/s (nvidia-smi reports
    # 143771 MiB); DGX H200: 8x NDR 400 Gb/s.
    "h200-141gb": DeviceSpec("H200-141GB", "143771MiB", 67 * _T, 989 * _T, 989 * _T, 4800 * _GB, 0.803, 0.342,
                             370 * _GB, 5e-6, 48 * _GB, 1, 1e-5,
                             host_memory="2TB", host_link=48 * _GB, host_memory_rate=2 * 307.2 * _GB,
                             other_attention=_H100_OTHER_ATTENTION, fp8=1979 * _T, mamf_fp8=0.734, sms=132),
    # NVIDIA V100 (SXM2): FP32 15.7, FP16 Tensor Core 125 TFLOPS; no BF16 hardware (BF16 at the FP32
    # rate); HBM2 900 GB/s; DGX-1: 4x EDR 100 Gb/s for 8 GPUs (two per NIC).
    "v100-32gb": DeviceSpec("V100-32GB", "32GiB", 15.7 * _T, 15.7 * _T, 125 * _T, 900 * _GB, 0.869, 0.625,
                            122 * _GB, 5e-6, 12 * _GB, 2, 1e-5, "cuda-sm70",
                            host_memory="512GB", host_link=12 * _GB, host_memory_rate=2 * 76.8 * _GB, sms=80),
    # NVIDIA TITAN RTX: FP32 16.3, 130 Tensor TFLOPS FP16; no BF16 hardware; GDDR6 672 GB/s. No NVLink
    # between the cards: PCIe 3.0 x16. The Galvatron paper's testbed (arXiv 2211.13878, Sec. 5): 8 per
    # node over PCIe 3.0, nodes on 100 Gb/s InfiniBand, one NIC for the node.
    "rtx-titan-24gb": DeviceSpec("RTX-TITAN-24GB", "24GiB", 16.3 * _T, 16.3 * _T, 130 * _T, 672 * _GB, 0.869,
                                 0.625, 12 * _GB, 1e-5, 12 * _GB, None, 2e-5, "cuda-sm70",
                                host_memory="512GB", host_link=12 * _GB, host_memory_rate=2 * 76.8 * _GB, sms=72),
}


# NOTE: GPU defaults. A CUDA kernel launch from PyTorch's eager dispatcher costs ~5-10 us, the backward
# node about as much again; an NCCL call ~10-30 us beyond its ring steps (the presets' ``α`` prices
# those); a galvatron layer adds two autograd Functions and its parameter views; checkpointing adds
# two Python saved-tensor hooks per saved tensor (a few us per op, host-side like a launch); a fused / foreach
# Adam step and the device's copies stream at its memory rate: the presets set optimizer_s_per_byte
# (ADAM_WORDS_PER_PARAMETER) and copy_s_per_byte from it (preset_fields); the figures here
# (2 TB/s) serve hand-made clusters that ask for GPU_OVERHEADS.
GPU_OVERHEADS = dict(op_launch_s=7e-6, op_launch_bwd_s=10e-6, collective_latency_s=20e-6,
                     layer_overhead_s=60e-6, microbatch_overhead_s=300e-6, optimizer_s_per_byte=5e-12,
                     optimizer_overhead_s=20e-6, checkpoint_op_s=5e-6, copy_s_per_byte=1e-12,
                     split_backward_op_s=5e-6)

ADAM_WORDS_PER_PARAMETER = 7
"""A fused / foreach Adam step streams ~7 fp32 words per parameter (reads p, g, m, v; writes p, m,
v): bytes of memory traffic per byte of fp32 parameters it updates."""


def preset_fields(spec: DeviceSpec, per_node: int, attention_kernel: str = "sdpa") -> dict:
    """The :class:`~galvatron_fx.cluster.Cluster` fields of ``per_node`` devices of ``spec`` per node
    (all but the node counts and the name): its peaks and fractions, links, host, and the GPU
    overheads with the copy and optimizer rates taken from its memory bandwidth."""
    memory_rate = spec.hbm * HBM_EFFICIENCY
    host_rate = spec.host_memory_rate * HOST_STREAM_EFFICIENCY / per_node   # one device's share
    return dict(
        GPU_OVERHEADS, copy_s_per_byte=2 / memory_rate, optimizer_s_per_byte=ADAM_WORDS_PER_PARAMETER / memory_rate,
        memory_bytes=parse_bytes(spec.memory),
        peak_flops={"fp32": spec.fp32, "bf16": spec.bf16, "fp16": spec.fp16, **({"fp8": spec.fp8} if spec.fp8 else {})},
        efficiency=spec.mamf, fp8_efficiency=spec.mamf_fp8, gemm_tile=GEMM_TILE, gemm_wave=spec.sms,
        device_speed_spread=NODE_SPEED_SPREAD,
        attention_efficiency=spec.attention_rate_of(attention_kernel), attention_half_rate_seq=ATTENTION_HALF_RATE_SEQ,
        intra_bandwidth=spec.intra_bandwidth, intra_latency=spec.intra_latency,
        inter_bandwidth=spec.inter_share(per_node), inter_latency=spec.inter_latency,
        host_memory_bytes=parse_bytes(spec.host_memory), host_bandwidth=spec.host_link,
        host_optimizer_s_per_byte=ADAM_WORDS_PER_PARAMETER / host_rate if host_rate else 0.0)
