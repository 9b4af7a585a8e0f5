"""Context parallelism at long sequences: searched plans vs the best cp = 1 plan and a torchtitan-style
FSDP + TP + CP baseline (estimated), and a measured 2-rank check of the CP cost model.

Llama-3-8B and Llama-3-70B (transformers ``LlamaConfig``, built on the meta device: no weights, no
downloads; causal SDPA without a materialised mask, as flash attention runs it: ``attn_implementation``
``"sdpa_causal"``, transformers' SDPA function under a name with no mask function) captured with
dynamo at 32k / 128k / 256k / 512k tokens, global batch 8 sequences, bf16-mixed, the whole device
memory as budget, on each cluster:

* **searched**: ``gfx.search`` (context parallelism offered from :data:`galvatron_fx.planner.CP_MIN_SEQ`
  positions: ring and Ulysses, every degree dividing the devices and the sequence, per layer);
* **best cp = 1**: the same search with ``constraints={"cp": 1}`` ("no plan" where nothing fits:
  one sequence per device is already too many tokens);
* **torchtitan-style**: uniform layers, FSDP (ZeRO-3) + TP (within a node, with SP) + CP ring, activation checkpointing on every layer,
  no pipeline, every micro-batch count whose batch slices divide it; the best that fits by
  ``gfx.estimate``.

Measured part (on by default; ``--no-measure`` skips it, ``--measure-only`` runs it alone): a small
transformers Llama (``LlamaConfig`` from :data:`SMALL`: hidden 128, 4 heads, 2 key/value heads, 2
layers, vocabulary 256; seeded, no downloads; the same ``sdpa_causal`` attention) captured once with
dynamo at :data:`SMALL_SEQ` tokens, global batch :data:`SMALL_GBS`, fp32, on 2 gloo ranks of this
CPU under three uniform plans: DP2, DP2 + CP2 ring and DP2 + CP2 Ulysses. Per plan: the median step
(``train_step`` + AdamW, slowest rank, interleaved rounds after 2 warm-up rounds, as
``benchmarks/moe.py``) and the estimate of the profiled cost model on the profiled live cluster
(``Cluster.profile()``, layer costs profiled at 1 / 2 / 4 samples: what the search uses there).

Acceptance (reported in the summary): Llama-3-8B at 131072 and 262144 tokens on 8xH100-80GB with
global batch 8: the searched plan uses cp > 1 in some layer and is estimated faster than the best
cp = 1 plan (or cp = 1 finds none).

    python benchmarks/long_context.py [--models llama3-8b] [--seqs 131072 262144]
                                      [--clusters 8xH100-80GB] [--layers N] [--json PATH]
                                      [--no-measure | --measure-only] [--steps N]
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ckpt_word, parser, practitioner, print_table, token_batches, train_stepper, write_json  # noqa: E402
from _dist import interleaved, profiled_cluster, rel_err, spawn, uniform  # noqa: E402

GBS = 8
SEQS = (32768, 131072, 262144, 524288)
MODELS = {  # key -> LlamaConfig keywords (the released Llama-3 configs)
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),
}
NAMES = {"llama3-8b": "Llama-3-8B", "llama3-70b": "Llama-3-70B"}
ACCEPTANCE = [("llama3-8b", 131072, "8xH100-80GB"), ("llama3-8b", 262144, "8xH100-80GB")]


SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
"""The measured part's Llama: attention FLOPs about those of the linear layers at :data:`SMALL_SEQ`."""
SMALL_SEQ, SMALL_GBS = 512, 4
MEASURED = ("dp2", "dp2 cp2 ring", "dp2 cp2 ulysses")


