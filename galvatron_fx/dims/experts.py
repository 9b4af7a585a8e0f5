"""Expert parallelism for mixture-of-experts layers: fields ``ep`` and ``expert_tp``.

The experts of a layer split over ``ep`` ranks of its data-parallel group; tokens reach their
experts by an all-gather or an all-to-all dispatch. With ``tp > 1`` each expert's weights are also
sharded over the TP group (``expert_tp``, Megatron's expert tensor parallelism, the default) or kept
whole there with the tokens split over the TP ranks. Offered only to layers with experts, at degrees
dividing their expert counts. Rewritten by ``passes/expert_parallel.py``; run by
``runtime/experts.py``.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Admission,
    Dimension,
    Field,
    PassSpec,
    SpaceOptions,
    a_bool,
    as_list,
    plan_bool,
    plan_int,
    positive_int,
    rule,
)


def _ep_degrees(s: Any, o: SpaceOptions) -> bool:
    """Expert parallelism splits the experts of MoE layers over ``ep`` ranks of the DP group: the
    space offers the degrees ``ep`` lists (the search: those some layer's experts divide by)."""
    return s.ep == 1 or s.ep in o.ep


def _ep_divides_dp(s: Any) -> str | None:
    if s.dp % s.ep:
        return (f"Strategy.ep={s.ep} must divide dp={s.dp} (the experts are split over ep ranks of the "
                "data-parallel group)")
    return None


def _shards_experts(self) -> bool:
    """Whether the experts run tensor parallel (``expert_tp`` with ``ep > 1``, ``tp > 1``, no
    ``sp``: sequence-parallel tokens are split over the TP ranks already, the experts stay whole)."""
    return self.expert_tp and self.ep > 1 and self.tp > 1 and not self.sp


def _admission(cost_model: Any, constraints) -> Admission:
    """``ep == 1`` on layers without experts; on layers with experts the degrees dividing each
    block's experts (and in the ``ep`` constraint, when given)."""
    allowed = constraints.get("ep")
    allowed = None if allowed is None else set(as_list(allowed, "ep"))
    cache: dict = {}

    def admits(layer: int, s: Any) -> bool:
        key = (layer, s.ep)
        if key not in cache:
            ex = cost_model.experts(layer)
            cache[key] = s.ep == 1 if ex is None else (allowed is None or s.ep in allowed) and ex.allows(s.ep)
        return cache[key]
    return Admission(admits=admits)


def _explain(layers: list) -> list[str]:
    """One line per distinct expert-parallel setting: the layers, ``ep``, the token dispatch and
    how the experts run over TP (expert TP: sharded; token split: whole, the tokens split)."""
    groups: dict[tuple, list[str]] = {}
    for lp in layers:
        if lp.ep > 1:
            over_tp = "" if lp.tp == 1 else ", experts sharded over tp" if lp.expert_tp else ", tokens split over tp"
            groups.setdefault((lp.ep, lp.extra.get("ep_dispatch", "allgather"), over_tp), []).append(lp.name)
    return [f"expert parallelism: ep {ep} ({dispatch} dispatch{over_tp}) on {len(names)} layer(s): "
            f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} (applies to layers with experts; others run ep 1)"
            for (ep, dispatch, over_tp), names in groups.items()]


def _plan_ep(w: str, layer, micro_batch: int) -> str | None:
    if (why := plan_int(f"{w}.ep", layer.ep)):
        return why
    if layer.dp % layer.ep:
        return (f"plan {w} ({layer.name!r}): ep={layer.ep} does not divide dp={layer.dp}; the experts are "
                f"split over ep ranks of the data-parallel group: use an ep dividing {layer.dp}")
    return plan_bool(f"{w}.expert_tp", layer.extra.get("expert_tp", True))


DIMENSION = Dimension(
    name="experts",
    fields=(Field("ep", int, 1, 60, values=lambda o, n, c: [e for e in o.ep if c["dp"] % e == 0], check=positive_int),
            # NOTE: not enumerated (the search keeps Megatron's default); the plan JSON keeps it in a
            # layer's extra keys, written only when set
            Field("expert_tp", bool, True, 90, check=a_bool, in_json=False)),
    rules=(rule(_ep_degrees),),
    admission=_admission,
    label=lambda s: [(30, f"ep{s.ep}")] if s.ep > 1 else [],
    explain=_explain,
    cost_terms=lambda cm, index, n, s, work: cm.expert_terms(index, n, s),
    passes=(PassSpec("expert_parallel", after="context_parallel",
                     when=lambda ctx: any(lp.ep > 1 for lp in ctx.plan.layers)),),
    runtime=("runtime.experts",),
    properties={"shards_experts": property(_shards_experts)},
    checks=(_ep_divides_dp,),
    plan_checks=(_plan_ep,),
)
