"""Live measurement of a torch.distributed world into a :class:`~galvatron_fx.cluster.Cluster`.

:func:`profile` (also ``Cluster.profile()`` and ``Cluster.preset("local")``) must be called by every
rank of ``group``. It measures, in this order:

0. the fixed costs of :data:`galvatron_fx.cluster.OVERHEAD_FIELDS` (:func:`measure_overheads`), on
   every rank at once (so that ranks sharing a host contend as in training), in rounds until two
   agree within 10 % (4 to 8 rounds; each figure the minimum of its round medians, the spread over
   the rounds recorded as the cluster's ``profile_spread``: :func:`stable_figures`; the collective and
   point-to-point timings of steps 2 and 3 likewise, 2 to 5 rounds, their median): a chain of tiny ops
   forward and backward (per-op launch), a one-element all-reduce between stretches of compute
   (per-collective latency, rank skew included; after a stretch 8x longer too, whose extra wait
   is the ranks' drift, ``sync_drift_sqrt_s``, the median over the rounds: :func:`_sync_figures`), a
   layer's autograd entry / exit Functions and parameter views (per layer), a micro-batch's slicing,
   loss and ``backward()`` call on a one-op graph (per micro-batch), AdamW steps at two sizes
   (per parameter byte) and two tensor counts (per tensor). A figure that is a difference of two
   timings times both in turn, run by run (:meth:`Timer.excess`).
1. the layout: ranks sharing a hostname form a node;
2. for every group size a plan can use (powers of two up to the group size, and the group size
   itself; consecutive ranks from 0)
   and every collective kind, the time at each of ``sizes`` (bytes), each run right after a stretch
   of compute (as in training) minus that compute — ``warmup`` untimed runs, then
   ``repeats`` timed runs, each the slowest rank's time, median over runs — and fits ``t = a + b·S``,
   turned into the link bandwidth and latency that reproduce it through the ring formulas of
   :mod:`galvatron_fx.cluster`;
3. point-to-point (ping-pong between group ranks 0 and 1, and across nodes when there are several);
   between ranks 0 and 1 the latency is raised to what a transfer costs inside a pipeline (a
   near-empty 2-stage 1F1B under ``torch.distributed.pipelining``: :func:`_pipelined_p2p`), and
   what a transfer its receiver asks for late waits while the sender computes (:func:`_p2p_wakeup`);
4. the overlap slowdown: an all-reduce of the largest size started asynchronously beside as much
   compute on the main thread, against the two alone (:func:`_measure_overlap`);
5. local matmul throughput per dtype (tiny on CPU for bf16/fp16, which are ~80x slower there).

Rank 0's figures are broadcast, so every rank returns the same Cluster. The measured matmul FLOP/s are
stored as ``peak_flops`` with ``efficiency = 1.0`` (they already are achieved rates).

If torch.distributed is not initialised, a world of one is profiled (compute only; collectives of a
group of one cost 0) with a warning.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist

from .distributed import all_gather_single, is_distributed, pick_device, reduce_scatter_single, synchronize
from .ir import TORCH_DTYPES
from .runtime.checkpointing import checkpoint_layer
from .runtime.groups import GROUPS

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
P2P = "p2p"
"""The link kinds measured here and priced by :class:`~galvatron_fx.cluster.Cluster` (which
re-exports them). NOTE: they live here, below ``cluster``, so the import goes one way only."""

# NOTE: a world of one never communicates; these placeholders only keep the Cluster valid.
_UNMEASURED_BANDWIDTH = 1e12  # bytes/s
_UNMEASURED_LATENCY = 0.0  # s
# Latencies fitted below this are measurement noise; floor them so that every figure stays positive.
_MIN_LATENCY = 1e-6  # s

_FLOOR = dict(op_launch_s=1e-7, op_launch_bwd_s=1e-7, collective_latency_s=_MIN_LATENCY, layer_overhead_s=1e-7,
              microbatch_overhead_s=1e-7, optimizer_s_per_byte=1e-14, optimizer_overhead_s=1e-7,
              checkpoint_op_s=1e-7, copy_s_per_byte=1e-14, split_backward_op_s=1e-7, sync_drift_sqrt_s=0.0,
              sync_stretch_s=0.0)
_CPU_SIZES = (2**16, 2**20, 2**23)  # bytes
_GPU_SIZES = (2**20, 2**24, 2**27)  # bytes
_CPU_MATMUL = {"fp32": 256, "bf16": 48, "fp16": 48}  # square matmul side
_GPU_MATMUL = {"fp32": 4096, "bf16": 8192, "fp16": 8192}


class _Reporter:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[galvatron_fx.profile +{time.perf_counter() - self.start:5.1f}s] {msg}", file=sys.stderr, flush=True)


def _steps(kind: str, n: int) -> tuple[float, float]:
    """(bandwidth coefficient, latency coefficient) of the ring formula of ``kind`` over ``n`` ranks."""
    if kind == P2P:
        return 1.0, 1.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps / n, float(steps)


def fit_link(kind: str, n: int, sizes: Sequence[float], times: Sequence[float],
             call_latency: float = 0.0) -> dict[str, float]:
    """Least-squares fit of ``times`` (s) against ``sizes`` (bytes) as ``{"bandwidth", "latency"}``.

    The line ``t = a + b·S`` is mapped through the ring formula of ``kind`` over ``n`` ranks:
    ``bandwidth = c_bw / b`` bytes/s and ``latency = a / c_lat`` s. A non-positive slope (noise) falls
    back to the largest message's mean rate; a negative intercept refits through the origin.
    ``call_latency`` (the cluster's ``collective_latency_s``, charged once per call on top of the
    ring) is taken off every time first, so that the two do not count the same seconds twice.
    """
    if len(sizes) < 2 or len(sizes) != len(times):
        raise ValueError("fit_link needs at least two (size, time) pairs")
    times = [max(t - call_latency, 1e-12) for t in times]
    xm, ym = statistics.fmean(sizes), statistics.fmean(times)
    var = sum((x - xm) ** 2 for x in sizes)
    b = sum((x - xm) * (y - ym) for x, y in zip(sizes, times)) / var if var > 0 else 0.0
    a = ym - b * xm
    if b <= 0:
        b, a = max(times) / max(sizes), 0.0
    elif a < 0:
        b, a = sum(x * y for x, y in zip(sizes, times)) / sum(x * x for x in sizes), 0.0
    c_bw, c_lat = _steps(kind, n)
    return {"bandwidth": c_bw / b, "latency": max(a / c_lat, _MIN_LATENCY)}


def _barrier(pg, device: torch.device) -> None:
    """Wait for every rank of ``pg``."""
    # NOTE: a tiny all-reduce instead of dist.barrier(): NCCL's barrier has to guess the device.
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
    synchronize(device)


class Timer:
    """Times operations on the ranks of ``pg``, each run the slowest rank's seconds (``pg=None``: this
    rank alone, device synchronised)."""

    def __init__(self, device: torch.device, pg, repeats: int, warmup: int) -> None:
        self.device, self.pg, self.repeats, self.warmup = device, pg, repeats, warmup

    def __call__(self, op: Callable[[], object]) -> float:
        """The median over runs of ``op``."""
        return statistics.median(self.interleaved({"op": op})["op"])

    def excess(self, base: Callable[[], object], ops: dict[str, Callable[[], object]],
               stat: Callable = statistics.median) -> dict[str, float]:
        """Per op, ``stat`` (the median) over runs of its time minus ``base``'s in the same run."""
        runs = self.interleaved({"": base, **ops})
        return {k: stat([t - b for t, b in zip(runs[k], runs[""])]) for k in ops}

    def interleaved(self, ops: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
        """``repeats`` timed runs of every op in turn (after ``warmup`` untimed ones): a slow spell of
        the host lands on one run of all of them, so that a difference within a run cancels it."""
        for _ in range(self.warmup):
            for op in ops.values():
                op()
        synchronize(self.device)
        times = []
        for _ in range(self.repeats):
            for op in ops.values():
                if self.pg is not None:
                    _barrier(self.pg, self.device)
                t0 = time.perf_counter()
                op()
                synchronize(self.device)
                times.append(time.perf_counter() - t0)
        if self.pg is not None:
            slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.pg)
            times = slowest.tolist()
        return {k: times[i::len(ops)] for i, k in enumerate(ops)}


