"""sf.smap, sf.lax.pcast, sf.lax.all_gather_invariant, and ppermute with a one-shot
iterator: values and gradients (reverse and forward mode) against plain torch."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P, lax


@pytest.fixture
def mesh() -> sf.Mesh:
    return sf.Mesh((2, 2), ("dp", "tp"), backend="local")


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [8, 7])
def test_smap_values_and_grads(mesh, m):
    x, w = torch.randn(m, 6), torch.randn(6)
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_()
    f = sf.smap(lambda a, b: torch.tanh(a * b), in_axes=(0, None), axis_name="dp", mesh=mesh)
    y = f(xs, ws)
    assert y.spec == P("dp")
    y.full_tensor().pow(2).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.tanh(xr * wr).pow(2).sum().backward()
    _close(y.full_tensor(), torch.tanh(x * w))
    _close(xs.grad, xr.grad)
    _close(ws.grad, wr.grad)


def test_smap_axes_and_reductions(mesh):
    x = torch.randn(4, 6)
    f = sf.smap(lambda a: lax.psum(a.sum(1), "tp"), in_axes=1, out_axes=None, axis_name="tp", mesh=mesh)
    y = f(x)
    assert y.spec == P()
    _close(y.full_tensor(), x.sum(1))
    g = sf.smap(lambda a: a.T, in_axes=-1, out_axes=0, axis_name="tp", mesh=mesh)
    _close(g(x).full_tensor(), x.T)


@pytest.mark.xfail(raises=NotImplementedError, strict=False,
                   reason="forward mode through shard_map boundaries is issue 13b (a parallel branch)")
def test_smap_forward_mode(mesh):
    x, t = torch.randn(8, 3), torch.randn(8, 3)
    f = sf.smap(lambda a: torch.sin(a), axis_name="dp", mesh=mesh)
    _, jt = torch.func.jvp(lambda a: sf.gather(f(a)), (x,), (t,))
    _close(jt, torch.cos(x) * t)


def test_smap_errors(mesh):
    x = torch.randn(4, 6)
    with pytest.raises(sf.ShardingError, match="in_axes .* has 2 entries"):
        sf.smap(lambda a: a, in_axes=(0, 1), axis_name="dp", mesh=mesh)(x)
    with pytest.raises(sf.ShardingError, match=r"in_axes=2 is out of range"):
        sf.smap(lambda a: a, in_axes=2, axis_name="dp", mesh=mesh)(x)
    with pytest.raises(sf.ShardingError, match="axis 'tp' is not manual"):
        sf.smap(lambda a: lax.psum(a, "tp"), axis_name="dp", mesh=mesh)(x)


@pytest.mark.parametrize("m", [8, 6])
def test_pcast_values_grads_and_vma(mesh, m):
    x = torch.randn(m, 3)
    xs = sf.distribute(x, P(), mesh=mesh).requires_grad_()
    # replicated over dp; pcast makes it varying, so a partial out_spec over dp is allowed
    f = sf.shard_map(lambda a: lax.pcast(a * 3, "dp"), mesh=mesh, in_specs=P(), out_specs=P(partial="dp"))
    y = f(xs)
    _close(y.full_tensor(), 2 * 3 * x)
    y.full_tensor().sum().backward()
    _close(xs.grad.full_tensor(), torch.full_like(x, 6.0))  # transpose of pcast is psum
    with pytest.raises(sf.ShardingError, match="does not vary over 'dp'"):
        sf.shard_map(lambda a: a * 3, mesh=mesh, in_specs=P(), out_specs=P(partial="dp"))(xs)
    with pytest.raises(sf.ShardingError, match="to='invariant'"):
        sf.shard_map(lambda a: lax.pcast(a, "dp", to="invariant"), mesh=mesh, in_specs=P(), out_specs=P())(xs)


@pytest.mark.xfail(raises=NotImplementedError, strict=False,
                   reason="forward mode through shard_map boundaries is issue 13b (a parallel branch)")
def test_pcast_forward_mode(mesh):
    x, t = torch.randn(4, 3), torch.randn(4, 3)
    f = sf.shard_map(lambda a: lax.pcast(a, "tp"), mesh=mesh, in_specs=P(), out_specs=P(partial="tp"))
    _, jt = torch.func.jvp(lambda a: sf.gather(f(a)), (x,), (t,))
    _close(jt, 2 * t)


@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_invariant(mesh, tiled):
    x = torch.randn(8, 3)
    xs = x.clone().requires_grad_()
    f = sf.shard_map(lambda a: lax.all_gather_invariant(a, "dp", axis=0, tiled=tiled) * 2, mesh=mesh,
                     in_specs=P("dp"), out_specs=P())
    y = f(xs)
    want = 2 * (x if tiled else x.view(2, 4, 3))
    _close(y.full_tensor(), want)
    ct = torch.randn(want.shape)
    (y.full_tensor() * ct).sum().backward()
    _close(xs.grad, (2 * ct).reshape(8, 3))  # transpose: each device's slice of the cotangent


def test_all_gather_invariant_outside_shard_map():
    with pytest.raises(sf.ShardingError, match=r"all_gather_invariant.*outside sf\.shard_map"):
        lax.all_gather_invariant(torch.ones(2), "x")


@pytest.mark.parametrize("extra", [4, 5])  # 5: an uneven argument, the body runs once per device
def test_ppermute_one_shot_iterator(mesh, extra):
    x, e = torch.randn(8, 3), torch.randn(extra)
    perm = zip([0, 1], [1, 0])
    f = sf.shard_map(lambda a, b: lax.ppermute(a, "dp", perm), mesh=mesh, in_specs=(P("dp"), P("tp")),
                     out_specs=P("dp"))
    first, second = f(x, e).full_tensor(), f(x, e).full_tensor()
    _close(first, torch.roll(x, 4, 0))
    _close(second, first)
