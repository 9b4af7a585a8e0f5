"""Every zoo family through gfx.capture by each front end: same layers, shared signatures, eager output."""

import pytest
import torch

import galvatron_fx as gfx
import galvatron_fx.models as zoo
from tests.test_models import CAPTURE, SMALL

METHODS = ["fx", "dynamo", "export"]


def _expected_layers(name: str) -> list[tuple[str, str]]:
    """Layer (name, kind) list from the zoo config, independent of the grouping pass."""
    cfg = zoo.config(name, **SMALL[name])
    family = name.split("-")[0]
    if family == "t5":
        half = cfg.layers // 2
        return ([("pre", "pre")] + [(f"encoder.blocks.{i}", "block") for i in range(half)] + [(None, "other")]
                + [(f"decoder.blocks.{i}", "block") for i in range(half)] + [("post", "post")])
    if family == "swin":
        out = [("pre", "pre")]
        for s, depth in enumerate(cfg.depths):
            out += [(f"stages.{s}.blocks.{i}", "block") for i in range(depth)]
            if s < len(cfg.depths) - 1:
                out.append((f"stages.{s}.downsample", "other"))
        return out + [("post", "post")]
    return [("pre", "pre")] + [(f"blocks.{i}", "block") for i in range(cfg.layers)] + [("post", "post")]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [n if n not in ("t5-large-32", "swin-huge-32") else pytest.param(n, marks=pytest.mark.matrix)
                                  for n in CAPTURE])   # CI time: T5 / Swin captured three ways in the matrix
def test_three_methods_agree_on_layers_and_match_eager(name):
    model, args = zoo.build(name, device="cpu", **SMALL[name])
    expected = _expected_layers(name)
    ref = model(*args)
    for method in METHODS:
        gm = gfx.capture(model, args, method=method)
        layers = gfx.layers(gm)
        got = [(la.name if kind != "other" or exp is not None else None, la.kind)
               for la, (exp, kind) in zip(layers, expected)]
        assert len(layers) == len(expected) and got == expected, (method, [(la.name, la.kind) for la in layers])
        torch.testing.assert_close(gm(*args), ref, msg=f"{name} via {method}")
        # blocks of one list with the same module class and shapes share a signature (Swin alternates
        # shifted / unshifted windows: two signatures per stage at most)
        by_list: dict[str, set[str]] = {}
        for la in layers:
            if la.kind == "block":
                by_list.setdefault(la.name.rsplit(".", 1)[0], set()).add(la.signature)
        limit = 2 if name.startswith("swin") else 1
        assert all(len(s) <= limit for s in by_list.values()), (method, by_list)
        params = {p for la in layers for p in la.params}
        assert params == {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_name_captures_on_meta(name):
    model, args = zoo.build(name, device="meta", **SMALL[name])
    layers = gfx.layers(gfx.capture(model, args, method="fx"))
    assert [la.kind for la in layers] == [kind for _, kind in _expected_layers(name)]
