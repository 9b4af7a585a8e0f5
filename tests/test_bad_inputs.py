"""One test per bad input: the exception type, and a message that names the problem and a fix.

docs/reliability.md tables every bad input with the test that covers it (here or elsewhere).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.errors import CaptureError, ConfigError, InfeasibleError, PlanMismatchError
from tests.dist_utils import run_distributed


@pytest.fixture(scope="module")
def tiny():
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1)
    return gfx.capture(model, args, method="fx")


def _names(info):
    return [r.name for r in info.layers]


def test_infeasible_budget_names_the_minimum(tiny):
    with pytest.raises(InfeasibleError) as err:
        gfx.search(tiny, gfx.Cluster.preset("2xA100-80GB"), "1KiB", 8)
    msg = str(err.value)
    assert err.value.min_memory_bytes > 1024
    assert "least memory any searched plan needs" in msg and f"{int(err.value.min_memory_bytes)} bytes" in msg
    assert "budget of 1.00 KiB" in msg and "fix: raise memory_budget" in msg


def test_world_size_differs_from_plan(tiny):
    plan = gfx.Plan.uniform(tiny, 8)
    info = tiny.meta["galvatron"]
    with pytest.raises(PlanMismatchError, match=r"world_size=8.*4"):
        plan.validate_for(world_size=4, fingerprint=info.fingerprint, layer_names=_names(info))


def test_plan_for_another_model(tiny):
    other = gfx.capture(*gfx.models.build("gpt-tiny", device="cpu", layers=1, hidden=32, heads=2),
                        method="fx")
    plan = gfx.Plan.uniform(other, 2)
    info = tiny.meta["galvatron"]
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        plan.validate_for(world_size=2, fingerprint=info.fingerprint, layer_names=_names(info))


def test_corrupt_plan_json(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{oops")
    with pytest.raises(ConfigError, match=r"not valid JSON.*regenerate it with `galvatron-fx plan"):
        gfx.Plan.load(str(path))


def test_wrong_version_plan_json(tiny, tmp_path):
    data = json.loads(gfx.Plan.uniform(tiny, 2).to_json())
    data["format"] = "galvatron_fx.plan/99"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"'galvatron_fx.plan/99' is not supported.*regenerate the plan"):
        gfx.Plan.load(str(path))


def test_unknown_cluster_preset():
    with pytest.raises(ConfigError, match=r"unknown cluster preset '8xB300-1TB'.*e\.g\. '8xA100-80GB'"):
        gfx.Cluster.preset("8xB300-1TB")


@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"),
                                         ('{"devices": 2}', "cluster key 'format'")])
def test_malformed_cluster_file(tmp_path, text, match):
    path = tmp_path / "cluster.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        gfx.Cluster.load(str(path))


@pytest.mark.parametrize("budget, match", [(0, "must be positive"), (-5, "must be positive"),
                                           ("-1GiB", "must be positive"),
                                           ("lots", r"cannot parse memory_budget 'lots'.*e\.g\. '16GiB'")])
def test_bad_budget(tiny, budget, match):
    with pytest.raises(ConfigError, match=match):
        gfx.search(tiny, gfx.Cluster.preset("2xA100-80GB"), budget, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(global_batch_size=7, micro_batches=2), "not divisible by micro_batches=2; pick micro_batches"),
    (dict(global_batch_size=6, micro_batches=2),
     "dp=2 does not divide the micro-batch.*change global_batch_size"),
])
def test_global_batch_not_divisible(tiny, kw, match):
    with pytest.raises(ConfigError, match=match):
        gfx.Plan.uniform(tiny, 2, **kw).validate()


class _Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.tensor(y.tolist()).sum() + y.sum()   # leaves the tensor world


class _GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        print("side effect")                              # a graph break under fullgraph
        return y.sum()


def test_op_capture_cannot_handle():
    with pytest.raises(CaptureError) as err:
        gfx.capture(_Unsupported(), (torch.randn(2, 4),), method="fx")
    msg = str(err.value)
    assert "test_bad_inputs.py" in msg and "y.tolist()" in msg and "try method=" in msg


def test_graph_break_under_dynamo_names_the_line():
    with pytest.raises(CaptureError) as err:
        gfx.capture(_GraphBreak(), (torch.randn(2, 4),), method="dynamo")
    msg = str(err.value)
    assert "method='dynamo'" in msg and re.search(r"test_bad_inputs\.py:\d+", msg)
    assert 'print("side effect")' in msg and "fix:" in msg


def test_transform_without_torch_distributed(tiny):
    with pytest.raises(ConfigError, match=r"needs torch.distributed: call dist.init_process_group\(\)"):
        gfx.transform(tiny, plan=gfx.Plan.uniform(tiny, 1))


def test_graph_without_layers_is_one_layer_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with pytest.warns(UserWarning, match="no repeated layers"):
        gm = gfx.capture(model, (torch.randn(2, 4),), method="fx")
    assert [(r.name, r.kind) for r in gfx.layers(gm)] == [("model", "other")]


def test_bad_collective_timeout(monkeypatch):
    from galvatron_fx.distributed import TIMEOUT_ENV, collective_timeout

    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match=f"{TIMEOUT_ENV}='soon' is not a positive number of seconds"):
        collective_timeout()
    monkeypatch.setenv(TIMEOUT_ENV, "42")
    assert collective_timeout().total_seconds() == 42


def _tp_not_dividing_heads(rank, world_size):
    model, args = gfx.models.build("gpt-tiny", device="cpu", layers=1, hidden=48, heads=3)
    gm = gfx.capture(model, args, method="fx")
    try:
        gfx.transform(gm, plan=gfx.Plan.uniform(gm, world_size, tp=2, dp=1))
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.dist
def test_tp_degree_not_dividing_heads_at_transform():
    kind, msg = run_distributed(_tp_not_dividing_heads, 2, timeout=60)[0]
    assert kind == "ConfigError", msg
    assert "layer blocks.0" in msg and "3 attention heads are not divisible by tp=2" in msg, msg
    assert "use tp in {1, 3}" in msg, msg
