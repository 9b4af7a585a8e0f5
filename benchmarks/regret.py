"""Search regret on the local 2-rank gloo cluster: the searched plan's measured step time over the best
measured uniform plan, under a memory budget where plain DP does not fit.

Inside the spawned world the cluster is profiled (``Cluster.profile()``) and rank 0 builds the cost
model (``--mode profiled`` by default: layers timed on this CPU). The budget is ``--budget-fraction``
(0.75) x the DP baseline's estimated per-device memory. Candidates: the uniform plans the search
considers on 2 devices -- pp1 x micro-batches {1, 2}: tp1 x {none, zero2, zero3} x ckpt, tp2 x ckpt
x sp; pp2 (1F1B): ckpt x micro-batches {2, 4, 8} -- those the cost model says fit, plus the searched
plan. All are measured (``train_step`` + AdamW step, slowest rank, interleaved rounds, medians).
Reports the regret (searched / best measured) and the cost model's ranking vs the measured one
(Spearman, top-1).

    python benchmarks/regret.py [--mode profiled|analytic] [--budget-fraction 0.75] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import (  # noqa: E402
    add_model_args,
    build,
    gfx_step,
    interleaved,
    model_kw,
    plan_label,
    profiled_cluster,
    spawn,
    spearman,
    uniform,
)


def candidates(pp1_micro_batches=(1, 2), pp2_micro_batches=(2, 4, 8)) -> list[dict]:
    """Plan.uniform keywords of the uniform plans on 2 devices."""
    out = []
    for ckpt in (False, True):
        for m in pp1_micro_batches:
            for sdp in ("none", "zero2", "zero3"):
                out.append(dict(tp=1, sdp=sdp, ckpt=ckpt, micro_batches=m))
            for sp in (False, True):
                out.append(dict(tp=2, sp=sp, ckpt=ckpt, micro_batches=m))
        for m in pp2_micro_batches:
            out.append(dict(pp=2, micro_batches=m, schedule="1f1b", ckpt=ckpt))
    return out


def _rank(rank, world, overrides, mode, steps, fraction):
    import galvatron_fx as gfx

    cluster = profiled_cluster()
    model, args, gm = build(overrides)
    gbs = args[0].shape[0]
    box = [None]
    if rank == 0:
        with tempfile.TemporaryDirectory() as cache:
            cost = {"mode": mode, "reserve_bytes": 0}
            if mode == "profiled":
                cost.update(cache_dir=cache, profile_sizes=(2, 8, 16))
            dp = gfx.estimate(gm, uniform(gm, world, gbs), cluster, **cost)
            budget = int(fraction * max(dp["memory_bytes_per_device"]))
            rows = []
            for kw in candidates():
                plan = uniform(gm, world, gbs, **kw)
                est = gfx.estimate(gm, plan, cluster, **cost)
                rows.append((plan.to_dict(), est["step_time_s"], max(est["memory_bytes_per_device"])))
            t0 = time.perf_counter()
            searched = gfx.search(gm, cluster, budget, gbs, **cost)
            search_s = time.perf_counter() - t0
            est = gfx.estimate(gm, searched, cluster, **cost)
            rows.append((searched.to_dict(), est["step_time_s"], max(est["memory_bytes_per_device"])))
        box = [{"budget": budget, "dp_memory": max(dp["memory_bytes_per_device"]), "rows": rows,
                "search_s": search_s}]
    dist.broadcast_object_list(box, src=0)
    info = box[0]
    fits = [(i, r) for i, r in enumerate(info["rows"]) if r[2] <= info["budget"]]
    step_fns = {}
    for i, (plan_d, _, _) in fits:
        dm = gfx.transform(gm, plan=gfx.Plan.from_dict(plan_d))
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-4)
        step_fns[i] = gfx_step(dm, opt, args)
    times = interleaved(step_fns, steps)
    return {**info, "measured": times}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--mode", choices=["profiled", "analytic"], default="profiled")
    p.add_argument("--budget-fraction", type=float, default=0.75, help="x the DP baseline's estimated memory")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = spawn(_rank, 2, model_kw(args), args.mode, args.steps, args.budget_fraction)[0]
    wall = time.perf_counter() - t0
    import galvatron_fx as gfx

    n = len(res["rows"])
    searched_i = n - 1
    entries = []
    for i, (plan_d, pred, mem) in enumerate(res["rows"]):
        plan = gfx.Plan.from_dict(plan_d)
        meas = res["measured"].get(i)
        entries.append({"label": ("searched: " if i == searched_i else "") + plan_label(plan), "pred_s": pred,
                        "pred_memory": mem, "fits": mem <= res["budget"], "measured_s": meas, "plan": plan_d})
    measured = [e for e in entries if e["measured_s"] is not None]
    pred_rank = {id(e): k + 1 for k, e in enumerate(sorted(measured, key=lambda e: e["pred_s"]))}
    meas_rank = {id(e): k + 1 for k, e in enumerate(sorted(measured, key=lambda e: e["measured_s"]))}
    rows = []
    for e in sorted(entries, key=lambda e: (e["measured_s"] is None, e["measured_s"] or 0)):
        e["pred_rank"], e["measured_rank"] = pred_rank.get(id(e)), meas_rank.get(id(e))
        rows.append([e["label"], e["pred_memory"] / 2**20, "yes" if e["fits"] else "oom", e["pred_s"] * 1e3,
                     e["measured_s"] * 1e3 if e["measured_s"] else "-", e["pred_rank"] or "-",
                     e["measured_rank"] or "-"])
    best = min(measured, key=lambda e: e["measured_s"])
    searched = entries[searched_i]
    regret = searched["measured_s"] / best["measured_s"]
    uni = [e for e in measured if e is not searched]
    rho = spearman([e["pred_s"] for e in uni], [e["measured_s"] for e in uni])
    top1 = min(uni, key=lambda e: e["pred_s"]) is min(uni, key=lambda e: e["measured_s"])
    print(f"gpt-tiny {model_kw(args)} on 2 gloo ranks; cost model {args.mode} on the profiled cluster; "
          f"budget {res['budget'] / 2**20:.2f} MiB = {args.budget_fraction} x DP's "
          f"{res['dp_memory'] / 2**20:.2f} MiB; iteration incl. AdamW, median of {args.steps}")
    print_table(["plan", "pred MiB", "fits", "pred ms", "meas ms", "pred rank", "meas rank"], rows)
    print(f"summary: regret {regret:.2f} (searched {searched['measured_s'] * 1e3:.1f} ms vs best measured "
          f"{best['label']} {best['measured_s'] * 1e3:.1f} ms); Spearman {rho:.2f} over {len(uni)} feasible "
          f"uniform plans, predicted best {'is' if top1 else 'is not'} measured best; "
          f"search {res['search_s']:.2f} s, run {wall:.0f} s")
    write_json(args.json, {"model": "gpt-tiny", "overrides": model_kw(args), "mode": args.mode,
                           "budget_bytes": res["budget"], "dp_memory_bytes": res["dp_memory"],
                           "plans": entries,
                           "regret": regret, "spearman": rho, "top1_agrees": top1, "wall_s": wall,
                           # NOTE: one case (one model x one budget) per run so far: the sweep of the
                           # performance issue is not built; the figures below are over that one case
                           "summary": {"regret_max": regret, "regret_median": regret,
                                       "cases_within_5pct_fraction": float(regret <= 1.05), "cases": 1,
                                       "spearman": rho}})


if __name__ == "__main__":
    main()
