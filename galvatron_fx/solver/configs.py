"""The configurations of a search and each configuration's tables (:class:`ConfigSpace`, a part of
:class:`~galvatron_fx.solver.engine.Engine`): every (pipeline degree, micro-batches, schedule, global
batch, chunks per rank) the space holds, the per-stage strategy space, and the per-layer
``[L, S]`` time and memory tables with what each layer admits."""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..schedule import SCHEDULE
from .objective import step_time
from .schedules import ZERO_BUBBLE, check_schedule, step_slots
from .strategy import Strategy, strategy_space
from .tables import ConfigTables, layout_groups

MAX_VIRTUAL_STAGES = 8
"""The most chunks per pipeline rank the search tries unpinned (interleaving more adds a send per
chunk to win back ever less bubble: ``(p - 1) / v`` micro-batch times; a constraint may pin more)."""
SEARCHED_SCHEDULES = [n for n, s in SCHEDULE.items() if s.searched]
"""The schedules the search tries (GPipe only when pinned: never faster than 1F1B, never smaller)."""


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def free_batch_sizes(world_size: int, limit: int) -> list[int]:
    """Global batches a free search tries: ``2^i`` and ``2^i * q`` (``q`` the odd part of the
    device count), up to ``limit``."""
    q = world_size
    while q % 2 == 0:
        q //= 2
    out = {g for base in (1, q) for g in (base << i for i in range(0, 40)) if g <= limit}
    return sorted(out)


