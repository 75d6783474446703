"""Sharding rules of losses that used to replicate their inputs (issue 25/21): values and
gradients against plain torch, and no FallbackWarning on the shardings the rules cover."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn import P

from _no_fallback import NoFallback


def _full(a):
    return a.full_tensor() if isinstance(a, sf.ShardedArray) else a


def _multi_margin(p, weighted):
    def make(n, c, gen):
        t = torch.randint(0, c, (n,), generator=gen)
        w = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5 if weighted else None
        return t, (lambda x, tt, red, W=w: F.multi_margin_loss(x, tt, p=p, margin=0.7, weight=W, reduction=red))
    return make


def _multilabel(n, c, gen):
    t = torch.randint(-1, c, (n, c), generator=gen)
    return t, (lambda x, tt, red: F.multilabel_margin_loss(x, tt, reduction=red))


_LOSSES = {"multi_margin_p1": _multi_margin(1, False), "multi_margin_p2_weight": _multi_margin(2, True),
           "multi_margin_p1_weight": _multi_margin(1, True), "multilabel_margin": _multilabel}
# (rows, classes): 6 rows split evenly, 3 unevenly over 2, 1 row over 4 devices (empty shards)
_CASES = [((6, 5), P("x"), P("x")), ((3, 5), P("x"), P("x")), ((1, 4), P(("x", "y")), P(("x", "y"))),
          ((6, 5), P(("x", "y")), P()), ((4, 5), P("y", "x"), P("y"))]


@pytest.mark.parametrize("case", range(len(_CASES)))
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_margin_losses_of_sharded_rows_match_torch(name, reduction, case):
    """Batch-sharded rows stay sharded (each device's kernel on its rows, a reduced loss a pending
    sum, "mean" divided by the global row count); a class-sharded input is gathered along the
    classes, not replicated by the fallback. A device holding no rows adds 0 (torch's kernel
    leaves that loss unwritten)."""
    shape, xspec, tspec = _CASES[case]
    mesh = sf.Mesh((2, 2), ("x", "y"))
    gen = torch.Generator().manual_seed(case)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    t, f = _LOSSES[name](shape[0], shape[1], gen)
    if name == "multilabel_margin":
        tspec = P(*tuple(xspec)[:1])
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = f(xr, t, reduction)
    gout = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    with NoFallback():
        got = f(sf.distribute(xs, xspec, mesh=mesh), sf.distribute(t, tspec, mesh=mesh), reduction)
        (g,) = torch.autograd.grad(got, xs, sf.distribute(gout, P(*tuple(xspec)[:gout.dim()]), mesh=mesh))
    if "x" in str(xspec[0]) and reduction != "none":
        assert got._layout.partial  # the rows' losses stay a pending sum
    (gw,) = torch.autograd.grad(want, xr, gout)
    torch.testing.assert_close(_full(got), want)
    torch.testing.assert_close(_full(g), gw)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_margin_loss_of_unbatched_input_and_aten_backward(reduction):
    """A 1-D input is one row (whole); the backward called directly checks shapes as the forward."""
    mesh = sf.Mesh((2,), ("x",))
    x, t = torch.randn(5, dtype=torch.float64), torch.tensor(3)
    with NoFallback():
        got = F.multi_margin_loss(sf.distribute(x, P("x"), mesh=mesh), t, reduction=reduction)
    torch.testing.assert_close(_full(got), F.multi_margin_loss(x, t, reduction=reduction))
    xb = sf.distribute(torch.randn(4, 3, dtype=torch.float64), P("x"), mesh=mesh)
    with pytest.raises(RuntimeError):
        torch.ops.aten.multi_margin_loss_backward(torch.ones(()), xb, torch.zeros(3, dtype=torch.long), 1, 1.0)
    with pytest.raises(RuntimeError):
        torch.ops.aten.multi_margin_loss_backward(torch.ones(()), xb.full_tensor(), torch.zeros(3, dtype=torch.long), 1, 1.0)
