"""The training loop users write around a model, for the loop tests (single device and distributed).

One loop body (:func:`fit`) runs the eager reference and every distributed door alike: a new batch
every step (labels from a collator: -100 on padding), a gradient clip, AdamW over param groups
built by name, a cosine LR schedule; it records the loss and the clip's total norm of every step.
"""

from __future__ import annotations

import math

import torch

V, S, B = 64, 16, 12            # vocabulary, sequence, global batch (B differs from every model extent)
LR, WD, CLIP = 1e-2, 0.5, 0.05  # CLIP small enough that every step clips


def neox():
    """A tiny transformers GPT-NeoX (seeded; parallel attention + MLP residual, rotary on a quarter
    of each head)."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  max_position_embeddings=32, rotary_pct=0.25))


def moe(kind: str):
    """A tiny transformers mixture-of-experts model (seeded): ``"mixtral"`` (8 experts, top-2) or
    ``"qwen2-moe"`` (4 routed experts, top-2, a shared expert behind a 1-wide sigmoid gate)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=32, num_experts_per_tok=2)
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=64, num_local_experts=8, **common))
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=64, num_experts=4,
                                                    decoder_sparse_step=1, **common))


def falcon(tied: bool = True):
    """A tiny transformers Falcon (seeded): multi-query attention (one key / value head beside 4
    query heads, fused into one projection), parallel attention + MLP, rotary embeddings; the
    output head tied to the embedding unless ``tied=False``."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.FalconForCausalLM(tf.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                                alibi=False, bias=False, max_position_embeddings=32,
                                                tie_word_embeddings=tied))


def mistral(window: int = 8):
    """A tiny transformers Mistral (seeded) whose attention sees the last ``window`` tokens only."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.MistralForCausalLM(tf.MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=32, sliding_window=window))


def llama(lora: bool = False, freeze: tuple[str, ...] = (), layers: int = 2):
    """A tiny transformers Llama (seeded) of ``layers`` blocks, optionally with peft LoRA on q/v
    (r = 4; everything else frozen) or with the parameters whose names contain one of ``freeze`` frozen."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = tf.LlamaForCausalLM(cfg)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0, init_lora_weights=False))
    for name, p in model.named_parameters():
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    return model


def collate(steps: int, batch: int = B, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of ``batch`` sequences of random lengths, right-padded to ``S`` with token 0,
    labels = inputs with -100 on the padding (what a causal-LM collator gives)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, V, (batch, S), generator=g)
        lengths = torch.randint(S // 2, S + 1, (batch,), generator=g)
        pad = torch.arange(S)[None, :] >= lengths[:, None]
        ids[pad] = 0
        labels = ids.masked_fill(pad, -100)
        out.append(dict(input_ids=ids, labels=labels))
    return out


def param_groups(named, wd: float = WD, frozen_lr_for: tuple[str, ...] = ()):
    """AdamW param groups by name: biases and norms without weight decay (names in ``frozen_lr_for``
    also with lr 0), the rest with ``wd``; trainable parameters only."""
    decay, plain, still = [], [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        if any(k in name for k in frozen_lr_for):
            still.append(p)
        elif name.endswith("bias") or "norm" in name or ".ln" in name:
            plain.append(p)
        else:
            decay.append(p)
    groups = [dict(params=decay, weight_decay=wd), dict(params=plain, weight_decay=0.0)]
    if still:
        groups.append(dict(params=still, weight_decay=0.0, lr=0.0))
    return [g for g in groups if g["params"]]


def optimizer(named, **kw):
    """AdamW over :func:`param_groups` with a cosine schedule (warm-up free, to 10 % of ``LR``)."""
    opt = torch.optim.AdamW(param_groups(named, **kw), lr=LR, eps=1e-6)
    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)))
    return opt, sched


def fit(step, params, opt, sched, batches, clip=None) -> tuple[list[float], list[float]]:
    """The loop: ``loss = step(batch)`` (forward and backward), ``norm = clip(params)`` (default
    ``torch.nn.utils.clip_grad_norm_(params(), CLIP)``), optimizer and schedule steps. Returns the
    losses and the total norms."""
    clip = clip or (lambda: torch.nn.utils.clip_grad_norm_(list(params()), CLIP))
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        loss = step(batch)
        norms.append(float(clip()))
        opt.step()
        sched.step()
        losses.append(float(loss))
    return losses, norms


def eager(model, batches, clip: bool = True, **group_kw):
    """The single-device reference: ``(losses, norms, final parameters)``."""
    opt, sched = optimizer(model.named_parameters(), **group_kw)

    def step(b):
        loss = model(**b).loss
        loss.backward()
        return loss.item()

    losses, norms = fit(step, model.parameters, opt, sched, batches,
                        None if clip else (lambda: 0.0))
    return losses, norms, {k: p.detach().clone() for k, p in model.named_parameters()}


def plain_losses(model, batches, lr: float, opt=None) -> list[float]:
    """The plainest loop: AdamW over ``model.parameters()`` (or ``opt``), ``model(**b).loss`` (one
    device, or a model compiled with the galvatron backend)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def initialised_reference(model, seed: int, batches, lr: float) -> tuple[dict, list[float]]:
    """One device: ``model`` re-initialised by its own initialiser under ``seed`` (what
    ``dist_model.init_weights(seed=seed)`` reproduces) and its parameters, then the losses of the
    plain AdamW loop over ``batches``."""
    for t in [*model.modules(), *model.parameters()]:
        t.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    model.initialize_weights()
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    return init, plain_losses(model, batches, lr)


def step_losses(dm, batches, lr: float) -> list[float]:
    """The same plain loop on a distributed model (``dm.train_step``, AdamW over ``dm.parameters()``)."""
    opt = torch.optim.AdamW(dm.parameters(), lr=lr)
    out = []
    for b in batches:
        out.append(dm.train_step(**b).item())
        opt.step()
        opt.zero_grad()
    return out


def rel(a, b) -> float:
    """Largest relative difference of two sequences of numbers."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def meta_training(build, world: int, **plan) -> tuple[dict, list[float]]:
    """On every rank: ``build()`` on the meta device, captured (dynamo) on meta batches, a
    ``Plan.uniform(**plan)`` over ``world`` ranks, ``init_weights(seed=7)``, 3 AdamW steps (lr 1e-2):
    ``(full state dict, losses)`` (compare with :func:`initialised_reference` at seed 7)."""
    import galvatron_fx as gfx

    with torch.device("meta"):
        meta = build()
    batches = collate(3)
    gm = gfx.capture(meta, (), kwargs={k: v.to("meta") for k, v in batches[0].items()}, method="dynamo")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, global_batch_size=B, **plan))
    dm.init_weights(seed=7)
    return dm.full_state_dict(), step_losses(dm, batches, lr=1e-2)
