"""The estimated peak device memory against the peak of live tensors in a real training step.

Per rank (gloo), a transformers model built from a small config and called as users call it
(keyword inputs, labels), one step after a warm-up step (the optimizer's moments exist):
:class:`_LivePeak` counts the bytes of every live tensor (the states the step starts with, then
every storage an op makes, until freed) and their peak over the forward and backward.
:func:`galvatron_fx.estimate`'s ``memory_bytes_per_device`` of the rank's stage, less the reserve
it adds for the allocator and the CUDA context, must match that peak within :data:`TOL`. The
optimizer step's peak is reported beside it (not priced); on one stage torch's own tracker
(``torch.distributed._tools.mem_tracker.MemTracker``, over forward, backward and the optimizer
step) must agree with ours within 1 %. The tracker is the test's own, apart from the cost model's
:mod:`galvatron_fx.cost.backward_peak`, so that a mistake the two could share does not hide.

The vocabulary is large next to the hidden size, so that the loss's buffers decide the peak: the
backward of the cross-entropy holds two ``[tokens, vocab]`` fp32 gradients next to the saved
log-probabilities, which the estimate missed (it read about half the live peak).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import run_distributed

TOL = 0.15
BATCH, SEQ = 4, 128
PLANS = [  # label, Plan.uniform arguments
    ("dp", dict()),
    ("zero3", dict(sdp="zero3")),
    ("tp2", dict(tp=2, dp=1)),
    ("ckpt", dict(ckpt=True)),
    ("pp2", dict(pp=2, dp=1, micro_batches=2)),
]


def _model(arch: str):
    import transformers as tf

    if arch == "llama":
        cfg = tf.LlamaConfig(vocab_size=16000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             use_cache=False)
        cfg._attn_implementation = "sdpa"
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.GPT2Config(vocab_size=16000, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return tf.GPT2LMHeadModel(cfg)


class _LivePeak(TorchDispatchMode):
    """The most bytes live at once while it is active: the storages of ``at_rest`` (what the step
    starts with: states) until freed, and every storage an op makes (views and ops writing into
    an input allocate nothing), each until it is freed."""

    def __init__(self, at_rest):
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.ref] = {}
        # NOTE: the states' storages may be resized in place (ZeRO-3 frees its gathered buffer with
        # resize_(0) and gathers into it again), which no op reports: re-read before every op
        self._resizable = {id(st): (weakref.ref(st), 0) for st in (t.untyped_storage() for t in at_rest)}
        self._resized()

    def _resized(self):
        for key, (ref, counted) in list(self._resizable.items()):
            st = ref()
            now = st.nbytes() if st is not None else 0
            if now != counted:
                self.live += now - counted
                self.peak = max(self.peak, self.live)
                self._resizable[key] = (ref, now)

    def _add(self, st):
        known = self._seen.get(id(st))
        if (known is not None and known() is st) or id(st) in self._resizable or st.nbytes() == 0:
            return
        self._seen[id(st)] = weakref.ref(st)
        self.live += st.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, st.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._resized()
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            inputs = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                    self._add(t.untyped_storage())
        self._resized()
        return out

    def _free(self, nbytes):
        self.live -= nbytes


def _states(dm, opt):
    """The tensors a step starts with: parameters, their gradients, the runtime's flat buffers and
    the optimizer's states."""
    out = [t for p in dm.parameters() for t in (p, p.grad) if t is not None]
    for m in dm.modules():
        for store in getattr(m, "_stores", ()):
            out += [t for t in (store.flat_param, store.flat_param.grad, store.full) if t is not None]
    out += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _peaks(rank, world, arch, method):
    from torch.distributed._tools.mem_tracker import MemTracker

    import galvatron_fx as gfx

    torch.manual_seed(0)
    model = _model(arch)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    labels = ids.clone()
    labels[:, -8:] = -100   # padding, as a collator marks it
    batch = dict(input_ids=ids, labels=labels)
    gm = gfx.capture(model, (), kwargs=batch, method=method)
    cluster = gfx.Cluster.preset(f"{world}xA100-80GB")
    out = {}
    for label, spec in PLANS:
        plan = gfx.Plan.uniform(gm, world, global_batch_size=BATCH, **spec)
        dm = gfx.transform(gm, plan=plan)
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1, foreach=False)
        dm.train_step(**batch)
        opt.step()
        with _LivePeak(_states(dm, opt)) as step:
            dm.train_step(**batch)
            measured = step.peak   # forward and backward
            opt.step()
        r = dict(step=measured, with_optimizer=step.peak)
        if plan.pp == 1:   # torch's own tracker (it takes no module called twice in a step)
            tracker = MemTracker()
            tracker.track_external(dm, opt)
            with tracker:
                dm.train_step(**batch)
                opt.step()
            r["memtracker"] = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
        est = gfx.estimate(gm, plan, cluster)
        stage = dm.stage_index if plan.pp > 1 else 0
        r["estimated"] = est["memory_bytes_per_device"][stage] - est["per_device"]["reserve_bytes"]
        out[label] = r
    return out


KNOWN_HIGH: dict[tuple[str, str, int], str] = {}
"""(model, plan, rank) the estimate is known to put above the live peak by more than :data:`TOL`
(conservative; checked to stay above it: the day it is fixed the entry must go)."""


@pytest.mark.dist
@pytest.mark.parametrize("arch, method", [("llama", "dynamo"), ("gpt2", "export")])
def test_estimated_peak_matches_the_live_tensors_peak(arch, method):
    pytest.importorskip("transformers")
    results = run_distributed(_peaks, 2, arch, method, timeout=300)
    for rank, res in enumerate(results):
        for label, r in res.items():
            ratio = r["estimated"] / r["step"]
            print(f"{arch} rank {rank} {label}: live peak {r['step'] / 2**20:.1f} MiB (with the optimizer's step "
                  f"{r['with_optimizer'] / 2**20:.1f}, MemTracker {r.get('memtracker', 0) / 2**20:.1f}), "
                  f"estimated {r['estimated'] / 2**20:.1f} MiB ({ratio:.3f})")
            if (arch, label, rank) in KNOWN_HIGH:
                assert ratio > 1 + TOL, (arch, rank, label, r, "fixed: drop it from KNOWN_HIGH")
                continue
            assert abs(ratio - 1) <= TOL, (arch, rank, label, r)
            if "memtracker" in r:
                assert abs(r["memtracker"] / r["with_optimizer"] - 1) <= 0.01, (arch, rank, label, r)
