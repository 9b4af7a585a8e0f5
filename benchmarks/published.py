"""The cost model against training throughput others measured on GPUs and published.

Each row is a published run written as its plan: the model (a transformers config built on the
meta device: no weights, no downloads), the published degrees (TP, PP, CP, DP, ZeRO stage),
global batch, sequence length, recomputation and precision, estimated by ``gfx.estimate`` on the
matching cluster preset. No figure is fitted to a row: the presets' rates are the public device
figures of ``galvatron_fx/devices.py``, one curve per device for every row (matmuls in waves of
tiles over the device's SMs), at the pace of the slowest of the row's devices
(``Cluster.straggler_factor``: the spread of one type's devices).

* **absolute rows** compare the estimated throughput, in the row's published unit, with the
  published figure: ratio = estimated / published (>1: the model is optimistic).
* **ratio rows** are runs with Float8 linears or async TP: each is compared only as its throughput
  relative to a reference row of the same table (estimated ratio / published ratio). A run with
  Float8 linears is built with them (``float8``: :func:`galvatron_fx.models.float8.convert_to_float8`,
  the output projection left in bf16 as torchtitan converts) and priced as it runs: its matmuls at
  the fp8 rate, its casts as the memory traffic they are.
* A run that compiled its model (``compiled``: torch.compile) is estimated with
  ``fused_pointwise=True``: the ops outside matmuls and attention cost the bytes entering and
  leaving inductor's fused kernels (:mod:`galvatron_fx.cost.fusion`), not each op's own. Its bf16
  rows are compared absolutely.
* A run with torch's async TP (``async_tp``: torchtitan's ``enable_async_tensor_parallel``) is
  estimated with ``async_tp=True``: each sequence-parallel all-gather and reduce-scatter pipelined
  against the matmuls it feeds or follows. Its rows stay ratio rows, relative to the same run
  without it where the table has one.
* Every Llama row is a torchtitan run, built with torchtitan's attention (``_titan_llama.py``: the
  key / value heads repeated before SDPA, which then saves and exchanges the repeated heads); every
  llm-foundry row that called flash-attn 2 with llm-foundry's attention (``_foundry_flash.py``: q, k
  and v gathered into unpadded rows and the output scattered back, on every layer).
* Torchtitan's 405B rows (Tables 5 and 6, PP 8) are priced as ``zero2``: under PP its FSDP keeps the
  parameters unsharded through the step.
* A publication that omits the micro-batch size or the interleaving depth: every choice that fits
  the device memory is estimated and the fastest taken (what the authors tuned for).

Sources (every figure below with the table it comes from):

* ``torchtitan``: pytorch/torchtitan ``docs/performance.md`` (A100 tables, 2024-04, 64 A100-80GB,
  FSDP2, bf16) and ``benchmarks/llama3_h100_202412_torchtitan.md`` (Table 2: Llama-3.1-8B context
  parallelism on 8 H100, Float8 + torch.compile, full AC, local batch 1; Tables 1 and 3: its FSDP rows
  on 8 and 128 H100 in bf16, with torchtitan's default selective AC, the "op" policy: priced as
  ``ckpt="selective-op"``, which runs that policy; their "FSDP + torch.compile" rows, and their
  Float8 rows relative to those; Table 6: Llama-3.1-405B on 512 H100 with TP 8, PP 8 and CP up to 8,
  its 64k-256k rows relative to its 32k row).
  Its async-TP benchmark (``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``: Llama-3.1-70B
  on 256 and 8B on 64 H100-96GB, FSDP over the nodes, TP 8 with sequence parallelism inside each,
  torch.compile): the vanilla-TP column's bf16 rows, its Float8 tensorwise rows relative to them,
  and each async-TP row relative to the vanilla row of its precision; Table 4 of the 2024-12 file
  (Llama-3.1-70B, FSDP 32 x TP 8, Float8 + compile): "2D + AsyncTP" relative to "2D"; its Table 5
  (Llama-3.1-405B, FSDP 8 x TP 8 x PP 8): interleaved 1F1B relative to 1F1B.
* ``trainy``: Trainy's runs on WhiteFiber, published in torchtitan as
  ``benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md``: Llama-3.1-8B under FSDP on 4 and 8
  nodes of 8 H200 (Float8 + torch.compile, torchtitan's 8B config: selective op AC, local batch 2):
  the 8-node row relative to the 4-node one.
Every model is built in bf16 (each run computed in 16 bits throughout) and estimated as a
``bf16-mixed`` plan (fp32 masters, gradients and Adam moments). A row's ``sp``: sequence
parallelism beside its TP (torchtitan's TP runs it).

* ``megatron``: Narayanan et al., SC'21 (arXiv 2104.04473), Tables 1 and 2: achieved TFLOP/s per
  GPU by their eq. (3), 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, A100-80GB, 16-bit mixed
  precision, full recomputation; Table 1's micro-batch sizes and interleaving depths as the authors'
  NVIDIA/Megatron-LM ``examples/sc21/run_table_1.sh`` runs them. Their attention stores its
  probabilities (a fused softmax, not flash): priced here as transformers' ``eager`` GPT-2
  attention, GELU fused (``gelu_pytorch_tanh``).
* ``korthikanti``: Korthikanti et al. (arXiv 2205.05198), Table 5, "full recompute" column: seconds
  per iteration, no data parallelism; the configs of their Table 3.
* ``llm-foundry``: mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``: MPT models under
  FSDP (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2), amp_bf16; the 128-GPU rows at 2048 tokens of
  both large-scale tables (H100 80GB, A100 40GB). MPT is priced as GPT-2 with MPT's widths, exact
  GELU, no dropout (MPT has no biases; the difference is below 0.1 % of the FLOPs), and the loss
  llm-foundry's MPT computes by default, flash-attn's fused cross-entropy (``_fused_loss.py``: no
  fp32 ``[tokens, vocab]`` buffers; torch's ``cross_entropy`` makes three). Each row's
  attention is the kernel its run called, priced at that kernel's rate (``Cluster.preset(...,
  attention_kernel=...)``): the 2024-01 H100 table ran ``scripts/train/benchmarking/sweep.py``
  (``--attn_impl flash`` with ``flash-attn==2.4.2`` for 1b / 3b / 7b / 70b, ``--attn_impl triton``
  for 13b / 30b); the A100 tables and the 8-GPU H100 table ran ``sweep.sh``, which passes no
  ``--attn_impl``: ``submit_benchmarks.py``'s default ``triton`` (the Triton FlashAttention kernel).

Further rows (for instance held back by a reviewer) load from a JSON list of row dicts with the keys
of :data:`ROWS` (``--rows FILE``; ``--only ID...`` selects).

``--sweep`` adds llm-foundry's 64 8-GPU rows of three model sizes over 512 to 65536 tokens
(:data:`LF_SWEEP`), summarised apart (``sweep_summary``): how the estimate moves with the sequence.

    python benchmarks/published.py [--rows FILE] [--only ID ...] [--sweep] [--json PATH]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _foundry_flash  # noqa: E402
import _titan_llama  # noqa: E402
from _common import parser, print_table, write_json  # noqa: E402

TT_A100 = "torchtitan docs/performance.md (2024-04): Llama on 64 A100-80GB, FSDP2, bf16"
TT_H100_CP = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 2: Llama-3.1-8B, 8 H100, FSDP + CP, "
              "Float8 + torch.compile, full AC, local batch 1")
TT_H100_4D = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 6: Llama-3.1-405B, 512 H100, TP 8 "
              "(SP), PP 8 (1F1B), FSDP x CP, Float8 + torch.compile + async TP, full AC, local batch 8")
TT_H100_3D = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5: Llama-3.1-405B, 512 H100, FSDP 8 x "
              "TP 8 (SP) x PP 8, Float8 + torch.compile + async TP, full AC, local batch 32, 1F1B and interleaved 1F1B")
TT_H100_2D = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4: Llama-3.1-70B, 256 H100, FSDP 32 x "
              "TP 8 (SP), Float8 + torch.compile, full AC, local batch 16, with and without async TP")
TT_H100 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama-3.1-8B, FSDP, bf16 (the "
           "rows without Float8 or torch.compile), selective (op) AC, local batch 2, 8192 tokens")
TT_ATP = ("torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: Llama-3.1 on H100-96GB (500 W), FSDP + "
          "TP 8 with SP, torch.compile, vanilla and async TP, bf16 and Float8 tensorwise, 8192 tokens")
TRAINY = ("torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (Trainy on WhiteFiber): Llama-3.1-8B, FSDP "
          "on 4 and 8 nodes of 8 H200, Float8 + torch.compile, selective (op) AC, local batch 2, 8192 tokens")
TT_H100_F8 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama-3.1-8B, FSDP + "
              "torch.compile with and without Float8, selective (op) AC, local batch 2, 8192 tokens")
MEG = "Narayanan et al. SC'21 (arXiv 2104.04473)"
KORTH = "Korthikanti et al. 2022 (arXiv 2205.05198), Table 5, full recompute"
LF = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (2024-01)"

LLAMA3_8B = dict(kind="llama", hidden=4096, layers=32, ffn=14336, heads=32, kv_heads=8, vocab=128256)
LLAMA3_70B = dict(kind="llama", hidden=8192, layers=80, ffn=28672, heads=64, kv_heads=8, vocab=128256)
LLAMA3_405B = dict(kind="llama", hidden=16384, layers=126, ffn=53248, heads=128, kv_heads=8, vocab=128256)
LLAMA2_13B = dict(kind="llama", hidden=5120, layers=40, ffn=13824, heads=40, kv_heads=40, vocab=32000)
LLAMA2_70B = dict(kind="llama", hidden=8192, layers=80, ffn=28672, heads=64, kv_heads=8, vocab=32000)


def megatron_gpt(hidden, layers, heads):
    """A Megatron GPT (Narayanan et al. Table 1 / Korthikanti Table 3): 4h FFN, vocab 51200."""
    return dict(kind="gpt", hidden=hidden, layers=layers, ffn=4 * hidden, heads=heads, vocab=51200,
                attention="eager", activation="gelu_pytorch_tanh", dropout=0.1)


def mpt(hidden, layers, heads):
    """An MPT model of llm-foundry's yamls (expansion ratio 4, vocab 50368, flash attention, its
    default fused cross-entropy: ``_fused_loss``)."""
    return dict(kind="gpt", hidden=hidden, layers=layers, ffn=4 * hidden, heads=heads, vocab=50368,
                attention="sdpa", activation="gelu", dropout=0.0, loss="fused")


def _meg(name, arch, gpus, tp, pp, gbs, value, *, sdp="none", mb=None, interleaved=True, v=None, table="Table 1"):
    return dict(id=f"megatron-{name}", source=f"{MEG}, {table}", arch=arch, cluster=_a100(gpus), seq=2048,
                gbs=gbs, tp=tp, pp=pp, sdp=sdp, ckpt=True, micro_batch=mb, interleaved=interleaved and pp > 1,
                virtual_stages=v, unit="megatron_tflops", published=value)


def _a100(gpus, memory="80GB"):
    return f"{gpus // 8}x8xA100-{memory}" if gpus > 8 else f"{gpus}xA100-{memory}"


def _lf(id_, name, arch, device, gbs, mb, ckpt, sdp, value, attention="flash-attn-triton"):
    cluster = f"16x8x{device}"
    if attention == "flash-attn-2":   # llm-foundry's flash_attn_fn: unpads q / k / v and pads the output
        arch = dict(arch, attention=_foundry_flash.NAME)
    return dict(id=f"llm-foundry-{id_}-{name}", source=LF, arch=arch, cluster=cluster, seq=2048, gbs=gbs,
                sdp=sdp, ckpt=ckpt, micro_batch=mb, unit="tokens/s/GPU", published=value,
                attention_kernel=attention)


_KORTH = dict(source=KORTH, seq=2048, tp=8, ckpt=True, micro_batch=1, unit="s/iteration")
_TT_CP = dict(source=TT_H100_CP, arch=LLAMA3_8B, cluster="8xH100-96GB", ckpt=True, sdp="zero3", float8=True,
              compiled=True, unit="tokens/s/GPU", reference="torchtitan-h100-cp1-32k")
_MPT = {"70b": mpt(8192, 80, 64), "30b": mpt(7168, 48, 64), "13b": mpt(5120, 40, 40), "7b": mpt(4096, 32, 32),
        "3b": mpt(2560, 32, 20), "1b": mpt(2048, 24, 16), "760m": mpt(1536, 24, 12), "350m": mpt(1024, 24, 16),
        "125m": mpt(768, 12, 12)}


def _float8_pair(row: dict, ref: str, f8: str, compiled: float, float8: float) -> list[dict]:
    """A table's Float8 row relative to its row of the same run in bf16 (both compiled), which is
    itself compared absolutely."""
    return [dict(row, id=ref, published=compiled),
            dict(row, id=f8, published=float8, float8=True, reference=ref)]


def _tt_float8(name, cluster, gbs, compiled, float8):
    """torchtitan H100 Table 1 or 3: its "FSDP + torch.compile + Float8" row relative to its "FSDP +
    torch.compile" row (the same plan in bf16)."""
    row = dict(source=TT_H100_F8, arch=LLAMA3_8B, cluster=cluster, seq=8192, gbs=gbs, sdp="zero3",
               ckpt="selective-op", micro_batch=2, unit="tokens/s/GPU", compiled=True)
    return _float8_pair(row, f"torchtitan-h100-llama3-8b-{name}-compile",
                        f"torchtitan-h100-llama3-8b-{name}-float8", compiled, float8)


