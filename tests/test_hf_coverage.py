"""The transformers coverage benchmark on a representative subset: a decoder LM with grouped-query
attention (Llama), an encoder-decoder (T5), a vision model (ViT); capture, blocks, TP shard fraction,
and one 2-rank training run (T5 under TP2)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import hf_coverage  # noqa: E402

import galvatron_fx as gfx  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "t5", "vit"])
def test_architecture_captures_with_its_blocks_and_tp_shards_them(name):
    gm = hf_coverage.capture(name, "dynamo")
    blocks = [la for la in gfx.layers(gm) if la.kind == "block"]
    assert len(blocks) == hf_coverage.expected_blocks(name)
    # TP halves (almost) all block states: only norms and biases of row-parallel linears stay whole
    assert 0.5 <= hf_coverage.tp2_states_ratio(gm) < 0.52
    model, kw = hf_coverage.build(name)
    out = gm(**hf_coverage.tensor_inputs(kw))
    torch.testing.assert_close(out[0], model(**kw).loss)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.matrix   # CI time: T5 trains in CI through test_hf_doors_dist.py
def test_t5_trains_under_tp2_like_one_device():
    errors = hf_coverage.train_errors("t5", ["tp2"], steps=3, timeout=120)
    assert isinstance(errors["tp2"], float) and errors["tp2"] <= 1e-5, errors


def test_summary_counts_rows_and_failures():
    ok = {"capture_dynamo": "ok", "capture_export": "ok", "blocks": 2, "expected_blocks": 2,
          "meta_plan": "ok (pp1)", "tp2_states_ratio": 0.5, "train_tp2": 1e-7}
    bad = dict(ok, capture_export="CaptureError: x", blocks=1, meta_plan="RuntimeError: y",
               tp2_states_ratio=1.0, train_tp2="ConfigError: z")
    s = hf_coverage.summary([ok, bad], tol=1e-4)
    assert s == {"archs": 2, "capture_dynamo_ok": 2, "capture_export_ok": 1, "blocks_ok": 1, "meta_plan_ok": 1,
                 "median_tp2_states_ratio": 0.75, "train_tol": 1e-4, "train_ok_tp2": 1}
    assert hf_coverage.error_line(ValueError("\nfirst\nsecond")) == "ValueError: first"
