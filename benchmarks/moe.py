"""Expert parallelism: searched plans vs the best ep = 1 plan and a Megatron-style EP baseline, and a
measured 2-rank check of the EP cost model.

Part 1 (searched, meta device, seq 4096, global batch 64, bf16-mixed): Mixtral-8x7B, a
Qwen2-MoE-A2.7B class model and a DeepSeek-V2-Lite class model (transformers configs, captured
with dynamo) on each cluster: the searched plan (``gfx.search``), the best plan restricted to
``ep = 1`` (``constraints={"ep": 1}``) and a Megatron-style EP baseline: uniform layers, pp = nodes,
1F1B, tp in {1, 2} for attention, ep the largest divisor of dp and of the expert count up to 8 (one
node), recomputation off / on, ZeRO none / zero2 (the nearest to Megatron's distributed optimizer),
every micro-batch count giving each DP rank whole samples; the best that fits by ``gfx.estimate``.
A model that fails to capture or whose experts are not recognised is a row with the reason; a case
where nothing fits shows the least memory any plan needs.

Part 2 (measured, 2 gloo ranks on this CPU): the tiny transformers Mixtral of the loop tests
(``tests/loops.moe("mixtral")``) under DP2 and DP2+EP2 (both token dispatches): the median step
(``train_step`` + AdamW, slowest rank, interleaved) vs the profiled cost model's estimate.

    python benchmarks/moe.py [--layers N] [--models mixtral qwen2moe] [--clusters 8xH100-80GB]
                             [--skip-measured] [--json PATH]
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, plan_text, practitioner, print_table, train_stepper, write_json  # noqa: E402
from _dist import interleaved, profiled_cluster, rel_err, spawn, uniform  # noqa: E402

SEQ, GBS = 4096, 64
MODELS = {  # key -> (config class, model class, config keywords)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, decoder_sparse_step=1)),
    "deepseekv2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        moe_intermediate_size=1408, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128)),
}
NAMES = {"mixtral": "Mixtral-8x7B", "qwen2moe": "Qwen2-MoE-A2.7B", "deepseekv2": "DeepSeek-V2-Lite"}


def capture(key: str, layers: int | None):
    """``(gm, experts per MoE layer)`` of a model on the meta device; raises with the reason."""
    import transformers as tf

    import galvatron_fx as gfx
    from galvatron_fx.sharding.experts import MoEBlock, expert_layers, layer_blocks

    cfg_name, cls_name, kw = MODELS[key]
    if not hasattr(tf, cfg_name):
        raise RuntimeError(f"transformers {tf.__version__} has no {cfg_name}")
    kw = dict(kw, max_position_embeddings=SEQ, use_cache=False)
    if layers:
        kw["num_hidden_layers"] = min(layers, kw["num_hidden_layers"])
    with torch.device("meta"):
        model = getattr(tf, cls_name)(getattr(tf, cfg_name)(**kw))
    ids = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    gm = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="dynamo")
    if not expert_layers(gm):
        blocks = [b for bs in layer_blocks(gm).values() for b in bs]
        raise RuntimeError("experts not recognised" + (f": {blocks[0]}" if blocks else ""))
    experts = {b.num_experts for bs in layer_blocks(gm).values() for b in bs if isinstance(b, MoEBlock)}
    return gm, max(experts)


def megatron(gm, cluster, experts: int, precision: str):
    """The best fitting Megatron-style EP plan (module docstring) and its estimate, or ``(None, None)``."""
    import galvatron_fx as gfx

    world, pp = cluster.world_size, cluster.nodes
    best = (None, None)
    for tp in (1, 2):
        dp = world // (pp * tp)
        ep = max(e for e in range(1, min(8, dp) + 1) if dp % e == 0 and experts % e == 0)
        for m in (m for m in range(pp, GBS + 1) if GBS % m == 0 and (GBS // m) % dp == 0):
            for ckpt in (False, True):
                for sdp in ("none", "zero2"):
                    plan = gfx.Plan.uniform(gm, world, tp=tp, dp=dp, pp=pp, sdp=sdp, ckpt=ckpt, micro_batches=m,
                                            schedule="1f1b", global_batch_size=GBS, ep=ep, precision=precision)
                    est = gfx.estimate(gm, plan, cluster)
                    fits = max(est["memory_bytes_per_device"]) <= cluster.device_memory
                    if fits and (best[1] is None or est["throughput_samples_s"] > best[1]["throughput_samples_s"]):
                        best = (plan, est)
    return best


def ep_of(plan) -> tuple[int, str]:
    """The largest ep over the plan's layers and the dispatches the cost model chose."""
    ep = max(lp.ep for lp in plan.layers)
    dispatch = sorted({lp.extra["ep_dispatch"] for lp in plan.layers if lp.ep > 1 and "ep_dispatch" in lp.extra})
    return ep, "/".join(dispatch) or "-"



