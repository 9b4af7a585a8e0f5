"""Attention and element-wise work priced as the target device runs them: the SDPA kernel choice, its
saved tensors against a live CPU run, transformers captures that keep eager's mask decisions and
record the fused tanh GELU, GPT-2 XL's saved activations against the published formula, dropout as
CUDA's fused kernel, and the cluster's rate curves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import galvatron_fx as gfx
from galvatron_fx.cost.attention_kernels import SdpaCall, attention_flops, attention_kernel, run_stand_in
from galvatron_fx.cost.model import CostModel
from galvatron_fx.cost.op_work import OpWork
from galvatron_fx.solver.strategy import Strategy


def _call(dtype=torch.bfloat16, mask=None, dropout=0.0, causal=True, gqa=False, d=64, kv_heads=4):
    q = torch.empty(2, 4, 32, d, dtype=dtype)
    k = torch.empty(2, kv_heads, 32, d, dtype=dtype)
    return SdpaCall(q, k, k, mask, dropout, causal, gqa)


def test_kernel_choice_follows_the_dispatcher():
    assert attention_kernel("cuda", _call()) == "flash"
    assert attention_kernel("cuda", _call(dtype=torch.float32)) == "efficient"     # flash: 16-bit only
    assert attention_kernel("cuda", _call(mask=torch.zeros(32, 32))) == "efficient"  # a bias
    assert attention_kernel("cuda", _call(d=512)) == "efficient"                     # flash: d <= 256
    assert attention_kernel("cuda-sm70", _call()) == "efficient"                     # no flash before sm80
    assert attention_kernel("cuda", _call(gqa=True, kv_heads=2)) == "flash"          # native grouped heads
    assert attention_kernel("cuda", _call(gqa=True, kv_heads=2, dtype=torch.float32)) == "math"
    assert attention_kernel("cpu", _call()) == "flash_cpu"
    assert attention_kernel("cpu", _call(dropout=0.1)) == "math"
    with pytest.raises(ValueError, match="unknown attention target"):
        attention_kernel("tpu", _call())


def test_causal_fused_kernels_count_the_lower_triangle():
    fwd, bwd = attention_flops(_call(), "flash")
    entries = 2 * 4 * 32 * 33 / 2
    assert fwd == 2 * entries * 128 and bwd == 2 * entries * (3 * 64 + 2 * 64)
    assert attention_flops(_call(), "math")[0] == 2 * (2 * 4 * 32 * 32) * 128     # math masks after computing


def _saved_bytes(fn) -> int:
    seen, total = set(), [0]

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(attn_mask="bool"), dict(dropout_p=0.0, is_causal=False),
                                dict(is_causal=True, enable_gqa=True)])
def test_stand_in_saves_what_the_cpu_kernel_saves(kw):
    """The CPU kernel's saved tensors (live bytes) equal the stand-in's, which the cost model counts
    (grouped key / value heads: the CPU kernel keeps them as given, not repeated)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 32, requires_grad=True)
    kv_heads = 2 if kw.get("enable_gqa") else 4
    k, v = (torch.randn(2, kv_heads, 64, 32, requires_grad=True) for _ in range(2))
    if kw.get("attn_mask") == "bool":
        kw = dict(attn_mask=torch.ones(64, 64, dtype=torch.bool).tril())
    live = _saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, **kw))
    out, kernel, _, _ = run_stand_in("cpu", (q, k, v), kw)
    stand_in = _saved_bytes(lambda: run_stand_in("cpu", (q, k, v), kw))
    assert kernel == "flash_cpu" and out.shape == (2, 4, 64, 32)
    # q, k, v are the caller's (already counted by its producers): compare what the kernel adds
    inputs = sum(t.untyped_storage().nbytes() for t in (q, k, v))
    assert stand_in - inputs == live - inputs


def test_fused_dropout_prices_one_kernel():
    """CUDA's ``native_dropout``: read x, write y and a one-byte mask (9 bytes per fp32 element and
    the mask read once by the multiply), where the CPU's three passes move 28."""
    x = torch.randn(1000, 100)
    per = []
    for fused in (False, True):
        w = OpWork(fused_dropout=fused)
        with w:
            F.dropout(x, 0.1, training=True)
        per.append(sum(w.work.traffic.values()) / x.numel())
    assert per == [28.0, 10.0]


