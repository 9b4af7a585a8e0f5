"""Sharded-checkpoint geometry and its DCP plumbing, in one process (no process group).

* :func:`range_boxes`: a flat range of a row-major tensor is at most ``2n - 1`` boxes, exactly;
* :func:`layer_pieces`: over every TP rank (fused blocks included) and every rank's dim-0 ZeRO
  slice, the pieces tile the global tensor exactly once, and each view holds the right values;
* :class:`ChunkedTensor` + the planners: DCP stores the pieces as chunks and reloads them into
  differently cut pieces (resharding); the save hands DCP views without copying;
* the streamed safetensors file equals ``safetensors.torch.save_file``'s.
"""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from galvatron_fx.ir import ShardInfo
from galvatron_fx.runtime.chunks import layer_pieces, piece_view, range_boxes
from galvatron_fx.sharding import shard_tensor


def _region(t, offsets, sizes):
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def test_range_boxes_are_exact_and_at_most_2n_minus_1():
    rng = random.Random(0)
    for _ in range(1500):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        boxes = range_boxes(shape, lo, hi)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        t = torch.arange(n).reshape(shape)
        got = [x for off, size in boxes for x in _region(t, off, size).reshape(-1).tolist()]
        assert got == list(range(lo, hi)), (shape, lo, hi, boxes)


def test_pieces_tile_every_global_tensor_once_over_tp_and_dp():
    from galvatron_fx.runtime.zero_layout import zero_layout

    rng = random.Random(1)
    for _ in range(300):
        nd = rng.randint(1, 3)
        dim, tp, dp = rng.randrange(nd), rng.choice([1, 2, 3]), rng.randint(1, 3)
        blocks = tuple(tp * rng.randint(1, 3) for _ in range(rng.randint(1, 3)))   # fused q/k/v: several
        shape = [rng.randint(1, 4) for _ in range(nd)]
        shape[dim] = sum(blocks)
        full = torch.arange(math.prod(shape)).reshape(shape)
        cover = torch.zeros(shape, dtype=torch.long)
        for r in range(tp):
            info = ShardInfo(dim, tp, r, blocks)
            local = shard_tensor(full, info, r)
            lay = zero_layout([(3,), tuple(local.shape)], dp)    # a 1-D parameter first, then this one
            buf = torch.full((lay.padded,), -1)
            buf[lay.offsets[1]:lay.offsets[1] + local.numel()] = local.reshape(-1)
            w = lay.row[1]
            for k in range(dp):
                shard = lay.shard_of(buf, k)
                a, b = lay.held_rows(1, k)
                span = (a * w, b * w, lay.shard_offsets[1] - a * w)
                pieces = layer_pieces(["w"], [tuple(local.shape)], [span], {"w": info},
                                      max_numel=rng.choice([None, 1, 5]))["w"]
                for p in pieces:
                    view = piece_view(shard, p)
                    assert torch.equal(view, _region(full, p.global_offsets, p.sizes)), p
                    _region(cover, p.global_offsets, p.sizes).add_(1)
                if tp == 1 and b > a:   # a ZeRO shard's part of a parameter is one dim-0 chunk
                    whole = layer_pieces(["w"], [tuple(local.shape)], [span], {})["w"]
                    assert [(q.global_offsets, q.sizes) for q in whole] == \
                        [((a,) + (0,) * (nd - 1), (b - a,) + tuple(shape[1:]))]
        assert (cover == 1).all()


def test_replicated_parameters_are_skipped_unless_asked():
    spans = [(0, 6, 0), (0, 4, 6)]
    pieces = layer_pieces(["a", "b"], [(2, 3), (4,)], spans, {}, replicated=False)
    assert pieces == {"a": [], "b": []}
    pieces = layer_pieces(["a", "b"], [(2, 3), (4,)], [(4, 6, 0), (0, 4, 6)], {})
    assert [(p.global_offsets, p.sizes) for p in pieces["a"]] == [((1, 1), (1, 2))]
    assert [(p.global_offsets, p.sizes) for p in pieces["b"]] == [((0,), (4,))]


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    from galvatron_fx.runtime.sharded_state import ChunkSavePlanner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), planner=ChunkSavePlanner(), no_dist=True)


def test_chunked_tensor_round_trip_reshards(tmp_path):
    import torch.distributed.checkpoint as dcp

    from galvatron_fx.runtime.sharded_state import ChunkedTensor, ChunkLoadPlanner

    full = torch.randn(6, 5)
    # saved as three pieces (one process plays every rank)
    pieces = [((0, 0), full[0:2]), ((2, 0), full[2:6, 0:3]), ((2, 3), full[2:6, 3:5])]
    _dcp_save({"w": ChunkedTensor(full.shape, full.dtype, pieces), "s": torch.tensor(3.0)}, tmp_path)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert sorted(tuple(c.sizes) for c in md["w"].chunks) == [(2, 5), (4, 2), (4, 3)]
    # loaded into other pieces: views of a buffer, filled in place
    buf = torch.zeros(30)
    target = [((0, 0), buf[:15].view(3, 5)), ((3, 0), buf[15:].view(3, 5))]
    step = torch.zeros(())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"w": ChunkedTensor(full.shape, full.dtype, target), "s": step},
                 checkpoint_id=str(tmp_path), planner=ChunkLoadPlanner(), no_dist=True)
    assert torch.equal(buf.view(6, 5), full) and step.item() == 3.0


def test_save_hands_dcp_views_not_copies():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from galvatron_fx.runtime.sharded_state import ChunkedTensor

    buf = torch.arange(20.0)
    c = ChunkedTensor((20,), buf.dtype, [((4,), buf[4:12])])
    t = c.write_view(MetadataIndex("w", (4,), 0))
    # DCP's CPU loader clones a tensor whose storage is bigger than its bytes; this one is exact
    assert t.untyped_storage().nbytes() == t.nbytes == 32
    assert t.data_ptr() == buf[4:].data_ptr() and torch.equal(t, buf[4:12])


def test_streamed_safetensors_equals_save_file(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    from galvatron_fx.consolidation import stream_safetensors

    tensors = {"b.weight": torch.randn(3, 4), "a.bias": torch.randn(7).to(torch.bfloat16),
               "c.big": torch.randn(5, 6), "d.flag": torch.tensor([True, False]), "e.step": torch.tensor(2.0)}
    entries = {f"model.{k}": (v.shape, v.dtype) for k, v in tensors.items()}
    names = {k: k[len("model."):] for k in entries}
    reads = []

    def read(want):
        reads.append(sorted(want))
        for k, t in want.items():
            t.copy_(tensors[names[k]])
        return want

    held = stream_safetensors(str(tmp_path / "ours.safetensors"), entries, names, read)
    assert held == 5 * 6 * 4                                    # at most the largest tensor at once
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    ours, ref = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    assert set(ours) == set(ref) and all(torch.equal(ours[k], ref[k]) and ours[k].dtype == ref[k].dtype
                                         for k in ref)
    assert len(reads) > 1
