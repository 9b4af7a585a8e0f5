"""capture(): the three front ends give one normalised, annotated GraphModule."""

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.ir import META_KEY, GraphInfo, ParamInfo
from tests.toy_models import ToyLM, toy_inputs

METHODS = ["fx", "dynamo", "export"]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("method", METHODS)
def test_output_equals_eager_and_params_are_the_originals(method):
    torch.manual_seed(0)
    model = ToyLM()
    args = toy_inputs()
    gm = gfx.capture(model, args, method=method)
    torch.testing.assert_close(gm(*args), model(*args), rtol=0, atol=0)

    names = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    seen = set()
    for node in gm.graph.nodes:
        info = node.meta[META_KEY]
        if node.op == "get_attr":
            p: ParamInfo = info.param
            assert p is not None and node.target == p.fqn
            ref = names.get(p.fqn, buffers.get(p.fqn))
            assert p.shape == tuple(ref.shape) and p.dtype == ref.dtype
            assert p.is_param == (p.fqn in names)
            assert gm.get_submodule(p.fqn.rpartition(".")[0]).__getattr__(p.fqn.rpartition(".")[2]) is ref
            seen.add(p.fqn)
        if node.op != "output":
            assert info.layer is not None
        if node.op in ("call_function", "placeholder", "get_attr"):
            assert isinstance(node.meta.get("val"), torch.Tensor), node.name
    assert seen == set(names) | set(buffers)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["ids", "targets"]
    assert isinstance(gm.meta[META_KEY], GraphInfo) and gm.meta[META_KEY].method == method


@pytest.mark.parametrize("method", METHODS)
def test_gradients_flow_to_the_original_parameters(method):
    torch.manual_seed(0)
    model, ref = ToyLM(), ToyLM()
    ref.load_state_dict(model.state_dict())
    args = toy_inputs()
    gfx.capture(model, args, method=method)(*args).backward()
    ref(*args).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("method", METHODS)
def test_tied_weights_are_one_node_with_aliases(method):
    model = ToyLM(tied=True)
    gm = gfx.capture(model, toy_inputs(), method=method)
    tied = [n.meta[META_KEY].param for n in gm.graph.nodes if n.op == "get_attr" and
            n.meta[META_KEY].param.fqn in ("emb.weight", "head.weight")]
    assert len(tied) == 1 and tied[0].fqn == "emb.weight" and tied[0].aliases == ("head.weight",)


@pytest.mark.parametrize("method", METHODS)
def test_meta_device_model_needs_no_memory(method):
    with torch.device("meta"):
        model = ToyLM(n=2, d=4096, vocab=50000)
    args = toy_inputs(device="meta", vocab=50000)
    gm = gfx.capture(model, args, method=method)
    layers = gfx.layers(gm)
    assert [la.kind for la in layers] == ["pre", "block", "block", "post"]
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].shape == () and out.meta["val"].device.type == "meta"


def test_kwargs_become_named_placeholders():
    model = ToyLM()
    ids, tgt = toy_inputs()
    gm = gfx.capture(model, (ids,), kwargs={"targets": tgt}, method="export")
    assert gm.meta[META_KEY].input_names == ["ids", "targets"]
    torch.testing.assert_close(gm(ids, tgt), model(ids, targets=tgt))


class TwoInputs(torch.nn.Module):
    def forward(self, x, mask=None, scale=None):
        return (x * mask + scale).sum(-1)


@pytest.mark.parametrize("method", METHODS)
def test_keywords_in_another_order_than_forward_keep_their_names(method):
    """``model(scale=..., x=..., mask=...)``: each placeholder is the keyword the caller gave (a
    caller's order once swapped HF's ``labels`` and ``attention_mask``: a wrong loss, silently)."""
    x, mask, scale = torch.randn(3, 4), torch.rand(3, 4), torch.randn(3, 4)
    gm = gfx.capture(TwoInputs(), kwargs=dict(scale=scale, x=x, mask=mask), method=method)
    names = gm.meta[META_KEY].input_names
    assert sorted(names) == ["mask", "scale", "x"]
    torch.testing.assert_close(gm(**dict(scale=scale, x=x, mask=mask)), TwoInputs()(x, mask, scale))


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: not capturable as one graph
            return y.relu().sum()
        return y.sum()


@pytest.mark.parametrize("method", METHODS)
def test_untraceable_model_error_names_method_line_and_alternative(method):
    with pytest.raises(gfx.CaptureError) as err:
        gfx.capture(DataDependent(), (torch.randn(2, 4),), method=method)
    msg = str(err.value)
    assert f"method={method!r}" in msg
    assert "test_capture.py" in msg and "if y.sum() > 0" in msg
    assert "try method=" in msg


def test_unknown_method_is_a_config_error():
    with pytest.raises(gfx.ConfigError, match="unknown capture method 'jit'"):
        gfx.capture(ToyLM(), toy_inputs(), method="jit")