def _tt_async_tp(name, arch, gpus, local_batch, ckpt, bf16, float8, bf16_async, float8_async):
    """torchtitan's async-TP benchmark, FSDP over the nodes and TP 8 with sequence parallelism inside
    each: its vanilla-TP "float8 tensorwise" row relative to "None (bfloat16)", and each async-TP row
    relative to the vanilla row of its precision (priced with ``async_tp=True``)."""
    dp = gpus // 8
    row = dict(source=TT_ATP, arch=arch, cluster=f"{dp}x8xH100-96GB", seq=8192, gbs=local_batch * dp, tp=8,
               sp=True, sdp="zero3", ckpt=ckpt, micro_batch=local_batch, unit="tokens/s/GPU",
               compiled=True)
    ref, f8 = f"torchtitan-asynctp-{name}-bf16", f"torchtitan-asynctp-{name}-float8"
    return [*_float8_pair(row, ref, f8, bf16, float8),
            dict(row, id=ref + "-async", published=bf16_async, async_tp=True, reference=ref),
            dict(row, id=f8 + "-async", published=float8_async, float8=True, async_tp=True, reference=f8)]


ROWS: list[dict] = [
    # torchtitan A100 tables: FSDP over 64 GPUs, one micro-batch ("local batch")
    dict(id="torchtitan-a100-llama3-70b-full", source=TT_A100, arch=LLAMA3_70B, cluster="8x8xA100-80GB", seq=8192,
         gbs=64, sdp="zero3", ckpt=True, micro_batch=1, unit="tokens/s/GPU", published=331),
    dict(id="torchtitan-a100-llama2-13b-none", source=TT_A100, arch=LLAMA2_13B, cluster="8x8xA100-80GB", seq=4096,
         gbs=128, sdp="zero3", ckpt=False, micro_batch=2, unit="tokens/s/GPU", published=2162),
    dict(id="torchtitan-a100-llama2-70b-full", source=TT_A100, arch=LLAMA2_70B, cluster="8x8xA100-80GB", seq=4096,
         gbs=128, sdp="zero3", ckpt=True, micro_batch=2, unit="tokens/s/GPU", published=353),
    # torchtitan H100 Tables 1 and 3: FSDP in bf16 (their rows without Float8 and torch.compile)
    dict(id="torchtitan-h100-llama3-8b-fsdp8", source=TT_H100, arch=LLAMA3_8B, cluster="8xH100-96GB", seq=8192,
         gbs=16, sdp="zero3", ckpt="selective-op", micro_batch=2, unit="tokens/s/GPU", published=5762),
    dict(id="torchtitan-h100-llama3-8b-fsdp128", source=TT_H100, arch=LLAMA3_8B, cluster="16x8xH100-96GB",
         seq=8192, gbs=256, sdp="zero3", ckpt="selective-op", micro_batch=2, unit="tokens/s/GPU", published=5605),
    # torchtitan H100 Tables 1 and 3: "FSDP + torch.compile", and its Float8 row relative to it
    *_tt_float8("fsdp8", "8xH100-96GB", 16, compiled=6667, float8=8532),
    *_tt_float8("fsdp128", "16x8xH100-96GB", 256, compiled=6514, float8=8380),
    # torchtitan H100 Table 2 (Float8 + compile): relative to its 32k FSDP-8 row
    dict(id="torchtitan-h100-cp1-32k", seq=32768, gbs=8, published=3890, **{**_TT_CP, "reference": None},
         ratio_only=True),
    dict(id="torchtitan-h100-cp2-64k", seq=65536, gbs=4, cp=2, published=2540, **_TT_CP),
    dict(id="torchtitan-h100-cp4-128k", seq=131072, gbs=2, cp=4, published=1071, **_TT_CP),
    dict(id="torchtitan-h100-cp8-256k", seq=262144, gbs=1, cp=8, published=548, **_TT_CP),
    # torchtitan H100 Table 5 (Float8 + compile + async TP): interleaved 1F1B relative to 1F1B (local batch 32
    # in torchtitan's default micro-batches of 4: one per stage; 2 stages per rank interleaved). Tables 5 and 6
    # as zero2: under PP torchtitan's FSDP keeps the parameters unsharded through the step
    # (reshard_after_forward=False) and reduce-scatters the gradients after the last micro-batch; zero2 holds
    # the parameters whole likewise (and reduce-scatters each micro-batch's gradients)
    *[dict(id=f"torchtitan-h100-405b-3d-{name}", source=TT_H100_3D, arch=LLAMA3_405B, cluster="64x8xH100-96GB",
           seq=8192, gbs=256, tp=8, sp=True, pp=8, sdp="zero2", ckpt=True, micro_batch=4, float8=True, compiled=True,
           async_tp=True, unit="tokens/s/GPU", published=value,
           **(dict(virtual_stages=2, interleaved=True, reference="torchtitan-h100-405b-3d-1f1b") if name != "1f1b"
              else dict(ratio_only=True)))
      for name, value in [("1f1b", 100), ("interleaved-1f1b", 128)]],
    # torchtitan H100 Table 6 (Float8 + compile + async TP): relative to its 32k row
    *[dict(id=f"torchtitan-h100-405b-cp{cp}-{seq // 1024}k", source=TT_H100_4D, arch=LLAMA3_405B,
           cluster="64x8xH100-96GB", seq=seq, gbs=64 // cp, tp=8, sp=True, pp=8, cp=cp, sdp="zero2", ckpt=True,
           micro_batch=1, float8=True, compiled=True, async_tp=True, unit="tokens/s/GPU", published=value,
           **(dict(ratio_only=True) if cp == 1 else dict(reference="torchtitan-h100-405b-cp1-32k")))
      for cp, seq, value in [(1, 32768, 76), (2, 65536, 47), (4, 131072, 31), (8, 262144, 16)]],
    # torchtitan's async-TP benchmark (2025-06), vanilla TP, compiled: bf16, and Float8 relative to it
    *_tt_async_tp("llama3-70b-256", LLAMA3_70B, 256, 16, True, bf16=597.3, float8=809.8, bf16_async=652.4,
                  float8_async=942.4),
    *_tt_async_tp("llama3-8b-64", LLAMA3_8B, 64, 12, "selective-op", bf16=4378, float8=5078.1, bf16_async=4809.4,
                  float8_async=5570.1),
    # torchtitan H100 Table 4 (Float8 + compile): "2D + AsyncTP" relative to "2D"
    *[dict(id=f"torchtitan-h100-70b-2d{tag}", source=TT_H100_2D, arch=LLAMA3_70B, cluster="32x8xH100-96GB",
           seq=8192, gbs=512, tp=8, sp=True, sdp="zero3", ckpt=True, micro_batch=16, float8=True, compiled=True,
           unit="tokens/s/GPU", published=value,
           **(dict(async_tp=True, reference="torchtitan-h100-70b-2d") if tag else dict(ratio_only=True)))
      for tag, value in [("", 829), ("-asynctp", 876)]],
    # Trainy's H200 runs (Float8 + compile, shared): 8 nodes relative to 4
    dict(id="trainy-h200-llama3-8b-32", source=TRAINY, arch=LLAMA3_8B, cluster="4x8xH200-141GB", seq=8192, gbs=64,
         sdp="zero3", ckpt="selective-op", micro_batch=2, float8=True, compiled=True, unit="tokens/s/GPU",
         published=10938,
         ratio_only=True),
    dict(id="trainy-h200-llama3-8b-64", source=TRAINY, arch=LLAMA3_8B, cluster="8x8xH200-141GB", seq=8192, gbs=128,
         sdp="zero3", ckpt="selective-op", micro_batch=2, float8=True, compiled=True, unit="tokens/s/GPU",
         published=10753,
         reference="trainy-h200-llama3-8b-32"),
    # Megatron-LM SC'21 Table 1, each run as NVIDIA/Megatron-LM examples/sc21/run_table_1.sh gives it
    # (micro-batch size, and the interleaving depth: --num-layers-per-virtual-pipeline-stage), and Table 2
    _meg("1.7B", megatron_gpt(2304, 24, 24), 32, 1, 1, 512, 137, mb=16),
    _meg("3.6B", megatron_gpt(3072, 30, 32), 64, 2, 1, 512, 138, mb=16),
    _meg("7.5B", megatron_gpt(4096, 36, 32), 128, 4, 1, 512, 142, mb=16),
    _meg("18.4B", megatron_gpt(6144, 40, 48), 256, 8, 1, 1024, 135, mb=8),
    _meg("39.1B", megatron_gpt(8192, 48, 64), 512, 8, 2, 1536, 138, mb=4, interleaved=False),
    _meg("76.1B", megatron_gpt(10240, 60, 80), 1024, 8, 4, 1792, 140, mb=2, v=3),
    _meg("145.6B", megatron_gpt(12288, 80, 96), 1536, 8, 8, 2304, 148, mb=2, v=2),
    _meg("310.1B", megatron_gpt(16384, 96, 128), 1920, 8, 16, 2160, 155, mb=1, v=2),
    _meg("529.6B", megatron_gpt(20480, 105, 128), 2520, 8, 35, 2520, 163, mb=1, v=3),
    _meg("1008B", megatron_gpt(25600, 128, 160), 3072, 8, 64, 3072, 163, mb=1, interleaved=False),
    _meg("174.6B-zero3-384", megatron_gpt(12288, 96, 96), 384, 1, 1, 1536, 144, sdp="zero3", mb=4, table="Table 2"),
    _meg("174.6B-ptdp-384", megatron_gpt(12288, 96, 96), 384, 8, 12, 1536, 153, mb=1, table="Table 2"),
    # Korthikanti et al. Table 5 (full recompute), no data parallelism
    dict(id="korthikanti-22B", arch=megatron_gpt(6144, 48, 64), cluster="8xA100-80GB", gbs=4, pp=1,
         published=1.42, **{**_KORTH, "micro_batch": 4}),
    dict(id="korthikanti-175B", arch=megatron_gpt(12288, 96, 96), cluster="8x8xA100-80GB", gbs=64, pp=8,
         virtual_stages=3, published=18.13, **_KORTH),
    dict(id="korthikanti-530B", arch=megatron_gpt(20480, 105, 128), cluster="35x8xA100-80GB", gbs=280, pp=35,
         virtual_stages=3, published=49.05, **_KORTH),
    dict(id="korthikanti-1T", arch=megatron_gpt(25600, 128, 160), cluster="64x8xA100-80GB", gbs=512, pp=64,
         published=94.42, **_KORTH),
    # llm-foundry, 128 GPUs, 2048 tokens: H100 80GB then A100 40GB
    _lf("003", "70b-h100", _MPT["70b"], "H100-80GB", 1024, 8, True, "zero3", 1058, "flash-attn-2"),
    _lf("006", "30b-h100", _MPT["30b"], "H100-80GB", 1024, 8, True, "zero3", 2199),
    _lf("009", "13b-h100", _MPT["13b"], "H100-80GB", 2048, 16, True, "zero3", 5080),
    _lf("012", "7b-h100", _MPT["7b"], "H100-80GB", 768, 6, False, "zero3", 10475, "flash-attn-2"),
    _lf("015", "3b-h100", _MPT["3b"], "H100-80GB", 1024, 8, False, "zero2", 23422, "flash-attn-2"),
    _lf("018", "1b-h100", _MPT["1b"], "H100-80GB", 1536, 12, False, "zero2", 44123, "flash-attn-2"),
    _lf("139", "70b-a100", _MPT["70b"], "A100-40GB", 512, 4, True, "zero3", 376),
    _lf("141", "30b-a100", _MPT["30b"], "A100-40GB", 768, 6, True, "zero3", 865),
    _lf("145", "13b-a100", _MPT["13b"], "A100-40GB", 2048, 16, True, "zero3", 1972),
    _lf("155", "7b-a100", _MPT["7b"], "A100-40GB", 2304, 18, True, "zero3", 3623),
    _lf("166", "3b-a100", _MPT["3b"], "A100-40GB", 768, 6, False, "zero3", 9538),
    _lf("177", "1b-a100", _MPT["1b"], "A100-40GB", 1280, 10, False, "zero3", 18647),
    _lf("188", "760m-a100", _MPT["760m"], "A100-40GB", 1536, 12, False, "zero3", 28940),
    _lf("199", "350m-a100", _MPT["350m"], "A100-40GB", 2304, 18, False, "zero3", 51934),
    _lf("210", "125m-a100", _MPT["125m"], "A100-40GB", 3328, 26, False, "zero3", 123936),
]


