"""The fixed-cost probes of the cluster profile (:mod:`galvatron_fx.cluster_profile`, step 0 and
the point-to-point part of step 3): per op, per collective (and the ranks' drift), per layer, per
micro-batch, the optimizer, the runtime's copies and the split backward; a transfer inside a
pipeline and a transfer its receiver asks for late."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .cluster_timing import MIN_LATENCY, Timer, barrier, stable_figures
from .distributed import synchronize
from .runtime.checkpointing import checkpoint_layer

_FLOOR = dict(op_launch_s=1e-7, op_launch_bwd_s=1e-7, collective_latency_s=MIN_LATENCY, layer_overhead_s=1e-7,
              microbatch_overhead_s=1e-7, optimizer_s_per_byte=1e-14, optimizer_overhead_s=1e-7,
              checkpoint_op_s=1e-7, copy_s_per_byte=1e-14, split_backward_op_s=1e-7, sync_drift_sqrt_s=0.0,
              sync_stretch_s=0.0)


class _LayerEntry(torch.autograd.Function):
    """Stand-in for the runtime's per-layer entry / exit Functions (identity on a flat buffer)."""

    @staticmethod
    def forward(ctx, flat):
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx, grad):
        return grad


def stable_overheads(device, pg, repeats: int, say) -> tuple[dict[str, float], dict[str, float]]:
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
    # NOTE: one function (105 lines): one probe per cluster field, in the order each needs the ones before it
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
    small = 1024
    few = _adam_step(device, small)
    per_byte = _adam_per_byte(device, local)
    more = local.excess(few, {"many": _adam_step(device, small, 16)})["many"]
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


def _adam_step(device: torch.device, numel: int, tensors: int = 4) -> Callable[[], object]:
    """The step of an AdamW over ``tensors`` parameters of ``numel`` elements on ``device``, of the
    classes the user's optimizer steps (runtime/params.py: the gradient's ``__torch_function__`` is
    part of the per-tensor cost, ~19 % of it on 64 tensors of 1024)."""
    from .runtime.params import ShardedGrad, ShardedParameter

    params = [torch.Tensor._make_subclass(ShardedParameter, torch.zeros(numel, device=device), True)
              for _ in range(tensors)]
    for p in params:
        p.grad = ShardedGrad.wrap(torch.zeros(numel, device=device), None)
    return torch.optim.AdamW(params, lr=1e-3).step


def _adam_per_byte(device: torch.device, timer: Timer) -> float:
    """AdamW's seconds per fp32 parameter byte on ``device``: the slope between 4 tensors of two
    sizes (small ones timed apart from the large, whose steps leave the caches cold)."""
    small, large = 1024, 2**18 if device.type == "cpu" else 2**22
    runs = timer.interleaved({"small": _adam_step(device, small), "large": _adam_step(device, large)})
    extra = statistics.median(b - s for b, s in zip(runs["large"], runs["small"]))
    return max(extra, 0.0) / (4 * 4 * (large - small))


def host_figures(device: torch.device, repeats: int) -> dict[str, float]:
    """The host's figures (:data:`galvatron_fx.cluster.HOST_FIELDS`) for CPU offload, measured from
    this device while the other ranks of the node measure theirs: its physical memory, pinned
    copies device -> host and back (64 MiB, bytes/s per direction) and AdamW's seconds per fp32 byte
    over host tensors. Empty on the CPU (the devices are the host: nothing to offload to)."""
    if device.type == "cpu":
        return {}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    numel = 2**24
    host = torch.empty(numel, pin_memory=True)
    dev = torch.empty(numel, device=device)
    timer = Timer(device, None, repeats, 2)
    both = timer(lambda: (dev.copy_(host, non_blocking=True), host.copy_(dev, non_blocking=True)))
    cpu = torch.device("cpu")
    return dict(host_memory_bytes=memory, host_bandwidth=2 * 4 * numel / both,
                host_optimizer_s_per_byte=_adam_per_byte(cpu, Timer(cpu, None, repeats, 2)))


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


PIPELINE_PROBE = {"micro_batches": (2, 8), "width": 16, "rows": 4}
"""The near-empty pipeline of :func:`pipelined_p2p`: the two micro-batch counts whose step
difference gives the cost of one micro-batch, and the stage (one ``width x width`` Linear on
``rows`` rows per micro-batch)."""


def pipelined_p2p(fit: dict[str, float], device, pg, first: bool, overheads: dict[str, float], repeats: int,
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
"""The exchange of :func:`p2p_wakeup`: the sender posts ``nbytes`` 1 ms in and computes until
``busy_s`` later; the receiver asks for them at ``ask_s``. The compute is a layer's: forward and
backward of a ``width``-wide Linear + GELU on ``rows`` rows, in a loop."""


def p2p_wakeup(device, pg, first: bool, say) -> float:
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
            barrier(pg, device)
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