def searched(models: list[str], clusters: list[str], layers: int | None) -> list[dict]:
    """Part 1: one row per model x cluster."""
    import galvatron_fx as gfx

    rows = []
    for key in models:
        t0 = time.perf_counter()
        try:
            gm, experts = capture(key, layers)
        except Exception as e:   # noqa: BLE001 - reported as the row's reason
            rows += [{"model": key, "cluster": c, "error": f"{type(e).__name__}: {str(e)[:120]}"} for c in clusters]
            continue
        capture_s = time.perf_counter() - t0
        for preset in clusters:
            cluster = gfx.Cluster.preset(preset)
            row = {"model": key, "cluster": preset, "layers": len(gm.meta["galvatron"].layers), "experts": experts,
                   "capture_s": capture_s}
            t0 = time.perf_counter()
            try:
                plan = gfx.search(gm, cluster=cluster, global_batch_size=GBS)
            except gfx.InfeasibleError as e:
                row.update(error="no plan fits", min_memory_gib=e.min_memory_bytes / 2**30)
                rows.append(row)
                continue
            row["search_s"] = time.perf_counter() - t0
            row["ep"], row["dispatch"] = ep_of(plan)
            row["searched"] = plan.estimate["throughput_samples_s"]
            row["searched_plan"] = plan_text(plan)
            try:
                ep1 = gfx.search(gm, cluster=cluster, global_batch_size=GBS, constraints={"ep": 1})
                row["ep1"], row["ep1_plan"] = ep1.estimate["throughput_samples_s"], plan_text(ep1)
            except gfx.InfeasibleError as e:
                row["ep1_error"] = f"no plan fits ({e.min_memory_bytes / 2**30:.1f} GiB)"
            mplan, mest = megatron(gm, cluster, experts, plan.precision)
            if mplan is not None:
                row["megatron"], row["megatron_plan"] = mest["throughput_samples_s"], plan_text(mplan)
            row.update(practitioner(gm, cluster, GBS, plan.precision))
            for k in ("ep1", "megatron", "practitioner"):
                if k in row:
                    row[f"speedup_vs_{k}"] = row["searched"] / row[k]
            rows.append(row)
            print(f"  {key} on {preset}: searched {plan_text(plan)}", flush=True)
    return rows


def table(rows: list[dict]) -> None:
    """Print part 1's table, then each case's plans."""
    out = []
    for r in rows:
        head = [NAMES[r["model"]], r["cluster"]]
        if "searched" not in r:
            why = r["error"] + (f" (least memory {r['min_memory_gib']:.1f} GiB)" if "min_memory_gib" in r else "")
            out.append(head + [""] * 7 + [why])
            continue
        out.append(head + [r["searched"], f"{r['ep']} {r['dispatch']}", r.get("ep1", ""), r.get("megatron", ""),
                           *(f"{r[k]:.3f}" if k in r else "" for k in ("speedup_vs_ep1", "speedup_vs_megatron")),
                           f"{r['search_s']:.2f}",
                           r.get("ep1_error", "") or ("" if "megatron" in r else "no Megatron-EP plan fits")])
    print(f"\nsearched on the meta device (seq {SEQ}, global batch {GBS}, bf16-mixed, device memory): samples/s")
    print_table(["model", "cluster", "searched", "ep dispatch", "best ep=1", "Megatron-EP", "/ep1", "/Megatron",
                 "search s", "note"], out)
    for r in rows:
        if "searched" in r:
            print(f"  {NAMES[r['model']]} {r['cluster']}: searched [{r['searched_plan']}]; ep=1 "
                  f"[{r.get('ep1_plan', '-')}]; Megatron-EP [{r.get('megatron_plan', '-')}]; best practitioner "
                  f"[{r.get('practitioner_plan', r.get('practitioner_error', '-'))}] "
                  f"{_ratio(r, 'speedup_vs_practitioner')}")


