"""Coverage of real transformers architectures: capture, layer grouping, tensor parallelism, meta-device
planning and 2-rank training numerics, one row per architecture (tiny configs, no downloads).

Every model is built from a tiny config (hidden 32, 4 heads, 2 layers per stack, vocabulary 64),
seeded (``torch.manual_seed(0)``), with dropout off (config dropouts 0 and ``eval()``) and the KV
cache off. Inputs: batch 4, sequence 16 (targets of encoder-decoders 8), images 32x32. Columns:

* ``dynamo`` / ``export``: ``gfx.capture(model, (), kwargs, method=...)``: ok or the error's first line;
* ``blocks``: block layers found / expected (the config's layer count; encoder + decoder layers for
  T5/BART, text + vision layers for CLIP, the sum of the stage depths for Swin);
* ``tp2 states``: states bytes of the block layers at tp=2 over tp=1 (cost model on 2xA100-80GB):
  0.5 when TP shards every block parameter, 1.0 when it shards none (dynamo capture; the export
  capture's figure follows after a slash where it differs);
* ``meta plan``: built under ``torch.device("meta")``, captured (dynamo), and
  ``gfx.search(gm, 8xH100-80GB, "80GiB", 8)``;
* ``head tp2``: the cost model's activation bytes of the LM head (the ``post`` layer) per sample at
  tp=2 over tp=1, for the language models with the vocabulary ``HEAD_VOCAB`` (32 x hidden, the
  ratio of real LMs; the vocabulary-parallel loss keeps 1/tp of the logits' bytes);
* ``tp2`` / ``tp2sp`` / ``zero3`` / ``pp2`` / ``cp2`` / ``cp2u``: on 2 gloo ranks, 5 AdamW steps (lr
  1e-3, eps 1e-6) of ``Plan.uniform(tp=2)`` / ``(tp=2, sp=True)`` / ``(sdp="zero3")`` /
  ``(pp=2, micro_batches=2)`` / ``(dp=2, cp=2)`` ring / Ulysses from a dynamo capture:
  the largest relative loss error over the steps against the eager model on one device (``ok``
  below ``--tol``), or the error's first line. The three plans run in one spawned world per model.
  NOTE: CLIP's contrastive loss is not a mean over samples (every sample is a negative of the
  others), so plans that split the batch (ZeRO-3 at dp 2, PP2's micro-batches) change the loss itself.

    python benchmarks/hf_coverage.py [--models gpt2,llama,t5] [--no-train] [--timeout 300] [--json PATH]
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from _common import parser, print_table, write_json  # noqa: E402

from tests.training import EPS, LR, STEPS, reference  # noqa: E402  (5 AdamW steps, lr 1e-3, eps 1e-6)

BATCH, SEQ, TGT, IMAGE, LABELS = 4, 16, 8, 32, 10
"""Samples, source tokens, target tokens (encoder-decoders), image side (pixels), image classes.
NOTE: the sequence differs from the batch: the local-batch pass cannot tell a baked constant equal to
the batch from an equal sequence length."""
TRAIN_PLANS = {  # column -> Plan.uniform keywords on 2 ranks
    "tp2": dict(tp=2, dp=1),
    "tp2sp": dict(tp=2, dp=1, sp=True),
    "zero3": dict(sdp="zero3"),
    "pp2": dict(pp=2, dp=1, micro_batches=2),
    "cp2": dict(dp=2, cp=2),                         # context parallel, ring attention
    "cp2u": dict(dp=2, cp=2, cp_kind="ulysses"),     # context parallel, Ulysses all-to-alls
}
NO_DROPOUT = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop",
              "embd_pdrop", "attn_pdrop", "dropout_rate", "hidden_dropout_prob", "attention_probs_dropout_prob",
              "classifier_dropout", "drop_path_rate", "seq_classif_dropout", "qa_dropout")

_LM = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64)
_GQA = dict(_LM, num_key_value_heads=2)
_VISION = dict(image_size=IMAGE, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64)

# name -> (config class, model class, config keywords, inputs: "lm" | "seq2seq" | "image" | "clip")
ARCHS: dict[str, tuple[str, str, dict, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0),
             "lm"),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_LM), "lm"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_GQA), "lm"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_GQA, sliding_window=None), "lm"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_GQA), "lm"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_GQA, head_dim=8), "lm"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, head_dim=8, sliding_window=8), "lm"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_LM), "lm"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_GQA, pad_token_id=0, bos_token_id=1, eos_token_id=2), "lm"),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
                 eos_token_id=2), "lm"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4), "lm"),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4), "lm"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                  bos_token_id=0, eos_token_id=0), "lm"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_GQA, num_local_experts=4, num_experts_per_tok=2), "lm"),
    "bert": ("BertConfig", "BertForMaskedLM", dict(_LM), "lm"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(_LM, pad_token_id=1), "lm"),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
                   dict(vocab_size=64, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64),
                   "lm"),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64),
             "seq2seq"),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(_VISION, patch_size=8, num_labels=LABELS), "image"),
    "swin": ("SwinConfig", "SwinForImageClassification",
             dict(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                  window_size=4, mlp_ratio=2.0, num_labels=LABELS), "image"),
    "clip": ("CLIPConfig", "CLIPModel",
             dict(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
                                   eos_token_id=2, pad_token_id=1),
                  vision_config=dict(_VISION, patch_size=8), projection_dim=16), "clip"),
}


def error_line(exc: BaseException) -> str:
    """``Type: first non-empty line of the message``; a wrapper whose first line ends in a colon
    (``[Stage 0] failed to run forward:``) adds its cause's; a failed rank: its traceback's last line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if type(exc).__name__ == "DistributedTestError" and len(lines) > 1:
        return f"{lines[0]} {lines[-1]}"
    head = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    if head.endswith(":") and exc.__cause__ is not None:
        return f"{head} {error_line(exc.__cause__)}"
    return head


