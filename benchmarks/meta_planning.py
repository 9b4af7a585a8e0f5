"""Plan real-size transformers models built on the meta device, with the dynamo and export front ends.

Each case (model x method) runs in a fresh process: it builds the model from a hand-written config
with the published sizes (nothing downloaded, no weight allocated: every parameter stays on the
meta device), captures it, searches a plan with ``gfx.search`` and reports the blocks found against
the config's layer count, capture and planning seconds, the process's peak RSS
(``resource.getrusage`` of that child) and whether torch printed any error log or traceback.

    python benchmarks/meta_planning.py [--models qwen2-7b ...] [--methods dynamo export] [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

# name -> (transformers class, config class, config kwargs, layer-count keys, sequence length, cluster)
CASES = {
    "qwen2-7b": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False), ("num_hidden_layers",), 4096, "8xH100-80GB"),
    "mistral-7b": ("MistralForCausalLM", "MistralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096,
        rms_norm_eps=1e-5), ("num_hidden_layers",), 4096, "8xH100-80GB"),
    "llama-3-8b": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5), ("num_hidden_layers",), 4096, "8xH100-80GB"),
    "gpt-neox-20b": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
        num_attention_heads=64, rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True,
        tie_word_embeddings=False), ("num_hidden_layers",), 2048, "8xH100-80GB"),
    "t5-large": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_decoder_layers=24, num_heads=16,
        feed_forward_proj="relu", decoder_start_token_id=0), ("num_layers", "num_decoder_layers"), 512,
        "8xH100-80GB"),
    # NOTE: 70B parameters need >= 16 B each for mixed-precision Adam states (1.1 TB): more than
    # 8 x 80 GB holds under any plan, so it is planned on 4 nodes of 8 H100s
    "llama-2-70b": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5),
        ("num_hidden_layers",), 4096, "4x8xH100-80GB"),
}

CHILD = r"""
import json, resource, sys, time
import torch, transformers
import galvatron_fx as gfx
cls, cfg_cls, cfg, layer_keys, seq, cluster, method, batch, gbs = json.loads(sys.argv[1])
t0 = time.perf_counter()
with torch.device("meta"):
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(use_cache=False, **cfg))
ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device="meta")
t1 = time.perf_counter()
gm = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method=method)
t2 = time.perf_counter()
plan = gfx.search(gm, gfx.Cluster.preset(cluster), "80GiB", gbs)
t3 = time.perf_counter()
layers = gfx.layers(gm)
kinds = sorted({la.strategy.label for la in plan.layers})
print(json.dumps({
    "build_s": t1 - t0, "capture_s": t2 - t1, "plan_s": t3 - t2,
    "params": sum(p.numel() for p in model.parameters()),
    "config_layers": sum(cfg[k] for k in layer_keys), "blocks": sum(la.kind == "block" for la in layers),
    "layers": len(layers), "signatures": len({la.signature for la in layers}),
    "weights_allocated": any(t.device.type != "meta" for t in list(model.parameters()) + list(model.buffers())),
    "pp": plan.pp, "micro_batches": plan.micro_batches, "strategies": kinds,
    "step_s": plan.estimate["step_time_s"], "samples_s": plan.estimate["throughput_samples_s"],
    "max_mem_gib": max(plan.estimate["memory_bytes_per_device"]) / 2**30,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

ERROR_MARKS = ("Traceback", "failed while attempting")


def run_case(name: str, method: str, batch: int, gbs: int, timeout: float) -> dict:
    cls, cfg_cls, cfg, keys, seq, cluster = CASES[name]
    spec = json.dumps([cls, cfg_cls, cfg, keys, seq, cluster, method, batch, gbs])
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, spec], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "cluster": cluster}
    errors = sum(line.count(mark) for line in out.stderr.splitlines() for mark in ERROR_MARKS)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        return {"ok": False, "error": tail[0][:300], "error_logs": errors, "cluster": cluster}
    return {"ok": True, "cluster": cluster, "seq": seq, "error_logs": errors,
            **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--methods", nargs="+", default=["dynamo", "export"])
    p.add_argument("--batch", type=int, default=2, help="capture batch size (samples)")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    args = p.parse_args()
    results = {f"{m}/{meth}": {"model": m, "method": meth,
                               **run_case(m, meth, args.batch, args.global_batch_size, args.timeout)}
               for m in args.models for meth in args.methods}
    rows = []
    for r in results.values():
        if r["ok"]:
            rows.append([r["model"], r["method"], r["cluster"], f"{r['params'] / 1e9:.1f}B",
                         f"{r['blocks']}/{r['config_layers']}", r["capture_s"], r["plan_s"],
                         f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", f"pp{r['pp']} x{r['micro_batches']}",
                         " ".join(r["strategies"]), r["samples_s"], r["error_logs"]])
        else:
            rows.append([r["model"], r["method"], r["cluster"], "-", "-", "-", "-", "-", "FAILED", r["error"], "-",
                         r.get("error_logs", "-")])
    print(f"planning meta-device models (global batch {args.global_batch_size}, capture batch {args.batch}; "
          "one process per case)")
    print_table(["model", "method", "cluster", "params", "blocks/config", "capture s", "plan s", "peak RSS",
                 "pipeline", "layer strategies", "samples/s", "error logs"], rows)
    ok = [r for r in results.values() if r["ok"]]
    summary = {
        "cases": len(results), "planned": len(ok),
        "all_planned": len(ok) == len(results),
        "all_block_counts_match": all(r["blocks"] == r["config_layers"] for r in ok) and len(ok) == len(results),
        "max_capture_s": max((r["capture_s"] for r in ok), default=None),
        "max_plan_s": max((r["plan_s"] for r in ok), default=None),
        "max_rss_gib": max((r["peak_rss_bytes"] / 2**30 for r in ok), default=None),
        "error_logs": sum(r.get("error_logs", 0) for r in results.values()),
        "weights_allocated": any(r["weights_allocated"] for r in ok),
    }
    print(f"summary: {summary['planned']}/{summary['cases']} planned, block counts match: "
          f"{summary['all_block_counts_match']}, slowest plan {summary['max_plan_s'] or 0:.1f} s, slowest capture "
          f"{summary['max_capture_s'] or 0:.1f} s, largest peak RSS {summary['max_rss_gib'] or 0:.2f} GiB, "
          f"error logs {summary['error_logs']}, weights allocated: {summary['weights_allocated']}")
    write_json(args.json, {"summary": summary, "results": results,
                           "config": {"global_batch_size": args.global_batch_size, "batch": args.batch}})


if __name__ == "__main__":
    main()
