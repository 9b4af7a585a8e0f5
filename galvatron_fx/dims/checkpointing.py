"""Activation checkpointing: field ``ckpt``.

A checkpointed layer keeps only its inputs through the forward and recomputes its forward in the
backward. Rewritten by ``passes/checkpointing.py``; run by ``runtime/checkpointing.py``.
"""

from __future__ import annotations

from typing import Any

from .base import Dimension, Field, PassSpec, SpaceOptions, a_bool, plan_bool, rule


def _ckpt_switch(s: Any, o: SpaceOptions) -> bool:
    """``ckpt=False`` in the options drops the checkpointed strategies."""
    return not s.ckpt or o.ckpt


def _plan_ckpt(w: str, layer, micro_batch: int) -> str | None:
    return plan_bool(f"{w}.ckpt", layer.ckpt)


DIMENSION = Dimension(
    name="checkpointing",
    fields=(Field("ckpt", bool, False, 50, values=lambda o, n, c: (False, True), check=a_bool, json_required=True),),
    rules=(rule(_ckpt_switch),),
    label=lambda s: [(70, "ckpt")] if s.ckpt else [],
    passes=(PassSpec("checkpointing", after="stage_outputs"),),
    runtime=("runtime.checkpointing",),
    plan_checks=(_plan_ckpt,),
)
