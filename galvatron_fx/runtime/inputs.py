"""What ``train_step`` / ``eval_step`` are given: the graph's inputs, and this rank's share of them.

A distributed model takes, for each graph input, either the **whole global batch** (the same on
every rank) or this rank's **shard**: ``dist_model.input_shard = (index, size)`` are the arguments
of ``DistributedSampler(num_replicas=size, rank=index)`` (``size`` the ranks of this rank's pipeline
stage, ``index`` its position there), so each rank loads ``1 / size`` of the data. Inside, both
become the shard of the *input layout* (``tp = 1, dp = size``; the resharding pass moves it to each
layer's layout): micro-batch ``k`` on shard ``index`` is rows ``[k b, (k + 1) b)`` of the shard
(``b = global batch / (micro_batches x size)``). A whole global batch is cut to that first (rows
``index b + [0, b)`` of each of its micro-batches), so its outputs come back in its own order; the
union of the shards is the global batch either way, and the loss (a mean over samples, or the
exact token mean) is the same.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def match_inputs(names: list[str], args: tuple, kwargs: dict, where: str,
                 baked: dict | None = None) -> tuple[list, list]:
    """``(graph inputs in order, extra positional targets)`` from positional and keyword inputs,
    keywords matched to the graph's input ``names`` (the model's forward-argument names). A
    pipeline stage may be given ``None`` for the inputs it does not read. ``baked``: the non-tensor
    inputs given at capture (``return_loss=True``): the same value again is accepted, another one
    raises."""
    for key in [k for k in kwargs if k not in names and baked and k in baked]:
        value = kwargs[key]
        if value != baked[key]:
            raise ConfigError(f"{where}: {key}={value!r}, but the model was captured with {key}={baked[key]!r}, "
                              "which the graph bakes in; capture it again with the value you train with")
        kwargs = {k: v for k, v in kwargs.items() if k != key}
    n = len(names)
    if not kwargs:
        if len(args) < n:
            raise ConfigError(f"{where} needs the graph's {n} inputs ({', '.join(names)}), got {len(args)}")
        return list(args[:n]), list(args[n:])
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unexpected input(s) {unknown}; the model was captured with inputs "
                          f"{names}: capture it with the same (keyword) inputs you train with")
    missing_ = object()
    values = list(args[:n]) + [missing_] * (n - min(len(args), n))
    for key, value in kwargs.items():
        i = names.index(key)
        if i < len(args):
            raise ConfigError(f"{where}: input {key!r} is given twice (positionally and by name)")
        values[i] = value
    missing = [names[i] for i, v in enumerate(values) if v is missing_]
    if missing:
        raise ConfigError(f"{where}: missing input(s) {missing}; the graph's inputs are {names}")
    return values, list(args[n:])


def split(t, m: int):
    """``t`` cut into ``m`` equal micro-batches along dim 0 (anything without a batch dim repeated)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return [t] * m
    if t.shape[0] % m:
        raise ConfigError(f"batch of {t.shape[0]} samples is not divisible by micro_batches={m}")
    return list(t.chunk(m, dim=0))


def call_batch(values: list, planned: int, size: int, m: int, *, symbolic: bool, shards_before: bool,
               where: str) -> tuple[int | None, bool | None]:
    """``(global batch, given as shards?)`` of one call from the rows of its inputs: the planned
    global batch whole or as this rank's shard (``planned / size`` rows); any other number of rows
    is taken in the form of the previous call (``shards_before``; whole at first) and needs a graph
    with a symbolic batch and a global batch divisible by ``m x size``. ``(None, None)`` when no
    input has a batch dim (a pipeline stage given ``None``)."""
    rows = {int(t.shape[0]) for t in values if isinstance(t, torch.Tensor) and t.dim() >= 1}
    if not rows:
        return None, None
    if len(rows) > 1:
        raise ConfigError(f"{where}: inputs of {sorted(rows)} samples; every input must have the same number "
                          "of samples (dim 0)")
    r = rows.pop()
    if r == planned or (size > 1 and r * size == planned):
        return planned, r != planned
    batch = r * size if shards_before else r
    if not symbolic:
        raise ConfigError(f"{where}: inputs of {r} samples, but the graph bakes in its captured global batch of "
                          f"{planned} (whole, or {planned // size} per rank as dist_model.input_shard); a model "
                          "captured with a symbolic batch (capture's default) takes any multiple of "
                          f"{m * size}")
    if batch % (m * size):
        raise ConfigError(f"{where}: a global batch of {batch} samples does not split into micro_batches={m} x "
                          f"{size} input shards; give a multiple of {m * size} samples"
                          + (f" ({m} per rank as dist_model.input_shard)" if shards_before else ""))
    return batch, shards_before


def to_shards(values: list, batch: int, index: int, size: int, m: int, where: str) -> tuple[list, bool]:
    """``values`` (graph inputs and targets: whole global batches of ``batch`` samples, or this
    rank's shards of ``batch / size``) as shards of the input layout (module docstring); returns
    them and whether they were given as shards. Raises one :class:`ConfigError` naming the sizes
    a batch may have."""
    if batch % (m * size):
        raise ConfigError(f"the global batch of {batch} samples does not split into micro_batches={m} x "
                          f"{size} input shards")
    rows = {int(t.shape[0]) for t in values if isinstance(t, torch.Tensor) and t.dim() >= 1}
    shard = batch // size
    if size == 1 or not rows:
        return list(values), False
    if rows == {batch}:   # the whole global batch: this rank's rows of each micro-batch
        b = shard // m
        return [torch.cat([c[index * b:(index + 1) * b] for c in t.chunk(m)])
                if isinstance(t, torch.Tensor) and t.dim() >= 1 else t for t in values], False
    if rows == {shard}:
        return list(values), True
    raise ConfigError(f"{where}: inputs of {sorted(rows)} samples; pass the whole global batch ({batch} "
                      f"samples) or this rank's shard ({shard} samples: dist_model.input_shard = "
                      f"({index}, {size}), the arguments of DistributedSampler(num_replicas, rank)) for every input")


def apply_steps(steps, t):
    """``t`` through the reshard steps ``[(fn, extra_args), ...]`` of :func:`.reshard.plan_batched`."""
    for fn, extra in steps:
        t = fn(t, *extra)
    return t


def gather_rows(t, ranks: tuple[int, ...]):
    """The rows of ``t`` from every rank of ``ranks`` (in rank order), no gradient: the global batch
    (permuted shard by shard) from the shards."""
    from .reshard import _all_gather

    if not isinstance(t, torch.Tensor) or t.dim() == 0 or len(ranks) == 1:
        return t
    return _all_gather(t.detach(), ranks, 0)
