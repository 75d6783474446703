"""Explicit sharding on both backends: sf.explicit, sf.matmul/einsum out_sharding=,
shard_map in_specs=None / axis_names=, nested shard_map, smap, pcast,
all_gather_invariant, one-shot ppermute perms, and mesh views."""

from __future__ import annotations

import pytest
import torch
from dist_harness import collect, scenario

import shardfn as sf
from shardfn import P, lax


def _close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _data(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@scenario
def explicit_raises_without_moving(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    x, w = _data(8, 6), _data(6, 4, seed=1)
    xs = sf.distribute(x, P(None, a), mesh=mesh)
    ws = sf.distribute(w, P(a, None), mesh=mesh)
    with sf.explicit(), sf.debug.CommCounter() as c:
        y = xs @ ws  # contraction over a sharded dim: left Partial, nothing moves
        with pytest.raises(sf.ImplicitReshardError, match=r"aten\.(gelu|relu).*input 0.*partial.*sf\.reshard"):
            torch.relu(y)
    assert c.total == 0, c
    _close(torch.relu(y).full_tensor(), torch.relu(x @ w), "relu after")


@scenario
def matmul_out_sharding_reduce_scatter(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[-1]
    for m, k in ((8, 8), (7, 5)):
        x, w = _data(m, k), _data(k, 4, seed=1)
        xs = sf.distribute(x, P(None, a), mesh=mesh).requires_grad_()
        ws = sf.distribute(w, P(a, None), mesh=mesh).requires_grad_()
        with sf.explicit(), sf.debug.CommCounter() as c:
            y = sf.matmul(xs, ws, out_sharding=P(a, None))
        assert dict(c.counts) == {"reduce_scatter": 1}, c
        assert y.spec == P(a)
        _close(y.full_tensor(), x @ w, "matmul")
        y2 = sf.einsum("ik,kn->in", xs, ws, out_sharding=P())
        (y.full_tensor().sum() + y2.full_tensor().pow(2).sum()).backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = xr @ wr
        (r.sum() + r.pow(2).sum()).backward()
        _close(xs.grad.full_tensor(), xr.grad, "grad x")
        _close(ws.grad.full_tensor(), wr.grad, "grad w")


@scenario
def shard_map_own_specs_and_scalar_specs(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    x = _data(8, 3)
    xs = sf.distribute(x, P(a), mesh=mesh).requires_grad_()
    y = sf.shard_map(lambda t, k: t * k, mesh=mesh, out_specs=P(a))(xs, 2.0)
    y.full_tensor().sum().backward()
    _close(y.full_tensor(), 2 * x, "own specs")
    _close(xs.grad.full_tensor(), torch.full_like(x, 2.0), "own specs grad")
    with pytest.raises(sf.ShardingError, match=r"args\[1\] is a float"):
        sf.shard_map(lambda t, k: t, mesh=mesh, in_specs=(P(a), P(a)), out_specs=P(a))(xs, 2.0)
    with pytest.raises(sf.ShardingError, match=r"does not vary over"):
        sf.shard_map(lambda t: t, mesh=mesh, in_specs=P(), out_specs=P(partial=a))(xs)


@scenario(meshes=("2x2",))
def partial_manual_and_nested(mesh: sf.Mesh) -> None:
    for m in (8, 7):
        x, w = _data(m, 6), _data(6, 3, seed=1)
        xs = sf.distribute(x, P("x", "y"), mesh=mesh).requires_grad_()
        ws = sf.distribute(w, P("y", None), mesh=mesh).requires_grad_()

        def body(t, v):
            inner = sf.shard_map(lambda b: lax.psum(b.sum(1), "y"), in_specs=P(None, "y"), out_specs=P())
            return t @ v, lax.psum((t @ v).sum(0) + inner(t).sum(), "x")

        f = sf.shard_map(body, mesh=mesh, in_specs=(P("x", "y"), P("y", None)), out_specs=(P("x", "y"), P()),
                         axis_names={"x"})
        y, s = f(xs, ws)
        (y.full_tensor().sum() + s.full_tensor().pow(2).sum()).backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr = xr @ wr
        sr = yr.sum(0) + xr.sum()  # each x-device adds its own rows' sum; psum over x adds them up
        (yr.sum() + sr.pow(2).sum()).backward()
        _close(y.full_tensor(), yr.detach(), "partial-manual value")
        _close(s.full_tensor(), sr.detach(), "partial-manual psum")
        _close(xs.grad.full_tensor(), xr.grad, "partial-manual grad x")
        _close(ws.grad.full_tensor(), wr.grad, "partial-manual grad w")
        with pytest.raises(sf.ShardingError, match="axis 'y' is not manual"):
            sf.shard_map(lambda t: lax.psum(t, "y"), mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})(xs)


@scenario
def smap_pcast_all_gather_invariant(mesh: sf.Mesh) -> None:
    a = mesh.axis_names[0]
    n = mesh.axis_size(a)
    x = _data(8, 3)
    xs = x.clone().requires_grad_()
    y = sf.smap(lambda t: torch.tanh(t) * 2, axis_name=a, mesh=mesh)(xs)
    y.full_tensor().sum().backward()
    _close(y.full_tensor(), torch.tanh(x) * 2, "smap")
    _close(xs.grad, 2 * (1 - torch.tanh(x) ** 2), "smap grad")
    xr = sf.distribute(x, P(), mesh=mesh).requires_grad_()
    p = sf.shard_map(lambda t: lax.pcast(t, a), mesh=mesh, in_specs=P(), out_specs=P(partial=a))(xr)
    _close(p.full_tensor(), n * x, "pcast")
    p.full_tensor().sum().backward()
    _close(xr.grad.full_tensor(), torch.full_like(x, float(n)), "pcast grad")
    xg = x.clone().requires_grad_()
    g = sf.shard_map(lambda t: lax.all_gather_invariant(t, a, tiled=True) * 3, mesh=mesh, in_specs=P(a), out_specs=P())(xg)
    ct = _data(8, 3, seed=2)
    (g.full_tensor() * ct).sum().backward()
    _close(g.full_tensor(), 3 * x, "all_gather_invariant")
    _close(xg.grad, 3 * ct, "all_gather_invariant grad")
    perm = zip(range(n), [(i + 1) % n for i in range(n)])
    f = sf.shard_map(lambda t: lax.ppermute(t, a, perm), mesh=mesh, in_specs=P(a), out_specs=P(a))
    _close(f(x).full_tensor(), f(x).full_tensor(), "ppermute zip twice")
    _close(f(x).full_tensor(), torch.roll(x, 8 // n, 0), "ppermute zip")


@scenario(meshes=("2x2",))
def mesh_view_reshard_moves_nothing(mesh: sf.Mesh) -> None:
    flat = mesh.flatten(("x", "y"), "xy")
    for n in (8, 7):
        x = _data(n, 3)
        xs = sf.distribute(x, P(("x", "y")), mesh=mesh).requires_grad_()
        with sf.debug.CommCounter() as c:
            y = sf.reshard(xs, sf.NamedSharding(flat, P("xy")))
        assert c.total == 0, c
        assert y.mesh == flat and y.spec == P("xy")
        _close(y.full_tensor(), x, "flat view")
        (y.full_tensor() * 2).sum().backward()
        _close(xs.grad.full_tensor(), torch.full_like(x, 2.0), "flat view grad")
        z = sf.reshard(y, sf.NamedSharding(mesh, P("y")))
        _close(z.full_tensor(), x, "back with movement")


@scenario(meshes=("2x2",))
def mesh_view_reshard_uneven_and_shared_names(mesh: sf.Mesh) -> None:
    """6 over the flat 4 is 2, 2, 2, 0, nested over 2 then 2 it is 2, 1, 2, 1: the move is not a
    relabelling there; and a 4-device mesh that reuses the name 'x' is a view too."""
    flat = mesh.flatten(("x", "y"), "xy")
    other = sf.Mesh((4,), ("x",), backend=mesh.backend)
    x = _data(6, 3)
    xs = sf.distribute(x, P(("x", "y")), mesh=mesh).requires_grad_()
    for dst in (sf.NamedSharding(flat, P("xy")), sf.NamedSharding(other, P("x")), sf.NamedSharding(other, P(None, "x"))):
        y = sf.reshard(xs, dst)
        want = sf.distribute(x, dst)
        assert y._layout == want._layout
        _close(y.to_local(), want.to_local(), f"local shard on {dst}")
        _close(y.full_tensor(), x, f"value on {dst}")
    (sf.reshard(xs, sf.NamedSharding(other, P("x"))).full_tensor() * 3).sum().backward()
    _close(xs.grad.full_tensor(), torch.full_like(x, 3.0), "grad across meshes")


test_local, test_dist = collect(globals())
