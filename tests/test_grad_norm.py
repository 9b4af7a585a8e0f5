"""The norm routing of sharded parameters and gradients (runtime/grad_norm.py), in one process.

With no process group the reduction is the identity, so a rank's figures must equal torch's own
on the same tensors, for every order torch's clip supports; non-owner replicas must not count.
The multi-rank behaviour is tested by tests/test_training_loop_dist.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from galvatron_fx.runtime.grad_norm import global_norms, total_norm
from galvatron_fx.runtime.params import ShardedGrad


def _grads(owners=(True, True, True)):
    registry = types.SimpleNamespace(slots=4, device=torch.device("cpu"), pipelined=False)
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.zeros(0, 4)]
    wrapped = [ShardedGrad.wrap(t, types.SimpleNamespace(registry=registry, slot=i, owner=o))
               for i, (t, o) in enumerate(zip(plain, owners))]
    return registry, plain, wrapped


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, float("inf"), 0.0])
def test_norms_equal_torch_on_one_rank(p):
    registry, plain, wrapped = _grads()
    want = [torch.linalg.vector_norm(t, p) if t.numel() else torch.tensor(0.0) for t in plain]
    got = torch._foreach_norm(wrapped, p)          # routed through __torch_function__
    assert all(type(n) is torch.Tensor for n in got)
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    total = torch.nn.utils.get_total_norm(wrapped, p)
    # NOTE: torch's own inf norm refuses the empty tensor (a ZeRO rank holding no rows of a parameter)
    torch.testing.assert_close(total, torch.nn.utils.get_total_norm([t for t in plain if t.numel()], p))
    torch.testing.assert_close(total_norm(registry, wrapped, p), total)
    torch.testing.assert_close(wrapped[0].norm(p), torch.linalg.vector_norm(plain[0], p))


def test_a_replica_that_does_not_own_its_part_counts_nothing():
    registry, plain, wrapped = _grads(owners=(True, False, True))
    assert float(global_norms(wrapped)[1]) == 0.0
    torch.testing.assert_close(total_norm(registry, wrapped), torch.linalg.vector_norm(plain[0]))


def test_clip_scales_in_place_and_plain_tensors_stay_local():
    registry, plain, wrapped = _grads()
    extra = torch.ones(4)
    want = torch.nn.utils.get_total_norm(plain + [extra])
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in plain] + [torch.nn.Parameter(torch.zeros(4))]
    for q, g in zip(params, wrapped + [extra.clone()]):
        q.grad = g
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    torch.testing.assert_close(norm, want)
    torch.testing.assert_close(torch.nn.utils.get_total_norm([q.grad for q in params]), torch.tensor(0.5),
                               atol=1e-5, rtol=1e-5)
    assert wrapped[0].data_ptr() == plain[0].data_ptr() and torch.equal(wrapped[0], plain[0])   # in place
