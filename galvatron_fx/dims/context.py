"""Context parallelism: fields ``cp`` and ``cp_kind``.

Groups of ``cp`` consecutive data-parallel ranks hold the same samples and split their sequence, so
a rank holds ``B / (dp / cp)`` samples of ``S / cp`` tokens. Attention runs over the shards as a
ring (key / value blocks passed around, each block through the fused SDPA kernels, merged exactly
by their log-sum-exp) or Ulysses (all-to-alls trade sequence shards for head shards). Offered from
long sequences on, or where a constraint asks. Rewritten by ``passes/context_parallel.py``; run by
``runtime/context_parallel.py`` and ``runtime/ring_attention.py``.
"""

from __future__ import annotations

from typing import Any

from .base import (
    Admission,
    Dimension,
    Field,
    PassSpec,
    SpaceOptions,
    as_list,
    one_of,
    plan_int,
    positive_int,
    rule,
)

CP_KINDS: tuple[str, ...] = ("ring", "ulysses")
"""Context-parallel attention kinds: ``ring`` (key / value blocks passed around the CP group, merged
by their log-sum-exp) and ``ulysses`` (all-to-alls trade sequence shards for head shards around the
attention core); see :mod:`galvatron_fx.runtime.context_parallel`."""


def _cp_degrees(s: Any, o: SpaceOptions) -> bool:
    """Context parallelism splits the sequence over ``cp`` ranks of the DP group: the space offers
    the degrees ``cp`` lists and the attention kinds ``cp_kinds`` lists (the search: cp > 1 only for
    long sequences or when a constraint asks, :func:`galvatron_fx.planner.cp_degrees`)."""
    return s.cp == 1 or (s.cp in o.cp and s.cp_kind in o.cp_kinds)


def _cp_kind_needs_cp(s: Any, o: SpaceOptions) -> bool:
    """The attention kind only matters with ``cp > 1``: a ``cp == 1`` strategy is canonicalised to
    ``cp_kind="ring"`` and its Ulysses twin (same time, same memory) pruned."""
    return s.cp > 1 or s.cp_kind == "ring"


def _cp_without_ep(s: Any, o: SpaceOptions) -> bool:
    """A layer with ``cp > 1`` runs without expert parallelism: the context-parallel pass refuses
    both on the same layer (EP's token exchange is not written for sequence shards). Sequence
    parallelism composes: its TP chunks are chunks of the rank's CP shard."""
    return s.cp == 1 or s.ep == 1


