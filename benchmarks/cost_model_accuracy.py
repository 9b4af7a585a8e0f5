"""Cost model vs reality on the local 2-rank gloo cluster: step time and per-rank memory of DP, ZeRO-3,
TP2, PP2 and the searched plan, predicted (gfx.estimate) vs measured, on two model sizes.

Inside the spawned world the cluster is profiled first (``Cluster.profile()``: fixed overheads,
collective bandwidths, p2p, overlap, matmul FLOP/s); the cost model runs in ``--mode profiled``
(layers timed on this CPU, fresh cache; the default on a profiled cluster) or ``analytic``. Every rank
builds the cost model at once (so layers are timed under the contention training sees: two ranks on
one host), rank 0's figures count: it estimates and searches (under a budget every baseline fits) and
broadcasts the plans. Beside the model's prediction each plan is also priced in the other mode and
without the overhead terms (the cluster's ``OVERHEAD_FIELDS`` and ``SYNC_FIELDS`` zeroed: the time model
before them).
Measured: median step time (``train_step`` + AdamW ``step()``, slowest rank) over interleaved rounds
after warm-up; states bytes exact (``states_bytes(opt)``); saved activations of one micro-batch's
forward (unique storages; for pp > 1 the pipeline's peak saved bytes).

    python benchmarks/cost_model_accuracy.py [--mode profiled|analytic] [--hidden 128 256] [--json PATH]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
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
    model_kw,
    plan_label,
    profiled_cluster,
    rel_err,
    saved_activation_bytes,
    spawn,
    time_plans,
    uniform,
)

BASELINE_SPECS = {  # label -> Plan.uniform keywords (2 devices)
    "dp": dict(),
    "zero3": dict(sdp="zero3"),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2, micro_batches=4, schedule="1f1b"),
}


def _rank(rank, world, overrides, mode, steps):
    import galvatron_fx as gfx
    from galvatron_fx.cluster import OVERHEAD_FIELDS, SYNC_FIELDS

    t0 = time.perf_counter()
    cluster = profiled_cluster()
    t_profile = time.perf_counter() - t0
    model, args, gm = build(overrides)
    gbs = args[0].shape[0]
    other = "analytic" if mode == "profiled" else "profiled"
    bare = dataclasses.replace(cluster, **{k: 0.0 for k in OVERHEAD_FIELDS + SYNC_FIELDS})
    plans, info = {}, {}
    with tempfile.TemporaryDirectory() as cache:
        def cost(m):
            return {"mode": m, "reserve_bytes": 0,
                    **({"cache_dir": cache, "profile_sizes": (2, 8, 16), "profile_repeats": 9} if m == "profiled" else {})}

        t1 = time.perf_counter()
        # NOTE: every rank times the layers at once (rank 0's figures count), as two ranks of one
        # host contend in training; only rank 0's plans run
        for label, kw in BASELINE_SPECS.items():
            plans[label] = uniform(gm, world, gbs, **kw)
        ests = {k: gfx.estimate(gm, p, cluster, **cost(mode)) for k, p in plans.items()}
        budget = max(max(e["memory_bytes_per_device"]) for e in ests.values())
        plans["searched"] = gfx.search(gm, cluster, budget, gbs, **cost(mode))
        ests["searched"] = gfx.estimate(gm, plans["searched"], cluster, **cost(mode))
        box = [None]
        if rank == 0:
            plan_dicts = {k: p.to_dict() for k, p in plans.items()}
            alt = {k: gfx.estimate(gm, p, cluster, **cost(other))["step_time_s"] for k, p in plans.items()}
            before = {k: gfx.estimate(gm, p, bare, **cost(mode))["step_time_s"] for k, p in plans.items()}
            info = {"budget_bytes": budget, "estimate_s": time.perf_counter() - t1, "alt": alt, "before": before}
            box = [(plan_dicts, ests, info)]
    dist.broadcast_object_list(box, src=0)
    plan_dicts, ests, info = box[0]
    plans = {k: gfx.Plan.from_dict(d) for k, d in plan_dicts.items()}

    models, times = time_plans(gm, plans, args, steps)
    out = {}
    for label, plan in plans.items():
        dm, opt = models[label]
        stage = getattr(dm, "stage_index", 0)
        states = dm.states_bytes(opt)["total"]  # NOTE: before the activation probe, which frees the gradients
        if plan.pp > 1:
            dm.track_memory = True   # after the timed steps: the probe costs a hook per saved tensor
            dm.train_step(*args)
            act = dm.schedule_stats["peak_saved_bytes"]
        else:
            act = saved_activation_bytes(dm, plan, args)
        est = ests[label]
        out[label] = {"plan": plan_label(plan), "stage": stage, "step_s": times[label],
                      "pred_step_s": est["step_time_s"], "states": states,
                      "pred_other_mode_step_s": info["alt"][label], "pred_no_overheads_step_s": info["before"][label],
                      "pred_states": est["per_device"]["states_bytes"][stage], "activation": act,
                      "pred_activation": est["per_device"]["activation_bytes"][stage]}
    return {"results": out, "cluster": cluster.to_dict(), "profile_s": t_profile, **info}


def _one_size(args, hidden: int) -> dict:
    overrides = {**model_kw(args), "hidden": hidden}
    t0 = time.perf_counter()
    ranks = spawn(_rank, 2, overrides, args.mode, args.steps)
    wall = time.perf_counter() - t0
    rows, results = [], {}
    for label in ranks[0]["results"]:
        per_rank = [r["results"][label] for r in ranks]
        r0 = per_rank[0]
        results[label] = {"per_rank": per_rank, "step_s": r0["step_s"], "pred_step_s": r0["pred_step_s"],
                          "step_err": rel_err(r0["pred_step_s"], r0["step_s"]),
                          "other_mode_err": rel_err(r0["pred_other_mode_step_s"], r0["step_s"]),
                          "no_overheads_err": rel_err(r0["pred_no_overheads_step_s"], r0["step_s"])}
        for rank, r in enumerate(per_rank):
            r["states_err"] = rel_err(r["pred_states"], r["states"])
            r["activation_err"] = rel_err(r["pred_activation"], r["activation"])
            v = results[label]
            rows.append([label if rank == 0 else "", rank, r["plan"] if rank == 0 else "",
                         r["pred_step_s"] * 1e3 if rank == 0 else "", r["step_s"] * 1e3 if rank == 0 else "",
                         f"{100 * v['step_err']:+.0f}%" if rank == 0 else "",
                         f"{100 * v['other_mode_err']:+.0f}%" if rank == 0 else "",
                         f"{100 * v['no_overheads_err']:+.0f}%" if rank == 0 else "",
                         r["pred_states"] / 2**10, r["states"] / 2**10, f"{100 * r['states_err']:+.1f}%",
                         r["pred_activation"] / 2**10, r["activation"] / 2**10,
                         f"{100 * r['activation_err']:+.0f}%"])
    other = "analytic" if args.mode == "profiled" else "profiled"
    print(f"\ngpt-tiny {overrides} on 2 gloo ranks; cost model mode {args.mode} on the profiled cluster; "
          f"search budget {ranks[0]['budget_bytes'] / 2**20:.2f} MiB; step = train_step + AdamW step, "
          f"median of {args.steps}")
    print_table(["plan", "rank", "strategy", "pred ms", "meas ms", "err", f"err {other}", "err no-ovh",
                 "pred states KiB", "meas KiB", "err", "pred act KiB", "meas KiB", "err"], rows)
    return {"overrides": overrides, "plans": results, "cluster": ranks[0]["cluster"],
            "budget_bytes": ranks[0]["budget_bytes"], "profile_s": ranks[0]["profile_s"], "wall_s": wall}


def _median_abs(xs: list[float]) -> float:
    return statistics.median(abs(x) for x in xs)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(hidden=None)
    p.add_argument("--hiddens", type=int, nargs="+", default=[128, 256], help="model sizes (hidden widths)")
    p.add_argument("--mode", choices=["profiled", "analytic"], default="profiled")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    sizes = {f"hidden{h}": _one_size(args, h) for h in args.hiddens}
    wall = time.perf_counter() - t0
    allp = [v for sz in sizes.values() for v in sz["plans"].values()]
    errs = [v["step_err"] for v in allp]
    st_exact = all(r["states"] == r["pred_states"] for v in allp for r in v["per_rank"])
    act_errs = [abs(r["activation_err"]) for v in allp for r in v["per_rank"]]
    summary = {"step_time_median_abs_err": _median_abs(errs), "step_time_max_abs_err": max(map(abs, errs)),
               "step_time_median_abs_err_other_mode": _median_abs([v["other_mode_err"] for v in allp]),
               "step_time_median_abs_err_no_overheads": _median_abs([v["no_overheads_err"] for v in allp]),
               "states_exact": st_exact, "activation_max_rel_err": max(act_errs), "cases": len(allp)}
    print(f"\nsummary: step time |error| median {100 * summary['step_time_median_abs_err']:.0f}% "
          f"(max {100 * summary['step_time_max_abs_err']:.0f}%; other mode "
          f"{100 * summary['step_time_median_abs_err_other_mode']:.0f}%, without the overhead terms "
          f"{100 * summary['step_time_median_abs_err_no_overheads']:.0f}%) over {len(allp)} plans x sizes, "
          f"states {'exact on every rank' if st_exact else 'NOT exact'}, activations |error| max "
          f"{100 * max(act_errs):.1f}%; run {wall:.0f} s")
    write_json(args.json, {"model": "gpt-tiny", "mode": args.mode, "sizes": sizes, "wall_s": wall,
                           "summary": summary})


if __name__ == "__main__":
    main()
