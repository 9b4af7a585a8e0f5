"""Plan: JSON round trip (byte-identical) and every validation error."""

from __future__ import annotations

import copy
import json

import pytest

from galvatron_fx.errors import ConfigError, PlanMismatchError
from galvatron_fx.plan import FORMAT, Plan
from galvatron_fx.solver.strategy import Strategy

NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def _plan(**kw) -> Plan:
    args = dict(world_size=8, tp=2, pp=2, micro_batches=4, global_batch_size=32, sdp="zero3",
                model_fingerprint="abc123", cluster={"preset": "8xA100-80GB", "bw": [1.5e11, 2.5e10]})
    args.update(kw)
    return Plan.uniform_from_layer_names(NAMES, **args)


def _searched() -> dict:
    d = _plan().to_dict()
    d["estimate"] = {"step_time_s": 0.1234567890123, "throughput_samples_s": 259.2,
                     "memory_bytes_per_device": [12_000_000_000, 9.5e9], "breakdown": {"x": 1}}
    d["layers"][1]["ckpt"] = True
    d["layers"][2].update(tp=4, dp=1, sdp="none", sp=True, kind="block")
    d["baselines"] = {"dp": "oom", "3d": {"step_time_s": 0.2}}
    return d


def test_uniform_plan_shape():
    p = _plan()
    assert p.stages == [(0, 2), (3, 5)] and p.devices_per_stage == 4 and p.micro_batch_size == 8
    assert all(layer.dp == 2 and layer.tp == 2 for layer in p.layers)
    assert p.layer_strategies()[0] == Strategy(2, 2, "zero3")
    assert p.stage_of(3) == 1 and p.num_layers == 6
    d = p.to_dict()
    assert d["format"] == FORMAT and d["stages"] == [[0, 2], [3, 5]]
    assert set(d["layers"][0]) == {"name", "tp", "sp", "dp", "sdp", "ckpt", "ep", "cp", "cp_kind", "offload"}
    assert set(d["estimate"]) >= {"step_time_s", "throughput_samples_s", "memory_bytes_per_device"}
    assert d["precision"] == "fp32" and p.precision == "fp32"  # no cluster name: fp32


def test_precision_round_trip_and_older_plans():
    p = _plan(precision="bf16-mixed")
    assert Plan.from_dict(json.loads(p.to_json())).precision == "bf16-mixed"
    d = p.to_dict()
    del d["precision"]
    assert Plan.from_dict(d).precision == "fp32" and "precision" not in Plan.from_dict(d).extra
    assert _plan(cluster={"name": "8xRTX-TITAN-24GB"}).precision == "fp16-mixed"


def test_json_round_trip_byte_identical(tmp_path):
    p = Plan.from_dict(_searched())
    text = p.to_json()
    assert text == Plan.from_dict(json.loads(text)).to_json()
    path = tmp_path / "plan.json"
    p.save(path)
    assert path.read_text() == text
    q = Plan.load(path)
    assert q == p
    q.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    d = json.loads(text)
    assert d["baselines"]["dp"] == "oom" and d["layers"][2]["kind"] == "block"  # extras kept
    assert list(d) == sorted(d)  # sorted keys
    # identical plans built independently give identical bytes
    assert _plan().to_json() == _plan().to_json()


def _with(mutate):
    d = _searched()
    mutate(d)
    return d


