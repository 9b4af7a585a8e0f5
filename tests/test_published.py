"""benchmarks/published.py: a published row written as its plan, estimated in its own unit; the
summary keys the benchmark reports; further rows from a file."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
published = pytest.importorskip("published")
pytest.importorskip("transformers")


def test_units_and_partition():
    row = dict(unit="megatron_tflops", arch=published.megatron_gpt(2304, 24, 24), seq=2048, gbs=512)
    # eq. (3): 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs per iteration, per GPU per second
    flops = 96 * 512 * 2048 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert published.in_unit(row, 2.0, 32) == pytest.approx(flops / 2.0 / 32 / 1e12)
    assert published.throughput_ratio(dict(unit="s/iteration"), 2.0, 1.0) == 0.5
    # Megatron's stages: 128 blocks over 64 stages, the embedding first, the head last
    stages = published.block_stages(130, 64)
    assert stages[0] == (0, 2) and stages[1] == (3, 4) and stages[-1] == (127, 129) and len(stages) == 64


def test_a_row_estimates_and_reports(tmp_path):
    extra = tmp_path / "rows.json"
    extra.write_text(json.dumps([dict(id="held-back", source="a reviewer's table", unit="s/iteration",
                                      arch=published.megatron_gpt(1024, 2, 16), cluster="8xA100-80GB", seq=1024,
                                      gbs=8, tp=8, ckpt=True, micro_batch=8, published=0.01)]))
    out = tmp_path / "out.json"
    data = published.main(["--rows", str(extra), "--only", "held-back", "--json", str(out)])
    (row,) = data["rows"]
    assert row["id"] == "held-back" and row["fits"] and row["estimated"] > 0
    assert row["ratio"] == pytest.approx(0.01 / row["estimated"])
    summary = json.loads(out.read_text())["summary"]
    assert {"rows", "sources", "within_15pct_fraction", "geomean_ratio", "worst_ratio"} <= set(summary)
    assert summary["rows"] == 1 and summary["sources"] == 1


def test_gpu_check_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py's smoke mode on this CPU (a one-rank gloo world): the ring's block
    kernels merge to SDPA's result, and the program's fp32 losses equal eager's."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_check.py")
    out = tmp_path / "gpu.json"
    env = dict(os.environ, MASTER_PORT="29547")
    r = subprocess.run([sys.executable, script, "--device", "cpu", "--small", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["ring_ok"] and summary["loss_max_rel_diff"] < 1e-5


def test_the_fused_loss_stand_in_is_cross_entropy_and_keeps_no_vocab_sized_gradients():
    """llm-foundry's rows price flash-attn's fused cross-entropy (``benchmarks/_fused_loss.py``):
    torch's value and gradient (ignored tokens included), and a head whose backward holds no
    ``[tokens, vocab]`` buffer beside the kept logits, where torch's holds two fp32 ones (the
    backward's working set the cost model measures, ``bwd_excess_elems``)."""
    import torch
    from _fused_loss import fused_cross_entropy

    import galvatron_fx as gfx
    from galvatron_fx.cost import CostModel

    torch.manual_seed(0)
    x = torch.randn(37, 101, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 101, (37,))
    t[::5] = -100
    ref = x.detach().clone().requires_grad_()
    loss, want = fused_cross_entropy(x.clone(), t), torch.nn.functional.cross_entropy(ref, t)
    loss.backward()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.allclose(x.grad, ref.grad, atol=1e-9)

    arch = published.mpt(64, 2, 4)
    excess = {}
    for loss_kind in ("fused", "torch"):
        model, kwargs = published.build(dict(arch, vocab=4096, loss=loss_kind), 512)
        cm = CostModel(gfx.capture(model, (), kwargs=kwargs), gfx.Cluster.preset("8xA100-80GB"))
        excess[loss_kind] = cm.measure(len(cm.layers) - 1).bwd_excess_elems(1)
    tokens_by_vocab = 511 * 4096   # transformers' loss drops the last position's logits
    assert excess["torch"] >= 2 * 2 * tokens_by_vocab      # two fp32 gradients, in bf16 elements
    # the fused loss: the head weight's gradient as it is made (4096 x 64), nothing vocab-sized per token
    assert excess["fused"] <= 4096 * 64 * 1.05


def test_torchtitan_attention_is_sdpa_with_the_key_value_heads_repeated():
    import torch
    import transformers as tf

    import galvatron_fx as gfx
    from galvatron_fx.planner import cost_model_for

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, use_cache=False)
    cfg._attn_implementation = "sdpa"
    reference = tf.LlamaForCausalLM(cfg)
    titan = tf.LlamaForCausalLM(cfg.__class__(**{**cfg.to_dict()}))
    titan.load_state_dict(reference.state_dict())
    titan.config._attn_implementation = published._titan_llama.register()
    ids = torch.randint(0, 128, (2, 16))
    a, b = reference(input_ids=ids, labels=ids), titan(input_ids=ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    # SDPA receives (saves, and under CP exchanges) the query heads' worth of keys and values
    cluster = gfx.Cluster.preset("8xH100-80GB")
    heads = {name: cost_model_for(gfx.capture(m, (), kwargs=dict(input_ids=ids, labels=ids)), cluster,
                                  precision="bf16-mixed").attention(1).kv_heads
             for name, m in (("sdpa", reference), ("titan", titan))}
    assert heads == {"sdpa": 2, "titan": 8}


def test_llm_foundry_attention_is_sdpa_between_a_gather_and_a_scatter_of_the_rows():
    import torch
    import transformers as tf

    import galvatron_fx as gfx
    from galvatron_fx.planner import cost_model_for

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    reference = tf.GPT2LMHeadModel(cfg)
    foundry = tf.GPT2LMHeadModel(cfg.__class__(**cfg.to_dict()))
    foundry.load_state_dict(reference.state_dict())
    foundry.config._attn_implementation = published._foundry_flash.register()
    ids = torch.randint(0, 128, (2, 16))
    a, b = reference(input_ids=ids, labels=ids), foundry(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(b.loss, a.loss)
    for p, q in zip(reference.parameters(), foundry.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    # the gathers and the scatter move memory on every layer: more bytes than sdpa's, the same FLOPs
    cluster = gfx.Cluster.preset("8xH100-80GB")
    measured = {}
    for name, m in (("sdpa", reference), ("foundry", foundry)):
        cm = cost_model_for(gfx.capture(m, (), kwargs=dict(input_ids=ids, labels=ids)), cluster, precision="bf16-mixed")
        m1 = cm.measure(1)
        measured[name] = (m1.fwd_traffic_sharded(2) + m1.fwd_traffic_rep(2), m1.bwd_traffic(2),
                          m1.fwd_flops_sharded(2) + m1.fwd_flops_rep(2))
    rows = 2 * 16 * 64 * 2   # one [batch * seq, hidden] bf16 tensor
    assert measured["foundry"][2] == measured["sdpa"][2]
    # forward: three gathers (read + write) and the output's zero fill and scatter, at least
    assert measured["foundry"][0] - measured["sdpa"][0] >= 3 * 2 * rows + 3 * rows
    assert measured["foundry"][1] > measured["sdpa"][1]