def _ulysses_divides_heads(s: Any, o: SpaceOptions) -> bool:
    """Ulysses trades sequence shards for head shards: the ``heads / tp`` heads of a TP rank split
    over the ``cp`` ranks, so ``cp`` divides ``heads / tp`` (when ``heads`` is given; the search
    asks each layer's attention, :meth:`galvatron_fx.cost.CostModel.cp_admits`)."""
    return s.cp == 1 or s.cp_kind != "ulysses" or o.heads is None or (o.heads // s.tp) % s.cp == 0


def _cp_divides_dp(s: Any) -> str | None:
    if s.dp % s.cp:
        return (f"Strategy.cp={s.cp} must divide dp={s.dp} (the sequence is split over cp ranks of the "
                "data-parallel group)")
    return None


def kinds_of(constraints) -> list[str]:
    """The context-parallel kinds the search offers: the ``cp_kind`` constraint's, else all."""
    from ..errors import ConfigError

    kinds = as_list((constraints or {}).get("cp_kind"), "cp_kind", str) or list(CP_KINDS)
    bad = [k for k in kinds if k not in CP_KINDS]
    if bad:
        raise ConfigError(f"constraint cp_kind must be among {list(CP_KINDS)}, got {bad}")
    return kinds


def _admission(cost_model: Any, constraints) -> Admission:
    """A layer runs at degree ``cp`` with attention ``kind`` under TP degree ``tp`` where the
    context-parallel pass takes it (:meth:`~galvatron_fx.cost.CostModel.cp_refuses`), ``cp`` is
    among the ``cp`` constraint's degrees and ``kind`` among the kinds (when given). ``cp == 1`` is
    admitted where the constraint has 1 or the layer takes none of its degrees at all (at
    ``tp = 1``; it then runs whole), so ``cp=4`` pins cp 4 on every layer that can take it."""
    asked = as_list(constraints.get("cp"), "cp")
    allowed = None if asked is None else set(asked)
    kinds = set(kinds_of(constraints))
    cache: dict = {}

    def takes(layer: int, cp: int, kind: str, tp: int) -> bool:
        key = (layer, cp, kind, tp)
        if key not in cache:
            cache[key] = not cost_model.cp_refuses(layer, cp, kind, tp)
        return cache[key]

    def admits(layer: int, s: Any) -> bool:
        if s.cp == 1:
            return allowed is None or 1 in allowed or not any(
                takes(layer, c, k, 1) for c in allowed if c > 1 for k in kinds)
        return (allowed is None or s.cp in allowed) and s.cp_kind in kinds and takes(layer, s.cp, s.cp_kind, s.tp)
    return Admission(admits=admits)


def _explain(layers: list) -> list[str]:
    """One line per context-parallel setting (``cp``, ``cp_kind``): its layers and how their
    attention exchanges the sequence shards (``extra["cp_exchange_s"]``: the search's seconds per
    micro-batch, when recorded)."""
    groups: dict[tuple, list] = {}
    for lp in layers:
        if lp.cp > 1:
            groups.setdefault((lp.cp, lp.cp_kind), []).append(lp)
    out = []
    for (cp, kind), lps in groups.items():
        how = (f"key / value shards passed around a ring of {cp} ranks" if kind == "ring"
               else f"all-to-alls of query / key / value / output over {cp} ranks")
        names = [lp.name for lp in lps]
        line = (f"context parallelism: cp {cp} ({kind}: {how}) on {len(names)} layer(s): {', '.join(names[:3])}"
                f"{' ...' if len(names) > 3 else ''}")
        spent = sum(lp.extra.get("cp_exchange_s", 0.0) for lp in lps)
        if spent:
            line += f"; exchanges {spent * 1e3:.3f} ms per micro-batch"
        out.append(line)
    if out:
        out.append("  (a CP group's ranks hold the same samples, 1/cp of the sequence each; leaving for another "
                   "layout the sequence is all-gathered)")
    return out


def _plan_cp(w: str, layer, micro_batch: int) -> str | None:
    """The degree, the kind, and the batch slices (``dp / cp``: a CP group shares its samples) that
    must divide the micro-batch."""
    if (why := plan_int(f"{w}.cp", layer.cp)):
        return why
    dp, cp = layer.dp, layer.cp
    if dp % cp:
        return (f"plan {w} ({layer.name!r}): cp={cp} does not divide dp={dp}; the sequence is "
                f"split over cp ranks of the data-parallel group: use a cp dividing {dp}")
    if layer.cp_kind not in CP_KINDS:
        return f"plan {w}.cp_kind must be one of {list(CP_KINDS)}, got {layer.cp_kind!r}"
    if micro_batch % (dp // cp):
        what = f"dp={dp}" if cp == 1 else f"dp/cp = {dp}/{cp} = {dp // cp}"
        return (f"plan {w} ({layer.name!r}): {what} does not divide the micro-batch of "
                f"global_batch_size/micro_batches = {micro_batch} samples; change global_batch_size, "
                "micro_batches or dp")
    return None


DIMENSION = Dimension(
    name="context",
    fields=(Field("cp", int, 1, 70, values=lambda o, n, c: [x for x in o.cp if c["dp"] % x == 0], check=positive_int),
            Field("cp_kind", str, "ring", 80, values=lambda o, n, c: o.cp_kinds if c["cp"] > 1 else ("ring",),
                  check=one_of(CP_KINDS))),
    rules=tuple(map(rule, (_cp_degrees, _cp_kind_needs_cp, _cp_without_ep, _ulysses_divides_heads))),
    admission=_admission,
    label=lambda s: [(40, f"cp{s.cp}" + ("u" if s.cp_kind == "ulysses" else ""))] if s.cp > 1 else [],
    explain=_explain,
    compute_terms=lambda cm, index, n, s: cm.context_compute(index, n, s),
    cost_terms=lambda cm, index, n, s, work: cm.context_terms(index, n, s),
    passes=(PassSpec("context_parallel", after="local_batch",
                     when=lambda ctx: any(lp.cp > 1 for lp in ctx.plan.layers)),),
    runtime=("runtime.context_parallel", "runtime.ring_attention", "runtime.seq_layout"),
    checks=(_cp_divides_dp,),
    plan_checks=(_plan_cp,),
)