def _compute_stretch(device: torch.device) -> Callable[[], object]:
    """A stretch of compute (two square matmuls) of the kind a layer runs between its collectives."""
    side = 256 if device.type == "cpu" else 2048
    a = torch.randn(side, side, device=device)
    return lambda: [torch.mm(a, a) for _ in range(2)]


STREAM_CALLS = 4
"""Collectives per timed stream in :func:`_in_stream`."""


def _in_stream(timer: Timer, work, ops: dict, calls: int = STREAM_CALLS) -> dict[str, float]:
    """Seconds per call of each collective of ``ops`` inside a stream of ``calls`` x (a stretch of
    compute ``work``, the collective), as a layer runs them, minus the compute alone. On a shared
    CPU host the transport threads wait to be scheduled and the ranks' compute drifts apart between
    calls, so that a call costs more than alone. The mean over runs, not the median: the calls'
    times have a heavy tail that a step pays on average (measured: docs/measurements.md, "Figures behind the design")."""
    excess = timer.excess(lambda: [work() for _ in range(calls)],
                          {s: (lambda op=op: [(work(), op()) for _ in range(calls)]) for s, op in ops.items()},
                          stat=statistics.fmean)
    return {s: max(t / calls, 1e-9) for s, t in excess.items()}


def _collective_op(kind: str, nbytes: int, n: int, device: torch.device, pg,
                   async_op: bool = False) -> Callable[[], object]:
    """A closure running ``kind`` with the full size ``nbytes`` (see Cluster.collective_time) on
    ``pg``; ``async_op``: an all-reduce started asynchronously, the closure returning its work."""
    numel = max(n, (nbytes // 4) // n * n)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.empty(numel // n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=pg, async_op=async_op)
    if kind == "all_gather":
        return lambda: all_gather_single(full, part, group=pg)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_single(part, full, group=pg)
    out = torch.empty_like(full)
    return lambda: dist.all_to_all_single(out, full, group=pg)


def _ping_pong(nbytes: int, me: int, a: int, b: int, device: torch.device, repeats: int, warmup: int) -> float:
    """Median one-way seconds of ``nbytes`` between global ranks ``a`` and ``b`` (measured on ``a``)."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        if me == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        else:
            dist.recv(buf, a)
            dist.send(buf, a)
        synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _agreed(figures: dict[str, float], me: int, a: int, b: int, device: torch.device) -> dict[str, float]:
    """Rank ``a``'s ``figures`` on both ranks of a ping-pong pair (so both stop after the same round)."""
    vals = torch.tensor(list(figures.values()), dtype=torch.float64, device=device)
    if me == a:
        dist.send(vals, b)
    else:
        dist.recv(vals, a)
    return dict(zip(figures, vals.tolist()))


def _matmul_flops(dtype: str, side: int, device: torch.device, repeats: int) -> float:
    """Measured FLOP/s of a ``side``×``side`` matmul in ``dtype`` (median of ``repeats``)."""
    a = torch.randn(side, side, device=device).to(TORCH_DTYPES[dtype])
    b = torch.randn(side, side, device=device).to(TORCH_DTYPES[dtype])
    c = torch.mm(a, b)
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * side**3 / max(statistics.median(times), 1e-9)


def _layout(pg, world: int) -> int:
    """Devices per node: the number of ranks sharing group rank 0's hostname (1 node on doubt)."""
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=pg)
    per_node = hosts.count(hosts[0])
    uniform = world % per_node == 0 and all(
        hosts[i] == hosts[i - i % per_node] and (i < per_node or hosts[i] != hosts[0]) for i in range(world)
    )
    if not uniform:
        warnings.warn(
            f"ranks are not laid out as equal consecutive blocks per host ({hosts}); "
            "profiling them as one node", stacklevel=3,
        )
        return world
    return per_node


def _device_memory(device: torch.device, per_node: int) -> int:
    """Bytes of memory of one device (CPU: physical RAM split between the node's ranks)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    return max(1, int(total) // per_node)


def profile(
    group=None,
    out: str | None = None,
    sizes: Sequence[int] | None = None,
    progress: bool = True,
    repeats: int = 7,
    warmup: int = 1,
    matmul_sides: dict[str, int] | None = None,
) -> dict:
    """Measure the live world (or process ``group``); returns the same keyword arguments of
    :class:`~galvatron_fx.cluster.Cluster` on every rank (``Cluster.profile()`` builds and saves it).

    ``sizes``: message sizes in bytes (≥ 2; default 16 KiB-2 MiB on CPU, 1-128 MiB on GPU).
    ``repeats`` timed runs (median) after ``warmup`` untimed ones. ``matmul_sides``: square matmul side
    per dtype for the compute measurement. ``out``: JSON path written by rank 0. Progress goes to
    stderr on rank 0 when ``progress``. Must be called by every rank of ``group``.
    """
    device = pick_device()
    sizes = sorted(set(int(s) for s in (sizes or (_GPU_SIZES if device.type == "cuda" else _CPU_SIZES))))
    if len(sizes) < 2:
        raise ValueError("Cluster.profile needs at least two message sizes to fit latency and bandwidth")
    sides = dict(_GPU_MATMUL if device.type == "cuda" else _CPU_MATMUL)
    sides.update(matmul_sides or {})

    if not is_distributed():
        warnings.warn(
            "torch.distributed is not initialised: profiling a world of one device (compute only)", stacklevel=2
        )
        say = _Reporter(progress)
        flops = _measure_compute(device, sides, repeats, say)
        overheads, spread = _stable_overheads(device, None, repeats, say)
        return dict(
            memory_bytes=_device_memory(device, 1), peak_flops=flops, efficiency=1.0,
            intra_bandwidth=_UNMEASURED_BANDWIDTH, intra_latency=_UNMEASURED_LATENCY,
            overlap_slowdown=1.0, name=f"local-1x{device.type}", profile_spread=spread, **overheads,
        )

    pg = group if group is not None else dist.group.WORLD
    world, me_local = dist.get_world_size(pg), dist.get_rank(pg)
    ranks = [dist.get_global_rank(pg, i) for i in range(world)] if pg is not dist.group.WORLD else list(range(world))
    me = ranks[me_local]
    say = _Reporter(progress and me_local == 0)
    say(f"profiling {world} rank(s) on {device.type} with {dist.get_backend(pg)}; sizes {sizes} bytes")
    per_node = _layout(pg, world)
    nodes = world // per_node

    overheads, spread = _stable_overheads(device, pg, repeats, say)
    call = overheads["collective_latency_s"]
    fits: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in COLLECTIVES}
    group_sizes = [2**i for i in range(1, world.bit_length()) if 2**i <= world]
    if world > 1 and world not in group_sizes:
        group_sizes.append(world)
    for n in group_sizes:
        members = ranks[:n]
        if n != world:
            GROUPS.ensure([members], local=True)
        sub = pg if n == world else GROUPS.get(tuple(members))
        if me in members:
            timer = Timer(device, sub, repeats, warmup)
            work = _compute_stretch(device)
            for kind in COLLECTIVES:
                ops = {str(s): _collective_op(kind, s, n, device, sub) for s in sizes}
                best, spread_k = stable_figures(lambda: _in_stream(timer, work, ops), pick=statistics.median)
                spread[f"{kind}_{n}"] = max(v for k, v in spread_k.items() if k != "rounds")
                times = [best[str(s)] for s in sizes]
                fit = fit_link(kind, n, sizes, times, call)
                fits[kind][str(n)] = fit
                say(f"{kind:>14} n={n}: {fit['bandwidth'] / 1e9:8.3f} GB/s, {fit['latency'] * 1e6:8.1f} us")
    _barrier(pg, device)

    fits[P2P] = {}
    inter_p2p, wakeup = None, 0.0
    pairs = [(ranks[0], ranks[1], "intra" if per_node > 1 else "inter")] if world > 1 else []
    if nodes > 1 and per_node > 1:
        pairs.append((ranks[0], ranks[per_node], "inter"))
    for a, b, where in pairs:
        if me in (a, b):
            best, spread_k = stable_figures(lambda: _agreed(
                {str(s): _ping_pong(s, me, a, b, device, repeats, warmup) for s in sizes}, me, a, b, device),
                pick=statistics.median)
            spread[f"p2p_{where}"] = max(v for k, v in spread_k.items() if k != "rounds")
            times = [best[str(s)] for s in sizes]
            fit = fit_link(P2P, 2, sizes, times, call)
            if where == "intra" or per_node == 1:
                sub = pg if world == 2 else GROUPS.get((a, b))
                fit = _pipelined_p2p(fit, device, sub, me == a, overheads, repeats, warmup, say)
                wakeup = _p2p_wakeup(device, sub, me == a, say)
                fits[P2P]["2"] = fit
            inter_p2p = fit if where == "inter" else inter_p2p
            say(f"{'p2p ' + where:>14}: {fit['bandwidth'] / 1e9:8.3f} GB/s, {fit['latency'] * 1e6:8.1f} us")
        _barrier(pg, device)

    overlap = _measure_overlap(device, pg, max(sizes), world, sides["fp32"], repeats, warmup, say)
    flops = _measure_compute(device, sides, repeats, say)

    box = [None]
    if me_local == 0:
        box[0] = {**_assemble(fits, inter_p2p, per_node, nodes, flops, overlap, device), **overheads,
                  "p2p_wakeup_s": wakeup, "profile_spread": spread}
        say(f"done in {time.perf_counter() - say.start:.1f}s")
    dist.broadcast_object_list(box, src=ranks[0], group=pg)
    return box[0]


def _measure_compute(device: torch.device, sides: dict[str, int], repeats: int, say: _Reporter) -> dict[str, float]:
    flops = {}
    for dtype, side in sides.items():
        flops[dtype] = _matmul_flops(dtype, side, device, repeats)
        say(f"{'matmul ' + dtype:>14}: {flops[dtype] / 1e9:8.2f} GFLOP/s ({side}x{side})")
    return flops


class _LayerEntry(torch.autograd.Function):
    """Stand-in for the runtime's per-layer entry / exit Functions (identity on a flat buffer)."""

    @staticmethod
    def forward(ctx, flat):
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx, grad):
        return grad


