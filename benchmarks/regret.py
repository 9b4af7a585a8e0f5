"""Search regret over a sweep on the local 2-rank gloo cluster: per case (model x memory budget), the
searched plan's measured step time over the best measured plan that fits.

Per model (``--hiddens``: gpt-tiny widths), inside one spawned world: the cluster is profiled
(``Cluster.profile()``), every rank builds the cost model at once (``--mode profiled`` by default, the
default on a profiled cluster: layers timed on this CPU under the contention training sees; rank 0's
figures count), and rank 0 estimates the uniform plans of 2 devices -- pp1: tp1 x {none, zero2,
zero3} x ckpt and tp2 x sp x ckpt (1 micro-batch); pp2 (1F1B): ckpt x micro-batches {2, 4} -- and
searches one plan per budget (``--budget-fractions`` x the DP plan's estimated memory). Every
distinct plan (uniform or searched) is then measured once, interleaved with the others
(``train_step`` + AdamW step, slowest rank, medians), so a case's figures come from the same rounds.
A case's candidates are the uniform plans the cost model says fit its budget; its regret is
``searched / min(best fitting uniform, searched, measured)`` in measured step time (1.0 is perfect).
Each case is also searched with measured final selection (``measure=4``: the 4 best plans by
estimate and the baselines timed on the ranks, galvatron_fx/selection.py); that plan joins the
interleaved rounds and gets its own regret (``--measure 0``: off).

    python benchmarks/regret.py [--hiddens 64 128] [--budget-fractions 1.0 0.8 0.6 0.45] [--json PATH]
"""

from __future__ import annotations

import json
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
    gfx_step,
    interleaved,
    model_kw,
    plan_label,
    profiled_cluster,
    spawn,
    spearman,
    uniform,
)


def candidates(pp1_micro_batches=(1,), pp2_micro_batches=(2, 4)) -> list[dict]:
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


def _key(plan_d: dict) -> str:
    """A plan's identity for de-duplication (what runs, not its estimate)."""
    keep = ("pp", "schedule", "micro_batches", "global_batch_size", "stages", "layers", "precision")
    return json.dumps({k: plan_d[k] for k in keep}, sort_keys=True, default=list)


def _rank(rank, world, overrides, mode, steps, fractions, measure):
    import galvatron_fx as gfx

    cluster = profiled_cluster()
    model, args, gm = build(overrides)
    gbs = args[0].shape[0]
    with tempfile.TemporaryDirectory() as cache:
        cost = {"mode": mode, "reserve_bytes": 0}
        if mode == "profiled":
            cost.update(cache_dir=cache, profile_sizes=(1, 4, 16), profile_repeats=9)
        # NOTE: every rank prices the plans (and so times the layers) at once; rank 0's figures count
        plans, preds, mems = {}, {}, {}
        for kw in candidates():
            plan = uniform(gm, world, gbs, **kw)
            est = gfx.estimate(gm, plan, cluster, **cost)
            k = _key(plan.to_dict())
            plans[k], preds[k], mems[k] = plan.to_dict(), est["step_time_s"], max(est["memory_bytes_per_device"])
        uniform_keys = list(plans)
        dp_memory = mems[_key(uniform(gm, world, gbs).to_dict())]
        cases, search_s = [], []
        for f in fractions:
            budget = int(f * dp_memory)
            t0 = time.perf_counter()
            try:
                searched = gfx.search(gm, cluster, budget, gbs, **cost)
            except gfx.InfeasibleError:
                cases.append({"fraction": f, "budget": budget, "searched": None})
                continue
            search_s.append(time.perf_counter() - t0)
            chosen = gfx.search(gm, cluster, budget, gbs, measure=measure, **cost) if measure else searched
            keys = []
            for plan in (searched, chosen):
                k = _key(plan.to_dict())
                keys.append(k)
                if k not in plans:
                    est = gfx.estimate(gm, plan, cluster, **cost)
                    plans[k], preds[k], mems[k] = plan.to_dict(), est["step_time_s"], max(est["memory_bytes_per_device"])
            cases.append({"fraction": f, "budget": budget, "searched": keys[0], "measured": keys[1],
                          "fitting": [u for u in uniform_keys if mems[u] <= budget],
                          "selection": chosen.extra.get("measured", [])})
    box = [{"plans": plans, "preds": preds, "mems": mems, "cases": cases, "dp_memory": dp_memory,
            "uniform": uniform_keys, "search_s": search_s}] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    info = box[0]
    needed = sorted({k for c in info["cases"] if c["searched"]
                     for k in [c["searched"], c["measured"], *c["fitting"]]})
    step_fns = {}
    for k in needed:
        dm = gfx.transform(gm, plan=gfx.Plan.from_dict(info["plans"][k]))
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-4)
        step_fns[k] = gfx_step(dm, opt, args)
    info["measured"] = interleaved(step_fns, steps)
    return info


