"""Planning transformers models built on the meta device, captured with dynamo and with export.

The cost model measures layers on CPU fake tensors while such graphs bake in ``device=meta``
constants (``arange(..., device=meta)``, ``.to(meta)``, ``_assert_tensor_metadata(device=meta)``):
:meth:`galvatron_fx.cost.LayerGraph.on_device` retargets them. Planning must succeed and print no
torch error log or traceback (a probe that fails and is handled is not a crash).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.fx

import galvatron_fx as gfx
from galvatron_fx.cost import CostModel, retarget_devices
from galvatron_fx.solver.strategy import Strategy

transformers = pytest.importorskip("transformers")
T = transformers

V, BATCH, SEQ = 64, 2, 8
DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64, use_cache=False)
GQA = dict(DEC, num_key_value_heads=2)


def _t5(cls, config_cls):
    return lambda: cls(config_cls(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                  decoder_start_token_id=0, use_cache=False))


# tiny configurations: (model class, config) per family; nothing is downloaded
FAMILIES = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**GQA)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**GQA)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**GQA)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**DEC)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   use_cache=False, bos_token_id=0, eos_token_id=0)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                word_embed_proj_dim=32, use_cache=False)),
    "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   rotary_dim=4, use_cache=False, bos_token_id=0, eos_token_id=0)),
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4,
                                                      use_cache=False)),
    # NOTE: multi-head Falcon; multi-query and the new decoder architecture are falcon_mq / falcon_new
    "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4, multi_query=False, use_cache=False)),
    "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**DEC)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2)),
    "t5": _t5(T.T5ForConditionalGeneration, T.T5Config),
    "bert": lambda: T.BertForMaskedLM(T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=64,
                                                   max_position_embeddings=64)),
}

MATRIX_FAMILIES = {
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**GQA, head_dim=8)),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**GQA, head_dim=8)),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**GQA, head_dim=8)),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**GQA, pad_token_id=0)),
    "stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(**GQA)),
    "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**GQA)),
    "olmo": lambda: T.OlmoForCausalLM(T.OlmoConfig(**GQA)),
    "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**GQA, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=32)),
    "gpt_bigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                                                      n_positions=64, use_cache=False)),
    "gpt_neo": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                                                          attention_types=[[["global", "local"], 1]],
                                                          max_position_embeddings=64, use_cache=False)),
    "codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                                            n_positions=64, rotary_dim=4, use_cache=False)),
    "mpt": lambda: T.MptForCausalLM(T.MptConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                                                use_cache=False)),
    "falcon_mq": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, use_cache=False)),
    "falcon_new": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                             num_attention_heads=4, new_decoder_architecture=True,
                                                             num_kv_heads=2, use_cache=False)),
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        use_cache=False)),
    "mt5": _t5(T.MT5ForConditionalGeneration, T.MT5Config),
    "roberta": lambda: T.RobertaForMaskedLM(T.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, intermediate_size=64,
                                                            max_position_embeddings=64)),
    "distilbert": lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=64, max_position_embeddings=64)),
}

KNOWN_CAPTURE_FAILURES = {("gpt_neo", "dynamo")}
"""dynamo cannot trace these on the meta device (a list index becomes a real meta tensor inside
FakeTensorMode); a capture limit, not the cost model's."""

METHODS = ("dynamo", "export")


def build(name: str, device: str = "meta"):
    torch.manual_seed(0)
    with torch.device(device):
        model = {**FAMILIES, **MATRIX_FAMILIES}[name]()
    ids = torch.randint(0, V, (BATCH, SEQ), device=device)
    return model, dict(input_ids=ids, labels=ids)


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def no_errors(capfd):
    """Fails the test if an ERROR record reaches the root logger or any torch / transformers
    logger (torch's do not propagate), or a traceback reaches stderr."""
    handler = _Errors()
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] in ("torch", "transformers")]
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    err = capfd.readouterr().err
    assert not handler.records, [f"{r.name}: {r.getMessage()}" for r in handler.records]
    assert "Traceback" not in err and "failed while attempting" not in err, err[-3000:]


