"""Activation checkpointing: field ``ckpt``, one of ``False``, ``"selective"``, ``"selective-op"``, ``True``.

A fully checkpointed layer (``True``) keeps only its inputs through the forward and recomputes its
whole forward in the backward. A selectively checkpointed one (``"selective"``) also keeps the
outputs of its matmuls and fused attention kernels and recomputes only the rest (norms,
activations, dropout, residual adds: cheap in time, large in bytes). ``"selective-op"`` is
torchtitan's op policy: as ``"selective"``, but every second linear matmul of the layer (the 2nd,
4th, ...) is recomputed too; offered where asked for (a ``ckpt`` constraint naming it), not in the
default search. Rewritten by
``passes/checkpointing.py``; run by ``runtime/checkpointing.py``; what selective keeps is measured
by ``cost/selective.py``. Priced here (:func:`_cost_terms`) beyond the recompute the cost model
adds to the backward and the kept bytes it counts as activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import CostTerms, Dimension, Field, LayerWork, PassSpec, SpaceOptions, rule

CKPT_MODES = (False, "selective", "selective-op", True)
"""The values of ``ckpt``, least recomputation first."""
SELECTIVE_MODES = ("selective", "selective-op")
SEARCHED_MODES = (False, "selective", True)
"""What ``ckpt: true`` (searched per layer) offers."""


def is_ckpt_mode(value: Any) -> bool:
    """Whether ``value`` is one of :data:`CKPT_MODES` (``1`` and ``0`` are not)."""
    return isinstance(value, bool) or value in SELECTIVE_MODES


def ckpt_modes(o: SpaceOptions) -> tuple:
    """The modes the space offers: ``o.ckpt`` False (none), True (:data:`SEARCHED_MODES`) or a tuple
    of modes."""
    if isinstance(o.ckpt, bool):
        return SEARCHED_MODES if o.ckpt else (False,)
    return tuple(m for m in CKPT_MODES if m in o.ckpt)


def _check(value: Any) -> str | None:
    return None if is_ckpt_mode(value) else f"must be false, 'selective', 'selective-op' or true, got {value!r}"


def _ckpt_switch(s: Any, o: SpaceOptions) -> bool:
    """The space options' ``ckpt`` (False, True or a tuple of modes) limits the checkpointing modes."""
    return s.ckpt in ckpt_modes(o)


def _selective_plain(s: Any, o: SpaceOptions) -> bool:
    """Selective checkpointing is offered to layers without context or expert parallelism: the ring's
    and the token dispatch's own saved buffers are not measured under its policy yet."""
    return s.ckpt not in SELECTIVE_MODES or (s.cp == 1 and s.ep == 1)


def _plan_ckpt(w: str, layer, micro_batch: int) -> str | None:
    if is_ckpt_mode(layer.ckpt):
        return None
    return f"plan {w}.ckpt must be false, \"selective\", \"selective-op\" or true, got {layer.ckpt!r}"


def _label(s: Any) -> list[tuple[int, str]]:
    return [(70, {"selective": "sac", "selective-op": "sac-op"}.get(s.ckpt, "ckpt"))] if s.ckpt else []


def _cost_terms(cm: Any, index: int, n: float, s: Any, work: LayerWork) -> CostTerms:
    """The recomputed activations, a transient of the backward (the whole saved set); under a split
    backward (zero-bubble) the layer recomputes a second time: its recompute and its forward TP
    collectives again."""
    if not s.ckpt:
        return CostTerms()
    m, plain = cm.measure(index), dataclasses.replace(s, ckpt=False)
    again = work.recompute + cm.tp_comm_time(m, n, s, work.fwd, work.plain_bwd) - cm.tp_comm_time(
        m, n, plain, work.fwd, work.plain_bwd)
    return CostTerms(transient_bytes=work.saved_bytes, split_extra_s=again)


DIMENSION = Dimension(
    name="checkpointing",
    fields=(Field("ckpt", object, False, 50, values=lambda o, n, c: ckpt_modes(o), check=_check,
                  json_required=True),),
    rules=(rule(_ckpt_switch), rule(_selective_plain)),
    label=_label,
    cost_terms=_cost_terms,
    passes=(PassSpec("checkpointing", after="stage_outputs"),),
    runtime=("runtime.checkpointing",),
    plan_checks=(_plan_ckpt,),
)
