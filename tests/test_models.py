"""The built-in model zoo: eager loss, capture by fx / export / dynamo, meta builds, errors."""

import time

import pytest
import torch
import torch.fx

import galvatron_fx.models as zoo
from galvatron_fx.errors import ConfigError

# Tiny overrides per family: every capture path runs in well under a second on CPU.
_GPT = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=64, batch=2)
_LLAMA = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, seq_len=16, vocab=64, batch=2)
_BERT = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=64, batch=2)
_VIT = dict(layers=2, hidden=32, heads=4, image_size=16, patch=4, num_classes=10, batch=2)
_T5 = dict(layers=4, hidden=32, heads=4, ffn_hidden=64, seq_len=16, tgt_len=8, vocab=64, batch=2)
# image 32 / patch 2 -> 16x16 tokens, window 4: stage 0 and 1 both shifted, stage 2 (4x4) unshifted.
_SWIN = dict(depths=[2, 2, 2], heads=[2, 4, 8], hidden=16, window=4, patch=2, image_size=32, num_classes=10, batch=2)

SMALL = {}
for _name in zoo.names():
    _family = _name.split("-")[0]
    SMALL[_name] = {"gpt3": _GPT, "gpt": _GPT, "llama": _LLAMA, "bert": _BERT, "vit": _VIT, "t5": _T5,
                    "swin": _SWIN}[_family]
# One representative per family (gpt3-125m: tied LM head) exercises every capture path; the rest
# only build + run eagerly (same code, other presets).
CAPTURE = ["gpt-tiny", "gpt3-125m", "llama-70b", "bert-huge-32", "vit-huge-32", "t5-large-32", "swin-huge-32"]

EXPECTED_PARAMS = {  # published sizes; tolerance is relative
    "gpt3-125m": (125e6, 0.03), "gpt3-350m": (350e6, 0.03), "gpt3-1.3b": (1.3e9, 0.03),
    "gpt3-2.7b": (2.7e9, 0.03), "gpt3-6.7b": (6.7e9, 0.03), "gpt3-13b": (13e9, 0.03),
    "gpt3-175b": (175e9, 0.03),
    "llama-7b": (6.74e9, 0.03), "llama-13b": (13.0e9, 0.03), "llama-70b": (69e9, 0.03),
    "bert-huge-32": (0.67e9, 0.15), "bert-huge-48": (1.0e9, 0.15),
    "vit-huge-32": (0.632e9, 0.05), "vit-huge-48": (0.95e9, 0.05),
    "t5-large-32": (0.50e9, 0.15), "t5-large-48": (0.74e9, 0.05),
    "swin-huge-32": (0.70e9, 0.15), "swin-huge-48": (1.0e9, 0.15),
}


class NoLeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return False


def _small(name, seed=0, **extra):
    return zoo.build(name, device="cpu", seed=seed, **{**SMALL[name], **extra})


@pytest.mark.parametrize("name", zoo.names())
def test_eager_loss_and_backward(name):
    model, args = _small(name)
    loss = model(*args)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", CAPTURE)
def test_captures_match_eager(name):
    model, args = _small(name)
    with torch.no_grad():
        expected = model(*args)

        gm = torch.fx.GraphModule(model, NoLeafTracer().trace(model))
        torch.testing.assert_close(gm(*args), expected)

        exported = torch.export.export(model, args, strict=False).module()
        torch.testing.assert_close(exported(*args), expected)

        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(*args), expected)
        torch._dynamo.reset()


def _ops_per_block(gm):
    """``{block path: [op targets]}``, a block being the innermost integer-indexed module on a
    node's ``nn_module_stack`` (what the layer-grouping pass keys on)."""
    blocks = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op not in ("call_function", "call_method") or not stack:
            continue
        parts = list(stack.values())[-1][0].split(".")
        digits = [i for i, part in enumerate(parts) if part.isdigit()]
        if digits:
            blocks.setdefault(".".join(parts[: digits[-1] + 1]), []).append(str(node.target))
    return blocks


@pytest.mark.parametrize("name", CAPTURE)
def test_blocks_of_a_list_trace_to_the_same_ops(name):
    """Masks / biases / rotary tables are computed above the blocks, so every block of a list
    runs the same op sequence (Swin: shifted and regular blocks differ only in roll amounts)."""
    model, _ = _small(name)
    blocks = _ops_per_block(torch.fx.GraphModule(model, NoLeafTracer().trace(model)))
    by_list = {}
    for path, ops in blocks.items():
        by_list.setdefault(path.rsplit(".", 1)[0], []).append(ops)
    assert by_list, "no ModuleList blocks found in the module stacks"
    for list_path, op_lists in by_list.items():
        assert all(ops == op_lists[0] for ops in op_lists), f"{name}: blocks of {list_path} differ"
    if name == "swin-huge-32":
        assert {"stages.0.blocks", "stages.1.blocks", "stages.2.blocks"} <= set(by_list)
    if name == "t5-large-32":
        assert {"encoder.blocks", "decoder.blocks"} <= set(by_list)


@pytest.mark.parametrize("name", zoo.names())
def test_full_size_on_meta(name):
    start = time.perf_counter()
    model, args = zoo.build(name)
    elapsed = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    assert all(a.is_meta for a in args)
    assert elapsed < 2.0, f"{name} took {elapsed:.2f}s on meta"
    if name in EXPECTED_PARAMS:
        expected, tol = EXPECTED_PARAMS[name]
        count = zoo.param_count(model)
        assert abs(count - expected) <= tol * expected, f"{name}: {count:,} parameters, expected ~{expected:,.0f}"


