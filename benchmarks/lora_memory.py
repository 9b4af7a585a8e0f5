"""Memory per device of a 7B-class LoRA plan vs full fine-tuning, estimated on the meta device.

    python benchmarks/lora_memory.py [--cluster 8xA100-80GB] [--global-batch-size 32] [--json PATH]

Builds Llama-2-7B (hidden 4096, 32 layers, ffn 11008, vocabulary 32000) from its published config
under ``torch.device("meta")`` (nothing allocated), once as is (full fine-tuning: every weight
trainable) and once wrapped by ``peft.get_peft_model`` with LoRA r = 16 on q_proj / v_proj (the base
weights frozen), captures both with dynamo and prices, under the same cost model (bf16-mixed, AdamW),
uniform DP, ZeRO-3 over the node, TP8 and the searched plan under the device memory: the largest
per-device memory and the estimated step time of each. Frozen weights cost only themselves (no
gradient, no optimizer state; sharded under ZeRO-3), which is what the LoRA column shows.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

import galvatron_fx as gfx  # noqa: E402
from galvatron_fx.errors import GalvatronError  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, use_cache=False)
SEQ = 2048


def build(lora: bool):
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                               target_modules=["q_proj", "v_proj"]))
    ids = torch.zeros((2, SEQ), dtype=torch.long, device="meta")
    return model, dict(input_ids=ids, labels=ids)


def plans(gm, cluster, budget: int, gbs: int) -> dict:
    world = cluster.world_size
    out = {}
    for name, kw in (("dp", dict(dp=world)), ("zero3", dict(dp=world, sdp="zero3")),
                     ("tp8", dict(tp=world, dp=1, sp=True))):
        plan = gfx.Plan.uniform(gm, world_size=world, global_batch_size=gbs, precision="bf16-mixed",
                                micro_batches=gbs // world if name != "tp8" else gbs, **kw)
        est = gfx.estimate(gm, plan, cluster, precision="bf16-mixed")
        out[name] = (max(est["memory_bytes_per_device"]), est["step_time_s"])
    try:
        plan = gfx.search(gm, cluster, budget, gbs, precision="bf16-mixed")
        out["searched"] = (max(plan.estimate["memory_bytes_per_device"]), plan.estimate["step_time_s"])
        out["searched_plan"] = sorted({la.strategy.label for la in plan.layers})
    except GalvatronError as exc:   # nothing fits
        out["searched"] = (None, None)
        out["searched_plan"] = [str(exc)[:80]]
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--cluster", default="8xA100-80GB")
    p.add_argument("--global-batch-size", type=int, default=32)
    args = p.parse_args()
    cluster = gfx.Cluster.preset(args.cluster)
    budget = int(cluster.memory_bytes)
    results, timing = {}, {}
    for label, lora in (("full", False), ("lora", True)):
        t0 = time.perf_counter()
        model, kwargs = build(lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        gm = gfx.capture(model, (), kwargs=kwargs, method="dynamo")
        results[label] = plans(gm, cluster, budget, args.global_batch_size)
        results[label]["trainable_params"] = trainable
        results[label]["params"] = sum(p.numel() for p in model.parameters())
        timing[label] = time.perf_counter() - t0
    def gib(b):
        return "-" if b is None else f"{b / 2**30:.1f}"

    rows = []
    for plan in ("dp", "zero3", "tp8", "searched"):
        (fm, ft), (lm, lt) = results["full"][plan], results["lora"][plan]
        rows.append([plan, gib(fm), gib(lm), "-" if not (fm and lm) else lm / fm,
                     "-" if ft is None else ft, "-" if lt is None else lt])
    print(f"Llama-2-7B on {args.cluster}, bf16-mixed AdamW, global batch {args.global_batch_size} x {SEQ} tokens; "
          f"trainable: full {results['full']['trainable_params'] / 1e9:.2f}B, LoRA "
          f"{results['lora']['trainable_params'] / 1e6:.1f}M of {results['lora']['params'] / 1e9:.2f}B")
    print_table(["plan", "full GiB/device", "LoRA GiB/device", "LoRA/full", "full step s", "LoRA step s"], rows)
    print(f"searched: full {results['full']['searched_plan']}, LoRA {results['lora']['searched_plan']}")
    summary = {f"{plan}_lora_over_full_memory": (results["lora"][plan][0] / results["full"][plan][0]
                                                 if results["full"][plan][0] and results["lora"][plan][0] else None)
               for plan in ("dp", "zero3", "tp8", "searched")}
    summary.update(lora_gib_zero3=results["lora"]["zero3"][0] / 2**30, full_gib_zero3=results["full"]["zero3"][0] / 2**30,
                   seconds=sum(timing.values()))
    print("summary: " + ", ".join(f"{k} {v:.3g}" for k, v in summary.items() if v is not None))
    write_json(args.json, {"summary": summary, "results": {k: {kk: (list(vv) if isinstance(vv, tuple) else vv)
                                                                  for kk, vv in v.items()} for k, v in results.items()},
                           "config": {"cluster": args.cluster, "global_batch_size": args.global_batch_size}})


if __name__ == "__main__":
    main()