class ConfigSpace:
    """The space and tables of :class:`~galvatron_fx.solver.engine.Engine` (its attributes: ``N``,
    ``L``, ``opt``, ``cluster``, ``tables``, the admission callables and caches its ``__init__``
    sets)."""

    def configs(self) -> list[tuple[int, int, str, int, int]]:
        """Every configuration ``(p, m, schedule, global batch, v)`` of the space (module docstring)."""
        o = self.opt
        if o.pp is not None:
            pps = [o.pp] if self.N % o.pp == 0 and 1 <= o.pp <= self.L else []
            if not pps:
                self._exclude(f"pp={o.pp} must divide the {self.N} devices and be at most the {self.L} layers")
        else:
            pps = [p for p in divisors(self.N) if p <= self.L]
        gbss = [o.global_batch_size] if o.global_batch_size else free_batch_sizes(self.N, o.max_global_batch_size)
        schedules = ([o.schedule] if isinstance(o.schedule, str) else list(o.schedule)) if o.schedule \
            else SEARCHED_SCHEDULES
        out = []
        for gbs in gbss:
            for p in pps:
                if o.micro_batches is not None:
                    ms = [o.micro_batches]
                    if gbs % o.micro_batches:
                        self._exclude(f"micro_batches={o.micro_batches} must divide the global batch {gbs}")
                        continue
                else:
                    ms = [m for m in divisors(gbs) if o.max_micro_batches is None or m <= o.max_micro_batches]
                # NOTE: a pipeline needs at least one micro-batch per stage (torch.distributed.pipelining
                # refuses fewer, and fewer would leave stages idle anyway)
                kept = [m for m in ms if p == 1 or m >= p]
                if not kept:
                    self._exclude(f"pp={p} needs at least {p} micro-batches (global batch {gbs})")
                out += [(p, m, sched, gbs, v) for m in kept for sched in schedules for v in self._chunks(p, m, sched)]
        return out

    def _chunks(self, p: int, m: int, sched: str) -> list[int]:
        """The virtual-stage counts ``v`` configuration ``(p, m, sched)`` may take (reasons recorded)."""
        o = self.opt
        if p == 1 and sched != "1f1b" and not o.schedule:
            return []   # no pipeline: one schedule (pp=1 configurations run 1F1B's space)
        sch = SCHEDULE[sched]
        if sch.chunks_per_rank:   # fixed: one chunk per rank, or two in a V
            vs = [o.virtual_stages or sch.chunks_per_rank]
        else:   # interleaved: v = 2 .. L / p chunks per rank (interleaved-zb also v = 1: ZB-H1)
            low = sch.min_searched_chunks
            vs = [o.virtual_stages] if o.virtual_stages else list(range(low, min(self.L // p, MAX_VIRTUAL_STAGES) + 1))
        out = []
        for v in vs:
            try:
                check_schedule(sched, p, v, m)
            except ConfigError as e:
                self._exclude(str(e).split(";")[0])
                continue
            if p * v > self.L:
                self._exclude(f"pp * virtual_stages = {p} * {v} exceeds the {self.L} layers")
                continue
            out.append(v)
        return out

    def space(self, p: int, b: int) -> list[Strategy]:
        """Strategies for one layer of a stage of ``N / p`` devices and micro-batches of ``b`` samples."""
        return self._space(p, b)[0]

    def _space(self, p: int, b: int) -> tuple[list[Strategy], str]:
        d = self.N // p
        kw = {"devices_per_node": getattr(self.cluster, "devices_per_node", 8), "power_of_two": False,
              "ep": tuple(e for e in self.ep_degrees if d % e == 0), **self.opt.space}
        if len(self.cp_degrees) > 1:
            kw.update(cp=tuple(c for c in self.cp_degrees if d % c == 0), cp_kinds=self.cp_kinds)
        out = strategy_space(d, **kw)
        if not out:
            return out, f"no strategy for {d} devices under the space options {kw}"
        # NOTE: a CP group of cp ranks shares its samples: dp / cp batch slices (a rank may hold a
        # fraction of a sample's tokens)
        out = [s for s in out if b % (s.dp // s.cp) == 0]
        if not out:
            return out, f"no data-parallel degree on {d} devices divides the micro-batch of {b} samples"
        cap = self.opt.max_micro_batch_size
        if cap is not None:
            out = [s for s in out if b // s.dp <= cap]
            if not out:
                return out, f"every strategy on {d} devices runs more than {cap} samples per device per micro-batch"
        if self.opt.strategy_filter:
            out = [s for s in out if self.opt.strategy_filter(s)]
            if not out:
                return out, f"the tp / sdp / ckpt constraints exclude every strategy on {d} devices"
        return out, ""

    # ------------------------------------------------------------------ tables
    def _layer_tables(self, p: int, m: int, b: int, space: list[Strategy], slots: float, split: bool = False):
        """[L, S] arrays: step time, states, activations per micro-batch, transient (inf = not allowed),
        the zero-bubble held bytes per micro-batch (or None), host bytes (None when all zero);
        ``split``: under a split (zero-bubble) backward (:meth:`~.objective.LayerTerms.split`)."""
        key = (p, m, b, tuple(space))
        if key not in self._tables_memo:
            if len(self._tables_memo) > 64:
                self._tables_memo.clear()
            self._tables_memo[key] = self._build_tables(p, m, b, tuple(space))
        t_mb, sync, states, act, trans, split_t, split_b, wg, host, host_act = self._tables_memo[key]
        if split:
            t_mb, states = t_mb + split_t, states + split_b
        # NOTE: slots * t_mb + sync is layer_step_time's arithmetic, element by element (one table
        # per schedule and virtual-stage count, from the same per-micro-batch terms)
        return slots * t_mb + sync, states, act, trans, (wg if split else None), host, host_act

    def _build_tables(self, p: int, m: int, b: int, space: tuple[Strategy, ...]):
        out = np.empty((10, self.L, len(space)))
        whole = np.array([s.tp == 1 and not (s.sdp == "zero3" and s.ckpt) for s in space])
        by_sig: dict[int, np.ndarray] = {}
        for i in range(self.L):
            sig = int(self.sig_ids[i])
            if sig not in by_sig:
                by_sig[sig] = self.tables.rows(i, space, b)
            only = np.full(len(space), m == 1) if i in self.batch_coupled else None
            ok = self._admissible(i, space, only)
            if p > 1 and i in self.tied_layers:
                ok = ok & whole
            out[:, i, :] = np.where(ok[None, :], by_sig[sig], np.inf)
        # NOTE: None when nothing is offloaded: the search then ignores the host
        host, host_act = ((x if (np.where(np.isfinite(x), x, 0.0) > 0).any() else None) for x in out[8:10])
        if host is None and host_act is not None:
            host = np.where(np.isfinite(out[8]), 0.0, np.inf)
        return (*out[:8], host, host_act)

    def _admissible(self, layer: int, space: tuple[Strategy, ...], only: np.ndarray | None = None) -> np.ndarray:
        """Whether layer ``layer`` is offered each strategy of ``space``: every dimension admits it
        there (``admits``: the TP pass accepts the degree and SP, the experts divide by ``ep``, the
        context-parallel pass takes ``cp`` and its kind) and prefers it (``prefers``: a TP degree
        that shards nothing only repeats the layer on every TP rank, so it is offered only where
        nothing else is, or where every layer must share one strategy: ``uniform_only``).
        ``only``: the strategies the layer may take at all (a layer mixing the samples of a batch:
        none under micro-batches), applied first."""
        key = (layer, space, None if only is None else only.tobytes())
        hit = self._adm.get(key)
        if hit is None:
            hit = np.array([bool(self.admits(layer, s)) for s in space])
            if only is not None:
                hit = hit & only
            if not self.opt.uniform_only:
                useful = hit & np.array([bool(self.prefers(layer, s)) for s in space])
                hit = useful if useful.any() else hit
            self._adm[key] = hit
        return hit

    def _pipeline_allows(self, layer: int, s: Strategy, p: int) -> bool:
        """NOTE: a weight tied across layers (embedding / LM head) may cross pipeline stages, where
        the runtime sends it whole: with pp > 1 its layers run without TP and not as ZeRO-3 with
        checkpointing (see galvatron_fx/runtime/pipeline.py). Conservative: applies whatever the split
        (with pp > 1 the first and last layers always sit on different stages)."""
        return p == 1 or layer not in self.tied_layers or (s.tp == 1 and not (s.sdp == "zero3" and s.ckpt))

    def config(self, p: int, m: int, sched: str, gbs: int, v: int = 1) -> ConfigTables | None:
        """The tables of one configuration, or ``None`` (reason recorded) when its space is empty."""
        if gbs % m:
            return None
        b = gbs // m
        space, why = self._space(p, b)
        if not space:
            self._exclude(why)
            return None
        t, states, act, trans, wg, host, host_act = self._layer_tables(p, m, b, space, step_slots(sched, p, v, m),
                                                                       sched in ZERO_BUBBLE)
        dead = np.flatnonzero(~np.isfinite(t).any(axis=1))
        if dead.size:
            i = int(dead[0])
            tps = sorted({s.tp for s in space})
            why = (f"layer {self.names[i]!r} admits none of the strategies on {self.N // p} devices "
                   f"(TP degrees {tps}")
            why += ", and a weight tied across stages needs tp=1)" if p > 1 and i in self.tied_layers else ")"
            if i in self.batch_coupled and m > 1:
                why += f"; it mixes the samples of a batch, so it needs them all: one micro-batch (here {m})"
            self._exclude(why)
            return None
        gid, layouts = layout_groups(space)
        c = ConfigTables(p, m, sched, gbs, space, t, states, act, trans, gid, layouts, self.sig_ids,
                         self.tables, self.cluster, self.N, v=v, wg=wg, host=host, host_act=host_act)
        c.bound = step_time(self.cluster, c.p, self.N, self._step_bound(c), c.pipe)
        return c
