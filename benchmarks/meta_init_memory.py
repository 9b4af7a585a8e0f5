"""Peak host memory per rank when a model built on the meta device is initialised shard by shard.

    python benchmarks/meta_init_memory.py [--world 4] [--layers 8] [--hidden 2048] [--steps 1] [--json PATH]

A Llama config (hidden 2048, ffn 5632, 16 heads, vocabulary 32000, 8 layers: about 0.54 B
parameters, 2.2 GB in fp32) is built under ``torch.device("meta")`` on every one of ``world`` gloo
ranks, captured (dynamo), transformed under uniform ZeRO-3 over all ranks, and initialised with
``dist_model.init_weights(seed=0)`` (transformers' own initialiser, one module at a time, each rank
keeping only its rows). Each rank reports its peak RSS (``ru_maxrss``) after import, after
``init_weights`` and after ``--steps`` AdamW training steps (batch 4 x 64 tokens). The reference is
what the usual path costs before any sharding: the whole model's fp32 bytes in every process.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402
from _dist import spawn  # noqa: E402

SEQ, BATCH = 64, 4


def _peak() -> int:
    """This process's peak resident set, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run(rank, world, layers, hidden, steps):
    import transformers as tf

    import galvatron_fx as gfx

    out = {"import": _peak()}
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=SEQ, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    out["params"] = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (BATCH, SEQ), generator=g)
    gm = gfx.capture(model, (), kwargs={"input_ids": ids.to("meta"), "labels": ids.to("meta")}, method="dynamo")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, dp=world, sdp="zero3", global_batch_size=BATCH))
    out["transform"] = _peak()
    dm.init_weights(seed=0, model=model)
    out["init"] = _peak()
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-4)
    index, size = dm.input_shard
    for _ in range(steps):
        out["loss"] = float(dm.train_step(input_ids=ids[index::size], labels=ids[index::size]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["train"] = _peak()
    return out


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--steps", type=int, default=1)
    args = p.parse_args(argv)
    results = spawn(_run, args.world, args.layers, args.hidden, args.steps, timeout=1800)
    whole = results[0]["params"] * 4
    gib = 2 ** 30
    rows = [[r, f"{x['import'] / gib:.2f}", f"{x['init'] / gib:.2f}", f"{x['train'] / gib:.2f}",
             f"{x['init'] / whole:.2f}", f"{x['train'] / whole:.2f}"] for r, x in enumerate(results)]
    print(f"{results[0]['params'] / 1e9:.2f} B parameters, whole model fp32 {whole / gib:.2f} GiB; "
          f"ZeRO-3 over {args.world} gloo ranks, built on the meta device, dist_model.init_weights(seed=0)")
    print_table(["rank", "peak after import GiB", "after init_weights GiB", f"after {args.steps} AdamW step(s) GiB",
                 "init / whole fp32", "train / whole fp32"], rows)
    summary = {"params": results[0]["params"], "whole_fp32_gib": whole / gib,
               "max_init_peak_gib": max(x["init"] for x in results) / gib,
               "max_train_peak_gib": max(x["train"] for x in results) / gib,
               "max_init_over_whole": max(x["init"] for x in results) / whole,
               "max_train_over_whole": max(x["train"] for x in results) / whole,
               "import_peak_gib": max(x["import"] for x in results) / gib, "world": args.world,
               "loss": results[0].get("loss")}
    print("summary: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    write_json(args.json, {"summary": summary, "ranks": results})
    return summary


if __name__ == "__main__":
    main()
