"""A transformers GPT-2 (small config, no download) captured by dynamo trains under TP2 and ZeRO-3
on 2 gloo ranks like one device; TP really shards its Conv1D MLP (addmm on an [in, out] weight)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training import EPS, LR, STEPS, TOL, reference

# NOTE: HF models under TP / ZeRO through dynamo are also covered in CI by tests/test_frontend_matrix_dist.py
# and tests/test_hf_doors_dist.py; these run with --run-matrix
pytestmark = pytest.mark.matrix

transformers = pytest.importorskip("transformers")


class _Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids):
        return self.m(input_ids=ids, labels=ids).loss


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return _Loss(transformers.GPT2LMHeadModel(cfg)), ids


def test_gpt2_blocks_have_tensor_parallel_mlps():
    import galvatron_fx as gfx
    from galvatron_fx.sharding import analyze

    model, ids = _gpt2()
    gm = gfx.capture(model, (ids,), method="dynamo")
    blocks = [la.index for la in gfx.layers(gm) if la.kind == "block"]
    result = analyze(gm, {i: (2, False) for i in blocks})
    for i in blocks:
        assert result[i].column and result[i].row, gfx.layers(gm)[i].name
        assert any(s.fqn.endswith("mlp.c_fc.weight") for s in result[i].param_shards.values())


def _train(rank, world, tp, sdp):
    import galvatron_fx as gfx

    model, ids = _gpt2()
    ref_losses, ref_params = reference(copy.deepcopy(model), (ids,))
    gm = gfx.capture(model, (ids,), method="dynamo")
    plan = gfx.Plan.uniform(gm, world, tp=tp, dp=world // tp, sdp=sdp, global_batch_size=4)
    dm = gfx.transform(gm, plan=plan)
    opt = dm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        losses.append(dm.train_step(ids).item())
        opt.step()
    sd = dm.full_state_dict()
    diff = torch.cat([(sd[k] - p).flatten() for k, p in ref_params.items()])
    ref = torch.cat([p.flatten() for p in ref_params.values()])
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), (diff.norm() / ref.norm()).item()


@pytest.mark.dist
@pytest.mark.parametrize("tp, sdp", [(2, "none"), (1, "zero3")])
def test_gpt2_dynamo_trains_like_one_device(tp, sdp):
    for loss_err, param_err in run_distributed(_train, 2, tp, sdp, timeout=120):
        assert loss_err <= TOL and param_err <= TOL, (loss_err, param_err)
