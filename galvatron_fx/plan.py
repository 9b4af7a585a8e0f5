"""The parallel plan: what every layer runs as, and how layers are split into pipeline stages.

A :class:`Plan` is plain data (its JSON form, ``Plan.to_dict``)::

    {"format": "galvatron_fx.plan/1", "world_size": 8, "pp": 2, "schedule": "1f1b",
     "micro_batches": 4, "global_batch_size": 32, "stages": [[0, 15], [16, 31]],
     "layers": [{"name": "layers.0", "tp": 2, "sp": false, "dp": 4, "sdp": "none", "ckpt": false}, ...],
     "estimate": {"step_time_s": ..., "throughput_samples_s": ..., "memory_bytes_per_device": [...]},
     "precision": "bf16-mixed", "model_fingerprint": "...", "cluster": {...}}

``precision`` (``"fp32"``, ``"bf16-mixed"``, ``"fp16-mixed"``: fp32 master weights and optimizer
states, compute in the low precision) is what the plan was priced for and what the runtime should
train in; a plan file without it (written before the key existed) reads as ``"fp32"``.
``virtual_stages`` (chunks per pipeline rank; :mod:`galvatron_fx.solver.schedules` for the
schedules and the chunk placement) makes ``stages`` list ``pp * virtual_stages`` chunks; a plan
file without it reads as 1 (2 for ``zbv`` / ``dualpipev``).

Every constructor validates (:class:`ConfigError` naming the key, the value and the fix); unknown
top-level keys (e.g. ``baselines``) and unknown per-layer keys are kept and written back.
``to_json`` is deterministic: sorted keys, 2-space indent, floats in Python's shortest round-trip
form (``repr``), so identical plans give byte-identical files and ``load`` then ``save`` reproduces
a file exactly. Per layer, ``ep`` (expert parallel), ``cp`` (context parallel) and ``cp_kind``
(``"ring"`` | ``"ulysses"``) are optional: a plan written before them reads as 1, 1, ``"ring"``.
Per-layer extras the runtime reads: ``ep_dispatch`` (``"allgather"`` | ``"alltoall"``, the token
exchange of an ``ep > 1`` layer, default all-gather) and ``expert_tp`` (a bool, default true: with
``ep > 1``, ``tp > 1`` and no ``sp`` each grouped expert weight is sharded over the TP group too,
Megatron's expert tensor parallelism, ``1 / (ep * tp)`` of the expert states per rank; false keeps
the experts whole over TP and splits the tokens over the TP ranks; :attr:`LayerPlan.expert_tp`).

Estimate values may be ``null`` (``None``): "not estimated" (hand-made plans before
``gfx.estimate``). An empty ``model_fingerprint`` means "not recorded".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from . import dims
from .cluster import PRECISIONS
from .errors import ConfigError, PlanMismatchError
from .plan_text import explain_plan
from .solver.pipeline import even_split
from .solver.schedules import check_schedule, chunk_rank, default_virtual_stages, rank_chunks
from .solver.strategy import Strategy

FORMAT = "galvatron_fx.plan/1"
ESTIMATE_KEYS = ("step_time_s", "throughput_samples_s", "memory_bytes_per_device")
_LAYER_KEYS = ("name",) + tuple(f.name for f in dims.json_fields() if f.json_required)
_OPTIONAL_LAYER_KEYS = tuple(f.name for f in dims.json_fields() if not f.json_required)
"""Per-layer JSON keys from the registered dimensions: those every plan had from the start are
required; a later dimension's key reads as its default when absent (older plans load unchanged)."""
_TOP_KEYS = ("format", "world_size", "pp", "schedule", "micro_batches", "global_batch_size", "stages",
             "layers", "estimate", "model_fingerprint", "cluster")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _need_int(where: str, v: Any, minimum: int = 1) -> int:
    if not _is_int(v) or v < minimum:
        raise ConfigError(f"plan {where} must be an integer >= {minimum}, got {v!r}; fix the value in the plan")
    return v


