"""shard_map in_specs=None, partial-manual axis_names=, nested shard_map, and the
out_spec partial= check: values and gradients against plain torch."""

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


@pytest.mark.parametrize("m,n", [(8, 6), (7, 5)])
def test_in_specs_none_takes_each_arrays_spec(mesh, m, n):
    x, w = torch.randn(m, n), torch.randn(n)
    xs = sf.distribute(x, P("dp", "tp"), mesh=mesh).requires_grad_()
    ws = sf.distribute(w, P("tp"), mesh=mesh).requires_grad_()
    seen = []

    def body(a, b):
        seen.append(tuple(a.shape))
        return lax.psum((a * b).sum(1), "tp")

    y = sf.shard_map(body, mesh=mesh, out_specs=P("dp"))(xs, ws)
    y.full_tensor().pow(2).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr * wr).sum(1).pow(2).sum().backward()
    _close(y.full_tensor(), (x * w).sum(1))
    _close(xs.grad.full_tensor(), xr.grad)
    _close(ws.grad.full_tensor(), wr.grad)
    assert seen[0][0] <= -(-m // 2) and seen[0][1] <= -(-n // 2)  # local shards, not whole values


def test_in_specs_none_plain_tensor_is_named(mesh):
    xs = sf.distribute(torch.randn(4, 4), P("dp"), mesh=mesh)
    f = sf.shard_map(lambda a, b: a, mesh=mesh, out_specs=P("dp"))
    with pytest.raises(sf.ShardingError, match=r"in_specs=None.*args\[1\]\['w'\] is a plain tensor"):
        f(xs, {"w": torch.ones(3)})


@pytest.mark.parametrize("m,n", [(8, 6), (7, 5)])
def test_partial_manual_values_and_grads(mesh, m, n):
    # float64: the gradient sums (1 + 2 * column sums) terms in another order than torch,
    # which in float32 can differ by more than 1e-5 (seed 1529 of randn: 3.9e-5 relative)
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w = torch.randn(m, n, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    xs = sf.distribute(x, P("dp", "tp"), mesh=mesh).requires_grad_()
    ws = sf.distribute(w, P("tp", None), mesh=mesh).requires_grad_()

    def body(a, b):  # manual over dp only: whole over tp, so a @ b needs no tp collective
        assert a.shape[1] == n and b.shape[0] == n
        return a @ b, lax.psum((a @ b).sum(0), "dp")

    f = sf.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)),
                     out_specs=(P("dp", "tp"), P()), axis_names={"dp"})
    y, s = f(xs, ws)
    assert y.spec == P("dp", "tp")
    (y.full_tensor().sum() + s.full_tensor().pow(2).sum()).backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = xr @ wr
    (yr.sum() + yr.sum(0).pow(2).sum()).backward()
    _close(y.full_tensor(), yr.detach())
    _close(s.full_tensor(), yr.sum(0).detach())
    _close(xs.grad.full_tensor(), xr.grad)
    _close(ws.grad.full_tensor(), wr.grad)


def test_collective_over_non_manual_axis_is_named(mesh):
    xs = sf.distribute(torch.randn(4, 4), P("dp", "tp"), mesh=mesh)
    f = sf.shard_map(lambda a: lax.psum(a, "tp"), mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp"),
                     axis_names={"dp"})
    with pytest.raises(sf.ShardingError, match=r"sf\.lax\.psum: axis 'tp' is not manual"):
        f(xs)


def test_bad_axis_names(mesh):
    xs = sf.distribute(torch.randn(4, 4), P("dp"), mesh=mesh)
    with pytest.raises(sf.ShardingError, match=r"axis_names names 'pp'"):
        sf.shard_map(lambda a: a, mesh=mesh, out_specs=P("dp"), axis_names={"pp"})(xs)


def test_partial_out_spec_over_non_manual_axis(mesh):
    xs = sf.distribute(torch.randn(4, 4), P("dp"), mesh=mesh)
    f = sf.shard_map(lambda a: a, mesh=mesh, in_specs=P("dp"), out_specs=P("dp", partial="tp"), axis_names={"dp"})
    with pytest.raises(sf.ShardingError, match=r"partial over 'tp'.*not a manual axis"):
        f(xs)


@pytest.mark.parametrize("m", [8, 7])
def test_partial_out_spec_over_invariant_axis(mesh, m):
    """JAX: an out_spec may not declare a pending sum over an axis the value does not vary over."""
    xs = sf.distribute(torch.randn(m, 4), P("dp"), mesh=mesh)
    f = sf.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("dp"), out_specs=P("dp", partial="tp"))
    with pytest.raises(sf.ShardingError, match=r"partial over mesh axis 'tp'.*does not vary over 'tp'"):
        f(xs)
    g = sf.shard_map(lambda a: a * lax.axis_index("tp"), mesh=mesh, in_specs=P("dp"), out_specs=P("dp", partial="tp"))
    _close(g(xs).full_tensor(), xs.full_tensor())  # varies over tp: 0*x + 1*x


