"""Profiled mode: real timing with TP-sharded shapes, and the on-disk cache."""

from __future__ import annotations

import json

import pytest

import galvatron_fx as gfx
from galvatron_fx.cluster import Cluster
from galvatron_fx.cost import PROFILE_CALLS, CostModel
from galvatron_fx.passes.cost_annotation import CostAnnotationPass
from galvatron_fx.solver.strategy import Strategy


def test_profiled_cache_hit(tmp_path):
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=2)
    gm = gfx.capture(model, args, method="fx")
    cluster = Cluster.preset("2xA100-80GB")
    opts = dict(mode="profiled", cache_dir=tmp_path, profile_sizes=(1, 2))
    strategies = [Strategy(1, 2), Strategy(2, 1), Strategy(2, 1, ckpt=True)]
    start = PROFILE_CALLS["count"]
    gm = CostAnnotationPass(cluster, **opts)(gm).graph_module
    cm = gm.meta["galvatron"].cost_model
    first = [cm.layer_cost(i, s, 2) for i in range(len(cm.layers)) for s in strategies]
    calls = PROFILE_CALLS["count"] - start
    # pre, block (one signature for both blocks), post x 2 TP degrees: checkpointing reuses the
    # plain profile (backward + recomputed forward)
    assert calls == 3 * 2
    assert all(c.fwd_s > 0 for c in first[3:])
    records = [json.loads(p.read_text()) for p in (tmp_path / "layers").glob("*.json")]
    assert len(records) == 6
    plain, ckpt = cm.layer_cost(1, strategies[1], 2), cm.layer_cost(1, strategies[2], 2)
    assert ckpt.fwd_s == plain.fwd_s and ckpt.bwd_s == pytest.approx(plain.bwd_s + plain.fwd_s)
    assert {r["method"] for r in records if r["tp"] == 2} == {"sharded"}  # TP shapes really ran

    again = CostModel(gm, cluster, **opts)
    second = [again.layer_cost(i, s, 2) for i in range(len(again.layers)) for s in strategies]
    assert PROFILE_CALLS["count"] - start == calls  # nothing re-profiled
    assert second == first


def test_annotation_attaches_costs():
    model, args = gfx.models.build("gpt-tiny", device="meta")
    gm = gfx.capture(model, args, method="fx")
    gm = CostAnnotationPass(Cluster.preset("8xA100-80GB"))(gm).graph_module
    info = gm.meta["galvatron"]
    assert len(info.costs) == len(info.layers)
    block = info.costs[1]
    assert block["fwd_flops_sharded"][0] > 0 and block["params_sharded_tp2"] > 0
    assert len(info.cost_model.measures) == 3  # identical blocks measured once


def test_layers_are_timed_as_a_step_runs_them():
    """time_layer runs CHAIN forwards, holding their activations, before their backwards (a layer
    alone in a loop reuses its freed, cache-warm memory and reads low)."""
    import itertools

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from galvatron_fx.cost.profile import CHAIN, time_layer

    class Phases(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.log = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.log.append(torch._C._current_graph_task_id() != -1)   # inside a backward
            return func(*args, **(kwargs or {}))

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1, batch=2)
    gm = CostAnnotationPass(Cluster.preset("2xA100-80GB"))(gfx.capture(model, args, method="fx")).graph_module
    cm = gm.meta["galvatron"].cost_model
    layer = cm.graphs[cm.layers[1].signature]
    counts = {}
    for chain in (1, CHAIN):
        with Phases() as mode:
            fwd, bwd = time_layer(layer, 2, repeats=1, warmup=0, chain=chain)
        runs = [(inside, len(list(ops))) for inside, ops in itertools.groupby(mode.log)]
        # every forward, then the backwards, each after its output gradient's one op
        assert [inside for inside, _ in runs] == [False, True] + [False, True] * (chain - 1)
        assert all(n == 1 for inside, n in runs[2:] if not inside) and fwd > 0 and bwd > 0
        counts[chain] = runs[0][1]
    assert CHAIN > 1 and counts[CHAIN] == CHAIN * (counts[1] - 1) + 1
