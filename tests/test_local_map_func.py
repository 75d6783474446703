"""``local_map`` under torch.func transforms: a ShardedArray argument reaches it wrapped
(vmap's BatchedTensor, grad's GradTrackingTensor) and is read at that level, as shard_map
reads it. Oracle: the same function on plain tensors under the same transform."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn import P


@pytest.fixture
def mesh():
    return sf.Mesh((4,), ("x",), backend="local")


@pytest.mark.parametrize("cols", [8, 7, 3])  # even, uneven, fewer columns than devices
def test_vmap_over_a_sharded_argument(mesh, cols):
    x = torch.randn(3, cols)
    f = sf.local_map(lambda b: b.sin() * 2, out_specs=P("x"), in_specs=P("x"))
    out = torch.func.vmap(f)(sf.distribute(x, P(None, "x"), mesh=mesh))
    assert isinstance(out, sf.ShardedArray) and out.sharding.spec == P(None, "x")
    torch.testing.assert_close(out.full_tensor(), x.sin() * 2)


def test_vmap_with_in_dims_one(mesh):
    x = torch.randn(8, 3)
    f = sf.local_map(lambda b: b * 3, out_specs=P("x"), in_specs=P("x"))
    out = torch.func.vmap(f, in_dims=1)(sf.distribute(x, P("x"), mesh=mesh))
    torch.testing.assert_close(out.full_tensor(), (x * 3).T)


def test_vmap_checks_the_spec_at_its_level(mesh):
    f = sf.local_map(lambda b: b, out_specs=P("x"), in_specs=P(None, "x"))
    with pytest.raises(sf.ShardingError, match=r"has 2 entries but the tensor has rank 1"):
        torch.func.vmap(f)(sf.distribute(torch.randn(3, 8), P(None, "x"), mesh=mesh))
    g = sf.local_map(lambda b: b, out_specs=P("x"), in_specs=P(None))
    with pytest.raises(sf.ShardingError, match=r"laid out as P\('x'\) but in_specs asks for P\(\)"):
        torch.func.vmap(g)(sf.distribute(torch.randn(3, 8), P(None, "x"), mesh=mesh))


def test_grad_jvp_jacrev(mesh):
    x = torch.randn(3, 8, dtype=torch.float64)
    X = sf.distribute(x, P(None, "x"), mesh=mesh)
    f = sf.local_map(lambda b: b.sin() * b, out_specs=P(None, "x"), in_specs=P(None, "x"))
    plain = lambda a: a.sin() * a  # noqa: E731

    g = torch.func.grad(lambda a: f(a).sum())(X)
    assert g.sharding.spec == P(None, "x")
    torch.testing.assert_close(g.full_tensor(), torch.func.grad(lambda a: plain(a).sum())(x))

    out, tangent = torch.func.jvp(f, (X,), (X,))
    want_out, want_tangent = torch.func.jvp(plain, (x,), (x,))
    torch.testing.assert_close(out.full_tensor(), want_out)
    torch.testing.assert_close(tangent.full_tensor(), want_tangent)

    j = torch.func.jacrev(lambda a: f(a).sum())(X)
    torch.testing.assert_close(j.full_tensor(), torch.func.jacrev(lambda a: plain(a).sum())(x))


def test_vmap_of_a_plain_argument_with_a_spec(mesh):
    x = torch.randn(3, 8)
    f = sf.local_map(lambda b: b * 2, out_specs=P("x"), in_specs=P("x"), mesh=mesh)
    torch.testing.assert_close(torch.func.vmap(f)(x).full_tensor(), x * 2)
