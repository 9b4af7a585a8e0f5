"""passes/stage_split.py: running the stage graphs one after another computes what the whole graph does."""

from __future__ import annotations

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.errors import ConfigError
from galvatron_fx.passes.stage_split import cross_stage_params, stage_info, stage_split

T5 = dict(layers=4, hidden=32, heads=4, ffn_hidden=64, seq_len=16, tgt_len=8, vocab=64, batch=4)


def _chain(gm, args, stages):
    carry = ()
    for k in range(len(stages)):
        sg = stage_split(gm, stages, k)
        info = stage_info(sg)
        assert [r.index for r in sg.meta["galvatron"].layers] == list(range(info.last - info.first + 1))
        carry = sg(*[args[i] for i in info.local_inputs], *carry)
    return carry


@pytest.mark.parametrize("name, overrides, stages", [
    ("gpt-tiny", dict(layers=2, batch=4), [(0, 1), (2, 3)]),
    ("t5-large-32", T5, [(0, 3), (4, 6)]),
    ("t5-large-32", T5, [(0, 1), (2, 2), (3, 4), (5, 6)]),
])
def test_stages_compose_to_the_graph(name, overrides, stages):
    model, args = gfx.models.build(name, device="cpu", **overrides)
    gm = gfx.capture(model, args, method="fx")
    assert torch.equal(_chain(gm, args, stages), gm(*args))


def test_t5_boundary_values():
    model, args = gfx.models.build("t5-large-32", device="cpu", **T5)
    gm = gfx.capture(model, args, method="fx")
    info = stage_info(stage_split(gm, [(0, 3), (4, 6)], 1))
    got = {cv.name: (cv.batched, cv.requires_grad) for cv in info.received}
    # tied weight and decoder position bias: replicated, with gradient; encoder output and decoder input: batched
    assert got == {"shared_weight": (False, True), "mul_11": (True, True), "embedding_2": (True, True),
                   "to_6": (False, True)}
    assert info.local_inputs == [1]   # labels only
    first = stage_info(stage_split(gm, [(0, 3), (4, 6)], 0))
    assert [cv.name for cv in first.sent] == [cv.name for cv in info.received]
    assert cross_stage_params(gm, [(0, 3), (4, 6)]) == {"shared.weight": [0, 3, 6]}
    params = {n for n, _ in stage_split(gm, [(0, 3), (4, 6)], 1).named_parameters()}
    assert "shared.weight" not in params and params


def test_bad_stages():
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=2, batch=4)
    gm = gfx.capture(model, args, method="fx")
    with pytest.raises(ConfigError):
        stage_split(gm, [(0, 1), (3, 3)], 0)