def _model_cases(args, hidden: int) -> tuple[list[dict], dict]:
    import galvatron_fx as gfx

    overrides = {**model_kw(args), "hidden": hidden}
    res = spawn(_rank, 2, overrides, args.mode, args.steps, args.budget_fractions, args.measure)[0]
    meas, preds, mems = res["measured"], res["preds"], res["mems"]
    label = {k: plan_label(gfx.Plan.from_dict(d)) for k, d in res["plans"].items()}
    out = []
    print(f"\ngpt-tiny {overrides}: DP's estimated memory {res['dp_memory'] / 2**20:.2f} MiB; "
          f"{len(meas)} distinct plans measured (train_step + AdamW, median of {args.steps})")
    rows = [[label[k], mems[k] / 2**20, preds[k] * 1e3, meas[k] * 1e3 if k in meas else "-"]
            for k in sorted(res["plans"], key=lambda k: meas.get(k, float("inf")))]
    print_table(["plan", "pred MiB", "pred ms", "meas ms"], rows)
    for c in res["cases"]:
        name = f"hidden{hidden} @ {c['fraction']:.2f} x DP"
        if c["searched"] is None:
            out.append({"case": name, "budget_bytes": c["budget"], "infeasible": True})
            continue
        pool = [*c["fitting"], c["searched"], c["measured"]]
        best = min(pool, key=lambda k: meas[k])
        uni = c["fitting"]
        rho = spearman([preds[k] for k in uni], [meas[k] for k in uni]) if len(uni) > 2 else float("nan")
        out.append({"case": name, "budget_bytes": c["budget"], "searched": label[c["searched"]],
                    "searched_step_s": meas[c["searched"]], "searched_pred_s": preds[c["searched"]],
                    "best": label[best], "best_step_s": meas[best], "fitting_uniform": len(uni),
                    "regret": meas[c["searched"]] / meas[best], "spearman": rho,
                    "measured": label[c["measured"]], "measured_step_s": meas[c["measured"]],
                    "measured_regret": meas[c["measured"]] / meas[best],
                    "selection": c["selection"]})   # the measured selection's candidates and rounds
    return out, {"overrides": overrides, "dp_memory_bytes": res["dp_memory"], "search_s": res["search_s"],
                 "plans": [{"plan": label[k], "pred_s": preds[k], "pred_memory": mems[k], "measured_s": meas.get(k)}
                           for k in res["plans"]]}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    add_model_args(p, steps=5)
    p.add_argument("--hiddens", type=int, nargs="+", default=[64, 128], help="model sizes (hidden widths)")
    p.add_argument("--mode", choices=["profiled", "analytic"], default="profiled")
    p.add_argument("--measure", type=int, default=4, help="measured final selection's K (0: off)")
    p.add_argument("--budget-fractions", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.45],
                   help="budgets, x the DP plan's estimated memory")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cases, models = [], {}
    for h in args.hiddens:
        c, m = _model_cases(args, h)
        cases += c
        models[f"hidden{h}"] = m
    wall = time.perf_counter() - t0
    done = [c for c in cases if not c.get("infeasible")]
    print()
    print_table(["case", "searched", "meas ms", "best measured", "meas ms", "fitting", "regret", "Spearman",
                 "measured sel.", "regret"],
                [[c["case"], c["searched"], c["searched_step_s"] * 1e3, c["best"], c["best_step_s"] * 1e3,
                  c["fitting_uniform"], c["regret"], c["spearman"], c["measured"], c["measured_regret"]]
                 for c in done])
    regrets = [c["regret"] for c in done]
    chosen = [c["measured_regret"] for c in done]
    summary = {"regret_max": max(regrets), "regret_median": statistics.median(regrets),
               "cases_within_5pct_fraction": sum(r <= 1.05 for r in regrets) / len(regrets),
               "measured_regret_max": max(chosen), "measured_regret_median": statistics.median(chosen),
               "measured_within_5pct_fraction": sum(r <= 1.05 for r in chosen) / len(chosen),
               "cases": len(done), "infeasible_cases": len(cases) - len(done)}
    print(f"summary: {len(done)} cases; estimate only: regret median {summary['regret_median']:.3f}, max "
          f"{summary['regret_max']:.3f}, within 5 % in {100 * summary['cases_within_5pct_fraction']:.0f} %; "
          f"measured selection (K={args.measure}): median {summary['measured_regret_median']:.3f}, max "
          f"{summary['measured_regret_max']:.3f}, within 5 % in {100 * summary['measured_within_5pct_fraction']:.0f} %"
          f"; cost model {args.mode} on the profiled cluster; run {wall:.0f} s")
    write_json(args.json, {"model": "gpt-tiny", "mode": args.mode, "cases": cases, "models": models,
                           "wall_s": wall, "summary": summary})


if __name__ == "__main__":
    main()
