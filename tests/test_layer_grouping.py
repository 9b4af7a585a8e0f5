"""Layer grouping pass: module-based block lists, cut-point fallback, encoder-decoder layouts."""

import pytest
import torch

import galvatron_fx as gfx
from galvatron_fx.ir import META_KEY
from galvatron_fx.passes.layer_grouping import LayerGroupingPass, block_list_elements
from tests.toy_models import ToyEncDec, ToyLM, toy_inputs

METHODS = ["fx", "dynamo", "export"]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


def test_innermost_same_class_non_leaf_lists_are_block_lists():
    types = {
        "embed": "Embedding",
        "stages": "ModuleList",
        "stages.0": "Stage", "stages.1": "Stage",
        "stages.0.blocks": "ModuleList", "stages.1.blocks": "ModuleList",
        "stages.0.blocks.0": "Blk", "stages.0.blocks.1": "Blk", "stages.1.blocks.0": "Blk",
        "stages.0.blocks.0.fc": "Linear", "stages.0.blocks.1.fc": "Linear", "stages.1.blocks.0.fc": "Linear",
        "stages.0.blocks.0.mlp.0": "Linear", "stages.0.blocks.0.mlp.1": "GELU",  # Sequential: mixed classes
        "stages.0.down": "Merge",
        "heads.0": "Linear", "heads.1": "Linear",  # leaf elements: not blocks
    }
    lists = block_list_elements(types)
    assert lists == {"stages.0.blocks": ["stages.0.blocks.0", "stages.0.blocks.1"],
                     "stages.1.blocks": ["stages.1.blocks.0"]}


@pytest.mark.parametrize("method", METHODS)
def test_decoder_only_layers_and_signatures(method):
    gm = gfx.capture(ToyLM(n=3), toy_inputs(), method=method)
    layers = gfx.layers(gm)
    assert [(la.name, la.kind) for la in layers] == [
        ("pre", "pre"), ("blocks.0", "block"), ("blocks.1", "block"), ("blocks.2", "block"), ("post", "post")]
    assert len({la.signature for la in layers[1:4]}) == 1
    assert layers[0].signature != layers[1].signature
    assert layers[1].params == [f"blocks.0.{p}" for p in (
        "ln1.weight", "ln1.bias", "attn.weight", "attn.bias", "ln2.weight", "ln2.bias",
        "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")]
    assert [la.consumes_from for la in layers] == [[], [0], [1], [2], [3]]
    assert layers[0].graph_inputs == ["ids"] and layers[-1].graph_inputs == ["targets"]
    # every node's record points at its layer
    for node in gm.graph.nodes:
        layer = layers[node.meta[META_KEY].layer] if node.op != "output" else None
        if node.op == "placeholder":
            assert node.name in layer.graph_inputs
        elif node.op != "output":
            assert node.name in layer.nodes


@pytest.mark.parametrize("method", METHODS)
def test_encoder_decoder_crossing_tensor_is_explicit(method):
    model = ToyEncDec(n_enc=2, n_dec=3)
    ids, tgt = toy_inputs()
    gm = gfx.capture(model, (ids, tgt, tgt), method=method)
    layers = gfx.layers(gm)
    assert [la.kind for la in layers] == ["pre", "block", "block", "other", "block", "block", "block", "post"]
    assert [la.name for la in layers[1:3]] == ["encoder.0", "encoder.1"]
    assert [la.name for la in layers[4:7]] == ["decoder.0", "decoder.1", "decoder.2"]
    between = layers[3]
    assert "enc_norm.weight" in between.params
    # every decoder block reads the encoder output produced by the 'other' layer (non-adjacent for 5, 6)
    for la in layers[4:7]:
        assert between.index in la.consumes_from
    assert len({la.signature for la in layers[5:7]}) == 1


def _strip_module_info(gm):
    for node in gm.graph.nodes:
        node.meta.pop("nn_module_stack", None)
        node.meta[META_KEY].module_path = ""
    gm.meta.pop(META_KEY)
    return gm


@pytest.mark.parametrize("method", METHODS)
def test_cut_point_fallback_without_module_information(method):
    gm = _strip_module_info(gfx.capture(ToyLM(n=4), toy_inputs(), method=method, group_layers=False))
    gm = LayerGroupingPass()(gm).graph_module
    info = gm.meta[META_KEY]
    assert info.grouping == "cut-points"
    layers = info.layers
    assert [la.kind for la in layers] == ["pre"] + ["block"] * 4 + ["post"]
    assert len({la.signature for la in layers[1:-1]}) == 1  # attention half + MLP half merged per block
    assert layers[1].params[0].startswith("blocks.0.") and layers[4].params[-1].startswith("blocks.3.")