LF_SWEEP = [  # (table row, MPT size, device, tokens, samples per step, micro-batch, full AC, tokens/s/GPU)
    ("035", "7b", "H100-80GB", 65536, 8, 1, True, 1956),
    ("036", "7b", "H100-80GB", 32768, 16, 2, True, 3318),
    ("037", "7b", "H100-80GB", 8192, 64, 8, True, 6935),
    ("038", "7b", "H100-80GB", 4096, 128, 16, True, 8611),
    ("039", "7b", "H100-80GB", 2048, 48, 6, False, 10643),
    ("040", "7b", "H100-80GB", 1024, 512, 64, True, 10203),
    ("041", "3b", "H100-80GB", 65536, 8, 1, True, 3262),
    ("042", "3b", "H100-80GB", 32768, 24, 3, True, 5873),
    ("043", "3b", "H100-80GB", 16384, 8, 1, False, 11152),
    ("044", "3b", "H100-80GB", 8192, 24, 3, False, 16578),
    ("045", "3b", "H100-80GB", 4096, 40, 5, False, 20964),
    ("049", "3b", "H100-80GB", 1024, 160, 20, False, 27046),
    ("050", "3b", "H100-80GB", 512, 320, 40, False, 27965),
    ("051", "1b", "H100-80GB", 65536, 8, 1, True, 5506),
    ("052", "1b", "H100-80GB", 32768, 8, 1, False, 12025),
    ("053", "1b", "H100-80GB", 16384, 16, 2, False, 19649),
    ("054", "1b", "H100-80GB", 8192, 24, 3, False, 29157),
    ("055", "1b", "H100-80GB", 4096, 56, 7, False, 38535),
    ("059", "1b", "H100-80GB", 2048, 112, 14, False, 45455),
    ("060", "1b", "H100-80GB", 1024, 144, 18, False, 48910),
    ("061", "1b", "H100-80GB", 512, 448, 56, False, 52275),
    ("091", "7b", "A100-80GB", 65536, 8, 1, True, 1013),
    ("092", "7b", "A100-80GB", 32768, 16, 2, True, 1672),
    ("093", "7b", "A100-80GB", 16384, 32, 4, True, 2453),
    ("094", "7b", "A100-80GB", 8192, 64, 8, True, 3206),
    ("095", "7b", "A100-80GB", 4096, 128, 16, True, 3684),
    ("096", "7b", "A100-80GB", 2048, 48, 6, False, 4641),
    ("097", "7b", "A100-80GB", 1024, 512, 64, True, 4357),
    ("098", "3b", "A100-80GB", 65536, 8, 1, True, 1767),
    ("099", "3b", "A100-80GB", 32768, 24, 3, True, 3029),
    ("100", "3b", "A100-80GB", 16384, 8, 1, False, 5529),
    ("101", "3b", "A100-80GB", 8192, 24, 3, False, 7695),
    ("102", "3b", "A100-80GB", 4096, 40, 5, False, 9457),
    ("103", "3b", "A100-80GB", 2048, 80, 10, False, 10811),
    ("104", "3b", "A100-80GB", 1024, 160, 20, False, 11580),
    ("105", "3b", "A100-80GB", 512, 320, 40, False, 12127),
    ("106", "1b", "A100-80GB", 65536, 8, 1, True, 3044),
    ("107", "1b", "A100-80GB", 32768, 8, 1, False, 6275),
    ("108", "1b", "A100-80GB", 16384, 16, 2, False, 9956),
    ("109", "1b", "A100-80GB", 8192, 24, 3, False, 13814),
    ("110", "1b", "A100-80GB", 4096, 56, 7, False, 17807),
    ("111", "1b", "A100-80GB", 2048, 112, 14, False, 20513),
    ("112", "1b", "A100-80GB", 1024, 144, 18, False, 22112),
    ("113", "1b", "A100-80GB", 512, 448, 56, False, 23148),
    ("152", "7b", "A100-40GB", 16384, 8, 1, True, 2249),
    ("153", "7b", "A100-40GB", 8192, 24, 3, True, 2887),
    ("154", "7b", "A100-40GB", 4096, 48, 6, True, 3366),
    ("159", "7b", "A100-40GB", 2048, 96, 12, True, 3679),
    ("160", "7b", "A100-40GB", 1024, 192, 24, True, 3854),
    ("161", "7b", "A100-40GB", 512, 384, 48, True, 3895),
    ("162", "3b", "A100-40GB", 32768, 8, 1, True, 2955),
    ("163", "3b", "A100-40GB", 16384, 16, 2, True, 4465),
    ("164", "3b", "A100-40GB", 8192, 8, 1, False, 7149),
    ("165", "3b", "A100-40GB", 4096, 16, 2, False, 8777),
    ("170", "3b", "A100-40GB", 2048, 40, 5, False, 10065),
    ("171", "3b", "A100-40GB", 1024, 80, 10, False, 10731),
    ("172", "3b", "A100-40GB", 512, 160, 20, False, 11324),
    ("173", "1b", "A100-40GB", 32768, 8, 1, True, 5095),
    ("174", "1b", "A100-40GB", 16384, 8, 1, False, 9715),
    ("175", "1b", "A100-40GB", 8192, 16, 2, False, 13474),
    ("176", "1b", "A100-40GB", 4096, 32, 4, False, 16856),
    ("181", "1b", "A100-40GB", 2048, 64, 8, False, 19271),
    ("182", "1b", "A100-40GB", 1024, 128, 16, False, 20959),
    ("183", "1b", "A100-40GB", 512, 256, 32, False, 21782),
]
"""``--sweep``: llm-foundry's 8-GPU rows of the 1b / 3b / 7b models at every published length (512 to
65536 tokens, bf16, FSDP FULL_SHARD): how the estimate moves with the sequence length."""


