"""Single-process checks of the transform's pieces: layer split, rank layout, reshard planning."""

from __future__ import annotations

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.errors import ConfigError
from galvatron_fx.passes.split_layers import split_layers
from galvatron_fx.runtime.groups import Layout
from galvatron_fx.runtime.reshard import gather, plan_batched, take


def test_transform_needs_distributed():
    from galvatron_fx.parallelize import transform

    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1)
    gm = gfx.capture(model, args, method="fx")
    with pytest.raises(ConfigError, match="torch.distributed"):
        transform(gm, plan=gfx.Plan.uniform(gm, 1))


@pytest.mark.parametrize("name, overrides", [
    ("gpt-tiny", dict(layers=2)),
    ("bert-huge-32", dict(layers=2, hidden=32, heads=2, seq_len=8, vocab=40)),
])
def test_split_layers_keeps_semantics_and_fqns(name, overrides):
    model, args = gfx.models.build(name, device="cpu", **overrides)
    gm = gfx.capture(model, args)
    top = split_layers(gm)
    n = len(gfx.layers(gm))
    assert all(f"self.layers_{i}(" in top.code for i in range(n))
    torch.testing.assert_close(top(*args), model(*args))
    # every parameter lives in exactly one layer, under its original name
    names = {k.split(".", 1)[1] for k, _ in top.named_parameters()}
    assert names == {k for k, _ in model.named_parameters()}


def test_rank_layout():
    lay = Layout(tp=2, dp=2)
    assert [lay.tp_ranks(r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [lay.dp_ranks(r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [lay.batch_index(r) for r in range(4)] == [0, 0, 1, 1]


def test_reshard_plans():
    dp4, tp2, tp4 = Layout(1, 4), Layout(2, 2), Layout(4, 1)
    assert plan_batched(dp4, dp4, 0) == []
    # dp4 -> tp2·dp2: rank 3 (slice 3 of 4) gathers slices 2, 3 with rank 2
    assert plan_batched(dp4, tp2, 3) == [(gather, ((2, 3), 1, 0))]
    # tp4 -> tp2·dp2: rank 3 keeps half 1 of the whole batch; backward gathers with rank 1
    assert plan_batched(tp4, tp2, 3) == [(take, ((1, 3), 1, 0))]
    # sp on <-> off: the tensor-parallel pass converts sequence shards inside the layers, so the
    # boundary only ever changes the batch slice
    assert plan_batched(Layout(2, 2, True), tp2, 1) == []
    assert plan_batched(Layout(2, 2, True), dp4, 1) == [(take, ((0, 1), 1, 0))]
