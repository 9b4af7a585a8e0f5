"""Memory knobs searched per layer: selective activation checkpointing, HSDP and CPU offload, each
off vs searched (estimated), activation offload where asked for, and a measured 2-rank check of
selective checkpointing's step time and bytes against the cost model.

Estimated part: transformers configs built on the meta device (no weights, no downloads), captured
with dynamo, bf16-mixed, the whole device memory as budget (and each device's share of its node's
host memory for offload). Each case is searched with the same cost model **without the knobs**
(``ckpt`` only false / true, no HSDP, no offload: the space before them), **searched** (every knob
per layer) and with **one knob off** at a time (what that knob adds), and searched with activation
offload asked for too (constraint ``act_offload: true``: it is not in the default space). Cases:

* Llama-3-8B on 8xH100-80GB, 8192 tokens, global batch 16;
* Llama-3-70B on 8x8 and 128x8 H100-80GB, 8192 tokens, global batch 64 / 1024;
* Mixtral-8x7B on 8xH100-80GB, 4096 tokens, global batch 64 ("no plan" where nothing fits).

And the memory of one uniform Llama-3-8B layout at 8192 tokens (tp1·dp8·zero3, 2 sequences per
device per micro-batch) under each mode: what the model says selective saves between none and full.

Measured part (``--no-measure`` skips it): a small transformers Llama (:data:`SMALL`) on gloo ranks
of this CPU, fp32 (:data:`MEASURED`): on 2 ranks three uniform DP2 plans (no checkpointing,
selective, full), on 4 ranks ZeRO-3 over DP4, HSDP (shard 2) and offload. Per plan: the median step
(``train_step`` + AdamW, slowest rank, interleaved rounds after 2 warm-up rounds), the profiled cost
model's estimate on the profiled live cluster, one micro-batch's activation bytes on rank 0
(autograd's saved tensors plus what the selective regions keep) and rank 0's device / host state
bytes, each against the estimate. (This CPU is its own host: offload's copies stay in its memory.)

    python benchmarks/memory_knobs.py [--cases llama3-8b_8 ...] [--no-measure] [--steps N] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, plan_text, print_table, token_batches, train_stepper, write_json  # noqa: E402
from _dist import interleaved, profiled_cluster, rel_err, spawn, uniform  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
MIXTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
CASES = {  # name -> (config class, keywords, tokens, cluster, global batch)
    "llama3-8b_8": ("LlamaConfig", LLAMA3_8B, 8192, "8xH100-80GB", 16),
    "llama3-70b_8x8": ("LlamaConfig", LLAMA3_70B, 8192, "8x8xH100-80GB", 64),
    "llama3-70b_128x8": ("LlamaConfig", LLAMA3_70B, 8192, "128x8xH100-80GB", 1024),
    "mixtral-8x7b_8": ("MixtralConfig", MIXTRAL, 4096, "8xH100-80GB", 64),
}
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
SMALL_SEQ, SMALL_GBS = 256, 8
MODES = {"none": False, "selective": "selective", "full": True}


def capture(config: str, kw: dict, seq: int):
    """The model on the meta device, captured with dynamo at ``seq`` tokens (2 sequences)."""
    import transformers as tf

    import galvatron_fx as gfx

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(getattr(tf, config)(**kw, max_position_embeddings=seq,
                                                                        use_cache=False))
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="dynamo")


def searched(gm, cluster, gbs: int, constraints: dict | None) -> dict:
    import galvatron_fx as gfx

    t0 = time.perf_counter()
    try:
        plan = gfx.search(gm, cluster=cluster, global_batch_size=gbs, constraints=constraints)
    except gfx.InfeasibleError as e:
        return {"error": "no plan fits", "min_memory_gib": e.min_memory_bytes / 2**30,
                "search_s": time.perf_counter() - t0}
    return {"samples_s": plan.estimate["throughput_samples_s"], "plan": plan_text(plan),
            "selective_layers": sum(lp.ckpt == "selective" for lp in plan.layers),
            "hsdp_layers": sum((lp.value("shard") or lp.dp) < lp.dp for lp in plan.layers),
            "offload_layers": sum((lp.value("offload") or "none") != "none" for lp in plan.layers),
            "act_offload_layers": sum(bool(lp.value("act_offload")) for lp in plan.layers),
            "peak_gib": max(plan.estimate["memory_bytes_per_device"]) / 2**30, "search_s": time.perf_counter() - t0}


KNOBS = {"selective": {"ckpt": [False, True]}, "hsdp": {"hsdp": False}, "offload": {"offload": False}}
"""Each knob's constraint switching it off."""