def stable_figures(measure_round: Callable[[], dict[str, float]], tol: float = 0.10, max_rounds: int = 5,
                   min_rounds: int = 2, pick=min, noise: Collection[str] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """Repeat ``measure_round()`` (figures, each a median of its runs), at least ``min_rounds`` times,
    until the last two rounds agree within ``tol`` (relative) on every figure, or ``max_rounds``;
    returns each figure's ``pick`` over the rounds (default the minimum, the min of medians:
    interference only ever adds time, so the quietest round is the reproducible one; the link
    timings use the median, which fits steps under contention better) and its spread,
    ``(max - min) / min``, with ``"rounds"``. Figures named in ``noise`` measure interference
    itself: they take the median over the rounds and need not agree. Deterministic in the figures,
    so ranks that measure the same (all-reduced) figures stop together."""
    rounds: list[dict[str, float]] = []
    agreed = False
    while len(rounds) < max(max_rounds, min_rounds, 2) and not agreed:
        rounds.append(measure_round())
        agreed = len(rounds) >= max(min_rounds, 2) and all(_close(rounds[-1][k], rounds[-2][k], tol)
                                                           for k in rounds[-1] if k not in noise)
    best = {k: (statistics.median if k in noise else pick)([r[k] for r in rounds]) for k in rounds[0]}
    low = {k: min(r[k] for r in rounds) for k in rounds[0]}
    spread = {k: (max(r[k] for r in rounds) - low[k]) / low[k] if low[k] > 0 else 0.0 for k in best}
    return best, {**spread, "rounds": float(len(rounds))}


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(min(abs(a), abs(b)), 1e-30)


def _stable_overheads(device, pg, repeats: int, say) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`measure_overheads` in rounds until two agree within 10 % (:func:`stable_figures`)."""
    best, spread = stable_figures(lambda: measure_overheads(device, pg, repeats), max_rounds=8, min_rounds=4,
                                  noise=("sync_drift_sqrt_s",))
    if say is not None:
        say(f"{'overheads':>14}: {int(spread['rounds'])} rounds, largest spread "
            f"{max(v for k, v in spread.items() if k != 'rounds') * 100:.0f} %")
        _say_overheads(best, say)
    return best, spread


def measure_overheads(device: torch.device, pg=None, repeats: int = 7, say: Callable[[str], None] | None = None,
                      chain: int = 64) -> dict[str, float]:
    """The fixed costs of :data:`galvatron_fx.cluster.OVERHEAD_FIELDS`, in seconds (per byte for
    ``optimizer_s_per_byte``), measured on this device; with a process group ``pg``, every rank of it
    must call this (the collective latency is a one-element all-reduce over ``pg``, 0 without one).

    Each figure is the median over ``repeats`` of a loop of ``chain`` calls, divided by ``chain``; a
    figure that is a difference of loops times them in turn and takes the median of the differences
    (:meth:`Timer.excess`), which a slow spell of the host does not move.
    """
    local = Timer(device, None, repeats, 2)
    x0 = torch.zeros(16, device=device, requires_grad=True)

    def fwd_chain():
        y = x0
        for _ in range(chain):
            y = y * 1.0
        return y

    runs = local.interleaved({"fwd": fwd_chain, "all": lambda: fwd_chain().sum().backward()})
    op_fwd = statistics.median(runs["fwd"]) / chain
    op_bwd = max(statistics.median(t - f for t, f in zip(runs["all"], runs["fwd"])), 0.0) / chain

    # a layer: entry Function over its flat buffer, a dozen parameter views, an exit Function
    flat = torch.zeros(1024, device=device, requires_grad=True)

    def layers():
        y = x0
        for _ in range(chain // 8):
            buf = _LayerEntry.apply(flat)
            views = [buf[i * 64:(i + 1) * 64] for i in range(12)]
            y = _LayerEntry.apply(y) + views[0][:16]
        y.sum().backward()

    t_layers = local(layers) / (chain // 8)
    layer = max(t_layers - 16 * (op_fwd + op_bwd), op_fwd + op_bwd)

    # a micro-batch: slice the inputs, a one-op loss, scale, backward, accumulate the detached loss
    inp = torch.zeros(8, 16, device=device)
    w = torch.zeros(16, device=device, requires_grad=True)

    def micro_batch():
        total = None
        for k in range(chain // 8):
            a = inp[k % 8:k % 8 + 1]
            loss = (a * w).sum()
            (loss * 1.0).backward()
            total = loss.detach() if total is None else total + loss.detach()

    micro = local(micro_batch) / (chain // 8)

    # checkpointing: the same op chain (each op saves a tensor) under torch.utils.checkpoint, beyond
    # the plain forward + backward and the recomputed forward, per op
    w0 = torch.ones(16, device=device, requires_grad=True)

    def saving_chain(x):
        for _ in range(chain):
            x = x * w0
        return x

    runs = local.interleaved({
        "plain": lambda: saving_chain(x0).sum().backward(), "forward": lambda: saving_chain(x0),
        "ckpt": lambda: checkpoint_layer(saving_chain, x0).sum().backward()})
    ckpt_op = max(statistics.median(c - p - f for c, p, f in zip(runs["ckpt"], runs["plain"], runs["forward"])),
                  0.0) / chain

    latency = drift = stretch = 0.0
    if pg is not None and dist.get_world_size(pg) > 1:
        latency, drift, stretch = _sync_figures(device, pg, repeats)

    # AdamW: 4 tensors at two sizes, the slope seconds per byte; 4 and 16 small tensors (timed apart
    # from the large ones, whose steps leave the caches cold: that doubled the figure), the slope per tensor
    # NOTE: parameters and gradients of the classes the user's optimizer steps (runtime/params.py:
    # the gradient's __torch_function__ is part of the per-tensor cost, ~19 % of it on 64 tensors of 1024)
    from .runtime.params import ShardedGrad, ShardedParameter

    def adam_step(numel: int, tensors: int = 4) -> Callable[[], object]:
        params = [torch.Tensor._make_subclass(ShardedParameter, torch.zeros(numel, device=device), True)
                  for _ in range(tensors)]
        for p in params:
            p.grad = ShardedGrad.wrap(torch.zeros(numel, device=device), None)
        return torch.optim.AdamW(params, lr=1e-3).step

    small, large = 1024, 2**18 if device.type == "cpu" else 2**22
    few = adam_step(small)
    runs = local.interleaved({"small": few, "large": adam_step(large)})
    extra = statistics.median(b - s for b, s in zip(runs["large"], runs["small"]))
    per_byte = max(extra, 0.0) / (4 * 4 * (large - small))
    more = local.excess(few, {"many": adam_step(small, 16)})["many"]
    per_tensor = max(more / 12 - 4 * small * per_byte, 0.0)
    out = dict(op_launch_s=op_fwd, op_launch_bwd_s=op_bwd, collective_latency_s=latency, layer_overhead_s=layer,
               microbatch_overhead_s=micro, optimizer_s_per_byte=per_byte, optimizer_overhead_s=per_tensor,
               checkpoint_op_s=ckpt_op, copy_s_per_byte=_copy_s_per_byte(device, repeats),
               split_backward_op_s=_split_backward_op_s(device, repeats), sync_drift_sqrt_s=drift,
               sync_stretch_s=stretch)
    # NOTE: a difference of two noisy medians may come out <= 0; floor it at a tiny positive figure
    out = {k: v if k == "collective_latency_s" and pg is None else max(v, _FLOOR[k]) for k, v in out.items()}
    if pg is not None and dist.get_world_size(pg) > 1:
        # NOTE: ranks sharing a host measured at once; the slowest rank paces a step
        vals = torch.tensor(list(out.values()), dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=pg)
        out = dict(zip(out, vals.tolist()))
    if say is not None:
        _say_overheads(out, say)
    return out


def _copy_s_per_byte(device: torch.device, repeats: int) -> float:
    """Seconds per byte written of the runtime's gradient flattening (12 tensors into one buffer,
    the slope between two sizes)."""
    def flatten(numel: int) -> Callable[[], object]:
        parts = [torch.ones(numel // 12, device=device) for _ in range(12)]
        return lambda: torch._C._nn.flatten_dense_tensors(parts)

    small, large = 12 * 256, 2**20 if device.type == "cpu" else 2**26
    excess = Timer(device, None, repeats, 2).excess(flatten(small), {"large": flatten(large)})["large"]
    return max(excess, 0.0) / (4 * (large - small))


def _split_backward_op_s(device: torch.device, repeats: int, layers: int = 8) -> float:
    """Seconds per op that torch's split backward (zero-bubble: ``stage_backward_input`` then
    ``stage_backward_weight``) costs beyond one whole backward: its Python walk of the autograd
    graph, the parameter groups' hooks and the weight pass re-running each parameter's consumer.
    Timed on ``layers`` x (linear, gelu) of 64 features whose input needs a gradient (a later stage)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    weights = [torch.randn(64, 64, device=device, requires_grad=True) for _ in range(layers)]
    x = torch.randn(16, 64, device=device, requires_grad=True)

    def forward():
        h = x
        for w in weights:
            h = torch.nn.functional.gelu(h @ w)
        return h.sum()

    def whole():
        forward().backward()

    def split():
        _grads, groups = stage_backward_input([forward()], None, [x], iter(weights))
        stage_backward_weight(iter(weights), groups)

    excess = Timer(device, None, repeats, 2).excess(whole, {"split": split})["split"]
    return max(excess, 0.0) / (2 * layers)


