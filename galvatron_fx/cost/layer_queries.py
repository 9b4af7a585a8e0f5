"""What each layer of the captured graph is, as the cost model reads it: its experts, attention and
sequence, parameter shapes under TP / EP, the TP pass's analysis, parameter counts and states
bytes (:class:`LayerQueries`, a part of :class:`~galvatron_fx.cost.model.CostModel`)."""

from __future__ import annotations

import math

from ..ir import META_KEY
from ..sharding.experts import MoEBlock, layer_blocks
from ..sharding.state import tensor_val
from ..solver.strategy import Strategy
from .context import (
    NO_ATTENTION,
    LayerAttention,
    LayerSequenceTerms,
    layer_attention,
    layer_sequence_terms,
)
from .extract import capture_batch
from .measure import LayerMeasure
from .memory import StatesBytes, states_bytes
from .records import LayerExperts, LayerParams


class LayerQueries:
    """The per-layer questions of :class:`~galvatron_fx.cost.model.CostModel` (its attributes: ``layers``,
    ``graphs``, ``measures``, the caches its ``__init__`` sets)."""

    def _moe(self) -> tuple[dict, dict]:
        """``(layer -> LayerExperts, layer -> names of its experts blocks' nodes)``, cached.
        NOTE: no fx nodes are kept: the cost model lives in the graph's metadata, which the
        rewrite passes deep-copy."""
        if "_moe_info" not in self.__dict__:
            experts, names = {}, {}
            for i, blocks in layer_blocks(self.gm).items():
                if not all(isinstance(b, MoEBlock) for b in blocks):
                    continue
                x = tensor_val(blocks[0].x)
                loops = tuple(tuple(tuple(p.target for p in ps) for ps in b.loop.params) for b in blocks if b.loop)
                experts[i] = LayerExperts(frozenset(p.target for b in blocks for p in b.params),
                                          tuple(b.num_experts for b in blocks), blocks[0].top_k, int(x.shape[1]),
                                          int(x.shape[0]) / capture_batch(self.gm), loops)
                names[i] = frozenset(n.name for b in blocks for n in b.nodes)
            self._moe_info = (experts, names)
        return self._moe_info

    def experts(self, index: int) -> LayerExperts | None:
        """Layer ``index``'s experts, or None when it has none expert parallelism can split."""
        return self._moe()[0].get(index)

    def attention(self, index: int) -> LayerAttention:
        """Layer ``index``'s attention as context parallelism prices it (:mod:`.context`), cached
        for every layer at once (no fx nodes kept)."""
        if "_attention" not in self.__dict__:
            self._attention = layer_attention(self.gm, capture_batch(self.gm))
        return self._attention.get(index, NO_ATTENTION)

    def sequence_length(self) -> int:
        """The captured sequence length as the context-parallel pass reads it: dim 1 of the first
        graph input with two or more dims (0 when there is none)."""
        if "_seq_len" not in self.__dict__:
            from ..sharding.sequence import sequence_length

            self._seq_len = sequence_length(self.gm) or 0
        return self._seq_len

    def cp_sequence(self, index: int, cp: int) -> LayerSequenceTerms:
        """The context-parallel pass's analysis of layer ``index`` at degree ``cp``, as costs
        (:func:`.context.layer_sequence_terms`; cached per signature and degree)."""
        key = (self.layers[index].signature, cp)
        cache = self.__dict__.setdefault("_cp_seq", {})
        if key not in cache:
            graph = self.graphs[self.layers[index].signature]
            cache[key] = layer_sequence_terms(graph.gm, self.sequence_length(), cp, graph.batch,
                                              self.layers[index].name)
        return cache[key]

    def cp_refuses(self, index: int, cp: int, kind: str = "ring", tp: int = 1) -> str:
        """Why layer ``index`` cannot run at context-parallel degree ``cp`` with ``kind`` under TP
        degree ``tp`` ("" when it can), as the context-parallel pass would refuse it: no sequence
        to split or one ``cp`` does not divide, a layer mixing the samples of a batch (it runs on
        the whole batch), the sequence analysis' reason, or its attention's
        (:meth:`.context.LayerAttention.refuses`)."""
        if cp == 1:
            return ""
        seq = self.sequence_length()
        if seq < 2 or seq % cp:
            return f"its inputs' sequence of {seq} positions does not split into cp={cp} shards"
        if self.layers[index].batch_coupled:
            return "it mixes the samples of a batch (it runs on the whole batch)"
        refused = self.cp_sequence(index, cp).refused
        return refused or self.attention(index).refuses(cp, kind, tp)

    def expert_tp_of(self, index: int, strategy: Strategy) -> int:
        """The TP degree layer ``index``'s expert weights are sharded over under ``strategy``:
        ``tp`` under expert tensor parallelism (:attr:`Strategy.shards_experts`, grouped experts
        split by ``ep > 1``), else 1 (whole over TP: the TP ranks split the tokens)."""
        ex = self.experts(index)
        on = strategy.shards_experts and self.ep_of(index, strategy) > 1 and ex is not None and not ex.loops
        return strategy.tp if on else 1

    def ep_of(self, index: int, strategy: Strategy) -> int:
        """The expert-parallel degree layer ``index`` runs at under ``strategy`` (1 where it has no
        experts, or ``ep`` does not divide their number: the search never offers that)."""
        if strategy.ep == 1:
            return 1
        ex = self.experts(index)
        return strategy.ep if ex is not None and ex.allows(strategy.ep) else 1

    def cost_key(self, index: int) -> str:
        """What layer ``index``'s costs depend on, for the search's memo (equal keys cost the same):
        its signature and its neighbours' (ZeRO-3 prices the buffers it prefetches for them:
        :func:`galvatron_fx.dims.data.buffer_terms`)."""
        sigs = [self.layers[j].signature if 0 <= j < len(self.layers) else "" for j in (index - 1, index, index + 1)]
        return "|".join(sigs)

    def _owned_params(self, index: int) -> dict[str, int]:
        """fqn -> elements of the parameters (trainable and frozen) layer ``index`` owns (tied
        weights: the first user)."""
        if self._owned is None:
            self._owned = [{} for _ in self.layers]
            for n in self.gm.graph.nodes:
                info = n.meta.get(META_KEY)
                if n.op == "get_attr" and info is not None and info.layer is not None \
                        and info.param is not None and info.param.is_param:
                    self._owned[info.layer][info.param.fqn] = info.param.numel
                    self._shapes[info.layer][info.param.fqn] = tuple(info.param.shape)
                    if not info.param.requires_grad:
                        self._frozen.add(info.param.fqn)
        return self._owned[index]

    def tied_copy_bytes(self, first: int, last: int) -> float:
        """Bytes of the copies of tied weights a pipeline chunk of layers ``first..last`` holds per
        micro-batch in flight (``passes/stage_split.py``): a weight it reads but a layer outside it
        owns arrives as a copy with every micro-batch (e.g. an LM head tied to an embedding in
        another chunk), and a weight it owns that a layer outside it reads leaves as a copy (a
        ``torch.clone``, one per micro-batch, kept as the chunk's output until that micro-batch's
        backward). Whole (a tied weight crossing stages is never TP-sharded), in the compute dtype."""
        key = (first, last)
        if key not in self._tied_copies:
            if self._param_numel is None:   # every layer's owned parameters, once
                self._param_numel = {f: n for i in range(len(self.layers)) for f, n in self._owned_params(i).items()}
            numel = self._param_numel
            inside = range(first, last + 1)
            here = {fqn for i in inside for fqn in self._owned_params(i)}
            read = {fqn for i in inside for fqn in self.layers[i].params if fqn in numel}
            read_outside = {fqn for i in range(len(self.layers)) if i not in inside
                            for fqn in self.layers[i].params if fqn in here}
            self._tied_copies[key] = float(sum(numel[f] for f in (read - here) | read_outside) * self.itemsize)
        return self._tied_copies[key]

    def split_shapes(self, index: int, tp: int, ep: int = 1) -> tuple[list, list]:
        """:meth:`layer_shapes` split into the trainable parameters' and the frozen ones' (the
        runtime's two buffers per layer); with ``ep > 1`` the expert weights' are left out (their
        own buffers: :meth:`expert_shapes`)."""
        shapes = self.layer_shapes(index, tp, ep)
        experts = self.experts(index).fqns if ep > 1 else frozenset()
        fqns = list(self._owned_params(index))
        train = [s for f, s in zip(fqns, shapes) if f not in self._frozen and f not in experts]
        return train, [s for f, s in zip(fqns, shapes) if f in self._frozen and f not in experts]

    def expert_shapes(self, index: int, ep: int, tp: int = 1) -> tuple[list, list]:
        """This rank's expert weights of layer ``index`` under ``ep`` (``E / ep`` experts each, whole
        over TP, or with ``tp > 1`` (expert tensor parallelism) this TP rank's width slice of each),
        trainable and frozen: the shapes of its expert buffers."""
        ex = self.experts(index)
        held = ex.held(ep)   # a loop's experts: whole, E / ep of them
        local = dict(zip(self._owned_params(index), self.layer_shapes(index, tp, ep, expert_tp=tp > 1)))
        shapes = {f: s if f in held else (s[0] // ep, *s[1:]) for f, s in local.items()
                  if f in ex.fqns and held.get(f, True)}
        return ([s for f, s in shapes.items() if f not in self._frozen],
                [s for f, s in shapes.items() if f in self._frozen])

    def layer_shapes(self, index: int, tp: int, ep: int = 1, expert_tp: bool = False) -> list[tuple[int, ...]]:
        """TP-local shapes of the parameters layer ``index`` owns at degree ``tp``, as the runtime's
        flat buffer holds them (a sharded dim keeps ``block / tp`` of every block): the input of
        the buffer layout (:func:`galvatron_fx.runtime.zero_layout.zero_layout`). ``ep > 1``: the
        experts and their routers stay whole over TP (``expert_tp``: only the routers)."""
        key = (index, tp, ep > 1, expert_tp and ep > 1)
        if key not in self._local_shapes:
            owned = self._owned_params(index)
            shapes = [self._shapes[index][fqn] for fqn in owned]
            analysis = self.tp_analysis(index, tp, ep=ep, expert_tp=expert_tp) if tp > 1 else None
            if analysis is not None and not isinstance(analysis, Exception):
                rep = {shard.fqn: shard for shard in analysis.param_shards.values()}
                for i, fqn in enumerate(self._owned_params(analysis.layer)):   # same order (see below)
                    shard = rep.get(fqn)
                    if shard is not None and i < len(shapes):
                        shape = list(shapes[i])
                        shape[shard.dim] = sum(b // shard.tp for b in shard.blocks)
                        shapes[i] = tuple(shape)
            self._local_shapes[key] = shapes
        return self._local_shapes[key]

    def tp_analysis(self, index: int, tp: int, sp: bool = False, ep: int = 1, expert_tp: bool = False):
        """The tensor-parallel pass's own analysis of layer ``index`` at degree ``tp`` (with sequence
        parallelism: ``sp``; ``ep > 1``: experts split by expert, left whole unless ``expert_tp``;
        cached per signature),
        or the :class:`ConfigError` it raises when the layer cannot take that degree (heads, widths,
        or a sequence length not divisible by tp)."""
        key = (self.layers[index].signature, tp) + ((True,) if sp else ()) + (("ep",) if ep > 1 else ()) \
            + (("etp",) if ep > 1 and expert_tp else ())
        if key not in self._tp:
            from ..sharding.analysis import analyze_layer

            # with the layers sharing its weights
            self._tp[key] = analyze_layer(self.gm, index, tp, sp, ep, expert_tp)
        return self._tp[key]

    def layer_params(self, index: int, tp: int, trainable_only: bool = False, ep: int = 1) -> LayerParams:
        """Owned parameter elements of layer ``index`` (``trainable_only``: without the frozen
        ones), split by whether TP at degree ``tp`` shards them, exactly as
        :mod:`galvatron_fx.passes.tensor_parallel` will (vocabularies that do not divide, or
        linears feeding a norm, stay replicated); ``ep > 1``: without the expert weights (split by
        expert: :meth:`expert_shapes`)."""
        key = (index, tp, trainable_only, ep > 1)
        if key not in self._params:
            self._params[key] = self._layer_params(index, tp, trainable_only, ep)
        return self._params[key]

    def _layer_params(self, index: int, tp: int, trainable_only: bool, ep: int = 1) -> LayerParams:
        owned = self._owned_params(index)
        experts = self.experts(index).fqns if ep > 1 else frozenset()
        keep = [not (trainable_only and fqn in self._frozen) and fqn not in experts for fqn in owned]
        analysis = self.tp_analysis(index, tp, ep=ep) if tp > 1 else None
        if analysis is None or isinstance(analysis, Exception):
            return LayerParams(0, sum(n for k, n in zip(keep, owned.values()) if k))
        # NOTE: the analysis is cached per signature: it may come from another layer of the same
        # structure, whose parameters correspond to these one to one, in graph order.
        rep_owned = self._owned_params(analysis.layer)
        rep_sharded = {shard.fqn for shard in analysis.param_shards.values()}
        flags = [fqn in rep_sharded for fqn in rep_owned]
        sharded = sum(n for flag, k, n in zip(flags, keep, owned.values()) if flag and k)
        return LayerParams(sharded, sum(n for k, n in zip(keep, owned.values()) if k) - sharded)

    def measure(self, index: int) -> LayerMeasure:
        return self.measures[self.layers[index].signature]

    def states_bytes(self, index: int, strategy: Strategy, dp_index: int = 0, tp_index: int = 0) -> StatesBytes:
        """Per-device parameter, gradient and optimizer-state bytes of layer ``index`` (frozen
        parameters: their weights only); ``dp_index``: which rank of the DP group (0, the default,
        holds the most: ZeRO shards are cut ``ceil(rows / dp)`` rows per rank). Under expert
        parallelism the expert weights are ``E / ep`` experts whole over TP (expert tensor
        parallelism: ``1 / tp`` of their width), sharded (ZeRO) over the ranks holding the same
        slice (``tp_index``: the rank's place in its TP group)."""
        ep = self.ep_of(index, strategy)
        p = self.layer_params(index, strategy.tp, trainable_only=True, ep=ep)
        train, frozen = self.split_shapes(index, strategy.tp, ep)
        kw = dict(itemsize=self.itemsize, mixed_precision=self.mixed_precision, optimizer=self.optimizer)
        st = states_bytes(p.sharded, p.replicated, strategy, shapes=train, frozen_shapes=frozen,
                          dp_index=dp_index, **kw)
        if ep == 1:
            return st
        xtp = self.expert_tp_of(index, strategy)
        train, frozen = self.expert_shapes(index, ep, xtp)
        slot = dp_index // ep if xtp > 1 else dp_index // ep * strategy.tp + tp_index
        ex = states_bytes(0, sum(math.prod(s) for s in train), self._expert_strategy(strategy, xtp > 1),
                          shapes=train, frozen_shapes=frozen, dp_index=slot, **kw)
        return StatesBytes(st.params + ex.params, st.grads + ex.grads, st.optimizer + ex.optimizer,
                           st.masters + ex.masters, st.host + ex.host)

    @staticmethod
    def _expert_strategy(s: Strategy, expert_tp: bool = False) -> Strategy:
        """How a layer's expert buffers are held under ``s``: data-parallel (ZeRO as ``s``) over the
        ``tp * dp / ep`` ranks holding the same experts whole over TP, or (``expert_tp``) the
        ``dp / ep`` ranks holding the same width slice."""
        return Strategy(1, (1 if expert_tp else s.tp) * s.dp // s.ep, s.sdp, False, s.ckpt)

    def boundary_bytes(self, index: int, micro_batch_size: float) -> float:
        """Bytes of the activations layer ``index`` hands to later layers for ``micro_batch_size``
        samples (whole micro-batch, unsharded): what a pipeline boundary after it sends in total."""
        return self.measure(index).output_elems(micro_batch_size) * self.itemsize