def one_case(name: str) -> dict:
    import galvatron_fx as gfx

    config, kw, seq, preset, gbs = CASES[name]
    t0 = time.perf_counter()
    gm = capture(config, kw, seq)
    row = {"case": name, "seq": seq, "cluster": preset, "global_batch": gbs, "capture_s": time.perf_counter() - t0}
    cluster = gfx.Cluster.preset(preset)
    row["off"] = searched(gm, cluster, gbs, {k: v for c in KNOBS.values() for k, v in c.items()})
    row["on"] = searched(gm, cluster, gbs, None)
    for knob, cons in KNOBS.items():
        row[f"no_{knob}"] = searched(gm, cluster, gbs, cons)
    # activation offload is searched only where asked for: every knob plus it
    row["act_offload"] = searched(gm, cluster, gbs, {"act_offload": True})
    if "samples_s" in row["on"] and "samples_s" in row["off"]:
        row["speedup"] = row["on"]["samples_s"] / row["off"]["samples_s"]
    if name == "llama3-8b_8":
        row["uniform_memory_gib"] = uniform_memory(gm, cluster)
    print(f"  {name}: off [{row['off'].get('plan', row['off'].get('error'))}] "
          f"on [{row['on'].get('plan', row['on'].get('error'))}]", flush=True)
    return row


def uniform_memory(gm, cluster) -> dict:
    """Peak GiB per device of tp1·dp8·zero3 with 2 sequences per device per micro-batch, per mode."""
    import galvatron_fx as gfx

    out = {}
    for mode, ckpt in MODES.items():
        plan = gfx.Plan.uniform(gm, cluster.world_size, sdp="zero3", ckpt=ckpt, global_batch_size=2 * cluster.world_size,
                                precision="bf16-mixed")
        out[mode] = max(gfx.estimate(gm, plan, cluster)["memory_bytes_per_device"]) / 2**30
    return out


# ------------------------------------------------------------------------------ measured part
MEASURED = {   # world -> plan label -> Plan.uniform keywords (each knob beside the plan it changes)
    2: {"none": dict(ckpt=False), "selective": dict(ckpt="selective"), "full": dict(ckpt=True)},
    4: {"zero3": dict(sdp="zero3"), "hsdp": dict(sdp="zero3", shard=2), "offload": dict(sdp="zero3", offload="optimizer")},
}


def _measure_rank(rank, world, steps):
    import transformers as tf

    import galvatron_fx as gfx
    from galvatron_fx.cost import CostModel
    from galvatron_fx.runtime.checkpointing import kept_tensors, recording_kept

    cluster = profiled_cluster()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, max_position_embeddings=SMALL_SEQ, use_cache=False))
    batches = token_batches(4, SMALL["vocab_size"], SMALL_GBS, SMALL_SEQ)
    gm = gfx.capture(model, (), kwargs=batches[0], method="dynamo")
    plans = {k: uniform(gm, world, SMALL_GBS, dp=world, **kw) for k, kw in MEASURED[world].items()}
    steps_fn, act, states = {}, {}, {}
    for k, plan in plans.items():
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-4)
        steps_fn[k] = train_stepper(dm, opt, batches)
        act[k] = _activation_bytes(dm, batches[0], recording_kept, kept_tensors)
        steps_fn[k]()
        live = dm.states_bytes(opt)
        states[k] = (live["total"], live["host"])
    with tempfile.TemporaryDirectory() as cache:
        cost = {"mode": "profiled", "reserve_bytes": 0, "cache_dir": cache, "profile_sizes": (1, 2, 4),
                "profile_repeats": 9}
        ests = {k: gfx.estimate(gm, p, cluster, **cost) for k, p in plans.items()}
        cm = CostModel(gm, cluster, **cost)
    pred = {}
    for k, plan in plans.items():   # this rank's states (an offloaded gradient shard is on the host at rest)
        est = [cm.states_bytes(i, s, dp_index=rank % s.shard) for i, s in enumerate(plan.layer_strategies())]
        off = [s.offload != "none" for s in plan.layer_strategies()]
        pred[k] = (sum(e.total - (e.grads if o else 0) for e, o in zip(est, off)), sum(e.host for e in est))
    times = interleaved(steps_fn, steps)
    return {k: {"step_s": times[k], "pred_step_s": ests[k]["step_time_s"], "activation_bytes": act[k],
                "pred_activation_bytes": ests[k]["per_device"]["activation_bytes"][0],
                "states_bytes": states[k], "pred_states_bytes": pred[k]} for k in plans}