@dataclass
class LayerPlan:
    """One layer's strategy in a plan: ``name`` (the layer record's name), ``tp``, ``dp``, ``sdp``
    ("none" | "zero2" | "zero3"), ``sp``, ``ckpt`` (false, "selective", "selective-op" or true); ``extra`` holds any
    other per-layer JSON keys."""

    name: str
    tp: int
    dp: int
    sdp: str = "none"
    sp: bool = False
    ckpt: bool | str = False
    extra: dict[str, Any] = field(default_factory=dict)
    ep: int = 1
    cp: int = 1
    cp_kind: str = "ring"

    @property
    def strategy(self) -> Strategy:
        """The layer's :class:`~galvatron_fx.solver.strategy.Strategy`."""
        return Strategy(**{f.name: self.value(f.name, f.default) for f in dims.fields()})

    def value(self, name: str, default: Any = None) -> Any:
        """A strategy field's value: the attribute, else the layer's extra JSON key (dimensions
        registered after the attributes keep their values there), else ``default``."""
        if name in LAYER_ATTRIBUTES:
            return getattr(self, name)
        return self.extra.get(name, default)

    @property
    def expert_tp(self) -> bool:
        """Whether the layer's experts run tensor parallel (expert tensor parallelism, ETP):
        ``extra["expert_tp"]`` (default true) with ``ep > 1``, ``tp > 1`` and no ``sp``. Each
        expert weight is then split by expert over the EP group *and* along its FFN width over the
        TP group (every TP rank runs the same tokens, the partial outputs are summed over TP);
        ``extra["expert_tp"] = false`` keeps the experts whole over TP and splits the tokens over
        the TP ranks instead (:mod:`galvatron_fx.runtime.experts`)."""
        return self.strategy.shards_experts

    def to_dict(self) -> dict[str, Any]:
        # NOTE: a field unset and without a default (HSDP's shard, completed to dp) is left out, and
        # one marked omit_default at its default
        return {**self.extra, "name": self.name,
                **{f.name: v for f in dims.json_fields() if (v := self.value(f.name, f.default)) is not None
                   and not (f.omit_default and v == f.default)}}

    @classmethod
    def from_dict(cls, d: Any, index: int) -> LayerPlan:
        where = f"layers[{index}]"
        if not isinstance(d, dict):
            raise ConfigError(f"plan {where} must be an object with keys {list(_LAYER_KEYS)}, got {d!r}")
        missing = [k for k in _LAYER_KEYS if k not in d]
        if missing:
            raise ConfigError(f"plan {where} is missing key(s) {missing}; every layer needs {list(_LAYER_KEYS)}")
        known = {f.name: f for f in dims.json_fields()}
        # NOTE: a later dimension's field at its default is the same as its key left out
        extra = {k: v for k, v in d.items() if k not in LAYER_ATTRIBUTES and k != "name"
                 and not (k in known and v == known[k].default)}
        return cls(d["name"], extra=extra, **{k: d.get(k, known[k].default) for k in LAYER_ATTRIBUTES if k in known})


LAYER_ATTRIBUTES = frozenset(f.name for f in dataclass_fields(LayerPlan)) - {"name", "extra"}
"""The strategy fields a :class:`LayerPlan` holds as attributes (the rest live in ``extra``)."""