HEAD_VOCAB = 1024
"""Vocabulary of the ``head tp2`` column: 32 x the hidden size 32 (Llama-3: 128k / 4096)."""


def _config(name: str, vocab_size: int | None = None):
    import transformers

    cfg_cls, _, kw, _ = ARCHS[name]
    cfg = getattr(transformers, cfg_cls)(**(kw if vocab_size is None else dict(kw, vocab_size=vocab_size)))
    for sub in [cfg] + [getattr(cfg, k) for k in ("text_config", "vision_config") if hasattr(cfg, k)]:
        for key in NO_DROPOUT:
            if hasattr(sub, key):
                setattr(sub, key, 0.0)
        sub.use_cache = False
    return cfg


def expected_blocks(name: str) -> int:
    """The layer count of the architecture's config (all stacks)."""
    cfg = _config(name)
    if name == "clip":
        return cfg.text_config.num_hidden_layers + cfg.vision_config.num_hidden_layers
    if name == "swin":
        return sum(cfg.depths)
    if name == "t5":
        return cfg.num_layers + cfg.num_decoder_layers
    if name == "bart":
        return cfg.encoder_layers + cfg.decoder_layers
    for key in ("num_hidden_layers", "n_layer", "n_layers"):
        if hasattr(cfg, key):
            return getattr(cfg, key)
    raise KeyError(name)


def inputs(name: str, device: str = "cpu") -> dict:
    """The model's keyword inputs (seeded, independent of the global RNG), including the targets."""
    g = torch.Generator().manual_seed(1)
    kind = ARCHS[name][3]
    ids = torch.randint(3, 64, (BATCH, SEQ), generator=g)
    if kind == "lm":
        kw = dict(input_ids=ids, labels=ids.clone())
    elif kind == "seq2seq":
        kw = dict(input_ids=ids, labels=torch.randint(3, 64, (BATCH, TGT), generator=g))
    else:
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)
        if kind == "image":
            kw = dict(pixel_values=pixels, labels=torch.randint(0, LABELS, (BATCH,), generator=g))
        else:
            kw = dict(input_ids=ids, pixel_values=pixels)
    kw = {k: v.to(device) for k, v in kw.items()}
    return dict(kw, return_loss=True) if kind == "clip" else kw


