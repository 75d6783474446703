"""sf.optim steps torch's kernels on aliases of the caller's storage under copy-on-write
and recycles output buffers: nothing passed in (parameters, gradients, state) ever changes,
outputs still referenced anywhere are never reused, unreferenced ones are."""

from __future__ import annotations

import gc

import optree
import pytest
import torch

import shardfn as sf
from shardfn import P
from shardfn.optim._cow import BufferPool, CopyOnWrite

OPTIMIZERS = [
    ("sgd_nesterov", lambda: sf.optim.SGD(0.1, momentum=0.9, nesterov=True)),  # torch adds into the gradient
    ("sgd_nesterov_foreach", lambda: sf.optim.SGD(0.1, momentum=0.9, nesterov=True, foreach=True)),
    ("sgd_maximize_wd", lambda: sf.optim.SGD(0.1, momentum=0.5, weight_decay=0.1, maximize=True, foreach=True)),
    ("adam_wd", lambda: sf.optim.Adam(0.01, weight_decay=0.1, amsgrad=True, foreach=True)),
    ("adamw", lambda: sf.optim.AdamW(0.01)),
    ("adamw_foreach", lambda: sf.optim.AdamW(0.01, foreach=True, amsgrad=True)),
    ("adamw_fused", lambda: sf.optim.AdamW(0.01, fused=True)),
    ("adagrad", lambda: sf.optim.from_torch(torch.optim.Adagrad, lr=0.1, weight_decay=0.1, foreach=True)),
    ("rmsprop", lambda: sf.optim.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.5, centered=True)),
    ("nadam", lambda: sf.optim.from_torch(torch.optim.NAdam, lr=0.01, foreach=True)),
]


def _snap(tree) -> list[torch.Tensor]:
    return [x.full_tensor().clone() if isinstance(x, sf.ShardedArray) else x.clone()
            for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("name,make", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_nothing_passed_in_changes(name, make) -> None:
    mesh = sf.Mesh((2, 2), ("dp", "tp"))
    # big enough for the buffer pool (>= 64 KiB per stored tensor); row-sharded storage is
    # contiguous (torch writes into it directly without copy-on-write), column-sharded is not
    params = {"w": sf.distribute(torch.randn(64, 512), P(None, "tp"), mesh=mesh),
              "r": sf.distribute(torch.randn(64, 512), P("tp"), mesh=mesh), "b": torch.randn(7)}
    opt = make()
    state = opt.init(params)
    history = []
    for _ in range(4):
        grads = {"w": sf.distribute(torch.randn(64, 512), P(None, "tp"), mesh=mesh),
                 "r": sf.distribute(torch.randn(64, 512), P("tp"), mesh=mesh), "b": torch.randn(7)}
        before = [_snap(params), _snap(grads), _snap(state)]
        new_params, new_state = opt.step(params, grads, state)
        after = [_snap(params), _snap(grads), _snap(state)]
        for x, y in zip(before, after):
            for u, v in zip(x, y):
                assert torch.equal(u, v), f"{name}: a step changed its inputs"
        history.append((params, state, before[0], before[2]))  # every generation stays referenced
        params, state = new_params, new_state
    for p, s, p_vals, s_vals in history:  # later steps never reused the buffers of live arrays
        assert all(torch.equal(u, v) for u, v in zip(_snap(p), p_vals))
        assert all(torch.equal(u, v) for u, v in zip(_snap(s), s_vals))


def test_views_of_outputs_keep_their_buffers() -> None:
    mesh = sf.Mesh((2,), ("x",))
    opt = sf.optim.AdamW(0.1, foreach=True)
    params = [sf.distribute(torch.randn(256, 128), P("x"), mesh=mesh)]
    state = opt.init(params)
    params, state = opt.step(params, [torch.randn(256, 128)], state)
    view = params[0].local_shards()[0]  # a view of the stored buffer
    kept = view.clone()
    del params[0]
    params = [sf.distribute(torch.randn(256, 128), P("x"), mesh=mesh)]
    for _ in range(4):
        params, state = opt.step(params, [torch.randn(256, 128)], state)
    assert torch.equal(view, kept)


def test_unreferenced_outputs_are_recycled() -> None:
    mesh = sf.Mesh((2,), ("x",))
    opt = sf.optim.SGD(0.1, momentum=0.9, foreach=True)
    params = [sf.distribute(torch.randn(256, 256), P("x"), mesh=mesh)]
    state = opt.init(params)
    ptrs = set()
    for _ in range(10):
        params, state = opt.step(params, [torch.randn(256, 256)], state)
        gc.collect()
        # the array's own storage (``local_shards()`` hands out copies, whose addresses are malloc's)
        ptrs.add(params[0]._local.untyped_storage().data_ptr())
    # parameters and momentum share one shape: two generations of both alive at a time, then reuse
    assert len(ptrs) <= 4


def test_copy_on_write_mode_directly() -> None:
    """In-place ops on protected tensors (element-wise ones out of place, others copied
    first, views given a private copy) leave the original storage alone."""
    pool = BufferPool()
    a, b = torch.randn(300, 70), torch.randn(300, 70)
    a0, b0 = a.clone(), b.clone()
    x, y = a.detach(), b.detach()
    with CopyOnWrite([x, y], pool):
        torch._foreach_mul_([x, y], 2.0)
        x.addcmul_(y, y, value=0.5)
        y.clamp_(min=0.0)  # not in the element-wise table: copied first
        v = x.view(-1)
        v.add_(1.0)
    assert torch.equal(a, a0) and torch.equal(b, b0)
    torch.testing.assert_close(x, (a0 * 2 + 0.5 * (b0 * 2) ** 2) + 1.0)
    torch.testing.assert_close(y, (b0 * 2).clamp(min=0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
], ids=["sgd_nesterov", "adamw_amsgrad", "rmsprop"])
@pytest.mark.parametrize("foreach", [False, True])
def test_bit_equal_to_torch_in_every_dtype(cls, kw, foreach, dtype) -> None:
    """The out-of-place forms equal torch's in-place kernels bit for bit (CPU foreach kernels
    round some scalars to 16-bit types first: those run as torch wrote them)."""
    mesh = sf.Mesh((2,), ("x",))
    full = torch.randn(64, 300).to(dtype)
    params = [sf.distribute(full, P("x"), mesh=mesh)]
    ref = [full.clone()]
    opt, topt = sf.optim.from_torch(cls, foreach=foreach, **kw), cls(ref, foreach=foreach, **kw)
    state = opt.init(params)
    for _ in range(3):
        g = torch.randn(64, 300).to(dtype)
        params, state = opt.step(params, [sf.distribute(g, P("x"), mesh=mesh)], state)
        ref[0].grad = g
        topt.step()
    assert torch.equal(params[0].full_tensor(), ref[0])
