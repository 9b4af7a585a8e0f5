"""Export: a transformers Llama trained under TP2 on 2 gloo ranks, checkpointed with its config and
consolidated in one process, loads with ``AutoModelForCausalLM.from_pretrained`` and gives the
distributed run's final eval loss."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

STEPS = 3


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(cfg), ids


def _train_save(rank, world, path):
    import galvatron_fx as gfx

    model, ids = _llama()
    gm = gfx.capture(model, (), kwargs=dict(input_ids=ids, labels=ids), method="dynamo")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, tp=2, dp=1, global_batch_size=4))
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    for _ in range(STEPS):
        dm.train_step(input_ids=ids, labels=ids)
        opt.step()
    gfx.checkpoint.save(dm, opt, path, step=STEPS, config=model.config)
    return dm.eval_step(input_ids=ids, labels=ids).item()


@pytest.mark.dist
def test_llama_tp2_checkpoint_exports_to_from_pretrained(tmp_path):
    from galvatron_fx import checkpoint
    from galvatron_fx.cli import main

    path = str(tmp_path / "ckpt")
    dist_loss = run_distributed(_train_save, 2, path, timeout=300)[0]
    out = tmp_path / "hf"
    assert main(["consolidate", path, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    fresh, ids = _llama()
    assert type(model) is type(fresh)
    trained = checkpoint.consolidate(path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    assert any(not torch.equal(fresh.state_dict()[k], v) for k, v in trained.items())   # really trained
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    print(f"from_pretrained eval loss {loss:.6f}, distributed TP2 eval loss {dist_loss:.6f}")
    assert abs(loss - dist_loss) <= 1e-5 * abs(dist_loss), (loss, dist_loss)