def register_causal_sdpa() -> None:
    """Register ``attn_implementation="sdpa_causal"``: transformers' SDPA function under a name with
    no mask function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # NOTE: an attention name without a mask function: transformers then passes no mask and SDPA runs
    # is_causal (its default "sdpa" path materialises a [B, 1, S, S] mask: 17 GB per sample at 128k)
    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)


def capture(key: str, seq: int, layers: int | None):
    """The model on the meta device, captured with dynamo at ``seq`` positions (2 sequences)."""
    import transformers as tf

    import galvatron_fx as gfx

    register_causal_sdpa()
    kw = dict(MODELS[key], max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa_causal")
    if layers:
        kw["num_hidden_layers"] = min(layers, kw["num_hidden_layers"])
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="dynamo")


def torchtitan(gm, cluster, precision: str):
    """The best fitting torchtitan-style plan (module docstring) and its estimate, or ``(None, None)``."""
    import galvatron_fx as gfx

    world = cluster.world_size
    best = (None, None)
    for tp in (t for t in (1, 2, 4, 8) if t <= cluster.devices_per_node and world % t == 0):
        dp = world // tp
        for cp in (c for c in range(1, dp + 1) if dp % c == 0):
            for m in (m for m in range(1, GBS + 1) if GBS % m == 0 and (GBS // m) % (dp // cp) == 0):
                plan = gfx.Plan.uniform(gm, world, tp=tp, dp=dp, sdp="zero3", ckpt=True, sp=tp > 1,
                                        cp=cp, cp_kind="ring", micro_batches=m, global_batch_size=GBS,
                                        precision=precision)
                est = gfx.estimate(gm, plan, cluster)
                fits = max(est["memory_bytes_per_device"]) <= cluster.device_memory
                if fits and (best[1] is None or est["throughput_samples_s"] > best[1]["throughput_samples_s"]):
                    best = (plan, est)
    return best


def label(plan) -> str:
    """Short text of a plan: ``pp1 m8 | tp1 cp8u zero3 ckpt, tp8 sp ckpt`` (distinct layer strategies)."""
    kinds = []
    for lp in plan.layers:
        s = f"tp{lp.tp}" + (f" cp{lp.cp}{'u' if lp.cp_kind == 'ulysses' else ''}" if lp.cp > 1 else "") \
            + (f" {lp.sdp}" if lp.sdp != "none" else "") + (" sp" if lp.sp else "") + ckpt_word(lp.ckpt)
        if s not in kinds:
            kinds.append(s)
    return f"pp{plan.pp} m{plan.micro_batches} | " + ", ".join(kinds)


def one_case(gm, key: str, seq: int, preset: str) -> dict:
    """One row: searched, best cp = 1 and torchtitan-style on one cluster."""
    import galvatron_fx as gfx

    cluster = gfx.Cluster.preset(preset)
    row = {"model": key, "seq": seq, "cluster": preset, "layers": len(gm.meta["galvatron"].layers)}
    t0 = time.perf_counter()
    try:
        plan = gfx.search(gm, cluster=cluster, global_batch_size=GBS)
    except gfx.InfeasibleError as e:
        row.update(error="no plan fits", min_memory_gib=e.min_memory_bytes / 2**30,
                   search_s=time.perf_counter() - t0)
        return row
    row["search_s"] = time.perf_counter() - t0
    row["searched"] = plan.estimate["throughput_samples_s"]
    row["searched_plan"] = label(plan)
    row["cp_max"] = max(lp.cp for lp in plan.layers)
    row["cp_layers"] = sum(lp.cp > 1 for lp in plan.layers)
    row["cp_kinds"] = sorted({lp.cp_kind for lp in plan.layers if lp.cp > 1})
    try:
        cp1 = gfx.search(gm, cluster=cluster, global_batch_size=GBS, constraints={"cp": 1})
        row["cp1"], row["cp1_plan"] = cp1.estimate["throughput_samples_s"], label(cp1)
    except gfx.InfeasibleError as e:
        row["cp1_error"] = f"no plan ({e.min_memory_bytes / 2**30:.0f} GiB)"
    tplan, test = torchtitan(gm, cluster, plan.precision)
    if tplan is not None:
        row["torchtitan"], row["torchtitan_plan"] = test["throughput_samples_s"], label(tplan)
    row.update(practitioner(gm, cluster, GBS, plan.precision))
    for k in ("cp1", "torchtitan", "practitioner"):
        if k in row:
            row[f"speedup_vs_{k}"] = row["searched"] / row[k]
    return row


def run(models: list[str], seqs: list[int], clusters: list[str], layers: int | None) -> list[dict]:
    rows = []
    for key in models:
        for seq in seqs:
            t0 = time.perf_counter()
            try:
                gm = capture(key, seq, layers)
            except Exception as e:   # noqa: BLE001 - reported as the row's reason
                rows += [{"model": key, "seq": seq, "cluster": c, "error": f"{type(e).__name__}: {str(e)[:120]}"}
                         for c in clusters]
                continue
            capture_s = time.perf_counter() - t0
            for preset in clusters:
                row = one_case(gm, key, seq, preset)
                row["capture_s"] = capture_s
                rows.append(row)
                print(f"  {NAMES[key]} {seq // 1024}k on {preset}: "
                      + (row.get("searched_plan") or row["error"]), flush=True)
    return rows


def table(rows: list[dict]) -> None:
    out = []
    for r in rows:
        head = [NAMES[r["model"]], f"{r['seq'] // 1024}k", r["cluster"]]
        if "searched" not in r:
            why = r["error"] + (f" (least {r['min_memory_gib']:.0f} GiB)" if "min_memory_gib" in r else "")
            out.append(head + [""] * 7 + [why])
            continue
        kinds = "/".join(r["cp_kinds"]) or "-"
        out.append(head + [r["searched"], f"{r['cp_max']} {kinds}", r.get("cp1", r.get("cp1_error", "")),
                           r.get("torchtitan", "no plan"),
                           *(f"{r[k]:.3f}" if k in r else "-" for k in ("speedup_vs_cp1", "speedup_vs_torchtitan")),
                           f"{r['search_s']:.2f}", ""])
    print(f"\nestimated on the meta device (global batch {GBS} sequences, bf16-mixed, device memory): samples/s")
    print_table(["model", "seq", "cluster", "searched", "cp kind", "best cp=1", "torchtitan", "/cp1",
                 "/torchtitan", "search s", "note"], out)
    for r in rows:
        if "searched" in r:
            print(f"  {NAMES[r['model']]} {r['seq'] // 1024}k {r['cluster']}: searched [{r['searched_plan']}]; "
                  f"cp=1 [{r.get('cp1_plan', '-')}]; torchtitan [{r.get('torchtitan_plan', '-')}]; best practitioner "
                  f"without CP [{r.get('practitioner_plan', r.get('practitioner_error', '-'))}]"
                  + (f" (searched / it {r['speedup_vs_practitioner']:.3f})" if "speedup_vs_practitioner" in r else ""))


# ------------------------------------------------------------------------------ measured part
def _measure_rank(rank, world, steps):
    """On each rank: the median step of DP2, DP2 + CP2 ring and DP2 + CP2 Ulysses and their estimates."""
    import tempfile

    import transformers as tf

    import galvatron_fx as gfx

    register_causal_sdpa()
    cluster = profiled_cluster()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, max_position_embeddings=SMALL_SEQ, use_cache=False,
                                               attn_implementation="sdpa_causal"))
    batches = token_batches(4, SMALL["vocab_size"], SMALL_GBS, SMALL_SEQ)
    gm = gfx.capture(model, (), kwargs=batches[0], method="dynamo")
    plans = {"dp2": uniform(gm, world, SMALL_GBS, dp=world),
             "dp2 cp2 ring": uniform(gm, world, SMALL_GBS, dp=world, cp=2, cp_kind="ring"),
             "dp2 cp2 ulysses": uniform(gm, world, SMALL_GBS, dp=world, cp=2, cp_kind="ulysses")}
    steps_fn = {}
    for name, plan in plans.items():
        dm = gfx.transform(gm, plan=plan)
        steps_fn[name] = train_stepper(dm, dm.optimizer(torch.optim.AdamW, lr=1e-4), batches)
    with tempfile.TemporaryDirectory() as cache:
        cost = {"mode": "profiled", "reserve_bytes": 0, "cache_dir": cache, "profile_sizes": (1, 2, 4),
                "profile_repeats": 9}
        ests = {k: gfx.estimate(gm, p, cluster, **cost) for k, p in plans.items()}
    times = interleaved(steps_fn, steps)
    return {k: {"step_s": times[k], "pred_step_s": ests[k]["step_time_s"],
                "pred_memory_bytes": max(ests[k]["memory_bytes_per_device"])} for k in plans}


def measured(steps: int) -> dict:
    """The 2-rank measured steps vs the estimates, printed as a table."""
    t0 = time.perf_counter()
    res = spawn(_measure_rank, 2, steps)[0]
    res["wall_s"] = time.perf_counter() - t0
    base = res["dp2"]
    rows = [[k, v["pred_step_s"] * 1e3, v["step_s"] * 1e3, f"{v['step_s'] / v['pred_step_s']:.2f}",
             f"{100 * rel_err(v['pred_step_s'], v['step_s']):+.0f}%", f"{v['step_s'] / base['step_s']:.2f}",
             f"{v['pred_step_s'] / base['pred_step_s']:.2f}"] for k, v in res.items() if k in MEASURED]
    print(f"\nsmall Llama (hidden {SMALL['hidden_size']}, {SMALL['num_attention_heads']} heads / "
          f"{SMALL['num_key_value_heads']} kv, {SMALL['num_hidden_layers']} layers, vocab {SMALL['vocab_size']}) "
          f"on 2 gloo ranks, seq {SMALL_SEQ}, global batch {SMALL_GBS}, fp32; median of {steps} interleaved "
          f"steps (train_step + AdamW); profiled cluster and layers; {res['wall_s']:.0f} s")
    print_table(["plan", "est ms", "meas ms", "meas/est", "err", "meas/dp2", "est/dp2"], rows)
    return res


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def accepted(r: dict | None) -> bool | None:
    """The acceptance of one case: cp > 1 in some layer and faster than cp = 1 (or cp = 1 has none)."""
    if r is None or "searched" not in r:
        return None if r is None else False
    return r["cp_max"] > 1 and ("cp1" not in r or r["searched"] > r["cp1"])


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--seqs", nargs="+", type=int, default=list(SEQS), help="sequence lengths (tokens)")
    p.add_argument("--clusters", default="8xH100-80GB,4x8xH100-80GB", help="comma-separated cluster presets")
    p.add_argument("--layers", type=int, default=None, help="cap num_hidden_layers (default: the real count)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measured plan (after 2 warm-up rounds)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-measure", action="store_true", help="skip the measured 2-rank part")
    g.add_argument("--measure-only", action="store_true", help="run only the measured 2-rank part")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    meas = {} if args.no_measure else measured(args.steps)
    rows = [] if args.measure_only else run(args.models, args.seqs, args.clusters.split(","), args.layers)
    if rows:
        table(rows)
    ok = [r for r in rows if "searched" in r]

    def short(preset):   # "4x8xH100-80GB" -> "4x8", "8xH100-80GB" -> "8"
        return preset.rsplit("x", 1)[0]

    def case(r):
        return f"{r['model']}_{r['seq'] // 1024}k_{short(r['cluster'])}"
    summary: dict = {f"{case(r)}_speedup_vs_cp1": r.get("speedup_vs_cp1") for r in ok}
    summary.update({f"{case(r)}_speedup_vs_torchtitan": r.get("speedup_vs_torchtitan") for r in ok})
    find = {(r["model"], r["seq"], r["cluster"]): r for r in rows}
    for key, seq, preset in ACCEPTANCE if rows else ():   # none when --measure-only
        summary[f"acceptance_{key.replace('-', '_')}_{seq // 1024}k_{short(preset)}"] = accepted(find.get((key, seq, preset)))
    summary.update({
        "cases": len(rows), "cases_planned": len(ok), "cases_with_cp_gt_1": sum(r["cp_max"] > 1 for r in ok),
        "cases_cp1_no_plan": sum("cp1_error" in r for r in ok),
        "geomean_speedup_vs_cp1": geomean([r["speedup_vs_cp1"] for r in ok if "speedup_vs_cp1" in r]),
        "geomean_speedup_vs_torchtitan": geomean([r["speedup_vs_torchtitan"] for r in ok
                                                  if "speedup_vs_torchtitan" in r]),
        "cases_below_cp1_or_torchtitan": sum(min(r.get("speedup_vs_cp1", 1), r.get("speedup_vs_torchtitan", 1))
                                             < 1 - 1e-9 for r in ok),
        "geomean_speedup_vs_practitioner": geomean([r["speedup_vs_practitioner"] for r in ok
                                                    if "speedup_vs_practitioner" in r]),
        "min_speedup_vs_practitioner": min((r["speedup_vs_practitioner"] for r in ok
                                            if "speedup_vs_practitioner" in r), default=None),
        "cases_practitioner_no_plan": sum("practitioner_error" in r for r in ok),
        "search_s_max": max((r["search_s"] for r in ok), default=None),
        "layers_cap": args.layers})
    for k in MEASURED if meas else ():
        short_k = k.split()[-1]   # dp2, ring, ulysses
        summary[f"measured_over_estimated_{short_k}"] = meas[k]["step_s"] / meas[k]["pred_step_s"]
        if k != "dp2":
            summary[f"cp_{short_k}_over_dp2_measured"] = meas[k]["step_s"] / meas["dp2"]["step_s"]
            summary[f"cp_{short_k}_over_dp2_estimated"] = meas[k]["pred_step_s"] / meas["dp2"]["pred_step_s"]
    if meas:
        summary["measured_s"] = meas["wall_s"]
    summary["wall_s"] = time.perf_counter() - t0
    print(f"\nsummary: {summary}")
    write_json(args.json, {"global_batch_size": GBS, "rows": rows, "measured": meas,
                           "measured_model": dict(SMALL, seq=SMALL_SEQ, global_batch_size=SMALL_GBS),
                           "summary": summary})


if __name__ == "__main__":
    main()