def test_model_without_layers_is_one_layer_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="no repeated layers"):
        gm = gfx.capture(model, (torch.randn(2, 4),), method="fx")
    assert [(la.name, la.kind) for la in gfx.layers(gm)] == [("model", "other")]


def test_fingerprint_depends_on_shapes_not_on_weights():
    a = gfx.capture(ToyLM(n=2), toy_inputs(), method="fx").meta[META_KEY].fingerprint
    b = gfx.capture(ToyLM(n=2), toy_inputs(), method="fx").meta[META_KEY].fingerprint
    c = gfx.capture(ToyLM(n=3), toy_inputs(), method="fx").meta[META_KEY].fingerprint
    assert a == b != c


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dynamo", "export"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_huggingface_models_yield_their_block_count(family, method):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
        model, prefix = transformers.GPT2LMHeadModel(cfg), "transformer.h."
    else:
        cfg = transformers.BertConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=64, max_position_embeddings=16)
        model, prefix = transformers.BertForMaskedLM(cfg), "bert.encoder.layer."
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    gm = gfx.capture(model, (), {"input_ids": ids, "labels": ids}, method=method)
    layers = gfx.layers(gm)
    assert [la.name for la in layers] == ["pre"] + [f"{prefix}{i}" for i in range(3)] + ["post"]
    assert len({la.signature for la in layers[1:4]}) == 1
    out = gm(ids, ids)
    torch.testing.assert_close(out[0], model(input_ids=ids, labels=ids).loss)


def test_block_whose_only_child_is_an_uncalled_list_is_not_a_leaf():
    # HF T5: containers never run themselves, so neither ``encoder.block`` nor ``encoder.block.0.layer``
    # appear; ``encoder.block.0`` has grandchildren only, and its sub-layers are of mixed classes.
    types = {"encoder": "T5Stack", "encoder.final_layer_norm": "T5LayerNorm", "lm_head": "Linear"}
    for i in range(2):
        types.update({f"encoder.block.{i}": "T5Block",
                      f"encoder.block.{i}.layer.0": "T5LayerSelfAttention",
                      f"encoder.block.{i}.layer.0.SelfAttention": "T5Attention",
                      f"encoder.block.{i}.layer.0.SelfAttention.q": "Linear",
                      f"encoder.block.{i}.layer.1": "T5LayerFF",
                      f"encoder.block.{i}.layer.1.DenseReluDense.wi": "Linear"})
    assert block_list_elements(types) == {"encoder.block": ["encoder.block.0", "encoder.block.1"]}


def _hf_encoder_decoder(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "bart":
        cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0)
        return transformers.BartForConditionalGeneration(cfg), "model.encoder.layers.", "model.decoder.layers."
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    if family == "t5-encoder":
        return transformers.T5EncoderModel(cfg), "encoder.block.", None
    return transformers.T5ForConditionalGeneration(cfg), "encoder.block.", "decoder.block."


@pytest.mark.slow
@pytest.mark.parametrize("method", [pytest.param("dynamo", marks=pytest.mark.matrix), "export"])
@pytest.mark.parametrize("family", ["t5", *(pytest.param(f, marks=pytest.mark.matrix) for f in ("t5-encoder", "bart"))])
def test_huggingface_encoder_decoders_yield_encoder_and_decoder_blocks(family, method):
    model, enc, dec = _hf_encoder_decoder(family)
    model.eval()
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids} if dec is None else {"input_ids": ids, "labels": ids[:, :8].clone()}
    layers = gfx.layers(gfx.capture(model, (), kwargs, method=method))
    names = [la.name for la in layers]
    if dec is None:
        assert names == ["pre", f"{enc}0", f"{enc}1", "post"]
        return
    # the layer between the lists: T5's encoder final norm + decoder embedding (named as in the zoo's T5)
    between = {"t5": "between.encoder.block.1", "bart": "model.decoder"}[family]
    assert names == ["pre", f"{enc}0", f"{enc}1", between, f"{dec}0", f"{dec}1", "post"]
    assert [la.kind for la in layers] == ["pre", "block", "block", "other", "block", "block", "post"]
    encoder_out = 3 if family == "t5" else 2  # T5 normalises the encoder output in the 'other' layer
    assert all(encoder_out in la.consumes_from for la in layers[4:6])
