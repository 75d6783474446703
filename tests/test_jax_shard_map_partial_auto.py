"""JAX's partial-auto shard_map tests (tests/shard_map_test.py, ``axis_names=``), ported:
with_sharding_constraint over the automatic axes inside the body, nested shard_maps over
the remaining axes, gradients, closures. shardfn's in_specs/out_specs are whole layouts (see
API.md), so where JAX keeps an automatic axis's sharding on the result, shardfn lays the
result out as its out_spec says: those tests check the values and the manual axes' layout."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P, lax


def _mesh(shape, names):
    return sf.Mesh(shape, names, backend="local")


V = torch.arange(32.0).reshape(4, 8)


def test_partial_auto():
    mesh = _mesh((2, 2), ("i", "j"))

    def g(x):
        assert isinstance(x, sf.ShardedArray) and x.mesh.axis_names == ("j",)
        x = sf.with_sharding_constraint(x, P(None, "j"))
        assert x.placements == (sf.Shard(1),)
        return x * x

    def f(x):
        x = sf.shard_map(g, mesh=mesh, in_specs=P("i", None), out_specs=P("i", None), axis_names=frozenset({"i"}))(x)
        return sf.with_sharding_constraint(x, sf.NamedSharding(mesh, P("i", "j")))

    out = f(sf.distribute(V, P("i", "j"), mesh=mesh))
    assert out.sharding == sf.NamedSharding(mesh, P("i", "j"))
    assert torch.equal(out.full_tensor(), V * V)


@pytest.mark.parametrize("grad", [False, True])
def test_partial_auto_explicit(grad):
    """in_specs=None: the body sees the argument's own layout over the automatic axes."""
    mesh = _mesh((2, 2), ("i", "j"))
    seen = []

    def g(x):
        out = x * x
        seen.extend([getattr(x, "spec", None), getattr(out, "spec", None)])  # under torch.func: whole values
        return out

    f = sf.shard_map(g, out_specs=P("i", None), axis_names=frozenset({"i"}))
    v = sf.distribute(V, P("i", "j"), mesh=mesh)
    out = f(v)
    assert set(seen) == {P(None, "j")}
    assert out.placements[0] == sf.Shard(0)
    assert torch.equal(out.full_tensor(), V * V)
    if grad:
        vr = v.detach().requires_grad_()
        f(vr).full_tensor().sum().backward()
        assert vr.grad.sharding == v.sharding
        assert torch.equal(vr.grad.full_tensor(), 2 * V)
        assert torch.equal(torch.func.grad(lambda t: sf.gather(f(sf.distribute(t, P("i", "j"), mesh=mesh))).sum())(V), 2 * V)


def test_partial_auto_explicit_multi_explicit():
    mesh = _mesh((2, 1, 2, 2), ("i", "j", "k", "l"))
    v = torch.arange(64.0).reshape(4, 2, 2, 4)
    seen = []

    def g(x):
        seen.append(x.spec)
        out = x.permute(3, 2, 1, 0)
        seen.append(out.spec)
        return out

    out = sf.shard_map(g, out_specs=P("i", "j", None, None), axis_names=frozenset({"i", "j"}))(
        sf.distribute(v, P("i", "j", "k", "l"), mesh=mesh))
    assert set(seen) == {P(None, None, "k", "l"), P("l", "k")}  # the two manual coordinates' runs interleave
    want = torch.cat([v[2 * i:2 * i + 2].permute(3, 2, 1, 0) for i in range(2)], 0)  # j has size 1
    assert torch.equal(out.full_tensor(), want)


def test_partial_auto_propagate_through():
    mesh = _mesh((2, 2, 2), ("i", "j", "k"))
    sharding = sf.NamedSharding(mesh, P("i"))
    out = sf.shard_map(lambda x: sf.with_sharding_constraint(x * x, sharding), mesh=mesh, in_specs=P(), out_specs=P(),
                       check_vma=False, axis_names=frozenset({"j", "k"}))(sf.distribute(V, sharding))
    assert torch.equal(out.full_tensor(), V * V)


def test_wsc_naming_a_manual_axis_is_an_error():
    """JAX's test_partial_auto_error_wsc_manual and test_partial_auto_error_invalid_auto."""
    mesh = _mesh((2, 2), ("i", "j"))
    v = sf.distribute(V, P("i", "j"), mesh=mesh)
    g = lambda x: sf.with_sharding_constraint(x, sf.NamedSharding(mesh, P("i", "j"))) * x  # noqa: E731
    for names in ({"i"}, {"i", "j"}):
        f = sf.shard_map(g, mesh=mesh, in_specs=P("i", None), out_specs=P("i", None), check_vma=False,
                         axis_names=frozenset(names))
        with pytest.raises(sf.ShardingError, match=r"names manual mesh axis 'i'.*only automatic axes"):
            f(v)


