"""Mixture-of-experts written as a loop over an ``nn.ModuleList`` of experts (:mod:`tests.loop_moe`:
``torch.where(mask[e])``, ``out.index_add_``): captured by the three front ends, found as one
experts block (``galvatron_fx/sharding/experts.py``, kind ``"loop"``), priced by the cost model and
trained under DP2+EP2 on 2 gloo ranks, each rank holding only its two of the four experts of each
layer: losses, clip norms, final parameters and ``full_state_dict()`` against one device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import galvatron_fx as gfx
from galvatron_fx.cost import CostModel
from galvatron_fx.errors import CaptureError
from galvatron_fx.sharding.experts import MoEBlock, NotAnExpertsBlock, layer_blocks
from galvatron_fx.solver.strategy import Strategy
from tests import loop_moe, loops
from tests.dist_utils import run_distributed

STEPS = 4
TOL = 1e-5


def _capture(model, method: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a static batch (fx) is noted, not an error
        return gfx.capture(model, (), kwargs=loops.collate(1)[0], method=method)


@pytest.mark.parametrize("method", ["fx", "dynamo", "export"])
def test_the_loop_is_one_experts_block(method):
    gm = _capture(loop_moe.build(), method)
    assert [r.name for r in gm.meta["galvatron"].layers] == ["pre", "layers.0", "layers.1", "post"]  # experts: no layers
    blocks = layer_blocks(gm)
    assert sorted(blocks) == [1, 2]
    for i, (b,) in blocks.items():
        assert isinstance(b, MoEBlock) and b.kind == "loop", b
        assert (b.num_experts, b.top_k, b.path) == (loop_moe.E, loop_moe.K, f"layers.{i - 1}.moe.experts")
        assert [sorted(p.target for p in ps) for ps in b.loop.params] == [
            [f"layers.{i - 1}.moe.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3")] for e in range(loop_moe.E)]
        assert not b.index.meta["val"].is_floating_point()
        assert tuple(b.weights.meta["val"].shape) == tuple(b.index.meta["val"].shape) == (loops.B * loops.S, loop_moe.K)
        assert tuple(b.x.meta["val"].shape) == tuple(b.output.meta["val"].shape) == (loops.B * loops.S, loop_moe.H)
        assert [r.args[1].target for r in b.routers()] == [f"layers.{i - 1}.moe.gate.weight"]
        assert len(b.grouped) == 3 * loop_moe.E   # every expert's three linears
    # the cost model: the same MoE terms as a grouped block (so the search offers ep on it)
    cm = CostModel(gm, gfx.Cluster.preset("8xA100-80GB"), reserve_bytes=0, precision="fp32")
    ex = cm.experts(1)
    assert (ex.num_experts, ex.top_k, ex.hidden, ex.tokens_per_sample) == ((loop_moe.E,), loop_moe.K, loop_moe.H, loops.S)
    assert len(ex.fqns) == 3 * loop_moe.E and ex.allows(2) and not ex.allows(3)
    one, two = (cm.states_bytes(1, Strategy(1, 2, ep=e)) for e in (1, 2))
    expert = 3 * loop_moe.H * loop_moe.FF * 4   # fp32 bytes of one expert's weights
    assert one.params - two.params == loop_moe.E // 2 * expert   # each EP rank: half the experts, whole
    m = cm.measure(1)   # uniform routing: the experts see tokens x k rows in all
    assert m.fwd_flops_expert(1) >= loops.S * loop_moe.K * 2 * 3 * loop_moe.H * loop_moe.FF


class _EqMask(loop_moe.LoopMoE):
    """The rows of expert ``e`` as ``torch.where(selected == e)``: a data-dependent count galvatron_fx
    cannot estimate (no one-hot expert mask)."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w, selected = torch.topk(F.softmax(self.gate(x), dim=1, dtype=torch.float), loop_moe.K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(loop_moe.E):
            top_x, idx = torch.where(selected == e)
            out.index_add_(0, top_x, self.experts[e](x[top_x]) * w[top_x, idx, None])
        return out.view(b, s, h)


@pytest.mark.parametrize("method", ["fx", "dynamo", "export"])
def test_rows_without_a_one_hot_mask_are_refused(method):
    model = loop_moe.build()
    for block in model.layers:
        block.moe.__class__ = _EqMask
    with pytest.raises(CaptureError, match=r"data-dependent shape .*fix: write the expert mask that way"):
        _capture(model, method)