SYNC_STRETCHES = (2, 16)
"""Matmuls per compute stretch of :func:`_sync_figures`' short and long streams (8 calls each)."""
SYNC_WINDOWS = 3
"""Consecutive windows of ``repeats`` runs of the short stream, the latency the quietest one's median:
the wait after a short stretch moves from minute to minute on a shared host (measured: docs/measurements.md, "Figures behind the design"), and a quiet
window is the reproducible figure (the drift term prices the rest)."""


def _sync_figures(device: torch.device, pg, repeats: int) -> tuple[float, float, float]:
    """``(collective_latency_s, sync_drift_sqrt_s, sync_stretch_s)``: a blocking collective between
    stretches of compute (what TP and resharding do) also waits for the slowest rank to get there,
    the longer the stretch the longer (the ranks' per-op jitter adds up). Timed as (compute +
    one-element all-reduce) x calls minus the compute alone, per call, after a short stretch (the
    latency, rank skew included) and after one 8x longer; the drift ``c`` fits the extra wait as
    ``c * (sqrt(S_long) - sqrt(S_short))`` (measured: docs/measurements.md, "Figures behind the design"). Each stream is timed in turn
    with its compute alone, run by run (:meth:`Timer.interleaved`)."""
    one = torch.zeros(1, device=device)
    side = 256 if device.type == "cpu" else 2048
    a = torch.randn(side, side, device=device)
    bare = Timer(device, pg, repeats, 2)(lambda: [dist.all_reduce(one, group=pg) for _ in range(8)]) / 8
    waits, stretches = [], []
    for k, windows in zip(SYNC_STRETCHES, (SYNC_WINDOWS, 1)):
        def work(k=k):
            for _ in range(k):
                torch.mm(a, a)

        runs = Timer(device, pg, windows * repeats, 2).interleaved({
            "alone": lambda: [work() for _ in range(8)],
            "both": lambda: [(work(), dist.all_reduce(one, group=pg)) for _ in range(8)]})
        excess = [y - x for x, y in zip(runs["alone"], runs["both"])]
        waits.append(min(statistics.median(excess[w * repeats:(w + 1) * repeats]) for w in range(windows)) / 8)
        stretches.append(statistics.median(runs["alone"]) / 8)
    latency = max(waits[0], bare)
    span = math.sqrt(stretches[1]) - math.sqrt(stretches[0])
    drift = max(waits[1] - latency, 0.0) / span if span > 0 else 0.0
    return latency, drift, stretches[0]