def sweep_rows() -> list[dict]:
    return [dict(id=f"llm-foundry-{n}-{size}-{dev.split('-')[0].lower()}-{seq}", source=f"{LF} (8 GPUs)",
                 arch=_MPT[size], cluster=f"8x{dev}", seq=seq, gbs=gbs, sdp="zero3", ckpt=ckpt, micro_batch=mb,
                 unit="tokens/s/GPU", published=value, attention_kernel="flash-attn-triton")
            for n, size, dev, seq, gbs, mb, ckpt, value in LF_SWEEP]


def build(arch: dict, seq: int, float8: bool = False):
    """The row's transformers model on the meta device and its keyword inputs (one sample);
    ``float8``: its linears (not the output projection) as Float8 training runs them."""
    import transformers as tf

    if arch["kind"] == "llama":
        cfg = tf.LlamaConfig(vocab_size=arch["vocab"], hidden_size=arch["hidden"], intermediate_size=arch["ffn"],
                             num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"],
                             num_key_value_heads=arch["kv_heads"], max_position_embeddings=max(seq, 8192),
                             rope_theta=500000.0, use_cache=False)
        # NOTE: every Llama row is a torchtitan run: its attention repeats the key / value heads
        cls, impl = tf.LlamaForCausalLM, _titan_llama.register()
    else:
        p = arch["dropout"]
        cfg = tf.GPT2Config(vocab_size=arch["vocab"], n_embd=arch["hidden"], n_layer=arch["layers"],
                            n_head=arch["heads"], n_inner=arch["ffn"], n_positions=seq,
                            activation_function=arch["activation"], resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
                            use_cache=False)
        cls, impl = tf.GPT2LMHeadModel, arch["attention"]
        if impl == _foundry_flash.NAME:
            _foundry_flash.register()
    cfg._attn_implementation = impl
    with torch.device("meta"):
        # NOTE: every run here computes in 16 bits throughout (Megatron's fp16 model, FSDP's bf16
        # parameters): masks and scores the model builds take that dtype, as they did there (an fp32
        # model's mask would promote eager attention's scores to fp32); the plan's states are
        # bf16-mixed's either way
        model = cls(cfg).to(torch.bfloat16)
    if float8:
        from galvatron_fx.models.float8 import convert_to_float8

        convert_to_float8(model)
    if arch.get("loss") == "fused":
        from _fused_loss import FusedLossLM

        model = FusedLossLM(model)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, dict(input_ids=ids, labels=ids)


