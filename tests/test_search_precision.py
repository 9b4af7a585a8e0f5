"""Precision is part of the plan: defaults by cluster, the cost model prices it, the JSON keeps it."""

from __future__ import annotations

import dataclasses
import json

import pytest

import galvatron_fx as gfx
from galvatron_fx.cli import main
from galvatron_fx.cluster import default_precision
from galvatron_fx.cost import CostModel
from galvatron_fx.planner import resolve_precision
from galvatron_fx.solver.strategy import Strategy

TINY = dict(layers=2, hidden=64, heads=4, seq_len=32, vocab=128, batch=8)


@pytest.fixture(scope="module")
def tiny():
    model, args = gfx.models.build("gpt-tiny", device="meta", **TINY)
    return gfx.capture(model, args, method="fx")


@pytest.mark.parametrize("cluster, precision", [
    ("8xA100-80GB", "bf16-mixed"), ("2x8xA100-40GB", "bf16-mixed"), ("8xH100-80GB", "bf16-mixed"),
    ("4xH200-141GB", "bf16-mixed"), ("8xV100-32GB", "fp16-mixed"), ("8xRTX-TITAN-24GB", "fp16-mixed"),
    ("local-2x1xcpu", "fp32"), ("local-1x2xcuda", "fp32"), ("custom", "fp32"), (None, "fp32"),
    ({"name": "4xA100-80GB"}, "bf16-mixed"), ({}, "fp32"),
])
def test_default_precision_by_cluster(cluster, precision):
    assert default_precision(cluster) == precision
    if isinstance(cluster, str) and "x" in cluster and not cluster.startswith("local"):
        assert default_precision(gfx.Cluster.preset(cluster)) == precision


def test_cli_default_on_h100_is_bf16_mixed(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "llama-7b", "--cluster", "8xH100-80GB", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["precision"] == "bf16-mixed"


def test_legacy_dtype_options_map_onto_precision():
    c = gfx.Cluster.preset("8xA100-80GB")
    assert resolve_precision(c) == "bf16-mixed"
    assert resolve_precision(c, dtype="fp32") == "fp32"
    assert resolve_precision(c, dtype="bf16", mixed_precision=True) == "bf16-mixed"
    assert resolve_precision(c, dtype="fp16") == "fp16-mixed"
    assert resolve_precision(c, "fp32", dtype="fp32") == "fp32"
    for kw, match in [({"precision": "bf16"}, "precision must be one of"),
                      ({"dtype": "bf16", "mixed_precision": False}, "not a supported precision"),
                      ({"dtype": "fp32", "mixed_precision": True}, "needs dtype"),
                      ({"precision": "fp32", "dtype": "bf16"}, "contradicts")]:
        with pytest.raises(gfx.ConfigError, match=match):
            resolve_precision(c, **kw)


def test_search_stores_precision_and_reestimates_it(tiny, tmp_path):
    cluster = gfx.Cluster.preset("4xA100-80GB")
    default = gfx.search(tiny, cluster, "64MiB", 16, reserve_bytes=0)
    fp32 = gfx.search(tiny, cluster, "64MiB", 16, precision="fp32", reserve_bytes=0)
    legacy = gfx.search(tiny, cluster, "64MiB", 16, dtype="fp32", reserve_bytes=0)
    assert default.precision == "bf16-mixed" and fp32.precision == "fp32" and legacy.to_json() == fp32.to_json()
    # the same layout in fp32: its matmuls at 19.5 instead of 312 TFLOP/s (at these widths the
    # searched plans differ by launches and collectives more than by their matmuls)
    as_fp32 = gfx.Plan.from_dict({**json.loads(default.to_json()), "precision": "fp32"})
    assert gfx.estimate(tiny, as_fp32, cluster)["throughput_samples_s"] < default.estimate["throughput_samples_s"]
    for plan in (default, fp32):
        path = tmp_path / f"{plan.precision}.json"
        plan.save(path)
        loaded = gfx.Plan.load(path)
        assert loaded.precision == plan.precision and json.loads(path.read_text())["precision"] == plan.precision
        assert gfx.estimate(tiny, loaded, cluster) == plan.estimate  # priced in the plan's precision


def test_plan_json_precision_round_trip_and_old_plans(tiny):
    plan = gfx.Plan.uniform(tiny, 4, tp=2, dp=2, global_batch_size=8, precision="fp16-mixed")
    d = json.loads(plan.to_json())
    assert d["precision"] == "fp16-mixed" and gfx.Plan.from_dict(d) == plan
    del d["precision"]  # a plan written before the key existed
    assert gfx.Plan.from_dict(d).precision == "fp32"
    assert gfx.Plan.uniform(tiny, 4).precision == "fp32"  # no cluster: fp32
    assert gfx.Plan.uniform(tiny, 4, cluster=gfx.Cluster.preset("4xV100-32GB").to_dict()).precision == "fp16-mixed"
    d["precision"] = "int8"
    with pytest.raises(gfx.ConfigError, match="precision must be one of"):
        gfx.Plan.from_dict(d)


def test_cost_model_prices_precision(tiny):
    cluster = gfx.Cluster.preset("8xA100-80GB")
    fp32, mixed = CostModel(tiny, cluster), CostModel(tiny, cluster, precision="bf16-mixed")
    assert (mixed.dtype, mixed.mixed_precision, fp32.precision) == ("bf16", True, "fp32")
    block = [r.index for r in gfx.layers(tiny) if r.kind == "block"][0]
    n = fp32.layer_params(block, 1).sharded + fp32.layer_params(block, 1).replicated
    s32, smix = fp32.states_bytes(block, Strategy(1, 1)), mixed.states_bytes(block, Strategy(1, 1))
    assert (s32.params, s32.grads, s32.optimizer, s32.masters) == (4 * n, 4 * n, 8 * n, 0)    # fp32 Adam
    # bf16 working copy + fp32 gradients, moments and masters (runtime/precision.py)
    assert (smix.params, smix.grads, smix.optimizer, smix.masters) == (2 * n, 4 * n, 8 * n, 4 * n)
    c32, cmix = fp32.layer_cost(block, Strategy(1, 1), 8), mixed.layer_cost(block, Strategy(1, 1), 8)
    assert c32.fwd_s > 4 * cmix.fwd_s   # tensor cores; half the bytes for element-wise ops
    # priced as FLOPs alone (no tiles, no memory traffic): the peaks' ratio exactly
    flat = dataclasses.replace(cluster, gemm_tile=1, gemm_wave=0, copy_s_per_byte=0.0)
    f32, fmix = (CostModel(tiny, flat, precision=p).layer_cost(block, Strategy(1, 1), 8) for p in ("fp32", "bf16-mixed"))
    assert fmix.fwd_s == pytest.approx(f32.fwd_s * 19.5 / 312)
    assert cmix.activation_bytes < c32.activation_bytes


def test_fp32_on_local_clusters_is_unchanged(tiny):
    # the CPU / local path (a profiled-style cluster) defaults to fp32 and prices exactly like the
    # fp32 cost model the multi-process memory tests compare the runtime with
    data = gfx.Cluster.preset("2xA100-80GB").to_dict()
    data["name"] = "local-2x1xcpu"
    local = gfx.Cluster.from_dict(data)
    plan = gfx.search(tiny, local, "64MiB", 8, reserve_bytes=0)
    assert plan.precision == "fp32"
    cm = CostModel(tiny, local, reserve_bytes=0)
    states = [sum(cm.states_bytes(i, plan.layers[i].strategy).total for i in range(a, b + 1))
              for a, b in plan.stages]
    assert plan.estimate["per_device"]["states_bytes"] == states