def _gpt2(layers=2, n_embd=1600, heads=25, seq=1024, **kw):
    tf = pytest.importorskip("transformers")
    cfg = tf.GPT2Config(n_embd=n_embd, n_layer=layers, n_head=heads, n_positions=seq, use_cache=False, **kw)
    with torch.device("meta"):
        model = tf.GPT2LMHeadModel(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("method", ["dynamo", "export"])
def test_transformers_capture_runs_the_fused_kernels(method):
    """A transformers config captured by the front ends that trace it (``symbolic_trace`` stops at
    transformers' mask preprocessing): SDPA without a mask (flash on an A100), the tanh GELU as
    one op."""
    model, kw = _gpt2(layers=1, n_embd=64, heads=4, seq=32)
    gm = gfx.capture(model, (), kwargs=kw, method=method)
    cm = CostModel(gm, gfx.Cluster.preset("8xA100-80GB"), precision="bf16-mixed")
    block = [r.index for r in gfx.layers(gm) if r.kind == "block"][0]
    assert set(cm.measure(block).kernels) == {"flash"}
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert any("gelu" in t for t in targets) and not any("tanh" in t for t in targets)


def test_gpt2_xl_saved_activations_match_the_formula():
    """GPT-2 XL's config (gelu_new, dropout 0.1) at 1024 tokens, bf16 on A100s (flash attention):
    Korthikanti et al.'s 34 h bytes per token per layer with the attention's 5 a s of probabilities,
    masks and dropped copy replaced by what flash saves, its fp32 log-sum-exp (4 a)."""
    model, kw = _gpt2()
    gm = gfx.capture(model, (), kwargs=kw)
    cm = CostModel(gm, gfx.Cluster.preset("8xA100-80GB"), precision="bf16-mixed")
    h, a, s = 1600, 25, 1024
    per_token = cm.layer_cost(1, Strategy(1, 1), 1).activation_bytes / s
    formula = 34 * h + 4 * a
    assert abs(per_token / formula - 1) <= 0.15, per_token / h
    assert set(cm.measure(1).kernels) == {"flash"}
    plan = gfx.search(gm, cluster="8xA100-80GB", global_batch_size=8)
    assert plan.extra["attention_target"] == "cuda"
    assert {lp.extra.get("attention_kernel") for lp in plan.layers} >= {"flash"}
    # the same model priced for the CPU: its kernel (math, with dropout) keeps the probabilities
    cpu = CostModel(gm, gfx.Cluster.preset("8xA100-80GB"), precision="bf16-mixed", attention_target="cpu")
    assert cpu.layer_cost(1, Strategy(1, 1), 1).activation_bytes / s > 2 * formula


def test_cluster_rate_curves():
    c = gfx.Cluster.preset("1xH100-80GB")   # one device's curves (more wait for their slowest)
    peak = c.peak_flops["bf16"]
    big = c.gemm_time(1, 8448, 8192, 8192, "bf16")   # 66 x 64 tiles: 32 whole waves of 132 SMs
    assert big == pytest.approx(2 * 8448 * 8192**2 / (peak * c.efficiency))            # compute-bound, tiles full
    # a partial 128-wide tile costs a whole one
    assert c.gemm_time(1, 8448, 8193, 8192, "bf16") == pytest.approx(c.gemm_time(1, 8448, 8320, 8192, "bf16"))
    assert c.gemm_time(1, 8448, 8193, 8192, "bf16") > 1.01 * big
    thin = c.gemm_time(1, 8192, 1, 8192, "bf16")                                    # a matrix-vector product
    assert thin == pytest.approx(c.memory_time(2 * (8192 * 8192 + 8192 + 8192)))
    assert c.memory_time(1e9) == pytest.approx(1e9 / (3350e9 * 0.88))
    long = c.attention_time(1e15, "bf16", seq=65536, head_dim=128)
    short = c.attention_time(1e15, "bf16", seq=512, head_dim=128)
    assert long == pytest.approx(1e15 / (peak * c.attention_efficiency * 65536 / (65536 + 512)))
    assert short == pytest.approx(2 * 1e15 / (peak * c.attention_efficiency))      # half rate at 512 keys
    assert c.attention_target == "cuda" and gfx.Cluster.preset("8xV100-32GB").attention_target == "cuda-sm70"
    assert gfx.Cluster.preset("8xH100-80GB").memory_time(1e9) == c.memory_time(1e9)


def test_a_preset_prices_the_attention_kernel_the_model_calls():
    """``Cluster.preset(..., attention_kernel=...)``: FlashAttention-1 and the Triton kernel at their
    own published rates (FlashAttention-2's plots: 83 and 80 against 189 TFLOP/s on an A100 at 16k),
    the same shape over the sequence; a kernel with no figure on the device is one clear error."""
    from galvatron_fx.errors import ConfigError

    sdpa = gfx.Cluster.preset("8xA100-80GB")
    assert gfx.Cluster.preset("8xA100-80GB", attention_kernel="flash-attn-2").attention_efficiency == \
        sdpa.attention_efficiency
    for kernel, tflops in (("flash-attn-1", 83), ("flash-attn-triton", 80)):
        c = gfx.Cluster.preset("8xA100-80GB", attention_kernel=kernel)
        t = c.attention_time(1e15, "bf16", seq=16384, head_dim=128)
        assert 1e15 / t / 1e12 == pytest.approx(tflops, rel=0.03)
        assert c.gemm_time(1, 4096, 4096, 4096, "bf16") == sdpa.gemm_time(1, 4096, 4096, 4096, "bf16")
    h100 = gfx.Cluster.preset("8xH100-80GB", attention_kernel="flash-attn-1")
    assert 1e15 / h100.attention_time(1e15, "bf16", seq=16384, head_dim=128) / 1e12 == pytest.approx(137, rel=0.03)
    with pytest.raises(ConfigError, match="no published rate prices attention kernel 'flash-attn-1' on V100"):
        gfx.Cluster.preset("8xV100-32GB", attention_kernel="flash-attn-1")
    with pytest.raises(ConfigError, match="use one of: sdpa, flash-attn-2, flash-attn-1, flash-attn-triton"):
        gfx.Cluster.preset("8xA100-80GB", attention_kernel="xformers")


def test_torchtitans_op_policy_keeps_and_recomputes_between_selective_and_full():
    """``ckpt: "selective-op"``: every second linear matmul's output is recomputed, not kept: fewer
    kept bytes than ``"selective"`` by exactly those outputs, a recompute longer by exactly those
    matmuls' time, still shorter than full checkpointing's (live bytes:
    tests/test_memory_equality_dist.py)."""
    from tests.hf_meta import meta_llama

    gm = meta_llama(256, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    cm = CostModel(gm, gfx.Cluster.preset("8xH100-80GB"), precision="bf16-mixed")
    i = 1
    m = cm.measure(i)
    cost = {c: cm.layer_cost(i, Strategy(1, 1, "none", False, c), 2) for c in (False, "selective", "selective-op", True)}
    alt = (m.sac_alt_sharded_elems(2) + m.sac_alt_rep_elems(2) + m.sac_alt_whole_elems(2)) * 2
    assert alt > 0 and cost["selective-op"].activation_bytes == pytest.approx(cost["selective"].activation_bytes - alt)
    assert cost[True].activation_bytes < cost["selective-op"].activation_bytes < cost["selective"].activation_bytes
    assert cost["selective"].bwd_s < cost["selective-op"].bwd_s < cost[True].bwd_s
    gemm, other, memory, attention, _, second = cm._analytic_parts(i, m, 2, Strategy(1, 1))
    fwd = cost[False].fwd_s
    assert cost["selective-op"].bwd_s - cost["selective"].bwd_s == pytest.approx(
        fwd * second / (gemm + other + memory + attention))
    # Llama's block: q, k, v, o, gate, up, down; the 2nd, 4th and 6th are recomputed
    assert 0.2 < second / gemm < 0.6
    assert Strategy(1, 1, "none", False, "selective-op").label.endswith("sac-op")
