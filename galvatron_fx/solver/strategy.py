"""The per-layer strategy space of one pipeline stage.

A :class:`Strategy` says how one layer runs on the ``tp * dp`` devices of its pipeline stage: one
value of each field of the registered parallel dimensions (:mod:`galvatron_fx.dims`): tensor
parallelism ``tp`` with sequence parallelism ``sp``, the data-parallel degree ``dp`` and kind
``sdp`` (plain DP, ZeRO-2 or ZeRO-3), activation checkpointing ``ckpt``, the expert-parallel degree
``ep`` (with ``expert_tp``) and the context-parallel degree ``cp`` with its attention ``cp_kind``.
The pipeline degree is *not* part of a strategy: it is chosen outside this space (the caller loops
over pipeline degrees and partitions layers with :mod:`galvatron_fx.solver.pipeline`).

:func:`strategy_space` walks the decision tree (the fields in their registered order: TP degree,
data-parallel kind, SP, checkpointing, then the expert- and context-parallel degrees) and keeps
the strategies that pass every rule in :data:`RULES`: the dimensions' rules, each a named
:class:`Rule` with a docstring; nothing else filters strategies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from .. import dims
from ..dims import Rule, SpaceOptions
from ..dims.checkpointing import is_ckpt_mode
from ..dims.context import CP_KINDS
from ..dims.data import SDP_KINDS
from ..errors import ConfigError

__all__ = ["CP_KINDS", "RULES", "SDP_KINDS", "Rule", "SpaceOptions", "Strategy", "candidate_counts",
           "paper_comparable_count", "rejecting_rules", "strategy_space"]


def _post_init(self) -> None:
    for f in dims.fields():
        if f.complete is not None and getattr(self, f.name) is None:
            object.__setattr__(self, f.name, f.complete(self))   # a frozen dataclass completes itself here
    dims.validate(self)


def _devices(self) -> int:
    """Number of devices the layer occupies: ``tp * dp``."""
    return self.tp * self.dp


def _label(self) -> str:
    """Short stable label, e.g. ``"tp2·dp4·zero3·sp·ckpt"``, ``"tp1·dp8"``, ``"tp1·dp8·ep4"``,
    ``"tp2·dp4·cp4"`` (ring) or ``"tp2·dp4·cp4u"`` (Ulysses): each dimension's pieces."""
    return dims.label(self)


Strategy = dataclasses.make_dataclass(
    "Strategy",
    [(f.name, f.type) if f.default is None and f.complete is None else (f.name, f.type, dataclasses.field(default=f.default))
     for f in dims.fields()],
    frozen=True, order=True,
    namespace={"__post_init__": _post_init, "devices": property(_devices), "label": property(_label),
               "__str__": lambda self: self.label, **dims.strategy_namespace(),
               "__doc__": """How one layer runs on the ``tp * dp`` devices of its pipeline stage: one value
    of each registered dimension's fields, in their order (``Strategy(tp, dp, sdp, sp, ckpt, ep, cp,
    cp_kind, expert_tp)``; :mod:`galvatron_fx.dims` documents each). ``tp``: tensor-parallel degree;
    ``dp``: data-parallel degree; ``sdp``: data-parallel kind, one of :data:`SDP_KINDS`; ``sp``:
    sequence parallelism inside the TP group (needs ``tp > 1``); ``ckpt``: activation checkpointing;
    ``ep``: expert-parallel degree (divides ``dp``); ``cp``: context-parallel degree (divides ``dp``);
    ``cp_kind``: one of :data:`CP_KINDS`; ``expert_tp``: with ``ep > 1`` and ``tp > 1``, shard each
    expert over the TP group too (:attr:`shards_experts`)."""})


Strategy.__module__ = __name__   # NOTE: pickled by name (plans are broadcast between ranks)


RULES: tuple[Rule, ...] = dims.rules()
"""Every pruning rule of the space (each dimension's, in registry order). ``tp * dp ==
devices_per_stage`` holds by construction (the tree enumerates ``tp`` over divisors and sets ``dp``
from it)."""


def _options(devices_per_stage: int, **kwargs) -> SpaceOptions:
    ckpt = kwargs.get("ckpt", True)
    if not isinstance(ckpt, bool):
        if isinstance(ckpt, str) or not all(is_ckpt_mode(m) for m in ckpt):
            raise ConfigError(f"ckpt must be a bool or a list of false / 'selective' / 'selective-op' / true, got {ckpt!r}")
        kwargs["ckpt"] = tuple(ckpt)
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
    ckpt: bool | tuple = True,
    sp: bool = True,
    zero2: bool = True,
    zero3: bool = True,
    max_tp: int | None = None,
    ep: tuple[int, ...] = (1,),
    cp: tuple[int, ...] = (1,),
    cp_kinds: tuple[str, ...] = CP_KINDS,
    more: dict | None = None,
) -> list[Strategy]:
    """All strategies for ``devices_per_stage`` devices that pass every rule in :data:`RULES`.

    Decision tree: TP degree ``tp`` (a divisor of ``devices_per_stage``; ``dp = devices_per_stage /
    tp``), then the data-parallel kind (``"none"``, ``"zero2"``, ``"zero3"``), then SP, then
    checkpointing, then the expert-parallel degree among ``ep`` (dividing ``dp``; MoE layers: the
    search offers ``ep > 1`` only to layers with experts), then the context-parallel degree among
    ``cp`` (dividing ``dp``) and, for ``cp > 1``, the attention kind among ``cp_kinds``
    (:data:`CP_KINDS`). The order is deterministic (ascending ``tp``, then kinds in
    :data:`SDP_KINDS` order, ``sp`` False before True, ``ckpt`` False, "selective", True, ascending ``ep``,
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
                 cp_kinds=kinds, more=dict(more or {}))
    key = (o, tuple(sorted(o.more.items())))
    if key not in _SPACES:
        if len(_SPACES) > 4096:
            _SPACES.clear()
        _SPACES[key] = tuple(st for st in dims.enumerate_strategies(Strategy, o) if all(r.allows(st, o) for r in RULES))
    return list(_SPACES[key])


_SPACES: dict[tuple, tuple] = {}
"""The spaces built so far, by their options: a search asks for the same few spaces per pipeline
degree many times (one per micro-batch count and schedule)."""


def candidate_counts(device_counts: Iterable[int] = (1, 2, 4, 8, 16, 64), **kwargs) -> dict[int, int]:
    """Number of per-stage strategies for each device count (keywords as :func:`strategy_space`).

    With the defaults (power-of-two degrees, TP within an 8-device node, all switches on) the counts
    are ``{1: 3, 2: 15, 4: 33, 8: 51, 16: 93, 64: 153}`` (three checkpointing modes: none, selective,
    full; HSDP shard groups from two nodes on); without checkpointing and HSDP a third of the
    first nodes': ``{1: 1, 2: 5, 4: 11, 8: 17, 16: 21,
    64: 21}``. From two nodes on the count is flat:
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
    kw = {"ckpt": False, "sp": False, "zero2": False, "more": {"hsdp": False, "offload": ("none",)}, **kwargs}
    pps = [p for p in range(1, world_size + 1) if world_size % p == 0 and dims.is_pow2(p)]
    return sum(len(strategy_space(world_size // p, **kw)) for p in pps)
