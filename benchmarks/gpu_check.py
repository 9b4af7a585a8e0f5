"""The cost model and the runtime on one real accelerator: what a CPU cannot check.

Run on one GPU (about 5 minutes on an H100; ``--small`` shrinks every size for a smoke run, and
``--device cpu`` runs it on this CPU to check the script itself):

* **ring blocks**: the ring's CUDA block kernels (:mod:`galvatron_fx.runtime.ring_attention`: flash
  for bf16 without a mask) on two key spans, merged by their log-sum-exp, against one
  ``F.scaled_dot_product_attention`` call, forward and backward;
* **attention rate**: ``F.scaled_dot_product_attention`` causal, head dim 128, forward + backward,
  timed at 2k / 8k / 32k tokens against :meth:`Cluster.attention_time` on the device's preset;
* **memory**: a 1B-class Llama (transformers ``LlamaConfig``: hidden 2048, 16 layers, 16 heads,
  8 key / value heads) trained by ``gfx.transform`` on a one-rank NCCL world, bf16-mixed AdamW:
  peak ``torch.cuda.max_memory_allocated`` over two steps against ``gfx.estimate``'s per-device
  bytes, without and with activation checkpointing;
* **step time**: the same step's median time against the estimate's ``step_time_s``;
* **bf16 like eager**: five steps' losses against the same model trained eagerly under
  ``torch.autocast(bfloat16)`` with fp32 AdamW (PyTorch's mixed-precision reference).

    python benchmarks/gpu_check.py [--device cuda] [--small] [--json PATH]
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parser, print_table, write_json  # noqa: E402

PRESETS = {"H100": "1xH100-80GB", "H200": "1xH200-141GB", "A100": "1xA100-80GB", "V100": "1xV100-32GB"}


def preset_for(device: torch.device) -> str:
    """The cluster preset of the device (``1xH100-80GB`` for an H100 ...; the A100's elsewhere)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((p for key, p in PRESETS.items() if key in name), "1xA100-80GB")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def check_ring_blocks(device, small: bool) -> dict:
    """Two key spans through the ring's block kernels, merged, against one SDPA call."""
    from galvatron_fx.runtime import ring_attention as ra

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, s, d = (1, 4, 256, 64) if small else (2, 16, 4096, 128)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
    scale = d ** -0.5
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
    ref.backward(grad)
    half = s // 2
    spans = [(0, half), (half, s - half)]
    kernel = ra._kernel(q, k[..., :half, :], v[..., :half, :], None, False, scale, 1)
    acc = torch.float32
    out = torch.zeros(b, h, s, d, device=device, dtype=acc)
    lse = torch.full((b, h, s), float("-inf"), device=device, dtype=acc)
    rngs = []
    with torch.no_grad():
        for a, n in spans:
            o_b, l_b, rng = ra._forward_kernel(kernel, q, k.narrow(-2, a, n), v.narrow(-2, a, n), None, False,
                                               scale, 1)
            ra._merge(out, lse, o_b.to(acc), l_b.to(acc), (0, s), None)
            rngs.append(rng)
        o = out.to(dtype)
        dq = torch.zeros_like(q, dtype=acc)
        dks, dvs = [], []
        for (a, n), rng in zip(spans, rngs):
            g = ra._backward_kernel(kernel, grad, q, k.narrow(-2, a, n), v.narrow(-2, a, n), None, o, lse, False,
                                    scale, 1, rng)
            dq += g[0].to(acc)
            dks.append(g[1])
            dvs.append(g[2])
    err = [(o - ref).abs().max().item(), (dq.to(dtype) - q.grad).abs().max().item(),
           (torch.cat(dks, -2) - k.grad).abs().max().item(), (torch.cat(dvs, -2) - v.grad).abs().max().item()]
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    return dict(kernel=kernel, max_abs_err=max(err), errors=err, ok=max(err) <= tol)


def check_attention_rate(device, cluster, small: bool) -> list[dict]:
    """SDPA causal forward + backward, measured against the cluster's attention price."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    rows = []
    for s in ((256, 512) if small else (2048, 8192, 32768)):
        b, h, d = 1, 16, 128
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        seconds = timed(step, device)
        fwd = 4 * b * h * d * s * (s + 1) / 2            # causal: the entries on and below the diagonal
        priced = (cluster.attention_time(fwd, dname, seq=s, head_dim=d)
                  + cluster.attention_time(2.5 * fwd, dname, backward=True, seq=s, head_dim=d))
        rows.append(dict(seq=s, measured_s=seconds, priced_s=priced, measured_tflops=3.5 * fwd / seconds / 1e12,
                         measured_over_priced=seconds / priced))
    return rows


def _llama(small: bool, device):
    import transformers as tf

    kw = (dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, vocab_size=512) if small else
          dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=32000))
    cfg = tf.LlamaConfig(max_position_embeddings=4096, use_cache=False, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(device)


def _batches(small: bool, device, steps: int):
    b, s, vocab = (2, 64, 512) if small else (4, 2048, 32000)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (b, s), generator=g)
        out.append(dict(input_ids=ids.to(device), labels=ids.to(device)))
    return out


def check_training(device, cluster, small: bool) -> dict:
    """Memory and step time of ``gfx.transform``'s program against ``gfx.estimate``, and its bf16
    losses against eager autocast."""
    import galvatron_fx as gfx

    precision = "bf16-mixed" if device.type == "cuda" else "fp32"
    batches = _batches(small, device, 5)
    model = _llama(small, device)
    reference = copy.deepcopy(model)
    gm = gfx.capture(model, (), kwargs=batches[0])
    out = {}
    for ckpt in (False, True):
        plan = gfx.Plan.uniform(gm, 1, global_batch_size=batches[0]["input_ids"].shape[0], ckpt=ckpt,
                                precision=precision)
        est = gfx.estimate(gm, plan, cluster)
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-4)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        losses, turn = [], iter(range(1 << 30))

        def step(dm=dm, opt=opt):
            losses.append(float(dm.train_step(**batches[next(turn) % len(batches)])))
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(2):
            step()
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
        seconds = timed(step, device, repeats=3)
        estimated = est["per_device"]
        est_bytes = (estimated["states_bytes"][0] + estimated["activation_bytes"][0]
                     + estimated["transient_bytes"][0])
        out["ckpt" if ckpt else "plain"] = dict(
            peak_bytes=peak, estimated_bytes=est_bytes, memory_ratio=peak / est_bytes if peak else None,
            step_s=seconds, estimated_step_s=est["step_time_s"], time_ratio=seconds / est["step_time_s"],
            losses=losses[:5])
        del dm, opt, step   # the next plan's peak is measured from what remains
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # eager reference: fp32 parameters, bf16 autocast, fp32 AdamW
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    ref_losses = []
    for batch in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = reference(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(float(loss.detach()))
    ours = out["plain"]["losses"][:len(ref_losses)]
    out["eager_losses"] = ref_losses
    out["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ours, ref_losses))
    return out


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="small sizes: a smoke run of the script")
    args = p.parse_args(argv)
    import torch.distributed as dist

    import galvatron_fx as gfx

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    cluster = gfx.Cluster.preset(preset_for(device))
    t0 = time.perf_counter()
    ring = check_ring_blocks(device, args.small)
    rates = check_attention_rate(device, cluster, args.small)
    training = check_training(device, cluster, args.small)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"priced as {cluster.name}; {time.perf_counter() - t0:.0f} s")
    print(f"ring blocks ({ring['kernel']}): max abs error {ring['max_abs_err']:.2e} ({'ok' if ring['ok'] else 'FAIL'})")
    print_table(["seq", "measured ms", "priced ms", "TFLOP/s", "measured / priced"],
                [[r["seq"], r["measured_s"] * 1e3, r["priced_s"] * 1e3, r["measured_tflops"],
                  r["measured_over_priced"]] for r in rates])
    print_table(["plan", "peak GiB", "estimated GiB", "peak / est", "step ms", "est ms", "measured / est"],
                [[k, v["peak_bytes"] / 2**30, v["estimated_bytes"] / 2**30, v["memory_ratio"] or "-",
                  v["step_s"] * 1e3, v["estimated_step_s"] * 1e3, v["time_ratio"]]
                 for k, v in training.items() if isinstance(v, dict)])
    print(f"bf16 losses vs eager autocast: max relative difference {training['loss_max_rel_diff']:.2e}")
    summary = dict(ring_ok=ring["ok"], ring_max_abs_err=ring["max_abs_err"],
                   attention_measured_over_priced=[r["measured_over_priced"] for r in rates],
                   memory_ratio_plain=training["plain"]["memory_ratio"], memory_ratio_ckpt=training["ckpt"]["memory_ratio"],
                   time_ratio_plain=training["plain"]["time_ratio"], loss_max_rel_diff=training["loss_max_rel_diff"])
    data = dict(summary=summary, ring=ring, attention=rates, training=training, cluster=cluster.name)
    write_json(args.json, data)
    dist.destroy_process_group()
    return data


if __name__ == "__main__":
    main()
