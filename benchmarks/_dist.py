"""Shared helpers of the distributed benchmarks (2 gloo ranks on 127.0.0.1): spawning, model and plan
building, the profiled local cluster, interleaved step timing, measured memory, rank correlation.

Every rank runs with one intra-op thread (see ``tests/dist_utils.run_distributed``). Times are in
seconds, memory in bytes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _common import ckpt_word  # noqa: E402

from tests.dist_utils import run_distributed  # noqa: E402

MODEL = "gpt-tiny"
MODEL_KW = dict(layers=4, hidden=128, heads=4, seq_len=64, vocab=256, batch=16)
"""The default workload: gpt-tiny widened so that a 2-rank step takes tens of milliseconds."""


def spawn(fn, world: int, *args, timeout: float = 600.0):
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; values by rank."""
    return run_distributed(fn, world, *args, timeout=timeout)


def model_kw(args) -> dict:
    """The model overrides from the common command-line flags."""
    return dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
                vocab=args.vocab, batch=args.batch)


def add_model_args(p, steps: int = 7) -> None:
    d = MODEL_KW
    p.add_argument("--layers", type=int, default=d["layers"])
    p.add_argument("--hidden", type=int, default=d["hidden"])
    p.add_argument("--heads", type=int, default=d["heads"])
    p.add_argument("--seq-len", type=int, default=d["seq_len"])
    p.add_argument("--vocab", type=int, default=d["vocab"])
    p.add_argument("--batch", type=int, default=d["batch"], help="global batch (samples)")
    p.add_argument("--steps", type=int, default=steps,
                   help="timed steps per variant (median), after 2 warm-up rounds")


def build(overrides: dict):
    """``(model, args, gm)``: the zoo model on CPU (seeded), its example batch and the fx capture."""
    import galvatron_fx as gfx

    torch.manual_seed(0)
    model, args = gfx.models.build(MODEL, device="cpu", **overrides)
    gm = gfx.capture(model, args, method="fx")
    return model, args, gm


def uniform(gm, world: int, gbs: int, **kw):
    """``Plan.uniform`` validated (``kw``: tp, sdp, pp, ckpt, sp, micro_batches, schedule)."""
    import galvatron_fx as gfx

    plan = gfx.Plan.uniform(gm, world, global_batch_size=gbs, **kw)
    plan.validate()
    return plan


def profiled_cluster():
    """``Cluster.profile()`` of the live world (collective fits, p2p, overlap, matmul FLOP/s)."""
    import galvatron_fx as gfx

    return gfx.Cluster.profile(progress=False, repeats=5)


def plan_label(plan) -> str:
    """Short text of a plan: ``pp2 m4 1f1b | tp2 zero3 ckpt`` (distinct layer strategies)."""
    kinds = []
    for lp in plan.layers:
        s = f"tp{lp.tp}" + (f" {lp.sdp}" if lp.sdp != "none" else "") + (" sp" if lp.sp else "") \
            + ckpt_word(lp.ckpt)
        if s not in kinds:
            kinds.append(s)
    head = f"pp{plan.pp} m{plan.micro_batches}" + (f" {plan.schedule}" if plan.pp > 1 else "")
    return head + " | " + ", ".join(kinds)


def timed(step) -> float:
    """Seconds of ``step()`` on the slowest rank (barrier before, max all-reduce after)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def interleaved(steps: dict, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per step of every ``name -> step()``, round-robin: every round runs each
    variant once, so that machine noise hits all of them alike. ``warmup`` untimed rounds first."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(warmup + repeats):
        for k, step in steps.items():
            t = timed(step)
            if r >= warmup:
                times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def gfx_step(dm, opt, args, with_optimizer: bool = True):
    """A galvatron_fx training step (``train_step`` then, optionally, ``opt.step()``)."""
    def step():
        dm.train_step(*args)
        if with_optimizer:
            opt.step()
    return step


def time_plans(gm, plans: dict, args, steps: int) -> tuple[dict, dict[str, float]]:
    """Build every ``label -> plan`` on this rank (AdamW, one warm-up step each) and time them
    interleaved (:func:`interleaved`): ``({label: (dist_model, optimizer)}, {label: median s})``."""
    import galvatron_fx as gfx

    models, step_fns = {}, {}
    for label, plan in plans.items():
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-4)
        dm.train_step(*args)
        opt.step()
        models[label] = (dm, opt)
        step_fns[label] = gfx_step(dm, opt, args)
    return models, interleaved(step_fns, steps)


def saved_activation_bytes(dm, plan, args) -> int:
    """Bytes saved for backward by one micro-batch's forward on this rank (pp = 1): unique storages,
    parameter storages (and ZeRO-3's gathered buffers) excluded, the outputs selective checkpointing
    keeps included. The graph is released afterwards."""
    from galvatron_fx.runtime.checkpointing import kept_tensors, recording_kept

    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in dm.parameters()}

    def pack(t):
        st = t.untyped_storage()
        full = {s.full.untyped_storage().data_ptr() for s in dm.stores if s.full is not None}
        if st.data_ptr() not in params and st.data_ptr() not in full and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    b = plan.micro_batch_size
    index, size = dm.input_shard   # the graph takes this rank's slice of a micro-batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recording_kept() as regions:
        loss = dm(*[a[:b][index * b // size:(index + 1) * b // size] for a in args])
    for t in kept_tensors(regions):   # what selective checkpointing keeps beside autograd's saved tensors
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    loss.backward()
    for s in dm.stores:
        s.zero_grad_state()
    return sum(seen.values())


def rel_err(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``."""
    return (predicted - measured) / measured if measured else float("nan")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation of two equal-length lists (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return float("nan")
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")