def _say_overheads(out: dict[str, float], say) -> None:
    say(f"{'overheads':>14}: op {out['op_launch_s'] * 1e6:.1f} + {out['op_launch_bwd_s'] * 1e6:.1f} us, "
        f"collective {out['collective_latency_s'] * 1e6:.1f} us, layer {out['layer_overhead_s'] * 1e6:.1f} us, "
        f"micro-batch {out['microbatch_overhead_s'] * 1e6:.1f} us, optimizer "
        f"{out['optimizer_s_per_byte'] * 1e12:.1f} ps/byte + {out['optimizer_overhead_s'] * 1e6:.1f} us/tensor, "
        f"checkpointing {out['checkpoint_op_s'] * 1e6:.1f} us/op, copies {out['copy_s_per_byte'] * 1e12:.1f} ps/byte, "
        f"split backward {out['split_backward_op_s'] * 1e6:.1f} us/op, drift {out['sync_drift_sqrt_s'] * 1e3:.2f} "
        f"ms/sqrt(s) beyond {out['sync_stretch_s'] * 1e3:.2f} ms")


def _measure_overlap(device, pg, nbytes, world, side, repeats, warmup, say) -> float:
    """The ``overlap_slowdown`` (>= 1) that :meth:`Cluster.overlap_time` needs to reproduce an
    all-reduce of ``nbytes`` started asynchronously and waited for after a stretch of compute on
    the main thread (how the runtime overlaps ZeRO's gathers and reduce-scatters with a layer's
    compute; NCCL on its own stream): ``1 + (together - longer) / shorter`` of the two timed alone,
    the compute sized to the collective, the median over rounds (:func:`stable_figures`), slowest
    rank. A collective timed beside a matmul thread instead read too unstable a figure (measured: docs/measurements.md, "Figures behind the design")."""
    if world < 2:
        return 1.0
    timer = Timer(device, pg, repeats, warmup)
    a = torch.randn(side, side, device=device)
    op = _collective_op("all_reduce", nbytes, world, device, pg)
    comm = timer(op)
    one = timer(lambda: torch.mm(a, a))
    calls = max(1, round(comm / one)) if one > 0 else 1

    def compute() -> None:
        for _ in range(calls):
            torch.mm(a, a)

    start = _collective_op("all_reduce", nbytes, world, device, pg, async_op=True)

    def together() -> None:
        handle = start()
        compute()
        handle.wait()

    def measure_round() -> dict[str, float]:
        runs = timer.interleaved({"comm": op, "compute": compute, "both": together})
        c, m, both = (statistics.median(runs[k]) for k in ("compute", "comm", "both"))
        short, long = sorted((c, m))
        return {"overlap_slowdown": max(1.0, 1.0 + (both - long) / short) if short > 0 else 1.0,
                "comm": m, "compute": c, "both": both}

    best, _spread = stable_figures(measure_round, max_rounds=5, min_rounds=3, pick=statistics.median,
                                   noise=("overlap_slowdown", "comm", "compute", "both"))
    factor = best["overlap_slowdown"] if math.isfinite(best["overlap_slowdown"]) else 1.0
    say(f"{'overlap':>14}: all_reduce {best['comm'] * 1e3:.2f} ms, compute {best['compute'] * 1e3:.2f} ms, "
        f"the collective started beside the compute {best['both'] * 1e3:.2f} ms -> slowdown {factor:.2f}")
    return factor


