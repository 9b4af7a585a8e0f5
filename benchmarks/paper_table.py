"""The Galvatron paper's table: estimated throughput of every baseline and of galvatron_fx.

Eight workloads (bert-huge-32/48, vit-huge-32/48, t5-large-32/48, swin-huge-32/48) x per-device
memory budgets 8/12/16/20 GB on 8xRTX-TITAN-24GB (the paper's testbed) and 2x8xRTX-TITAN-24GB,
in fp32 as the paper trained (its scripts use no mixed precision; ``--precision`` to change).
Every method (the paper's DP, ZeRO-3, TP, PP, best 3D, DP+TP, DP+PP; the practitioners' ``megatron``,
``fsdp``, ``fsdp+tp``; galvatron_fx) chooses its own global batch size (powers of two up to --max-batch) for the best
throughput under the same cost model; "oom" where it cannot fit. Prints per cell the searched plan's
speedup over the best baseline and the geometric mean; ``--json`` writes a top-level ``summary``
(``geomean_speedup``, ``cells_below_best_baseline``, ``cells``).

    python benchmarks/paper_table.py [--models ...] [--clusters ...] [--budgets 8 12 16 20] [--json out.json]
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

import galvatron_fx as gfx  # noqa: E402
from galvatron_fx.planner import BASELINES, PRACTITIONER_BASELINES, baselines  # noqa: E402

MODELS = ["bert-huge-32", "bert-huge-48", "vit-huge-32", "vit-huge-48", "t5-large-32", "t5-large-48",
          "swin-huge-32", "swin-huge-48"]
CLUSTERS = ["8xRTX-TITAN-24GB", "2x8xRTX-TITAN-24GB"]


def cell(gm, cluster, budget_gb: int, max_batch: int, precision: str) -> dict:
    budget = f"{budget_gb}GB"
    cons = {"max_global_batch_size": max_batch}
    try:
        plan = gfx.search(gm, cluster, budget, None, constraints=cons, precision=precision)
        searched = {"throughput_samples_s": plan.estimate["throughput_samples_s"], "plan": plan.to_dict()}
    except gfx.InfeasibleError:
        searched = "oom"
    base = baselines(gm, cluster, budget, None, constraints=cons, precision=precision)
    return {"galvatron_fx": searched,
            "baselines": {k: v if v == "oom" else {"throughput_samples_s": v["throughput_samples_s"]}
                          for k, v in base.items()}}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--clusters", nargs="+", default=CLUSTERS)
    p.add_argument("--budgets", nargs="+", type=int, default=[8, 12, 16, 20], help="GB per device")
    p.add_argument("--max-batch", type=int, default=256, help="largest global batch any method may use")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                   help="training precision of every method (default fp32: what the paper used)")
    args = p.parse_args()
    cells, rows, ratios, worse, prac_ratios = [], [], [], [], []
    t0 = time.perf_counter()
    for model_name in args.models:
        model, example = gfx.models.build(model_name, device="meta")
        gm = gfx.capture(model, example, method="fx")
        for preset in args.clusters:
            cluster = gfx.Cluster.preset(preset)
            for gb in args.budgets:
                c = cell(gm, cluster, gb, args.max_batch, args.precision)
                c.update(model=model_name, cluster=preset, memory_budget_gb=gb)
                cells.append(c)
                fits = {k: v["throughput_samples_s"] for k, v in c["baselines"].items() if v != "oom"}
                best_name = max(fits, key=fits.get) if fits else None
                ours = c["galvatron_fx"]["throughput_samples_s"] if c["galvatron_fx"] != "oom" else None
                ratio = ours / fits[best_name] if ours and best_name else None
                prac = [fits[k] for k in PRACTITIONER_BASELINES if k in fits]
                if ours and prac:
                    prac_ratios.append(ours / max(prac))
                if ratio is not None:
                    ratios.append(ratio)
                    if ratio < 1 - 1e-9:
                        worse.append(f"{model_name}/{preset}/{gb}GB")
                rows.append([model_name, preset, gb] + [
                    f"{c['baselines'][k]['throughput_samples_s']:.2f}" if c["baselines"][k] != "oom" else "oom"
                    for k in BASELINES] + [f"{ours:.2f}" if ours else "oom",
                                           f"{ratio:.2f}x ({best_name})" if ratio else "-"])
                print(f"[paper_table] {model_name} {preset} {gb}GB done ({time.perf_counter() - t0:.0f}s)",
                      file=sys.stderr, flush=True)
    print_table(["model", "cluster", "GB"] + list(BASELINES) + ["galvatron_fx", "speedup vs best"], rows)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    print(f"summary: geometric-mean speedup over the best baseline {geo:.3f}x over {len(ratios)} cells; "
          f"cells where galvatron_fx < best baseline: {len(worse)} {worse if worse else ''}; "
          f"{time.perf_counter() - t0:.0f}s")
    prac_geo = math.exp(sum(math.log(r) for r in prac_ratios) / len(prac_ratios)) if prac_ratios else None
    print(f"summary: over the best practitioner baseline ({', '.join(PRACTITIONER_BASELINES)}): geometric mean "
          f"{prac_geo or float('nan'):.3f}x, min {min(prac_ratios, default=float('nan')):.3f}x over {len(prac_ratios)} cells")
    summary = {"geomean_speedup": geo, "cells_below_best_baseline": len(worse), "cells": len(ratios),
               "geomean_speedup_vs_practitioner": prac_geo, "min_speedup_vs_practitioner": min(prac_ratios, default=None)}
    write_json(args.json, {"summary": summary, "cells": cells, "geomean_speedup": geo, "worse_cells": worse,
                           "precision": args.precision})


if __name__ == "__main__":
    main()