@dataclass
class Plan:
    """A parallel plan (see the module docstring for the JSON). Validated on construction."""

    world_size: int
    pp: int
    schedule: str
    micro_batches: int
    global_batch_size: int
    stages: list[tuple[int, int]]
    layers: list[LayerPlan]
    estimate: dict[str, Any]
    model_fingerprint: str = ""
    cluster: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stages, (list, tuple)):
            self.stages = [tuple(s) if isinstance(s, (list, tuple)) else s for s in self.stages]
        if isinstance(self.layers, tuple):
            self.layers = list(self.layers)
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def devices_per_stage(self) -> int:
        """``world_size / pp``: devices each pipeline stage (and so each layer) runs on."""
        return self.world_size // self.pp

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch (all data-parallel ranks together)."""
        return self.global_batch_size // self.micro_batches

    @property
    def num_chunks(self) -> int:
        """``pp * virtual_stages``: the contiguous layer ranges of ``stages``."""
        return self.pp * self.virtual_stages

    def chunk_rank(self, chunk: int) -> int:
        """The pipeline rank (0..pp-1) running chunk ``chunk`` of ``stages`` (round-robin for the
        interleaved schedules, a V for ``zbv`` / ``dualpipev``: :mod:`galvatron_fx.solver.schedules`)."""
        return chunk_rank(self.schedule, chunk, self.pp)

    def rank_chunks(self, rank: int) -> list[int]:
        """The chunks of ``stages`` pipeline rank ``rank`` runs, in layer order."""
        return rank_chunks(self.schedule, rank, self.pp, self.virtual_stages)

    def stage_of(self, layer_index: int) -> int:
        """Index of the chunk of ``stages`` holding layer ``layer_index`` (its pipeline stage when
        ``virtual_stages`` is 1)."""
        for k, (first, last) in enumerate(self.stages):
            if first <= layer_index <= last:
                return k
        raise IndexError(f"layer index {layer_index} is outside the plan's {self.num_layers} layers")

    def layer_strategies(self) -> list[Strategy]:
        return [layer.strategy for layer in self.layers]

    # -------------------------------------------------------------- validation
    def validate(self) -> Plan:
        """Check every invariant; raise :class:`ConfigError` naming the key, value and fix."""
        ws = _need_int("world_size", self.world_size)
        pp = _need_int("pp", self.pp)
        if ws % pp:
            raise ConfigError(f"plan pp={pp} must divide world_size={ws}; choose pp among the divisors of {ws}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"plan precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        m = _need_int("micro_batches", self.micro_batches)
        gbs = _need_int("global_batch_size", self.global_batch_size)
        if gbs % m:
            raise ConfigError(f"plan global_batch_size={gbs} is not divisible by micro_batches={m}; "
                              "pick micro_batches dividing the global batch")
        if not isinstance(self.layers, list) or not self.layers:
            raise ConfigError("plan layers must be a non-empty list, one entry per layer in execution order")
        check_schedule(self.schedule, pp, self.virtual_stages, m)
        self._validate_layers(ws // pp, gbs // m)
        self._validate_stages(pp * self.virtual_stages)
        self._validate_estimate(pp)
        if not isinstance(self.model_fingerprint, str):
            raise ConfigError(f"plan model_fingerprint must be a string, got {self.model_fingerprint!r}")
        if not isinstance(self.cluster, dict):
            raise ConfigError(f"plan cluster must be an object (dict), got {type(self.cluster).__name__}")
        return self

    def _validate_layers(self, per_stage: int, micro_batch: int) -> None:
        seen: set[str] = set()
        for i, layer in enumerate(self.layers):
            w = f"layers[{i}]"
            if not isinstance(layer, LayerPlan):
                raise ConfigError(f"plan {w} must be a LayerPlan, got {type(layer).__name__}")
            if not isinstance(layer.name, str) or not layer.name:
                raise ConfigError(f"plan {w}.name must be a non-empty string, got {layer.name!r}")
            if layer.name in seen:
                raise ConfigError(f"plan {w}.name {layer.name!r} is repeated; layer names must be unique")
            seen.add(layer.name)
            tp, dp = _need_int(f"{w}.tp", layer.tp), _need_int(f"{w}.dp", layer.dp)
            if tp * dp != per_stage:
                raise ConfigError(
                    f"plan {w} ({layer.name!r}): tp*dp = {tp}*{dp} = {tp * dp} but each stage has "
                    f"world_size/pp = {per_stage} devices; choose tp and dp with tp*dp == {per_stage}")
            problems = dims.plan_problems(w, layer, micro_batch)
            if problems:
                raise ConfigError(problems[0])

    def _validate_stages(self, pp: int) -> None:
        L = len(self.layers)
        if not isinstance(self.stages, list) or len(self.stages) != pp:
            what = f"pp={pp}" if self.virtual_stages == 1 else \
                f"pp * virtual_stages = {self.pp} * {self.virtual_stages} = {pp}"
            raise ConfigError(f"plan stages must list {what} [first, last] ranges, got {self.stages!r}")
        expect = 0
        for k, rng in enumerate(self.stages):
            ok = isinstance(rng, tuple) and len(rng) == 2 and all(_is_int(x) for x in rng)
            if not ok:
                raise ConfigError(f"plan stages[{k}] must be [first, last] layer indices, got {rng!r}")
            first, last = rng
            if first != expect or last < first:
                raise ConfigError(
                    f"plan stages[{k}] = [{first}, {last}] breaks contiguity: stages must be non-empty, "
                    f"inclusive, in order, stage {k} starting at layer {expect}")
            expect = last + 1
        if expect != L:
            raise ConfigError(f"plan stages end at layer {expect - 1} but there are {L} layers; "
                              f"the last stage must end at layer {L - 1}")

    def _validate_estimate(self, pp: int) -> None:
        est = self.estimate
        if not isinstance(est, dict):
            raise ConfigError(f"plan estimate must be an object, got {type(est).__name__}")
        missing = [k for k in ESTIMATE_KEYS if k not in est]
        if missing:
            raise ConfigError(f"plan estimate is missing {missing}; use null for a value not estimated")
        for k in ("step_time_s", "throughput_samples_s"):
            v = est[k]
            if v is not None and not (_is_num(v) and v >= 0):
                raise ConfigError(f"plan estimate.{k} must be a finite number >= 0 or null, got {v!r}")
        mem = est["memory_bytes_per_device"]
        if mem is not None and not (isinstance(mem, list) and len(mem) == pp
                                    and all(_is_num(x) and x >= 0 for x in mem)):
            raise ConfigError(f"plan estimate.memory_bytes_per_device must be null or a list of pp={pp} "
                              f"byte counts (one per stage), got {mem!r}")

    def validate_for(self, world_size: int | None = None, fingerprint: str | None = None,
                     layer_names: list[str] | None = None) -> Plan:
        """Check the plan against the running world and the captured model; raise
        :class:`PlanMismatchError` on a mismatch. An empty plan fingerprint skips that check."""
        if world_size is not None and world_size != self.world_size:
            raise PlanMismatchError(
                f"the plan was made for world_size={self.world_size} but {world_size} processes are "
                "running; launch with that many ranks or re-plan for this world size")
        if fingerprint is not None and self.model_fingerprint and fingerprint != self.model_fingerprint:
            raise PlanMismatchError(
                f"the plan was made for model fingerprint {self.model_fingerprint!r}, this model has "
                f"{fingerprint!r}; re-run the search for this model")
        if layer_names is not None:
            names = [layer.name for layer in self.layers]
            if list(layer_names) != names:
                diff = next((i for i, (a, b) in enumerate(zip(names, layer_names)) if a != b),
                            min(len(names), len(layer_names)))
                raise PlanMismatchError(
                    f"the plan's layers differ from the model's at index {diff} (plan has {len(names)} "
                    f"layers, model {len(layer_names)}); re-run the search for this model")
        return self

    # ---------------------------------------------------------- explanation
    def explain(self) -> str:
        """Human-readable plan: per stage and layer the strategy, step-time share and memory
        (states, in-flight activations, transient) against the budget the plan was searched for."""
        return explain_plan(self)

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            **self.extra,
            "format": FORMAT,
            "world_size": self.world_size,
            "pp": self.pp,
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "global_batch_size": self.global_batch_size,
            "stages": [[first, last] for first, last in self.stages],
            "layers": [layer.to_dict() for layer in self.layers],
            "estimate": dict(self.estimate),
            "precision": self.precision,
            "virtual_stages": self.virtual_stages,
            "model_fingerprint": self.model_fingerprint,
            "cluster": dict(self.cluster),
        }

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, indent 2, shortest round-trip floats, final newline)."""
        try:
            return json.dumps(self.to_dict(), sort_keys=True, indent=2, allow_nan=False) + "\n"
        except ValueError as e:
            raise ConfigError(f"plan holds a non-finite number ({e}); estimates must be finite or null") from e

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read plan file {os.fspath(path)!r}: {e}") from e
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan file {os.fspath(path)!r} is not valid JSON ({e}); "
                              "regenerate it with `galvatron-fx plan ... --json PATH`") from e
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> Plan:
        """Build and validate a plan from its JSON object."""
        if not isinstance(d, dict):
            raise ConfigError(f"a plan must be a JSON object, got {type(d).__name__}")
        if "format" not in d:
            raise ConfigError(f"plan is missing key 'format'; expected {FORMAT!r} (is this a galvatron_fx "
                              "plan? regenerate it with `galvatron-fx plan ... --json PATH`)")
        if d["format"] != FORMAT:
            raise ConfigError(f"plan format {d['format']!r} is not supported; this version reads {FORMAT!r}: "
                              "regenerate the plan with this galvatron_fx version")
        missing = [k for k in _TOP_KEYS if k not in d]
        if missing:
            raise ConfigError(f"plan is missing key(s) {missing}; see the Plan JSON section of the contract")
        if not isinstance(d["layers"], list):
            raise ConfigError(f"plan layers must be a list of layer objects, got {type(d['layers']).__name__}")
        if not isinstance(d["stages"], list):
            raise ConfigError(f"plan stages must be a list of [first, last] ranges, got {d['stages']!r}")
        layers = [LayerPlan.from_dict(x, i) for i, x in enumerate(d["layers"])]
        stages = [tuple(s) if isinstance(s, list) else s for s in d["stages"]]
        extra = {k: v for k, v in d.items() if k not in _TOP_KEYS and k not in ("precision", "virtual_stages")}
        return cls(d["world_size"], d["pp"], d["schedule"], d["micro_batches"], d["global_batch_size"],
                   stages, layers, d["estimate"], d["model_fingerprint"], d["cluster"], extra,
                   precision=d.get("precision", "fp32"),
                   virtual_stages=d.get("virtual_stages", default_virtual_stages(d["schedule"])))

    @classmethod
    def uniform(cls, gm: Any, world_size: int, **kwargs: Any) -> Plan:
        """A hand-chosen plan for a captured graph ``gm``: every layer on the same strategy (keyword
        arguments as :meth:`uniform_from_layer_names`), with the graph's fingerprint."""
        from .sharding.experts import expert_layers

        info = gm.meta["galvatron"]
        return cls.uniform_from_layer_names([rec.name for rec in info.layers], world_size,
                                            model_fingerprint=info.fingerprint,
                                            expert_layers=expert_layers(gm), **kwargs)

    @classmethod
    def uniform_from_layer_names(
        cls,
        names: list[str],
        world_size: int,
        tp: int = 1,
        dp: int | None = None,
        sdp: str = "none",
        pp: int = 1,
        ckpt: bool | str = False,
        sp: bool = False,
        micro_batches: int = 1,
        schedule: str = "1f1b",
        global_batch_size: int = 8,
        virtual_stages: int | None = None,
        *,
        ep: int = 1,
        cp: int = 1,
        cp_kind: str = "ring",
        shard: int | None = None,
        offload: str = "none",
        expert_layers: set[str] | None = None,
        model_fingerprint: str = "",
        cluster: dict[str, Any] | None = None,
        precision: str | None = None,
        **fields: Any,
    ) -> Plan:
        """A hand-chosen plan: every layer on the same strategy, layers split evenly over ``pp``
        stages (:func:`~galvatron_fx.solver.pipeline.even_split`: the first ``L % pp`` stages get one
        more layer), ``pp * virtual_stages`` chunks for the interleaved and V schedules
        (``virtual_stages`` defaults to the schedule's: 2 for ``zbv`` / ``dualpipev``, else 1). ``dp`` defaults to ``world_size / (pp * tp)``. ``precision`` defaults to the
        ``cluster``'s (:func:`galvatron_fx.cluster.default_precision`; ``"fp32"`` without one).
        ``shard``: HSDP's ZeRO group size (default ``dp``: plain ZeRO); ``offload``: CPU offload
        (``"optimizer"``: ZeRO layers keep optimizer states and masters in host memory); ``fields``:
        any other registered dimension's plan-JSON field (:func:`galvatron_fx.dims.json_fields`),
        e.g. ``act_offload=True``. Estimates are ``None``."""
        names = list(names)
        _need_int("world_size", world_size)
        _need_int("pp", pp)
        _need_int("tp", tp)
        if dp is None:
            if world_size % (pp * tp):
                raise ConfigError(f"pp*tp = {pp}*{tp} does not divide world_size={world_size}; "
                                  "choose pp and tp whose product divides the world size")
            dp = world_size // (pp * tp)
        if not names:
            raise ConfigError("uniform plan needs at least one layer name")
        v = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
        if pp * v > len(names):
            what = f"pp={pp}" if v == 1 else f"pp * virtual_stages = {pp} * {v}"
            raise ConfigError(f"{what} exceeds the {len(names)} layers; use {what.split('=')[0].strip()} <= {len(names)}")
        extra = {} if shard is None else {"shard": shard}
        if offload != "none":
            extra["offload"] = offload
        extra.update(_dimension_fields(fields))
        layers = [LayerPlan(n, tp, dp, sdp, sp, ckpt, ep=ep if expert_layers is None or n in expert_layers else 1,
                            cp=cp, cp_kind=cp_kind, extra=dict(extra))
                  for n in names]
        est = {"step_time_s": None, "throughput_samples_s": None, "memory_bytes_per_device": None}
        if precision is None:
            from .cluster import default_precision

            precision = default_precision(cluster or None)
        return cls(world_size, pp, schedule, micro_batches, global_batch_size, even_split(len(names), pp * v),
                   layers, est, model_fingerprint, dict(cluster or {}), precision=precision, virtual_stages=v)


def _dimension_fields(fields: dict) -> dict:
    """The keyword arguments of :meth:`Plan.uniform_from_layer_names` beyond its own: fields of
    registered dimensions, kept in each layer's ``extra`` (the plan JSON's per-layer keys)."""
    known = {f.name for f in dims.json_fields()}
    bad = [k for k in fields if k not in known]
    if bad:
        raise ConfigError(f"Plan.uniform got unknown keyword(s) {bad}; a layer field is one of "
                          f"{sorted(known)}")
    return dict(fields)
