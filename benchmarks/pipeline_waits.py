"""Where a pipelined step's time goes beyond its compute: per schedule, each rank's time inside
``torch.distributed.pipelining``'s chunk calls (forward, backward) against the whole ``train_step``,
the schedule's bubble, and the cross-rank transfers on its critical path.

gpt-tiny (``_dist.MODEL_KW``: hidden 128, 4 layers, seq 64, batch 16) on 2 gloo ranks; pp2 under
GPipe, 1F1B and interleaved 1F1B (v = 2) with 2 and 4 micro-batches. Per plan and rank: the median
``train_step`` over interleaved rounds after warm-up, the seconds inside the chunk calls in those
steps (the stage's compute), and the rest. The rest holds the bubble, ``(slots - m) / m`` of the
compute (:func:`galvatron_fx.solver.schedules.step_slots`), and what the ranks' exchanges cost:
``critical_transfers`` of them lie on the step's critical path (the schedule simulated with a
delay on every cross-rank input: :func:`galvatron_fx.solver.schedules.critical_transfers`), so
``(rest - bubble) / critical`` is what one costs in the step, the wait for the other rank
included, beside what the profiled cluster prices a transfer (``Cluster.p2p_time`` of the
boundary activation) plus its drift wait. Beside it the plan's estimate against its measured
``train_step`` + AdamW step, which prices the schedule's late-asked inputs
(:func:`galvatron_fx.solver.schedules.late_transfers`, column ``late``) at the profile's
``p2p_wakeup_s`` each.

Then the point-to-point semantics the schedules run on (:func:`_rendezvous`): how long a send takes
to complete (``isend`` + ``wait``) when its receiver posts the receive ``LATE_S`` later, at 16 KiB
and 1 MiB. On gloo a send completes only once the receiver has posted (a rendezvous), so a stage
cannot run ahead of the next one's receive. And how long posting takes (the ``isend`` call alone)
when both ranks send to each other at once, as interleaved schedules do: its median and its
slowest over the repeats.

    python benchmarks/pipeline_waits.py [--steps N] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import MODEL_KW, build, profiled_cluster, spawn, uniform  # noqa: E402

PLANS = {  # label -> Plan.uniform keywords beside pp = 2
    "gpipe m2": dict(micro_batches=2, schedule="gpipe"),
    "1f1b m2": dict(micro_batches=2, schedule="1f1b"),
    "interleaved v2 m2": dict(micro_batches=2, schedule="interleaved-1f1b", virtual_stages=2),
    "gpipe m4": dict(micro_batches=4, schedule="gpipe"),
    "1f1b m4": dict(micro_batches=4, schedule="1f1b"),
    "interleaved v2 m4": dict(micro_batches=4, schedule="interleaved-1f1b", virtual_stages=2),
}


class _ChunkClock:
    """Seconds spent inside the pipeline stages' chunk calls while installed.

    NOTE: wraps ``torch.distributed.pipelining``'s private ``_PipelineStageBase`` methods (the one
    place every schedule runs a chunk's forward and backward); a benchmark's probe only."""

    NAMES = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self) -> None:
        from torch.distributed.pipelining import stage

        self.cls, self.seconds, self.saved = stage._PipelineStageBase, 0.0, {}

    def __enter__(self) -> _ChunkClock:
        for name in self.NAMES:
            fn = getattr(self.cls, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def timed(*a, _fn=fn, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(self.cls, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)


LATE_S = 0.005
"""How late the receiver of :func:`_rendezvous` posts its receive (seconds of compute first)."""
POSTS = 36
"""How many times :func:`_rendezvous` times both ranks posting sends to each other."""


def _rendezvous(rank, world, repeats: int = 9) -> dict[str, float]:
    """Median seconds from rank 0's ``isend`` to its ``wait`` returning, when rank 1 computes for
    ``LATE_S`` before posting the matching receive, per message size (bytes, as text); and
    ``post_median`` / ``post_max``: seconds to post two 64 KiB sends while the other rank posts its
    own to this one."""
    import torch
    import torch.distributed as dist

    def compute(seconds: float) -> None:
        a, t0 = torch.randn(128, 128), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a = a @ a
            a = a / a.norm()

    out = {}
    posts = []
    for _ in range(POSTS):   # both ranks post two sends to each other, then receive
        x, y = torch.zeros(2, (64 << 10) // 4), torch.zeros(2, (64 << 10) // 4)
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(x[i], 1 - rank, tag=i) for i in range(2)]
        posts.append(time.perf_counter() - t0)
        for i in range(2):
            dist.recv(y[i], 1 - rank, tag=i)
        for w in works:
            w.wait()
    out["post_median"], out["post_max"] = statistics.median(posts), max(posts)
    for nbytes in (16 << 10, 1 << 20):
        times = []
        for _ in range(repeats):
            x = torch.zeros(nbytes // 4)
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                dist.isend(x, 1).wait()
                times.append(time.perf_counter() - t0)
            else:
                compute(LATE_S)
                dist.recv(x, 0)
        out[str(nbytes)] = statistics.median(times) if times else 0.0
    return out


def _rank(rank, world, steps):
    import torch
    import torch.distributed as dist

    import galvatron_fx as gfx
    from galvatron_fx.solver.schedules import critical_transfers, late_transfers, step_slots

    cluster = profiled_cluster()
    _model, args, gm = build(MODEL_KW)
    batch = MODEL_KW["batch"]
    plans = {k: uniform(gm, world, batch, pp=2, **kw) for k, kw in PLANS.items()}
    with tempfile.TemporaryDirectory() as cache:
        est = {k: gfx.estimate(gm, p, cluster, mode="profiled", cache_dir=cache, profile_sizes=(2, 8, 16),
                               profile_repeats=9, reserve_bytes=0)["step_time_s"] for k, p in plans.items()}
    built = {}
    for k, plan in plans.items():
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-4)
        built[k] = (dm, opt)
    runs = {k: [] for k in plans}
    for r in range(steps + 2):
        for k, (dm, opt) in built.items():
            dist.barrier()
            with _ChunkClock() as clock:
                t0 = time.perf_counter()
                dm.train_step(*args)
                t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if r >= 2:
                runs[k].append((t1 - t0, clock.seconds, t2 - t0))
    out = {}
    for k, plan in plans.items():
        step, compute, whole = (statistics.median(x[i] for x in runs[k]) for i in range(3))
        m, v = plan.micro_batches, plan.virtual_stages
        bubble = (step_slots(plan.schedule, 2, v, m) - m) / m * compute
        critical = critical_transfers(plan.schedule, 2, v, m)
        nbytes = batch // m * MODEL_KW["seq_len"] * MODEL_KW["hidden"] * 4   # one micro-batch's activation
        stretch = compute / (m * (2 * v - 1))   # the compute between two receives
        priced = cluster.p2p_time(nbytes, 0, 1) + cluster.sync_wait(stretch)
        out[k] = {"train_step_s": step, "chunk_compute_s": compute, "rest_s": step - compute, "bubble_s": bubble,
                  "critical_transfers": critical, "per_critical_transfer_s": (step - compute - bubble) / critical,
                  "late_transfers": late_transfers(plan.schedule, 2, v, m), "wakeup_s": cluster.p2p_wakeup_s,
                  "priced_transfer_s": priced, "step_s": whole, "estimated_step_s": est[k]}
    out["rendezvous"] = _rendezvous(rank, world)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=9, help="timed interleaved rounds (median)")
    args = p.parse_args()
    t0 = time.perf_counter()
    ranks = spawn(_rank, 2, args.steps)
    rows, summary = [], {}
    for k in PLANS:
        for r, res in enumerate(ranks):
            x = res[k]
            rows.append([k if r == 0 else "", r, x["train_step_s"] * 1e3, x["chunk_compute_s"] * 1e3, x["rest_s"] * 1e3,
                         x["bubble_s"] * 1e3, x["critical_transfers"], x["per_critical_transfer_s"] * 1e3,
                         x["late_transfers"],
                         x["priced_transfer_s"] * 1e3, x["step_s"] * 1e3, x["estimated_step_s"] * 1e3])
        worst = max(ranks, key=lambda res: res[k]["train_step_s"])[k]
        key = k.replace(" ", "_")
        summary[f"{key}_per_critical_transfer_s"] = worst["per_critical_transfer_s"]
        summary[f"{key}_measured_over_estimated"] = worst["step_s"] / worst["estimated_step_s"]
    print(f"gpt-tiny {MODEL_KW} on 2 gloo ranks, pp2; medians of {args.steps} interleaved rounds; ms")
    print_table(["plan", "rank", "train_step", "chunks", "rest", "bubble", "critical", "per critical", "late",
                 "priced", "step+opt", "estimated"], rows)
    print(f"late: inputs asked for while their sender computes, each priced {ranks[0]['1f1b m2']['wakeup_s'] * 1e3:.2f} ms "
          "(the profile's p2p_wakeup_s) in the estimate")
    per = [ranks[0][k]["per_critical_transfer_s"] for k in PLANS] + [ranks[1][k]["per_critical_transfer_s"] for k in PLANS]
    priced = statistics.median(res[k]["priced_transfer_s"] for res in ranks for k in PLANS)
    sends = dict(ranks[0]["rendezvous"])
    post = {k: max(r["rendezvous"][k] for r in ranks) for k in ("post_median", "post_max")}
    for k in post:
        del sends[k]
    summary.update(per_critical_transfer_median_s=statistics.median(per), priced_transfer_median_s=priced,
                   **{f"send_{n}_bytes_receiver_late_s": s for n, s in sends.items()},
                   both_ranks_posting_median_s=post["post_median"], both_ranks_posting_max_s=post["post_max"],
                   wall_s=time.perf_counter() - t0)
    print(f"summary: a transfer on the critical path costs {summary['per_critical_transfer_median_s'] * 1e3:.2f} ms "
          f"in the step (median over plans and ranks; the wait for the other rank included) against "
          f"{priced * 1e3:.2f} ms priced (p2p + drift wait); measured / estimated step " + ", ".join(
              f"{k} {summary[k.replace(' ', '_') + '_measured_over_estimated']:.2f}" for k in PLANS)
          + f"; a send whose receiver posts {LATE_S * 1e3:g} ms late completes after "
          + " / ".join(f"{s * 1e3:.2f} ms ({int(n) >> 10} KiB)" for n, s in sends.items())
          + f"; posting two 64 KiB sends while the other rank posts its own takes {post['post_median'] * 1e3:.2f} ms "
          f"(median), {post['post_max'] * 1e3:.2f} ms at the slowest of {POSTS} (either rank)")
    write_json(args.json, {"summary": summary, "model": MODEL_KW, "ranks": ranks})


if __name__ == "__main__":
    main()