def test_experts_of_different_shapes_are_not_split():
    model = loop_moe.build()
    model.layers[0].moe.experts[1].w1 = torch.nn.Linear(loop_moe.H, loop_moe.FF, bias=True)
    gm = _capture(model, "fx")
    (bad,) = layer_blocks(gm)[1]
    assert isinstance(bad, NotAnExpertsBlock) and "differ in their parameters" in str(bad)
    cm = CostModel(gm, gfx.Cluster.preset("8xA100-80GB"), reserve_bytes=0, precision="fp32")
    assert cm.experts(1) is None and cm.experts(2) is not None   # the search offers ep on layer 2 only


def _train(rank, world, method, dispatch):
    """DP2+EP2, the user's loop (AdamW param groups, torch's clip_grad_norm_): losses, norms,
    full state, this rank's parameter names, states bytes and their estimate."""
    from galvatron_fx.runtime.experts import ExpertParallel
    from galvatron_fx.runtime.groups import Layout

    batches = loops.collate(STEPS)
    gm = _capture(loop_moe.build(), method)
    plan = gfx.Plan.uniform(gm, world, global_batch_size=loops.B, dp=2, ep=2)
    for lp in plan.layers:
        lp.extra["ep_dispatch"] = dispatch
    dm = gfx.transform(gm, plan=plan)
    opt, sched = loops.optimizer(dm.named_parameters())
    losses, norms = loops.fit(lambda b: dm.train_step(**b).item(), dm.parameters, opt, sched, batches)
    cm = CostModel(gm, gfx.Cluster.preset(f"{world}xA100-80GB"), reserve_bytes=0, precision="fp32")
    predicted = sum(cm.states_bytes(i, s, dp_index=Layout(s.tp, s.dp).batch_index(rank)).total
                    for i, s in enumerate(plan.layer_strategies()))
    blocks = [m for m in dm.modules() if isinstance(m, ExpertParallel)]
    full = dm.full_state_dict()
    dm.load_state_dict(full)   # strict: the other rank's experts are known, not unexpected
    return dict(losses=losses, norms=norms, full=full, names=[k for k, _ in dm.named_parameters()],
                state_dict=set(dm.state_dict()), states=dm.states_bytes(opt)["total"], predicted=predicted,
                blocks=len(blocks), dispatch={m.dispatch for m in blocks})


@pytest.mark.dist
@pytest.mark.parametrize("method,dispatch", [("fx", "allgather"), ("export", "alltoall")])
def test_dp2_ep2_trains_like_one_device(method, dispatch):
    results = run_distributed(_train, 2, method, dispatch, timeout=300)
    ref_losses, ref_norms, ref_params = loops.eager(loop_moe.build(), loops.collate(STEPS))
    init = dict(loop_moe.build().named_parameters())
    for rank, r in enumerate(results):
        assert r["blocks"] == 2 and r["dispatch"] == {dispatch}, rank
        assert loops.rel(r["losses"], ref_losses) < TOL, (rank, r["losses"], ref_losses)
        assert loops.rel(r["norms"], ref_norms) < TOL, (rank, r["norms"], ref_norms)
        # only this rank's experts exist here: experts 2 * rank and 2 * rank + 1 of each layer
        held = {n.split(".")[4] for n in r["names"] if ".experts." in n}
        assert held == {str(2 * rank), str(2 * rank + 1)}, (rank, held)
        assert len(r["names"]) == len(ref_params) - 2 * 3 * loop_moe.E // 2
        assert r["state_dict"] == set(r["names"])   # DCP's entries: this rank's experts only
        assert r["states"] == r["predicted"], (rank, r["states"], r["predicted"])
        full = r["full"]
        assert set(full) == set(ref_params)
        for k, v in full.items():
            assert torch.equal(v, results[0]["full"][k]), (rank, k)
            assert not torch.equal(v, init[k].detach()), k   # every parameter trained
        diff = torch.cat([(full[k] - ref_params[k]).flatten() for k in full])
        assert diff.norm() / torch.cat([p.flatten() for p in ref_params.values()]).norm() < TOL