def test_nested_shard_map_over_disjoint_axes(mesh):
    x = torch.randn(8, 6)
    xs = sf.distribute(x, P("dp", "tp"), mesh=mesh).requires_grad_()

    def outer(a):
        inner = sf.shard_map(lambda b: lax.psum((b * b).sum(1), "tp"), in_specs=P(None, "tp"), out_specs=P(),
                             axis_names={"tp"})
        return lax.pmax(inner(a), "dp") + inner(a)

    f = sf.shard_map(outer, mesh=mesh, in_specs=P("dp", None), out_specs=P("dp"), axis_names={"dp"})
    y = f(xs)
    y.full_tensor().sum().backward()
    xr = x.clone().requires_grad_()
    r = (xr * xr).sum(1).view(2, 4)
    want = (r.amax(0, keepdim=True) + r).reshape(8)
    want.sum().backward()
    _close(y.full_tensor(), want.detach())
    _close(xs.grad.full_tensor(), xr.grad)


def test_nested_over_outer_manual_axis_is_named(mesh):
    xs = sf.distribute(torch.randn(4, 4), P("dp"), mesh=mesh)

    def outer(a):
        return sf.shard_map(lambda b: b, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})(a)

    f = sf.shard_map(outer, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})
    with pytest.raises(sf.ShardingError, match=r"axis_names names 'dp', which the enclosing shard_map is already manual"):
        f(xs)


@pytest.mark.parametrize("m", [8, 7])
def test_specs_on_python_scalars_must_hold(mesh, m):
    xs = sf.distribute(torch.randn(m, 4), P("dp"), mesh=mesh)
    ok = sf.shard_map(lambda a, k: (a * k, 2.5), mesh=mesh, in_specs=(P("dp"), P()), out_specs=(P("dp"), P()))
    y, c = ok(xs, 3.0)
    assert c == 2.5
    torch.testing.assert_close(y.full_tensor(), xs.full_tensor() * 3)
    bad_in = sf.shard_map(lambda a, k: a * k, mesh=mesh, in_specs=(P("dp"), P("tp")), out_specs=P("dp"))
    with pytest.raises(sf.ShardingError, match=r"in_specs for args\[1\] is P\('tp'\), but args\[1\] is a float"):
        bad_in(xs, 3.0)
    bad_out = sf.shard_map(lambda a: (a, 1), mesh=mesh, in_specs=P("dp"), out_specs=(P("dp"), P(partial="tp")))
    with pytest.raises(sf.ShardingError, match=r"out_specs for output\[1\] is P\(partial='tp'\), but output\[1\] is a int"):
        bad_out(xs)


def test_partial_manual_body_propagates_over_the_automatic_axes(mesh):
    """Inside, values are sharded over 'tp' as in_specs say: a contraction over 'tp' is a
    pending sum that reshard reduces with one all_reduce over the 'tp' submesh."""
    x, w = sf.distribute(torch.randn(8, 6), P("dp", "tp"), mesh=mesh), sf.distribute(torch.randn(6, 4), P("tp"), mesh=mesh)
    specs = []

    def body(a, b):
        assert isinstance(a, sf.ShardedArray) and a.mesh.axis_names == ("tp",)
        y = sf.reshard(a @ b, P())
        specs.append((a.spec, (a @ b).spec))
        return y

    f = sf.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp"), axis_names={"dp"})
    with sf.debug.CommCounter() as c:
        out = f(x, w)
    # one run per 'dp' coordinate, on its devices' shards (no gather on entry or exit); the
    # sub-mesh all_reduce is one collective over the mesh, counted once
    assert dict(c.counts) == {"all_reduce": 1}
    assert specs == [(P(None, "tp"), P(partial="tp"))] * 2
    _close(out.full_tensor(), x.full_tensor() @ w.full_tensor())


_MESH_XY = sf.Mesh((2, 3), ("x", "y"), backend="local")
# module-level, as user code keeps them (Dynamo reads globals and closures differently)
_SM = sf.shard_map(lambda b: b.sin() * lax.axis_size("y"), mesh=_MESH_XY, in_specs=P(None, "y"), out_specs=P(None, "y"),
                   axis_names={"y"})
_SP = sf.smap(lambda b: b.cos(), in_axes=0, out_axes=0, axis_name="y", mesh=_MESH_XY)


def _manual_pair(v: torch.Tensor) -> torch.Tensor:
    return _SM(v) + _SP(v)


@pytest.mark.parametrize("dynamic", [False, True])
def test_partial_manual_shard_map_and_smap_under_compile(dynamic: bool) -> None:
    """A body run a thread per manual coordinate cannot be traced (the tracer's modes are
    per-thread): under torch.compile the call leaves the graph and runs eagerly, with the
    values and gradients of eager torch, also after a recompile for a new shape and layout."""
    torch._dynamo.reset()
    cf = torch.compile(_manual_pair, dynamic=dynamic, backend="aot_eager")
    for shape, spec in [((6, 6), P("x", None)), ((9, 12), P(None, None))]:
        t = torch.randn(*shape, dtype=torch.float64)
        x = sf.distribute(t, spec, mesh=_MESH_XY)
        torch.testing.assert_close(cf(x).full_tensor(), t.sin() * 3 + t.cos())  # no gradient
        t.requires_grad_()
        x = x.detach().requires_grad_()
        out, want = cf(x), t.sin() * 3 + t.cos()
        torch.testing.assert_close(out.full_tensor(), want)
        out.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(sf.gather(x.grad), t.grad)
    torch._dynamo.reset()
