"""Expert tensor parallelism: the experts of an ``ep > 1`` layer also sharded over TP.

Mixtral (tests/loops.py) on 4 gloo ranks, TP2 x DP2 with EP2 (``extra["expert_tp"]``, the default):
each rank holds ``[E / ep, F / tp, ...]`` of every grouped expert weight. The training loop of
:mod:`tests.loops` (AdamW over param groups, ``torch.nn.utils.clip_grad_norm_`` clipping every step)
matches one device (fp32, rel 1e-5) in losses, norms and ``full_state_dict()``; the sharded state
dict's owned pieces cover every element once; whole tensors load back into the slices; per-rank
states bytes equal the cost model's estimate and are below the token-split mode's (``expert_tp``
false: experts whole over TP), which still trains exactly (tests/test_training_loop_dist.py's
``tp2xdp2-ep2`` cases run it too).
"""

from __future__ import annotations

import pytest
import torch

from tests import loops
from tests.dist_utils import run_distributed

pytest.importorskip("transformers")

STEPS, TOL, WORLD = 3, 1e-5, 4
EXPERTS = ("gate_up_proj", "down_proj")


def _run(rank, world, method, dispatch, expert_tp):
    import galvatron_fx as gfx
    from galvatron_fx.cost import CostModel
    from galvatron_fx.runtime.groups import Layout
    from galvatron_fx.runtime.params import ParamSpec

    model = loops.moe("mixtral")
    batches = loops.collate(STEPS)
    gm = gfx.capture(model, (), kwargs=batches[0], method=method)
    plan = gfx.Plan.uniform(gm, world, global_batch_size=loops.B, tp=2, dp=2, ep=2)
    for lp in plan.layers:
        if lp.ep > 1:
            lp.extra.update(ep_dispatch=dispatch, expert_tp=expert_tp)
    dm = gfx.transform(gm, plan=plan)
    opt, sched = loops.optimizer(dm.named_parameters())

    def clip():
        return torch.nn.utils.clip_grad_norm_(list(dm.parameters()), loops.CLIP)

    losses, norms = loops.fit(lambda b: dm.train_step(**b).item(), dm.parameters, opt, sched, batches, clip)
    local = {k: tuple(p.to_local().shape) for k, p in dm.named_parameters() if k.endswith(EXPERTS)}
    pieces = []   # what a DCP save writes: (fqn, global offsets, values) of this rank's owned pieces
    for fqn, p in dm.params.named():
        spec = p._gfx
        for piece in spec.pieces(owned=True):
            pieces.append((fqn, tuple(piece.global_offsets), ParamSpec.view(p.to_local(), piece).clone()))
    expert = next(k for k in local)
    whole = dm.state_dict()[expert].full_tensor()
    cm = CostModel(gm, gfx.Cluster.preset(f"{world}xA100-80GB"), reserve_bytes=0)
    predicted = sum(cm.states_bytes(i, s, dp_index=Layout(s.tp, s.dp).batch_index(rank),
                                    tp_index=Layout(s.tp, s.dp).tp_index(rank)).total
                    for i, s in enumerate(plan.layer_strategies()))
    out = dict(losses=losses, norms=norms, full=dm.full_state_dict(), local=local, pieces=pieces,
               whole=(expert, whole), states=dm.states_bytes(opt)["total"], predicted=predicted,
               etp=[lp.expert_tp for lp in plan.layers])
    initial = loops.moe("mixtral").state_dict()   # whole tensors in: each rank keeps its slices
    dm.load_state_dict(initial)
    back = dm.full_state_dict()
    out["reloaded"] = all(torch.equal(v, initial[k]) for k, v in back.items())
    return out


def _check(results, expert_tp):
    ref_losses, ref_norms, ref_params = loops.eager(loops.moe("mixtral"), loops.collate(STEPS))
    assert any(results[0]["etp"]) == expert_tp
    for rank, r in enumerate(results):
        assert loops.rel(r["losses"], ref_losses) < TOL, (rank, r["losses"], ref_losses)
        assert loops.rel(r["norms"], ref_norms) < TOL, (rank, r["norms"], ref_norms)
        assert r["states"] == r["predicted"], (rank, r["states"], r["predicted"])
        assert r["reloaded"], rank
        for k, v in r["full"].items():
            assert torch.equal(v, results[0]["full"][k]), (rank, k)
        name, whole = r["whole"]
        assert torch.equal(whole, r["full"][name]), (rank, name)
        for k, shape in r["local"].items():   # [E / ep, F / tp (x2 fused), H] / [E / ep, H, F / tp]
            full = ref_params[k].shape
            tp = 2 if expert_tp else 1
            want = (full[0] // 2, full[1] // tp, full[2]) if "gate_up" in k else (full[0] // 2, full[1], full[2] // tp)
            assert shape == want, (rank, k, shape, want)
    full = results[0]["full"]
    assert set(full) == set(ref_params)
    diff = torch.cat([(full[k] - ref_params[k]).flatten() for k in full])
    assert diff.norm() / torch.cat([p.flatten() for p in ref_params.values()]).norm() < TOL
    # the owned pieces of all ranks (a DCP save) tile every parameter exactly once, with its values
    for k, v in full.items():
        seen = torch.zeros(v.shape, dtype=torch.int64)
        got = torch.zeros_like(v)
        for r in results:
            for fqn, offsets, vals in r["pieces"]:
                if fqn == k:
                    box = tuple(slice(o, o + s) for o, s in zip(offsets, vals.shape))
                    seen[box] += 1
                    got[box] = vals
        assert bool((seen == 1).all()), k
        assert torch.equal(got, v), k
    return results[0]["states"]


STATES: dict[bool, list[int]] = {}


@pytest.mark.dist
@pytest.mark.parametrize("method,dispatch", [("export", "allgather"),
                                             pytest.param("dynamo", "alltoall", marks=pytest.mark.matrix)])
def test_expert_tp_trains_exactly(method, dispatch):
    results = run_distributed(_run, WORLD, method, dispatch, True, timeout=300)
    _check(results, True)
    STATES.setdefault(True, [r["states"] for r in results])


@pytest.mark.dist
def test_token_split_still_exact_and_larger():
    results = run_distributed(_run, WORLD, "export", "allgather", False, timeout=300)
    _check(results, False)
    split = [r["states"] for r in results]
    etp = STATES.get(True) or [r["states"] for r in run_distributed(_run, WORLD, "export", "allgather", True,
                                                                    timeout=300)]
    print("states bytes per rank: expert TP", etp, "token split", split)
    assert all(a < b for a, b in zip(etp, split)), (etp, split)
