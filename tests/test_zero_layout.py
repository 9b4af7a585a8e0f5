"""ZeRO's per-parameter dim-0 layout (runtime/data_parallel.py ``ZeroLayout``), one process.

* every rank's shard holds, per parameter, its rows ``[r * R, (r + 1) * R)`` (zero padding rows);
* the ``[dp, S]`` staging buffer of all shards and the full buffer convert into each other exactly
  (``copy_out`` / ``copy_in``, padding zeroed), as the all-gather and reduce-scatter use them;
* ``buffer_parts`` cuts the full buffer at every parameter (the layer-entry call's chunks);
* ``FlatParams`` builds its shard and spans from it, and the cost model's ``states_bytes`` given the
  same shapes predicts its buffer sizes.
"""

from __future__ import annotations

import math
import random

import torch

from galvatron_fx.cost.memory import states_bytes
from galvatron_fx.runtime.data_parallel import FlatParams
from galvatron_fx.runtime.zero_layout import buffer_parts, zero_layout
from galvatron_fx.solver.strategy import Strategy


def _shapes(rng):
    pool = [(), (1,), (5,), (3, 4), (7, 2), (2, 3, 2), (1, 6), (4,)]
    return [rng.choice(pool) for _ in range(rng.randint(1, 5))]


def test_staging_and_full_buffer_round_trip():
    rng = random.Random(0)
    for _ in range(200):
        shapes, dp = _shapes(rng), rng.randint(1, 4)
        lay = zero_layout(shapes, dp)
        params = [torch.randn(s) for s in shapes]
        full = torch.zeros(lay.padded)
        for t, o in zip(params, lay.offsets):
            full[o:o + t.numel()] = t.reshape(-1)
        shards = [lay.shard_of(full, r) for r in range(dp)]
        for r, sh in enumerate(shards):
            assert sh.numel() == lay.shard
            for i, t in enumerate(params):
                a, b = lay.held_rows(i, r)
                so, w = lay.shard_offsets[i], lay.row[i]
                rows = t.reshape(lay.rows[i], w)
                assert torch.equal(sh[so:so + (b - a) * w], rows[a:b].reshape(-1))
                assert not sh[so + (b - a) * w:so + lay.seg(i)].any()   # padding rows are zero
        staging = torch.stack(shards).reshape(-1)                       # what one all-gather gives
        out = torch.full((lay.padded,), float("nan"))
        lay.copy_out(staging, out)
        n = sum(t.numel() for t in params)
        assert torch.equal(out[:n], full[:n])
        back = torch.full((lay.padded,), float("nan"))
        lay.copy_in(full, back)
        assert torch.equal(back, staging)
        # from per-parameter gradients (the entry call's chunks), one of them absent (zeros)
        srcs = [t.reshape(-1) for t in params]
        gone = rng.randrange(len(srcs))
        srcs[gone] = None
        back.fill_(float("nan"))
        lay.copy_in_params(srcs, back)
        expect = staging.view(dp, lay.shard).clone()
        so = lay.shard_offsets[gone]
        expect[:, so:so + lay.seg(gone)] = 0
        assert torch.equal(back.view(dp, lay.shard), expect)


def test_buffer_parts_cut_at_every_parameter():
    rng = random.Random(1)
    for _ in range(100):
        shapes, dp = _shapes(rng), rng.randint(1, 4)
        lay = zero_layout(shapes, dp)
        sizes, index = buffer_parts(lay)
        assert sum(sizes) == lay.padded
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        for i, shape in enumerate(shapes):
            assert starts[index[i]] == lay.offsets[i] and sizes[index[i]] == math.prod(shape)


def test_flat_params_shard_and_memory_model_agree():
    shapes = [(6, 4), (6,), (5, 3), ()]
    tensors = {f"p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    for mode in ("none", "zero2", "zero3"):
        for dp in (1, 2, 4):
            stores = [FlatParams(tensors, mode, tuple(range(dp)), r) for r in range(dp)]
            st = states_bytes(0, 0, Strategy(1, dp, mode), itemsize=4, optimizer="sgd", shapes=shapes)
            for r, s in enumerate(stores):
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in (s.flat_param, s.full) if t is not None}
                assert sum(storages.values()) == st.params, (mode, dp, r)   # ZeRO-3: the gathered one is empty
                for i, t in enumerate(tensors.values()):
                    lo, hi = s.shard_span(i)
                    got = s.flat_param.data[lo:hi]
                    if mode == "none":
                        assert torch.equal(got, t.reshape(-1))
                    else:
                        a, b = s.layout.held_rows(i, r)
                        w = s.layout.row[i]
                        assert torch.equal(got, t.reshape(-1)[a * w:b * w])
            # the unsharded parameters come back from any rank's buffers (dp = 1 needs no group)
            if dp == 1:
                full = stores[0].unsharded()
                assert all(torch.equal(full[k], v) for k, v in tensors.items())
