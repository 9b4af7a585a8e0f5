"""The cluster model: devices, links and α-β time models of the collectives a plan uses.

A :class:`Cluster` is plain data (no torch.distributed needed): ``nodes`` × ``devices_per_node``
devices, each with ``memory_bytes`` of memory and a peak FLOP/s per dtype, linked inside a node by
the intra-node link and across nodes by the inter-node link. The cost model asks it three things:

* :meth:`Cluster.collective_time` — seconds for ``all_reduce`` / ``all_gather`` / ``reduce_scatter`` /
  ``all_to_all`` of a message over a group of global ranks (ring α-β formulas, below);
* :meth:`Cluster.p2p_time` — seconds for one point-to-point send (pipeline stage boundaries);
* :meth:`Cluster.compute_time` — seconds for a number of FLOPs in a dtype.

Ring formulas, for a group of ``n`` ranks over a link of bandwidth ``B`` (bytes/s) and latency ``α`` (s),
where ``S`` is always the **full** message size in bytes as stated per kind:

=================  ==========================================  =============================================
kind               time                                        ``S`` is
=================  ==========================================  =============================================
``all_reduce``     ``2(n-1)/n · S/B + 2(n-1)·α``               the buffer each rank holds (input = output)
``all_gather``     ``(n-1)/n · S/B + (n-1)·α``                 the gathered output (n × each rank's shard)
``reduce_scatter`` ``(n-1)/n · S/B + (n-1)·α``                 the full input (n × each rank's output shard)
``all_to_all``     ``(n-1)/n · S/B + (n-1)·α``                 each rank's whole send buffer
p2p                ``S/B + α``                                 the tensor sent
=================  ==========================================  =============================================

A group of one rank costs 0. Rank ``r`` lives on node ``r // devices_per_node``. A group inside one node
uses the intra-node link. A group spanning nodes is bound by the inter-node link: its bandwidth is
``min(intra_bandwidth, inter_bandwidth × k)`` where ``k`` is the largest number of the group's ranks on
one node, and its latency is ``inter_latency``.

NOTE: ``inter_bandwidth`` is the inter-node bandwidth **per device** — the share of the node's network
each device gets when all devices of a node talk across nodes at once (one NIC per GPU on DGX-class
machines). A ring whose group has ``k`` devices on a node can drive ``k`` such shares in parallel (NCCL
runs one channel per NIC), hence the ``× k``; a strided group such as ``[0, 8]`` gets one share.

**Overheads.** Besides FLOPs and bytes, a step pays fixed costs that dominate small models and
small messages (all seconds; 0 on a hand-made ``Cluster(...)`` unless given, GPU presets get datasheet-
style defaults, :meth:`Cluster.profile` measures them):

==========================  ===================================================================
field                       what it prices
==========================  ===================================================================
``op_launch_s``             one op call (one fx node) in forward: dispatch + kernel launch
``op_launch_bwd_s``         the same op's backward node
``collective_latency_s``    one collective or send call beyond the ring's ``α`` steps (the
                            framework's call, the backend's fixed cost): added once per call
``layer_overhead_s``        one layer per micro-batch: the runtime's entry / exit autograd
                            Functions, parameter views and hooks (forward + backward)
``microbatch_overhead_s``   one micro-batch of one stage: slicing the inputs, the loss, starting
                            the autograd engine; with pipelining, the send / recv bookkeeping
``optimizer_s_per_byte``    the optimizer step, per byte of fp32 parameters a device updates
``optimizer_overhead_s``    the optimizer step, per parameter tensor (one per trainable parameter)
``checkpoint_op_s``         one forward op of a checkpointed layer: ``torch.utils.checkpoint``'s
                            saved-tensor hooks and recomputation bookkeeping (re-running the op
                            is priced as a second forward)
``copy_s_per_byte``         the runtime's copies around a layer, per byte written: a pass's
                            gradients flattened into one buffer (DP) or into the reduce-scatter
                            staging (ZeRO), DP's gradient buckets, ZeRO's gathered parameters
                            copied out of the all-gather staging
``split_backward_op_s``     one op of a layer under a split backward (the zero-bubble
                            schedules): torch's input / weight split walks the autograd graph in
                            Python and its weight pass re-runs each parameter's consumer
``sync_drift_sqrt_s``       the ranks' drift apart over a stretch of compute, which the next
                            blocking collective waits out: ``c`` in ``c * sqrt(S)`` seconds after
                            ``S`` seconds of compute (independent per-op jitter adds up as a
                            random walk), priced beyond the probe's own stretch ``sync_stretch_s``
                            (whose wait ``collective_latency_s`` holds): :meth:`Cluster.sync_wait`
``sync_stretch_s``          the compute stretch ``collective_latency_s`` was measured after (s)
``p2p_wakeup_s``            what a point-to-point transfer waits beyond its own time when its
                            receiver asks for data the sender posted earlier while the sender
                            computes on (a send moves only at the receiver's request and then
                            needs the sender's communication thread, which waits for a core):
                            charged once per such input on a pipeline's critical path
                            (:func:`galvatron_fx.solver.schedules.late_transfers`)
``door_call_s``             a training step through ``torch.compile(backend="galvatron")`` beyond
                            its ``train_step``: dynamo's frame, the backend's call, the program
                            run inside the compiled call, the backward's routing (per step)
``door_param_s``            the same, per trainable parameter tensor (its gradient routed in
                            ``loss.backward()``, the user's ``zero_grad``): :meth:`Cluster.door_time`
==========================  ===================================================================

**The host** (:data:`HOST_FIELDS`, CPU offload: :mod:`galvatron_fx.dims.offload`):
``host_memory_bytes`` per node (0: the devices are the host, as on a CPU cluster: nothing to
offload to), ``host_bandwidth`` bytes/s per direction between one device and the host while every
device of the node copies, ``host_optimizer_s_per_byte`` the host's optimizer step per byte of
fp32 parameters one device's share updates while every device's share steps. Presets: the node's
datasheet (:mod:`galvatron_fx.devices`); hand-made clusters 0 (no offload) unless given;
:meth:`Cluster.profile` measures the local host.

The last five (:data:`SYNC_FIELDS`, :data:`DOOR_FIELDS`) are measured only: presets and hand-made
clusters leave them 0; ``Cluster.profile()`` measures the drift, ``galvatron-fx profile`` the door too
(measured: docs/measurements.md, "Figures behind the design"). The door enters
the estimate of a plan the backend searches or loads (``estimate["door_s"]``), not the search's
ranking: every plan of one model pays the same.

:mod:`galvatron_fx.cost.model` and :mod:`galvatron_fx.solver.objective` say where each enters a
step.

Measured clusters (:meth:`Cluster.profile`) also carry ``fits``: per collective kind and group size, the
link bandwidth and latency that reproduce the measured times through the same formulas. They replace the
link figures for groups of that size laid out like the measured one (consecutive ranks from 0).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

import torch.distributed as dist

from .cluster_times import COLLECTIVES, P2P, ClusterTimes  # noqa: F401 - the link kinds: the cluster's names too
from .devices import DEVICES, GPU_OVERHEADS, preset_fields  # noqa: F401 - GPU_OVERHEADS: hand-made clusters ask for it
from .errors import ConfigError
from .units import DTYPES, format_bytes, matmul_dtype, normalize_dtype, parse_bytes  # noqa: F401 - DTYPES, normalize_dtype: the cluster's names too

FORMAT = "galvatron_fx.cluster/1"
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
"""Training precisions a plan may name: fp32 throughout, or fp32 master weights and optimizer
states with bf16 / fp16 compute (parameters, gradients and activations in the low precision)."""

# NOTE: 0.5 of peak is a typical sustained fraction for transformer training matmuls on data-centre
# GPUs (model-FLOPs utilisation of large-model training is commonly reported at 40-60 %).
DEFAULT_EFFICIENCY = 0.5
# NOTE: compute and communication sharing a device slow each other down (SM / memory-bandwidth and
# PCIe contention); Galvatron-BMW models this with an overlap coefficient. 1.3 is a middle-of-the-road
# default; Cluster.profile() measures the real one.
DEFAULT_OVERLAP_SLOWDOWN = 1.3
OVERHEAD_FIELDS = ("op_launch_s", "op_launch_bwd_s", "collective_latency_s", "layer_overhead_s",
                   "microbatch_overhead_s", "optimizer_s_per_byte", "optimizer_overhead_s", "checkpoint_op_s",
                   "copy_s_per_byte", "split_backward_op_s")
"""The fixed-cost fields of a :class:`Cluster` (module docstring), seconds (per byte for the optimizer
and the runtime's copies)."""
DOOR_FIELDS = ("door_call_s", "door_param_s")
"""What one training step through ``torch.compile(backend="galvatron")`` costs beyond the program's
``train_step`` (:meth:`Cluster.door_time`): per step, and per trainable parameter tensor. Measured
by ``galvatron-fx profile`` (:func:`galvatron_fx.backend.door.measure_door`, the real door on two
small models), 0 (not priced) on presets and ``Cluster.profile()``."""
SYNC_FIELDS = ("sync_drift_sqrt_s", "sync_stretch_s", "p2p_wakeup_s")
"""The ranks' drift between blocking collectives (module docstring; :meth:`Cluster.sync_wait`) and
the wake-up a late-asked transfer waits for: measured by :meth:`Cluster.profile`, 0 (not priced) on
presets and hand-made clusters."""
HOST_FIELDS = ("host_memory_bytes", "host_bandwidth", "host_optimizer_s_per_byte")
"""The host's figures (module docstring); 0 where there is no host apart from the devices."""
CALIBRATION_FIELDS = ("step_overhead_s", "pipeline_step_s", "time_scale", "pipeline_time_scale")
"""How a plan's modelled step maps to the measured one: ``step = scale * slowest stage + constant``
(:func:`galvatron_fx.solver.objective.step_time`). ``time_scale`` multiplies every plan's stage
time, ``pipeline_time_scale`` a pipelined plan's on top; ``step_overhead_s`` is what every step
costs beyond the model's terms, ``pipeline_step_s`` what a pipelined step costs beyond that
(seconds). Scales 1 and constants 0 for presets and fresh profiles; the measured final selection
fits the scales to its timed candidates (:mod:`galvatron_fx.selection`) and ``galvatron-fx plan /
train --measure K --cluster FILE`` stores them in FILE, so the next search starts closer."""
SCALE_FIELDS = ("time_scale", "pipeline_time_scale")
# Presets: galvatron_fx/devices.py (datasheet peaks and the rates public measurements sustain).
_DEVICES = DEVICES
_PRESET_RE = re.compile(r"^(?:(\d+)x)?(\d+)x(.+)$", re.IGNORECASE)
_PRESET_HELP = (
    "valid presets: 'local' (profile the live torch.distributed world), 'NxDEVICE' (N devices in one "
    "node) or 'MxNxDEVICE' (M nodes of N devices), e.g. '8xA100-80GB', '2x8xA100-80GB'; DEVICE is one of "
    + ", ".join(spec.display for spec in _DEVICES.values())
)


# NOTE: the default precision is what a user of the device would train in: bf16 where the hardware
# has it (Ampere and later), fp16 with loss scaling where only fp16 tensor cores exist, fp32 on CPUs
# and on measured clusters (the live world: the runtime's own numerics, fp32 on the gloo CPU path).
_DEFAULT_PRECISION = {"a100": "bf16-mixed", "h100": "bf16-mixed", "h200": "bf16-mixed",
                      "v100": "fp16-mixed", "rtx-titan": "fp16-mixed"}


def default_precision(cluster: Cluster | Mapping | str | None) -> str:
    """The precision a plan gets on ``cluster`` (a Cluster, its dict, or its name) unless one is
    given: ``bf16-mixed`` on A100 / H100 / H200 presets, ``fp16-mixed`` on V100 / RTX TITAN,
    ``fp32`` everywhere else (CPU, ``local`` and other profiled clusters, custom clusters)."""
    name = cluster.get("name") if isinstance(cluster, Mapping) else getattr(cluster, "name", cluster)
    m = _PRESET_RE.match(name.strip()) if isinstance(name, str) else None
    if m is None:
        return "fp32"
    device = m.group(3).lower()
    return next((p for prefix, p in _DEFAULT_PRECISION.items() if device.startswith(prefix)), "fp32")


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"cluster field {name!r} must be a number, got {value!r}")
    ok = value >= 0 if allow_zero else value > 0
    if not ok or not math.isfinite(value):
        bound = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"cluster field {name!r} must be {bound} and finite, got {value!r}")
    return float(value)


