"""Extra memory of a sharded save (matrix): a rank's memory beyond its states while
``gfx.checkpoint.save`` runs stays within one bucket, on 2 gloo ranks under ZeRO-3, TP2 and DP2.

Two measures, per rank, on gpt-tiny widened to ~100 MB of states per rank, ``bucket_bytes`` 4 MiB:

* storage accounting: every tensor the save planner hands DCP's writer must be a view of the
  masters / optimizer states whose storage is exactly its bytes (DCP's CPU writer clones any other,
  and keeps one per tensor until the file is written): copies counted in bytes;
* resident memory: the peak RSS during the save (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``, and ``malloc_trim`` so that freed heap cannot hide a copy) minus the
  RSS before it (a save that copies its pieces, as the async staging does, shows them here).

The previous checkpoint format (whole tensors gathered per layer) needed a layer's whole states
on every rank: printed beside, as ``gathered_layer_bytes``.
"""

from __future__ import annotations

import ctypes
import math
import os

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.matrix]

BUCKET = 4 * 2**20
WIDE = dict(layers=2, batch=4, hidden=512, ffn_hidden=2048, vocab=2048, seq_len=16)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _measure(rank, world, path, spec):
    import galvatron_fx as gfx
    from galvatron_fx import checkpoint
    from galvatron_fx.runtime import sharded_state

    model, args = gfx.models.build("gpt-tiny", device="cpu", **WIDE)
    gm = gfx.capture(model, args, method="fx")
    dm = gfx.transform(gm, plan=gfx.Plan.uniform(gm, world, global_batch_size=4, **spec), bucket_bytes=BUCKET)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)
    dm.train_step(*args)
    opt.step()
    states = dm.states_bytes(opt)
    storages = [t.untyped_storage() for p in dm.parameters() for t in [p, *opt.state[p].values()]]
    spans = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
    copies, largest = [0], [0]
    resolve = sharded_state.ChunkSavePlanner.resolve_data

    def accounted(self, item):
        t = resolve(self, item)
        inside = any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in spans)
        if t.dim() and (not inside or t.untyped_storage().nbytes() != t.nbytes):
            copies[0] += t.nbytes
        largest[0] = max(largest[0], t.nbytes)
        return t

    sharded_state.ChunkSavePlanner.resolve_data = accounted   # fresh processes: never restored
    checkpoint.save(dm, opt, path + "-warm", step=0)          # imports, process group, first-use caches
    copies[0] = 0
    # NOTE: hand freed heap memory back first, or a copy could reuse it without raising the RSS
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                          # resets VmHWM to the current RSS
    before = _rss("VmRSS")
    checkpoint.save(dm, opt, path, step=1)
    peak = _rss("VmHWM")
    layers: dict = {}   # masters + 2 Adam states of each layer's whole parameters
    for p in dm.parameters():
        layers[id(p.spec.store)] = layers.get(id(p.spec.store), 0) + 3 * 4 * math.prod(p.spec.global_shape)
    gathered = max(layers.values())
    return dict(extra_rss=peak - before, copies=copies[0], largest_piece=largest[0], states=states["total"],
                gathered_layer_bytes=gathered)


@pytest.mark.parametrize("spec", [dict(sdp="zero3"), dict(tp=2, dp=1), dict(sdp="none")],
                         ids=["zero3", "tp2", "dp2"])
def test_save_extra_memory_within_one_bucket(tmp_path, spec):
    for rank, r in enumerate(run_distributed(_measure, 2, str(tmp_path / "ck"), spec, timeout=400, fresh=True)):
        print(f"{spec} rank {rank}: extra RSS during save {r['extra_rss'] / 2**20:.2f} MiB, copies "
              f"{r['copies']} B, largest piece {r['largest_piece'] / 2**20:.2f} MiB, states "
              f"{r['states'] / 2**20:.1f} MiB, whole-layer gather (old format) >= "
              f"{r['gathered_layer_bytes'] / 2**20:.1f} MiB; bucket {BUCKET / 2**20:.0f} MiB")
        assert r["copies"] == 0, r
        assert r["largest_piece"] <= BUCKET, r
        assert r["extra_rss"] <= BUCKET, r
        assert r["states"] >= 10 * BUCKET, r
    assert os.path.isdir(tmp_path / "ck")