def build(name: str, device: str = "cpu", vocab_size: int | None = None):
    """``(model, kwargs)``: the seeded model in eval mode (no dropout) on ``device`` and its inputs
    (``vocab_size``: another vocabulary than the tiny config's; the inputs stay below 64)."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, ARCHS[name][1])(_config(name, vocab_size))
    return model.eval(), inputs(name, device)


def tensor_inputs(kwargs: dict) -> dict:
    """The tensor inputs of ``kwargs`` (what ``train_step`` takes; flags are baked into the graph)."""
    return {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def capture(name: str, method: str, device: str = "cpu", vocab_size: int | None = None):
    import galvatron_fx as gfx

    model, kw = build(name, device, vocab_size)
    try:
        return gfx.capture(model, (), kwargs=kw, method=method)
    finally:
        torch._dynamo.reset()


def tp2_states_ratio(gm) -> float:
    """States bytes of the block layers at tp=2 over tp=1 (0.5: TP shards all their parameters)."""
    import galvatron_fx as gfx
    from galvatron_fx.planner import cost_model_for
    from galvatron_fx.solver.strategy import Strategy

    cm = cost_model_for(gm, gfx.Cluster.preset("2xA100-80GB"))
    blocks = [la.index for la in gfx.layers(gm) if la.kind == "block"]
    if not blocks:
        raise ValueError("no block layers")
    tp = {t: sum(cm.layer_cost(i, Strategy(tp=t, dp=1), BATCH).states_bytes for i in blocks) for t in (1, 2)}
    return tp[2] / tp[1]


def head_activation_ratio(name: str, method: str = "dynamo", vocab_size: int = HEAD_VOCAB, sp: bool = False) -> float:
    """Activation bytes of the LM head (the ``post`` layer) per sample at tp=2 (with or without sp)
    over tp=1, from the cost model on 2xA100-80GB in fp32, with vocabulary ``vocab_size``."""
    import galvatron_fx as gfx
    from galvatron_fx.planner import cost_model_for
    from galvatron_fx.solver.strategy import Strategy

    gm = capture(name, method, vocab_size=vocab_size)
    cm = cost_model_for(gm, gfx.Cluster.preset("2xA100-80GB"), precision="fp32")
    post = next(la.index for la in gfx.layers(gm) if la.kind == "post")
    act = {tp: cm.layer_cost(post, Strategy(tp=tp, dp=1, sp=sp and tp > 1), BATCH).activation_bytes for tp in (1, 2)}
    return act[2] / act[1]


def meta_plan(name: str) -> str:
    import galvatron_fx as gfx

    gm = capture(name, "dynamo", device="meta")
    plan = gfx.search(gm, gfx.Cluster.preset("8xH100-80GB"), "80GiB", 8)
    mid = plan.layers[len(plan.layers) // 2]
    return f"ok (pp{plan.pp}, mid-model tp{mid.tp} dp{mid.dp} {mid.sdp})"


class _KeywordLoss(torch.nn.Module):
    """``model(**kwargs).loss`` as a module without inputs (for :func:`tests.training.reference`)."""

    def __init__(self, model: torch.nn.Module, kwargs: dict):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self) -> torch.Tensor:
        return self.model(**self.kwargs).loss


def reference_losses(name: str, steps: int = STEPS) -> list[float]:
    """Eager single-device losses of ``steps`` AdamW steps."""
    return reference(_KeywordLoss(*build(name)), (), steps=steps, eps=EPS)[0]


def _train_rank(rank: int, world: int, name: str, plans: list[str], steps: int) -> dict:
    """On every rank: the losses of each plan in ``plans`` (a list of floats), or its error line."""
    import galvatron_fx as gfx

    out: dict = {}
    for label in plans:
        try:
            model, kw = build(name)
            gm = gfx.capture(model, (), kwargs=kw, method="dynamo")
            plan = gfx.Plan.uniform(gm, world, global_batch_size=BATCH, **TRAIN_PLANS[label])
            dm = gfx.transform(gm, plan=plan)
            opt = torch.optim.AdamW(dm.parameters(), lr=LR, eps=EPS)
            losses = []
            for _ in range(steps):
                losses.append(float(dm.train_step(**tensor_inputs(kw))))
                opt.step()
            out[label] = losses
        except Exception as exc:  # noqa: BLE001 - one plan's failure is a table cell
            out[label] = error_line(exc)
        finally:
            torch._dynamo.reset()
    return out


def train_errors(name: str, plans: list[str] | None = None, steps: int = STEPS, timeout: float = 300.0) -> dict:
    """plan column -> the largest relative loss error over ``steps`` (float) or an error line; all
    plans in one 2-rank world (a timeout or a crash fails every plan of the model)."""
    from tests.dist_utils import run_distributed

    plans = list(plans or TRAIN_PLANS)
    try:
        ref = reference_losses(name, steps)
    except Exception as exc:  # noqa: BLE001
        return dict.fromkeys(plans, "reference: " + error_line(exc))
    try:
        ranks = run_distributed(_train_rank, 2, name, plans, steps, timeout=timeout)
    except Exception as exc:  # noqa: BLE001
        return dict.fromkeys(plans, error_line(exc))
    out = {}
    for label in plans:
        losses = ranks[0][label]
        if isinstance(losses, str):
            out[label] = losses
        else:
            out[label] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    return out


def _attempt(fn, *args):
    """``(value, None)`` or ``(None, error line)``."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - a failure is a table cell
        return None, error_line(exc)