def test_block_lists_are_homogeneous():
    for name, path in [("gpt3-125m", "blocks"), ("llama-7b", "blocks"), ("t5-large-32", "encoder.blocks"),
                       ("t5-large-32", "decoder.blocks"), ("swin-huge-32", "stages.2.blocks")]:
        blocks = zoo.build(name)[0].get_submodule(path)
        assert isinstance(blocks, torch.nn.ModuleList) and len({type(b) for b in blocks}) == 1


def test_seed_is_deterministic():
    (m1, a1), (m2, a2), (m3, _) = _small("gpt-tiny"), _small("gpt-tiny"), _small("gpt-tiny", seed=1)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2)
    assert torch.equal(a1[0], a2[0])
    assert not torch.equal(next(m1.parameters()), next(m3.parameters()))


def test_gpt_tiny_defaults_and_dtype():
    model, (ids, labels) = zoo.build("gpt-tiny", device="cpu")
    assert ids.shape == (8, 32) and labels.shape == (8, 32)
    assert model(ids, labels).dtype == torch.float32
    model, args = zoo.build("gpt-tiny", device="cpu", dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model(*args).dtype == torch.float32


def test_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError, match="gpt3-175b"):
        zoo.build("gpt5")


def test_unknown_override_lists_valid_keys():
    with pytest.raises(ConfigError, match="hidden"):
        zoo.build("gpt-tiny", hiden=64)
    with pytest.raises(ConfigError, match="divide"):
        zoo.build("gpt-tiny", heads=5)


# ---------------------------------------------------------------------------------------------
# numerics against reference implementations


def test_swin_window_constants_match_reference_code():
    """Mask and index as the reference Swin code builds them (slice assignment, torch.roll)."""
    from galvatron_fx.models import swin

    res, window, shift = 16, 4, 2
    img = torch.zeros(res, res)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for k, (h, w) in enumerate((h, w) for h in bounds for w in bounds):
        img[h, w] = k
    wins = img.view(res // window, window, res // window, window).transpose(1, 2).reshape(-1, window * window)
    ref_mask = (wins[:, None, :] - wins[:, :, None]).ne(0).float() * -100.0
    torch.testing.assert_close(swin.shifted_window_mask(res, window, shift).squeeze(1), ref_mask)
    assert not swin.shifted_window_mask(res, window, 0).any()

    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    assert torch.equal(swin.relative_position_index(window), rel[..., 0] * (2 * window - 1) + rel[..., 1])

    x = torch.randn(2, res * res, 3)
    rolled = torch.roll(x.unflatten(1, (res, res)), (-shift, -shift), (1, 2)).flatten(1, 2)
    assert torch.equal(x.index_select(1, swin.cyclic_shift_index(res, shift)), rolled)
    assert torch.equal(rolled.index_select(1, swin.cyclic_shift_index(res, -shift)), x)


def _load(model, mapping):
    missing, unexpected = model.load_state_dict(mapping, strict=False)
    assert not unexpected and not ({n for n, _ in model.named_parameters()} - set(mapping))


def test_llama_matches_transformers():
    transformers = pytest.importorskip("transformers")
    model, (ids, labels) = zoo.build("llama-7b", device="cpu", layers=2, hidden=32, heads=4, kv_heads=2,
                                     ffn_hidden=48, seq_len=16, vocab=64, batch=2)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    sd = ref.state_dict()
    mapping = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
               "lm_head.weight": sd["lm_head.weight"]}
    names = [("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"),
             ("attn.o", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
             ("mlp.down", "mlp.down_proj"), ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")]
    for i in range(2):
        for ours, theirs in names:
            mapping[f"blocks.{i}.{ours}.weight"] = sd[f"model.layers.{i}.{theirs}.weight"]
    _load(model, mapping)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, labels), ref(input_ids=ids, labels=labels).loss)


def test_t5_matches_transformers():
    transformers = pytest.importorskip("transformers")
    # seq 40 / tgt 24 exceed max_exact, so the log-spaced buckets are exercised.
    model, (ids, labels) = zoo.build("t5-large-32", device="cpu", layers=4, hidden=32, heads=4, ffn_hidden=64,
                                     seq_len=40, tgt_len=24, vocab=64, batch=2)
    ref = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, feed_forward_proj="relu", tie_word_embeddings=True, decoder_start_token_id=0,
        attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    sd = ref.state_dict()
    mapping = {"shared.weight": sd["shared.weight"], "lm_head.weight": sd["shared.weight"]}
    for stack in ("encoder", "decoder"):
        mapping[f"{stack}.rel_bias.weight"] = sd[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        mapping[f"{stack}.final_norm.weight"] = sd[f"{stack}.final_layer_norm.weight"]
        ff = "1" if stack == "encoder" else "2"
        for i in range(2):
            ours, theirs = f"{stack}.blocks.{i}.", f"{stack}.block.{i}.layer."
            for x in "qkvo":
                mapping[f"{ours}attn.{x}.weight"] = sd[f"{theirs}0.SelfAttention.{x}.weight"]
                if stack == "decoder":
                    mapping[f"{ours}cross_attn.{x}.weight"] = sd[f"{theirs}1.EncDecAttention.{x}.weight"]
            mapping[f"{ours}attn_norm.weight"] = sd[f"{theirs}0.layer_norm.weight"]
            if stack == "decoder":
                mapping[f"{ours}cross_norm.weight"] = sd[f"{theirs}1.layer_norm.weight"]
            mapping[f"{ours}mlp.fc1.weight"] = sd[f"{theirs}{ff}.DenseReluDense.wi.weight"]
            mapping[f"{ours}mlp.fc2.weight"] = sd[f"{theirs}{ff}.DenseReluDense.wo.weight"]
            mapping[f"{ours}mlp_norm.weight"] = sd[f"{theirs}{ff}.layer_norm.weight"]
    _load(model, mapping)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, labels), ref(input_ids=ids, labels=labels).loss)