BAD = [
    ("missing format", lambda d: d.pop("format"), "format"),
    ("wrong format", lambda d: d.update(format="galvatron_fx.plan/0"), "not supported"),
    ("missing key", lambda d: d.pop("cluster"), "cluster"),
    ("world_size", lambda d: d.update(world_size=0), "world_size"),
    ("bool world_size", lambda d: d.update(world_size=True), "world_size"),
    ("pp not dividing", lambda d: d.update(pp=3), "pp=3"),
    ("schedule", lambda d: d.update(schedule="zb"), "schedule"),
    ("micro_batches", lambda d: d.update(micro_batches=0), "micro_batches"),
    ("gbs % m", lambda d: d.update(global_batch_size=30), "divisible"),
    ("dp vs micro-batch", lambda d: d.update(global_batch_size=4), "does not divide the micro-batch"),
    ("stages count", lambda d: d.update(stages=[[0, 5]]), "stages"),
    ("stages gap", lambda d: d.update(stages=[[0, 1], [3, 5]]), "contiguity"),
    ("stages overlap", lambda d: d.update(stages=[[0, 3], [3, 5]]), "contiguity"),
    ("stages short", lambda d: d.update(stages=[[0, 2], [3, 4]]), "last stage must end"),
    ("stages empty", lambda d: d.update(stages=[[0, 2], [3, 2]]), "contiguity"),
    ("stage type", lambda d: d.update(stages=[[0, 2], "3-5"]), r"stages\[1\]"),
    ("tp*dp", lambda d: d["layers"][0].update(dp=4), "tp\\*dp"),
    ("sdp", lambda d: d["layers"][1].update(sdp="zero1"), "sdp"),
    ("sp without tp", lambda d: d["layers"][0].update(tp=1, dp=4, sp=True), "sp=true needs tp > 1"),
    ("sp type", lambda d: d["layers"][0].update(sp="yes"), "sp"),
    ("layer key missing", lambda d: d["layers"][0].pop("ckpt"), "missing key"),
    ("layer name repeated", lambda d: d["layers"][1].update(name="embed"), "repeated"),
    ("layers empty", lambda d: d.update(layers=[], stages=[[0, 0], [1, 1]]), "non-empty"),
    ("estimate key", lambda d: d["estimate"].pop("step_time_s"), "estimate"),
    ("estimate value", lambda d: d["estimate"].update(step_time_s=-1.0), "step_time_s"),
    ("estimate memory", lambda d: d["estimate"].update(memory_bytes_per_device=[1]), "memory_bytes_per_device"),
    ("fingerprint", lambda d: d.update(model_fingerprint=5), "model_fingerprint"),
    ("cluster", lambda d: d.update(cluster="8xA100"), "cluster"),
    ("precision", lambda d: d.update(precision="bf16"), "precision must be one of"),
]


@pytest.mark.parametrize("what, mutate, match", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(what, mutate, match):
    with pytest.raises(ConfigError, match=match):
        Plan.from_dict(_with(mutate))


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Plan.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        Plan.load(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="JSON object"):
        Plan.from_dict([1, 2])


def test_non_finite_estimate_rejected():
    p = _plan()
    p.estimate["extra_s"] = float("inf")
    with pytest.raises(ConfigError, match="non-finite"):
        p.to_json()


def test_validate_for():
    p = _plan()
    assert p.validate_for(world_size=8, fingerprint="abc123", layer_names=NAMES) is p
    with pytest.raises(PlanMismatchError, match="world_size=8"):
        p.validate_for(world_size=4)
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        p.validate_for(fingerprint="zzz")
    with pytest.raises(PlanMismatchError, match="index 5"):
        p.validate_for(layer_names=NAMES[:5] + ["lm_head"])
    with pytest.raises(PlanMismatchError, match="index 6"):
        p.validate_for(layer_names=NAMES + ["extra"])
    # an unrecorded fingerprint is not checked
    _plan(model_fingerprint="").validate_for(fingerprint="anything")


def test_uniform_errors():
    with pytest.raises(ConfigError, match="divide"):
        Plan.uniform_from_layer_names(NAMES, world_size=8, tp=3)
    with pytest.raises(ConfigError, match="pp=8"):
        Plan.uniform_from_layer_names(NAMES, world_size=8, pp=8)
    with pytest.raises(ConfigError, match="sp=true"):
        Plan.uniform_from_layer_names(NAMES, world_size=2, sp=True)
    p = Plan.uniform_from_layer_names(NAMES, world_size=1)
    assert p.layers[0].dp == 1 and p.stages == [(0, 5)]


def test_copy_equality():
    p = _plan()
    assert copy.deepcopy(p) == p