PIPELINE_PROBE = {"micro_batches": (2, 8), "width": 16, "rows": 4}
"""The near-empty pipeline of :func:`_pipelined_p2p`: the two micro-batch counts whose step
difference gives the cost of one micro-batch, and the stage (one ``width x width`` Linear on
``rows`` rows per micro-batch)."""


def _pipelined_p2p(fit: dict[str, float], device, pg, first: bool, overheads: dict[str, float], repeats: int,
                   warmup: int, say) -> dict[str, float]:
    """The p2p ``fit`` with its latency raised to what a pipeline's transfer costs: a near-empty
    2-stage 1F1B under ``torch.distributed.pipelining`` (what the runtime runs) between the two
    ranks of ``pg``, at two micro-batch counts. Each added micro-batch costs the stage's forward +
    backward (timed alone, on both ranks at once), the micro-batch overhead and two transfers
    (activation, gradient), as the cost model prices a pipeline slot; what remains, halved, is one
    transfer's seconds, priced as ``Cluster.p2p_time`` prices it (bytes / bandwidth + latency +
    the per-call latency). Ping-pong alone prices a transfer at its wire time, well under what a
    pipelined transfer costs (measured: docs/measurements.md, "Figures behind the design"). Never lowers the ping-pong latency."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    width, rows = PIPELINE_PROBE["width"], PIPELINE_PROBE["rows"]
    torch.manual_seed(0)
    stage_mod = nn.Linear(width, width).to(device)
    timer = Timer(device, pg, repeats, warmup)
    steps, nbytes = {}, rows * width * stage_mod.weight.element_size()   # one micro-batch's activation
    for m in PIPELINE_PROBE["micro_batches"]:
        x = torch.randn(m * rows, width, device=device)
        schedule = Schedule1F1B(PipelineStage(stage_mod, 0 if first else 1, 2, device, group=pg), n_microbatches=m,
                                loss_fn=lambda out, _target: out.sum())
        steps[m] = (lambda s=schedule, x=x: s.step(x)) if first else (lambda s=schedule, x=x: s.step(target=x))

    def alone():
        stage_mod(torch.randn(rows, width, device=device)).sum().backward()

    m1, m2 = PIPELINE_PROBE["micro_batches"]

    def measure_round() -> dict[str, float]:
        return {"per_microbatch": timer.excess(steps[m1], {"more": steps[m2]})["more"] / (m2 - m1),
                "stage": timer(alone)}

    best, _spread = stable_figures(measure_round, pick=statistics.median)
    one_way = (best["per_microbatch"] - best["stage"] - overheads["microbatch_overhead_s"]) / 2
    latency = one_way - nbytes / fit["bandwidth"] - overheads["collective_latency_s"]
    say(f"{'pipelined p2p':>14}: one micro-batch of a near-empty 1F1B {best['per_microbatch'] * 1e3:.2f} ms "
        f"-> a transfer {one_way * 1e3:.2f} ms, latency {max(latency, fit['latency']) * 1e6:.1f} us")
    return {**fit, "latency": max(latency, fit["latency"])} if math.isfinite(latency) else fit


WAKEUP_PROBE = {"ask_s": 0.003, "busy_s": 0.006, "nbytes": 64 << 10, "width": 256, "rows": 64, "samples": 48}
"""The exchange of :func:`_p2p_wakeup`: the sender posts ``nbytes`` 1 ms in and computes until
``busy_s`` later; the receiver asks for them at ``ask_s``. The compute is a layer's: forward and
backward of a ``width``-wide Linear + GELU on ``rows`` rows, in a loop."""


def _p2p_wakeup(device, pg, first: bool, say) -> float:
    """Seconds a point-to-point transfer waits beyond its own time when its receiver asks for data
    the sender posted earlier while the sender computes on: the mean receive over
    ``WAKEUP_PROBE["samples"]`` such exchanges less the mean with the sender waiting instead
    (five rounds, their median: a figure of interference, it need not settle; with three, two
    back-to-back profiles read 0.32 and 1.33 ms).
    A send moves only once its receiver has posted the receive (gloo: a rendezvous), and then needs
    the sender's communication thread, which waits for a core while the sender computes
    (measured: docs/measurements.md, "Figures behind the design"). Both ranks
    of ``pg`` (the pair) call it; the first sends."""
    from torch import nn

    probe = WAKEUP_PROBE
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(probe["width"], probe["width"]), nn.GELU()).to(device)
    x = torch.randn(probe["rows"], probe["width"], device=device)
    peer = dist.get_global_rank(pg, 1 if first else 0)

    def compute(seconds: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            layer(x).sum().backward()

    def waits(sender_busy: bool) -> float:
        buf, total = torch.zeros(probe["nbytes"] // 4, device=device), 0.0
        for _ in range(probe["samples"]):
            _barrier(pg, device)
            if first:
                compute(0.001)
                work = dist.isend(buf, peer, group=pg)
                compute(probe["busy_s"] if sender_busy else 0.0)
                work.wait()
            else:
                compute(probe["ask_s"])
                t0 = time.perf_counter()
                dist.recv(buf, peer, group=pg)
                synchronize(device)   # NCCL: the receive is queued on a stream, not waited for on the host
                total += time.perf_counter() - t0
        return total / probe["samples"]

    def measure_round() -> dict[str, float]:
        wake = torch.tensor([max(0.0, waits(True) - waits(False))], dtype=torch.float64, device=device)
        dist.broadcast(wake, dist.get_global_rank(pg, 1), group=pg)   # the receiver's figure
        return {"p2p_wakeup_s": float(wake.item())}

    compute(0.01)   # warm-up
    best, _spread = stable_figures(measure_round, max_rounds=5, min_rounds=5, pick=statistics.median,
                                   noise=("p2p_wakeup_s",))
    say(f"{'p2p wake-up':>14}: a transfer its receiver asks for while the sender computes waits "
        f"{best['p2p_wakeup_s'] * 1e3:.2f} ms more")
    return best["p2p_wakeup_s"]


def _assemble(fits, inter_p2p, per_node, nodes, flops, overlap, device) -> dict:
    """The Cluster's keyword arguments, on rank 0, from the measured fits."""
    def link(n: int) -> dict[str, float] | None:
        return fits["all_reduce"].get(str(n))

    sizes = sorted(int(k) for k in fits["all_reduce"])
    intra_sizes = [s for s in sizes if s <= per_node]
    inter_sizes = [s for s in sizes if s > per_node]
    intra = link(intra_sizes[-1]) if intra_sizes else None
    inter = None
    if inter_sizes:
        fig = link(inter_sizes[0])
        # The consecutive group has min(n, per_node) ranks on its busiest node, each driving one device
        # share of the node's network (see the cluster module docstring).
        inter = {"bandwidth": fig["bandwidth"] / min(inter_sizes[0], per_node), "latency": fig["latency"]}
    elif inter_p2p is not None:
        inter = {"bandwidth": inter_p2p["bandwidth"] / per_node, "latency": inter_p2p["latency"]}
    intra = intra or inter or {"bandwidth": _UNMEASURED_BANDWIDTH, "latency": _UNMEASURED_LATENCY}
    inter = inter or intra
    return dict(
        memory_bytes=_device_memory(device, per_node),
        peak_flops=flops,
        efficiency=1.0,
        intra_bandwidth=intra["bandwidth"],
        intra_latency=intra["latency"],
        inter_bandwidth=inter["bandwidth"],
        inter_latency=inter["latency"],
        nodes=nodes,
        devices_per_node=per_node,
        overlap_slowdown=overlap,
        name=f"local-{nodes}x{per_node}x{device.type}",
        fits={k: v for k, v in fits.items() if v},
    )
