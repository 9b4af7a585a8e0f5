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
   near-empty 2-stage 1F1B under ``torch.distributed.pipelining``: :func:`pipelined_p2p`), and
   what a transfer its receiver asks for late waits while the sender computes (:func:`p2p_wakeup`);
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
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .cluster_probes import host_figures, p2p_wakeup, pipelined_p2p, stable_overheads
from .cluster_times import COLLECTIVES, P2P
from .cluster_timing import MIN_LATENCY, Timer, barrier, stable_figures
from .distributed import all_gather_single, is_distributed, pick_device, reduce_scatter_single, synchronize
from .ir import TORCH_DTYPES
from .runtime.groups import GROUPS

# NOTE: a world of one never communicates; these placeholders only keep the Cluster valid.
_UNMEASURED_BANDWIDTH = 1e12  # bytes/s
_UNMEASURED_LATENCY = 0.0  # s

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
    return {"bandwidth": c_bw / b, "latency": max(a / c_lat, MIN_LATENCY)}


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
    # NOTE: one function (102 lines): the measurement steps of the module docstring, in their order, sharing the group, device and sizes
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
        overheads, spread = stable_overheads(device, None, repeats, say)
        return dict(
            memory_bytes=_device_memory(device, 1), peak_flops=flops, efficiency=1.0,
            intra_bandwidth=_UNMEASURED_BANDWIDTH, intra_latency=_UNMEASURED_LATENCY,
            overlap_slowdown=1.0, name=f"local-1x{device.type}", profile_spread=spread, **overheads,
            **host_figures(device, repeats),
        )

    pg = group if group is not None else dist.group.WORLD
    world, me_local = dist.get_world_size(pg), dist.get_rank(pg)
    ranks = [dist.get_global_rank(pg, i) for i in range(world)] if pg is not dist.group.WORLD else list(range(world))
    me = ranks[me_local]
    say = _Reporter(progress and me_local == 0)
    say(f"profiling {world} rank(s) on {device.type} with {dist.get_backend(pg)}; sizes {sizes} bytes")
    per_node = _layout(pg, world)
    nodes = world // per_node

    overheads, spread = stable_overheads(device, pg, repeats, say)
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
    barrier(pg, device)

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
                fit = pipelined_p2p(fit, device, sub, me == a, overheads, repeats, warmup, say)
                wakeup = p2p_wakeup(device, sub, me == a, say)
                fits[P2P]["2"] = fit
            inter_p2p = fit if where == "inter" else inter_p2p
            say(f"{'p2p ' + where:>14}: {fit['bandwidth'] / 1e9:8.3f} GB/s, {fit['latency'] * 1e6:8.1f} us")
        barrier(pg, device)

    overlap = _measure_overlap(device, pg, max(sizes), world, sides["fp32"], repeats, warmup, say)
    flops = _measure_compute(device, sides, repeats, say)
    host = host_figures(device, repeats)   # every rank at once, as offloaded ranks share their host

    box = [None]
    if me_local == 0:
        box[0] = {**_assemble(fits, inter_p2p, per_node, nodes, flops, overlap, device), **overheads,
                  "p2p_wakeup_s": wakeup, "profile_spread": spread, **host}
        say(f"done in {time.perf_counter() - say.start:.1f}s")
    dist.broadcast_object_list(box, src=ranks[0], group=pg)
    return box[0]


def _measure_compute(device: torch.device, sides: dict[str, int], repeats: int, say: _Reporter) -> dict[str, float]:
    flops = {}
    for dtype, side in sides.items():
        flops[dtype] = _matmul_flops(dtype, side, device, repeats)
        say(f"{'matmul ' + dtype:>14}: {flops[dtype] / 1e9:8.2f} GFLOP/s ({side}x{side})")
    return flops


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