def coverage_row(name: str, train: bool = True, timeout: float = 300.0, steps: int = STEPS) -> dict:
    """One architecture's row (see the module docstring); errors are recorded, never raised."""
    import galvatron_fx as gfx

    t0 = time.perf_counter()
    row: dict = {"arch": name, "expected_blocks": expected_blocks(name)}
    graphs = {}
    for method in ("dynamo", "export"):
        graphs[method], err = _attempt(capture, name, method)
        row[f"capture_{method}"] = err or "ok"
    gm = graphs["dynamo"] or graphs["export"]
    row["blocks"] = None if gm is None else sum(la.kind == "block" for la in gfx.layers(gm))
    row["layers"] = None if gm is None else [la.name for la in gfx.layers(gm)]
    row["tp2_states_ratio"], row["tp2_states_error"] = _attempt(tp2_states_ratio, gm) if gm is not None \
        else (None, "no capture")
    if graphs["export"] is not None:
        row["tp2_states_ratio_export"], _ = _attempt(tp2_states_ratio, graphs["export"])
    if ARCHS[name][3] in ("lm", "seq2seq"):
        row["head_tp2_act_ratio"], row["head_tp2_act_error"] = _attempt(head_activation_ratio, name)
    plan, err = _attempt(meta_plan, name)
    row["meta_plan"] = plan or err
    if train:
        for label, value in train_errors(name, steps=steps, timeout=timeout).items():
            row[f"train_{label}"] = value
    row["seconds"] = time.perf_counter() - t0
    return row


def _states_cell(r: dict) -> str:
    """``tp2 states``: the dynamo figure, then the export one where it differs."""
    dyn, exp = r["tp2_states_ratio"], r.get("tp2_states_ratio_export")
    if dyn is None:
        return _cell(r["tp2_states_error"], 0)
    return f"{dyn:.3f}" if exp is None or abs(exp - dyn) < 5e-4 else f"{dyn:.3f} / {exp:.3f}"


