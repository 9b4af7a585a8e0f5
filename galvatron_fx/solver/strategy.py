"""The per-layer strategy space of one pipeline stage.

A :class:`Strategy` says how one layer runs on the ``tp * dp`` devices of its pipeline stage:
tensor parallelism of degree ``tp`` (optionally with sequence parallelism), a data-parallel degree
``dp`` whose kind is plain DP, ZeRO-2 or ZeRO-3 (never a mix), and activation checkpointing on/off.
The pipeline degree is *not* part of a strategy: it is chosen outside this space (the caller loops
over pipeline degrees and partitions layers with :mod:`galvatron_fx.solver.pipeline`).

:func:`strategy_space` walks the decision tree (TP degree, then data-parallel kind, then SP, then
checkpointing, then the expert- and context-parallel degrees) and keeps the strategies that pass every rule in :data:`RULES`. Every pruning rule
lives there, once, as a named :class:`Rule` with a docstring; nothing else filters strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ConfigError

CP_KINDS: tuple[str, ...] = ("ring", "ulysses")
"""Context-parallel attention kinds: ``ring`` (key / value blocks passed around the CP group, merged
by their log-sum-exp) and ``ulysses`` (all-to-alls trade sequence shards for head shards around the
attention core); see :mod:`galvatron_fx.runtime.context_parallel`."""

SDP_KINDS: tuple[str, ...] = ("none", "zero2", "zero3")
"""Data-parallel kinds, in enumeration order: plain DP (replicated states), ZeRO-2 (optimizer states
and gradients sharded over the ``dp`` group), ZeRO-3 (parameters sharded too)."""


@dataclass(frozen=True, order=True)
class Strategy:
    """How one layer runs on the ``tp * dp`` devices of its pipeline stage.

    ``tp``: tensor-parallel degree; ``dp``: data-parallel degree; ``sdp``: data-parallel kind, one of
    :data:`SDP_KINDS`; ``sp``: sequence parallelism inside the TP group (needs ``tp > 1``); ``ckpt``:
    activation checkpointing (recompute the layer's forward in backward); ``ep``: expert-parallel
    degree of the layer's experts (MoE layers; divides ``dp``: the experts are split over ``ep``
    ranks of the DP group, :mod:`galvatron_fx.runtime.experts`); ``cp``: context-parallel degree
    (divides ``dp``: groups of ``cp`` consecutive DP ranks hold the same samples and split their
    sequence, so a rank holds ``B / (dp / cp)`` samples of ``S / cp`` tokens); ``cp_kind``: how
    attention runs over the sequence shards, one of :data:`CP_KINDS` (only meaningful for cp > 1);
    ``expert_tp``: with ``ep > 1`` and ``tp > 1``, shard each expert's weights over the TP group too
    (Megatron's expert tensor parallelism, the default) rather than keep them whole there and
    split the tokens over the TP ranks (:attr:`shards_experts`).
    """

    tp: int
    dp: int
    sdp: str = "none"
    sp: bool = False
    ckpt: bool = False
    ep: int = 1
    cp: int = 1
    cp_kind: str = "ring"
    expert_tp: bool = True

    @property
    def shards_experts(self) -> bool:
        """Whether the experts run tensor parallel (``expert_tp`` with ``ep > 1``, ``tp > 1``, no
        ``sp``: sequence-parallel tokens are split over the TP ranks already, the experts stay whole)."""
        return self.expert_tp and self.ep > 1 and self.tp > 1 and not self.sp

    def __post_init__(self) -> None:
        for key in ("tp", "dp", "ep", "cp"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"Strategy.{key} must be an int >= 1, got {v!r}")
        if self.sdp not in SDP_KINDS:
            raise ConfigError(f"Strategy.sdp must be one of {SDP_KINDS}, got {self.sdp!r}")
        if not isinstance(self.expert_tp, bool):
            raise ConfigError(f"Strategy.expert_tp must be a bool, got {self.expert_tp!r}")
        if not isinstance(self.sp, bool) or not isinstance(self.ckpt, bool):
            raise ConfigError(f"Strategy.sp and Strategy.ckpt must be bools, got sp={self.sp!r} ckpt={self.ckpt!r}")
        if self.dp % self.ep:
            raise ConfigError(f"Strategy.ep={self.ep} must divide dp={self.dp} (the experts are split over ep "
                              "ranks of the data-parallel group)")
        if self.dp % self.cp:
            raise ConfigError(f"Strategy.cp={self.cp} must divide dp={self.dp} (the sequence is split over cp "
                              "ranks of the data-parallel group)")
        if self.cp_kind not in CP_KINDS:
            raise ConfigError(f"Strategy.cp_kind must be one of {CP_KINDS}, got {self.cp_kind!r}")

    @property
    def devices(self) -> int:
        """Number of devices the layer occupies: ``tp * dp``."""
        return self.tp * self.dp

    @property
    def label(self) -> str:
        """Short stable label, e.g. ``"tp2·dp4·zero3·sp·ckpt"``, ``"tp1·dp8"``, ``"tp1·dp8·ep4"``,
        ``"tp2·dp4·cp4"`` (ring) or ``"tp2·dp4·cp4u"`` (Ulysses)."""
        parts = [f"tp{self.tp}", f"dp{self.dp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("u" if self.cp_kind == "ulysses" else ""))
        if self.sdp != "none":
            parts.append(self.sdp)
        if self.sp:
            parts.append("sp")
        if self.ckpt:
            parts.append("ckpt")
        return "·".join(parts)

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True)
class SpaceOptions:
    """The knobs of :func:`strategy_space` (see there), as one value the rules read."""

    devices_per_stage: int
    heads: int | None = None
    hidden: int | None = None
    devices_per_node: int = 8
    allow_cross_node_tp: bool = False
    power_of_two: bool = True
    ckpt: bool = True
    sp: bool = True
    zero2: bool = True
    zero3: bool = True
    max_tp: int | None = None
    ep: tuple[int, ...] = (1,)
    cp: tuple[int, ...] = (1,)
    cp_kinds: tuple[str, ...] = CP_KINDS


@dataclass(frozen=True)
class Rule:
    """A named pruning rule: ``allows(strategy, options)`` is False when the strategy is pruned."""

    name: str
    allows: Callable[[Strategy, SpaceOptions], bool]
    doc: str


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _power_of_two(s: Strategy, o: SpaceOptions) -> bool:
    """With ``power_of_two=True`` (default) the TP and DP degrees are powers of two, as in the papers:
    collectives and head/hidden splits are balanced, and the space stays small."""
    return not o.power_of_two or (_is_pow2(s.tp) and _is_pow2(s.dp))


def _tp_within_node(s: Strategy, o: SpaceOptions) -> bool:
    """TP all-reduces every layer's activations, so a TP group stays inside one node (its fast
    interconnect) unless ``allow_cross_node_tp=True``: ``tp <= devices_per_node`` and ``tp`` divides
    ``devices_per_node`` (so groups of consecutive ranks never straddle a node boundary)."""
    if o.allow_cross_node_tp:
        return True
    return s.tp <= o.devices_per_node and o.devices_per_node % s.tp == 0


def _tp_divides_heads(s: Strategy, o: SpaceOptions) -> bool:
    """Megatron-style TP splits attention by heads: ``tp`` divides ``heads`` (when given)."""
    return o.heads is None or o.heads % s.tp == 0


def _tp_divides_hidden(s: Strategy, o: SpaceOptions) -> bool:
    """TP splits the hidden / FFN dimensions evenly: ``tp`` divides ``hidden`` (when given)."""
    return o.hidden is None or o.hidden % s.tp == 0


def _max_tp(s: Strategy, o: SpaceOptions) -> bool:
    """``tp <= max_tp`` when a cap is given (e.g. a user constraint)."""
    return o.max_tp is None or s.tp <= o.max_tp


def _sdp_needs_dp(s: Strategy, o: SpaceOptions) -> bool:
    """ZeRO shards states over the data-parallel group; with ``dp == 1`` there is nothing to shard,
    so ZeRO-2/3 equal plain DP (same memory, same time, no communication). We canonicalise such a
    layer to ``sdp="none"`` and prune the two duplicates: with ``dp == 1`` only ``sdp="none"``."""
    return s.dp > 1 or s.sdp == "none"


def _sp_needs_tp(s: Strategy, o: SpaceOptions) -> bool:
    """Sequence parallelism splits the non-TP regions (norms, dropout) across the TP group; with
    ``tp == 1`` it is a no-op, so ``sp=True`` requires ``tp > 1``."""
    return s.tp > 1 or not s.sp


def _ep_degrees(s: Strategy, o: SpaceOptions) -> bool:
    """Expert parallelism splits the experts of MoE layers over ``ep`` ranks of the DP group: the
    space offers the degrees ``ep`` lists (the search: those some layer's experts divide by)."""
    return s.ep == 1 or s.ep in o.ep


def _cp_degrees(s: Strategy, o: SpaceOptions) -> bool:
    """Context parallelism splits the sequence over ``cp`` ranks of the DP group: the space offers
    the degrees ``cp`` lists and the attention kinds ``cp_kinds`` lists (the search: cp > 1 only for
    long sequences or when a constraint asks, :func:`galvatron_fx.planner.cp_degrees`)."""
    return s.cp == 1 or (s.cp in o.cp and s.cp_kind in o.cp_kinds)


def _cp_kind_needs_cp(s: Strategy, o: SpaceOptions) -> bool:
    """The attention kind only matters with ``cp > 1``: a ``cp == 1`` strategy is canonicalised to
    ``cp_kind="ring"`` and its Ulysses twin (same time, same memory) pruned."""
    return s.cp > 1 or s.cp_kind == "ring"


def _cp_without_ep(s: Strategy, o: SpaceOptions) -> bool:
    """A layer with ``cp > 1`` runs without expert parallelism: the context-parallel pass refuses
    both on the same layer (EP's token exchange is not written for sequence shards). Sequence
    parallelism composes: its TP chunks are chunks of the rank's CP shard."""
    return s.cp == 1 or s.ep == 1


def _ulysses_divides_heads(s: Strategy, o: SpaceOptions) -> bool:
    """Ulysses trades sequence shards for head shards: the ``heads / tp`` heads of a TP rank split
    over the ``cp`` ranks, so ``cp`` divides ``heads / tp`` (when ``heads`` is given; the search
    asks each layer's attention, :meth:`galvatron_fx.cost.CostModel.cp_admits`)."""
    return s.cp == 1 or s.cp_kind != "ulysses" or o.heads is None or (o.heads // s.tp) % s.cp == 0


def _switches(s: Strategy, o: SpaceOptions) -> bool:
    """The on/off switches of the space: ``ckpt=False`` drops checkpointed strategies, ``sp=False``
    drops SP, ``zero2=False`` / ``zero3=False`` drop that data-parallel kind."""
    if s.ckpt and not o.ckpt:
        return False
    if s.sp and not o.sp:
        return False
    if s.sdp == "zero2" and not o.zero2:
        return False
    return not (s.sdp == "zero3" and not o.zero3)


RULES: tuple[Rule, ...] = tuple(
    Rule(fn.__name__.lstrip("_"), fn, (fn.__doc__ or "").strip())
    for fn in (_power_of_two, _tp_within_node, _tp_divides_heads, _tp_divides_hidden, _max_tp,
               _sdp_needs_dp, _sp_needs_tp, _ep_degrees, _cp_degrees, _cp_kind_needs_cp, _cp_without_ep,
               _ulysses_divides_heads,
               _switches)
)
"""Every pruning rule of the space, in the order they are checked. ``tp * dp == devices_per_stage``
holds by construction (the tree enumerates ``tp`` over divisors and sets ``dp`` from it)."""


def _options(devices_per_stage: int, **kwargs) -> SpaceOptions:
    o = SpaceOptions(devices_per_stage, **kwargs)
    for key in ("devices_per_stage", "devices_per_node"):
        v = getattr(o, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key} must be an int >= 1, got {v!r}")
    for key in ("heads", "hidden", "max_tp"):
        v = getattr(o, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{key} must be None or an int >= 1, got {v!r}")
    for key in ("ep", "cp"):
        bad = [v for v in getattr(o, key) if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ConfigError(f"{key} degrees must be ints >= 1, got {bad}")
    return o


def rejecting_rules(strategy: Strategy, devices_per_stage: int | None = None, **kwargs) -> list[str]:
    """Names of the rules in :data:`RULES` that prune ``strategy`` under the given options
    (same keywords as :func:`strategy_space`; ``devices_per_stage`` defaults to ``strategy.devices``)."""
    o = _options(strategy.devices if devices_per_stage is None else devices_per_stage, **kwargs)
    bad = [r.name for r in RULES if not r.allows(strategy, o)]
    if strategy.devices != o.devices_per_stage:
        bad.insert(0, "devices_match")
    return bad


def strategy_space(
    devices_per_stage: int,
    *,
    heads: int | None = None,
    hidden: int | None = None,
    devices_per_node: int = 8,
    allow_cross_node_tp: bool = False,
    power_of_two: bool = True,
    ckpt: bool = True,
    sp: bool = True,
    zero2: bool = True,
    zero3: bool = True,
    max_tp: int | None = None,
    ep: tuple[int, ...] = (1,),
    cp: tuple[int, ...] = (1,),
    cp_kinds: tuple[str, ...] = CP_KINDS,
) -> list[Strategy]:
    """All strategies for ``devices_per_stage`` devices that pass every rule in :data:`RULES`.

    Decision tree: TP degree ``tp`` (a divisor of ``devices_per_stage``; ``dp = devices_per_stage /
    tp``), then the data-parallel kind (``"none"``, ``"zero2"``, ``"zero3"``), then SP, then
    checkpointing, then the expert-parallel degree among ``ep`` (dividing ``dp``; MoE layers: the
    search offers ``ep > 1`` only to layers with experts), then the context-parallel degree among
    ``cp`` (dividing ``dp``) and, for ``cp > 1``, the attention kind among ``cp_kinds``
    (:data:`CP_KINDS`). The order is deterministic (ascending ``tp``, then kinds in
    :data:`SDP_KINDS` order, ``sp`` False before True, ``ckpt`` False before True, ascending ``ep``,
    ascending ``cp``, kinds in :data:`CP_KINDS` order), so strategy indices are stable; with the
    default ``cp=(1,)`` the space is the one without context parallelism.
    """
    kinds = tuple(k for k in CP_KINDS if k in set(cp_kinds))
    bad = sorted(set(cp_kinds) - set(CP_KINDS))
    if bad:
        raise ConfigError(f"cp_kinds must be among {CP_KINDS}, got {bad}")
    o = _options(devices_per_stage, heads=heads, hidden=hidden, devices_per_node=devices_per_node,
                 allow_cross_node_tp=allow_cross_node_tp, power_of_two=power_of_two, ckpt=ckpt, sp=sp,
                 zero2=zero2, zero3=zero3, max_tp=max_tp, ep=tuple(sorted({1, *ep})), cp=tuple(sorted({1, *cp})),
                 cp_kinds=kinds)
    n = o.devices_per_stage
    out = []
    for tp in (d for d in range(1, n + 1) if n % d == 0):
        for sdp in SDP_KINDS:
            for use_sp in (False, True):
                for use_ckpt in (False, True):
                    for e in (e for e in o.ep if (n // tp) % e == 0):
                        for c in (c for c in o.cp if (n // tp) % c == 0):
                            for kind in (o.cp_kinds if c > 1 else ("ring",)):
                                s = Strategy(tp, n // tp, sdp, use_sp, use_ckpt, e, c, kind)
                                if all(r.allows(s, o) for r in RULES):
                                    out.append(s)
    return out


def candidate_counts(device_counts: Iterable[int] = (1, 2, 4, 8, 16, 64), **kwargs) -> dict[int, int]:
    """Number of per-stage strategies for each device count (keywords as :func:`strategy_space`).

    With the defaults (power-of-two degrees, TP within an 8-device node, all switches on) the counts
    are ``{1: 2, 2: 10, 4: 22, 8: 34, 16: 42, 64: 42}``; without checkpointing (``ckpt=False``) half
    of that: ``{1: 1, 2: 5, 4: 11, 8: 17, 16: 21, 64: 21}``. From two nodes on the count is flat:
    TP is capped at the node size and every TP degree then has ``dp > 1`` (all three kinds).

    Comparison with the papers' "22 strategies on 8 GPUs" (Galvatron, arXiv 2211.13878, without
    checkpointing). As we read the paper and its reference implementation, that figure counts whole
    hybrid strategies on 8 GPUs, i.e. it also chooses the pipeline degree ``pp`` in {1, 2, 4, 8} at
    the top of the decision tree and, for mixed TP x DP levels, *which dimension is inner*
    (consecutive ranks: TP-inner or DP-inner), with data-parallel kind DP or SDP (= ZeRO-3) but no
    ZeRO-2, no SP. Our space differs in three ways:

    * the pipeline degree is *not* in it: it is searched outside (one space per ``8 / pp`` devices),
      so the comparable count is the sum of our counts over ``pp``;
    * TP is always the inner dimension (consecutive ranks, NVLink-adjacent), because TP
      communicates per layer and DP once per step; the DP-inner variants are not enumerated;
    * ZeRO-2 and SP (and checkpointing) are extra dimensions.

    Restricting ours to the paper's dimensions (``ckpt=False, sp=False, zero2=False``) and summing
    over ``pp`` gives ``7 + 5 + 3 + 1 = 16`` for 8 GPUs; the 6 missing ones are the DP-inner
    placements of tp2·dp4, tp4·dp2 (8 devices) and tp2·dp2 (4 devices), each with DP or SDP:
    ``16 + 6 = 22``. (Keeping ZeRO-2 and dropping those 6 also happens to give ``10 + 7 + 4 + 1 = 22``.)
    See :func:`paper_comparable_count`.
    """
    return {n: len(strategy_space(n, **kwargs)) for n in device_counts}


def paper_comparable_count(world_size: int = 8, **kwargs) -> int:
    """Sum over power-of-two pipeline degrees ``pp`` of the per-stage space size on
    ``world_size / pp`` devices, restricted to the paper's dimensions (no ckpt, no SP, no ZeRO-2)
    unless overridden by keywords. 16 for 8 GPUs; see :func:`candidate_counts` for the 22."""
    kw = {"ckpt": False, "sp": False, "zero2": False, **kwargs}
    pps = [p for p in range(1, world_size + 1) if world_size % p == 0 and _is_pow2(p)]
    return sum(len(strategy_space(world_size // p, **kw)) for p in pps)
