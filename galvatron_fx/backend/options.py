"""The galvatron backend's options: ``torch.compile(..., options={...})`` parsed and validated.

Takes the ``options`` dict ``torch.compile`` hands the backend (or ``None``); gives a
:class:`BackendOptions`, or raises :class:`ConfigError` on an unknown key or a bad value. The
options themselves are described in the :mod:`galvatron_fx.backend` docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError

stats = {"compiles": 0, "searches": 0}
"""Counters for tests and logs: backend compiles and plan searches in this process."""


@dataclass
class BackendOptions:
    """``torch.compile(..., options={...})`` of the galvatron backend (see the package docstring)."""

    memory_budget: Any = None
    cluster: Any = None
    plan: Any = None
    global_batch_size: int | None = None
    reserve: Any = None
    constraints: dict | None = None
    precision: str | None = None      # "fp32" | "bf16-mixed" | "fp16-mixed"; default the plan's / cluster's
    reduce_dtype: str | None = None   # mixed precision: "fp32" (default) or the compute dtype
    init: str | None = None           # a meta-device model: "weights" (its own initialiser) or a from_pretrained DIR
    measure: int = 0                  # time the K best plans and the baselines on the live world (galvatron_fx/selection.py)
    measure_options: dict | None = None  # its budget and rules (selection.DEFAULTS: warmup, steps, close, rounds, seconds, tie, doubt)
    schedule: str | None = None       # pin the search's pipeline schedule (a constraint)
    virtual_stages: int | None = None  # pin its chunks per pipeline rank (a constraint)

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown galvatron backend option(s) {unknown}; known: {', '.join(known)}")
        opts = cls(**options)
        gbs = opts.global_batch_size
        if gbs is not None and (not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1):
            raise ConfigError(f"option global_batch_size must be a positive int, got {gbs!r}")
        from ..cluster import PRECISIONS

        if opts.precision is not None and opts.precision not in PRECISIONS:
            raise ConfigError(f"option precision must be one of {list(PRECISIONS)}, got {opts.precision!r}")
        pinned = {k: getattr(opts, k) for k in ("schedule", "virtual_stages") if getattr(opts, k) is not None}
        if pinned:   # NOTE: the same as constraints={"schedule": ..., "virtual_stages": ...}
            opts.constraints = {**(opts.constraints or {}), **pinned}
        return opts