def _train_ok(value, tol: float) -> bool:
    return isinstance(value, float) and value <= tol


def summary(rows: list[dict], tol: float) -> dict:
    ratios = [r["tp2_states_ratio"] for r in rows if r["tp2_states_ratio"] is not None]
    out = {
        "archs": len(rows),
        "capture_dynamo_ok": sum(r["capture_dynamo"] == "ok" for r in rows),
        "capture_export_ok": sum(r["capture_export"] == "ok" for r in rows),
        "blocks_ok": sum(r["blocks"] == r["expected_blocks"] for r in rows),
        "meta_plan_ok": sum(r["meta_plan"].startswith("ok") for r in rows),
        "median_tp2_states_ratio": statistics.median(ratios) if ratios else None,
        "train_tol": tol,
    }
    heads = [r["head_tp2_act_ratio"] for r in rows if r.get("head_tp2_act_ratio") is not None]
    if heads:
        out["max_head_tp2_act_ratio"] = max(heads)
    for label in TRAIN_PLANS:
        if any(f"train_{label}" in r for r in rows):
            out[f"train_ok_{label}"] = sum(_train_ok(r.get(f"train_{label}"), tol) for r in rows)
    return out


def _cell(value, tol: float, width: int = 28) -> str:
    if isinstance(value, float):
        return f"{value:.1e}" + ("" if value <= tol else " (>tol)")
    text = str(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _head_cell(row: dict) -> str:
    if "head_tp2_act_error" not in row:
        return "-"   # no LM head
    ratio = row["head_tp2_act_ratio"]
    return f"{ratio:.3f}" if ratio is not None else _cell(row["head_tp2_act_error"], 0)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--models", help=f"comma-separated subset of: {','.join(ARCHS)}")
    p.add_argument("--no-train", action="store_true", help="skip the 2-rank training runs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model for its 2-rank runs")
    p.add_argument("--steps", type=int, default=STEPS, help="AdamW steps per training run")
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss error counted as ok")
    args = p.parse_args()
    names = args.models.split(",") if args.models else list(ARCHS)
    unknown = sorted(set(names) - set(ARCHS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {','.join(ARCHS)}")
    torch.set_num_threads(min(8, torch.get_num_threads()))
    # NOTE: a failing fake-tensor call logs its whole traceback; the table keeps the first line
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

    rows = []
    for name in names:
        rows.append(coverage_row(name, train=not args.no_train, timeout=args.timeout, steps=args.steps))
        r = rows[-1]
        print(f"[{name}] {r['seconds']:.0f}s dynamo={r['capture_dynamo'] == 'ok'} blocks={r['blocks']}/"
              f"{r['expected_blocks']}", flush=True)

    train_cols = [c for c in TRAIN_PLANS if any(f"train_{c}" in r for r in rows)]
    headers = ["arch", "dynamo", "export", "blocks", "tp2 states", "head tp2", "meta plan"] + train_cols
    table = [[r["arch"], _cell(r["capture_dynamo"], args.tol), _cell(r["capture_export"], args.tol),
              f"{r['blocks']}/{r['expected_blocks']}",
              _states_cell(r),
              _head_cell(r),
              _cell(r["meta_plan"], args.tol)] + [_cell(r.get(f"train_{c}"), args.tol) for c in train_cols]
             for r in rows]
    print_table(headers, table)
    print("\nfailures:")
    for r in rows:
        for key in ["capture_dynamo", "capture_export", "tp2_states_error", "head_tp2_act_error", "meta_plan"] + \
                   [f"train_{c}" for c in train_cols]:
            value = r.get(key)
            if isinstance(value, float) and value > args.tol or isinstance(value, str) and not value.startswith("ok"):
                print(f"  {r['arch']:<10} {key:<16} {value}")
    s = summary(rows, args.tol)
    print("\nsummary: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()))
    write_json(args.json, {"summary": s, "rows": rows})


if __name__ == "__main__":
    main()
