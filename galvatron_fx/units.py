"""Parsing and formatting of byte quantities (memory budgets, device memory)."""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, what: str = "memory budget") -> int:
    """Return ``value`` in bytes.

    Accepts a positive int/float (bytes) or a string such as ``"16GiB"``, ``"8GB"``, ``"512MiB"``,
    ``"1.5e9"``. Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units are distinct; a bare
    ``K``/``M``/``G`` means binary. Raises :class:`ConfigError` naming ``what`` on anything else.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a size such as '16GiB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"cannot parse {what} {value!r}: write a number with an optional unit, "
                "e.g. '16GiB', '8GB', '512MiB' or 17179869184"
            )
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise ConfigError(f"{what} must be a size such as '16GiB' or a number of bytes, got {type(value).__name__}")
    if not n > 0 or n != n or n == float("inf"):
        raise ConfigError(f"{what} must be positive and finite, got {value!r}")
    return int(n)


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


DTYPES = ("fp32", "bf16", "fp16")
"""The element types a cluster prices and a plan computes in."""
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
}


FP8 = "fp8"
"""The matmul-only element type: fp8 tensor-core matmuls (``torch._scaled_mm`` on ``float8_e4m3fn`` /
``float8_e5m2`` operands), which a cluster may price beside :data:`DTYPES` (``peak_flops["fp8"]``)
but no plan computes in throughout."""
_FP8_ALIASES = {"fp8", "float8", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float8_e4m3fnuz",
                "torch.float8_e5m2fnuz", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


def matmul_dtype(dtype: Any) -> str:
    """:func:`normalize_dtype`, or :data:`FP8` for an fp8 dtype (name or ``torch.dtype``)."""
    return FP8 if str(dtype).lower() in _FP8_ALIASES else normalize_dtype(dtype)


def normalize_dtype(dtype: Any) -> str:
    """``'fp32' | 'bf16' | 'fp16'`` for a dtype name or a ``torch.dtype``; ConfigError otherwise."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} (or the torch dtype)")
    return _DTYPE_ALIASES[key]