# ------------------------------------------------------------------------------ part 2: measured
def _rank(rank, world, steps):
    """On each rank: median step of DP2 and DP2+EP2 (allgather, alltoall) and their estimates."""
    import galvatron_fx as gfx
    from galvatron_fx.planner import cost_model_for
    from galvatron_fx.runtime.experts import ExpertParallel
    from tests import loops

    cluster = profiled_cluster()
    batches = loops.collate(4)
    gm = gfx.capture(loops.moe("mixtral"), (), kwargs=batches[0], method="dynamo")
    plans = {"dp2": uniform(gm, world, loops.B, dp=world), "dp2 ep2": uniform(gm, world, loops.B, dp=world, ep=2)}
    variants = {"dp2": ("dp2", None), "dp2 ep2 allgather": ("dp2 ep2", "allgather"),
                "dp2 ep2 alltoall": ("dp2 ep2", "alltoall")}
    steps_fn = {}
    for name, (plan_key, dispatch) in variants.items():
        dm = gfx.transform(gm, plan=plans[plan_key])
        for m in dm.modules():
            if isinstance(m, ExpertParallel):
                m.dispatch = dispatch
        steps_fn[name] = train_stepper(dm, dm.optimizer(torch.optim.AdamW, lr=1e-4), batches)
    with tempfile.TemporaryDirectory() as cache:
        cost = {"mode": "profiled", "reserve_bytes": 0, "cache_dir": cache, "profile_sizes": (1, 2, 4),
                "profile_repeats": 9}
        ests = {k: gfx.estimate(gm, p, cluster, **cost) for k, p in plans.items()}
        lp = next(lp for lp in plans["dp2 ep2"].layers if lp.ep > 1)   # the dispatch the estimate priced
        n = loops.B / plans["dp2 ep2"].micro_batches / lp.dp
        chosen = cost_model_for(gm, cluster, **cost).ep_dispatch(plans["dp2 ep2"].layers.index(lp), n, lp.strategy)[0]
    times = interleaved(steps_fn, steps)
    return {name: {"step_s": times[name], "pred_step_s": ests[plan_key]["step_time_s"],
                   "chosen_dispatch": chosen}
            for name, (plan_key, _) in variants.items()}


def measured(steps: int) -> dict:
    """Part 2: the 2-rank measured steps vs the estimates."""
    t0 = time.perf_counter()
    res = spawn(_rank, 2, steps)[0]
    rows = [[k, v["pred_step_s"] * 1e3, v["step_s"] * 1e3, f"{v['step_s'] / v['pred_step_s']:.2f}",
             f"{100 * rel_err(v['pred_step_s'], v['step_s']):+.0f}%"] for k, v in res.items()]
    print(f"\ntiny Mixtral (tests/loops.moe) on 2 gloo ranks, global batch 12; median of {steps} interleaved "
          f"steps; {time.perf_counter() - t0:.0f} s")
    print_table(["plan", "est ms", "meas ms", "meas/est", "err"], rows)
    return res


def _ratio(r: dict, key: str) -> str:
    return f"(searched / it {r[key]:.3f})" if key in r else ""


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="cap num_hidden_layers (default: the real count)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--clusters", default="8xH100-80GB,4x8xH100-80GB", help="comma-separated cluster presets")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measured variant")
    p.add_argument("--skip-measured", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    meas = {} if args.skip_measured else measured(args.steps)
    rows = searched(args.models, args.clusters.split(","), args.layers)
    table(rows)
    ok = [r for r in rows if "searched" in r]

    def short(preset):   # "4x8xH100-80GB" -> "4x8", "8xH100-80GB" -> "8"
        return preset.rsplit("x", 1)[0]
    summary = {f"{r['model']}_{short(r['cluster'])}_speedup_vs_ep1": r.get("speedup_vs_ep1") for r in ok}
    summary.update({
        "cases": len(rows), "cases_planned": len(ok), "cases_with_ep_gt_1": sum(r["ep"] > 1 for r in ok),
        "geomean_speedup_vs_ep1": geomean([r["speedup_vs_ep1"] for r in ok if "speedup_vs_ep1" in r]),
        "geomean_speedup_vs_megatron_ep": geomean([r["speedup_vs_megatron"] for r in ok if "speedup_vs_megatron" in r]),
        "cases_below_ep1_or_megatron": sum(min(r.get("speedup_vs_ep1", 1), r.get("speedup_vs_megatron", 1)) < 1 - 1e-9
                                           for r in ok),
        "geomean_speedup_vs_practitioner": geomean([r["speedup_vs_practitioner"] for r in ok
                                                    if "speedup_vs_practitioner" in r]),
        "min_speedup_vs_practitioner": min((r["speedup_vs_practitioner"] for r in ok
                                            if "speedup_vs_practitioner" in r), default=None),
        "search_s_max": max((r["search_s"] for r in ok), default=None),
        "layers_cap": args.layers})
    for k in ("dp2", "dp2 ep2 allgather", "dp2 ep2 alltoall"):
        if k in meas:
            summary[f"measured_over_estimated_{k.replace('dp2 ', '').replace(' ', '_')}"] = \
                meas[k]["step_s"] / meas[k]["pred_step_s"]
    if meas:
        chosen = meas["dp2 ep2 allgather"]["chosen_dispatch"]   # the dispatch the estimate priced
        summary["measured_over_estimated_ep2"] = summary[f"measured_over_estimated_ep2_{chosen}"]
        summary["estimated_ep2_dispatch"] = chosen
    print(f"\nsummary: {summary}")
    write_json(args.json, {"seq_len": SEQ, "global_batch_size": GBS, "searched": rows, "measured": meas,
                           "summary": summary})


if __name__ == "__main__":
    main()