def _plan(name: str, method: str):
    model, kwargs = build(name)
    gm = gfx.capture(model, (), kwargs=kwargs, method=method)
    plan = gfx.search(gm, gfx.Cluster.preset("8xH100-80GB"), "80GiB", 8)
    assert plan.world_size == 8 and len(plan.layers) == len(gfx.layers(gm))
    assert all(math.isfinite(x) and x > 0 for x in plan.estimate["memory_bytes_per_device"])
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was allocated
    return gm, plan


# NOTE: CI runs the families that once failed in distinct ways (device constants, export asserts,
# the caught-probe tracebacks of OPT / GPT-J, Bloom's autograd functions, Mixtral's integer histc,
# T5's encoder-decoder); the others run with --run-matrix.
CI_FAMILIES = ("llama", "opt", "gptj", "bloom", "mixtral", "t5")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in CI_FAMILIES else pytest.mark.matrix)
                                  for n in sorted(FAMILIES)])
def test_meta_model_plans_without_error_logs(name, method, no_errors):
    gm, _plan_ = _plan(name, method)
    assert any(la.kind == "block" for la in gfx.layers(gm))


@pytest.mark.matrix
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(MATRIX_FAMILIES))
def test_meta_model_matrix(name, method, no_errors):
    if (name, method) in KNOWN_CAPTURE_FAILURES:
        model, kwargs = build(name)
        with pytest.raises(gfx.CaptureError):
            gfx.capture(model, (), kwargs=kwargs, method=method)
        pytest.xfail("dynamo cannot capture this model on the meta device")
    _plan(name, method)


def test_meta_and_cpu_models_measure_the_same():
    """Baked devices are retargeted, not approximated: a model built on the meta device is
    measured exactly like the same model built on the CPU (signatures name the device)."""
    measures = []
    for device in ("cpu", "meta"):
        model, kwargs = build("llama", device)
        gm = gfx.capture(model, (), kwargs=kwargs, method="export")
        cm = CostModel(gm, gfx.Cluster.preset("8xH100-80GB"))
        measures.append([{**cm.measure(i).to_dict(), "signature": None} for i in range(len(cm.layers))])
    assert measures[0] == measures[1]


def test_profiled_mode_on_a_meta_model(tmp_path):
    model, kwargs = build("llama")
    gm = gfx.capture(model, (), kwargs=kwargs, method="export")
    cm = CostModel(gm, gfx.Cluster.preset("8xH100-80GB"), mode="profiled", cache_dir=tmp_path, profile_sizes=(1, 2))
    block = next(la.index for la in cm.layers if la.kind == "block")
    for s in (Strategy(tp=1, dp=8), Strategy(tp=2, dp=4)):
        prof = cm.profile(block, s)
        assert prof["fwd"](1) > 0 and prof["bwd"](1) >= 0, (s, prof)


def _graph(build_body) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(build_body(g, x))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_retarget_devices_rewrites_every_baked_device():
    meta = torch.device("meta")
    aten = torch.ops.aten

    def body(g, x):
        g.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32, "device": meta})
        r = g.call_function(torch.arange, (4,), {"device": meta})
        z = g.call_function(torch.zeros, (4,), {"device": "meta"})
        a = g.call_method("to", (x, meta))
        b = g.call_method("to", (x, "meta"))
        c = g.call_function(aten._to_copy.default, (x,), {"device": meta, "dtype": torch.float32})
        d = g.call_method("cuda", (x,))
        return (r, z, a, b, c, d)

    gm = retarget_devices(_graph(body), torch.device("cpu"))
    targets = [n.target for n in gm.graph.nodes]
    assert aten._assert_tensor_metadata.default not in targets and "cuda" not in targets
    assert "meta" not in gm.code
    outs = gm(torch.ones(4))
    assert all(o.device.type == "cpu" for o in outs)
    assert "meta" in _graph(body).code  # the original graph is left alone


def test_retarget_casts_integer_histc_for_the_cpu():
    def body(g, x):
        x.meta["val"] = torch.empty(6, dtype=torch.int32, device="meta")
        return g.call_function(torch.histc, (x,), {"bins": 4, "min": 0, "max": 3})

    gm = retarget_devices(_graph(body), torch.device("cpu"))
    ids = torch.tensor([0, 1, 1, 3, 3, 3], dtype=torch.int32)
    out = gm(ids)
    assert out.dtype == torch.int32 and out.tolist() == [1, 2, 0, 3]