def _activation_bytes(dm, batch: dict, recording_kept, kept_tensors) -> int:
    """One micro-batch's saved bytes on this rank: autograd's saved tensors (parameters, a ZeRO-3
    layer's gathered buffer, looked up when a tensor is saved since it is re-allocated at each
    gather, and the caller's batch excluded) and what selective regions keep."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in dm.parameters()}
    index, size = dm.input_shard
    shard = {k: v[index::size] for k, v in batch.items()}
    caller = {v.untyped_storage().data_ptr() for v in shard.values()}

    def pack(t):
        st = t.untyped_storage()
        gathered = {s.full.untyped_storage().data_ptr() for s in dm.stores if s.full is not None}
        if st.data_ptr() not in params | caller | gathered and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recording_kept() as regions:
        out = dm(**shard)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None) or out[0]
    for t in kept_tensors(regions):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    loss.backward()
    for s in dm.stores:
        s.zero_grad_state()
    return sum(seen.values())


def measured(steps: int) -> dict:
    res = {}
    for world, plans in MEASURED.items():
        t0 = time.perf_counter()
        got = spawn(_measure_rank, world, steps)[0]
        base = got[next(iter(plans))]
        rows = [[k, v["pred_step_s"] * 1e3, v["step_s"] * 1e3, f"{v['step_s'] / v['pred_step_s']:.2f}",
                 f"{v['step_s'] / base['step_s']:.2f}", f"{v['pred_step_s'] / base['pred_step_s']:.2f}",
                 f"{100 * rel_err(v['pred_activation_bytes'], v['activation_bytes']):+.1f}%",
                 "{} / {}".format(*v["states_bytes"]), "{} / {}".format(*v["pred_states_bytes"])]
                for k, v in got.items()]
        print(f"\nsmall Llama (hidden {SMALL['hidden_size']}, {SMALL['num_hidden_layers']} layers) on {world} gloo "
              f"ranks, seq {SMALL_SEQ}, global batch {SMALL_GBS}, fp32, DP{world}; median of {steps} interleaved "
              f"steps; {time.perf_counter() - t0:.0f} s")
        print_table(["plan", "est ms", "meas ms", "meas/est", "meas/first", "est/first", "act err",
                     "states B dev / host", "estimated"], rows)
        res.update(got)
    return res


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--steps", type=int, default=10, help="timed steps per measured plan (after 2 warm-up rounds)")
    p.add_argument("--no-measure", action="store_true", help="skip the measured 2- and 4-rank part")
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    meas = {} if args.no_measure else measured(args.steps)
    rows = [one_case(c) for c in args.cases]
    out = []

    def rate(x: dict):
        return f"{x['samples_s']:.3f}" if "samples_s" in x else x.get("error")
    for r in rows:
        on, off = r["on"], r["off"]
        out.append([r["case"], rate(off), rate(on), f"{r['speedup']:.3f}" if "speedup" in r else "-",
                    *(rate(r[f"no_{k}"]) for k in KNOBS),
                    *(on.get(f"{k}_layers", "-") for k in KNOBS), f"{off['search_s']:.1f}", f"{on['search_s']:.1f}"])
    print("\nestimated (bf16-mixed): samples/s without the knobs, searched with all, and with each one off")
    print_table(["case", "without", "searched", "speedup", "no sac", "no hsdp", "no offload", "sac layers",
                 "hsdp layers", "offload layers", "search s off", "search s on"], out)
    for r in rows:
        print(f"  {r['case']}: without [{r['off'].get('plan', '-')}]; searched [{r['on'].get('plan', '-')}]")
        if "uniform_memory_gib" in r:
            print("  Llama-3-8B tp1·dp8·zero3, 2 x 8192 tokens per device: "
                  + ", ".join(f"{k} {v:.1f} GiB" for k, v in r["uniform_memory_gib"].items()))
    summary: dict = {f"{r['case']}_speedup": r.get("speedup") for r in rows}
    for k in KNOBS:
        summary.update({f"{r['case']}_{k}_layers": r["on"].get(f"{k}_layers") for r in rows})
    summary.update({f"{r['case']}_feasible_{which}": "samples_s" in r[which] for r in rows for which in ("off", "on")})
    find = {r["case"]: r for r in rows}
    if "llama3-8b_8" in find:
        r = find["llama3-8b_8"]
        summary["acceptance_llama3_8b_selective"] = bool(r["on"].get("selective_layers")) and r.get("speedup", 0) > 1
        summary.update({f"llama3_8b_uniform_{k}_gib": v for k, v in r["uniform_memory_gib"].items()})
    for k in meas:
        summary[f"measured_over_estimated_{k}"] = meas[k]["step_s"] / meas[k]["pred_step_s"]
        summary[f"activation_error_{k}"] = rel_err(meas[k]["pred_activation_bytes"], meas[k]["activation_bytes"])
        summary[f"states_exact_{k}"] = tuple(meas[k]["states_bytes"]) == tuple(meas[k]["pred_states_bytes"])
    summary["wall_s"] = time.perf_counter() - t0
    aoff = [[r["case"], rate(r["on"]), rate(r["act_offload"]),
             f"{r['act_offload']['samples_s'] / r['on']['samples_s']:.3f}"
             if "samples_s" in r["act_offload"] and "samples_s" in r["on"] else "-",
             r["act_offload"].get("act_offload_layers", "-"), f"{r['act_offload']['search_s']:.1f}"] for r in rows]
    print("\nactivation offload asked for (constraint act_offload: true) beside the default search")
    print_table(["case", "searched", "with act_offload", "ratio", "act_offload layers", "search s"], aoff)
    summary.update({f"{r['case']}_act_offload_ratio": (r["act_offload"]["samples_s"] / r["on"]["samples_s"]
                    if "samples_s" in r["act_offload"] and "samples_s" in r["on"] else None) for r in rows})
    summary.update({f"{r['case']}_act_offload_layers": r["act_offload"].get("act_offload_layers") for r in rows})
    print(f"\nsummary: {summary}")
    write_json(args.json, {"rows": rows, "measured": meas, "summary": summary})


if __name__ == "__main__":
    main()
