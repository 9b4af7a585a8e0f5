"""The per-stage strategy space: enumeration, each pruning rule, counts."""

from __future__ import annotations

import pytest

from galvatron_fx.errors import ConfigError
from galvatron_fx.solver.strategy import (
    RULES,
    Strategy,
    candidate_counts,
    paper_comparable_count,
    rejecting_rules,
    strategy_space,
)


def test_strategy_label_and_devices():
    s = Strategy(2, 4, "zero3", True, True)
    assert s.label == "tp2·dp4·zero3·sp·ckpt" and str(s) == s.label and s.devices == 8
    assert Strategy(1, 8).label == "tp1·dp8"
    with pytest.raises(ConfigError):
        Strategy(2, 4, "zero1")
    with pytest.raises(ConfigError):
        Strategy(0, 4)


def test_rules_are_named_and_documented():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert set(names) >= {"power_of_two", "tp_within_node", "tp_divides_heads", "tp_divides_hidden",
                          "max_tp", "sdp_needs_dp", "sp_needs_tp", "sp_switch", "sdp_switch",
                          "ckpt_switch", "ep_degrees", "cp_degrees", "cp_kind_needs_cp", "cp_without_ep",
                          "ulysses_divides_heads"}
    assert all(r.doc for r in RULES)


def test_space_invariants():
    for n in (1, 2, 4, 8, 16, 64):
        space = strategy_space(n)
        assert len(space) == len(set(space))
        for s in space:
            assert s.devices == n and rejecting_rules(s, n) == []


@pytest.mark.parametrize("strategy, kwargs, rule", [
    (Strategy(2, 3), {}, "power_of_two"),
    (Strategy(16, 1), {}, "tp_within_node"),
    (Strategy(4, 1), {"devices_per_node": 2}, "tp_within_node"),
    (Strategy(4, 2), {"heads": 6}, "tp_divides_heads"),
    (Strategy(4, 2), {"hidden": 1026}, "tp_divides_hidden"),
    (Strategy(4, 2), {"max_tp": 2}, "max_tp"),
    (Strategy(8, 1, "zero3"), {}, "sdp_needs_dp"),
    (Strategy(1, 8, "none", sp=True), {}, "sp_needs_tp"),
    (Strategy(1, 8, ckpt=True), {"ckpt": False}, "ckpt_switch"),
    (Strategy(2, 4, sp=True), {"sp": False}, "sp_switch"),
    (Strategy(2, 4, "zero2"), {"zero2": False}, "sdp_switch"),
    (Strategy(2, 4, "zero3"), {"zero3": False}, "sdp_switch"),
])
def test_each_rule_prunes(strategy, kwargs, rule):
    assert rejecting_rules(strategy, **kwargs) == [rule]
    assert strategy not in strategy_space(strategy.devices, **kwargs)


def test_rules_relaxed():
    assert Strategy(16, 1) in strategy_space(16, allow_cross_node_tp=True)
    assert Strategy(2, 3) in strategy_space(6, power_of_two=False)
    assert Strategy(2, 3) not in strategy_space(6)
    assert rejecting_rules(Strategy(3, 2), power_of_two=False) == ["tp_within_node"]  # 8 % 3 != 0
    assert Strategy(3, 2) in strategy_space(6, power_of_two=False, devices_per_node=6)
    assert rejecting_rules(Strategy(2, 2), 8) == ["devices_match"]


def test_dp1_canonicalised_to_plain():
    space = strategy_space(1)
    assert space == [Strategy(1, 1, "none", False, c) for c in (False, "selective", True)]
    assert all(s.sdp == "none" for s in strategy_space(8) if s.dp == 1)


def test_order_is_deterministic():
    space = strategy_space(8)
    assert space == strategy_space(8)
    assert [s.tp for s in space] == sorted(s.tp for s in space)
    assert space[0] == Strategy(1, 8) and space[-1] == Strategy(8, 1, "none", True, True)


def test_heads_and_hidden_limit_tp():
    assert {s.tp for s in strategy_space(8, heads=12, hidden=768)} == {1, 2, 4}
    assert {s.tp for s in strategy_space(8, heads=25)} == {1}


def test_candidate_counts_documented():
    # HSDP from two nodes on; CPU offload doubles the ZeRO strategies (where the cluster has a host)
    assert candidate_counts() == {1: 3, 2: 21, 4: 51, 8: 81, 16: 165, 64: 285}
    assert candidate_counts(more={"offload": ("none",)}) == {1: 3, 2: 15, 4: 33, 8: 51, 16: 93, 64: 153}
    old = {"hsdp": False, "offload": ("none",)}
    assert candidate_counts(ckpt=[False, True], more=old) == {1: 2, 2: 10, 4: 22, 8: 34, 16: 42, 64: 42}
    assert candidate_counts(ckpt=["selective"]) == candidate_counts(ckpt=False)
    # torchtitan's op policy only where asked for: the searched default stays none / selective / full
    assert candidate_counts(ckpt=["selective-op"]) == candidate_counts(ckpt=False)
    assert candidate_counts(ckpt=[False, "selective", "selective-op", True])[8] == 81 + 27
    assert candidate_counts(ckpt=False, more=old) == {1: 1, 2: 5, 4: 11, 8: 17, 16: 21, 64: 21}
    assert candidate_counts(ckpt=False, more={"hsdp": False}) == {1: 1, 2: 7, 4: 17, 8: 27, 16: 35, 64: 35}
    assert paper_comparable_count(8) == 16  # + 6 DP-inner placements = the paper's 22
    assert paper_comparable_count(8, zero2=True) == 22