def test_shmap_close_over_unused_params():
    mesh = _mesh((2,), ("data",))
    arr = torch.arange(32.0).reshape(4, 8)
    params = arr.clone()

    def loss_fn(params, batch):
        return params.sum() + batch.sum()

    def grad_fn(batch):
        g, v = torch.func.grad_and_value(loss_fn)(params, batch)
        return g, v

    g, v = sf.shard_map(grad_fn, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)(arr)
    assert torch.equal(g.full_tensor(), torch.ones(4, 8))
    assert v.full_tensor() == params.sum() + arr[:2].sum()
    gs, vs = sf.shard_map(torch.func.vmap(grad_fn), mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                          check_vma=False)(arr)
    assert torch.equal(gs.full_tensor(), torch.ones(4, 4, 8))
    assert torch.equal(vs.full_tensor(), params.sum() + arr.sum(1))


def test_close_over_a_sharded_array():
    """JAX's test_close_over_input_explict_ctx_mesh: a body closing over a replicated array
    uses its whole value; the result is laid out as the out_spec says."""
    mesh = _mesh((2,), ("x",))
    w = sf.distribute(torch.full((2, 4), 2.0), P(), mesh=mesh)
    x = sf.distribute(torch.arange(16.0).reshape(4, 4), P("x"), mesh=mesh)

    def simple(w, x):
        return (w * x).sum(-1)

    want = (2 * torch.arange(16.0).reshape(4, 4)).sum(-1)
    out = sf.shard_map(simple, in_specs=(P(), P("x")), out_specs=P("x"))(w, x)
    assert out.spec == P("x") and torch.equal(out.full_tensor(), want)
    out = sf.shard_map(lambda xi: simple(w, xi), in_specs=P("x"), out_specs=P("x"))(x)
    assert out.spec == P("x") and torch.equal(out.full_tensor(), want)
    wr = w.detach().requires_grad_()
    sf.shard_map(lambda xi: simple(wr, xi), in_specs=P("x"), out_specs=P("x"))(x).full_tensor().sum().backward()
    assert torch.equal(wr.grad.full_tensor(), torch.arange(16.0).reshape(2, 2, 4).sum(0))


def _nested(power):
    inner_spec = P(None, "j")

    def h(x):
        return sf.shard_map(lambda t: t ** power, in_specs=inner_spec, out_specs=inner_spec)(x)
    return h


@pytest.mark.parametrize("power", [2, 3])
def test_nested_partial_auto_and_grads(power):
    """JAX's test_nested_partial_auto, test_grad_nested_partial_auto(_with_residuals)."""
    mesh = _mesh((2, 2), ("i", "j"))
    v = sf.distribute(V, P("i", "j"), mesh=mesh)
    f = sf.shard_map(_nested(power=power), mesh=mesh, in_specs=P("i", None), out_specs=P("i", None), check_vma=False,
                     axis_names=frozenset({"i"}))
    assert torch.equal(f(v).full_tensor(), V ** power)
    vr = v.detach().requires_grad_()
    f(vr).full_tensor().sum().backward()
    torch.testing.assert_close(vr.grad.full_tensor(), power * V ** (power - 1))
    g = torch.func.grad(lambda t: sf.gather(f(t)).sum())(V)
    torch.testing.assert_close(g, power * V ** (power - 1))


@pytest.mark.parametrize("dim1,dim2", [("x", "y"), (None, "y"), ("x", None), (None, None)])
def test_nested_partial_auto_1d(dim1, dim2):
    mesh = _mesh((2, 2, 2), ("x", "y", "z"))
    arr = sf.distribute(V, P(dim1, dim2), mesh=mesh)

    def g(x):
        return x * x

    def h(x):
        return sf.shard_map(g, in_specs=P(None, dim2), out_specs=P(None, dim2), axis_names={"y"})(x)

    out = sf.shard_map(h, in_specs=P(dim1, None), out_specs=P(dim1, None), axis_names={"x"})(arr)
    assert torch.equal(out.full_tensor(), V * V)


def test_axis_size_1_partial_auto():
    mesh = _mesh((1, 2, 2), ("i", "j", "k"))
    out = sf.shard_map(lambda x: x * x, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i", "k"})(
        sf.distribute(V, P(("i", "j"), "k"), mesh=mesh))
    assert torch.equal(out.full_tensor(), V * V)


def test_partial_auto_axis_index():
    mesh = _mesh((4, 2), ("i", "j"))
    out = sf.shard_map(lambda x: lax.axis_index("i").reshape(1, 1).expand(1, x.shape[1]).to(x.dtype) + 0 * x,
                       mesh=mesh, in_specs=P("i", None), out_specs=P("i", None), axis_names={"i"})(torch.zeros(4, 2))
    assert torch.equal(out.full_tensor(), torch.arange(4.0)[:, None].expand(4, 2))
    out = sf.shard_map(lambda: lax.axis_index("i").reshape(1), mesh=mesh, in_specs=(), out_specs=P("i"),
                       axis_names={"i"}, check_vma=False)()
    assert torch.equal(out.full_tensor(), torch.arange(4))


def test_partial_auto_ppermute():
    mesh = _mesh((4, 2), ("i", "j"))
    x = torch.arange(8.0)

    def g(x):
        return lax.ppermute(x, "i", [(0, 1), (1, 2), (2, 3), (3, 0)])

    out = sf.shard_map(g, mesh=mesh, in_specs=P("i"), out_specs=P("i"), axis_names={"i"})(x)
    assert torch.equal(out.full_tensor(), torch.roll(x, 2))
