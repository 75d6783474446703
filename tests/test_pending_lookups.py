"""Pending sums through recomputed expressions and table lookups (issue 20's families):
the same op on the same arrays reduces once; ``x[idx]`` with split ids stays split; the
scatter-add backward of a lookup keeps pending sums and split ids without moving data."""

from __future__ import annotations

import torch

import shardfn as sf
from shardfn import P

MESH = sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _pending(t: torch.Tensor) -> sf.ShardedArray:
    """``t`` as a pending sum over tp (the output of a row-parallel matmul)."""
    a = sf.distribute(torch.randn(t.shape[-1], 8), P(None, "tp"), mesh=MESH)
    b = sf.distribute(torch.randn(8, t.shape[-1]), P("tp", None), mesh=MESH)
    return sf.distribute(t, P("dp"), mesh=MESH) @ a @ b


def test_recomputed_expression_reduces_once() -> None:
    torch.manual_seed(0)
    h = _pending(torch.randn(4, 6))
    mean = h.mean(-1, keepdim=True)
    want_h = h.full_tensor()
    with sf.debug.CommCounter() as cc:
        var = (h - mean).pow(2).mean(-1, keepdim=True)  # reduces (h - mean)
        out = (h - mean) * torch.rsqrt(var + 1e-5)  # the same (h - mean): no second reduction
        y = torch.tanh(out).sum(-1)  # reads out whole
    assert cc.counts["all_reduce"] == 1, cc
    c = want_h - want_h.mean(-1, keepdim=True)
    torch.testing.assert_close(y.full_tensor(), torch.tanh(c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)).sum(-1))


def test_recomputation_does_not_keep_the_parts_alive() -> None:
    """The earlier pending output dies with its last reader (its n-fold parts are not held
    for a recomputation); its reduction still serves one that comes, with the same value."""
    import gc
    import weakref

    torch.manual_seed(0)
    h = _pending(torch.randn(4, 6))
    mean = h.mean(-1, keepdim=True)
    d = h - mean
    first = d.pow(2)  # reduces d
    gone = weakref.ref(d)
    del d
    gc.collect()
    assert gone() is None
    with sf.debug.CommCounter() as cc:
        again = (h - mean).pow(2)
    assert cc.total == 0, cc
    torch.testing.assert_close(again.full_tensor(), first.full_tensor())


def test_recomputation_entry_goes_when_an_input_dies() -> None:
    """The table of recomputable calls (``reduced._SAME``) drops a call's entry as soon as one
    of its input arrays dies; the pending output itself it never keeps alive."""
    import gc
    import weakref

    from shardfn.arrays import reduced

    torch.manual_seed(0)
    h = _pending(torch.randn(4, 6))
    out = h * 2.0  # a pending output of a pure op on an array: remembered
    assert out._layout.partial
    keys = [k for k, v in reduced._SAME.items() if v[0]() is out]
    assert len(keys) == 1
    gone = weakref.ref(out)
    del out
    gc.collect()
    assert keys[0] in reduced._SAME and gone() is None  # the entry stays while its input lives
    del h
    gc.collect()
    assert keys[0] not in reduced._SAME


def test_lookup_by_split_ids_stays_split() -> None:
    w = torch.randn(5, 3, 2)
    ids = torch.randint(0, 5, (8,))
    sw, sids = sf.distribute(w, P(), mesh=MESH), sf.distribute(ids, P("dp"), mesh=MESH)
    with sf.debug.CommCounter() as cc:
        out = sw[sids]
    assert cc.total == 0 and out.spec == P("dp"), cc
    torch.testing.assert_close(out.full_tensor(), w[ids])


def test_lookup_backward_is_a_pending_scatter_add() -> None:
    """grad of w[ids] (ids split over dp) and of x[:, [i]] under a pending gradient: index_put
    with accumulate keeps both pending, and the values equal torch's."""
    ids = torch.randint(0, 5, (8,))
    g = torch.randn(8, 3)
    sg = sf.distribute(g, P("dp"), mesh=MESH)
    z = sf.distribute(torch.zeros(5, 3), P(), mesh=MESH)
    with sf.debug.CommCounter() as cc:
        out = torch.ops.aten.index_put(z, [sf.distribute(ids, P("dp"), mesh=MESH)], sg, True)
    assert cc.total == 0 and out.spec == P(partial="dp"), (cc, out.spec)
    torch.testing.assert_close(out.full_tensor(), torch.zeros(5, 3).index_put([ids], g, accumulate=True))

    torch.manual_seed(1)
    v = _pending(torch.randn(4, 2))  # pending values
    col = torch.tensor([0, 2])
    zz = sf.distribute(torch.zeros(4, 5), P("dp"), mesh=MESH)
    with sf.debug.CommCounter() as cc:
        out = torch.ops.aten.index_put(zz, [None, sf.distribute(col, P(), mesh=MESH)], v, True)
    assert cc.total == 0 and out.spec == P("dp", partial="tp"), (cc, out.spec)
    torch.testing.assert_close(out.full_tensor(), torch.ops.aten.index_put(torch.zeros(4, 5), [None, col], v.full_tensor(), True))