def megatron_flops(arch: dict, seq: int, gbs: int) -> float:
    """FLOPs per iteration by Narayanan et al.'s eq. (3) (recomputation's forward included)."""
    h, layers, vocab = arch["hidden"], arch["layers"], arch["vocab"]
    return 96 * gbs * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def in_unit(row: dict, step_s: float, world: int) -> float:
    """Throughput in the row's published unit for one iteration of ``step_s`` seconds."""
    if row["unit"] == "tokens/s/GPU":
        return row["gbs"] * row["seq"] / step_s / world
    if row["unit"] == "megatron_tflops":
        return megatron_flops(row["arch"], row["seq"], row["gbs"]) / step_s / world / 1e12
    if row["unit"] == "s/iteration":
        return step_s
    raise ValueError(f"row {row['id']}: unknown unit {row['unit']!r} (tokens/s/GPU, megatron_tflops, s/iteration)")


def throughput_ratio(row: dict, estimated: float, published: float) -> float:
    """estimated / published throughput (seconds per iteration invert)."""
    return published / estimated if row["unit"] == "s/iteration" else estimated / published


def candidates(row: dict, world: int):
    """The plans a row may be: its published degrees; every micro-batch size and interleaving depth
    where the publication omits them."""
    import galvatron_fx as gfx  # noqa: F401

    tp, pp, cp = row.get("tp", 1), row.get("pp", 1), row.get("cp", 1)
    dp = world // (tp * pp)            # the data-parallel group holds the context-parallel ranks
    per_rank = row["gbs"] * cp // dp   # samples per data replica (a sample spans cp ranks)
    sizes = [row["micro_batch"]] if row.get("micro_batch") else [m for m in (1, 2, 4, 8, 16) if per_rank % m == 0]
    depths = ([row["virtual_stages"]] if row.get("virtual_stages")
              else [v for v in (2, 3, 4) if row["arch"]["layers"] % (pp * v) == 0] if row.get("interleaved") else [1])
    for mb in sizes:
        for v in depths:
            yield dict(tp=tp, pp=pp, cp=cp, dp=dp, sdp=row.get("sdp", "none"), ckpt=row["ckpt"],
                       sp=row.get("sp", False),
                       micro_batches=max(1, per_rank // mb), global_batch_size=row["gbs"],
                       schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)


def block_stages(layers: int, chunks: int) -> list[tuple[int, int]] | None:
    """Megatron's partition: the blocks evenly over the pipeline chunks, the embedding with the
    first, the head with the last (layer 0 and ``layers - 1`` of the captured graph), as the
    publications ran; None where the blocks do not divide (then :meth:`Plan.uniform`'s split)."""
    blocks = layers - 2
    if chunks == 1 or blocks % chunks:
        return None
    k = blocks // chunks
    return [(0 if i == 0 else 1 + i * k, layers - 1 if i == chunks - 1 else k + i * k) for i in range(chunks)]


def estimate_row(row: dict, captured: dict) -> dict:
    """The fastest of the row's candidate plans that fits the device memory (else the least memory)."""
    import galvatron_fx as gfx

    key = json.dumps([row["arch"], row["seq"], row.get("float8", False)], sort_keys=True)
    if key not in captured:
        model, kwargs = build(row["arch"], row["seq"], row.get("float8", False))
        captured[key] = gfx.capture(model, (), kwargs=kwargs)
    gm = captured[key]
    cluster = gfx.Cluster.preset(row["cluster"], attention_kernel=row.get("attention_kernel", "sdpa"))
    world = cluster.world_size
    best = None
    for kw in candidates(row, world):
        plan = gfx.Plan.uniform(gm, world, precision="bf16-mixed", **kw)
        stages = block_stages(len(plan.layers), kw["pp"] * kw["virtual_stages"])
        if stages is not None:
            plan = dataclasses.replace(plan, stages=stages)
        est = gfx.estimate(gm, plan, cluster, fused_pointwise=row.get("compiled", False),
                           async_tp=row.get("async_tp", False))
        memory = max(est["memory_bytes_per_device"])
        fits = memory <= cluster.memory_bytes
        score = (fits, -est["step_time_s"] if fits else -memory)
        if best is None or score > best[0]:
            best = (score, dict(step_s=est["step_time_s"], memory_gib=memory / 2**30, fits=fits,
                                micro_batches=kw["micro_batches"], virtual_stages=kw["virtual_stages"]))
    out = best[1]
    out["estimated"] = in_unit(row, out["step_s"], world)
    return out


def run(rows: list[dict]) -> tuple[list[dict], dict]:
    captured, results = {}, {}
    for row in rows:
        t0 = time.perf_counter()
        results[row["id"]] = r = estimate_row(row, captured)
        r["seconds"] = time.perf_counter() - t0
        print(f"  {row['id']}: {r['seconds']:.0f} s", file=sys.stderr, flush=True)
    out = []
    for row in rows:
        r = dict(results[row["id"]], id=row["id"], source=row["source"].split(",")[0].split(" (")[0],
                 unit=row["unit"], published=row["published"], kind="absolute")
        ref = row.get("reference")
        if ref:
            base = next(x for x in rows if x["id"] == ref)
            r.update(kind=f"ratio to {ref}",
                     ratio=(r["estimated"] / results[ref]["estimated"]) / (row["published"] / base["published"]))
        elif row.get("ratio_only"):
            r.update(kind="reference", ratio=None)
        else:
            r["ratio"] = throughput_ratio(row, r["estimated"], row["published"])
        out.append(r)
    compared = [r for r in out if r["ratio"] is not None]
    ratios = [r["ratio"] for r in compared]
    summary = dict(
        rows=len(compared), sources=len({r["source"] for r in compared}),
        within_15pct_fraction=sum(abs(x - 1) <= 0.15 for x in ratios) / len(ratios) if ratios else 0.0,
        within_30pct_fraction=sum(abs(x - 1) <= 0.30 for x in ratios) / len(ratios) if ratios else 0.0,
        geomean_ratio=math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else 0.0,
        worst_ratio=max(ratios, key=lambda x: abs(math.log(x))) if ratios else 0.0,
        all_fit=all(r["fits"] for r in out))
    return out, summary


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", metavar="FILE", help="a JSON list of further rows (the keys of ROWS)")
    p.add_argument("--only", nargs="+", metavar="ID", help="estimate only these rows (and their references)")
    p.add_argument("--sweep", action="store_true", help="also llm-foundry's 64 8-GPU rows over sequence length "
                                                        "(LF_SWEEP; a separate summary)")
    args = p.parse_args(argv)
    rows = list(ROWS)
    if args.rows:
        with open(args.rows) as f:
            rows += json.load(f)
    if args.only:
        keep = set(args.only) | {r.get("reference") for r in rows if r["id"] in args.only}
        rows = [r for r in rows if r["id"] in keep]
    out, summary = run(rows)
    _report(out, summary)
    data = {"summary": summary, "rows": out}
    if args.sweep:
        sweep, sweep_summary = run(sweep_rows())
        _report(sweep, sweep_summary)
        data.update(sweep=sweep, sweep_summary=sweep_summary)
    write_json(args.json, data)
    return data


def _report(out: list[dict], summary: dict) -> None:
    print_table(["row", "unit", "published", "estimated", "ratio", "est GiB", "fits", "mbs", "v", "compared"],
                [[r["id"], r["unit"], r["published"], r["estimated"], r["ratio"] if r["ratio"] is not None else "-",
                  r["memory_gib"], r["fits"], r["micro_batches"], r["virtual_stages"], r["kind"]] for r in out])
    print(f"summary: {summary['rows']} rows from {summary['sources']} sources; within 15 %: "
          f"{summary['within_15pct_fraction']:.0%}; geomean ratio {summary['geomean_ratio']:.3f}; "
          f"worst {summary['worst_ratio']:.3f}")


if __name__ == "__main__":
    main()