def _fraction(name: str, value: Any, *, allow_zero: bool = True) -> float:
    """A fraction of a peak: in (0, 1], or [0, 1] where 0 means "not given"."""
    value = _positive(name, value, allow_zero=allow_zero)
    if value > 1:
        span = "[0, 1]" if allow_zero else "(0, 1]"
        raise ConfigError(f"cluster field {name!r} is a fraction of peak in {span}, got {value}")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"cluster field {name!r} must be a positive integer, got {value!r}")
    return value


@dataclass
class Cluster(ClusterTimes):
    """A homogeneous GPU (or CPU) cluster: ``nodes`` × ``devices_per_node`` devices.

    Units: ``memory_bytes`` bytes per device; ``peak_flops`` FLOP/s per device per dtype (keys
    ``fp32``, ``bf16``, ``fp16``, and ``fp8`` where the device has fp8 tensor cores: the rate of a
    model's ``torch._scaled_mm`` matmuls); ``efficiency`` the achievable fraction of peak (0, 1]
    (``fp8_efficiency`` that of the fp8 peak; 0: ``efficiency``) of one device;
    ``device_speed_spread`` the spread of that speed over 8 devices of the type (the compute-bound
    rates are the slowest device's: :meth:`straggler_factor`; 0: all alike, as on a profiled host);
    bandwidths bytes/s per direction; latencies seconds; ``overlap_slowdown`` ≥ 1 is the factor by which
    compute and communication slow each other while they overlap. ``inter_*`` default to the ``intra_*``
    figures. The overhead fields (:data:`OVERHEAD_FIELDS`) are seconds per op, call, layer,
    micro-batch or optimizer tensor, and seconds per byte for ``optimizer_s_per_byte`` (module
    docstring). ``fits`` holds measured per-collective link figures (see the module docstring):
    ``{kind: {str(group_size): {"bandwidth": bytes/s, "latency": s}}}``, kind one of
    :data:`COLLECTIVES` or ``"p2p"``.
    """

    memory_bytes: int
    peak_flops: dict[str, float]
    intra_bandwidth: float
    intra_latency: float
    nodes: int = 1
    devices_per_node: int = 1
    inter_bandwidth: float | None = None
    inter_latency: float | None = None
    efficiency: float = DEFAULT_EFFICIENCY
    overlap_slowdown: float = DEFAULT_OVERLAP_SLOWDOWN
    name: str = "custom"
    fits: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    op_launch_s: float = 0.0
    op_launch_bwd_s: float = 0.0
    collective_latency_s: float = 0.0
    layer_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    optimizer_s_per_byte: float = 0.0
    optimizer_overhead_s: float = 0.0
    checkpoint_op_s: float = 0.0
    copy_s_per_byte: float = 0.0
    split_backward_op_s: float = 0.0
    sync_drift_sqrt_s: float = 0.0
    sync_stretch_s: float = 0.0
    p2p_wakeup_s: float = 0.0
    door_call_s: float = 0.0
    door_param_s: float = 0.0
    gemm_tile: int = 1
    gemm_wave: int = 0   # GEMM tiles computed at once (the SMs); 0: no wave quantisation
    attention_efficiency: float = 0.0
    attention_half_rate_seq: float = 0.0
    fp8_efficiency: float = 0.0
    device_speed_spread: float = 0.0   # (fastest - slowest) / mean matmul speed over 8 devices
    profile_spread: dict[str, float] = field(default_factory=dict)  # profiled: figure -> (max - min) / min over rounds
    host_memory_bytes: int = 0   # the host (HOST_FIELDS)
    host_bandwidth: float = 0.0
    host_optimizer_s_per_byte: float = 0.0
    step_overhead_s: float = 0.0   # calibration (CALIBRATION_FIELDS)
    pipeline_step_s: float = 0.0
    time_scale: float = 1.0
    pipeline_time_scale: float = 1.0

    def __post_init__(self) -> None:
        self.nodes = _count("nodes", self.nodes)
        self.devices_per_node = _count("devices_per_node", self.devices_per_node)
        self.memory_bytes = parse_bytes(self.memory_bytes, "cluster field 'memory_bytes'")
        if not isinstance(self.peak_flops, Mapping):
            raise ConfigError(f"cluster field 'peak_flops' must map {DTYPES} to FLOP/s, got {self.peak_flops!r}")
        missing = [d for d in DTYPES if d not in self.peak_flops]
        if missing:
            raise ConfigError(f"cluster field 'peak_flops' lacks {missing}; it needs FLOP/s for {list(DTYPES)}")
        self.peak_flops = {
            matmul_dtype(k): _positive(f"peak_flops.{k}", v) for k, v in self.peak_flops.items()
        }
        self.intra_bandwidth = _positive("intra_bandwidth", self.intra_bandwidth)
        self.intra_latency = _positive("intra_latency", self.intra_latency, allow_zero=True)
        if self.inter_bandwidth is None:
            self.inter_bandwidth = self.intra_bandwidth
        if self.inter_latency is None:
            self.inter_latency = self.intra_latency
        self.inter_bandwidth = _positive("inter_bandwidth", self.inter_bandwidth)
        self.inter_latency = _positive("inter_latency", self.inter_latency, allow_zero=True)
        self.efficiency = _fraction("efficiency", self.efficiency, allow_zero=False)
        self.overlap_slowdown = _positive("overlap_slowdown", self.overlap_slowdown)
        if self.overlap_slowdown < 1:
            raise ConfigError(f"cluster field 'overlap_slowdown' must be >= 1, got {self.overlap_slowdown}")
        if not isinstance(self.name, str):
            raise ConfigError(f"cluster field 'name' must be a string, got {self.name!r}")
        self.fits = self._check_fits(self.fits)
        self.gemm_tile = _count("gemm_tile", self.gemm_tile)
        if self.gemm_wave != 0:
            self.gemm_wave = _count("gemm_wave", self.gemm_wave)
        self.fp8_efficiency = _fraction("fp8_efficiency", self.fp8_efficiency)
        self.device_speed_spread = _positive("device_speed_spread", self.device_speed_spread, allow_zero=True)
        if self.device_speed_spread >= 0.5:
            raise ConfigError(f"cluster field 'device_speed_spread' is the spread of the devices' speeds over "
                              f"8 devices, below 0.5 (GPU presets: 0.05), got {self.device_speed_spread}")
        self.attention_efficiency = _fraction("attention_efficiency", self.attention_efficiency)
        self.attention_half_rate_seq = _positive("attention_half_rate_seq", self.attention_half_rate_seq,
                                                 allow_zero=True)
        if self.host_memory_bytes != 0:   # 0: no host apart from the devices
            self.host_memory_bytes = parse_bytes(self.host_memory_bytes, "cluster field 'host_memory_bytes'")
        for name in OVERHEAD_FIELDS + SYNC_FIELDS + DOOR_FIELDS + CALIBRATION_FIELDS + HOST_FIELDS[1:]:
            setattr(self, name, _positive(name, getattr(self, name), allow_zero=name not in SCALE_FIELDS))

    def calibrated(self, fit: Mapping[str, float]) -> Cluster:
        """This cluster with calibration fields (:data:`CALIBRATION_FIELDS`) replaced by ``fit``,
        e.g. ``plan.extra["measure"]["fit"]`` of a measured search on this cluster."""
        unknown = sorted(set(fit) - set(CALIBRATION_FIELDS))
        if unknown:
            raise ConfigError(f"calibration key(s) {unknown} unknown; known: {', '.join(CALIBRATION_FIELDS)}")
        return replace(self, **fit)

    @staticmethod
    def _check_fits(fits: Any) -> dict[str, dict[str, dict[str, float]]]:
        if not isinstance(fits, Mapping):
            raise ConfigError(f"cluster field 'fits' must be a mapping, got {type(fits).__name__}")
        out: dict[str, dict[str, dict[str, float]]] = {}
        for kind, by_size in fits.items():
            if kind not in COLLECTIVES and kind != P2P:
                raise ConfigError(f"cluster field 'fits.{kind}': unknown kind; use {list(COLLECTIVES) + [P2P]}")
            if not isinstance(by_size, Mapping):
                raise ConfigError(f"cluster field 'fits.{kind}' must map group sizes to figures")
            out[kind] = {}
            for size, fig in by_size.items():
                where = f"fits.{kind}.{size}"
                if not str(size).isdigit() or not isinstance(fig, Mapping) or set(fig) != {"bandwidth", "latency"}:
                    raise ConfigError(
                        f"cluster field {where!r} must be a group size mapped to "
                        "{'bandwidth': bytes/s, 'latency': s}"
                    )
                out[kind][str(int(size))] = {
                    "bandwidth": _positive(f"{where}.bandwidth", fig["bandwidth"]),
                    "latency": _positive(f"{where}.latency", fig["latency"], allow_zero=True),
                }
        return out

    # ------------------------------------------------------------------ shape
    @property
    def world_size(self) -> int:
        """Number of devices in the cluster (``nodes × devices_per_node``)."""
        return self.nodes * self.devices_per_node

    @property
    def device_memory(self) -> int:
        """Memory of one device, in bytes."""
        return self.memory_bytes

    @property
    def has_host(self) -> bool:
        """Whether the devices have a host apart from them to offload to (memory and a link)."""
        return self.host_memory_bytes > 0 and self.host_bandwidth > 0

    @property
    def host_memory_per_device(self) -> float:
        """One device's share of its node's host memory, in bytes (0 without a host)."""
        return self.host_memory_bytes / self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node index of global rank ``rank``."""
        return rank // self.devices_per_node

    # ------------------------------------------------------------------ time models


    @property
    def profiled(self) -> bool:
        """Whether this cluster was measured (:meth:`profile`: named ``local-...``)."""
        return self.name.startswith("local-")

    @property
    def attention_target(self) -> str:
        """The device family whose SDPA kernels price attention
        (:data:`galvatron_fx.cost.attention_kernels.TARGETS`): a measured cluster's own device
        (its name ends with the device type), a preset's GPU (flash attention from sm80 on),
        CUDA sm80+ for a hand-made cluster."""
        if self.profiled:
            return "cpu" if self.name.endswith("cpu") else "cuda"
        m = _PRESET_RE.match(self.name.strip())
        spec = _DEVICES.get(m.group(3).lower()) if m else None
        return spec.attention if spec is not None else "cuda"


    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with the versioned ``format`` key)."""
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Any) -> Cluster:
        """Inverse of :meth:`to_dict`; ConfigError naming the bad key on malformed input."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a cluster description must be a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ConfigError(f"cluster key 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"format"})
        if unknown:
            raise ConfigError(f"unknown cluster key(s) {unknown}; valid keys: {sorted(names)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"cluster key(s) {missing} missing")
        kwargs = {k: v for k, v in data.items() if k != "format"}
        for key in ("memory_bytes", "host_memory_bytes"):
            if isinstance(kwargs.get(key), float) and kwargs[key].is_integer():
                kwargs[key] = int(kwargs[key])
        return cls(**kwargs)

    def save(self, path: str) -> None:
        """Write the cluster to ``path`` as JSON."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")

    @classmethod
    def load(cls, path: str) -> Cluster:
        """Read a cluster written by :meth:`save`; ConfigError on unreadable or malformed files."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read cluster file {path!r}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cluster file {path!r} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str, attention_kernel: str = "sdpa") -> Cluster:
        """A datasheet cluster such as ``'8xA100-80GB'`` or ``'2x8xH100-80GB'``; ``'local'`` profiles.
        Devices: A100-40GB, A100-80GB, H100-80GB, H200-141GB, V100-32GB, RTX-TITAN-24GB. Attention
        is priced as ``attention_kernel`` runs (:data:`galvatron_fx.devices.ATTENTION_KERNELS`)."""
        if not isinstance(name, str):
            raise ConfigError(f"cluster preset must be a string; {_PRESET_HELP}")
        if name.strip().lower() == "local":
            return cls.profile()
        m = _PRESET_RE.match(name.strip())
        spec = _DEVICES.get(m.group(3).lower()) if m else None
        if spec is None:
            raise ConfigError(f"unknown cluster preset {name!r}; {_PRESET_HELP}")
        nodes, per_node = int(m.group(1) or 1), int(m.group(2))
        if nodes < 1 or per_node < 1:
            raise ConfigError(f"cluster preset {name!r} needs at least one node and one device; {_PRESET_HELP}")
        canonical = f"{per_node}x{spec.display}" if m.group(1) is None else f"{nodes}x{per_node}x{spec.display}"
        return cls(nodes=nodes, devices_per_node=per_node, name=canonical,
                   **preset_fields(spec, per_node, attention_kernel))

    @classmethod
    def profile(cls, group=None, out: str | None = None, sizes=None, progress: bool = True, **kwargs) -> Cluster:
        """Measure the live torch.distributed world; see :func:`galvatron_fx.cluster_profile.profile`."""
        from .cluster_profile import (
            profile,  # NOTE: the profile sits above the cluster model (it runs the runtime)
        )

        cluster = cls(**profile(group=group, sizes=sizes, progress=progress, **kwargs))
        cluster.save_profile(out, group, progress)
        return cluster

    def save_profile(self, out: str | None, group=None, progress: bool = True) -> None:
        """A profiled cluster written to ``out`` (if given) by rank 0 of ``group`` alone."""
        if out and (not dist.is_initialized() or dist.get_rank(group) == 0):
            self.save(out)
            if progress:
                print(f"[galvatron_fx.profile] wrote {out}", file=sys.stderr, flush=True)


    @property
    def is_calibrated(self) -> bool:
        """Whether any calibration field (:data:`CALIBRATION_FIELDS`) is off its default."""
        defaults = {f.name: f.default for f in fields(self)}
        return any(getattr(self, k) != defaults[k] for k in CALIBRATION_FIELDS)
